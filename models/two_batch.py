"""Two-batch overlap: the batch as two micro-batches, one's layers running while the other's
dispatch is in flight.

Each micro-batch runs every layer as a generator (`layer.steps`, stages.pre_norm_residual):
a MoE block sends its dispatch (dispatch_send), yields the pending half, and on resuming
receives it (dispatch_recv), runs the experts and the combine, and goes on into the next
layer. `interleave` resumes the micro-batches in turn, so between one's dispatch_send and its
dispatch_recv run the other's receive, experts, combine, next attention and next send: across
hosts the rows travel while the GPU computes (what DeepEP's users get from SGLang's two-batch
overlap). Optimization barriers over every pending half pin that order: a micro-batch resumes
only with values tied to the other's latest send, so XLA cannot move its receive ahead.

Each micro-batch holds half of every shard's sequences (`split`: a shard's rows are not moved
between devices), its own communicators (CommunicatorPool slots 0 and 1: separate buffers and
call orders) and its half of the KV cache; `merge` puts the outputs and caches back in the
batch's order. The logits are the one-batch model's up to the halves' own roundings (attention
and the grouped GEMMs see half the rows). A batch splits when every shard holds an even
number of sequences (`splits`); otherwise the model runs it as one batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_moe.models.sharding import ShardingRules

MICRO_BATCHES = 2


def _shards(rules: ShardingRules, batch: int) -> int:
  """Devices the batch is split over (1 when it is replicated)."""
  return rules.axis_size if rules.is_sharded(batch, "batch") else 1


def splits(rules: ShardingRules, batch: int) -> bool:
  """Whether a batch of `batch` sequences splits into two micro-batches sharded as it is."""
  shards = _shards(rules, batch)
  return (batch % (MICRO_BATCHES * shards) == 0 and
          _shards(rules, batch // MICRO_BATCHES) == shards)


def split(rules: ShardingRules, tree, i: int):
  """Micro-batch i of every batch-first array in `tree`: the i-th half of each shard's rows,
  sharded over the batch as the batch was."""
  def half(a):
    shards, batch = _shards(rules, a.shape[0]), a.shape[0]
    per_shard = a.reshape(shards, MICRO_BATCHES, batch // (MICRO_BATCHES * shards),
                          *a.shape[1:])
    out = per_shard[:, i].reshape(batch // MICRO_BATCHES, *a.shape[1:])
    return rules.constrain(out, "batch", *([None] * (a.ndim - 1)))
  return jax.tree.map(half, tree)


def merge(rules: ShardingRules, first, second):
  """The inverse of split: the two micro-batches' batch-first arrays back in batch order."""
  def join(a, b):
    shards = _shards(rules, 2 * a.shape[0])
    per_shard = [v.reshape(shards, 1, a.shape[0] // shards, *a.shape[1:]) for v in (a, b)]
    out = jnp.concatenate(per_shard, axis=1).reshape(2 * a.shape[0], *a.shape[1:])
    return rules.constrain(out, "batch", *([None] * (a.ndim - 1)))
  return jax.tree.map(join, first, second)


def interleave(steps: list):
  """Runs the generators `steps` in turn to their ends, each up to its next yield (a pending
  dispatch), and returns their results. After each yield every pending half goes through one
  optimization barrier, so none is resumed (received) before the latest send of the others."""
  pending = [None] * len(steps)
  results = [None] * len(steps)
  live = list(range(len(steps)))
  while live:
    for i in list(live):
      try:
        pending[i] = steps[i].send(pending[i])
      except StopIteration as done:
        results[i] = done.value
        pending[i] = None
        live.remove(i)
        continue
      waiting = [j for j in live if pending[j] is not None]
      tied = jax.lax.optimization_barrier(tuple(pending[j] for j in waiting))
      for j, value in zip(waiting, tied):
        pending[j] = value
  return results


def run_layers(model, x_bsd, layer_caches, per_token, layer_steps):
  """model.run_layers with the batch as two micro-batches (see the module docstring).
  `layer_caches`: a tuple with one batch-first pytree per layer, or None; `per_token`: the
  batch-first arrays each layer takes (positions, rotary tables). Returns (x_bsd, the new
  layer caches)."""
  rules = model.rules

  def micro_batch(slot):
    x, caches, args = split(rules, (x_bsd, layer_caches, per_token), slot)
    new_caches = []
    for i, layer in enumerate(model.layers):
      x, cache = yield from layer_steps(layer, x, None if caches is None else caches[i], args,
                                        slot)
      x = rules.constrain(x, "batch", None, None)
      new_caches.append(cache)
    return x, tuple(new_caches)

  (x_a, caches_a), (x_b, caches_b) = interleave([micro_batch(s) for s in range(MICRO_BATCHES)])
  return merge(rules, x_a, x_b), merge(rules, caches_a, caches_b)
