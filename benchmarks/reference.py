"""Dense numpy references for the identity-expert exchange, and the checks against them.

The identity expert returns the dispatched row itself, dequantized and cast to bf16, so
rank-independent expectations follow from the inputs alone (docs/semantics.md):
  dispatch: rank d's segment of global expert g lists x rows of the slots routed to g,
            in (source rank, token, slot) order, then zero rows;
  combine:  out[t] = bf16( sum over valid k of w[t, k] * y[t] ),  y[t] = bf16(deq(q(x[t]))).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from benchmarks.problem import Inputs, Shape

BF16_HALF_ULP = 2.0 ** -8    # relative rounding error bound of one bf16 rounding
F32_SLACK = 2.0 ** -16       # generous room for f32 accumulation order over <= 64 terms
FP8_MAX = np.float32(448.0)
INV_FP8_MAX = np.float32(1.0 / 448.0)
AMAX_FLOOR = np.float32(1e-4)


def quantize_fp8(x: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
  """docs/semantics.md fp8: per block amax, scale = amax * f32(1/448), RNE to e4m3fn."""
  xb = x.astype(np.float32).reshape(x.shape[0], -1, block_size)
  amax = np.maximum(np.abs(xb).max(axis=-1), AMAX_FLOOR)
  scales = amax * INV_FP8_MAX
  scaled = xb * (FP8_MAX / amax)[..., None]
  q = np.clip(scaled, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
  return q.reshape(x.shape), scales.astype(np.float32)


def dequantize_fp8(q: np.ndarray, scales: np.ndarray) -> np.ndarray:
  qb = q.astype(np.float32).reshape(q.shape[0], scales.shape[1], -1)
  return (qb * scales[..., None]).reshape(q.shape)


@dataclasses.dataclass(frozen=True)
class Expected:
  """What every method must reproduce for one (inputs, dispatch dtype)."""
  rows: np.ndarray           # [N, H] dispatched row per token: fp8 codes or bf16
  scales: np.ndarray | None  # [N, H/bs] f32 (fp8 only)
  y: np.ndarray              # [N, H] bf16: the identity expert's output for the token
  combined: np.ndarray       # [N, H] f32 weighted sum (f64 sum, one f32 rounding)
  bound: np.ndarray          # [N, H] f32 sum_k |w| * |y|: the scale of rounding errors


def expected(shape: Shape, inputs: Inputs) -> Expected:
  if shape.fp8:
    rows, scales = quantize_fp8(inputs.x, shape.block_size)
    y = dequantize_fp8(rows, scales).astype(ml_dtypes.bfloat16)
  else:
    rows, scales, y = inputs.x, None, inputs.x
  valid = (inputs.topk_ids >= 0) & (inputs.topk_ids < shape.experts)
  # The identity expert gives every slot of a token the same row, so the sum over slots
  # is (sum of weights) * row. f32 storage keeps prefill-sized checks fast; its rounding
  # (2^-24 relative) is far inside F32_SLACK.
  w = np.where(valid, inputs.topk_weights, 0.0).astype(np.float64)
  y32 = y.astype(np.float32)
  return Expected(rows=rows, scales=scales, y=y,
                  combined=w.sum(axis=1).astype(np.float32)[:, None] * y32,
                  bound=np.abs(w).sum(axis=1).astype(np.float32)[:, None] * np.abs(y32))


def check_close(out, want, bound, roundings: int) -> dict:
  """|out - want| <= (roundings * bf16 half-ulp + f32 slack) * bound, element-wise.

  `roundings` is how many bf16 roundings the method applies to partial or final sums;
  each moves a value by at most a half ulp of something no larger than `bound`. Arrays
  may be numpy or (sharded) jax arrays; the comparison runs where they live, so
  prefill-sized outputs need not travel to the host.
  """
  rtol = roundings * BF16_HALF_ULP + F32_SLACK
  mismatches, worst = _close_stats(out, want, bound, np.float32(rtol))
  return {"passed": int(mismatches) == 0, "mismatches": int(mismatches),
          "max_err_over_tol": float(worst), "rtol": rtol}


@jax.jit
def _close_stats(out, want, bound, rtol):
  err = jnp.abs(out.astype(jnp.float32) - want)
  tol = rtol * bound
  bad = ~(err <= tol)  # NaN fails
  ratio = jnp.where(tol > 0, err / jnp.where(tol > 0, tol, 1.0), jnp.where(err > 0, jnp.inf, 0.0))
  return bad.sum(), ratio.max(initial=0.0)


def _bits(a: np.ndarray) -> np.ndarray:
  return np.asarray(a).view(np.uint8 if np.asarray(a).dtype.itemsize == 1 else np.uint16)


def check_dispatch(shape: Shape, inputs: Inputs, want: Expected, got: dict, capacity: int,
                   expert_padding: int) -> dict:
  """Compares every rank's dispatched buffers with the layout of docs/semantics.md, bit for bit:
  the rows inside the segments (a padding row zero), and the weights of every row (zero past
  the total); x and scales of rows past sum(group_sizes) are unspecified.

  `got` holds global arrays: x [R*cap, H], scales [R*cap, H/bs] or None, weights [R*cap],
  group_sizes [R*L], tokens_per_expert [R*L].
  """
  R, L, K, E = shape.ranks, shape.local_experts, shape.topk, shape.experts
  ids = inputs.topk_ids.reshape(-1)
  weights = inputs.topk_weights.reshape(-1)
  valid = (ids >= 0) & (ids < E)
  # A stable sort by expert keeps (source rank, token, slot) order inside each expert,
  # because the global slot index is (s*T + t)*K + k.
  order = np.argsort(np.where(valid, ids, E), kind="stable")
  counts = np.bincount(ids[valid], minlength=E)
  first = np.concatenate([[0], np.cumsum(counts)[:-1]])
  padded = (counts + expert_padding - 1) // expert_padding * expert_padding

  problems = []
  x = np.asarray(got["x"]).reshape(R, capacity, -1)
  w_got = np.asarray(got["weights"]).reshape(R, capacity)
  s_got = None if got.get("scales") is None else np.asarray(got["scales"]).reshape(R, capacity, -1)
  for name in ("group_sizes", "tokens_per_expert"):
    want_counts = padded if name == "group_sizes" else counts
    if not np.array_equal(np.asarray(got[name]).reshape(-1), want_counts):
      problems.append(f"{name} differs")
  for d in range(R):
    slot_of_row = np.full(capacity, -1, np.int64)
    start = 0
    for g in range(d * L, (d + 1) * L):
      n = min(int(counts[g]), max(capacity - start, 0))
      slot_of_row[start:start + n] = order[first[g]:first[g] + n]
      start += int(padded[g])
    filled = slot_of_row >= 0
    padding = ~filled & (np.arange(capacity) < start)  # inside a segment, no slot
    token = np.where(filled, slot_of_row // K, 0)
    if not np.array_equal(_bits(x[d][filled]), _bits(want.rows[token[filled]])):
      problems.append(f"rank {d}: x rows differ")
    if np.any(x[d][padding].astype(np.float32) != 0):
      problems.append(f"rank {d}: padding x rows are not zero")
    want_w = np.where(filled, weights[np.maximum(slot_of_row, 0)], 0.0).astype(np.float32)
    if not np.array_equal(w_got[d], want_w):
      problems.append(f"rank {d}: weights differ")
    if want.scales is not None:
      want_s = np.where(filled[:, None], want.scales[token], 0.0).astype(np.float32)
      specified = filled | padding
      if s_got is None or not np.array_equal(s_got[d][specified], want_s[specified]):
        problems.append(f"rank {d}: scales differ")
  return {"passed": not problems, "problems": problems[:8]}
