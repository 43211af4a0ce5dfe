"""Run-time errors of a Communicator or AllReduce: the error word's codes and CommError.

Kernels (and the xla backend's host callback) record the first error of a communicator as
four int32 words `(code, stage, rank, detail)`; `Communicator.check()` raises it.
"""

from __future__ import annotations

import enum


# ErrorCode and Stage mirror ffi/protocol/dims.h (import jax_moe works without the native module);
# tests/test_protocol_enums.py checks them against the built module's protocol_enums().
class ErrorCode(enum.IntEnum):
  OK = 0
  INVALID_EXPERT_ID = 1   # detail: the offending id
  CAPACITY_OVERFLOW = 2   # detail: rows that needed a place
  TIMEOUT = 3             # detail: the peer rank waited for
  BAD_NUM_TOKENS = 4      # detail: the value given
  CALL_ORDER = 5          # detail: sends not yet received when the call came


class Stage(enum.IntEnum):
  NONE = 0
  DISPATCH_SEND = 1
  DISPATCH_RECV = 2
  COMBINE_SEND = 3
  COMBINE_RECV = 4
  ALL_REDUCE_ONE_SHOT = 5   # waiting for the peers' inputs
  ALL_REDUCE_SCATTER = 6    # two-shot: waiting for the peers' parts of this rank's segment
  ALL_REDUCE_GATHER = 7     # two-shot: waiting for the peers' reduced segments
  ALL_REDUCE_NVLS = 8       # multimem: waiting at one of its two barriers
  PROXY = 9                 # a GPU stream waiting for its host proxy (backends/cuda_proxy.py)


_HINTS = {
    ErrorCode.INVALID_EXPERT_ID: "topk_ids must hold -1 or an id in [0, num_experts)",
    ErrorCode.CAPACITY_OVERFLOW: "raise MoEConfig.max_recv_tokens (or leave it None)",
    ErrorCode.TIMEOUT: "a peer did not reach the same call; raise JAX_MOE_TIMEOUT_S if it is slow",
    ErrorCode.BAD_NUM_TOKENS: "num_tokens must be in [0, max_tokens]",
    ErrorCode.CALL_ORDER: ("a communicator's halves alternate (send, recv, send, ...); use "
                           "one communicator per batch in flight"),
}


def first_to_report(records):
  """Of the error records (code, stage, rank, detail) of several ranks (None: no error), the
  one check() raises: the lowest rank's, leaving out a TIMEOUT that waited on a rank which
  recorded an error of its own (it is that error's consequence: the rank it waited on was
  stuck too), unless nothing else is left. None when there is no error."""
  records = [r for r in records if r is not None]
  if not records:
    return None
  recorded = {r[2] for r in records}
  causes = [r for r in records
            if not (r[0] == ErrorCode.TIMEOUT and r[3] != r[2] and r[3] in recorded)]
  return min(causes or records, key=lambda r: r[2])


class CommError(RuntimeError):
  """A run-time failure recorded by a communicator (see ErrorCode)."""

  def __init__(self, code: int, stage: int, rank: int, detail: int):
    self.code = ErrorCode(code)
    self.stage = Stage(stage)
    self.rank = int(rank)
    self.detail = int(detail)
    super().__init__(f"{self.code.name} in {self.stage.name.lower()} on rank {self.rank} "
                     f"(detail {self.detail}): {_HINTS.get(self.code, '')}")
