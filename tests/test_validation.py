"""Trace-time validation: bad configs and bad arguments raise ValueError/TypeError naming them."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import jax_moe as jm
from support.meshes import make_mesh
from support.moe_runner import AXIS
from jax_moe.sharding import shard_map

BASE = dict(num_experts=16, experts_per_token=4, hidden=256, max_tokens=16)


def names(argument):
    """Matches the argument's name as a word, e.g. `x` but not the x in `max_tokens`."""
    return rf"(?<![\w]){argument}(?![\w])"


# ---------------------------------------------------------------------------- config


@pytest.mark.parametrize("overrides, argument", (
    (dict(dispatch_dtype=jnp.float8_e4m3fn, hidden=320, block_size=128), "hidden"),
    (dict(dispatch_dtype=jnp.bfloat16, hidden=36), "hidden"),  # 72-byte rows
    (dict(dispatch_dtype=jnp.float8_e4m3fn, hidden=24, block_size=8), "hidden"),  # 24-byte rows
    (dict(experts_per_token=17), "experts_per_token"),
    (dict(combine_reduce="sum"), "combine_reduce"),
    (dict(partial_dtype=jnp.float16), "partial_dtype"),
    (dict(dispatch_dtype=jnp.float32), "dispatch_dtype"),
))
def test_bad_config_is_refused(backend, overrides, argument):
    with pytest.raises((ValueError, TypeError), match=names(argument)):
        cfg = jm.MoEConfig(**{**BASE, **overrides})
        jm.Communicator(cfg, make_mesh(2), axis=AXIS, backend=backend)


def test_num_experts_must_divide_over_the_axis(backend):
    cfg = jm.MoEConfig(**{**BASE, "num_experts": 12})
    jm.Communicator(cfg, make_mesh(4), axis=AXIS, backend=backend)  # 3 local experts: fine
    with pytest.raises(ValueError, match=names("num_experts")):
        jm.Communicator(cfg, make_mesh(8), axis=AXIS, backend=backend)


def test_max_recv_tokens_above_the_default_capacity_is_refused(backend):
    default = 2 * 16 * 4  # R * T * min(K, L)
    jm.Communicator(jm.MoEConfig(**BASE, max_recv_tokens=default), make_mesh(2), backend=backend)
    with pytest.raises(ValueError, match=names("max_recv_tokens")):
        cfg = jm.MoEConfig(**BASE, max_recv_tokens=default + 1)
        jm.Communicator(cfg, make_mesh(2), axis=AXIS, backend=backend)


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match=names("backend")):
        jm.Communicator(jm.MoEConfig(**BASE), make_mesh(2), axis=AXIS, backend="nccl")


# ---------------------------------------------------------------------------- arguments

R = 2


@dataclasses.dataclass(frozen=True)
class Args:
    """Global (all-rank) shapes of one dispatch + combine; each shard sees 1/R of axis 0."""

    x: tuple = ((R * 16, 256), jnp.bfloat16)
    scales: tuple | None = None  # set: x is a pre-quantized (q, scales) pair
    topk_ids: tuple = ((R * 16, 4), jnp.int32)
    topk_weights: tuple = ((R * 16, 4), jnp.float32)
    num_tokens: tuple = ((R,), jnp.int32)
    y: tuple | None = None  # default: [R * capacity, 256] bf16


def trace(comm, args):
    """Traces dispatch then combine under shard_map without compiling or running them."""
    y = args.y or ((R * comm.capacity, 256), jnp.bfloat16)
    specs = [args.x, args.topk_ids, args.topk_weights, args.num_tokens, y]
    if args.scales is not None:
        specs.append(args.scales)
    shapes = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in specs]

    def per_shard(x, topk_ids, topk_weights, num_tokens, y, *scales):
        payload = (x, scales[0]) if scales else x
        r = comm.dispatch(payload, topk_ids, topk_weights, num_tokens)
        return comm.combine(y, r.handle)

    return jax.eval_shape(shard_map(per_shard, comm.mesh, in_specs=P(AXIS), out_specs=P(AXIS)),
                          *shapes)


@functools.lru_cache(maxsize=None)
def communicator(backend, dispatch_dtype):
    cfg = jm.MoEConfig(**BASE, dispatch_dtype=jnp.dtype(dispatch_dtype))
    return jm.Communicator(cfg, make_mesh(R), axis=AXIS, backend=backend)


PREQUANTIZED = dict(x=((R * 16, 256), jnp.float8_e4m3fn), scales=((R * 16, 2), jnp.float32))


@pytest.mark.parametrize("dtype, args", (
    ("bfloat16", {}),
    ("float8_e4m3fn", {}),
    ("float8_e4m3fn", PREQUANTIZED),
))
def test_valid_arguments_trace(backend, dtype, args):
    out = trace(communicator(backend, dtype), Args(**args))
    assert out.shape == (R * 16, 256) and out.dtype == jnp.bfloat16


@pytest.mark.parametrize("dtype, args, argument", (
    ("bfloat16", dict(x=((R * 16, 256), jnp.float32)), "x"),
    ("bfloat16", dict(x=((R * 17, 256), jnp.bfloat16)), "x"),
    ("bfloat16", dict(x=((R * 16, 384), jnp.bfloat16)), "x"),
    ("float8_e4m3fn", dict(x=((R * 16, 256), jnp.float16)), "x"),
    ("float8_e4m3fn", {**PREQUANTIZED, "scales": ((R * 16, 4), jnp.float32)}, "scales"),
    ("float8_e4m3fn", {**PREQUANTIZED, "scales": ((R * 16, 2), jnp.bfloat16)}, "scales"),
    ("float8_e4m3fn", {**PREQUANTIZED, "x": ((R * 16, 256), jnp.int8)}, "q"),
    ("bfloat16", PREQUANTIZED, "x"),  # a (q, scales) pair needs fp8 dispatch
    ("bfloat16", dict(topk_ids=((R * 16, 4), jnp.float32)), "topk_ids"),
    ("bfloat16", dict(topk_ids=((R * 16, 4), jnp.int16)), "topk_ids"),
    ("bfloat16", dict(topk_ids=((R * 16, 5), jnp.int32)), "topk_ids"),
    ("bfloat16", dict(topk_weights=((R * 16, 4), jnp.bfloat16)), "topk_weights"),
    ("bfloat16", dict(topk_weights=((R * 16, 3), jnp.float32)), "topk_weights"),
    ("bfloat16", dict(num_tokens=((R,), jnp.float32)), "num_tokens"),
    ("bfloat16", dict(num_tokens=((R * 2,), jnp.int32)), "num_tokens"),
    ("bfloat16", dict(y=((R * 128, 256), jnp.float32)), "y"),
    ("bfloat16", dict(y=((R * 129, 256), jnp.bfloat16)), "y"),
    ("bfloat16", dict(y=((R * 128, 128), jnp.bfloat16)), "y"),
))
def test_bad_argument_is_refused_at_trace_time(backend, dtype, args, argument):
    comm = communicator(backend, dtype)
    assert comm.capacity == 128  # the y shapes above are built around it
    with pytest.raises((ValueError, TypeError), match=names(argument)):
        trace(comm, Args(**args))



@pytest.mark.parametrize("text", ["0", "-1", "nan", "inf", "1e12", "ten"])
def test_timeout_setting_must_be_a_finite_positive_bound(monkeypatch, text):
    from jax_moe.settings import timeout_s
    monkeypatch.setenv("JAX_MOE_TIMEOUT_S", text)
    with pytest.raises(ValueError, match="JAX_MOE_TIMEOUT_S must be a number of seconds in"):
        timeout_s()
