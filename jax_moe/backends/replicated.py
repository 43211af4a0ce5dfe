"""The replicated-input mode: every rank of the expert-parallel group holds every token.

Dispatch needs no communication: each rank selects, from all the tokens, the slots of its own
experts into the dispatched layout (docs/semantics.md: one source, rows in (t, k) order).
Combine forms each rank's partial sums (expert mode) and sums them over the group in rank
order, so every rank gets every output. It runs in JAX on every platform: the xla backend's
layout code with a single source, a rank exchanging only with itself.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_moe.backends.xla import XlaBackend
from jax_moe.config import MoEConfig
from jax_moe.errors import ErrorCode, Stage


class ReplicatedBackend(XlaBackend):
  name = "replicated"

  def __init__(self, cfg: MoEConfig, mesh, axis):
    super().__init__(cfg, mesh, axis)
    self.global_experts = cfg.num_experts
    self.group_ranks = self.R
    self.local_experts = local = cfg.num_local_experts(self.R)
    # This rank's exchange is one of a single rank (itself) over all E expert ids, of which
    # only [0, L) occur (the local experts, shifted); its outputs keep the first L segments.
    self.R, self.L = 1, cfg.num_experts
    default = cfg.max_tokens * min(cfg.experts_per_token, local) + local * (cfg.expert_padding - 1)
    if cfg.max_recv_tokens is not None and cfg.max_recv_tokens > default:
      raise ValueError(f"MoEConfig.max_recv_tokens ({cfg.max_recv_tokens}) must be <= the "
                       f"worst-case receive count {default} of the replicated-input mode")
    self.capacity = cfg.max_recv_tokens or default
    self.wire_rows = cfg.max_tokens * min(cfg.experts_per_token, local)

  def _all_to_all(self, v: jax.Array) -> jax.Array:
    return v  # one rank: its own blocks

  def _local_ids(self, topk_ids, num_tokens):
    """Slots of this rank's experts as local ids, -1 elsewhere; invalid ids recorded here
    (with the id given), since the local exchange sees only its own experts."""
    T = topk_ids.shape[0]
    E, L = self.global_experts, self.local_experts
    live = (jnp.arange(T) < jnp.clip(num_tokens.reshape(()), 0, T))[:, None]
    bad = live & ((topk_ids >= E) | (topk_ids < -1))
    self._report([(jnp.any(bad), ErrorCode.INVALID_EXPERT_ID, Stage.DISPATCH_SEND,
                   topk_ids.reshape(-1)[jnp.argmax(bad.reshape(-1))])])
    first = jax.lax.axis_index(self.axis) * L
    here = (topk_ids >= first) & (topk_ids < first + L)
    return jnp.where(here, topk_ids - first, -1).astype(jnp.int32)

  def dispatch_send(self, x, topk_ids, topk_weights, num_tokens):
    pending = super().dispatch_send(x, self._local_ids(topk_ids, num_tokens), topk_weights,
                                    num_tokens)
    return pending, self._holders(topk_ids, num_tokens)

  def _holders(self, topk_ids, num_tokens):
    """[T, K] rank holding slot (t, k) (every rank computes it: the routing is replicated),
    -1 for slots that are not routed or tokens past num_tokens."""
    T = topk_ids.shape[0]
    live = (jnp.arange(T) < jnp.clip(num_tokens.reshape(()), 0, T))[:, None]
    valid = live & (topk_ids >= 0) & (topk_ids < self.global_experts)
    return jnp.where(valid, topk_ids // self.local_experts, -1).astype(jnp.int32)

  def dispatch_recv(self, p):
    pending, holders = p
    r = super().dispatch_recv(pending)
    L = self.local_experts
    return r._replace(group_sizes=r.group_sizes[:L], tokens_per_expert=r.tokens_per_expert[:L],
                      handle=(r.handle, holders))

  def dispatch(self, x, topk_ids, topk_weights, num_tokens):
    return self.dispatch_recv(self.dispatch_send(x, topk_ids, topk_weights, num_tokens))

  def combine_send(self, y, handle):
    inner, holders = handle
    return super().combine_send(y, inner), holders

  def combine_recv(self, q):
    """out[t] = bf16(sum over the ranks holding a slot of t, in rank order, of f32(p_d[t]))."""
    pending, holders = q
    partials = jax.lax.all_gather(pending.recv[0], self.axis)  # [R, T, H] partial dtype
    acc = jnp.zeros(partials.shape[1:], jnp.float32)
    for d in range(self.group_ranks):
      has = jnp.any(holders == d, axis=1)
      acc = acc + jnp.where(has[:, None], partials[d].astype(jnp.float32), 0.0)
    return acc.astype(self.cfg.combine_dtype)

  def combine(self, y, handle):
    return self.combine_recv(self.combine_send(y, handle))
