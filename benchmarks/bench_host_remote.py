#!/usr/bin/env python3
"""Host backend (or the cuda backend's host proxies) across two processes against the raw
TransferEngine.

Two processes on one host (jax.distributed on 127.0.0.1), one CPU device each by default, so
every peer rank is remote and reached through the TransferEngine, per provider (shm default,
tcp;ofi_rxm on 127.0.0.1). Per phase, dispatch dtype and combine mode, in the same processes
(benchmarks/host_remote_worker.py):
- the host backend's fused dispatch + identity expert + combine is checked against the dense
  reference (benchmarks/reference.py), then timed: fused, and dispatch and combine alone
  (benchmarks/methods.py bodies in a jitted fori_loop, per-iteration time from two loop
  lengths, median and p10/p90 over --reps);
- the bytes and writes that cross the process boundary for that routing are derived from it
  (benchmarks/remote_traffic.py) and a bare TransferEngine between the same two processes,
  same provider, moves them (benchmarks/raw_exchange.py): `same_writes` (the host protocol's
  writes and acknowledgements, no computation) and `one_write` (one write per phase);
- the xla backend's fused exchange (all_to_all between the processes), for context.
Targets (TARGET_RATIOS): issue 5's host fused <= 2 x raw same_writes; issue 13's cuda-proxy
fused <= 1.5 x. Each number is the slower of the two processes' medians.

`--platform cuda` (a machine with 2 GPUs): process i drives GPU i and the timed backend is
`cuda-proxy`, the cuda backend with every peer forced remote (JAX_MOE_FORCE_REMOTE=1): each
GPU exchanges through its host proxy, whose host exchange writes to the other process through
the TransferEngine. The proxies' own timings come back too: per request kind, the median
time from the doorbell seen to the first remote write posted (the proxy-overhead
target of issues 5 and 13: <= 5 us) and to the request done. For context the same run times
the cuda backend over CUDA IPC (NVLink between the processes) and the xla backend.

Writes <out>/host_remote_<host>.json and .png and prints a table.

  python benchmarks/bench_host_remote.py                          # decode defaults, minutes
  python benchmarks/bench_host_remote.py --providers 'shm,tcp;ofi_rxm' \\
    --phases decode=128,prefill=512                               # README's run
  python benchmarks/bench_host_remote.py --hidden 256 --experts 16 --topk 4 --phases tiny=8 \\
    --iters 3 --short-iters 1 --reps 1                            # smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `jax_moe` importable
  sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import report  # noqa: E402
from benchmarks.arguments import csv_list, phases  # noqa: E402
from benchmarks.environment import _git  # noqa: E402
from benchmarks.processes import free_loopback_port, private_mps, wait_all  # noqa: E402

WORKER = Path(__file__).with_name("host_remote_worker.py")
REPO_ROOT = Path(__file__).resolve().parents[1]
PROVIDERS = {"shm": "", "tcp;ofi_rxm": "127.0.0.1"}  # provider -> JAX_MOE_HOST_NODE
OPS = ("fused", "dispatch", "combine")
BACKENDS = {"cpu": "host", "cuda": "cuda-proxy"}  # the timed backend of each --platform
# fused <= this x the raw same writes, per --platform: the host backend's (issue 5) and the
# cuda backend's host proxies' (issue 13)
TARGET_RATIOS = {"cpu": 2.0, "cuda": 1.5}


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--providers", type=csv_list(PROVIDERS), default=["shm"],
                 help="comma-separated, from: " + ", ".join(PROVIDERS))
  p.add_argument("--platform", choices=tuple(BACKENDS), default="cpu",
                 help="cpu: the host backend on CPU devices; cuda: the cuda backend through "
                      "its host proxies, GPU i %% --gpus in process i")
  p.add_argument("--gpus", type=int, default=2,
                 help="--platform cuda: GPUs the processes are spread over (1: both share "
                      "GPU 0; then pass --no-nvlink)")
  p.add_argument("--mps", action="store_true",
                 help="--platform cuda --gpus 1 --no-nvlink: the two processes are clients of "
                      "a CUDA MPS daemon this run starts (private pipe folder, quit at the end), "
                      "so their kernels share the GPU at once instead of in time slices; tells "
                      "apart what the proxy path costs from what sharing one GPU costs")
  p.add_argument("--hidden", type=int, default=7168)
  p.add_argument("--experts", type=int, default=256)
  p.add_argument("--topk", type=int, default=8)
  p.add_argument("--block-size", type=int, default=128, help="fp8 scale block along hidden")
  p.add_argument("--phases", type=phases, default=phases("decode=128"),
                 help="NAME=TOKENS_PER_RANK,... (default decode=128)")
  p.add_argument("--dispatch-dtypes", type=csv_list(("fp8", "bf16")), default=["fp8", "bf16"])
  p.add_argument("--reduce", type=csv_list(("source", "expert")), default=["source", "expert"])
  p.add_argument("--partial-dtype", choices=("f32", "bf16"), default="f32")
  p.add_argument("--ops", type=csv_list(OPS), default=list(OPS), help="host backend ops to time")
  p.add_argument("--routing", choices=("uniform", "skewed"), default="uniform")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--devices-per-process", type=int, default=1,
                 help="CPU devices (ranks) per process; ranks of one process share memory")
  p.add_argument("--iters", type=int, default=10, help="iterations of the long timed loop")
  p.add_argument("--steps-per-iteration", type=int, default=4,
                 help="exchanges per loop iteration; the times are per exchange (a fori_loop "
                      "iteration costs ~20 us of its own on a GPU, which the raw engine's "
                      "loop does not pay)")
  p.add_argument("--short-iters", type=int, default=2, help="iterations of the short loop")
  p.add_argument("--reps", type=int, default=5, help="(short, long) pairs per method")
  p.add_argument("--raw-iters", type=int, default=40,
                 help="exchanges of the raw engine's long loop (it is cheap and noisy)")
  p.add_argument("--raw-short-iters", type=int, default=8)
  p.add_argument("--trace-iters", type=int, default=0,
                 help="also trace this many fused steps in each process (jax.profiler, CUPTI) "
                      "and report every kernel's device time (0: no trace)")
  p.add_argument("--one-host", action="store_true",
                 help="the two processes count as one host (JAX_MOE_HOST_GROUP): the timed "
                      "backend's ranks (host backend, or the cuda proxies' host states) share "
                      "memory instead of writing through the TransferEngine (the raw engine's "
                      "loops still use it)")
  p.add_argument("--no-xla", action="store_true", help="skip the xla backend")
  p.add_argument("--no-nvlink", action="store_true",
                 help="--platform cuda: skip the cuda backend over CUDA IPC")
  p.add_argument("--no-pin", action="store_true",
                 help="--platform cpu: let the two processes share every core (default: one "
                      "core each; on GPUs they always share, the proxy threads need cores)")
  p.add_argument("--timeout-s", type=float, default=30.0,
                 help="JAX_MOE_TIMEOUT_S of the workers: bound of every wait")
  p.add_argument("--worker-timeout-s", type=float, default=1200.0,
                 help="the workers of one provider are killed after this long")
  p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "host-remote")
  p.add_argument("--git-commit", default=None, help="names the code in a tree without .git")
  args = p.parse_args(argv)
  if args.steps_per_iteration < 1:
    p.error(f"--steps-per-iteration must be >= 1, got {args.steps_per_iteration}")
  if not 0 <= args.short_iters < args.iters:
    p.error(f"--short-iters must be in [0, --iters), got {args.short_iters} and {args.iters}")
  if not 0 <= args.raw_short_iters < args.raw_iters:
    p.error(f"--raw-short-iters must be in [0, --raw-iters), got {args.raw_short_iters} and "
            f"{args.raw_iters}")
  if args.trace_iters < 0:
    p.error(f"--trace-iters must be >= 0, got {args.trace_iters}")
  if args.reps < 1:
    p.error(f"--reps must be >= 1, got {args.reps}")
  if args.devices_per_process < 1 or (args.platform == "cuda" and args.devices_per_process != 1):
    p.error(f"--devices-per-process must be >= 1 (1 with --platform cuda), got "
            f"{args.devices_per_process}")
  for name in ("providers", "dispatch_dtypes", "reduce", "ops"):
    if not getattr(args, name):
      p.error(f"--{name.replace('_', '-')} must name at least one")
  if args.mps and (args.platform != "cuda" or args.gpus != 1 or not args.no_nvlink):
    # The NVLink kernels of the two processes spin on each other with a block on every SM:
    # side by side under MPS one launch can hold every SM while the other waits to start.
    p.error(f"--mps needs --platform cuda --gpus 1 --no-nvlink, got --platform "
            f"{args.platform} --gpus {args.gpus}" + ("" if args.no_nvlink else " (NVLink on)"))
  if "fused" not in args.ops:
    p.error("--ops must include fused (it is the op checked against the reference)")
  return args


def run_provider(provider: str, config: dict, args, folder: Path,
                 extra_env: dict | None = None) -> list[list[dict]]:
  """Starts the two workers for `provider` (with `extra_env` added to their environment);
  returns each one's records or raises with the workers' errors."""
  config_path = folder / "config.json"
  config_path.write_text(json.dumps(config))
  port = free_loopback_port()
  env = dict(os.environ, JAX_MOE_HOST_PROVIDER=provider, JAX_MOE_HOST_NODE=PROVIDERS[provider],
             JAX_MOE_TIMEOUT_S=str(args.timeout_s), PYTHONUNBUFFERED="1", **(extra_env or {}))
  results = [folder / f"result{i}.json" for i in range(2)]
  # The host backend's workers stand for a host each (JAX_MOE_HOST_GROUP), so their ranks
  # meet through the TransferEngine; --one-host puts both on one host (shared memory). On GPUs
  # the processes keep the machine's host (the NVLink comparison needs it) and the proxies'
  # communicator gives each process a host of its own (benchmarks/methods.py) unless
  # --one-host sets one for both.
  hosts = (["host0", "host0"] if args.one_host else
           ["host0", "host1"] if args.platform == "cpu" else [None, None])
  workers = [subprocess.Popen([sys.executable, str(WORKER), str(config_path), str(i), str(port),
                               str(results[i])], cwd=REPO_ROOT,
                              env=env if hosts[i] is None else
                              dict(env, JAX_MOE_HOST_GROUP=hosts[i]),
                              stdin=subprocess.DEVNULL)
             for i in range(2)]
  codes = wait_all(workers, args.worker_timeout_s)
  found = [json.loads(r.read_text()) if r.exists() else None for r in results]
  if codes != [0, 0] or any(f is None or not f["ok"] for f in found):
    reasons = [f"worker {i}: exit code {code}, "
               + ("no result file" if f is None else str(f["error"]).splitlines()[0][:300])
               for i, (code, f) in enumerate(zip(codes, found))]
    raise RuntimeError(f"{provider}: " + "; ".join(reasons))
  return [f["records"] for f in found]


def _cpu_model() -> str | None:
  try:
    text = Path("/proc/cpuinfo").read_text()
  except OSError:
    return None
  return next((line.split(":", 1)[1].strip() for line in text.splitlines()
               if line.startswith("model name")), None)


def _median(record: dict | None) -> float | None:
  if not record or record.get("status") != "ok":
    return None
  return record["time"]["median_us"]


def _slower(records: list[dict | None]) -> float | None:
  """The slower process's median (None when either failed)."""
  medians = [_median(r) for r in records]
  return None if any(m is None for m in medians) else max(medians)


