"""Device time per iteration from loops inside one jit, without per-call dispatch overhead.

A method is three per-shard functions: `init(x, ids, w) -> state`, `body(state) -> state` and
`final(state) -> result`. One compiled program runs init, then `n` bodies in a
lax.fori_loop (n is a run-time argument, so one compilation serves every n), then final.
Each body must feed its exchange's result into the next state (consume_output) so XLA can
neither hoist the exchange out of the loop nor overlap iterations. Timing two loop lengths
and taking (t(n_long) - t(n_short)) / (n_long - n_short) cancels the host's launch and
transfer costs and the work of init and final.
"""

from __future__ import annotations

import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.environment import REPLICATED, SHARDED
from jax_moe.sharding import shard_map


def consume_output(x, topk_ids: jax.Array, topk_weights: jax.Array, out: jax.Array):
  """(x, ids, w) for the next iteration, equal in value but data-dependent on all of `out`.

  `x + 0 * out` reads every element, like the residual add that consumes an MoE layer's
  output in a model; consuming less would let XLA compute only the elements read (a fusion
  rooted at a slice evaluates just that slice), flattering the pure-JAX methods. XLA does
  not fold a float multiply by zero (NaN semantics). A pre-quantized x = (q, scales) takes
  the zeros into q's bits, so nothing computed from q alone is loop-invariant. The routing
  gets a [T, K] pass so its processing stays inside the loop, as it would in a model.
  """
  zeros = out * jnp.zeros((), out.dtype)
  zero = zeros[0, 0].astype(jnp.float32)
  if isinstance(x, tuple):
    q, scales = x
    bits = jax.lax.bitcast_convert_type(q, jnp.uint8) + zeros.astype(jnp.uint8)
    x = (jax.lax.bitcast_convert_type(bits, q.dtype), scales + zero)
  else:
    x = x + zeros.astype(x.dtype)
  return x, topk_ids + zero.astype(jnp.int32), topk_weights + zero


def consume_probe(x, topk_ids: jax.Array, topk_weights: jax.Array, probe: jax.Array):
  """Like consume_output for results too large to read every iteration (dispatched rows):
  the next inputs depend on the scalar `probe` through a one-element write to x (to the
  scales of a pre-quantized x)."""
  zero = jnp.float32(0) * probe.astype(jnp.float32)
  if isinstance(x, tuple):
    q, scales = x
    x = (q, scales.at[0, 0].add(zero))
  else:
    x = x.at[0, 0].add(zero.astype(x.dtype))
  return x, topk_ids + zero.astype(jnp.int32), topk_weights + zero


def probe_all(tree) -> jax.Array:
  """A scalar that depends on one element of every array in `tree`, so none is dead code."""
  leaves = [leaf for leaf in jax.tree.leaves(tree) if leaf.size]
  return sum(leaf.reshape(-1)[0].astype(jnp.float32) for leaf in leaves)


def loop_program(mesh, init: Callable, body: Callable, final: Callable, steps: int = 1):
  """jit(shard_map(run)) with run(x, ids, w, n) = final(body^(n * steps)(init(x, ids, w))):
  each loop iteration runs `steps` bodies one after another. An iteration of a fori_loop
  costs a fixed ~20 us of its own on an H200 (its condition goes through the host), which
  is as much as a whole decode exchange; per_step() divides it over the steps. An
  optimization barrier between bodies keeps XLA from fusing one step's tail into the next
  (a model has attention between two MoE layers)."""

  def iteration(_, state):
    for _ in range(steps):
      state = jax.lax.optimization_barrier(body(state))
    return state

  def run(x, topk_ids, topk_weights, n):
    state = init(x, topk_ids, topk_weights)
    state = jax.lax.fori_loop(0, n.reshape(()), iteration, state)
    return final(state)

  return jax.jit(shard_map(run, mesh, in_specs=(SHARDED, SHARDED, SHARDED, REPLICATED),
                           out_specs=SHARDED))


def wall_time(fn: Callable, *args):
  """(seconds, output) of one call, waiting for the device."""
  start = time.perf_counter()
  out = jax.block_until_ready(fn(*args))
  return time.perf_counter() - start, out


def loop_lengths(seconds_short: float, n_short: int, n_long: int, reps: int,
                 budget_s: float) -> int:
  """The long loop length to use: `n_long`, shortened so that `reps` pairs of runs fit
  `budget_s` (estimated from one short run), but always at least n_short + 2."""
  per_iteration = seconds_short / max(n_short, 1)
  affordable = int(budget_s / max(reps * per_iteration, 1e-9)) - n_short
  return max(n_short + 2, min(n_long, affordable))


def summarize(samples_us: list[float]) -> dict:
  a = np.asarray(samples_us, np.float64)
  return {
      "median_us": float(np.median(a)),
      "p10_us": float(np.percentile(a, 10)),
      "p90_us": float(np.percentile(a, 90)),
      "min_us": float(a.min()),
      "max_us": float(a.max()),
      "samples_us": [float(v) for v in a],
  }


def per_step(timing: dict, steps: int) -> dict:
  """A time_per_iteration summary of loops of `steps` bodies per iteration, per body (the
  caller records `steps` under its own name)."""
  out = {k: (v / steps if k.endswith("_us") and k != "samples_us" else v)
         for k, v in timing.items()}
  out["samples_us"] = [v / steps for v in timing["samples_us"]]
  return out


def time_per_iteration(run: Callable[[int], object], n_short: int, n_long: int, reps: int,
                       budget_s: float):
  """Median and spread of the per-iteration time of `run(n)` (which runs n iterations).

  Returns (summary dict, the output of the last long run). `run` must already be compiled
  for the result to exclude compilation; one short warm-up run happens here anyway.
  """
  seconds_short, _ = wall_time(run, n_short)
  n_long = loop_lengths(seconds_short, n_short, n_long, reps, budget_s)
  samples, out = [], None
  for _ in range(reps):
    t_short, _ = wall_time(run, n_short)
    t_long, out = wall_time(run, n_long)
    samples.append((t_long - t_short) / (n_long - n_short) * 1e6)
  return {**summarize(samples), "n_short": n_short, "n_long": n_long, "reps": reps}, out
