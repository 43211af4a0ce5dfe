"""What every native backend's rank states share (cuda, its host proxies, host, AllReduce).

A communicator has one native rank state per device of its mesh axis on this process, named
by (comm id, device key). The comm id is a per-process counter, so every process must build
its communicators in the same order; ranks in other processes meet through the jax.distributed
key-value store under keys that carry it.
"""

from __future__ import annotations

import itertools
from typing import Callable

import jax

from jax_moe.errors import first_to_report

_comm_ids = itertools.count(1)
# How long a rank waits for its peers to publish their handles in the key-value store: process
# start-up and device setup of the peers come first, so much longer than one exchange.
KV_TIMEOUT_MS = 120_000


def distributed_client(owner: str):
  """The jax.distributed key-value client; ranks in other processes exchange handles through it.

  jax has no public accessor for it, so this reaches into jax._src and says so when that moves.
  """
  try:
    from jax._src import distributed
    client = distributed.global_state.client
  except (ImportError, AttributeError) as e:
    raise ValueError(f"{owner}: cannot reach jax.distributed's key-value store in jax "
                     f"{jax.__version__} ({e}); ranks spanning processes need it") from e
  if client is None:
    raise ValueError(f"{owner}: ranks span processes; call jax.distributed.initialize() first")
  return client


class RankStates:
  """The native rank states of one communicator on this process's devices: a communicator id
  unique in the process, the devices holding a rank, the error check and the teardown.

  `take_error(comm_id, ordinal)` and `destroy(comm_id, ordinal)` are the native module's
  bindings for the platform (cuda_* or host_*).
  """

  def __init__(self, take_error: Callable, destroy: Callable):
    self.comm_id = next(_comm_ids)
    self.ordinals: list[int] = []  # local devices holding a rank of this communicator
    self._take_error = take_error
    self._destroy = destroy

  def check(self):
    """The local ranks' error to report (errors.first_to_report) as (code, stage, rank,
    detail); every rank's record is cleared."""
    return first_to_report([self._take_error(self.comm_id, o) for o in self.ordinals])

  def close(self) -> None:
    while self.ordinals:
      self._destroy(self.comm_id, self.ordinals.pop())
