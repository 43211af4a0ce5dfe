"""The methods bench_dispatch_combine times: jax_moe backends, JAX peers and two probes.

Every method is a (init, body, final) triple of per-shard functions for
timing.loop_program, a correctness check of final's result, and the bytes one rank sends
to other ranks per iteration (mean over ranks) under a stated model.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

import jax_moe as jm
from benchmarks import peers, reference
from benchmarks.environment import AXIS, SHARDED
from benchmarks.problem import Inputs, Shape, Traffic
from benchmarks.timing import consume_output, consume_probe, probe_all

JAX_MOE_OPS = ("fused", "dispatch", "combine", "split")
PEER_NAMES = ("all_gather", "all_to_all", "ragged_all_to_all", "replicated_psum_scatter")
# The replicated-input mode (every rank holds every token; jax_moe/backends/replicated.py), a
# backend name here: JAX on every platform, expert mode only, fused and split.
REPLICATED = "replicated"
REPLICATED_OPS = ("fused", "split")
PROBE_NAMES = ("psum", "p2p", "fanout", "weighted_sum")
DTYPES = {"fp8": jnp.float8_e4m3fn, "bf16": jnp.bfloat16}
# Benchmark names of jax_moe backends built with a setting: "cuda-proxy" is the cuda backend
# with every peer forced remote (JAX_MOE_FORCE_REMOTE=1 while the Communicator is built), so
# each GPU exchanges through its host proxy (jax_moe/backends/cuda_proxy.py); each process
# then counts as a host of its own (JAX_MOE_HOST_GROUP) unless the caller set a group, so the
# proxies of processes on one machine reach each other through the TransferEngine.
FORCED_REMOTE = {"cuda-proxy": "cuda"}
PARTIAL_DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class Context:
  """One phase and dispatch dtype: what every method runs on and is checked against."""
  mesh: jax.sharding.Mesh
  shape: Shape
  inputs: Inputs
  expected: reference.Expected
  traffic: Traffic
  combined: jax.Array  # expected.combined and .bound on the devices, sharded like outputs
  bound: jax.Array

  @property
  def dtype_name(self) -> str:
    return "fp8" if self.shape.fp8 else "bf16"


def _on_devices(mesh, a: np.ndarray) -> jax.Array:
  return jax.device_put(a, NamedSharding(mesh, SHARDED))


def make_context(mesh, shape: Shape, inputs: Inputs, moved: Traffic) -> Context:
  want = reference.expected(shape, inputs)
  return Context(mesh=mesh, shape=shape, inputs=inputs, expected=want, traffic=moved,
                 combined=_on_devices(mesh, want.combined), bound=_on_devices(mesh, want.bound))


@dataclasses.dataclass
class Method:
  label: str                  # unique in a phase, e.g. "cuda fused fp8 source"
  family: str                 # "jax_moe", "peer" or "probe"
  name: str                   # backend, peer or probe name
  op: str                     # fused, dispatch, combine, split, exchange, psum, p2p
  dispatch_dtype: str | None
  combine_reduce: str | None
  init: Callable
  body: Callable
  final: Callable
  check: Callable[[object, int], dict]  # (final's global result, loop length n) -> verdict
  bytes_per_rank: float
  bytes_model: str
  after_run: Callable[[], None] = lambda: None  # raises what the method recorded (CommError)

  def record(self) -> dict:
    return {"label": self.label, "family": self.family, "name": self.name, "op": self.op,
            "dispatch_dtype": self.dispatch_dtype, "combine_reduce": self.combine_reduce,
            "bytes_per_rank": self.bytes_per_rank, "bytes_model": self.bytes_model}


def _keep(x, topk_ids, topk_weights):
  return x, topk_ids, topk_weights


def _combine_check(ctx: Context, roundings: int):
  return lambda out, n: reference.check_close(out, ctx.combined, ctx.bound, roundings)


# ------------------------------------------------------------------ jax_moe backends
def identity_expert(r: jm.Dispatched) -> jax.Array:
  """y = the dispatched rows through peers.identity_expert (dequantized, bf16, behind
  optimization barriers)."""
  return peers.identity_expert(r.x, r.scales)


def fused_op(comm: jm.Communicator) -> Callable:
  def fused(x, ids, w):
    r = comm.dispatch(x, ids, w)
    return comm.combine(identity_expert(r), r.handle)
  return fused


def split_op(comm: jm.Communicator) -> Callable:
  def split(x, ids, w):
    r = comm.dispatch_recv(comm.dispatch_send(x, ids, w))
    return comm.combine_recv(comm.combine_send(identity_expert(r), r.handle))
  return split


def make_communicator(ctx: Context, backend: str, reduce: str, partial_dtype: str,
                      expert_padding: int) -> jm.Communicator:
  s = ctx.shape
  replicated = backend == REPLICATED
  cfg = jm.MoEConfig(num_experts=s.experts, experts_per_token=s.topk, hidden=s.hidden,
                     max_tokens=s.tokens * (s.ranks if replicated else 1),
                     dispatch_dtype=DTYPES[ctx.dtype_name],
                     block_size=s.block_size, combine_dtype=jnp.bfloat16,
                     combine_reduce=reduce, partial_dtype=PARTIAL_DTYPES[partial_dtype],
                     expert_padding=expert_padding)
  if replicated:
    return jm.Communicator(cfg, ctx.mesh, axis=AXIS, replicated_over=AXIS)
  if backend not in FORCED_REMOTE:
    return jm.Communicator(cfg, ctx.mesh, axis=AXIS, backend=backend)
  settings = {"JAX_MOE_FORCE_REMOTE": "1",
              "JAX_MOE_HOST_GROUP": os.environ.get("JAX_MOE_HOST_GROUP")
              or f"process{jax.process_index()}"}
  before = {name: os.environ.get(name) for name in settings}
  os.environ.update(settings)
  try:
    return jm.Communicator(cfg, ctx.mesh, axis=AXIS, backend=FORCED_REMOTE[backend])
  finally:
    for name, value in before.items():
      if value is None:
        del os.environ[name]
      else:
        os.environ[name] = value


def jax_moe_methods(ctx: Context, comm: jm.Communicator, ops: tuple[str, ...],
                    name: str | None = None) -> list[Method]:
  """The methods `ops` on `comm`, in JAX_MOE_OPS order, labelled `name` (default: the
  communicator's backend)."""
  cfg = comm.cfg
  reduce = cfg.combine_reduce
  partial = "f32" if cfg.partial_dtype == np.dtype(jnp.float32) else "bf16"
  # bf16 roundings of partial or final sums (reference.check_close).
  roundings = 2 if reduce == "expert" and partial == "bf16" else 1
  t, s = ctx.traffic, ctx.shape
  dispatch_bytes = t.remote_pairs * s.row_bytes
  if reduce == "source":
    combine_bytes = t.remote_slots * s.combine_row_bytes
  else:
    combine_bytes = t.remote_pairs * s.hidden * np.dtype(cfg.partial_dtype).itemsize
  model = ("payload lower bound: dispatch one row per (token, remote rank); combine one "
           + ("row per remote slot" if reduce == "source" else "partial per (token, remote rank)"))

  fused, split = fused_op(comm), split_op(comm)

  def exchange_body(exchange):
    def body(state):
      return consume_output(*state, exchange(*state))
    return body

  def dispatch_body(state):
    return consume_probe(*state, probe_all(comm.dispatch(*state)))

  def dispatch_final(state):
    r = comm.dispatch(*state)
    return {"x": r.x, "scales": r.scales, "weights": r.weights, "group_sizes": r.group_sizes,
            "tokens_per_expert": r.tokens_per_expert}

  def dispatch_check(result, n):
    return reference.check_dispatch(s, ctx.inputs, ctx.expected, result, comm.capacity,
                                    cfg.expert_padding)

  def combine_init(x, ids, w):
    r = comm.dispatch(x, ids, w)
    return identity_expert(r), r.handle

  def combine_body(state):
    # The next y depends on all of this out (see timing.consume_output): y's first rows
    # absorb 0 * out, a [T, H] pass in place.
    y, handle = state
    out = comm.combine(y, handle)
    rows = min(out.shape[0], y.shape[0])
    return y.at[:rows].add(out[:rows] * jnp.zeros((), y.dtype)), handle

  def combine_final(state):
    return comm.combine(*state)

  name, dtype = name or comm.backend_name, ctx.dtype_name
  common = dict(family="jax_moe", name=name, dispatch_dtype=dtype, after_run=comm.check)
  builders = {
      "fused": lambda: Method(
          label=f"{name} fused {dtype} {reduce}", op="fused", combine_reduce=reduce,
          init=_keep, body=exchange_body(fused), final=lambda st: fused(*st),
          check=_combine_check(ctx, roundings), bytes_per_rank=dispatch_bytes + combine_bytes,
          bytes_model=model, **common),
      "dispatch": lambda: Method(
          label=f"{name} dispatch {dtype}", op="dispatch", combine_reduce=None,
          init=_keep, body=dispatch_body, final=dispatch_final, check=dispatch_check,
          bytes_per_rank=dispatch_bytes, bytes_model=model, **common),
      "combine": lambda: Method(
          label=f"{name} combine {dtype} {reduce}", op="combine", combine_reduce=reduce,
          init=combine_init, body=combine_body, final=combine_final,
          check=_combine_check(ctx, roundings), bytes_per_rank=combine_bytes,
          bytes_model=model, **common),
      "split": lambda: Method(
          label=f"{name} split {dtype} {reduce}", op="split", combine_reduce=reduce,
          init=_keep, body=exchange_body(split), final=lambda st: split(*st),
          check=_combine_check(ctx, roundings), bytes_per_rank=dispatch_bytes + combine_bytes,
          bytes_model=model, **common),
  }
  return [builders[op]() for op in JAX_MOE_OPS if op in ops]


def gather_tokens(x, topk_ids, topk_weights):
  """Every rank's tokens on every rank (x may be a pre-quantized (q, scales) pair): the
  replicated-input methods' state, made once before their loop."""
  return jax.tree.map(lambda a: jax.lax.all_gather(a, AXIS, tiled=True),
                      (x, topk_ids, topk_weights))


def replicated_methods(ctx: Context, comm: jm.Communicator, ops: tuple[str, ...]) -> list[Method]:
  """The replicated-input mode's fused and split ops: dispatch selects the local experts'
  slots of all R*T tokens without communication; combine sums the ranks' partials over the
  group (every rank gets every output). The check reads each rank's own T rows."""
  cfg, s = comm.cfg, ctx.shape
  partial = "f32" if cfg.partial_dtype == np.dtype(jnp.float32) else "bf16"
  roundings = 2 if partial == "bf16" else 1
  pbytes = np.dtype(cfg.partial_dtype).itemsize
  nbytes = 2.0 * (s.ranks - 1) / s.ranks * s.ranks * s.tokens * s.hidden * pbytes
  model = "combine all-reduces R*T partials (ring: 2*(R-1)/R of them); dispatch moves nothing"

  def own_rows(out):
    return jax.lax.dynamic_slice_in_dim(out, jax.lax.axis_index(AXIS) * s.tokens, s.tokens)

  def method(op, exchange):
    return Method(label=f"{REPLICATED} {op} {ctx.dtype_name} expert", family="jax_moe",
                  name=REPLICATED, op=op, dispatch_dtype=ctx.dtype_name,
                  combine_reduce="expert", init=gather_tokens,
                  body=lambda state: consume_output(*state, exchange(*state)),
                  final=lambda state: own_rows(exchange(*state)),
                  check=_combine_check(ctx, roundings), bytes_per_rank=nbytes,
                  bytes_model=model, after_run=comm.check)

  exchanges = {"fused": fused_op(comm), "split": split_op(comm)}
  return [method(op, exchanges[op]) for op in REPLICATED_OPS if op in ops]


# ------------------------------------------------------------------ JAX peers
def peer_method(ctx: Context, peer: str) -> Method:
  s, t = ctx.shape, ctx.traffic
  R = s.ranks
  exchange = peers.PEERS[peer](s, AXIS)
  if peer == "all_gather":
    # Rows, scales, ids and weights gathered; reduce-scatter moves (R-1)/R of R*T rows.
    nbytes = (R - 1) * s.tokens * (s.row_bytes + 8 * s.topk + s.combine_row_bytes)
    model = "(R-1)*T rows+routing gathered, (R-1)*T bf16 rows reduce-scattered"
    roundings = R + 1  # bf16 partial, then up to R-1 bf16 additions in the reduce-scatter
  elif peer == "all_to_all":
    nbytes = (R - 1) * s.slots_per_dest * (s.row_bytes + s.combine_row_bytes)
    model = "(R-1)*T*min(K,L) padded rows each way"
    roundings = 1
  elif peer == "replicated_psum_scatter":
    # Every rank holds every token: the all_gather peer without its gather.
    nbytes = (R - 1) * s.tokens * s.combine_row_bytes
    model = "(R-1)*T bf16 rows reduce-scattered (the tokens are replicated already)"
    roundings = R + 1
  else:
    nbytes = t.remote_slots * (s.row_bytes + s.combine_row_bytes) + 4 * R
    model = "one row per remote slot each way, plus the counts"
    roundings = 1
  replicated = peer == "replicated_psum_scatter"

  def body(state):
    out = exchange(*state)
    if replicated:  # out is this rank's T rows of the replicated R*T: a reduce-scatter's
      return consume_probe(*state, probe_all(out))  # whole input is needed for any element
    return consume_output(*state, out)

  return Method(label=f"{peer} {ctx.dtype_name}", family="peer", name=peer, op="exchange",
                dispatch_dtype=ctx.dtype_name, combine_reduce="source",
                init=gather_tokens if replicated else _keep, body=body,
                final=lambda st: exchange(*st), check=_combine_check(ctx, roundings),
                bytes_per_rank=float(nbytes), bytes_model=model)


# ------------------------------------------------------------------ probes
def psum_method(ctx: Context) -> Method:
  """psum of the [T, H] bf16 tokens: the floor for anything that moves T rows."""
  s = ctx.shape
  R = s.ranks
  x = ctx.inputs.x.astype(np.float64).reshape(R, s.tokens, s.hidden)
  want = _on_devices(ctx.mesh, np.tile(x.sum(axis=0), (R, 1)).astype(np.float32))
  bound = _on_devices(ctx.mesh, np.tile(np.abs(x).sum(axis=0), (R, 1)).astype(np.float32))

  def body(state):
    return consume_output(*state, jax.lax.psum(state[0], AXIS))

  return Method(label="psum [T,H] bf16", family="probe", name="psum", op="psum",
                dispatch_dtype=None, combine_reduce=None, init=_keep, body=body,
                final=lambda st: jax.lax.psum(st[0], AXIS),
                check=lambda out, n: reference.check_close(out, want, bound, R),
                bytes_per_rank=2.0 * (R - 1) / R * s.tokens * s.combine_row_bytes,
                bytes_model="ring all-reduce: 2*(R-1)/R of the array")


def _slots_by_expert(topk_ids: jax.Array, topk: int):
  """One rank's T * K slots in expert order (stable, so (token, slot) order inside an
  expert): the token of each row of that order [T*K], and each slot's row [T, K]. With every
  id valid this is the dispatched layout at expert padding 1."""
  order = jnp.argsort(topk_ids.reshape(-1), stable=True).astype(jnp.int32)
  row_of_slot = jnp.zeros_like(order).at[order].set(jnp.arange(order.size, dtype=jnp.int32))
  return order // topk, row_of_slot.reshape(topk_ids.shape)


def _host_token_of_row(ctx: Context) -> np.ndarray:
  """_slots_by_expert's token of each row for every rank, on the host, as global token
  indices [R*T*K]."""
  s = ctx.shape
  order = np.argsort(ctx.inputs.topk_ids.reshape(s.ranks, -1), axis=1, kind="stable")
  return (np.arange(s.ranks)[:, None] * s.tokens + order // s.topk).reshape(-1)


def _bitwise_equal(got, want) -> bool:
  got, want = np.asarray(got), np.asarray(want)
  bits = f"u{want.dtype.itemsize}"
  return got.shape == want.shape and np.array_equal(got.view(bits), want.view(bits))


def fanout_method(ctx: Context) -> Method:
  """Every token's wire row (fp8 codes and scales, quantized on the way if the input is
  bf16, or bf16) copied to its K slots' rows in expert order, [T*K, H], by XLA gathers: the
  row traffic of a dispatch at expert padding 1, with the routing already sorted before the
  loop. A floor for the dispatch kernels measured in the same run."""
  s = ctx.shape
  token_of_row = _host_token_of_row(ctx)
  want = (ctx.expected.rows[token_of_row],) + (
      (ctx.expected.scales[token_of_row],) if s.fp8 else ())

  def gather(x, rows):
    if s.fp8 and not isinstance(x, tuple):
      x = jm.quantize_fp8(x, s.block_size)
    return tuple(jnp.take(a, rows, axis=0) for a in (x if isinstance(x, tuple) else (x,)))

  def init(x, ids, w):
    return x, ids, w, _slots_by_expert(ids, s.topk)[0]

  def body(state):
    x, ids, w, rows = state
    out = jax.lax.optimization_barrier(gather(x, rows))  # all of it, not the probed element
    return (*consume_probe(x, ids, w, probe_all(out)), rows)

  def check(out, n):
    return {"passed": all(_bitwise_equal(g, w) for g, w in zip(out, want)), "n": n,
            "what": "rows bit for bit"}

  return Method(label=f"fanout [T*K,H] {ctx.dtype_name}", family="probe", name="fanout",
                op="fanout", dispatch_dtype=ctx.dtype_name, combine_reduce=None, init=init,
                body=body, final=lambda st: gather(st[0], st[3]), check=check,
                bytes_per_rank=0.0, bytes_model="local: T*K rows written, T rows read")


def weighted_sum_method(ctx: Context) -> Method:
  """out[t] = bf16(sum_k w[t,k] * y[row_of_slot[t,k]]) in f32, k order, for bf16 rows y
  [T*K, H] in expert order (the identity expert's output, made before the loop), as XLA
  computes it: the row traffic of an expert-mode combine at world 1. A floor for the combine
  kernels measured in the same run."""
  s = ctx.shape
  x = ctx.inputs.x.astype(np.float64).reshape(s.ranks, s.tokens, s.hidden)
  ids = ctx.inputs.topk_ids
  w = np.where((ids >= 0) & (ids < s.experts), ctx.inputs.topk_weights, 0.0)
  sums = w.astype(np.float64).reshape(s.ranks, s.tokens, s.topk).sum(axis=2, keepdims=True)
  want = _on_devices(ctx.mesh, (sums * x).reshape(-1, s.hidden).astype(np.float32))
  bound = _on_devices(ctx.mesh, (np.abs(sums) * np.abs(x)).reshape(-1, s.hidden)
                      .astype(np.float32))

  def weighted_sum(y, row_of_slot, topk_ids, topk_weights):
    # The peers' sum over slots; its gather of y picks rows by the slots' validity, which
    # depends on each step's ids (timing.consume_output), so it stays inside the loop.
    return peers._weighted_sum_by_slot(s, y, row_of_slot, peers._valid(s, topk_ids),
                                       topk_weights)

  def init(x, ids, w):
    token_of_row, row_of_slot = _slots_by_expert(ids, s.topk)
    return x, ids, w, jnp.take(x, token_of_row, axis=0), row_of_slot

  def body(state):
    x, ids, w, y, row_of_slot = state
    return (*consume_output(x, ids, w, weighted_sum(y, row_of_slot, ids, w)), y, row_of_slot)

  return Method(label="weighted_sum [T,K,H] bf16", family="probe", name="weighted_sum",
                op="weighted_sum", dispatch_dtype=None, combine_reduce="expert", init=init,
                body=body, final=lambda st: weighted_sum(st[3], st[4], st[1], st[2]),
                check=lambda out, n: reference.check_close(out, want, bound, 1),
                bytes_per_rank=0.0, bytes_model="local: T*K rows read, T rows written")


P2P_SAMPLE = 1024  # elements of the rotated buffer returned for checking


def p2p_method(ctx: Context, size_bytes: int) -> Method:
  """ppermute of `size_bytes` per rank to the next rank: achieved link bandwidth."""
  R = ctx.shape.ranks
  elements = max(size_bytes // 4, 1)
  sample = min(elements, P2P_SAMPLE)
  ring = [(i, (i + 1) % R) for i in range(R)]

  def init(x, ids, w):  # rank d's buffer holds d; after n hops rank d holds (d - n) mod R
    return jnp.full((elements,), jax.lax.axis_index(AXIS), jnp.uint32)

  def check(out, n):
    got = np.asarray(out).reshape(R, sample)
    want = ((np.arange(R) - n) % R)[:, None]
    return {"passed": bool(np.all(got == want)), "n": n}

  size = (f"{size_bytes // 2**20}MiB" if size_bytes >= 2**20 else f"{size_bytes // 2**10}KiB"
          if size_bytes >= 2**10 else f"{size_bytes}B")
  return Method(label=f"p2p ppermute {size}", family="probe", name="p2p", op="p2p",
                dispatch_dtype=None, combine_reduce=None, init=init,
                body=lambda buf: jax.lax.ppermute(buf, AXIS, ring),
                final=lambda buf: buf[:sample], check=check,
                bytes_per_rank=float(elements * 4), bytes_model="buffer size, one hop")
