#!/usr/bin/env python3
"""MoE dispatch/combine latency: jax_moe backends against JAX collectives, same inputs.

Every method moves the same tokens through an identity expert (the dispatched row,
dequantized, cast to bf16), so only the exchange costs time. Each method's result is first
compared with a dense numpy reference; a method that differs is reported as failed and not
timed. Times are device time per iteration from loops inside one jit (benchmarks/timing.py).

Writes <out>/dispatch_combine_<device>_<phase>.json and .png and prints a table last.

  python benchmarks/bench_dispatch_combine.py                       # H200 defaults
  JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
    python benchmarks/bench_dispatch_combine.py --hidden 256 --experts 16 --topk 4 \\
    --phases decode=8 --iters 4 --short-iters 1 --reps 2              # CPU smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import traceback
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `jax_moe` importable
  sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

import jax_moe as jm  # noqa: E402
from benchmarks import methods, peers, plot, report  # noqa: E402
from benchmarks.arguments import csv_list as _csv  # noqa: E402
from benchmarks.arguments import phases as _phases  # noqa: E402
from benchmarks.environment import SHARDED, device_slug, ep_mesh, provenance  # noqa: E402
from benchmarks.problem import ROUTINGS, Shape, make_inputs, traffic  # noqa: E402
from benchmarks.timing import loop_program, per_step, time_per_iteration, wall_time  # noqa: E402

TOLERANCE = (
    "combine outputs: |out - ref| <= (n * 2^-8 + 2^-16) * sum_k |w[t,k]| * |y[t]| per element, "
    "ref = sum_k w[t,k] * y[t] exactly, y = bf16(dequantized dispatched row); n = bf16 "
    "roundings of partial or final sums: 1 for jax_moe source and expert/f32, 2 for expert/bf16, "
    "1 for all_to_all peers, R+1 for all_gather+psum_scatter (bf16 reduce-scatter); "
    "psum probe n = R; dispatch alone: the docs/semantics.md layout bit for bit")


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--hidden", type=int, default=7168)
  p.add_argument("--experts", type=int, default=256)
  p.add_argument("--topk", type=int, default=8)
  p.add_argument("--block-size", type=int, default=128, help="fp8 scale block along hidden")
  p.add_argument("--phases", type=_phases, default=_phases("decode=128,prefill=4096"),
                 help="NAME=TOKENS_PER_RANK,... (default decode=128,prefill=4096)")
  p.add_argument("--dispatch-dtypes", type=_csv(methods.DTYPES), default=["fp8", "bf16"])
  p.add_argument("--reduce", type=_csv(("source", "expert")), default=["source", "expert"],
                 help="combine_reduce modes of the jax_moe backends")
  p.add_argument("--fp8-input", choices=("quantized", "bf16"), default="quantized",
                 help="fp8 dispatch input: (q, scales) quantized once on the host (as DeepEP's "
                      "normal dispatch takes it; default), or bf16 quantized by each method "
                      "on the device, inside the timed loop")
  p.add_argument("--partial-dtype", choices=tuple(methods.PARTIAL_DTYPES), default="f32")
  p.add_argument("--expert-padding", type=int, default=1)
  p.add_argument("--identity-dequantize", choices=peers.IDENTITY_DEQUANTIZE_CHOICES,
                 default=peers.IDENTITY_DEQUANTIZE, help="jm.dequantize_fp8's implementation in "
                 "every method's identity expert (fp8 rows): auto (its default: the CUDA kernel "
                 "on a GPU) or xla (XLA's fusion)")
  p.add_argument("--routing", choices=ROUTINGS, default="uniform")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--backends", type=_csv(), default=None,
                 help="jax_moe backends, or 'none' (default: jm.available_backends()); "
                      "'cuda-proxy' is the cuda backend with every peer forced remote "
                      "(through its host proxies); 'replicated' the replicated-input mode "
                      "(every rank holds every token; expert mode, fused and split)")
  p.add_argument("--ops", type=_csv(methods.JAX_MOE_OPS), default=list(methods.JAX_MOE_OPS),
                 help="jax_moe operations to time")
  p.add_argument("--peers", type=_csv(methods.PEER_NAMES + methods.PROBE_NAMES),
                 default=list(methods.PEER_NAMES + methods.PROBE_NAMES),
                 help="JAX peers and probes, or 'none' (default: all; those that cannot run "
                      "here are reported as skipped)")
  p.add_argument("--p2p-mib", type=_csv(convert=float), default=[256.0, 1.0],
                 help="ppermute sizes per rank in MiB for the P2P bandwidth probe")
  p.add_argument("--ep", type=int, default=None, help="use the first N devices (default all)")
  p.add_argument("--iters", type=int, default=20, help="iterations of the long timed loop")
  p.add_argument("--steps-per-iteration", type=int, default=4,
                 help="exchanges per loop iteration (spreads the loop's own cost over them)")
  p.add_argument("--short-iters", type=int, default=5, help="iterations of the short loop")
  p.add_argument("--reps", type=int, default=5, help="(short, long) pairs per method")
  p.add_argument("--budget-s", type=float, default=20.0,
                 help="shorten the long loop of slow methods to about this many seconds")
  p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
  p.add_argument("--git-commit", default=None,
                 help="commit to record when the checkout has no .git (a copied tree)")
  args = p.parse_args(argv)
  if not 0 <= args.short_iters < args.iters:
    p.error(f"--short-iters must be in [0, --iters), got {args.short_iters} and {args.iters}")
  if args.reps < 1:
    p.error(f"--reps must be >= 1, got {args.reps}")
  return args


def _skipped(label: str, family: str, name: str, reason: str, **fields) -> dict:
  print(f"  {label}: skipped ({reason})", flush=True)
  return {"label": label, "family": family, "name": name, "status": "skipped",
          "reason": reason, **fields}


def run_method(method: methods.Method, mesh, device_inputs, args) -> dict:
  """Checks, then times one method; never raises (errors become the record's status)."""
  record = method.record()
  try:
    steps = args.steps_per_iteration
    program = loop_program(mesh, method.init, method.body, method.final, steps)
    run = lambda n: program(*device_inputs, np.int32(n))
    # One exchange (n = 0) first: compiles, and costs little if the method is broken.
    _, out = wall_time(run, 0)
    record["correctness"] = method.check(out, 0)
    method.after_run()
    if not record["correctness"]["passed"]:
      record.update(status="failed", reason="differs from the reference; not timed")
    else:
      timing, out = time_per_iteration(run, args.short_iters, args.iters, args.reps,
                                       args.budget_s)
      record["time"] = {**per_step(timing, steps), "steps_per_iteration": steps}
      record["correctness_after_timing"] = method.check(out, timing["n_long"] * steps)
      method.after_run()
      passed = record["correctness_after_timing"]["passed"]
      record.update(status="ok" if passed else "failed",
                    reason=None if passed else "differs from the reference after the timed loops")
  except jm.CommError as e:
    record.update(status="failed", reason=f"CommError: {e}")
  except Exception as e:  # a method that cannot compile or run must not stop the others
    traceback.print_exc()
    record.update(status="error", reason=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
  t = record.get("time")
  print(f"  {record['label']}: {record['status']}"
        + (f" {t['median_us']:.1f} us (p10 {t['p10_us']:.1f}, p90 {t['p90_us']:.1f})" if t else "")
        + (f" - {record['reason']}" if record.get("reason") else ""), flush=True)
  return record


def jax_moe_records(ctx, mesh, device_inputs, backend, args) -> list[dict]:
  """Every op of `backend` in every combine mode, each on a fresh communicator so that a
  method that breaks the protocol (a timeout, say) cannot fail the ones after it."""
  records = []
  for i, reduce in enumerate(args.reduce):
    if backend == methods.REPLICATED and reduce != "expert":
      continue  # the replicated-input mode sums partials: expert mode only
    # Dispatch alone is the same work in both combine modes: time it once per dtype.
    for op in (op for op in args.ops if not (op == "dispatch" and i > 0)):
      if backend == methods.REPLICATED and op not in methods.REPLICATED_OPS:
        continue
      try:
        comm = methods.make_communicator(ctx, backend, reduce, args.partial_dtype,
                                         args.expert_padding)
      except Exception as e:
        traceback.print_exc()
        records.append({"label": f"{backend} {op} {ctx.dtype_name} {reduce}",
                        "family": "jax_moe", "name": backend, "op": op, "status": "error",
                        "reason": f"Communicator: {type(e).__name__}: {e}"})
        continue
      try:
        (method,) = (methods.replicated_methods(ctx, comm, (op,))
                     if backend == methods.REPLICATED
                     else methods.jax_moe_methods(ctx, comm, (op,), name=backend))
        records.append(run_method(method, mesh, device_inputs, args))
      finally:
        comm.close()
  return records


def peer_records(ctx, mesh, device_inputs, args) -> list[dict]:
  records = []
  platform = mesh.devices.flat[0].platform
  for peer in methods.PEER_NAMES:
    if peer not in args.peers:
      continue
    label = f"{peer} {ctx.dtype_name}"
    if peer == "ragged_all_to_all" and platform == "cpu":
      records.append(_skipped(label, "peer", peer, "XLA:CPU does not implement "
                              "ragged-all-to-all", dispatch_dtype=ctx.dtype_name))
      continue
    records.append(run_method(methods.peer_method(ctx, peer), mesh, device_inputs, args))
  if "fanout" in args.peers:  # the dispatch dtype's rows: a probe of each dtype
    records.append(run_method(methods.fanout_method(ctx), mesh, device_inputs, args))
  return records


def probe_records(ctx, mesh, device_inputs, args) -> list[dict]:
  records = []
  if "psum" in args.peers:
    records.append(run_method(methods.psum_method(ctx), mesh, device_inputs, args))
  if "weighted_sum" in args.peers:
    records.append(run_method(methods.weighted_sum_method(ctx), mesh, device_inputs, args))
  if "p2p" in args.peers:
    for mib in args.p2p_mib:
      size = int(mib * 2**20)
      method = methods.p2p_method(ctx, size)
      if mesh.devices.flat[0].platform != "gpu":
        records.append(_skipped(method.label, "probe", "p2p", "the P2P bandwidth probe runs "
                                "on GPUs only"))
      elif ctx.shape.ranks < 2:
        records.append(_skipped(method.label, "probe", "p2p", "needs at least 2 devices"))
      else:
        records.append(run_method(method, mesh, device_inputs, args))
  return records


def run_phase(phase: str, tokens: int, mesh, backends: list[str], args) -> dict:
  R = mesh.devices.size
  base = Shape(ranks=R, tokens=tokens, hidden=args.hidden, experts=args.experts,
               topk=args.topk, fp8=False, block_size=args.block_size)
  inputs = make_inputs(base, args.routing, args.seed)
  moved = traffic(base, inputs)
  sharding = NamedSharding(mesh, SHARDED)
  x, ids, weights = (jax.device_put(a, sharding)
                     for a in (inputs.x, inputs.topk_ids, inputs.topk_weights))
  print(f"[{phase}] {tokens} tokens/rank on {R} x {mesh.devices.flat[0].device_kind}: "
        f"{moved.remote_slots:.0f} remote slots/rank, {moved.remote_pairs:.0f} remote "
        f"(token, rank) pairs/rank", flush=True)

  results, ctx = [], None
  for dtype in args.dispatch_dtypes:
    shape = dataclasses.replace(base, fp8=dtype == "fp8")
    ctx = methods.make_context(mesh, shape, inputs, moved)
    tokens_in = x
    if shape.fp8 and args.fp8_input == "quantized":
      tokens_in = (jax.device_put(ctx.expected.rows, sharding),
                   jax.device_put(ctx.expected.scales, sharding))
    for backend in backends:
      results += jax_moe_records(ctx, mesh, (tokens_in, ids, weights), backend, args)
    results += peer_records(ctx, mesh, (tokens_in, ids, weights), args)
  if ctx is None:  # no dispatch dtype asked for: the probes still need a context
    ctx = methods.make_context(mesh, base, inputs, moved)
  results += probe_records(ctx, mesh, (x, ids, weights), args)

  return {
      "benchmark": "dispatch_combine",
      "phase": phase,
      "environment": provenance(mesh, args.git_commit),
      "config": {
          "tokens_per_rank": tokens, "ranks": R, "hidden": args.hidden,
          "experts": args.experts, "topk": args.topk, "block_size": args.block_size,
          "dispatch_dtypes": args.dispatch_dtypes, "fp8_input": args.fp8_input,
          "combine_dtype": "bf16",
          "combine_reduce": args.reduce, "partial_dtype": args.partial_dtype,
          "expert_padding": args.expert_padding, "routing": args.routing, "seed": args.seed,
          "identity_dequantize": args.identity_dequantize,
          "backends": backends, "ops": args.ops, "peers": args.peers,
          "iters": args.iters, "short_iters": args.short_iters, "reps": args.reps,
          "budget_s": args.budget_s, "argv": sys.argv[1:],
      },
      "traffic": dataclasses.asdict(moved),
      "tolerance": TOLERANCE,
      "timing": "per-iteration device time = (t(n_long) - t(n_short)) / (n_long - n_short), "
                "host wall time around block_until_ready of one jit with a fori_loop; "
                "fused and split include the identity expert (an fp8->bf16 pass over the "
                "received rows), dispatch and combine alone do not; fp8 quantization is "
                + ("outside the loop (pre-quantized input)" if args.fp8_input == "quantized"
                   else "inside the loop (bf16 input)"),
      "results": results,
  }


def main(argv=None) -> int:
  args = parse_args(argv)
  mesh = ep_mesh(args.ep)
  peers.IDENTITY_DEQUANTIZE = args.identity_dequantize
  available = jm.available_backends()
  backends = available if args.backends is None else args.backends
  # Settings of an available backend (methods.FORCED_REMOTE) only when asked for.
  allowed = available + [n for n, b in methods.FORCED_REMOTE.items() if b in available] + [
      methods.REPLICATED]
  for b in backends:
    if b not in allowed:
      print(f"backend {b!r} is not available here (available: {allowed})", file=sys.stderr)
      return 2
  slug = device_slug(mesh)
  tables = []
  for phase, tokens in args.phases:
    payload = run_phase(phase, tokens, mesh, backends, args)
    stem = args.out / f"dispatch_combine_{slug}_{phase}"
    report.write_json(stem.with_suffix(".json"), payload)
    plotted = plot.plot_results(payload, stem.with_suffix(".png"))
    tables.append(f"{phase} ({payload['config']['tokens_per_rank']} tokens/rank, {slug}); "
                  f"wrote {stem}.json" + (" and .png" if plotted else "") + "\n"
                  + report.table(payload["results"]))
  print("\n\n".join(tables))
  return 0


if __name__ == "__main__":
  sys.exit(main())
