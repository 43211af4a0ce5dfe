#!/usr/bin/env python3
"""Decode step time of the expert-parallel models, per MoE exchange backend.

For every model, the same weights (fixed seed) are built once per backend. First the
backends are checked against each other: f32 twins of the model with the exact MoE wire
(jax_moe.models.moe) must give the same prefill logits within 1e-5 of their largest
magnitude, and the bf16 models' logits gap is recorded. Then, per backend, the bf16 model
prefills a random prompt and runs greedy decode steps inside one jit (lax.fori_loop over the
step), timed as (t(n_long) - t(n_short)) / (n_long - n_short) per step (benchmarks/timing.py).
The prefill is timed the same way (prefills chained in a fori_loop) and given as TFLOP/s per
device and as a fraction of the device's dense bf16 peak (model FLOPs: benchmarks/flops.py).

Writes <out>/decode_<device>.json and .png and prints a table last.

  python benchmarks/bench_decode.py                                   # GPU defaults
  JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
    python benchmarks/bench_decode.py --models tiny-qwen3-moe --steps 4 --short-steps 1 \\
    --reps 2                                                          # CPU smoke run
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `jax_moe` importable
  sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import jax_moe as jm  # noqa: E402
from benchmarks import flops, report, stage_profile  # noqa: E402
from benchmarks.arguments import csv_list  # noqa: E402
from benchmarks.environment import device_slug, ep_mesh, provenance  # noqa: E402
from benchmarks.timing import summarize, time_per_iteration  # noqa: E402
from jax_moe import grouped_gemm, models  # noqa: E402
from jax_moe.models import moe  # noqa: E402

PARITY_TOLERANCE = 1e-5  # f32 twins, exact wire: only summation order may differ
# A larger model than the embedded tiny ones: Qwen3-MoE-like, 4 layers, 64 experts top-8.
SYNTHETIC = {
    "synthetic-qwen3-moe": {
        **models.TINY_CONFIGS["tiny-qwen3-moe"], "vocab_size": 32000, "hidden_size": 2048,
        "intermediate_size": 6144, "moe_intermediate_size": 768, "num_attention_heads": 16,
        "num_key_value_heads": 4, "head_dim": 128, "num_experts": 64, "num_experts_per_tok": 8,
        "mlp_only_layers": [],
    },
}
# Layer shapes of the served models (issue 16), random weights, few layers so one H200 holds
# them: DeepSeek-V3 with the 32 routed experts one GPU holds at EP8 (hidden 7168, MLA, top-8,
# one shared expert; every layer MoE) and Qwen3-235B-A22B with all 128 experts. Not in the
# default list: each takes minutes to build and check.
REALISTIC = {
    "dsv3-ep8-share": {
        **models.TINY_CONFIGS["tiny-deepseek-v3"], "vocab_size": 129280, "hidden_size": 7168,
        "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 4,
        "num_attention_heads": 128, "num_key_value_heads": 128, "n_routed_experts": 32,
        "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "first_k_dense_replace": 0,
        "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128,
    },
    "qwen3-235b-shape": {
        **models.TINY_CONFIGS["tiny-qwen3-moe"], "vocab_size": 151936, "hidden_size": 4096,
        "intermediate_size": 12288, "moe_intermediate_size": 1536, "num_attention_heads": 64,
        "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
        "num_experts_per_tok": 8, "mlp_only_layers": [],
    },
}
DEFAULT_MODELS = [*models.TINY_CONFIGS, *SYNTHETIC]
CONFIGS = {**models.TINY_CONFIGS, **SYNTHETIC, **REALISTIC}


def _csv(text: str) -> list[str]:
  return [v.strip() for v in text.split(",") if v.strip()]




def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--models", type=_csv, default=DEFAULT_MODELS,
                 help=f"comma-separated, from {list(CONFIGS)} (default {DEFAULT_MODELS})")
  p.add_argument("--layers", type=int, default=None,
                 help="override every model's num_hidden_layers")
  p.add_argument("--backends", type=_csv, default=None,
                 help="jax_moe backends (default: jm.available_backends())")
  p.add_argument("--batch", type=csv_list(convert=int), default=None,
                 help="sequences decoded together, comma-separated for several runs "
                      "(default: 16 per device)")
  p.add_argument("--copy-mib", type=int, default=None,
                 help="MiB of the read (the floors' HBM bandwidth) and of the copy "
                      "(default 4096 on GPUs, none elsewhere; 0: skip)")
  p.add_argument("--prompt-len", type=int, default=32)
  p.add_argument("--wire", choices=("bf16", "fp8"), default="bf16",
                 help="how the bf16 models move MoE tokens")
  p.add_argument("--expert-weights", choices=("dtype", "fp8"), default="dtype",
                 help="the routed experts' weights in bf16, or block-fp8 fed to the grouped "
                      "GEMM as such (the f32 check twins stay f32)")
  p.add_argument("--overlap-shared-experts", action="store_true",
                 help="run the shared experts (DeepSeek-V3's) between the halves of each MoE "
                      "layer's dispatch, while the routed rows travel (off in the models by "
                      "default until this measures the gain; the check twins take it too)")
  p.add_argument("--fuse-shared-experts", action="store_true",
                 help="run DeepSeek-V3's shared expert as one more expert slot of every token, "
                      "in the routed experts' grouped GEMMs (the bf16 check twin takes it too; "
                      "the f32 exact twins cannot: their wire sends each slot apart)")
  p.add_argument("--two-batch-overlap", action="store_true",
                 help="run each batch as two micro-batches, one's layers while the other's "
                      "dispatch travels (models.two_batch; the check twins take it too)")
  p.add_argument("--ep", type=int, default=None, help="use the first N devices (default all)")
  p.add_argument("--steps", type=int, default=32, help="decode steps of the long timed loop")
  p.add_argument("--short-steps", type=int, default=4, help="decode steps of the short loop")
  p.add_argument("--prefill-calls", type=int, default=4,
                 help="prefills of the long timed loop (the short loop runs one)")
  p.add_argument("--parity-layers", type=int, default=None,
                 help="layers of the parity check's twins (default: --layers); the check is of "
                      "the exchange, so 1 tells the same at a realistic shape for a fraction "
                      "of the build and compile (an f32 twin of dsv3-ep8-share is 34 GB)")
  p.add_argument("--parity-batch", type=int, default=None,
                 help="batch of the parity check (default: the first --batch); the f32 twins "
                      "run their experts through jax.lax.ragged_dot, which at qwen3-235b-shape "
                      "and batch 128 asks for 64 GiB (seen at 9ae817c on one H200)")
  p.add_argument("--bf16-parity", action=argparse.BooleanOptionalAction, default=True,
                 help="after the f32 twins' check, also record the bf16 models' logits gap "
                      "(one more build and compile per backend; --no-bf16-parity saves them "
                      "where a realistic shape must fit a time limit)")
  p.add_argument("--stages", action=argparse.BooleanOptionalAction, default=True,
                 help="profile a few decode steps and one prefill: kernel time per stage "
                      "(attention, router, dispatch, experts, combine, ...) into the JSON and, "
                      "for the decode steps, a stacked-bar PNG")
  p.add_argument("--jax-user-peer", action=argparse.BooleanOptionalAction, default=True,
                 help="also time the model with the xla exchange and lax.ragged_dot experts "
                      "(what a JAX user has today; only where tokamax is the default GEMM, "
                      "elsewhere the xla rows already are that)")
  p.add_argument("--reps", type=int, default=5)
  p.add_argument("--budget-s", type=float, default=30.0,
                 help="shorten the long loop to about this many seconds")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
  p.add_argument("--git-commit", default=None,
                 help="commit to record when the checkout has no .git (a copied tree)")
  args = p.parse_args(argv)
  unknown = [m for m in args.models if m not in CONFIGS]
  if unknown:
    p.error(f"--models: unknown {unknown}; choose from {list(CONFIGS)}")
  if not 0 <= args.short_steps < args.steps:
    p.error(f"--short-steps must be in [0, --steps), got {args.short_steps} and {args.steps}")
  if args.reps < 1 or args.prompt_len < 1:
    p.error("--reps and --prompt-len must be >= 1")
  if args.prefill_calls < 2:
    p.error(f"--prefill-calls must be >= 2, got {args.prefill_calls}")
  if args.batch is not None and (not args.batch or min(args.batch) < 1):
    p.error(f"--batch takes positive integers like 32,128, got {args.batch}")
  for name in ("layers", "parity_layers", "parity_batch"):
    if getattr(args, name) is not None and getattr(args, name) < 1:
      p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
  return args


def model_config(name: str, layers: int | None) -> dict:
  config = dict(CONFIGS[name])
  if layers is not None:
    config["num_hidden_layers"] = layers
  return config


def _build(name, mesh, backend, dtype, wire, seed, layers=None, expert_weights="dtype",
           overlap_shared_experts=False, two_batch_overlap=False, fuse_shared_experts=False):
  return models.from_config(model_config(name, layers), mesh=mesh, backend=backend, dtype=dtype,
                            wire=wire, seed=seed, expert_weights=expert_weights,
                            overlap_shared_experts=overlap_shared_experts,
                            two_batch_overlap=two_batch_overlap,
                            fuse_shared_experts=fuse_shared_experts)


def bytes_on_first_device(tree) -> int:
  """Bytes of the arrays in `tree` held by the mesh's first device (one rank's share: what a
  decode step must read at least once from HBM)."""
  total = 0
  for leaf in jax.tree.leaves(tree):
    if isinstance(leaf, jax.Array) and leaf.addressable_shards:
      total += leaf.addressable_shards[0].data.nbytes
  return total


def _prompt(model, batch, prompt_len, seed):
  return jax.random.randint(jax.random.key(seed + 1), (batch, prompt_len), 0, model.vocab_size,
                            jnp.int32)


def check_backends(name, mesh, backends, args, batch) -> dict:
  """Prefill logits of each backend against the first: f32 exact twins, then the bf16 models."""
  layers = args.parity_layers or args.layers
  parity = {"tolerance": PARITY_TOLERANCE, "reference_backend": backends[0], "batch": batch,
            "layers": model_config(name, layers)["num_hidden_layers"]}
  twins = [(jnp.float32, "exact", "f32_exact")]
  if args.bf16_parity:
    twins.append((jnp.bfloat16, args.wire, "bf16"))
  for dtype, wire, key in twins:
    logits = {}
    # f32 twins at full matmul precision: at the default, XLA:GPU may pick TF32 for the dense
    # layers in one program and not in the other (suspected cause of a 3e-4 gap on 2xH200).
    precision = "highest" if dtype == jnp.float32 else "default"
    for backend in backends:
      model = _build(name, mesh, backend, dtype, wire, args.seed, layers,
                     overlap_shared_experts=args.overlap_shared_experts,
                     two_batch_overlap=args.two_batch_overlap,
                     fuse_shared_experts=args.fuse_shared_experts and wire != "exact")
      with jax.default_matmul_precision(precision):
        logits[backend] = np.asarray(models.forward(model, _prompt(model, batch, args.prompt_len,
                                                                    args.seed)))
      model.pool.check()
      model.pool.close()
      del model  # before the next backend's twin is built: one model in HBM at a time
      report.progress(f"{name} parity {key} {backend}: done")
    ref = logits[backends[0]]
    parity[key] = {b: float(np.abs(v - ref).max() / np.abs(ref).max()) for b, v in logits.items()}
  parity["ok"] = all(gap <= PARITY_TOLERANCE for gap in parity["f32_exact"].values())
  return parity


def decode_program(model, batch, prompt_len, max_len):
  """jit(prefill), jit(n prefills in a fori_loop), jit(n greedy decode steps in a fori_loop)
  and jit(an empty cache) for one model."""
  model.prepare(batch, prompt_len)  # communicators of the prompt and of one token per sequence
  model.prepare(batch, 1)
  graphdef, state = nnx.split(model)

  @jax.jit
  def empty_cache(state):
    return nnx.merge(graphdef, state).init_cache(batch, max_len)

  @jax.jit
  def prefill(state, ids_bs):
    model = nnx.merge(graphdef, state)
    logits_bsv, cache = model(ids_bs, cache=model.init_cache(batch, max_len), logits_to_keep=1)
    return jnp.argmax(logits_bsv[:, -1], -1).astype(jnp.int32), cache

  @jax.jit
  def prefill_loop(state, ids_bs, n):
    """n prefills one after another: each prompt depends on the last one's tokens (never -1,
    so the values stay the same) and no prefill is loop-invariant."""
    def body(_, ids_bs):
      token_b, _ = prefill(state, ids_bs)
      return jnp.where(token_b[:, None] == -1, 0, ids_bs)
    return jax.lax.fori_loop(0, n, body, ids_bs)

  @jax.jit
  def decode(state, token_b, cache, n):
    model = nnx.merge(graphdef, state)

    def step(_, carry):
      token_b, cache = carry
      logits_bsv, cache = model(token_b[:, None], cache=cache)
      return jnp.argmax(logits_bsv[:, -1], -1).astype(jnp.int32), cache

    return jax.lax.fori_loop(0, n, step, (token_b, cache))

  return state, prefill, prefill_loop, decode, empty_cache


def out_of_memory(e: Exception) -> bool:
  return isinstance(e, jax.errors.JaxRuntimeError) and "RESOURCE_EXHAUSTED" in str(e)


def profile_loop(jitted, args_before_n: tuple, n: int, median_us: float) -> dict:
  """Kernel time per stage of one call `jitted(*args_before_n, n)` (n steps of its loop),
  with the step time not spent in a kernel (`gaps_us`, against the timed `median_us`)."""
  profiled = stage_profile.jit_for_profile(jitted)
  compiled = profiled.lower(*args_before_n, n).compile()
  stages = stage_profile.profile_stages(lambda: profiled(*args_before_n, n), compiled, n)
  stages["gaps_us"] = median_us - stages["total_us"]
  return stages


def time_prefill(model, mesh, args, batch, state, ids, prefill, prefill_loop) -> dict:
  """Wall time of single prefills and device time of chained ones, with the model FLOPs."""
  prefill_wall_us = []
  for _ in range(args.reps):
    start = time.perf_counter()
    jax.block_until_ready(prefill(state, ids))
    prefill_wall_us.append((time.perf_counter() - start) * 1e6)
  jax.block_until_ready(prefill_loop(state, ids, 1))  # compile
  prefill_time, _ = time_per_iteration(lambda n: prefill_loop(state, ids, n), 1,
                                       args.prefill_calls, args.reps, args.budget_s)
  work = flops.prefill_flops(model, batch, args.prompt_len)
  per_s = work["total"] / mesh.devices.size / (prefill_time["median_us"] * 1e-6)  # a device's
  peak = flops.bf16_peak_flops(mesh.devices.flat[0].device_kind)
  # kernel time per stage of one prefill, as for the decode steps
  stages = (profile_loop(prefill_loop, (state, ids), 1, prefill_time["median_us"])
            if args.stages else None)
  return {"time": prefill_time, "wall": summarize(prefill_wall_us), "flops": work,
          "tflops_per_device": per_s / 1e12,
          "fraction_of_bf16_peak": None if peak is None else per_s / peak, "stages": stages}


def time_model(name, mesh, backend, args, batch, read, prefill_may_fail=False,
               label=None) -> dict:
  """Prefill and decode of one model. With `prefill_may_fail`, a prefill that runs out of
  memory is recorded as such and the decode starts from an empty cache (a step reads the
  whole cache, masked, so it costs the same at any position)."""
  model = _build(name, mesh, backend, jnp.bfloat16, args.wire, args.seed, args.layers,
                 args.expert_weights, args.overlap_shared_experts, args.two_batch_overlap,
                 args.fuse_shared_experts)
  ids = _prompt(model, batch, args.prompt_len, args.seed)
  # the prompt is prefilled at max_len = prompt + steps so one cache shape serves every n
  max_len = args.prompt_len + args.steps + 1
  state, prefill, prefill_loop, decode, empty_cache = decode_program(model, batch,
                                                                     args.prompt_len, max_len)
  label = label or f"{name} b{batch} {backend}"
  report.progress(f"{label}: built")
  try:
    token_b, cache = jax.block_until_ready(prefill(state, ids))
    report.progress(f"{label}: prefill compiled and run")
    prefill_result = time_prefill(model, mesh, args, batch, state, ids, prefill, prefill_loop)
    report.progress(f"{label}: prefill timed")
  except Exception as e:  # noqa: BLE001 - only running out of memory is a result
    if not (prefill_may_fail and out_of_memory(e)):
      raise
    prefill_result = {"status": "out of memory", "reason": str(e).splitlines()[0]}
    token_b, cache = ids[:, -1], jax.block_until_ready(empty_cache(state))
  jax.block_until_ready(decode(state, token_b, cache, 1))  # compile
  report.progress(f"{label}: decode compiled")
  timing, _ = time_per_iteration(lambda n: decode(state, token_b, cache, n), args.short_steps,
                                 args.steps, args.reps, args.budget_s)
  report.progress(f"{label}: decode timed, {timing['median_us']:.1f} us a step")
  # What one step reads at least once per rank: its weights and its whole KV cache (the
  # attention reads every position of the cache, masked). Of an untied embedding table a step
  # reads only its batch's rows, not the table.
  embedding = 0 if model.lm_head is None else bytes_on_first_device(
      nnx.state(model.embed_tokens, nnx.Param))
  floor = {"weight_bytes": bytes_on_first_device(nnx.state(model, nnx.Param)) - embedding,
           "embedding_table_bytes_not_read": embedding,
           "cache_bytes": bytes_on_first_device(cache)}
  if read is not None:
    floor["hbm_floor_us"] = (floor["weight_bytes"] + floor["cache_bytes"]) / (
        read["tb_per_s"] * 1e6)
    floor["step_over_floor"] = timing["median_us"] / floor["hbm_floor_us"]
  stages = None
  if args.stages:  # kernel time per stage of a few steps, from a profiler trace
    stages = profile_loop(decode, (state, token_b, cache), min(args.steps, 8),
                          timing["median_us"])
    report.progress(f"{label}: stages profiled")
  model.pool.check()
  model.pool.close()
  return {"label": label, "model": name, "backend": backend,
          "batch": batch, "status": "ok", "family": "jax_moe", "time": timing,
          "prefill": prefill_result, "floor": floor, "stages": stages,
          "decode_tokens_per_s": batch / (timing["median_us"] * 1e-6),
          "layout": model.layout()}


def time_jax_user_peer(name, mesh, args, batch, read) -> dict:
  """The same model as a JAX user runs it today: the xla exchange and the experts through
  jax.lax.ragged_dot (models.moe.GEMM_IMPLEMENTATION, read while tracing). Running out of
  memory is a result too (seen at the realistic prefill sizes)."""
  label = f"{name} b{batch} xla+lax.ragged_dot"
  saved, moe.GEMM_IMPLEMENTATION = moe.GEMM_IMPLEMENTATION, "lax"
  try:
    result = time_model(name, mesh, "xla", args, batch, read, prefill_may_fail=True,
                        label=label)
  except Exception as e:  # noqa: BLE001 - only running out of memory is a result
    if not out_of_memory(e):
      raise
    return {"label": label, "model": name, "backend": "xla", "batch": batch,
            "status": "out of memory", "family": "peer", "reason": str(e).splitlines()[0]}
  finally:
    moe.GEMM_IMPLEMENTATION = saved
  return dict(result, label=label, family="peer")


def compare_with_peer(row: list) -> None:
  """Issue 16's ratios, in each timed result of one (model, batch): the exchange's share of
  the step (dispatch + combine kernel time from the stage profile over the step time) and
  tokens/s over the JAX-user peer's (when it ran)."""
  peer = next((r for r in row if r.get("family") == "peer" and r["status"] == "ok"), None)
  for r in row:
    if r["status"] != "ok":
      continue
    if r.get("stages"):
      per_stage = r["stages"]["stages_us"]
      r["exchange_fraction_of_step"] = ((per_stage["dispatch"] + per_stage["combine"])
                                        / r["time"]["median_us"])
    if peer is not None and r is not peer:
      r["tokens_per_s_over_jax_user"] = r["decode_tokens_per_s"] / peer["decode_tokens_per_s"]


