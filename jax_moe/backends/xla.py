"""The `xla` backend: dispatch/combine with pure JAX collectives (all_to_all).

This is the reference semantics of docs/semantics.md and runs on every JAX platform
(`ragged_all_to_all` would save padding but does not run on XLA:CPU). Every method runs
inside `jax.shard_map` over the communicator's axis, on per-shard arrays.

Wire format of one dispatch (per source rank, C = max_tokens * min(K, L) rows per peer):
  send_x      [R, C, H]    token rows for peer d, ordered by (local expert, token, slot)
  send_scales [R, C, H/bs] fp8 scales of those rows (fp8 dispatch only)
  send_meta   [R, C, 3]    (token index, slot k, weight bits) of each row
  send_counts [R, L]       rows for each of peer d's local experts
Each row sits at the same position on the way back in `source` combine, so the source
finds slot (t, k)'s result at (dest[t, k], pos[t, k]).
"""

from __future__ import annotations

import threading
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe.config import MoEConfig
from jax_moe.sharding import axis_size
from jax_moe.types import Dispatched
from jax_moe.errors import ErrorCode, Stage, first_to_report
from jax_moe.quantization import quantize_fp8


class XlaHandle(NamedTuple):
  """What combine needs, produced by dispatch; valid for one combine."""
  dest: jax.Array          # [T, K] int32 rank that holds slot (t, k), R if the slot is not routed
  pos: jax.Array           # [T, K] int32 position of the slot's row in the wire buffer for dest
  slot_weights: jax.Array  # [T, K] f32 router weights, 0 on slots that are not routed
  recv_rows: jax.Array     # [R, C] int32 dispatched row of each received wire row, -1 if none
  slot_rows: jax.Array     # [R, T, K] int32 dispatched row of (source, token, slot), -1 if none
  row_weights: jax.Array   # [capacity] f32 router weight of each dispatched row


class XlaDispatchPending(NamedTuple):
  recv_x: jax.Array        # [R, C, H] rows from each source (fp8 as uint8 bits)
  recv_scales: jax.Array | None
  recv_meta: jax.Array     # [R, C, 3] int32
  recv_counts: jax.Array   # [R, L] int32
  dest: jax.Array
  pos: jax.Array
  slot_weights: jax.Array


class XlaCombinePending(NamedTuple):
  recv: jax.Array          # source: [R, C, H] rows back; expert: [R, T, H] partials
  handle: XlaHandle


def _exclusive_cumsum(x: jax.Array, axis: int = 0) -> jax.Array:
  return jnp.cumsum(x, axis=axis) - x


def _first_error(candidates) -> jax.Array:
  """The first (code, stage, detail) whose condition holds, as int32 [3]; zeros if none."""
  err = jnp.zeros((3,), jnp.int32)
  for cond, code, stage, detail in reversed(candidates):
    err = jnp.where(cond, jnp.stack([jnp.int32(code), jnp.int32(stage),
                                     jnp.asarray(detail, jnp.int32)]), err)
  return err


class ErrorWord:
  """Host-side error records (code, stage, rank, detail): each rank's first error wins, and
  take() returns the one errors.first_to_report picks (the host and cuda backends' rule),
  clearing them all."""

  def __init__(self):
    self._lock = threading.Lock()
    self._by_rank: dict[int, tuple[int, int, int, int]] = {}

  def record(self, err, rank) -> None:
    err = np.asarray(err).reshape(-1)
    if int(err[0]) == ErrorCode.OK:
      return
    rank = int(np.asarray(rank).reshape(()))
    with self._lock:
      self._by_rank.setdefault(rank, (int(err[0]), int(err[1]), rank, int(err[2])))

  def take(self) -> tuple[int, int, int, int] | None:
    with self._lock:
      by_rank, self._by_rank = self._by_rank, {}
    return first_to_report(by_rank.values())


