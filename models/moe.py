"""The routed-expert block of both models: jax_moe dispatch -> ragged_dot SwiGLU -> combine.

The expert GEMMs go through jax_moe.grouped_gemm.ragged_dot (tokamax's Mosaic GPU kernel on
Hopper where it applies, jax.lax.ragged_dot elsewhere); `GEMM_IMPLEMENTATION` picks its
`implementation` for every layer ("auto", "lax" or "tokamax").

Contract (what the models rely on):

  experts = RoutedExperts(num_experts, dim, hidden, experts_per_token=K, rules=..., pool=...,
                          dtype=..., fp8_block=None)
  y_td = experts(x_td, topk_ids_tk, topk_weights_tk)
  y_td, z = experts.overlapped(x_td, topk_ids_tk, topk_weights_tk, module, scope)  # module(x)
  y_td = yield from experts.steps(x_td, topk_ids_tk, topk_weights_tk, slot)  # in a generator

  - `x_td` [T, D] in the model dtype (or [B, S, D]; the leading dims are flattened and
    restored). Routing is the model's job: `topk_ids_tk` [T, K] int32 (`-1` = slot unused),
    `topk_weights_tk` [T, K] f32, already normalised/scaled as the model wants; the block
    returns sum_k w[t, k] * expert_{ids[t, k]}(x[t]) in the model dtype.
  - Weights `w_gate_up_ed2f` [E, D, 2, F] (gate and up side by side, one GEMM) and
    `w_down_efd` [E, F, D], sharded over the expert axes (logical axis "experts": the
    data-parallel axis, and the tensor-parallel one when there is one, ranks row-major):
    rank r holds experts [r*L, (r+1)*L). In the model dtype, or with `fp8_block=(bn, bk)`
    gate and up apart, `w_gate_edf`, `w_up_edf` [E, D, F], and all three as
    `grouped_gemm.BlockFp8Weights` of that logical shape (e4m3 codes [E, out, in], the
    checkpoint's own layout, with one f32 scale per bn x bk block; `sharding.fp8_param`),
    sharded the same way and fed to the grouped GEMM as they are: where tokamax's fp8 kernel
    applies (Hopper, bf16 rows, the conditions in grouped_gemm) it reads half the bytes of
    bf16 weights; elsewhere (CPU, f32 models, the "exact" wire) each call dequantizes them
    (f32 product, rounded to the model dtype, as the loader's dequantizing path rounds them):
    the bf16-copy model's results.
  - Tokens are data-parallel over the data-parallel axis (dp groups): T is padded to
    dp * Tg and each group holds Tg rows, Tg = tp * ceil(T / (dp * tp)) (the real count is
    passed as `num_tokens`, so padding rows are never sent). With a tensor-parallel axis
    the tokens are replicated over each tp group (as attention leaves them) and the
    Communicator runs in its DP-group mode (`replicated_over` the tp axis): each rank of a
    group sends its Tg / tp rows, and every rank gets all Tg outputs of its group. Works
    inside or outside jit, with any jax_moe backend.
  - `shared_expert=True` (DeepSeek-V3's `fuse_shared_experts`): a shared expert of the routed
    experts' shape sits in front of each shard's experts (slots [E + R]: slot s * (L + 1) is
    shard s's copy, slot s * (L + 1) + 1 + i routed expert s * L + i; checkpoint.SharedSlots)
    and every token goes to its own shard's copy with weight 1 as one more slot, so the block
    returns routed sum + shared(x) from the routed experts' GEMMs, with no GEMMs of its own.
    The bf16 and fp8 wires, no tp axis; weights in the model dtype or block-fp8 (the shared
    expert's codes and scales in the slots too).
  - `overlapped` gives the same y_td, bit for bit (its dispatch goes as dispatch_send and
    dispatch_recv, which give the fused op's bits), and module(x_td), an nnx.Module run under
    the named scope `scope` between the two halves, while the rows travel (DeepSeek-V3's
    shared experts with `overlap_shared_experts`). On one GPU the cuda backend's fused
    dispatch skips its buffer and the halves do not: there the overlap gives up that shortcut.
  - `steps` is the same block as a generator: it yields the pending dispatch after
    dispatch_send and takes it back (through whatever barrier the caller put it) for
    dispatch_recv, the experts and the combine; it returns y_td. The models' two-batch
    overlap (models.two_batch) runs the other micro-batch's layers while it is suspended;
    `slot` (0 or 1) picks the communicator, one per micro-batch in flight.
  - Communicators allocate, so they are built outside jit: one per MoEConfig (one per
    per-shard token count), cached in a `CommunicatorPool` shared by all layers of a model.
    Call `pool.prepare(num_tokens, slots)` (models do it in `prepare(batch, seq)`) before tracing
    a call with that many tokens; an eager call builds what it needs itself.

Wire formats (`wire`):
  "bf16"  tokens and expert outputs travel in bf16, combine sums in f32 (the serving path).
  "fp8"   tokens travel as e4m3 with block scales (hidden % 128 == 0), outputs in bf16.
  "exact" for f32 models (parity tests): each f32 row is split into three bf16 parts whose
          sum is the f32 value exactly, and every (token, slot) pair travels as its own
          token routed to one expert with weight 1, so combine returns each expert output
          unrounded and the weighted sum over k happens in f32 on the source. It moves
          3x the bytes of "bf16" and is not meant for speed.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

import jax_moe as jm
from jax_moe import grouped_gemm
from jax_moe.grouped_gemm import BlockFp8Weights
from jax_moe.models import stages
from jax_moe.models.sharding import ShardingRules, fp8_param, param
from jax_moe.sharding import shard_map

WIRES = ("exact", "bf16", "fp8")
GEMM_IMPLEMENTATION = "auto"  # grouped_gemm.ragged_dot's `implementation` for the experts
# Prefill-sized calls (at least this many tokens sent per rank) on more than one rank combine in
# "expert" mode: each expert rank sends one partial sum per token instead of one row per slot
# (K rows -> at most R partials), with partials in PARTIAL_DTYPE (bf16 halves the bytes again;
# set jnp.float32 for f32 partials). Decode-sized calls keep "source" mode.
EXPERT_REDUCE_MIN_TOKENS = 256
PARTIAL_DTYPE = jnp.bfloat16


def _check_shared_expert(wire: str, rules: ShardingRules) -> None:
  """Where RoutedExperts can hold a shared expert in its slots (fuse_shared_experts)."""
  why = ("the 'exact' wire sends each (token, slot) apart" if wire == "exact" else
         f"a tensor-parallel axis ({rules.tp_size} ranks) splits the shared expert's tokens"
         if rules.tp_size > 1 else None)
  if why:
    raise ValueError(f"RoutedExperts: shared_expert (fuse_shared_experts) needs the bf16 or "
                     f"fp8 wire and no tp axis: {why}")


def default_wire(dtype) -> str:
  return "exact" if jnp.dtype(dtype) == jnp.float32 else "bf16"


def _truncate_to_bf16(x):
  """f32 -> f32 with the low 16 bits cleared: exactly representable in bf16."""
  bits = jax.lax.bitcast_convert_type(x, jnp.uint32) & jnp.uint32(0xFFFF0000)
  return jax.lax.bitcast_convert_type(bits, jnp.float32)


def split_f32(x):
  """f32 [..., D] -> bf16 [..., 3D] (hi, mid, lo) with hi + mid + lo == x exactly.

  hi keeps the top 8 significant bits of x and mid the top 8 of what is left, both by
  truncation, so each is a bf16 value and each difference is exact in f32; lo, the rest, has
  at most 8 significant bits. Truncating (clearing bits) instead of rounding through a bf16
  cast matters on GPU: XLA may drop an f32 -> bf16 -> f32 round trip (excess precision),
  which left the rounded split with mid = lo = 0. Exact for normal values whose last part
  stays above the bf16 subnormal range, about |x| > 2^-110.
  """
  x = x.astype(jnp.float32)
  hi = _truncate_to_bf16(x)
  rest = x - hi
  mid = _truncate_to_bf16(rest)
  lo = rest - mid
  return jnp.concatenate([hi, mid, lo], axis=-1).astype(jnp.bfloat16)


def join_f32(parts):
  """Inverse of split_f32: bf16 [..., 3D] -> f32 [..., D]; sums lo + mid first, then hi."""
  hi, mid, lo = jnp.split(parts.astype(jnp.float32), 3, axis=-1)
  return hi + (mid + lo)


class CommunicatorPool:
  """A model's collectives, built outside jit and reused: one jm.Communicator per MoEConfig
  over the expert axes, and the jm.AllReduce over the tensor-parallel axis (when tp > 1).

  Layers register the config template of their exchange (`register`); `prepare(num_tokens,
  slots)` builds the communicators for a call with `num_tokens` tokens in total, one per slot
  (a micro-batch whose halves are in flight while another's run: its own buffers and call
  order); `get(cfg, tracing, slot)` returns one, building it when not inside a trace.
  `tp_sum(x)` sums tensor-parallel partial results. Hashable by identity, so models keep it
  as a static attribute.
  """

  def __init__(self, rules: ShardingRules, backend: str = "auto"):
    self.rules = rules
    self.backend = backend
    self._layers = []
    self._comms: dict[tuple[jm.MoEConfig, int], jm.Communicator] = {}
    # The custom call on GPUs (one-shot/two-shot, buffers allocated here), psum elsewhere.
    self._all_reduce = (jm.AllReduce(rules.mesh, rules.tp_axis) if rules.tp_size > 1
                        else None)

  def tp_sum(self, x):
    """x summed over the tensor-parallel axis, inside `ShardingRules.per_device` (x itself
    when tp is 1)."""
    return x if self._all_reduce is None else self._all_reduce(x)

  def register(self, layer: "RoutedExperts") -> None:
    self._layers.append(layer)

  def prepare(self, num_tokens: int, slots: int = 1) -> None:
    for layer in self._layers:
      for slot in range(slots):
        self.get(layer.moe_config(num_tokens), tracing=False, slot=slot)

  def get(self, cfg: jm.MoEConfig, tracing: bool, slot: int = 0) -> jm.Communicator:
    comm = self._comms.get((cfg, slot))
    if comm is None:
      if tracing:
        raise RuntimeError(
            f"RoutedExperts: no Communicator for max_tokens={cfg.max_tokens} per shard "
            f"(slot {slot}); "
            "communicators allocate and must be built outside jit: call "
            "model.prepare(batch, seq) with the shape of this call before jit-compiling it")
      # A tp group's ranks hold the same tokens after attention: the DP-group exchange.
      comm = jm.Communicator(cfg, self.rules.mesh, axis=self.rules.expert_axis,
                             backend=self.backend, replicated_over=self.rules.tp_axis)
      self._comms[(cfg, slot)] = comm
    return comm

  @property
  def backend_name(self) -> str:
    """The backend the communicators use ('auto' resolved as Communicator resolves it)."""
    if self.backend != "auto":
      return self.backend
    return jm.available_backends(self.rules.mesh.devices.flat[0].platform)[-1]

  def check(self) -> None:
    """Raises jm.CommError for a run-time error any communicator (or the AllReduce)
    recorded."""
    for comm in self._comms.values():
      comm.check()
    if self._all_reduce is not None:
      self._all_reduce.check()

  def close(self) -> None:
    for comm in self._comms.values():
      comm.close()
    self._comms.clear()
    if self._all_reduce is not None:
      self._all_reduce.close()
      self._all_reduce = None


@dataclasses.dataclass(frozen=True)
class _CallInputs:
  """What one RoutedExperts call hands its shard_maps (RoutedExperts._call_inputs)."""
  lead_shape: tuple
  T: int
  Tp: int
  comm: jm.Communicator
  dtype: jnp.dtype
  w: tuple
  x_td: jax.Array
  ids_tk: jax.Array
  weights_tk: jax.Array
  rows: P
  experts: P
  mesh: object


class RoutedExperts(nnx.Module):
  """E SwiGLU experts, sharded over the expert axes, fed through jax_moe dispatch/combine."""

  def __init__(self, num_experts: int, dim: int, hidden: int, *, experts_per_token: int,
               rules: ShardingRules, pool: CommunicatorPool, dtype, wire: str | None = None,
               fp8_block: tuple[int, int] | None = None, shared_expert: bool = False):
    wire = wire or default_wire(dtype)
    if wire not in WIRES:
      raise ValueError(f"RoutedExperts: wire must be one of {WIRES}, got {wire!r}")
    if num_experts % rules.expert_size:
      raise ValueError(f"RoutedExperts: num_experts ({num_experts}) must be divisible by the "
                       f"devices the experts are sharded over ({rules.expert_size})")
    if shared_expert:
      _check_shared_expert(wire, rules)
    self.num_experts, self.dim, self.hidden = num_experts, dim, hidden
    self.experts_per_token = experts_per_token
    self.shared_expert = bool(shared_expert)
    self.experts_per_shard = num_experts // rules.expert_size
    # expert slots: with a shared expert, each shard's slot 0 holds it (_with_shared_slot)
    slots = num_experts + (rules.expert_size if shared_expert else 0)
    self.wire = wire
    self.dtype = jnp.dtype(dtype)
    self.rules = rules
    self.pool = pool

    def weight(shape, logical_axes):
      if fp8_block is None:
        return param(rules, shape, logical_axes, dtype)
      return fp8_param(rules, shape, logical_axes, fp8_block)

    # "expert_mlp", not "mlp": the experts already take the tp axis, the dense MLP's rule.
    # Gate and up side by side, [E, D, 2, F] (tp splits F, so each shard's pair is one
    # contiguous [E_l, D, 2 F_l] block): one grouped GEMM reads both (results/
    # grouped-gemm-757ea6e/: 450.7 us against 2 x 231 at DeepSeek-V3's EP8 decode share).
    # Block-fp8 weights keep them apart: their scales tile F by 128 within each of the two.
    if fp8_block is None:
      self.w_gate_up_ed2f = param(rules, (slots, dim, 2, hidden),
                                  ("experts", "embed", None, "expert_mlp"), dtype)
    else:
      self.w_gate_edf = weight((slots, dim, hidden), ("experts", "embed", "expert_mlp"))
      self.w_up_edf = weight((slots, dim, hidden), ("experts", "embed", "expert_mlp"))
    self.w_down_efd = weight((slots, hidden, dim), ("experts", "expert_mlp", "embed"))
    pool.register(self)

  def weight_variables(self) -> tuple[nnx.Variable, ...]:
    """The experts' weights in the order the GEMMs take them: (w_gate_up_ed2f, w_down_efd),
    or (w_gate_edf, w_up_edf, w_down_efd) for block-fp8 weights."""
    if hasattr(self, "w_gate_up_ed2f"):
      return self.w_gate_up_ed2f, self.w_down_efd
    return self.w_gate_edf, self.w_up_edf, self.w_down_efd

  def tokens_per_group(self, num_tokens: int) -> int:
    """Tg: rows each data-parallel group holds, a multiple of tp (equal shares to send)."""
    tp = self.rules.tp_size
    return tp * max(1, math.ceil(num_tokens / (self.rules.axis_size * tp)))

  def moe_config(self, num_tokens: int) -> jm.MoEConfig:
    """The exchange for a call with `num_tokens` tokens in total (all groups)."""
    per_group = self.tokens_per_group(num_tokens)
    if self.wire == "exact":
      return jm.MoEConfig(num_experts=self.num_experts, experts_per_token=1, hidden=3 * self.dim,
                          max_tokens=per_group * self.experts_per_token,
                          dispatch_dtype=jnp.bfloat16)
    sent = per_group // self.rules.tp_size  # rows each rank sends
    expert = self.rules.expert_size > 1 and sent >= EXPERT_REDUCE_MIN_TOKENS
    shared = int(self.shared_expert)  # the shared expert: one more slot per token
    return jm.MoEConfig(num_experts=self.num_experts + shared * self.rules.expert_size,
                        experts_per_token=self.experts_per_token + shared,
                        hidden=self.dim, max_tokens=per_group,
                        dispatch_dtype=jnp.float8_e4m3fn if self.wire == "fp8" else jnp.bfloat16,
                        combine_reduce="expert" if expert else "source",
                        partial_dtype=PARTIAL_DTYPE if expert else jnp.float32)

  def __call__(self, x_td, topk_ids_tk, topk_weights_tk):
    c = self._call_inputs(x_td, topk_ids_tk, topk_weights_tk, slot=0)

    def fused(x_td, ids_tk, weights_tk, *w):
      with jax.named_scope(stages.DISPATCH):
        r = c.comm.dispatch(*self._dispatch_args(c.T, c.Tp, x_td, ids_tk, weights_tk))
      return self._experts_and_combine(c.comm, r, weights_tk, *w, dtype=c.dtype)

    y_td = shard_map(fused, c.mesh, in_specs=(c.rows, c.rows, c.rows) + (c.experts,) * len(c.w),
                     out_specs=c.rows)(c.x_td, c.ids_tk, c.weights_tk, *c.w)
    return y_td[:c.T].reshape(*c.lead_shape, self.dim)

  def overlapped(self, x_td, topk_ids_tk, topk_weights_tk, overlap: nnx.Module, scope: str):
    """(self(x_td, topk_ids_tk, topk_weights_tk), overlap(x_td)), the module `overlap` run
    under the named scope `scope` while the dispatched rows are in flight: the dispatch goes
    as its halves, dispatch_send -> overlap -> dispatch_recv, which give the fused dispatch's
    bits (docs/semantics.md). `overlap` takes x as given (any leading dims)."""
    steps = self.steps(x_td, topk_ids_tk, topk_weights_tk)
    pending = next(steps)
    # `overlap` needs nothing the exchange makes, so the scheduler could place it anywhere:
    # the barriers pin it after the send and before the receive. They take its parameters
    # and a copy of its output, not x or the output the caller adds: a barrier on those would
    # round them to the model dtype where XLA keeps a bf16 model's fused values in f32
    # (excess precision), and the logits would differ from the fused dispatch's.
    graphdef, state = nnx.split(overlap)
    pending, state = jax.lax.optimization_barrier((pending, state))
    with jax.named_scope(scope):
      overlapped = nnx.merge(graphdef, state)(x_td)
    pending, _ = jax.lax.optimization_barrier((pending, overlapped))
    return stages.finish(steps, pending), overlapped

  def steps(self, x_td, topk_ids_tk, topk_weights_tk, slot: int = 0):
    """A generator: dispatch_send, then it yields the pending dispatch and resumes with it
    (as the driver hands it back) for dispatch_recv, the experts and the combine; returns
    what __call__ returns. `slot` picks the communicator (one per micro-batch in flight)."""
    c = self._call_inputs(x_td, topk_ids_tk, topk_weights_tk, slot)

    def send(x_td, ids_tk, weights_tk):
      with jax.named_scope(stages.DISPATCH):
        pending = c.comm.dispatch_send(*self._dispatch_args(c.T, c.Tp, x_td, ids_tk,
                                                            weights_tk))
      # Out of shard_map as one row of a [ranks, ...] array per leaf (some are scalars):
      # `recv` takes the same rows, so each rank receives its own pending half.
      return jax.tree.map(lambda a: a[None], pending)

    def recv(pending, weights_tk, *w):
      with jax.named_scope(stages.DISPATCH):
        r = c.comm.dispatch_recv(jax.tree.map(lambda a: a[0], pending))
      return self._experts_and_combine(c.comm, r, weights_tk, *w, dtype=c.dtype)

    pending = shard_map(send, c.mesh, in_specs=(c.rows, c.rows, c.rows),
                        out_specs=c.experts)(c.x_td, c.ids_tk, c.weights_tk)
    pending = yield pending
    y_td = shard_map(recv, c.mesh, in_specs=(c.experts, c.rows) + (c.experts,) * len(c.w),
                     out_specs=c.rows)(pending, c.weights_tk, *c.w)
    return y_td[:c.T].reshape(*c.lead_shape, self.dim)

  def _call_inputs(self, x, topk_ids_tk, topk_weights_tk, slot: int) -> "_CallInputs":
    """One call's checked and padded inputs, its communicator and its sharding specs."""
    lead_shape = x.shape[:-1]
    D, K = self.dim, self.experts_per_token
    x_td = x.reshape(-1, D)
    T = x_td.shape[0]
    if topk_ids_tk.reshape(-1, K).shape[0] != T or topk_weights_tk.reshape(-1, K).shape[0] != T:
      raise ValueError(f"RoutedExperts: topk_ids {topk_ids_tk.shape} and topk_weights "
                       f"{topk_weights_tk.shape} must have {T} rows of K={K}, like x {x_td.shape}")
    ids_tk = topk_ids_tk.reshape(T, K).astype(jnp.int32)
    weights_tk = topk_weights_tk.reshape(T, K).astype(jnp.float32)
    comm = self.pool.get(self.moe_config(T), tracing=isinstance(x_td, jax.core.Tracer),
                         slot=slot)
    G, Tp = self.rules.axis_size, self.tokens_per_group(T)
    pad = G * Tp - T
    # get_value, not [...]: a BlockFp8Weights is a pytree, P(ax) shards each of its arrays
    w = tuple(variable.get_value() for variable in self.weight_variables())
    # tokens over the groups (replicated inside a tp group), experts over every rank
    return _CallInputs(
        lead_shape=lead_shape, T=T, Tp=Tp, comm=comm, dtype=x_td.dtype, w=w,
        x_td=jnp.pad(x_td, ((0, pad), (0, 0))),
        ids_tk=jnp.pad(ids_tk, ((0, pad), (0, 0)), constant_values=-1),
        weights_tk=jnp.pad(weights_tk, ((0, pad), (0, 0))),
        rows=P(self.rules.axis), experts=P(self.rules.expert_axis), mesh=self.rules.mesh)

  # ---------------------------------------------------------------- per shard
  def _real_tokens(self, T: int, Tp: int):
    """Rows of this group that hold real tokens: the rest is padding and is not sent."""
    start = jax.lax.axis_index(self.rules.axis) * Tp
    return jnp.clip(T - start, 0, Tp).astype(jnp.int32)

  def precompute_kernel_scales(self) -> bool:
    """Builds the tokamax kernel's scale operands of block-fp8 weights once, per expert shard
    (BlockFp8Weights.for_kernel on each shard's experts: the same operands, bit for bit, as
    the GEMM otherwise rebuilds in every call, ~3% of its time on an H200), where the experts'
    GEMM takes that kernel. They cost 2 bytes of HBM per 128 codes. Returns whether it did."""
    rows = jax.ShapeDtypeStruct((8, self.dim), self.dtype)  # what _wire_shard feeds the GEMM
    device = self.rules.mesh.devices.flat[0]
    spec = P(self.rules.expert_axis)
    built = False
    for variable in self.weight_variables():
      w = variable.get_value()
      if not isinstance(w, BlockFp8Weights) or w.kernel_scales is not None:
        continue
      path, _ = grouped_gemm.implementation_for(
          rows, w, preferred_element_type=jnp.float32, implementation=GEMM_IMPLEMENTATION,
          device=device)
      if self.wire == "exact" or path != "tokamax":
        continue

      def local(codes, scales, w=w):
        kernel_scales, unit = grouped_gemm.kernel_scales(scales, w.block, codes.shape[1])
        return kernel_scales, unit[None]  # a unit per shard: [shards] over the expert axes

      kernel_scales, units = jax.jit(shard_map(local, self.rules.mesh, in_specs=(spec, spec),
                                               out_specs=(spec, spec)))(w.codes, w.scales)
      variable.set_value(dataclasses.replace(w, kernel_scales=kernel_scales, kernel_unit=units))
      built = True
    return built

  @staticmethod
  def _experts(rows, group_sizes, w, precision, out_dtype):
    """SwiGLU of each row with its local expert: grouped GEMMs over the dispatched layout,
    the hidden activation rounded to the rows' dtype (arrays or BlockFp8Weights; a shard's
    precomputed kernel unit [1] becomes the scalar the GEMM takes). The down projection
    accumulates in f32 and writes `out_dtype` itself: a bf16 result costs no separate f32
    pass over every capacity row (10.8 us a layer at DeepSeek-V3's decode, 26cc7d8). Gate and
    up write the rows' dtype too (a bf16 model's linear layers round their outputs to bf16, as
    transformers' do); SwiGLU then runs in f32 on those values, rounded once."""
    def local(w):
      if isinstance(w, BlockFp8Weights) and w.kernel_unit is not None:
        return dataclasses.replace(w, kernel_unit=w.kernel_unit[0])
      return w

    w = tuple(map(local, w))
    # rows past the groups stay unspecified: down reads only h's rows inside them and the
    # combine only the routed rows (docs/semantics.md), so no pass zeroes them
    dot = lambda a, w, out=jnp.float32: grouped_gemm.ragged_dot(
        a, w, group_sizes, precision=precision, preferred_element_type=out,
        implementation=GEMM_IMPLEMENTATION, rows_past_groups="unspecified")
    if len(w) == 2:  # [E, D, 2, F]: one GEMM with N = 2F, gate's F columns then up's
      w_gate_up, w_down = w
      E, D, _, F = w_gate_up.shape
      gate_up = dot(rows, w_gate_up.reshape(E, D, 2 * F), rows.dtype).reshape(-1, 2, F)
      gate, up = gate_up[:, 0], gate_up[:, 1]
    else:
      w_gate, w_up, w_down = w
      gate, up = dot(rows, w_gate, rows.dtype), dot(rows, w_up, rows.dtype)
    f32 = lambda a: a.astype(jnp.float32)
    h = (jax.nn.silu(f32(gate)) * f32(up)).astype(rows.dtype)
    return dot(h, w_down, out_dtype)

  def _dispatch_args(self, T, Tp, x_td, ids_tk, weights_tk):
    """What this shard hands dispatch, (x, ids, weights, num_tokens), in the wire's form."""
    if self.wire != "exact":
      real = self._real_tokens(T, Tp)
      if self.shared_expert:
        ids_tk, weights_tk = self._with_shared_slot(ids_tk, weights_tk, real)
      return x_td.astype(jnp.bfloat16), ids_tk, weights_tk, real
    K = self.experts_per_token
    # every (token, slot) becomes its own token with one expert and weight 1
    x_parts = jnp.repeat(split_f32(x_td), K, axis=0)                    # [Tp*K, 3D]
    ids = ids_tk.reshape(Tp * K, 1)
    ones = jnp.where(ids >= 0, 1.0, 0.0).astype(jnp.float32)
    return x_parts, ids, ones, self._real_tokens(T, Tp) * K

  def _with_shared_slot(self, ids_tk, weights_tk, real):
    """[Tp, K] routing -> [Tp, K + 1] over the expert slots: routed expert e of shard
    s = e // L is slot e + s + 1 (slot s * (L + 1) holds the shard's shared expert), and slot
    K sends every real token to its own shard's shared expert with weight 1, so the combine
    adds the shared expert's output to the routed sum. Negative ids stay as they are (-1:
    unused; any other is the error the exchange reports)."""
    L = self.experts_per_shard
    slot_ids = jnp.where(ids_tk >= 0, ids_tk + ids_tk // L + 1, ids_tk)
    own = jax.lax.axis_index(self.rules.expert_axis) * (L + 1)
    is_real = jnp.arange(ids_tk.shape[0])[:, None] < real
    shared_ids = jnp.where(is_real, own, -1).astype(jnp.int32)
    shared_weights = is_real.astype(jnp.float32)
    return (jnp.concatenate([slot_ids, shared_ids], axis=1),
            jnp.concatenate([weights_tk, shared_weights], axis=1))

  def _experts_and_combine(self, comm, r, weights_tk, *w, dtype):
    """The dispatched rows `r` through the experts and back: this shard's [Tp, D] in dtype."""
    if self.wire != "exact":
      with jax.named_scope(stages.DISPATCH):
        rows = (jm.dequantize_fp8(r.x, r.scales, jnp.bfloat16) if comm.cfg.is_fp8 else r.x)
      with jax.named_scope(stages.EXPERTS):
        y = self._experts(rows.astype(self.dtype), r.group_sizes, w, None, jnp.bfloat16)
      with jax.named_scope(stages.COMBINE):
        out = comm.combine(y, r.handle)
      return out.astype(dtype)
    with jax.named_scope(stages.DISPATCH):
      rows = join_f32(r.x)
    # fp8 weights are dequantized in f32 by the GEMM (x's dtype), exactly as stored
    f32 = lambda w: w if isinstance(w, BlockFp8Weights) else w.astype(jnp.float32)
    with jax.named_scope(stages.EXPERTS):
      y = self._experts(rows, r.group_sizes, tuple(map(f32, w)), jax.lax.Precision.HIGHEST,
                        jnp.float32)
    with jax.named_scope(stages.COMBINE):
      y_parts = comm.combine(split_f32(y), r.handle)                    # [Tp*K, 3D], exact
    y_tkd = join_f32(y_parts).reshape(*weights_tk.shape, self.dim)
    out = jnp.zeros((weights_tk.shape[0], self.dim), jnp.float32)
    for k in range(self.experts_per_token):  # fixed k order, f32
      out = out + weights_tk[:, k:k + 1] * y_tkd[:, k]
    return out.astype(dtype)
