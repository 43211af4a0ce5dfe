"""Runs dispatch and combine of one configuration under jit + shard_map, compiled once.

One compiled program per `Setup` serves every routing scenario of that setup. It runs
  first  = dispatch(x);  out_given = combine(y_given, first.handle)
  second = dispatch(x);  out_scaled = combine(bf16(dequant(second.x) * (expert + 1)), second.handle)
with the second dispatch ordered after the first combine (a handle is valid for one combine,
and a backend may reuse its buffers), and returns both dispatches and both outputs per rank.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import jax_moe as jm
from jax_moe.sharding import shard_map
from support.meshes import make_mesh
from support.reference import Geometry, quantize_fp8
from support.routing_cases import activations, random_expert_outputs, random_fp8_rows

AXIS = "ep"
DISPATCH_FIELDS = ("x", "scales", "weights", "group_sizes", "tokens_per_expert")


@dataclasses.dataclass(frozen=True)
class Setup:
    backend: str
    axis_size: int
    dispatch: str = "bf16"  # "bf16", "fp8" (bf16 input quantized inside), "fp8-prequantized"
    expert_padding: int = 1
    combine_reduce: str = "source"
    partial_dtype: str = "float32"
    num_experts: int = 16
    experts_per_token: int = 4
    hidden: int = 256
    max_tokens: int = 16
    block_size: int = 128
    max_recv_tokens: int | None = None
    split: bool = False  # dispatch_send/recv + combine_send/recv instead of the fused calls
    pass_num_tokens: bool = True
    purpose: str = "parity"  # distinct purposes get distinct communicators (error tests)
    num_sms: int | None = None  # the cuda backend's chunks (MoEConfig.num_sms)

    @property
    def geometry(self):
        return Geometry(self.num_experts, self.axis_size, self.max_tokens, self.experts_per_token,
                        self.hidden, self.expert_padding, self.max_recv_tokens)

    @property
    def fp8(self):
        return self.dispatch != "bf16"

    def config(self):
        return jm.MoEConfig(
            num_experts=self.num_experts, experts_per_token=self.experts_per_token,
            hidden=self.hidden, max_tokens=self.max_tokens,
            dispatch_dtype=jnp.float8_e4m3fn if self.fp8 else jnp.bfloat16,
            block_size=self.block_size, combine_dtype=jnp.bfloat16,
            combine_reduce=self.combine_reduce, partial_dtype=jnp.dtype(self.partial_dtype),
            expert_padding=self.expert_padding, max_recv_tokens=self.max_recv_tokens,
            num_sms=self.num_sms)


@dataclasses.dataclass
class RunResult:
    first: dict  # DISPATCH_FIELDS -> [R, ...] numpy, per receiving rank
    second: dict
    out_given: np.ndarray  # [R, T, H] bf16
    out_scaled: np.ndarray


def dequantize_rows(x, scales, block_size):
    """f32 rows as the experts see them: fp8 codes times their block scale, or bf16 widened."""
    if scales is None:
        return x.astype(jnp.float32)
    blocks = x.astype(jnp.float32).reshape(x.shape[0], -1, block_size)
    return (blocks * scales[:, :, None]).reshape(x.shape)


def local_expert_of_rows(group_sizes, rows):
    """Local expert index of each dispatched row; rows past the total map to L."""
    ends = jnp.cumsum(group_sizes)
    return jnp.searchsorted(ends, jnp.arange(rows, dtype=jnp.int32), side="right")


class Runner:
    def __init__(self, setup):
        self.setup = setup
        self.geometry = setup.geometry
        self.mesh = make_mesh(setup.axis_size)
        self.comm = jm.Communicator(setup.config(), self.mesh, axis=AXIS, backend=setup.backend)
        sharded = P(AXIS)
        self._program = jax.jit(shard_map(self._per_shard, self.mesh, in_specs=sharded,
                                          out_specs=sharded))

    # ----------------------------------------------------------- inside shard_map
    def _dispatch(self, payload, ids, weights, num_tokens):
        nt = num_tokens if self.setup.pass_num_tokens else None
        if self.setup.split:
            return self.comm.dispatch_recv(self.comm.dispatch_send(payload, ids, weights, nt))
        return self.comm.dispatch(payload, ids, weights, nt)

    def _combine(self, y, handle):
        if self.setup.split:
            return self.comm.combine_recv(self.comm.combine_send(y, handle))
        return self.comm.combine(y, handle)

    def _per_shard(self, x, scales, ids, weights, num_tokens, y_given):
        payload = (x, scales) if self.setup.dispatch == "fp8-prequantized" else x
        first = self._dispatch(payload, ids, weights, num_tokens)
        out_given = self._combine(y_given, first.handle)
        payload, _ = jax.lax.optimization_barrier((payload, out_given))
        second = self._dispatch(payload, ids, weights, num_tokens)
        out_scaled = self._combine(self._scaled_by_expert(second), second.handle)
        fields = lambda r: {name: getattr(r, name) for name in DISPATCH_FIELDS}  # noqa: E731
        return fields(first), fields(second), out_given, out_scaled

    def _scaled_by_expert(self, r):
        """y = bf16(dequant(row) * (global expert + 1)): a different function per expert."""
        cap = self.comm.capacity
        L = self.geometry.local_experts
        expert = jax.lax.axis_index(AXIS) * L + local_expert_of_rows(r.group_sizes, cap)
        rows = dequantize_rows(r.x, r.scales, self.setup.block_size)
        return (rows * (expert + 1).astype(jnp.float32)[:, None]).astype(jnp.bfloat16)

    # ----------------------------------------------------------- host side
    def run(self, routing, x, y_given, scales=None):
        """x: [R, T, H] bf16 (or fp8 codes with `scales` [R, T, H/bs]); y_given: [R, cap, H] bf16."""
        g = self.geometry
        R, T = g.axis_size, g.max_tokens
        if scales is None:  # the program always takes scales; only pre-quantized runs read them
            scales = np.zeros((R, T, g.hidden // self.setup.block_size), np.float32)
        flat = lambda a: a.reshape(R * a.shape[1], *a.shape[2:]) if a.ndim > 1 else a  # noqa: E731
        args = (flat(x), flat(scales), flat(routing.topk_ids), flat(routing.topk_weights),
                routing.num_tokens, flat(y_given))
        first, second, out_given, out_scaled = jax.block_until_ready(self._program(*args))
        per_rank = lambda a: None if a is None else np.asarray(a).reshape(R, -1, *a.shape[1:])  # noqa: E731
        unflatten = lambda d: {k: per_rank(v) for k, v in d.items()}  # noqa: E731
        return RunResult(unflatten(first), unflatten(second), per_rank(out_given),
                         per_rank(out_scaled))


def describe(setup_args):
    """Readable test id for a dict of Setup overrides."""
    return ",".join(f"{key}={value}" for key, value in setup_args.items())


@functools.lru_cache(maxsize=None)
def runner(setup):
    """One compiled program per setup, shared by every test that uses it."""
    return Runner(setup)


@dataclasses.dataclass
class Inputs:
    """One call's inputs for every rank, and the rows the reference expects to travel."""

    routing: object  # reference.Routing
    x: np.ndarray  # [R, T, H] bf16, or fp8 codes when pre-quantized
    scales: np.ndarray | None  # [R, T, H/bs] f32 with pre-quantized codes
    y_given: np.ndarray  # [R, capacity, H] bf16
    rows: np.ndarray  # [R, T, H] what arrives per token: bf16 rows or fp8 codes
    row_scales: np.ndarray | None  # [R, T, H/bs] f32 for fp8

    def run(self, runner_):
        return runner_.run(self.routing, self.x, self.y_given, self.scales)


def make_inputs(setup, rng, routing):
    g = setup.geometry
    y_given = random_expert_outputs(rng, g)
    if setup.dispatch == "fp8-prequantized":
        codes, scales = random_fp8_rows(rng, g, setup.block_size)
        return Inputs(routing, codes, scales, y_given, codes, scales)
    x = activations(rng, g)
    if setup.dispatch == "fp8":
        rows, row_scales = quantize_fp8(x, setup.block_size)
        return Inputs(routing, x, None, y_given, rows, row_scales)
    return Inputs(routing, x, None, y_given, x, None)