def summarize_rows(provider: str, per_process: list[list[dict]], platform: str) -> list[dict]:
  rows = []
  for mine, theirs in zip(*per_process):
    both = (mine, theirs)
    host = {op: _slower([p["jax_moe"].get(op) for p in both]) for op in mine["jax_moe"]}
    raw = {mode: _slower([p["raw"][mode] for p in both]) for mode in mine["raw"]}
    xla = _slower([p.get("xla") for p in both]) if "xla" in mine else None
    nvlink = _slower([p.get("cuda") for p in both]) if "cuda" in mine else None
    ratio = lambda a, b: None if a is None or not b else a / b  # noqa: E731
    target = ratio(host["fused"], raw.get("same_writes"))
    rows.append({
        "provider": provider, "phase": mine["phase"], "tokens_per_rank": mine["tokens_per_rank"],
        "dispatch_dtype": mine["dispatch_dtype"], "reduce": mine["reduce"],
        "bytes_0to1": mine["traffic"][0]["bytes"], "bytes_1to0": mine["traffic"][1]["bytes"],
        "writes_0to1": mine["traffic"][0]["writes"], "writes_1to0": mine["traffic"][1]["writes"],
        "backend_us": host, "raw_us": raw, "xla_us": xla, "nvlink_us": nvlink,
        "proxy": [p.get("proxy") for p in both],
        "correct": all(p["jax_moe"]["fused"].get("correctness", {}).get("passed") for p in both),
        "ratio_fused_vs_same_writes": target,
        "ratio_fused_vs_one_write": ratio(host["fused"], raw.get("one_write")),
        "target_ratio": TARGET_RATIOS[platform],
        "meets_target": None if target is None else target <= TARGET_RATIOS[platform],
    })
  return rows


