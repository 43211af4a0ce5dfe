"""`jax-moe demo`: one MoE layer, checked.

dispatch -> grouped GEMM (jax_moe.grouped_gemm.ragged_dot: tokamax on Hopper where it applies,
else jax.lax.ragged_dot) -> combine on every device of the default platform with every
available backend and both combine modes, compared with a dense f32 computation; the command
exits non-zero when they disagree.
"""

from __future__ import annotations

import argparse
import sys
import time

# max |out - ref| / max |ref|: bf16 expert outputs and bf16 combine output each round once
# (about 2^-9 relative); an exchange that loses or misplaces a row is off by O(1).
_PARITY_TOLERANCE = 1e-2


def add_parser(commands) -> None:
  demo = commands.add_parser(
      "demo", help="dispatch -> ragged_dot experts -> combine, checked against a dense f32 layer",
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  demo.add_argument("--experts", type=int, default=64, help="number of experts")
  demo.add_argument("--topk", type=int, default=4, help="experts per token")
  demo.add_argument("--hidden", type=int, default=1024, help="hidden size")
  demo.add_argument("--tokens", type=int, default=64, help="tokens per rank")
  demo.add_argument("--dispatch-dtype", choices=("fp8", "bf16"), default="fp8",
                    help="fp8: e4m3fn with block scales, quantized on the source rank")
  demo.add_argument("--block-size", type=int, default=128, help="fp8 scale block")
  demo.add_argument("--warmup", type=int, default=2, help="untimed calls after compiling")
  demo.add_argument("--iters", type=int, default=5, help="timed calls")
  demo.add_argument("--seed", type=int, default=0, help="random inputs and expert weights")
  demo.set_defaults(run=run)


def _make_inputs(args, num_ranks: int):
  """Random bf16 tokens, a softmax top-k router and per-expert weights, all global arrays."""
  import jax
  import jax.numpy as jnp

  n = num_ranks * args.tokens
  kx, kr, kw = jax.random.split(jax.random.key(args.seed), 3)
  x = jax.random.normal(kx, (n, args.hidden), jnp.float32).astype(jnp.bfloat16)
  logits = jax.random.normal(kr, (n, args.experts), jnp.float32)
  probs, ids = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), args.topk)
  weights = probs / probs.sum(axis=-1, keepdims=True)
  w = (jax.random.normal(kw, (args.experts, args.hidden, args.hidden), jnp.float32)
       / jnp.sqrt(jnp.float32(args.hidden))).astype(jnp.bfloat16)
  return x, ids.astype(jnp.int32), weights, w


def _dense_reference(x, ids, weights, w, fp8: bool, block_size: int):
  """out[t] = sum_k weights[t, k] * (x[t] @ w[ids[t, k]]) in f32, expert by expert."""
  import numpy as np
  import jax
  import jax.numpy as jnp
  import jax_moe as jm

  if fp8:
    # The experts see what dispatch delivers: the tokens quantized as docs/semantics.md says.
    # Quantize on XLA:CPU, which follows it; XLA:GPU rounds a few fp8 codes differently.
    x_cpu = jax.device_put(x, jax.devices("cpu")[0])
    x = jm.dequantize_fp8(*jm.quantize_fp8(x_cpu, block_size), dtype=jnp.float32)
  x = np.asarray(x, np.float32)
  ids, weights, w = np.asarray(ids), np.asarray(weights), np.asarray(w)
  out = np.zeros_like(x)
  for expert in range(w.shape[0]):
    tokens, slots = np.nonzero(ids == expert)
    y = x[tokens] @ w[expert].astype(np.float32)
    np.add.at(out, tokens, weights[tokens, slots, None] * y)
  return out


def _config(args, combine_reduce: str, num_ranks: int):
  import jax.numpy as jnp
  import jax_moe as jm

  cfg = jm.MoEConfig(num_experts=args.experts, experts_per_token=args.topk,
                     hidden=args.hidden, max_tokens=args.tokens,
                     dispatch_dtype=jnp.float8_e4m3fn if args.dispatch_dtype == "fp8"
                     else jnp.bfloat16,
                     block_size=args.block_size, combine_reduce=combine_reduce)
  cfg.capacity(num_ranks)  # checks that the experts split evenly over the ranks
  return cfg


def _moe_layer(comm):
  """The per-shard MoE layer: dispatch, grouped GEMM on the local experts, combine."""
  import jax.numpy as jnp
  import jax_moe as jm
  from jax_moe import grouped_gemm

  def layer(x, ids, weights, w_local):
    r = comm.dispatch(x, ids, weights)
    rows = jm.dequantize_fp8(r.x, r.scales, jnp.bfloat16) if comm.cfg.is_fp8 else r.x
    y = grouped_gemm.ragged_dot(rows, w_local, r.group_sizes, preferred_element_type=jnp.float32)
    return comm.combine(y.astype(jnp.bfloat16), r.handle)

  return layer


def _mean_seconds(fn, inputs, warmup: int, iters: int) -> float:
  for _ in range(warmup):
    fn(*inputs).block_until_ready()
  start = time.perf_counter()
  for _ in range(iters):
    out = fn(*inputs)
  out.block_until_ready()
  return (time.perf_counter() - start) / iters


def run(args) -> int:
  import jax
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  import jax_moe as jm
  from jax_moe.sharding import shard_map

  devices = jax.devices()
  mesh = Mesh(np.array(devices), ("ep",))
  print(f"{len(devices)} {jax.default_backend()} devices on axis 'ep'; {args.experts} experts, "
        f"top-{args.topk}, hidden {args.hidden}, {args.tokens} tokens per rank, "
        f"{args.dispatch_dtype} dispatch")
  try:  # the config checks the flags; report them without a traceback
    configs = [_config(args, reduce, len(devices)) for reduce in ("source", "expert")]
  except ValueError as e:
    print(f"jax-moe demo: error: {e}", file=sys.stderr)
    return 2

  x, ids, weights, w = _make_inputs(args, len(devices))
  ref = _dense_reference(x, ids, weights, w, configs[0].is_fp8, args.block_size)
  ref_scale = float(np.max(np.abs(ref)))
  sharded = NamedSharding(mesh, P("ep"))
  inputs = [jax.device_put(a, sharded) for a in (x, ids, weights, w)]

  failures = 0
  for backend in jm.available_backends():
    for cfg in configs:
      with jm.Communicator(cfg, mesh, axis="ep", backend=backend) as comm:
        step = jax.jit(shard_map(_moe_layer(comm), mesh, in_specs=(P("ep"),) * 4,
                                  out_specs=P("ep")))
        out = np.asarray(step(*inputs), np.float32)
        comm.check()
        seconds = _mean_seconds(step, inputs, args.warmup, args.iters)
        comm.check()
      error = float(np.max(np.abs(out - ref))) / ref_scale
      ok = error <= _PARITY_TOLERANCE
      failures += not ok
      print(f"  {backend:5s} combine_reduce={cfg.combine_reduce:6s}  "
            f"max|out-ref|/max|ref| = {error:.2e} {'ok' if ok else 'FAIL'}  "
            f"{seconds * 1e3:8.3f} ms per layer call")
  if failures:
    print(f"parity FAILED in {failures} run(s) (tolerance {_PARITY_TOLERANCE:.0e})",
          file=sys.stderr)
    return 1
  return 0
