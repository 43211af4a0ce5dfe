"""Soak: many dispatch -> identity expert -> combine calls of two backends on fresh random
inputs, compared call by call, with the process's resident memory reported.

Each iteration draws a routing case (uniform, one hot expert, every token on one rank's
experts, `-1` slots, random `num_tokens`), a dispatch dtype (fp8, bf16) and a combine mode
(source, expert), runs both backends' compiled programs on the same inputs and compares:
group sizes, tokens per expert, weights, and the rows in use bit for bit (NaN-aware scales);
the combined outputs within two bf16 roundings of the sum's magnitude. Stops after
--iterations or --seconds, whichever comes first; exits 1 on any mismatch or run-time error.

  python benchmarks/soak.py --backends host,xla --seconds 3600          # CPU, 8 devices
  python benchmarks/soak.py --backends cuda,xla --iterations 100000     # GPU
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `jax_moe` importable from a checkout
  sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CASES = ("uniform", "hot_expert", "one_rank", "unused_slots", "partial_tokens")
CONFIGS = tuple((dtype, reduce) for dtype in ("fp8", "bf16") for reduce in ("source", "expert"))


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--backends", default="host,xla", help="two backends to compare")
  p.add_argument("--ep", type=int, default=None, help="devices (default all; 8 on CPU)")
  p.add_argument("--hidden", type=int, default=512)
  p.add_argument("--experts", type=int, default=32)
  p.add_argument("--topk", type=int, default=4)
  p.add_argument("--tokens", type=int, default=32, help="max_tokens per rank")
  p.add_argument("--iterations", type=int, default=1000)
  p.add_argument("--seconds", type=float, default=float("inf"))
  p.add_argument("--report-every", type=int, default=100)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--json", type=Path, default=None, help="write the summary here")
  args = p.parse_args(argv)
  args.backends = args.backends.split(",")
  if len(args.backends) != 2:
    p.error(f"--backends takes two names, got {args.backends}")
  return args


def rss_mib() -> float:
  """Resident set size now (not the peak), from /proc."""
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def routing(rng, case, R, T, E, K):
  """[R*T, K] ids, weights and [R] num_tokens for one case."""
  import numpy as np
  ids = np.stack([rng.permutation(E)[:K] for _ in range(R * T)]).astype(np.int32)
  num_tokens = np.full(R, T, np.int32)
  if case == "hot_expert":
    ids[:, 0] = int(rng.integers(E))  # may repeat another slot of the token: two rows
  elif case == "one_rank":
    L = E // R
    ids = (int(rng.integers(R)) * L + rng.integers(0, L, ids.shape)).astype(np.int32)
  elif case == "unused_slots":
    ids[rng.random(ids.shape) < 0.3] = -1
  elif case == "partial_tokens":
    num_tokens = rng.integers(0, T + 1, R).astype(np.int32)
  w = rng.random(ids.shape).astype(np.float32)
  return ids, w, num_tokens


def build(backend, mesh, args, dtype, reduce):
  import jax
  import jax.numpy as jnp
  from jax.sharding import PartitionSpec as P

  import jax_moe as jm
  from jax_moe.sharding import shard_map
  cfg = jm.MoEConfig(args.experts, args.topk, args.hidden, args.tokens,
                     dispatch_dtype=jnp.float8_e4m3fn if dtype == "fp8" else jnp.bfloat16,
                     combine_reduce=reduce)
  comm = jm.Communicator(cfg, mesh, "ep", backend=backend)

  def body(x, ids, w, n):
    r = comm.dispatch(x, ids, w, n.reshape(()))
    y = r.x.astype(jnp.bfloat16) if r.scales is None else jm.dequantize_fp8(r.x, r.scales,
                                                                           jnp.bfloat16)
    scales = r.scales if r.scales is not None else jnp.zeros((1, 1), jnp.float32)
    return (r.x.view(jnp.uint8) if cfg.is_fp8 else r.x.view(jnp.uint16), scales, r.weights,
            r.group_sizes, r.tokens_per_expert, comm.combine(y, r.handle))

  spec = P("ep")
  return comm, jax.jit(shard_map(body, mesh, in_specs=(spec,) * 4, out_specs=(spec,) * 6))


def compare(a, b, R, x, w, ids):
  """First difference between two backends' outputs, or None."""
  import numpy as np
  a = [np.asarray(v) for v in a]
  b = [np.asarray(v) for v in b]
  for name, i in (("group_sizes", 3), ("tokens_per_expert", 4), ("weights", 2)):
    if not np.array_equal(a[i].view(np.uint32) if i == 2 else a[i],
                          b[i].view(np.uint32) if i == 2 else b[i]):
      return f"{name} differ"
  rows = a[0].reshape(R, -1, a[0].shape[-1])
  used = a[3].reshape(R, -1).sum(-1)
  for r in range(R):
    n = min(int(used[r]), rows.shape[1])
    if not np.array_equal(rows[r, :n], b[0].reshape(R, -1, rows.shape[-1])[r, :n]):
      return f"x rows in use differ on rank {r}"
    sa, sb = a[1].reshape(R, -1, a[1].shape[-1])[r], b[1].reshape(R, -1, b[1].shape[-1])[r]
    sa, sb = sa[:n] if sa.shape[0] > 1 else sa, sb[:n] if sb.shape[0] > 1 else sb
    if not np.array_equal(sa, sb, equal_nan=True):
      return f"scales differ on rank {r}"
  magnitude = (np.abs(w) * (ids >= 0)).sum(-1, keepdims=True) * np.abs(x).max(-1, keepdims=True)
  error = np.abs(a[5].astype(np.float32) - b[5].astype(np.float32))
  if not (error <= 2.0**-7 * magnitude + 1e-30).all():
    return f"combined outputs differ by {float(error.max()):.3g}"
  return None


