"""Dense numpy reference for dispatch and combine, written from docs/semantics.md.

Everything here follows the spec text, not any backend's code: the tests use it as the
independent check of every backend. Arrays carry a leading rank axis: `[R, ...]` is
"one entry per rank of the expert-parallel axis".
"""

import dataclasses

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)

FP8_MAX = np.float32(448.0)
AMAX_FLOOR = np.float32(1e-4)
# The f32 constant nearest 1/448; the spec multiplies by it instead of dividing by 448.
INV_FP8_MAX = np.float32(1.0 / 448.0)

F32_EPS = np.float32(2.0**-24)  # unit roundoff of f32


# ---------------------------------------------------------------------------- fp8


def quantize_fp8(x, block_size):
    """(q, scales) per block of `block_size` along the last axis, all in f32."""
    x32 = np.asarray(x).astype(np.float32)
    *lead, hidden = x32.shape
    if hidden % block_size:
        raise ValueError(f"hidden {hidden} is not a multiple of block_size {block_size}")
    blocks = x32.reshape(*lead, hidden // block_size, block_size)
    amax = np.maximum(np.abs(blocks).max(axis=-1), AMAX_FLOOR)  # keeps NaN
    scales = amax * INV_FP8_MAX
    with np.errstate(invalid="ignore", divide="ignore"):
        factor = FP8_MAX / amax
    with np.errstate(invalid="ignore", divide="ignore"):  # non-finite blocks: NaN codes
        scaled = np.clip(blocks * factor[..., None], -FP8_MAX, FP8_MAX)
    scaled = np.where(np.isnan(scaled), np.float32(np.nan), scaled)  # the one NaN code 0x7f
    q = scaled.astype(FP8)  # ml_dtypes rounds to nearest even
    assert scales.dtype == np.float32 and scaled.dtype == np.float32
    return q.reshape(*lead, hidden), scales


def dequantize_fp8(q, scales, dtype=np.float32):
    """f32(q) * scale per block, then cast to `dtype`."""
    q32 = np.asarray(q).astype(np.float32)
    scales = np.asarray(scales, dtype=np.float32)
    *lead, hidden = q32.shape
    blocks = q32.reshape(*lead, scales.shape[-1], hidden // scales.shape[-1])
    return (blocks * scales[..., None]).reshape(*lead, hidden).astype(dtype)


# ---------------------------------------------------------------------------- routing


@dataclasses.dataclass(frozen=True)
class Geometry:
    num_experts: int
    axis_size: int
    max_tokens: int
    experts_per_token: int
    hidden: int
    expert_padding: int = 1
    max_recv_tokens: int | None = None

    @property
    def local_experts(self):
        return self.num_experts // self.axis_size

    @property
    def default_capacity(self):
        return (self.axis_size * self.max_tokens * min(self.experts_per_token, self.local_experts)
                + self.local_experts * (self.expert_padding - 1))

    @property
    def capacity(self):
        return self.default_capacity if self.max_recv_tokens is None else self.max_recv_tokens


@dataclasses.dataclass(frozen=True)
class Routing:
    topk_ids: np.ndarray  # [R, T, K] int32; -1 unused, other out-of-range ids invalid
    topk_weights: np.ndarray  # [R, T, K] f32
    num_tokens: np.ndarray  # [R] int32


def valid_slots(geometry, routing):
    """[R, T, K] bool: t < num_tokens and the id names an expert."""
    ids = routing.topk_ids
    token_index = np.arange(geometry.max_tokens)[None, :, None]
    sent = token_index < routing.num_tokens[:, None, None]
    return sent & (ids >= 0) & (ids < geometry.num_experts)


def invalid_ids(geometry, routing):
    """(rank, token, slot, id) of every id that is neither -1 nor an expert, in rank order."""
    ids = routing.topk_ids
    token_index = np.arange(geometry.max_tokens)[None, :, None]
    sent = token_index < routing.num_tokens[:, None, None]
    bad = sent & ((ids < -1) | (ids >= geometry.num_experts))
    return [(int(s), int(t), int(k), int(ids[s, t, k])) for s, t, k in zip(*np.nonzero(bad))]


# ---------------------------------------------------------------------------- dispatch


@dataclasses.dataclass
class RankDispatch:
    """What one receiving rank must hold after dispatch."""

    x: np.ndarray  # [capacity, H] bf16 rows or fp8 codes
    scales: np.ndarray | None  # [capacity, H // block_size] f32
    weights: np.ndarray  # [capacity] f32
    group_sizes: np.ndarray  # [L] int32, padded counts
    tokens_per_expert: np.ndarray  # [L] int32, real counts
    rows_needed: int  # sum(group_sizes); more than capacity means overflow

    @property
    def overflow(self):
        return self.rows_needed > self.x.shape[0]


@dataclasses.dataclass
class DispatchReference:
    ranks: list  # RankDispatch per receiving rank
    row_of: np.ndarray  # [R, T, K] row on the expert's rank; -1 for invalid or dropped slots


def dispatch_reference(geometry, routing, x_rows, scales=None):
    """Expected Dispatched of every rank.

    x_rows: [R, T, H] what travels per source token (bf16 rows, or fp8 codes);
    scales: [R, T, H // block_size] f32 with fp8 codes, else None.
    """
    g = geometry
    L, cap = g.local_experts, g.capacity
    valid = valid_slots(g, routing)
    row_of = np.full(routing.topk_ids.shape, -1, dtype=np.int64)
    ranks = []
    for dest in range(g.axis_size):
        x = np.zeros((cap, g.hidden), dtype=x_rows.dtype)
        sc = None if scales is None else np.zeros((cap, scales.shape[-1]), dtype=np.float32)
        weights = np.zeros(cap, dtype=np.float32)
        tokens_per_expert = np.zeros(L, dtype=np.int32)
        group_sizes = np.zeros(L, dtype=np.int32)
        start = 0
        for local in range(L):
            expert = dest * L + local
            # np.nonzero walks C order: (source rank, token, slot) ascending, the segment order.
            sources, tokens, slots = np.nonzero(valid & (routing.topk_ids == expert))
            count = len(sources)
            tokens_per_expert[local] = count
            group_sizes[local] = -(-count // g.expert_padding) * g.expert_padding
            for i, (s, t, k) in enumerate(zip(sources, tokens, slots)):
                row = start + i
                if row >= cap:  # overflow: dropped, every other row keeps its place
                    continue
                row_of[s, t, k] = row
                x[row] = x_rows[s, t]
                if sc is not None:
                    sc[row] = scales[s, t]
                weights[row] = routing.topk_weights[s, t, k]
            start += int(group_sizes[local])
        ranks.append(RankDispatch(x, sc, weights, group_sizes, tokens_per_expert, start))
    return DispatchReference(ranks, row_of)


# ---------------------------------------------------------------------------- combine


@dataclasses.dataclass
class CombineReference:
    out: np.ndarray  # [R, T, H] bf16
    term_magnitude: np.ndarray  # [R, T, H] f32, sum of |w * y| over the summed terms
    partial_rounding: np.ndarray  # [R, T, H] f32, sum over partials of one bf16 ulp (0 for f32)


def combine_reference(geometry, routing, dispatch, y, reduce="source", partial_dtype=np.float32):
    """Combine output per source rank for expert outputs `y` [R, capacity, H] (combine dtype)."""
    g = geometry
    L = g.local_experts
    partial_dtype = np.dtype(partial_dtype)
    shape = (g.axis_size, g.max_tokens, g.hidden)
    out = np.zeros(shape, dtype=BF16)
    magnitude = np.zeros(shape, dtype=np.float32)
    partial_rounding = np.zeros(shape, dtype=np.float32)
    for s in range(g.axis_size):
        for t in range(g.max_tokens):
            slots = [k for k in range(g.experts_per_token) if dispatch.row_of[s, t, k] >= 0]

            def term(k):
                dest = routing.topk_ids[s, t, k] // L
                row = y[dest, dispatch.row_of[s, t, k]].astype(np.float32)
                return routing.topk_weights[s, t, k] * row

            acc = np.zeros(g.hidden, dtype=np.float32)
            if reduce == "source":
                for k in slots:
                    acc = acc + term(k)
                    magnitude[s, t] += np.abs(term(k))
            elif reduce == "expert":
                for dest in range(g.axis_size):
                    on_dest = [k for k in slots if routing.topk_ids[s, t, k] // L == dest]
                    if not on_dest:
                        continue
                    partial = np.zeros(g.hidden, dtype=np.float32)
                    for k in on_dest:
                        partial = partial + term(k)
                        magnitude[s, t] += np.abs(term(k))
                    rounded = partial.astype(partial_dtype).astype(np.float32)
                    if partial_dtype != np.float32:
                        partial_rounding[s, t] += bf16_ulp(rounded)
                    acc = acc + rounded
            else:
                raise ValueError(f"reduce must be 'source' or 'expert', got {reduce!r}")
            out[s, t] = acc.astype(BF16)
    return CombineReference(out, magnitude, partial_rounding)


def dense_moe_reference(geometry, routing, x, expert_fn):
    """out[t] = bf16(sum over valid k, in k order, of w[t,k] * expert_fn(id, x[t])) in f32.

    x: [R, T, H] f32 token activations as the experts see them; expert_fn(expert, row) -> f32 row.
    Knows nothing of the dispatched layout; rows dropped by overflow are not modelled.
    """
    g = geometry
    valid = valid_slots(g, routing)
    shape = (g.axis_size, g.max_tokens, g.hidden)
    out = np.zeros(shape, dtype=BF16)
    magnitude = np.zeros(shape, dtype=np.float32)
    for s, t in np.ndindex(g.axis_size, g.max_tokens):
        acc = np.zeros(g.hidden, dtype=np.float32)
        for k in range(g.experts_per_token):
            if valid[s, t, k]:
                term = routing.topk_weights[s, t, k] * expert_fn(int(routing.topk_ids[s, t, k]), x[s, t])
                acc = acc + term
                magnitude[s, t] += np.abs(term)
        out[s, t] = acc.astype(BF16)
    return out, magnitude


def scaled_by_expert(expert, row):
    """The tests' expert function: bf16(row * (expert + 1)), returned as f32."""
    return (row.astype(np.float32) * np.float32(expert + 1)).astype(BF16).astype(np.float32)


# ---------------------------------------------------------------------------- tolerances


def bf16_ulp(values):
    """Spacing of bf16 numbers at |values| (8 significant bits; subnormal spacing 2**-133)."""
    v = np.abs(np.asarray(values, dtype=np.float32))
    _, exponent = np.frexp(v)  # v = m * 2**exponent, m in [0.5, 1)
    normal = v >= np.float32(2.0**-126)
    return np.where(normal, np.ldexp(np.float32(1.0), exponent - 8), np.float32(2.0**-133)).astype(np.float32)


def combine_tolerance(actual, expected, term_magnitude, summands, extra=0.0):
    """Allowed |actual - expected| for a bf16 result of an f32 sum.

    One bf16 ulp (the final rounding may land on either neighbour when the f32 sums differ
    in their last bits), plus the f32 error bound of a sum of `summands` terms in another
    order, which only matters under cancellation, plus `extra` (e.g. partial roundings).
    """
    a = np.asarray(actual).astype(np.float32)
    e = np.asarray(expected).astype(np.float32)
    ulp = bf16_ulp(np.maximum(np.abs(a), np.abs(e)))
    return ulp + summands * F32_EPS * term_magnitude + extra