class XlaBackend:
  name = "xla"

  def __init__(self, cfg: MoEConfig, mesh, axis: str):
    self.cfg = cfg
    self.axis = axis
    self.R = axis_size(mesh, axis)
    self.L = cfg.num_local_experts(self.R)
    self.capacity = cfg.capacity(self.R)
    self.wire_rows = cfg.max_tokens * min(cfg.experts_per_token, self.L)
    self.errors = ErrorWord()

  # ---------------------------------------------------------------- errors
  def _report(self, candidates) -> None:
    """Records the first failing condition of this shard in the host error word.

    The callback only runs when there is an error, so the common path costs no host
    round trip.
    """
    err = _first_error(candidates)
    rank = jax.lax.axis_index(self.axis)
    jax.lax.cond(err[0] != 0,
                 lambda e, r: jax.debug.callback(self.errors.record, e, r),
                 lambda e, r: None, err, rank)

  def check(self):
    return self.errors.take()

  def _all_to_all(self, v: jax.Array) -> jax.Array:
    """[R, ...] blocks, block d to rank d (backends/replicated.py exchanges with itself)."""
    return jax.lax.all_to_all(v, self.axis, 0, 0)

  def close(self) -> None:
    pass

  # ---------------------------------------------------------------- dispatch
  def dispatch_send(self, x, topk_ids, topk_weights, num_tokens) -> XlaDispatchPending:
    cfg, R, L, C = self.cfg, self.R, self.L, self.wire_rows
    T, K = topk_ids.shape
    E = cfg.num_experts

    n_given = num_tokens.reshape(())
    n = jnp.clip(n_given, 0, T)
    live = (jnp.arange(T) < n)[:, None]
    bad_ids = live & ((topk_ids >= E) | (topk_ids < -1))
    valid = live & (topk_ids >= 0) & (topk_ids < E)

    # Wire position of every slot: a stable sort by global expert id orders the slots by
    # (dest rank, local expert, token, slot); subtracting the dest's first rank gives the
    # position inside that dest's wire buffer.
    key = jnp.where(valid, topk_ids, E).reshape(-1)
    order = jnp.argsort(key, stable=True)
    sorted_rank = jnp.zeros_like(order).at[order].set(jnp.arange(order.size, dtype=order.dtype))
    dest = jnp.where(valid, topk_ids // L, R)
    per_dest = jnp.zeros((R + 1,), jnp.int32).at[dest.reshape(-1)].add(1)[:R]
    dest_start = jnp.concatenate([_exclusive_cumsum(per_dest), jnp.zeros((1,), jnp.int32)])
    pos = jnp.where(valid, sorted_rank.reshape(T, K) - dest_start[dest], -1).astype(jnp.int32)
    counts = jnp.zeros((E + 1,), jnp.int32).at[key].add(1)[:E].reshape(R, L)

    fits = valid & (pos < C)

    if isinstance(x, tuple):
      q, scales = x
    elif cfg.is_fp8:
      q, scales = quantize_fp8(x, cfg.block_size)
    else:
      q, scales = x, None
    if cfg.is_fp8:
      q = jax.lax.bitcast_convert_type(q, jnp.uint8)

    # Wire row (d, i) holds sorted slot dest_start[d] + i; rows are gathered, not scattered
    # (row scatters are slow on GPU). Rows past a dest's count, or past C, stay zero.
    i = jnp.arange(C, dtype=jnp.int32)
    wire_used = i[None, :] < per_dest[:, None]                              # [R, C]
    wire_slot = order[jnp.minimum(dest_start[:R, None] + i[None, :], T * K - 1)]
    wire_token = wire_slot // K

    def pack(rows):  # [T, ...] token rows -> [R, C, ...] wire buffers
      picked = rows[wire_token]
      return jnp.where(wire_used.reshape(wire_used.shape + (1,) * (rows.ndim - 1)), picked,
                       jnp.zeros((), rows.dtype))

    slot_weights = jnp.where(valid, topk_weights, 0.0).astype(jnp.float32)
    wire_meta = jnp.where(wire_used[..., None], jnp.stack([
        wire_token, wire_slot % K,
        jax.lax.bitcast_convert_type(slot_weights.reshape(-1)[wire_slot], jnp.int32),
    ], axis=-1), 0)

    self._report([
        (n_given != n, ErrorCode.BAD_NUM_TOKENS, Stage.DISPATCH_SEND, n_given),
        (jnp.any(bad_ids), ErrorCode.INVALID_EXPERT_ID, Stage.DISPATCH_SEND,
         topk_ids.reshape(-1)[jnp.argmax(bad_ids.reshape(-1))]),
        (jnp.any(valid & ~fits), ErrorCode.CAPACITY_OVERFLOW, Stage.DISPATCH_SEND,
         jnp.max(per_dest)),
    ])

    a2a = self._all_to_all
    return XlaDispatchPending(
        recv_x=a2a(pack(q)),
        recv_scales=None if scales is None else a2a(pack(scales.astype(jnp.float32))),
        recv_meta=a2a(wire_meta),
        recv_counts=a2a(counts),
        dest=dest.astype(jnp.int32), pos=pos, slot_weights=slot_weights)

  def dispatch_recv(self, p: XlaDispatchPending):
    cfg, R, L, C, cap = self.cfg, self.R, self.L, self.wire_rows, self.capacity
    T, K = cfg.max_tokens, cfg.experts_per_token

    counts = p.recv_counts                        # [R sources, L]
    tokens_per_expert = counts.sum(axis=0)
    pad = cfg.expert_padding
    group_sizes = (tokens_per_expert + pad - 1) // pad * pad
    seg_start = _exclusive_cumsum(group_sizes)
    src_start = _exclusive_cumsum(counts, axis=0)  # [R, L] offset of source s inside segment e

    # Dispatched row j of segment e, at offset o = j - seg_start[e], comes from the source s
    # whose run covers o and sits at wire row (cum - counts)[s, e] + o - src_start[s, e].
    # Rows past `cap` do not exist, so overflowing rows are never placed.
    cum = jnp.cumsum(counts, axis=1)
    j = jnp.arange(cap, dtype=jnp.int32)
    # compare_all: one vectorised comparison; the default binary search is a while loop, which
    # XLA:GPU steps from the host.
    e_j = jnp.minimum(jnp.searchsorted(jnp.cumsum(group_sizes), j, side="right",
                                       method="compare_all"), L - 1)
    o_j = j - seg_start[e_j]
    real = o_j < tokens_per_expert[e_j]
    s_j = jnp.minimum(jnp.sum(o_j[None, :] >= (src_start + counts)[:, e_j], axis=0), R - 1)
    i_j = (cum - counts)[s_j, e_j] + o_j - src_start[s_j, e_j]
    wire_j = jnp.where(real, s_j * C + jnp.clip(i_j, 0, C - 1), 0)

    # The inverse map, wire row -> dispatched row (-1: not placed), for the way back.
    recv_rows = jnp.full((R * C,), -1, jnp.int32).at[jnp.where(real, wire_j, R * C)].set(
        j, mode="drop").reshape(R, C)
    placed = recv_rows >= 0

    def place(wire):  # [R, C, ...] -> [cap, ...], zeros on padding and past the total
      rows = wire.reshape((R * C,) + wire.shape[2:])[wire_j]
      return jnp.where(real.reshape(real.shape + (1,) * (wire.ndim - 2)), rows,
                       jnp.zeros((), wire.dtype))

    x = place(p.recv_x)
    if cfg.is_fp8:
      x = jax.lax.bitcast_convert_type(x, jnp.float8_e4m3fn)
    scales = None if p.recv_scales is None else place(p.recv_scales)
    weights = jax.lax.bitcast_convert_type(place(p.recv_meta[..., 2]), jnp.float32)

    # (source, token, slot) -> dispatched row, for the expert-side partial sums of combine.
    tok, slot = p.recv_meta[..., 0], p.recv_meta[..., 1]
    sources = jnp.arange(R)[:, None]
    flat_slot = jnp.where(placed, (sources * T + tok) * K + slot, R * T * K).reshape(-1)
    slot_rows = jnp.full((R * T * K,), -1, jnp.int32).at[flat_slot].set(
        recv_rows.reshape(-1), mode="drop").reshape(R, T, K)

    total = group_sizes.sum()
    self._report([(total > cap, ErrorCode.CAPACITY_OVERFLOW, Stage.DISPATCH_RECV, total)])
    handle = XlaHandle(dest=p.dest, pos=p.pos, slot_weights=p.slot_weights,
                       recv_rows=recv_rows, slot_rows=slot_rows, row_weights=weights)
    return Dispatched(x=x, scales=scales, weights=weights, group_sizes=group_sizes,
                      tokens_per_expert=tokens_per_expert, handle=handle)

  # ---------------------------------------------------------------- combine
  def combine_send(self, y, handle: XlaHandle) -> XlaCombinePending:
    cfg = self.cfg
    a2a = self._all_to_all
    if cfg.combine_reduce == "source":
      rows = handle.recv_rows
      back = jnp.where((rows >= 0)[..., None], y[jnp.maximum(rows, 0)], 0).astype(y.dtype)
      return XlaCombinePending(recv=a2a(back), handle=handle)
    # expert: per (source, token) the weighted rows that live here, summed in k order in f32.
    rows = handle.slot_rows                              # [R, T, K]
    row_weights = handle.row_weights[jnp.maximum(rows, 0)]  # [R, T, K]
    partial = jnp.zeros(rows.shape[:2] + (y.shape[1],), jnp.float32)
    for k in range(cfg.experts_per_token):
      r_k = rows[..., k]
      contrib = row_weights[..., k, None] * y[jnp.maximum(r_k, 0)].astype(jnp.float32)
      partial = partial + jnp.where((r_k >= 0)[..., None], contrib, 0.0)
    return XlaCombinePending(recv=a2a(partial.astype(cfg.partial_dtype)), handle=handle)

  def combine_recv(self, q: XlaCombinePending):
    cfg, R = self.cfg, self.R
    h = q.handle
    T, K = h.dest.shape
    acc = jnp.zeros((T, cfg.hidden), jnp.float32)
    if cfg.combine_reduce == "source":
      for k in range(K):
        d, p = h.dest[:, k], h.pos[:, k]
        ok = (p >= 0) & (p < self.wire_rows)
        row = q.recv[jnp.minimum(d, R - 1), jnp.clip(p, 0, self.wire_rows - 1)]
        acc = acc + jnp.where(ok[:, None], h.slot_weights[:, k, None] * row.astype(jnp.float32),
                              0.0)
    else:
      for d in range(R):
        has = jnp.any(h.dest == d, axis=1)
        acc = acc + jnp.where(has[:, None], q.recv[d].astype(jnp.float32), 0.0)
    return acc.astype(cfg.combine_dtype)

  # ---------------------------------------------------------------- fused
  def dispatch(self, x, topk_ids, topk_weights, num_tokens):
    return self.dispatch_recv(self.dispatch_send(x, topk_ids, topk_weights, num_tokens))

  def combine(self, y, handle: XlaHandle):
    return self.combine_recv(self.combine_send(y, handle))
