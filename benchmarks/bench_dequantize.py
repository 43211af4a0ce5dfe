"""fp8 block dequantization (jm.dequantize_fp8): the CUDA kernel against XLA's fusion of the
same expression, at the row counts an fp8 dispatch hands the experts.

Rows: decode 128 tokens x top-8 = 1024, prefill 4096 x top-8 = 32768; hidden 7168, block 128,
bf16 out (the identity expert of bench_dispatch_combine.py and the models' fp8 path). Every
implementation is checked against the numpy spec first, bit for bit (NaN codes included), at
the timed size. Then, per implementation and row count:
  call      device time per call from a loop inside one jit: each fori_loop iteration runs
            --steps calls chained through one scale (the next call's scales[0, 0] gets 0 x the
            last result's [0, 0]), each result behind an optimization barrier so all of it is
            written; (t(n_long) - t(n_short)) / (n_long - n_short) / steps
  kernel    the dequantization's own kernel in a profiler trace of that loop (XLA's fusion, or
            jax_moe_dequantize_fp8's): mean device time, and GB/s of its bytes (codes + scales
            read, output written)
Writes JSON (commit, device, config, medians and spreads) and a PNG.

  python3 benchmarks/bench_dequantize.py [--rows 1024,32768] [--hidden 7168]
                                         [--out benchmarks/results/dequantize]
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import jax_moe as jm  # noqa: E402
from benchmarks import reference, stage_profile  # noqa: E402
from benchmarks.arguments import csv_list  # noqa: E402
from benchmarks.environment import ep_mesh, provenance  # noqa: E402
from benchmarks.plot import plot_time_bars  # noqa: E402
from benchmarks.report import progress, write_json  # noqa: E402
from benchmarks.timing import per_step, time_per_iteration  # noqa: E402

DTYPES = {"bf16": jnp.bfloat16, "f32": jnp.float32}
COLORS = {"xla": "tab:orange", "cuda": "tab:blue"}


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--rows", type=csv_list(convert=int), default=[1024, 32768],
                 help="row counts (tokens x top-k of a dispatch)")
  p.add_argument("--hidden", type=int, default=7168)
  p.add_argument("--block-size", type=int, default=128)
  p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="output dtype")
  p.add_argument("--implementations", type=csv_list(("xla", "cuda")), default=["xla", "cuda"])
  p.add_argument("--steps", type=int, default=8, help="calls a loop iteration")
  p.add_argument("--reps", type=int, default=5)
  p.add_argument("--n-short", type=int, default=2)
  p.add_argument("--n-long", type=int, default=40)
  p.add_argument("--budget-s", type=float, default=3.0, help="timing budget a case")
  p.add_argument("--git-commit", default=None, help="the code's commit (a copied tree)")
  p.add_argument("--out", type=Path, default=Path("benchmarks/results/dequantize"),
                 help="file stem: writes STEM.json and STEM.png")
  a = p.parse_args(argv)
  if a.hidden % a.block_size or min(a.rows) < 1 or a.steps < 1:
    p.error("--hidden must be a multiple of --block-size; --rows and --steps positive")
  return a


def inputs(rng, rows: int, hidden: int, block: int):
  """Random codes (every byte, the NaN codes included) and positive scales as quantize_fp8
  makes them (amax / 448 of blocks with amax in [2^-8, 2^8])."""
  q = rng.integers(0, 256, (rows, hidden), dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
  scales = (2.0 ** rng.uniform(-8, 8, (rows, hidden // block)) / 448).astype(np.float32)
  return q, scales


def differing(got: np.ndarray, want: np.ndarray) -> int:
  """Elements that differ in their bits (any NaN matches any NaN)."""
  width = np.dtype(f"u{got.dtype.itemsize}")
  differ = got.view(width) != want.view(width)
  differ &= ~(np.isnan(got.astype(np.float32)) & np.isnan(want.astype(np.float32)))
  return int(differ.sum())


def loop(call, steps: int):
  """jit(run(q, scales, n)): n iterations of `steps` chained calls of call(q, scales); returns
  the last result's [0, 0] (so the chain is live)."""

  def run(q, s, n):
    def iteration(_, s):
      for _ in range(steps):
        out = jax.lax.optimization_barrier(call(q, s))
        s = s.at[0, 0].add(out[0, 0].astype(jnp.float32) * 0)
      return s

    return jax.lax.fori_loop(0, n, iteration, s)[0, 0]

  return jax.jit(run)


