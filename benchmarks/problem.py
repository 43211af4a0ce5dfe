"""One MoE exchange to benchmark: its shape, random inputs and routing, and its traffic."""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

ROUTINGS = ("uniform", "skewed")


@dataclasses.dataclass(frozen=True)
class Shape:
  """Static sizes of one exchange. Per rank: `tokens` tokens of `hidden` features, each
  routed to `topk` of `experts` experts; rank d owns experts [d*L, (d+1)*L)."""
  ranks: int
  tokens: int
  hidden: int
  experts: int
  topk: int
  fp8: bool
  block_size: int

  def __post_init__(self):
    if self.experts % self.ranks:
      raise ValueError(f"--experts ({self.experts}) must be divisible by the number of ranks "
                       f"({self.ranks})")
    if self.topk > self.experts:
      raise ValueError(f"--topk ({self.topk}) must be <= --experts ({self.experts})")
    if self.fp8 and self.hidden % self.block_size:
      raise ValueError(f"--hidden ({self.hidden}) must be a multiple of --block-size "
                       f"({self.block_size}) for fp8 dispatch")

  @property
  def local_experts(self) -> int:
    return self.experts // self.ranks

  @property
  def slots_per_dest(self) -> int:
    """Most (token, slot) rows one rank can route to one destination: T * min(K, L)."""
    return self.tokens * min(self.topk, self.local_experts)

  @property
  def scale_blocks(self) -> int:
    return self.hidden // self.block_size

  @property
  def row_bytes(self) -> int:
    """Bytes of one dispatched token row: fp8 codes plus f32 scales, or bf16."""
    if self.fp8:
      return self.hidden + 4 * self.scale_blocks
    return 2 * self.hidden

  @property
  def combine_row_bytes(self) -> int:
    return 2 * self.hidden  # bf16


@dataclasses.dataclass(frozen=True)
class Inputs:
  """Every rank's inputs stacked along tokens: rank s owns rows [s*T, (s+1)*T)."""
  x: np.ndarray             # [R*T, H] bfloat16
  topk_ids: np.ndarray      # [R*T, K] int32
  topk_weights: np.ndarray  # [R*T, K] float32


def make_inputs(shape: Shape, routing: str, seed: int) -> Inputs:
  """Random tokens and top-k routing from a softmax over random router logits.

  The weights are the top-k probabilities, not renormalised: their per-token sums differ
  and stay below 1, so a combine that mixes up or ignores weights cannot match the
  reference by accident (as a mean would if every sum were 1). With
  routing="skewed" expert popularity follows Zipf(1) over a random order of the experts:
  log(popularity) is added to the logits, so a few experts (and their ranks) get most rows.
  """
  if routing not in ROUTINGS:
    raise ValueError(f"--routing must be one of {ROUTINGS}, got {routing!r}")
  rng = np.random.default_rng(seed)
  n = shape.ranks * shape.tokens
  x = rng.standard_normal((n, shape.hidden), dtype=np.float32).astype(ml_dtypes.bfloat16)
  logits = rng.standard_normal((n, shape.experts), dtype=np.float32)
  if routing == "skewed":
    popularity = 1.0 / (1.0 + rng.permutation(shape.experts))
    logits += np.log(popularity / popularity.sum()).astype(np.float32)
  probs = np.exp(logits - logits.max(axis=1, keepdims=True))
  probs /= probs.sum(axis=1, keepdims=True)
  # Highest first; argsort of the negation keeps the lower id first on ties.
  ids = np.argsort(-probs, axis=1, kind="stable")[:, :shape.topk].astype(np.int32)
  weights = np.take_along_axis(probs, ids, axis=1).astype(np.float32)
  return Inputs(x=x, topk_ids=ids, topk_weights=weights)


@dataclasses.dataclass(frozen=True)
class Traffic:
  """Routing statistics that set how many bytes an exchange must move (mean per rank)."""
  remote_slots: float   # valid (token, slot) pairs whose expert lives on another rank
  remote_pairs: float   # distinct (token, other rank) pairs: rows if a token crosses a link once
  max_remote_slots: int  # the busiest rank's remote_slots (load imbalance)


def traffic(shape: Shape, inputs: Inputs) -> Traffic:
  R, T = shape.ranks, shape.tokens
  ids = inputs.topk_ids.reshape(R, T, shape.topk)
  dest = np.where(ids >= 0, ids // shape.local_experts, -1)
  source = np.arange(R)[:, None, None]
  remote = (dest >= 0) & (dest != source)
  per_rank_slots = remote.sum(axis=(1, 2))
  # touched[s, t, d]: token t of rank s has at least one slot on rank d != s
  touched = np.zeros((R, T, R), bool)
  s_idx, t_idx, k_idx = np.nonzero(remote)
  touched[s_idx, t_idx, dest[s_idx, t_idx, k_idx]] = True
  return Traffic(remote_slots=float(per_rank_slots.mean()),
                 remote_pairs=float(touched.sum(axis=(1, 2)).mean()),
                 max_remote_slots=int(per_rank_slots.max()))
