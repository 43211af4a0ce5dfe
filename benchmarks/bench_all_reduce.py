#!/usr/bin/env python3
"""All-reduce device time: jax_moe AllReduce (one-shot, two-shot, auto) against jax.lax.psum.

Every method runs in the same process on the same mesh and inputs. Modes: "loop" runs n
all-reduces inside one jit in a lax.fori_loop whose carry is the result (each call consumes
the previous one, as psum was measured for DESIGN.md); "chain" unrolls n dependent calls in
one jit without a loop (no per-iteration loop overhead). Per-call time is
(t(n_long) - t(n_short)) / (n_long - n_short) (benchmarks/timing.py), so host dispatch and
transfers cancel. Before timing, each method's single-call result is compared with psum's.
On CPU, or without the native CUDA module, AllReduce is psum and only psum is timed.

Writes <out>/all_reduce_<device>_<dtype>.json (every sample, the crossover table) and .png,
and prints the table.

  python benchmarks/bench_all_reduce.py --git-commit abc1234          # 4 KiB .. 64 MiB, bf16
  JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=2 \\
    python benchmarks/bench_all_reduce.py --sizes 4KiB,64KiB --iters 3 --short-iters 1 --reps 1
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import traceback
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `jax_moe` importable
  sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

import jax_moe as jm  # noqa: E402
from benchmarks import plot, report  # noqa: E402
from benchmarks.environment import (AXIS, REPLICATED, SHARDED, device_slug, ep_mesh,  # noqa: E402
                                    provenance)
from benchmarks.timing import summarize, time_per_iteration, wall_time  # noqa: E402
from jax_moe.sharding import shard_map  # noqa: E402

KERNEL_METHODS = ("one_shot", "two_shot", "auto")
METHODS = KERNEL_METHODS + ("psum",)
MODES = ("loop", "chain")
DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32, "float16": jnp.float16}
UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20}
DEFAULT_SIZES = "4KiB..64MiB"


def parse_size(text: str) -> int:
  match = re.fullmatch(r"(\d+)(B|KiB|MiB)", text.strip())
  if not match:
    raise argparse.ArgumentTypeError(f"size {text!r} must look like 4KiB, 1MiB or 512B")
  return int(match[1]) * UNITS[match[2]]


def parse_sizes(text: str) -> list[int]:
  """'4KiB..64MiB' (every power of two between) or a comma-separated list."""
  if ".." in text:
    low, high = (parse_size(t) for t in text.split(".."))
    sizes, size = [], low
    while size <= high:
      sizes.append(size)
      size *= 2
    return sizes
  return [parse_size(t) for t in text.split(",") if t]


def parse_csv(choices):
  def parse(text: str) -> list[str]:
    items = [t for t in text.split(",") if t]
    bad = [t for t in items if t not in choices]
    if bad or not items:
      raise argparse.ArgumentTypeError(f"{bad or 'nothing'} not in {list(choices)}")
    return items
  return parse


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--sizes", type=parse_sizes, default=parse_sizes(DEFAULT_SIZES),
                 help="bytes per rank: LOW..HIGH in powers of two, or a list "
                      f"(default {DEFAULT_SIZES})")
  p.add_argument("--dtype", choices=tuple(DTYPES), default="bfloat16")
  p.add_argument("--methods", type=parse_csv(METHODS), default=list(METHODS))
  p.add_argument("--modes", type=parse_csv(MODES), default=list(MODES))
  p.add_argument("--ep", type=int, default=None, help="use the first N devices (default all)")
  p.add_argument("--iters", type=int, default=110,
                 help="calls in the long program (loop mode: up to 4x this, within --budget-s)")
  p.add_argument("--short-iters", type=int, default=10, help="calls in the short program")
  p.add_argument("--reps", type=int, default=7, help="(short, long) pairs per method")
  p.add_argument("--budget-s", type=float, default=1.5, help="loop mode: seconds per method")
  p.add_argument("--tag", default="", help="appended to the result file names, e.g. 'cmdbuf' "
                 "for a run with XLA command buffers forced on")
  p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
  p.add_argument("--git-commit", default=None,
                 help="commit to record when the checkout has no .git (a copied tree)")
  args = p.parse_args(argv)
  if not 1 <= args.short_iters < args.iters:
    p.error("need 1 <= --short-iters < --iters")
  return args


def per_shard(mesh, fn, *extra_specs):
  return jax.jit(shard_map(fn, mesh, in_specs=(SHARDED, *extra_specs), out_specs=SHARDED))


def loop_program(mesh, reduce):
  """run(x, n): n dependent all-reduces in a fori_loop (n a run-time argument)."""
  def run(x, n):
    return jax.lax.fori_loop(0, n.reshape(()), lambda _, v: reduce(v), x)
  return per_shard(mesh, run, REPLICATED)


def chain_program(mesh, reduce, n: int):
  def run(x):
    for _ in range(n):
      x = reduce(x)
    return x
  return per_shard(mesh, run)


def time_chain(mesh, reduce, x, args) -> dict:
  programs = {n: chain_program(mesh, reduce, n) for n in (args.short_iters, args.iters)}
  for n, program in programs.items():
    wall_time(program, x)  # compile and warm up
  samples = []
  for _ in range(args.reps):
    t_short, _ = wall_time(programs[args.short_iters], x)
    t_long, _ = wall_time(programs[args.iters], x)
    samples.append((t_long - t_short) / (args.iters - args.short_iters) * 1e6)
  return {**summarize(samples), "n_short": args.short_iters, "n_long": args.iters,
          "reps": args.reps}


def time_method(mode, mesh, reduce, x, args) -> dict:
  if mode == "chain":
    return time_chain(mesh, reduce, x, args)
  program = loop_program(mesh, reduce)
  run = lambda n: program(x, jnp.full((1,), n, jnp.int32))  # noqa: E731
  wall_time(run, args.short_iters)  # compile
  # A loop has no compile cost per length, so it affords more calls (less timer noise).
  summary, _ = time_per_iteration(run, args.short_iters, 4 * args.iters, args.reps, args.budget_s)
  return summary


def random_input(mesh, elements: int, dtype, seed: int):
  """[R * elements] standard normal, made on the devices (rank r holds its own slice)."""
  R = mesh.devices.size
  make = jax.jit(lambda key: jax.random.normal(key, (R * elements,), jnp.float32).astype(dtype),
                 out_shardings=NamedSharding(mesh, SHARDED))
  return make(jax.random.key(seed))


def max_difference(a, b) -> float:
  a = np.asarray(a, np.float32)
  b = np.asarray(b, np.float32)
  return float(np.max(np.abs(a - b))) if a.size else 0.0


def measure_size(size: int, mesh, reducers: dict, args) -> list[dict]:
  dtype = DTYPES[args.dtype]
  elements = size // np.dtype(dtype).itemsize
  x = random_input(mesh, elements, dtype, seed=size)
  reduce_fns = {name: ar for name, ar in reducers.items()}
  reduce_fns["psum"] = lambda v: jax.lax.psum(v, AXIS)
  once = {name: np.asarray(per_shard(mesh, fn)(x)) for name, fn in reduce_fns.items()
          if name in args.methods}
  records = []
  for mode in args.modes:
    for name in args.methods:
      if name not in reduce_fns:
        continue
      picked = reducers[name].algorithm_for(size) if name in reducers else "psum"
      record = {"size_bytes": size, "elements": elements, "method": name, "mode": mode,
                "runs": picked, "max_abs_diff_vs_psum": max_difference(once[name], once["psum"])
                if "psum" in once else None}
      try:
        record.update(status="ok", time=time_method(mode, mesh, reduce_fns[name], x, args))
      except Exception as e:  # noqa: BLE001 - recorded, the other methods still run
        record.update(status="error", time=None,
                      reason=f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}")
      records.append(record)
      t = record["time"]
      print(f"{mode:5} {size:>10} B {name:9} ({picked:8}) "
            f"{t['median_us'] if t else float('nan'):9.1f} us", flush=True)
  return records


def crossover_table(results: list[dict], mode: str) -> list[dict]:
  """Per size: the median of each method, the fastest kernel and its speedup over psum."""
  rows = []
  for size in sorted({r["size_bytes"] for r in results}):
    med = {r["method"]: r["time"]["median_us"] for r in results
           if r["size_bytes"] == size and r["mode"] == mode and r["status"] == "ok"}
    kernels = {m: med[m] for m in ("one_shot", "two_shot") if m in med}
    best = min(kernels, key=kernels.get) if kernels else None
    row = {"size_bytes": size, **{f"{m}_us": med.get(m) for m in METHODS}, "fastest_kernel": best}
    if best and "psum" in med:
      row["speedup_fastest_vs_psum"] = med["psum"] / kernels[best]
    if "auto" in med and "psum" in med:
      row["speedup_auto_vs_psum"] = med["psum"] / med["auto"]
    rows.append(row)
  return rows


def first_size_where(rows: list[dict], better: str, worse: str) -> int | None:
  """The smallest size from which `better` is faster than `worse` at every larger size."""
  answer = None
  for row in reversed(rows):
    a, b = row.get(f"{better}_us"), row.get(f"{worse}_us")
    if a is None or b is None or a >= b:
      break
    answer = row["size_bytes"]
  return answer


def print_table(rows: list[dict], mode: str) -> None:
  print(f"\n{mode}: median us per call")
  print(f"{'bytes':>10} " + " ".join(f"{m:>9}" for m in METHODS) + "  fastest  x psum  auto x psum")
  for row in rows:
    cells = " ".join(f"{row[f'{m}_us']:9.1f}" if row.get(f"{m}_us") is not None else f"{'-':>9}"
                     for m in METHODS)
    speed = row.get("speedup_fastest_vs_psum")
    auto = row.get("speedup_auto_vs_psum")
    print(f"{row['size_bytes']:>10} {cells}  {row['fastest_kernel'] or '-':8} "
          f"{speed if speed else float('nan'):6.2f}  {auto if auto else float('nan'):6.2f}")


def make_payload(results: list[dict], mesh, max_bytes: int, args) -> dict:
  tables = {mode: crossover_table(results, mode) for mode in args.modes}
  return {
      "benchmark": "all_reduce",
      "environment": provenance(mesh, args.git_commit),
      "config": {"tag": args.tag, "xla_flags": os.environ.get("XLA_FLAGS", ""),
                 "dtype": args.dtype, "sizes_bytes": args.sizes, "methods": args.methods,
                 "modes": args.modes, "max_bytes": max_bytes, "ranks": int(mesh.devices.size),
                 "auto_one_shot_max_bytes": jm.all_reduce.AUTO_ONE_SHOT_MAX_BYTES,
                 "iters": args.iters, "short_iters": args.short_iters, "reps": args.reps},
      "crossovers": {mode: {"table": rows,
                            "two_shot_beats_one_shot_from_bytes":
                                first_size_where(rows, "two_shot", "one_shot"),
                            "psum_beats_one_shot_from_bytes":
                                first_size_where(rows, "psum", "one_shot"),
                            "psum_beats_two_shot_from_bytes":
                                first_size_where(rows, "psum", "two_shot")}
                     for mode, rows in tables.items()},
      "results": results,
  }


def main(argv=None) -> int:
  args = parse_args(argv)
  mesh = ep_mesh(args.ep)
  max_bytes = max(args.sizes)
  reducers = {}
  for name in KERNEL_METHODS:
    if name not in args.methods:
      continue
    try:
      reducers[name] = jm.AllReduce(mesh, AXIS, max_bytes=max_bytes, algorithm=name)
    except ValueError as e:  # one_shot/two_shot need the CUDA build; auto falls back to psum
      print(f"{name}: not available here ({e})", file=sys.stderr)
  stem = args.out / (f"all_reduce_{device_slug(mesh)}_{args.dtype}"
                     + (f"_{args.tag}" if args.tag else ""))
  results, payload = [], {}
  for size in args.sizes:
    results += measure_size(size, mesh, reducers, args)
    payload = make_payload(results, mesh, max_bytes, args)
    report.write_json(stem.with_suffix(".json"), payload)  # after every size: a kill keeps them
  for ar in reducers.values():
    ar.check()
    ar.close()
  plotted = plot.plot_all_reduce(payload, stem.with_suffix(".png"))
  for mode in args.modes:
    print_table(payload["crossovers"][mode]["table"], mode)
  print(f"\nwrote {stem}.json" + (" and .png" if plotted else ""))
  return 0 if all(r["status"] == "ok" for r in results) else 1


if __name__ == "__main__":
  sys.exit(main())