def kernel_time(data, impl: str) -> dict | None:
  """Mean device time of the dequantization's kernel in a trace: ours by name, XLA's as the
  longest kernel (the fusion; the scale update is a one-element kernel)."""
  table = stage_profile.kernel_table(data, 1)
  for entry in table.values():
    kernels = entry["kernels"]
    mine = [k for k in kernels if "dequantize_fp8_kernel" in k["name"]]
    pick = mine if impl == "cuda" else sorted(kernels, key=lambda k: -k["mean_us"])[:1]
    if pick:
      return {"name": pick[0]["name"][:120], "mean_us": pick[0]["mean_us"],
              "count": pick[0]["count"]}
  return None


def main(argv=None):
  a = parse_args(argv)
  dtype = DTYPES[a.dtype]
  mesh = ep_mesh(1)
  rng = np.random.default_rng(0)
  results = []
  for rows in a.rows:
    q_np, s_np = inputs(rng, rows, a.hidden, a.block_size)
    want = reference.dequantize_fp8(q_np, s_np).astype(np.dtype(dtype))
    q, s = jnp.asarray(q_np), jnp.asarray(s_np)
    moved = q_np.nbytes + s_np.nbytes + want.nbytes
    for impl in a.implementations:
      label = f"{impl} {rows} rows"
      if impl == "cuda" and mesh.devices.flat[0].platform != "gpu":
        progress(f"{label}: skipped, the kernel needs a CUDA device")
        continue
      call = functools.partial(jm.dequantize_fp8, dtype=dtype, implementation=impl)
      got = np.asarray(jax.jit(call)(q, s))
      wrong = differing(got, want)
      if wrong:
        raise SystemExit(f"{label}: {wrong} of {got.size} elements differ from the spec")
      progress(f"{label}: matches the spec bit for bit")
      run = loop(call, a.steps)
      timing, _ = time_per_iteration(lambda n: run(q, s, np.int32(n)), a.n_short, a.n_long,
                                     a.reps, a.budget_s)
      per_call = per_step(timing, a.steps)
      kernel = kernel_time(stage_profile.traced(lambda: run(q, s, np.int32(a.n_short))), impl)
      if kernel:
        kernel["tb_per_s"] = moved / (kernel["mean_us"] * 1e-6) / 1e12
      results.append({"label": label, "implementation": impl, "rows": rows, "bytes": moved,
                      "time": per_call, "kernel": kernel})
      print(f"{label:>18}: {per_call['median_us']:8.1f} us a call (p10-p90 "
            f"{per_call['p10_us']:.1f}-{per_call['p90_us']:.1f})" +
            (f", kernel {kernel['mean_us']:.1f} us ({kernel['tb_per_s']:.2f} TB/s of "
             f"{moved / 1e6:.1f} MB)" if kernel else ", no kernel in the trace"))
  env = provenance(mesh, a.git_commit)
  config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()}
  payload = {**env, "config": config, "results": results}
  write_json(a.out.with_suffix(".json"), payload)
  plot_time_bars(results, a.out.with_suffix(".png"),
                 colors=[COLORS[r["implementation"]] for r in results],
                 notes=[f"kernel {r['kernel']['mean_us']:.1f} us" if r["kernel"] else ""
                        for r in results],
                 xlabel="microseconds a call (median, p10-p90)",
                 title=f"dequantize_fp8 to {a.dtype}, hidden {a.hidden}, block {a.block_size}\n"
                       f"{env['device_kind']}, jax {env['jax_version']}")


if __name__ == "__main__":
  main()