def measure_bandwidth(mib: int, reps: int) -> tuple[dict, dict]:
  """The HBM read bandwidth (bench_grouped_gemm's sum: bytes read per second), the floors'
  denominator since a decode step mostly reads, and the copy bandwidth (read + written)
  beside it."""
  from benchmarks.bench_grouped_gemm import measure_copy, measure_read
  args_ns = argparse.Namespace(iters=20, short_iters=2, reps=reps, budget_s=2.0)
  return measure_read(mib, args_ns), measure_copy(mib, args_ns)


def plot(payload: dict, path: Path) -> bool:
  from benchmarks.plot import plot_time_bars
  rows = [r for r in payload["results"] if r["status"] == "ok"]
  env, cfg = payload["environment"], payload["config"]
  batches = ",".join(map(str, cfg["batch"]))
  return plot_time_bars(
      rows, path, colors=["tab:blue" if r["backend"] == "cuda" else "tab:orange" for r in rows],
      notes=[f"{r['time']['median_us']:.0f} us, {r['decode_tokens_per_s']:.0f} tok/s"
             for r in rows],
      xlabel="microseconds per decode step (median, p10-p90)",
      title=f"decode: batch {batches}, prompt {cfg['prompt_len']}, bf16, {cfg['wire']} MoE wire\n"
            f"{env['device_count']} x {env['device_kind']}, jax {env['jax_version']}, "
            f"commit {str(env['git_commit'])[:10]}")


