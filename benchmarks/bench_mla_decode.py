"""MLA decode attention: the Pallas kernel (jax_moe.models.mla_decode) against the einsums
XLA runs for the same step, at DeepSeek-V3's attention shape, in one run.

Per case (batch B, keys S = the visible cache rows): q_latent [B, H, C], q_rope [B, H, R],
the cache's latents [B, S, C] and rotary keys [B, S, R], bf16. Each method first runs once and
is compared with an f32 computation of the same formula (max error over the largest output;
above --tolerance it is reported "wrong" and not timed). Time per call: n calls inside one jit
in a lax.fori_loop, each call's key count depending on the previous output (a scalar),
(t(n_long) - t(n_short)) / (n_long - n_short) (benchmarks/timing.py). The floor: the bytes a
step must move (q read, visible keys read, out written) over the HBM read bandwidth measured
in the same run (bench_grouped_gemm's sum).

Writes <out>/mla_decode_<device>.json and .png, and prints the table.

  python benchmarks/bench_mla_decode.py --out benchmarks/results/mla-decode-abc1234 --git-commit abc1234
  JAX_PLATFORMS=cpu python benchmarks/bench_mla_decode.py --quick --out /tmp/mla   # seconds
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `jax_moe` importable
  sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from benchmarks.arguments import csv_list  # noqa: E402
from benchmarks.environment import device_slug, provenance  # noqa: E402
from benchmarks.report import progress, write_json  # noqa: E402
from benchmarks.timing import time_per_iteration  # noqa: E402
from jax_moe.models import mla_decode  # noqa: E402

METHODS = ("pallas", "xla")


def inputs(batch, heads, latent, rope, keys, seed):
  k = jax.random.split(jax.random.key(seed), 4)
  draw = lambda key, shape: jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16)
  return (draw(k[0], (batch, heads, latent)), draw(k[1], (batch, heads, rope)),
          draw(k[2], (batch, keys, latent)), draw(k[3], (batch, keys, rope)))


def f32_reference(q_latent, q_rope, keys_latent, keys_rope, scale):
  f32 = lambda a: a.astype(jnp.float32)
  scores = (jnp.einsum("bhc,bsc->bhs", f32(q_latent), f32(keys_latent),
                       precision=jax.lax.Precision.HIGHEST)
            + jnp.einsum("bhr,bsr->bhs", f32(q_rope), f32(keys_rope),
                         precision=jax.lax.Precision.HIGHEST)) * scale
  return jnp.einsum("bhs,bsc->bhc", jax.nn.softmax(scores, -1), f32(keys_latent),
                    precision=jax.lax.Precision.HIGHEST)


def parse_config(text: str) -> mla_decode.KernelConfig:
  """"BH/BK/W/ST/SPLITS" (block_heads, block_keys, num_warps, num_stages, key_splits, 0 for
  the automatic count), e.g. 16/64/4/2/0."""
  try:
    bh, bk, warps, stages, splits = (int(v) for v in text.split("/"))
  except ValueError:
    raise argparse.ArgumentTypeError(f"--configs: {text!r} is not BH/BK/W/ST/SPLITS") from None
  return mla_decode.KernelConfig(bh, bk, warps, stages, splits or None)


def looped(method, config, scale):
  """(call, run): one call, and run(n, *args) = n dependent calls inside one jit. The inputs
  are arguments (as constants XLA would fold the einsums at compile time); each call's key
  count depends on the previous output (+ 0 * one element), a scalar, so no operand is
  rewritten in the loop (6ddf004's loop wrote one element of q, and the 16.8 MB q was copied
  every iteration)."""
  def call(num_keys, *args):
    return mla_decode.decode_attention(*args, num_keys, scale, implementation=method,
                                       config=config)

  @jax.jit
  def run(n, *args):
    def body(_, num_keys):
      out = call(num_keys, *args)
      return num_keys + (out[0, 0, 0] * 0).astype(jnp.int32)
    return jax.lax.fori_loop(0, n, body, jnp.int32(args[2].shape[1]))
  return jax.jit(call), run


def measure(args_ns, batch, keys, read_tb_s):
  H, C, R = args_ns.heads, args_ns.kv_lora_rank, args_ns.rope_dim
  args = inputs(batch, H, C, R, keys, args_ns.seed)
  scale = (128 + R) ** -0.5
  want = np.asarray(jax.jit(f32_reference, static_argnums=4)(*args, scale))
  moved = 2 * (batch * H * (C + R) + batch * keys * (C + R) + batch * H * C)
  floor_us = moved / (read_tb_s * 1e12) * 1e6 if read_tb_s else None
  variants = [("xla", None)] * ("xla" in args_ns.methods)
  if "pallas" in args_ns.methods:
    variants += [("pallas", c) for c in args_ns.configs]
  rows = []
  for method, config in variants:
    name = method if config is None else (
        f"pallas {config.block_heads}/{config.block_keys}/{config.num_warps}/"
        f"{config.num_stages}/{config.key_splits or 0}")
    label = f"{name} b{batch} s{keys}"
    row = dict(label=label, method=method, family="jax_moe" if method == "pallas" else "xla",
               config=None if config is None else dataclasses.asdict(config),
               batch=batch, keys=keys, bytes=moved, floor_us=floor_us)
    if config is not None:
      row["key_splits"] = config.key_splits or mla_decode.key_splits_for(batch, H, keys, config)
    try:
      call, run = looped(method, config or mla_decode.KernelConfig(), scale)
      out = call(jnp.int32(keys), *args)
      error = float(np.abs(np.asarray(out, np.float32) - want).max() / np.abs(want).max())
      row["error"] = error
      if error > args_ns.tolerance:
        row["status"] = "wrong"
      else:
        run(args_ns.short_iters, *args)  # compile
        timing, _ = time_per_iteration(lambda n: run(n, *args), args_ns.short_iters,
                                       args_ns.iters, args_ns.reps, args_ns.budget_s)
        row.update(status="ok", time=timing,
                   tb_per_s=moved / (timing["median_us"] * 1e-6) / 1e12,
                   x_floor=timing["median_us"] / floor_us if floor_us else None)
    except Exception as e:  # a method that fails is recorded, the others still run
      row.update(status="failed", error_text=f"{type(e).__name__}: {e}"[:2000])
    rows.append(row)
    t = row.get("time", {}).get("median_us")
    progress(f"{label}: {row['status']}" + (f", {t:.1f} us" if t else "")
             + (f", error {row['error']:.2e}" if "error" in row else ""))
  return rows


def plot(payload: dict, path: Path) -> bool:
  from benchmarks.plot import plot_time_bars
  rows = [r for r in payload["results"] if r["status"] == "ok"]
  env, cfg = payload["environment"], payload["config"]
  return plot_time_bars(
      rows, path, colors=["tab:blue" if r["method"] == "pallas" else "tab:orange" for r in rows],
      notes=[f"{r['time']['median_us']:.1f} us"
             + (f", floor {r['floor_us']:.1f}" if r.get("floor_us") else "") for r in rows],
      xlabel="microseconds per call (median, p10-p90)",
      title=f"MLA decode attention: H {cfg['heads']}, C {cfg['kv_lora_rank']}, "
            f"R {cfg['rope_dim']}, bf16\n{env['device_kind']}, jax {env['jax_version']}, "
            f"commit {str(env['git_commit'])[:10]}")


def parse(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--batch", type=csv_list(convert=int), default=[32, 128])
  p.add_argument("--keys", type=csv_list(convert=int), default=[65, 1024, 4096],
                 help="visible cache rows (the prompt and the tokens so far)")
  p.add_argument("--heads", type=int, default=128)
  p.add_argument("--kv-lora-rank", type=int, default=512)
  p.add_argument("--rope-dim", type=int, default=64)
  p.add_argument("--methods", type=csv_list(METHODS), default=list(METHODS))
  p.add_argument("--configs", type=csv_list(convert=parse_config),
                 default=[mla_decode.KernelConfig()],
                 help="the kernel's tilings to time, BH/BK/W/ST/SPLITS each (parse_config)")
  p.add_argument("--quick", action="store_true",
                 help="small shapes, few iterations, no bandwidth run: a smoke test on CPU")
  p.add_argument("--iters", type=int, default=200)
  p.add_argument("--short-iters", type=int, default=10)
  p.add_argument("--reps", type=int, default=5)
  p.add_argument("--budget-s", type=float, default=1.0)
  p.add_argument("--read-mib", type=int, default=4096,
                 help="MiB summed to measure the HBM read bandwidth (0: skip, no floor)")
  p.add_argument("--tolerance", type=float, default=2e-2)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--git-commit", default=None)
  p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
  args = p.parse_args(argv)
  if args.quick:
    args.batch, args.keys, args.heads, args.kv_lora_rank, args.rope_dim = [2], [20], 16, 32, 16
    args.iters, args.short_iters, args.reps, args.read_mib = 4, 1, 1, 0
  return args


def main(argv=None) -> int:
  args = parse(argv)
  mesh = Mesh(np.array(jax.devices()[:1]), ("x",))
  read = None
  if args.read_mib:
    from benchmarks.bench_grouped_gemm import measure_read
    read = measure_read(args.read_mib, argparse.Namespace(iters=20, short_iters=2, reps=args.reps,
                                                          budget_s=2.0))
  read_tb_s = read["tb_per_s"] if read else None
  results = []
  for batch in args.batch:
    for keys in args.keys:
      results.extend(measure(args, batch, keys, read_tb_s))
  payload = dict(benchmark="mla_decode", environment=provenance(mesh, args.git_commit),
                 config=dict(heads=args.heads, kv_lora_rank=args.kv_lora_rank,
                             rope_dim=args.rope_dim, batch=args.batch, keys=args.keys,
                             dtype="bfloat16", seed=args.seed),
                 read_bandwidth=read, results=results)
  stem = args.out / f"mla_decode_{device_slug(mesh)}"
  write_json(stem.with_suffix(".json"), payload)
  plotted = plot(payload, stem.with_suffix(".png"))
  print(f"{'case':<36} {'status':<7} {'us':>9} {'p10-p90':>17} {'TB/s':>6} {'x floor':>8}")
  for r in results:
    t = r.get("time")
    print(f"{r['label']:<36} {r['status']:<7} "
          + (f"{t['median_us']:9.1f} {t['p10_us']:8.1f}-{t['p90_us']:<8.1f} {r['tb_per_s']:6.2f} "
             + (f"{r['x_floor']:8.2f}" if r.get("x_floor") else f"{'-':>8}") if t else ""))
  print(f"wrote {stem}.json" + (" and .png" if plotted else ""))
  return 0 if all(r["status"] == "ok" for r in results) else 1


if __name__ == "__main__":
  sys.exit(main())
