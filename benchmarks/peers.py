"""The same MoE exchange written with plain JAX collectives, as baselines for jax_moe.

Each builder returns a per-shard function `exchange(x, topk_ids, topk_weights) -> out` for use
inside shard_map over `axis`: x [T, H] bf16 or, for fp8 dispatch, a pre-quantized (q, scales)
pair as jax_moe's dispatch accepts it; topk_ids [T, K] int32, topk_weights [T, K] f32;
out [T, H] bf16 = sum over valid k of w[t, k] * expert(x[t]), where the expert is the identity
(the dispatched row dequantized and cast to bf16), so only the exchange costs time. With fp8
dispatch the rows travel as e4m3 codes (bit-cast to uint8 for the collectives) plus f32 scales,
the same bytes as jax_moe's fp8 dispatch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import jax_moe as jm
from benchmarks.problem import Shape


def _wire_rows(shape: Shape, x) -> tuple[jax.Array, jax.Array | None]:
  """Token rows as they travel: (uint8 fp8 codes, f32 scales), or (bf16 rows, None)."""
  if not shape.fp8:
    return x, None
  q, scales = x if isinstance(x, tuple) else jm.quantize_fp8(x, shape.block_size)
  return jax.lax.bitcast_convert_type(q, jnp.uint8), scales


# implementation of jm.dequantize_fp8 in every method's identity expert: "auto" (the CUDA
# kernel on a GPU, jm.dequantize_fp8's default) or "xla" (XLA's fusion);
# bench_dispatch_combine.py and profile_kernels.py --identity-dequantize
IDENTITY_DEQUANTIZE_CHOICES = ("auto", "xla")
IDENTITY_DEQUANTIZE = "auto"


def identity_expert(rows: jax.Array, scales: jax.Array | None) -> jax.Array:
  """The expert output of received rows: dequantized, bf16. Zero rows stay zero. Behind
  optimization barriers: a real expert is a grouped GEMM that XLA cannot fuse into the
  exchange's gathers or scatters, so neither may this stand-in. The one identity of every
  method (methods.identity_expert too)."""
  rows, scales = jax.lax.optimization_barrier((rows, scales))
  if scales is None:
    return jax.lax.optimization_barrier(rows.astype(jnp.bfloat16))
  q = rows if rows.dtype == jnp.float8_e4m3fn else jax.lax.bitcast_convert_type(
      rows, jnp.float8_e4m3fn)
  return jax.lax.optimization_barrier(
      jm.dequantize_fp8(q, scales, jnp.bfloat16, implementation=IDENTITY_DEQUANTIZE))


def _valid(shape: Shape, topk_ids: jax.Array) -> jax.Array:
  return (topk_ids >= 0) & (topk_ids < shape.experts)


def _weighted_sum_by_slot(shape: Shape, rows_back: jax.Array, row_of_slot: jax.Array,
                          valid: jax.Array, topk_weights: jax.Array) -> jax.Array:
  """out[t] = bf16(sum_k w[t,k] * f32(rows_back[row_of_slot[t,k]])), in k order, f32."""
  acc = jnp.zeros((shape.tokens, shape.hidden), jnp.float32)
  for k in range(shape.topk):
    row = rows_back[jnp.where(valid[:, k], row_of_slot[:, k], 0)].astype(jnp.float32)
    acc = acc + jnp.where(valid[:, k, None], topk_weights[:, k, None] * row, 0.0)
  return acc.astype(jnp.bfloat16)


def _local_experts_psum_scatter(shape: Shape, axis: str, rows, scales, topk_ids,
                                topk_weights) -> jax.Array:
  """Given every rank's tokens (wire rows, routing), this rank's experts applied to every
  token, weighted by the router weights of the slots it owns, psum_scattered: [T, H]."""
  mine = _valid(shape, topk_ids) & (topk_ids // shape.local_experts == jax.lax.axis_index(axis))
  local_weight = jnp.where(mine, topk_weights, 0.0).sum(axis=1)           # [R*T] f32
  y = identity_expert(rows, scales).astype(jnp.float32)
  partial = (local_weight[:, None] * y).astype(jnp.bfloat16)              # [R*T, H]
  return jax.lax.psum_scatter(partial, axis, scatter_dimension=0, tiled=True)


def all_gather_psum_scatter(shape: Shape, axis: str):
  """Every rank gathers all tokens and routing, applies its local experts to every token
  (weighted by the router weights of the slots it owns) and psum_scatters the partial
  outputs back. Moves (R-1)*T rows each way per rank whatever the routing."""

  def exchange(x, topk_ids, topk_weights):
    rows, scales = _wire_rows(shape, x)
    gather = lambda a: jax.lax.all_gather(a, axis, tiled=True)
    return _local_experts_psum_scatter(shape, axis, gather(rows),
                                       None if scales is None else gather(scales),
                                       gather(topk_ids), gather(topk_weights))

  return exchange


def _slot_positions(shape: Shape, topk_ids: jax.Array):
  """Destination rank and padded-buffer position of every slot.

  Rank d's buffer from this rank has C = T*min(K, L) rows; slot (t, k) takes row
  t*min(K, L) + (number of earlier slots of token t with the same destination), so a
  position needs no prefix sum over tokens.
  """
  T, K, L = shape.tokens, shape.topk, shape.local_experts
  valid = _valid(shape, topk_ids)
  dest = jnp.where(valid, topk_ids // L, -1)
  earlier = jnp.tril(jnp.ones((K, K), bool), k=-1)                       # [k, k'] k' < k
  same = (dest[:, :, None] == dest[:, None, :]) & valid[:, None, :] & earlier[None]
  position = jnp.arange(T, dtype=jnp.int32)[:, None] * min(K, L) + same.sum(axis=2)
  return valid, dest, position.astype(jnp.int32)


def padded_all_to_all(shape: Shape, axis: str):
  """One fixed-size buffer of T*min(K, L) rows per destination, exchanged with all_to_all;
  the expert rank returns every row to the same position and the source sums in k order.
  Moves (R-1)*T*min(K, L) rows each way per rank whatever the routing."""
  R, T, K, C = shape.ranks, shape.tokens, shape.topk, shape.slots_per_dest

  def exchange(x, topk_ids, topk_weights):
    valid, dest, position = _slot_positions(shape, topk_ids)
    flat = jnp.where(valid, dest * C + position, R * C).reshape(-1)       # [T*K] wire row
    token = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[:, None], (T, K)).reshape(-1)
    token_of_row = jnp.full((R * C,), -1, jnp.int32).at[flat].set(token, mode="drop")
    rows, scales = _wire_rows(shape, x)

    def pack(a):  # [T, ...] token rows -> [R*C, ...] per-destination buffers, zero padding
      picked = a[jnp.maximum(token_of_row, 0)]
      mask = (token_of_row >= 0).reshape((-1,) + (1,) * (a.ndim - 1))
      return jnp.where(mask, picked, jnp.zeros((), a.dtype))

    a2a = lambda a: jax.lax.all_to_all(a, axis, 0, 0, tiled=True)
    received = a2a(pack(rows))
    received_scales = None if scales is None else a2a(pack(scales))
    back = a2a(identity_expert(received, received_scales))               # same positions
    return _weighted_sum_by_slot(shape, back, flat.reshape(T, K), valid, topk_weights)

  return exchange


def ragged_all_to_all(shape: Shape, axis: str):
  """Slots sorted by destination and sent with ragged_all_to_all, after an all_gather of the
  per-destination counts gives every rank its receive offsets (MaxText style). The receive
  buffer has the worst-case R*T*min(K, L) rows; only routed rows move. Combine mirrors it.
  XLA:CPU does not implement ragged_all_to_all."""
  R, T, K = shape.ranks, shape.tokens, shape.topk
  capacity = R * shape.slots_per_dest

  def exchange(x, topk_ids, topk_weights):
    rank = jax.lax.axis_index(axis)
    valid = _valid(shape, topk_ids)
    dest = jnp.where(valid, topk_ids // shape.local_experts, R).reshape(-1)
    order = jnp.argsort(dest, stable=True).astype(jnp.int32)              # sorted slot -> slot
    send_sizes = jnp.zeros((R + 1,), jnp.int32).at[dest].add(1)[:R]
    counts = jax.lax.all_gather(send_sizes, axis)                         # [src, dst]
    exclusive = lambda a, ax: jnp.cumsum(a, axis=ax) - a
    input_offsets = exclusive(send_sizes, 0)
    output_offsets = exclusive(counts, 0)[rank]    # where my rows start on each destination
    recv_sizes = counts[:, rank]
    recv_offsets = exclusive(recv_sizes, 0)
    back_offsets = exclusive(counts, 1)[:, rank]   # where rank s keeps its rows for me

    rows, scales = _wire_rows(shape, x)

    def send(a):  # token rows in destination order -> rows from every source, by source
      sorted_rows = a[order // K]
      out = jnp.zeros((capacity,) + a.shape[1:], a.dtype)
      return jax.lax.ragged_all_to_all(sorted_rows, out, input_offsets, send_sizes,
                                       output_offsets, recv_sizes, axis_name=axis)

    received = send(rows)
    received_scales = None if scales is None else send(scales)
    y = identity_expert(received, received_scales)
    back = jax.lax.ragged_all_to_all(
        y, jnp.zeros((T * K, shape.hidden), jnp.bfloat16), recv_offsets, recv_sizes,
        back_offsets, send_sizes, axis_name=axis)                         # in sorted order
    sorted_position = jnp.zeros((T * K,), jnp.int32).at[order].set(
        jnp.arange(T * K, dtype=jnp.int32))
    return _weighted_sum_by_slot(shape, back, sorted_position.reshape(T, K), valid, topk_weights)

  return exchange


def replicated_psum_scatter(shape: Shape, axis: str):
  """all_gather_psum_scatter for tokens every rank already holds (x, ids, weights of all R*T
  tokens): what a JAX user writes for replicated-input prefill; moves (R-1)*T rows per rank."""

  def exchange(x, topk_ids, topk_weights):
    rows, scales = _wire_rows(shape, x)
    return _local_experts_psum_scatter(shape, axis, rows, scales, topk_ids, topk_weights)

  return exchange


PEERS = {
    "all_gather": all_gather_psum_scatter,
    "replicated_psum_scatter": replicated_psum_scatter,
    "all_to_all": padded_all_to_all,
    "ragged_all_to_all": ragged_all_to_all,
}
