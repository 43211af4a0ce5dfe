"""Per-kernel device time of one MoE exchange, from a JAX profiler trace (CUPTI).

Runs `--iters` fused dispatch -> identity expert -> combine steps of a jax_moe backend inside
one jit, traces them with jax.profiler, and prints, per GPU, every kernel's count and mean
device time plus the busy span per step. The time of each stage is what the latency targets
are about, so this is the tool to find where a step's time goes (nsys does not run on the
lent machines; CUPTI through JAX does).

  python benchmarks/profile_kernels.py --tokens 128 --dispatch-dtype fp8 --reduce source

With --stages (cuda backend over NVLink) it also prints when each block of the last dispatch and
combine kernels reached each stage (ffi/protocol/stage_clock.h: JAX_MOE_STAGE_CLOCKS=1, set here),
as min / median / max over blocks in us from the kernel's first block start.
"""

from __future__ import annotations

import argparse
import os
import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `jax_moe` importable
  sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import jax_moe as jm  # noqa: E402
from benchmarks import peers, stage_profile  # noqa: E402
from benchmarks.methods import identity_expert  # noqa: E402
from jax_moe.sharding import shard_map  # noqa: E402


def parse_args():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--hidden", type=int, default=7168)
  p.add_argument("--experts", type=int, default=256)
  p.add_argument("--topk", type=int, default=8)
  p.add_argument("--tokens", type=int, default=128, help="tokens per rank")
  p.add_argument("--dispatch-dtype", choices=("fp8", "bf16"), default="fp8")
  p.add_argument("--reduce", choices=("source", "expert"), default="source")
  p.add_argument("--partial-dtype", choices=("f32", "bf16"), default="f32",
                 help="expert mode: dtype of the partial sums on the wire")
  p.add_argument("--backend", default="cuda")
  p.add_argument("--split", action="store_true",
                 help="time the halves (dispatch_send/recv, combine_send/recv) as separate calls")
  p.add_argument("--ep", type=int, default=None, help="use the first N devices (default all)")
  p.add_argument("--num-sms", type=int, default=None,
                 help="MoEConfig.num_sms: blocks of the cuda kernels (default: every SM)")
  p.add_argument("--iters", type=int, default=20)
  p.add_argument("--identity-dequantize", choices=peers.IDENTITY_DEQUANTIZE_CHOICES,
                 default=peers.IDENTITY_DEQUANTIZE,
                 help="jm.dequantize_fp8's implementation in the identity expert (fp8 rows)")
  p.add_argument("--stages", action="store_true",
                 help="also print per-block stage times of the NVLink kernels (cuda backend)")
  p.add_argument("--json", default=None, help="also write the table here")
  return p.parse_args()


def short_name(name: str) -> str:
  """A kernel's name without its namespace and argument list (template arguments kept)."""
  name = name.replace("jax_moe::(anonymous namespace)::", "").replace("void ", "")
  return name.split("(", 1)[0][:90] if "(" in name else name[:90]


def main():
  a = parse_args()
  peers.IDENTITY_DEQUANTIZE = a.identity_dequantize
  if a.stages:
    os.environ["JAX_MOE_STAGE_CLOCKS"] = "1"  # read when the Communicator is built
  devices = jax.devices()[:a.ep] if a.ep else jax.devices()
  R = len(devices)
  mesh = Mesh(np.array(devices), ("ep",))
  cfg = jm.MoEConfig(a.experts, a.topk, a.hidden, a.tokens,
                     dispatch_dtype=jnp.float8_e4m3fn if a.dispatch_dtype == "fp8" else jnp.bfloat16,
                     combine_reduce=a.reduce,
                     partial_dtype=jnp.bfloat16 if a.partial_dtype == "bf16" else jnp.float32,
                     num_sms=a.num_sms)
  comm = jm.Communicator(cfg, mesh, "ep", backend=a.backend)

  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((R * a.tokens, a.hidden)), jnp.bfloat16)
  logits = rng.standard_normal((R * a.tokens, a.experts))
  ids = np.argsort(-logits, axis=1)[:, :a.topk].astype(np.int32)
  w = rng.random((R * a.tokens, a.topk)).astype(np.float32)
  shard = NamedSharding(mesh, P("ep"))
  x, ids, w = (jax.device_put(v, shard) for v in (x, ids, w))

  def step(x, ids, w):
    r = (comm.dispatch_recv(comm.dispatch_send(x, ids, w)) if a.split
         else comm.dispatch(x, ids, w))
    y = identity_expert(r)
    return comm.combine_recv(comm.combine_send(y, r.handle)) if a.split else comm.combine(y, r.handle)

  def loop(x, ids, w):
    return jax.lax.fori_loop(0, a.iters, lambda i, v: step(v, ids, w), x)

  run = jax.jit(shard_map(loop, mesh, in_specs=(P("ep"),) * 3, out_specs=P("ep")))
  data = stage_profile.traced(lambda: run(x, ids, w))
  comm.check()

  table = stage_profile.kernel_table(data, a.iters)
  if not table:
    print(f"no stream lines in {[p.name for p in stage_profile.gpu_planes(data)]}")
  for plane, entry in table.items():
    print(f"{plane}: busy span {entry['span_us_per_step']:.1f} us per step "
          f"({a.backend}, {a.dispatch_dtype}, {a.reduce}, {a.tokens} tokens/rank, EP{R})")
    for k in entry["kernels"][:14]:
      print(f"  {k['mean_us']:9.1f} us x{k['count']:4d}  {short_name(k['name'])}")
  stages = stage_table(comm.stage_clocks(), fused=not a.split) if a.stages else {}
  if a.json:
    with open(a.json, "w") as f:
      json.dump({"config": vars(a), "planes": table, "stages": stages}, f, indent=1)


SEND_MARKS = ("send_start", "routed", "sent")


def stage_table(clocks: dict, fused: bool) -> dict:
  """Per device and kernel, each mark's min / median / max over blocks in us, from the first
  block's start of the launch that wrote it (the fused op's one launch starts at send_start;
  with the halves as separate launches the receive marks count from recv_start)."""
  out = {}
  for ordinal, kernels in sorted(clocks.items()):
    for kernel, marks in kernels.items():
      at = {m: np.asarray(v, dtype=np.int64) for m, v in marks.items()}
      send0, recv0 = at["send_start"], at["recv_start"]
      if not (send0 > 0).any() and not (recv0 > 0).any():
        continue
      print(f"GPU {ordinal} {kernel} stages ({'fused' if fused else 'per half'}), us from "
            f"the first block's start: min / median / max over blocks")
      rows = {}
      for mark, ns in at.items():
        hit = ns[ns > 0]
        if not hit.size:
          continue
        origin = send0[send0 > 0].min() if (mark in SEND_MARKS or fused) else \
            recv0[recv0 > 0].min()
        us = (hit - origin) / 1e3
        # per block (block order; None where the block did not reach the mark)
        per_block = [float((t - origin) / 1e3) if t > 0 else None for t in ns]
        rows[mark] = dict(blocks=int(hit.size), min_us=float(us.min()),
                          median_us=float(np.median(us)), max_us=float(us.max()),
                          per_block_us=per_block)
        print(f"  {mark:12s} {us.min():8.1f} {np.median(us):8.1f} {us.max():8.1f}"
              f"   ({hit.size} blocks)")
      out[f"{ordinal}/{kernel}"] = rows
  return out


if __name__ == "__main__":
  main()