# The request that posts a dispatch's rows (after the send kernel): the send half's closing
# request, alone or (fused dispatch) joined with the receive half's opening (host_proxy.cc).
POSTING_REQUESTS = ("dispatch_send.end", "dispatch_send.end+recv.begin")


def _first_post_us(row: dict) -> float | None:
  """The proxies' dispatch_send median, doorbell of the request that posts seen -> first
  remote write (slower process)."""
  values = []
  for requests in row["proxy"]:
    found = [(requests or {}).get(op, {}).get("first_post_us") for op in POSTING_REQUESTS]
    values.append(next((v for v in found if v is not None), None))
  return None if any(v is None for v in values) else max(values)


def proxy_phases(rows: list[dict]) -> str:
  """Per row, where a proxy exchange's time goes, request by request (each process's proxy,
  medians): the GPU's part before the request (previous answer -> this doorbell) and the
  proxy's own (doorbell -> answer)."""
  lines = []
  for r in rows:
    for i, requests in enumerate(r.get("proxy") or []):
      if not requests:
        continue
      cells = [f"{op} {p['since_answer_us'] or 0:.0f}+{p['serve_us']:.0f}"
               for op, p in requests.items()]
      lines.append(f"{r['provider']} {r['phase']} process {i}, us GPU before + proxy: "
                   + ", ".join(cells))
  return "\n".join(lines)


