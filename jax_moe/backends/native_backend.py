"""What the native backends (`cuda`, `host`) share above their FFI calls.

Both run the same FFI targets with the same arguments and results (the handlers of ffi/cuda/
and ffi/host/ share one argument order), keep one rank state per local device of the mesh, and
differ in how the states are made and connected (`_make_ranks`, `_create_rank`) and how a call
is emitted (`_call`: a plain FFI call on GPUs, an ordered one on CPUs). The FFI targets and
their argument order are those of ffi/exchange_handlers.h.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe import native, settings
from jax_moe.config import MoEConfig
from jax_moe.sharding import axis_size
from jax_moe.types import Dispatched


class NativeHandle(NamedTuple):
  """What combine needs, produced by dispatch; valid for one combine."""
  slot_rows: jax.Array     # [R, T, K] int32 row here of slot (s, t, k); -1 not here, -2 dropped
  row_weights: jax.Array   # [capacity] f32 router weight of each dispatched row
  send_dest: jax.Array     # [T, K] int32 rank holding this rank's slot (t, k), -1 if not routed
  topk_weights: jax.Array  # [T, K] f32 this rank's router weights


class NativeDispatchPending(NamedTuple):
  send_dest: jax.Array     # [T, K] int32, also orders dispatch_recv after dispatch_send
  topk_weights: jax.Array


class NativeCombinePending(NamedTuple):
  done: jax.Array          # [1] int32 marker that orders combine_recv after combine_send
  send_dest: jax.Array
  topk_weights: jax.Array


def moe_dims(cfg: MoEConfig, world: int, rank: int = 0):
  """The native layout's sizes of one rank (ffi/protocol/dims.h MoeDims, bound as
  jax_moe._native.MoeDims): the one place a MoEConfig becomes what the *_create_rank and
  buffer_bytes bindings take. Every field is set by its C++ name."""
  fields = dict(world=world, rank=rank, max_tokens=cfg.max_tokens, hidden=cfg.hidden,
                topk=cfg.experts_per_token, num_experts=cfg.num_experts,
                local_experts=cfg.num_local_experts(world), block_size=cfg.block_size,
                expert_padding=cfg.expert_padding, capacity=cfg.capacity(world),
                fp8=int(cfg.is_fp8), reduce_expert=int(cfg.combine_reduce == "expert"),
                partial_bf16=int(cfg.partial_dtype == np.dtype(jnp.bfloat16)))
  dims = native.load().MoeDims()
  for name, value in fields.items():
    setattr(dims, name, int(value))  # an unknown name raises: the struct has no other fields
  return dims


class NativeBackend:
  """Subclasses set `name` and provide `_make_ranks(mesh, axis)` (a RankStates with comm_id,
  check and close, whose rank states take their sizes from `_rank_sizes`) and
  `_call(target, result_types, *args)`."""

  name: str

  def __init__(self, cfg: MoEConfig, mesh, axis: str):
    self.cfg = cfg
    self.R = axis_size(mesh, axis)
    self.L = cfg.num_local_experts(self.R)
    self.capacity = cfg.capacity(self.R)
    self._timeout_s = settings.timeout_s()
    self._ranks = self._make_ranks(mesh, axis)
    self.comm_id = self._ranks.comm_id

  def _rank_sizes(self, rank: int) -> dict:
    """One rank's dims and timeout, as the *_create_rank bindings take them."""
    return dict(dims=moe_dims(self.cfg, self.R, rank), timeout_s=self._timeout_s)

  # ---------------------------------------------------------------- lifecycle
  def check(self):
    """The local ranks' error to report (errors.first_to_report); clears them all."""
    return self._ranks.check()

  def close(self) -> None:
    self._ranks.close()

  # ---------------------------------------------------------------- FFI calls
  def _token_args(self, x):
    """(x, x_scales): fp8 codes with their scales, or bf16 rows with the empty f32 [0]."""
    if isinstance(x, tuple):
      return x
    return x, jnp.zeros((0,), jnp.float32)

  def _send_dest_type(self):
    return jax.ShapeDtypeStruct((self.cfg.max_tokens, self.cfg.experts_per_token), jnp.int32)

  def _recv_types(self):
    cfg, C = self.cfg, self.capacity
    scales = (C, cfg.num_scale_blocks) if cfg.is_fp8 else (0,)
    return (jax.ShapeDtypeStruct((C, cfg.hidden), cfg.dispatch_dtype),
            jax.ShapeDtypeStruct(scales, jnp.float32),
            jax.ShapeDtypeStruct((C,), jnp.float32),
            jax.ShapeDtypeStruct((self.L,), jnp.int32),
            jax.ShapeDtypeStruct((self.L,), jnp.int32),
            jax.ShapeDtypeStruct((self.R, cfg.max_tokens, cfg.experts_per_token), jnp.int32))

  def _dispatched(self, recv_outputs, send_dest, topk_weights):
    x, scales, weights, group_sizes, tokens_per_expert, slot_rows = recv_outputs
    handle = NativeHandle(slot_rows=slot_rows, row_weights=weights, send_dest=send_dest,
                        topk_weights=topk_weights)
    return Dispatched(x=x, scales=scales if self.cfg.is_fp8 else None, weights=weights,
                      group_sizes=group_sizes, tokens_per_expert=tokens_per_expert,
                      handle=handle)

  # ---------------------------------------------------------------- dispatch
  def dispatch_send(self, x, topk_ids, topk_weights, num_tokens) -> NativeDispatchPending:
    send_dest = self._call("jax_moe_dispatch_send", self._send_dest_type(),
                           *self._token_args(x), topk_ids, topk_weights, num_tokens)
    return NativeDispatchPending(send_dest, topk_weights)

  def dispatch_recv(self, p: NativeDispatchPending):
    outputs = self._call("jax_moe_dispatch_recv", self._recv_types(), p.send_dest)
    return self._dispatched(outputs, p.send_dest, p.topk_weights)

  def dispatch(self, x, topk_ids, topk_weights, num_tokens):
    send_dest, *outputs = self._call("jax_moe_dispatch",
                                     (self._send_dest_type(),) + self._recv_types(),
                                     *self._token_args(x), topk_ids, topk_weights, num_tokens)
    return self._dispatched(outputs, send_dest, topk_weights)

  # ---------------------------------------------------------------- combine
  def _out_type(self):
    return jax.ShapeDtypeStruct((self.cfg.max_tokens, self.cfg.hidden), jnp.bfloat16)

  def combine_send(self, y, handle: NativeHandle) -> NativeCombinePending:
    done = self._call("jax_moe_combine_send", jax.ShapeDtypeStruct((1,), jnp.int32),
                      y, handle.slot_rows, handle.row_weights)
    return NativeCombinePending(done, handle.send_dest, handle.topk_weights)

  def combine_recv(self, q: NativeCombinePending):
    return self._call("jax_moe_combine_recv", self._out_type(), q.done, q.send_dest,
                      q.topk_weights)

  def combine(self, y, handle: NativeHandle):
    out, _ = self._call("jax_moe_combine",
                        (self._out_type(), jax.ShapeDtypeStruct((1,), jnp.int32)),
                        y, handle.slot_rows, handle.row_weights, handle.send_dest,
                        handle.topk_weights)
    return out