def main(argv=None) -> int:
  args = parse_args(argv)
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh

  import jax_moe as jm
  devices = jax.devices()[:args.ep] if args.ep else jax.devices()
  R = len(devices)
  mesh = Mesh(np.array(devices), ("ep",))
  programs = {c: [build(b, mesh, args, *c) for b in args.backends] for c in CONFIGS}
  rng = np.random.default_rng(args.seed)
  T, E, K, H = args.tokens, args.experts, args.topk, args.hidden
  start, rss_start = time.monotonic(), rss_mib()
  summary = dict(backends=args.backends, devices=R, device_kind=devices[0].device_kind,
                 jax=jax.__version__, iterations=0, mismatches=[], rss_mib_start=rss_start)
  for i in range(args.iterations):
    if time.monotonic() - start > args.seconds:
      break
    case = CASES[int(rng.integers(len(CASES)))]
    config = CONFIGS[int(rng.integers(len(CONFIGS)))]
    ids, w, n = routing(rng, case, R, T, E, K)
    x = (rng.standard_normal((R * T, H)) * 2.0 ** rng.integers(-6, 7, (R * T, 1))).astype(
        np.float32)
    inputs = (jnp.asarray(x, jnp.bfloat16), jnp.asarray(ids), jnp.asarray(w), jnp.asarray(n))
    results = []
    for comm, program in programs[config]:
      results.append(jax.block_until_ready(program(*inputs)))
      try:
        comm.check()
      except jm.CommError as e:
        summary["mismatches"].append(f"iteration {i} {case} {config}: {comm.backend_name}: {e}")
    live = (np.arange(T)[None, :] < n[:, None]).reshape(-1, 1)
    x_sent = np.asarray(inputs[0], np.float32) * live
    problem = compare(*results, R, x_sent, w, np.where(live, ids, -1))
    if problem:
      summary["mismatches"].append(f"iteration {i} {case} {config}: {problem}")
    summary["iterations"] = i + 1
    if (i + 1) % args.report_every == 0:
      summary.setdefault("rss_mib_first_report", rss_mib())  # after every program compiled
      print(f"{i + 1} iterations, {time.monotonic() - start:.0f} s, RSS {rss_mib():.0f} MiB, "
            f"{len(summary['mismatches'])} mismatches", flush=True)
  summary.update(seconds=time.monotonic() - start, rss_mib_end=rss_mib())
  for pair in programs.values():
    for comm, _ in pair:
      comm.close()
  print(json.dumps(summary))
  if args.json:
    args.json.write_text(json.dumps(summary, indent=1))
  return 1 if summary["mismatches"] else 0


if __name__ == "__main__":
  sys.exit(main())