def kernel_lines(per_provider: dict, top: int = 8) -> str:
  """Per provider, row and process, the traced fused steps' busy span and largest kernels
  (--trace-iters)."""
  lines = []
  for provider, per_process in per_provider.items():
    for i, records in enumerate(per_process):
      for r in records:
        for plane, entry in (r["jax_moe"]["fused"].get("kernels") or {}).items():
          lines.append(f"{provider} {r['phase']} {r['dispatch_dtype']} {r['reduce']} process {i} "
                       f"{plane}: busy span {entry['span_us_per_step']:.0f} us per step")
          lines += [f"  {k['mean_us']:9.1f} us x{k['count']:4d}  {k['name'][:100]}"
                    for k in entry["kernels"][:top]]
  return "\n".join(lines)


def table(rows: list[dict], failures: list[str]) -> str:
  f = lambda v, spec=".0f": "-" if v is None else format(v, spec)  # noqa: E731
  header = (f"{'provider':12} {'phase':8} {'dtype':5} {'reduce':6} {'MB 0>1':>7} {'writes':>6} "
            f"{'fused us':>9} {'disp us':>8} {'comb us':>8} {'raw same':>9} {'raw one':>8} "
            f"{'xla us':>8} {'fused/same':>10} {'fused/one':>9} {'nvlink us':>9} {'1st post us':>11}")
  lines = [header, "-" * len(header)]
  for r in rows:
    lines.append(
        f"{r['provider']:12} {r['phase']:8} {r['dispatch_dtype']:5} {r['reduce']:6} "
        f"{r['bytes_0to1'] / 1e6:>7.2f} {r['writes_0to1']:>6} {f(r['backend_us']['fused']):>9} "
        f"{f(r['backend_us'].get('dispatch')):>8} {f(r['backend_us'].get('combine')):>8} "
        f"{f(r['raw_us']['same_writes']):>9} {f(r['raw_us']['one_write']):>8} "
        f"{f(r['xla_us']):>8} {f(r['ratio_fused_vs_same_writes'], '.1f'):>10} "
        f"{f(r['ratio_fused_vs_one_write'], '.1f'):>9} {f(r['nvlink_us']):>9} "
        f"{f(_first_post_us(r), '.1f'):>11}"
        + ("" if r["correct"] else "  (result WRONG)"))
  lines += [f"failed: {reason[:300]}" for reason in failures]
  return "\n".join(lines)