def plot_stages(payload: dict, path: Path) -> bool:
  """Stacked bars of each result's decode step: kernel time per stage, then the gaps."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  rows = [r for r in payload["results"] if r["status"] == "ok" and r.get("stages")]
  if not rows:
    return False
  names = [*rows[0]["stages"]["stages_us"], "gaps"]
  fig, ax = plt.subplots(figsize=(9, 0.4 * len(rows) + 2.4))
  left = np.zeros(len(rows))
  for i, name in enumerate(names):
    widths = np.array([max(r["stages"]["gaps_us"], 0.0) if name == "gaps" else
                       r["stages"]["stages_us"][name] for r in rows])
    ax.barh(range(len(rows)), widths, left=left, label=name,
            color="lightgrey" if name == "gaps" else plt.cm.tab10(i))
    left += widths
  ax.set_yticks(range(len(rows)), [r["label"] for r in rows], fontsize=8)
  ax.invert_yaxis()
  ax.set_xlabel("microseconds per decode step (kernel time by stage; gaps = step - kernels)")
  env = payload["environment"]
  ax.set_title(f"decode step by stage: {env['device_count']} x {env['device_kind']}, "
               f"commit {str(env['git_commit'])[:10]}", fontsize=9)
  ax.legend(fontsize=7, ncol=5, loc="upper center", bbox_to_anchor=(0.5, -0.3))
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return True


def _table(results) -> str:
  def opt(value, form):
    return "-" if value is None else format(value, form)

  header = (f"{'model batch backend':40} {'status':8} {'step us':>9} {'p10-p90':>15} "
            f"{'tok/s':>9} {'x floor':>8} {'exch':>5} {'x user':>6} {'prefill ms':>10} "
            f"{'TFLOP/s':>8} {'of peak':>7}")
  lines = [header, "-" * len(header)]
  for r in results:
    if r["status"] != "ok":
      lines.append(f"{r['label'][:40]:40} {r['status']:8} {r.get('reason', '')[:120]}")
      continue
    t, pre = r["time"], r["prefill"]
    prefill = (f"{pre['time']['median_us'] / 1e3:10.2f} {pre['tflops_per_device']:8.2f} "
               f"{opt(pre['fraction_of_bf16_peak'], '.0%'):>7}") if "time" in pre else \
        f"{pre['status']:>27}"
    lines.append(f"{r['label'][:40]:40} {'ok':8} {t['median_us']:9.1f} "
                 f"{t['p10_us']:7.1f}-{t['p90_us']:<7.1f} {r['decode_tokens_per_s']:9.0f} "
                 f"{opt(r['floor'].get('step_over_floor'), '.2f'):>8} "
                 f"{opt(r.get('exchange_fraction_of_step'), '.0%'):>5} "
                 f"{opt(r.get('tokens_per_s_over_jax_user'), '.2f'):>6} {prefill}")
  return "\n".join(lines)


def main(argv=None) -> int:
  args = parse_args(argv)
  mesh = ep_mesh(args.ep)
  available = jm.available_backends()
  backends = args.backends or available
  missing = [b for b in backends if b not in available]
  if missing:
    print(f"backends {missing} are not available here (available: {available})", file=sys.stderr)
    return 2
  batches = args.batch or [16 * mesh.devices.size]
  copy_mib = args.copy_mib if args.copy_mib is not None else (
      4096 if jax.default_backend() == "gpu" else 0)
  read, copy = measure_bandwidth(copy_mib, args.reps) if copy_mib else (None, None)
  tokamax_ok, gemm = grouped_gemm.tokamax_status()
  if jax.default_backend() == "gpu" and not tokamax_ok:
    # Seen at 5f5a9ce on one H200: dsv3-ep8-share at batch 128 (4096 prompt tokens) asked for
    # one 14.7 GiB buffer in prefill, the size of [32 experts, capacity, 7168] bf16.
    print(f"warning: the experts' grouped GEMMs fall back to jax.lax.ragged_dot ({gemm}); on "
          "GPUs it is several times slower than tokamax's kernel and at prefill sizes of the "
          "realistic models it runs out of memory", file=sys.stderr)
  if read is not None:
    print(f"read bandwidth {read['tb_per_s']:.2f} TB/s ({read['method']}); copy "
          f"{copy['tb_per_s']:.2f} TB/s read + written ({copy['method']})")
  results, parity = [], {}
  stem = args.out / f"decode_{device_slug(mesh)}"

  def payload() -> dict:
    return {
        "benchmark": "decode",
        "environment": provenance(mesh, args.git_commit),
        "config": {"batch": batches, "prompt_len": args.prompt_len, "wire": args.wire,
                   "expert_weights": args.expert_weights,
                   "overlap_shared_experts": args.overlap_shared_experts,
                   "two_batch_overlap": args.two_batch_overlap,
                   "fuse_shared_experts": args.fuse_shared_experts,
                   "dtype": "bfloat16", "backends": backends, "seed": args.seed,
                   "models": {name: model_config(name, args.layers) for name in args.models}},
        "read_bandwidth": read,
        "copy_bandwidth": copy,
        "grouped_gemm": {"implementation": moe.GEMM_IMPLEMENTATION,
                         "tokamax": tokamax_ok, "status": gemm},
        "parity": parity,
        "results": results,
    }

  for name in args.models:
    try:
      parity[name] = check_backends(name, mesh, backends, args,
                                    args.parity_batch or batches[0])
    except NotImplementedError as e:  # a registered model class missing from this build
      results.append({"label": name, "model": name, "status": "skipped", "reason": str(e)})
      continue
    if not parity[name]["ok"]:
      results.append({"label": name, "model": name, "status": "failed",
                      "reason": f"backends disagree: {parity[name]['f32_exact']}"})
      continue
    for batch in batches:
      row = []
      timed = [functools.partial(time_model, name, mesh, backend) for backend in backends]
      if args.jax_user_peer and tokamax_ok:
        timed.append(functools.partial(time_jax_user_peer, name, mesh))
      for time_one in timed:
        row.append(time_one(args, batch, read))
        results.append(row[-1])
        compare_with_peer(row)
        # after every result, so a run cut short by its time limit keeps what it measured
        report.write_json(stem.with_suffix(".json"), payload())
  final = payload()
  report.write_json(stem.with_suffix(".json"), final)
  plotted = plot(final, stem.with_suffix(".png"))
  stages_png = stem.with_name(stem.name + "_stages.png")
  staged = plot_stages(final, stages_png)
  print(f"wrote {stem}.json" + (" and .png" if plotted else "") +
        (f", {stages_png.name}" if staged else ""))
  print(_table(results))
  failed = [r for r in results if r["status"] == "failed"]
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