def plot(payload: dict, path: Path) -> bool:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  rows = payload["rows"]
  if not rows:
    return False
  series = [(f"{payload['config']['backend']} fused", lambda r: r["backend_us"]["fused"], "tab:blue"),
            ("raw same writes", lambda r: r["raw_us"]["same_writes"], "tab:green"),
            ("raw one write", lambda r: r["raw_us"]["one_write"], "tab:olive"),
            ("xla fused", lambda r: r["xla_us"], "tab:orange"),
            ("cuda fused (NVLink)", lambda r: r["nvlink_us"], "tab:purple")]
  series = [s for s in series if any(s[1](r) is not None for r in rows)]
  labels = [f"{r['provider']} {r['phase']} {r['dispatch_dtype']} {r['reduce']}" for r in rows]
  fig, ax = plt.subplots(figsize=(11, 1.0 + 0.9 * len(rows)))
  height = 0.8 / len(series)
  for j, (name, value, color) in enumerate(series):
    ys = [i + (j - len(series) / 2) * height for i in range(len(rows))]
    ax.barh(ys, [value(r) or 0 for r in rows], height=height, color=color, label=name)
  for i, r in enumerate(rows):
    same = r["raw_us"]["same_writes"]
    if same:
      ax.plot([r["target_ratio"] * same] * 2, [i - 0.45, i + 0.45], color="red", lw=1.2,
              label=f"{r['target_ratio']:g} x raw same writes (target)" if i == 0 else None)
  ax.set_yticks(range(len(rows)), labels, fontsize=8)
  ax.invert_yaxis()
  ax.set_xscale("log")
  ax.set_xlabel("microseconds per exchange (median; slower of the two processes)")
  ax.grid(True, axis="x", which="both", alpha=0.3)
  ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
  env, cfg = payload["environment"], payload["config"]
  fig.suptitle(f"{cfg['backend']} across 2 processes vs raw TransferEngine; hidden {cfg['hidden']}, "
               f"top-{cfg['topk']} of {cfg['experts']}, {cfg['devices_per_process']} device(s)/"
               f"process; {env['host']} ({env['cpus']} CPUs), commit {env['git_commit'][:10]}",
               fontsize=9)
  fig.tight_layout()
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return True


def main(argv=None) -> int:
  args = parse_args(argv)
  from jax_moe import build_info
  from jax_moe.backends import host_remote
  if not host_remote.available():
    print(f"the native module cannot reach other processes (no libfabric): {build_info()}",
          file=sys.stderr)
    return 2

  config = {"hidden": args.hidden, "experts": args.experts, "topk": args.topk,
            "block_size": args.block_size, "phases": args.phases,
            "dispatch_dtypes": args.dispatch_dtypes, "reduce": args.reduce,
            "partial_dtype": args.partial_dtype, "ops": args.ops, "routing": args.routing,
            "seed": args.seed, "devices_per_process": args.devices_per_process,
            "iters": args.iters, "short_iters": args.short_iters, "reps": args.reps,
            "steps_per_iteration": args.steps_per_iteration, "trace_iters": args.trace_iters,
            "raw_iters": args.raw_iters, "raw_short_iters": args.raw_short_iters,
            "platform": args.platform, "backend": BACKENDS[args.platform], "gpus": args.gpus,
            "others": (["cuda"] if args.platform == "cuda" and not args.no_nvlink else [])
            + ([] if args.no_xla else ["xla"]),
            "pin": args.platform == "cpu" and not args.no_pin, "mps": args.mps,
            "one_host": args.one_host}
  rows, failures, per_provider = [], [], {}
  for provider in args.providers:
    print(f"== {provider}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench_host_remote_") as folder:
      try:
        with (private_mps(Path(folder)) if args.mps else contextlib.nullcontext({})) as mps_env:
          per_process = run_provider(provider, config, args, Path(folder), mps_env)
      except RuntimeError as e:
        failures.append(str(e))
        continue
    per_provider[provider] = per_process
    rows += summarize_rows(provider, per_process, args.platform)

  host = re.sub(r"[^a-z0-9]+", "-", platform.node().lower()).strip("-") or "host"
  payload = {
      "benchmark": "host_remote",
      "config": {**config, "providers": args.providers, "timeout_s": args.timeout_s,
                 # the engines' rails (NICs), as given (settings.host_domains)
                 "domains": os.environ.get("JAX_MOE_HOST_DOMAINS", ""),
                 "argv": sys.argv[1:] if argv is None else list(argv)},
      "environment": {
          "git_commit": args.git_commit or _git("rev-parse", "HEAD") or "unknown",
          "git_dirty": None if args.git_commit else
          bool(_git("status", "--porcelain", "--untracked-files=no")),
          "host": platform.node(), "cpu_model": _cpu_model(), "cpus": os.cpu_count(),
          "python": platform.python_version(), "jax_version": importlib.metadata.version("jax"),
          "platform": args.platform, "load_average_1_5_15": os.getloadavg(),
          "jax_moe_build_info": build_info()},
      "timing": "per-exchange time = (t(n_long) - t(n_short)) / (n_long - n_short) / steps, "
                "wall time of a jitted fori_loop of steps_per_iteration exchanges an iteration "
                "(host, xla, cuda) or a Python loop of engine calls (raw, steps 1); each number "
                "is the slower of the two processes' medians",
      "target": f"{BACKENDS[args.platform]} fused <= {TARGET_RATIOS[args.platform]} x raw "
                "same_writes; proxy: "
                "doorbell seen -> first write posted <= 5 us median",
      "rows": rows,
      "failures": failures,
      "per_process": per_provider,
  }
  stem = args.out / f"host_remote_{host}" if args.platform == "cpu" else \
      args.out / f"cuda_proxy_{host}"
  report.write_json(stem.with_suffix(".json"), payload)
  plotted = plot(payload, stem.with_suffix(".png"))
  print(table(rows, failures))
  if args.platform == "cuda":
    print(proxy_phases(rows))
  if args.trace_iters:
    print(kernel_lines(per_provider))
  print(f"wrote {stem}.json" + (" and .png" if plotted else ""))
  return 0 if not failures and all(r["correct"] for r in rows) else 1


if __name__ == "__main__":
  sys.exit(main())
