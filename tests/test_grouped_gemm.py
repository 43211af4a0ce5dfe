"""jax_moe.grouped_gemm.ragged_dot against jax.lax.ragged_dot and a numpy reference.

CPU: the fallback ("lax") path and "auto" (which is "lax" here) give lax.ragged_dot's result
bit for bit, for uneven and empty groups, sum(group_sizes) < rows and > rows; bad arguments
raise errors that name the argument; the tokamax wrapper's own logic (group clamping, zeroing
the rows past the groups, the dispatch rule) runs against a stand-in kernel that leaves NaN
where the real one leaves uninitialised memory.

GPU (marked `gpu`, skipped without CUDA; also skipped where tokamax does not import): the
tokamax Mosaic GPU path against lax.ragged_dot on the GPU for the same group patterns, bf16
and f32 outputs, every tuned config, inside jit and shard_map, and the models' expert layer.
fp8 weights (BlockFp8Weights, DeepSeek-V3's block layout): on CPU, quantize/dequantize against
jax_moe.models.fp8_weights' numpy dequantization (partial blocks too), the "lax" path bit for bit
against lax.ragged_dot with the dequantized weights, the kernel's scale operands, and the tokamax
wrapper on a stand-in kernel; on the GPU, tokamax's sm90 quantized kernel against lax.ragged_dot
of x with the bf16-dequantized weights, for the same group patterns and every fp8 config.
Tolerance for bf16 inputs: both accumulate in f32, so the difference is the f32 summation
order (K * 2^-24 * sum|x*w| per element) plus, for bf16 outputs, one bf16 ulp (at most 2^-7
relative: the two roundings of nearly equal f32 values may land one ulp apart).
"""

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jax_moe import grouped_gemm as gg
import jax_moe as jm
from jax_moe.sharding import shard_map
from support.meshes import make_mesh

# (M, group sizes): uneven, empty groups (first, middle, last), sum < M, sum > M, all empty.
CASES = {
    "uneven": (40, [3, 17, 1, 11, 8]),
    "empty": (32, [0, 9, 0, 0, 23, 0]),
    "short": (48, [5, 0, 12, 7]),            # sum 24 < 48: rows 24.. give zeros
    "over": (16, [10, 0, 9, 4]),             # sum 23 > 16: rows past M are ignored
    "all_empty": (8, [0, 0, 0]),
    "one_group": (24, [24]),
    "odd_rows": (21, [4, 0, 9, 5]),          # M % 8 != 0 (the tokamax wrapper pads x)
}


def _inputs(rng, m, sizes, k=32, n=24, dtype=jnp.float32):
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    w = jnp.asarray(rng.standard_normal((len(sizes), k, n)) / np.sqrt(k), dtype)
    return x, w, jnp.asarray(sizes, jnp.int32)


# ----------------------------------------------------------------------------- CPU: fallback
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("implementation", ["auto", "lax"])
def test_matches_lax_ragged_dot_bit_for_bit(rng, case, implementation):
    m, sizes = CASES[case]
    x, w, gs = _inputs(rng, m, sizes)
    highest = jax.lax.Precision.HIGHEST  # f32 on GPUs too (their default is TF32)
    got = gg.ragged_dot(x, w, gs, precision=highest, implementation=implementation)
    want = jax.lax.ragged_dot(x, w, gs, precision=highest)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_allclose(np.asarray(got), gg.reference_ragged_dot(x, w, sizes),
                               rtol=1e-5, atol=1e-5)
    covered = min(sum(sizes), m)
    assert not np.asarray(got)[covered:].any(), "rows past the groups must be zeros"


@pytest.mark.parametrize("implementation", ["auto", "lax"])
def test_garbage_rows_past_the_groups_give_zeros(rng, implementation):
    """Rows past sum(group_sizes) may hold anything (the cuda backend's dispatch leaves them
    unspecified): they never reach the output."""
    m, sizes = CASES["short"]
    x, w, gs = _inputs(rng, m, sizes)
    x = x.at[sum(sizes):].set(jnp.nan)
    got = np.asarray(gg.ragged_dot(x, w, gs, implementation=implementation))
    assert np.isfinite(got).all() and not got[sum(sizes):].any()


def test_garbage_rows_give_zeros_on_the_tokamax_wrapper(rng, stand_in_kernel):
    m, sizes = CASES["short"]
    x, w, gs = _inputs(rng, m, sizes, k=128, n=64, dtype=jnp.bfloat16)
    got = np.asarray(gg.ragged_dot(x.at[sum(sizes):].set(jnp.nan), w, gs), np.float32)
    assert stand_in_kernel and np.isfinite(got).all() and not got[sum(sizes):].any()


@pytest.mark.parametrize("dtype,out", [(jnp.bfloat16, None), (jnp.bfloat16, jnp.float32),
                                       (jnp.float32, jnp.bfloat16), (jnp.float16, None)])
def test_dtypes_and_preferred_element_type_follow_lax(rng, dtype, out):
    x, w, gs = _inputs(rng, *CASES["uneven"], dtype=dtype)
    got = gg.ragged_dot(x, w, gs, preferred_element_type=out)
    want = jax.lax.ragged_dot(x, w, gs, preferred_element_type=out)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_precision_is_passed_to_lax(rng):
    x, w, gs = _inputs(rng, *CASES["uneven"])
    got = gg.ragged_dot(x, w, gs, precision=jax.lax.Precision.HIGHEST)
    want = jax.lax.ragged_dot(x, w, gs, precision=jax.lax.Precision.HIGHEST)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_inside_jit_and_shard_map(rng):
    mesh = make_mesh(4)
    m, sizes = CASES["empty"]
    x, w, gs = _inputs(rng, m, sizes)
    xs, ws, gss = jnp.stack([x] * 4), jnp.stack([w] * 4), jnp.stack([gs] * 4)
    fn = jax.jit(shard_map(lambda a, b, c: gg.ragged_dot(a[0], b[0], c[0])[None], mesh,
                           in_specs=(P("ep"), P("ep"), P("ep")), out_specs=P("ep")))
    got = np.asarray(fn(xs, ws, gss))
    want = np.asarray(jax.lax.ragged_dot(x, w, gs))
    for shard in got:
        np.testing.assert_array_equal(shard, want)


def test_auto_is_lax_on_cpu_and_says_why():
    x = jax.ShapeDtypeStruct((64, 128), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((4, 128, 64), jnp.bfloat16)
    chosen, reason = gg.implementation_for(x, w, device=jax.devices("cpu")[0])
    assert chosen == "lax" and reason
    with pytest.raises(ValueError, match="implementation='tokamax' does not apply"):
        gg.implementation_for(x, w, implementation="tokamax", device=jax.devices("cpu")[0])


def test_tokamax_on_cpu_raises_clearly(rng):
    x, w, gs = _inputs(rng, *CASES["uneven"], dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="tokamax"):
        gg.ragged_dot(x, w, gs, implementation="tokamax")


def test_clamp_group_sizes():
    sizes, total = gg.clamp_group_sizes(jnp.asarray([3, -2, 9, 5, 4], jnp.int32), 10)
    assert np.asarray(sizes).tolist() == [3, 0, 7, 0, 0] and int(total) == 10
    sizes, total = gg.clamp_group_sizes(jnp.asarray([1, 0, 2], jnp.int16), 10)
    assert np.asarray(sizes).tolist() == [1, 0, 2] and int(total) == 3


# ----------------------------------------------------------------------------- CPU: bad input
def _bad(**overrides):
    rng = np.random.default_rng(0)
    x, w, gs = _inputs(rng, *CASES["uneven"])
    args = dict(lhs=x, rhs=w, group_sizes=gs)
    args.update(overrides)
    return args


@pytest.mark.parametrize("overrides,error,match", [
    (dict(lhs=jnp.zeros((40,))), ValueError, "lhs must have rank 2"),
    (dict(rhs=jnp.zeros((32, 24))), ValueError, "rhs must have rank 3"),
    (dict(group_sizes=jnp.zeros((5, 1), jnp.int32)), ValueError, "group_sizes must have rank 1"),
    (dict(lhs=jnp.zeros((40, 31))), ValueError, "contraction size K"),
    (dict(group_sizes=jnp.asarray([20, 20], jnp.int32)), ValueError,
     "group_sizes .* one entry per group"),
    (dict(group_sizes=jnp.asarray([8.0] * 5)), TypeError, "group_sizes must have an integer"),
    (dict(group_sizes=[8] * 5), TypeError, "group_sizes must be an array"),
    (dict(lhs=jnp.zeros((40, 32), jnp.int32)), TypeError, "lhs must have a floating dtype"),
])
def test_bad_arguments_name_the_argument(overrides, error, match):
    args = _bad(**overrides)
    with pytest.raises(error, match=match):
        gg.ragged_dot(args["lhs"], args["rhs"], args["group_sizes"])


def test_bad_implementation_and_preferred_type():
    args = _bad()
    with pytest.raises(ValueError, match="implementation must be one of"):
        gg.ragged_dot(args["lhs"], args["rhs"], args["group_sizes"], implementation="cublas")
    with pytest.raises(TypeError, match="preferred_element_type"):
        gg.ragged_dot(args["lhs"], args["rhs"], args["group_sizes"],
                      preferred_element_type="not-a-dtype")
    with pytest.raises(ValueError, match=r"rows_past_groups must be one of .*got 'nan'"):
        gg.ragged_dot(args["lhs"], args["rhs"], args["group_sizes"], rows_past_groups="nan")


# ------------------------------------------------- CPU: the tokamax wrapper on a stand-in kernel
@pytest.fixture
def stand_in_kernel(monkeypatch):
    """Pretend to be a Hopper GPU with tokamax: the 'kernel' is lax.ragged_dot with NaN in every
    row past the groups it was given (where the real kernel leaves uninitialised memory)."""
    calls = []

    def fake_ragged_dot(lhs, rhs, sizes, *, preferred_element_type, implementation):
        m = lhs.shape[0]
        if m > gg.KERNEL_ROW_TILE and m % gg.KERNEL_ROW_TILE:  # the kernel's TMA rule
            raise ValueError(f"dimension 0 must have size smaller or a multiple of its tiling "
                             f"8, but got {m}")
        try:
            recorded = np.asarray(sizes).tolist()
        except jax.errors.TracerArrayConversionError:  # inside jit
            recorded = None
        calls.append((recorded, implementation[0].config))
        if isinstance(rhs, FakeQArray):  # the quantized kernel: codes * scale of their K tile
            calls[-1] += (dict(lhs=lhs.dtype, qvalue=rhs.qvalue.shape, scale=rhs.scale.dtype,
                               scale_shape=rhs.scale.shape, out=preferred_element_type),)
            tile_k = rhs.qvalue.shape[1] // rhs.scale.shape[1]
            rhs = (rhs.qvalue.astype(jnp.float32)
                   * jnp.repeat(rhs.scale.astype(jnp.float32), tile_k, axis=1)).astype(lhs.dtype)
        out = jax.lax.ragged_dot(lhs, rhs, sizes, preferred_element_type=preferred_element_type)
        rows = jnp.arange(lhs.shape[0])[:, None]
        return jnp.where(rows < jnp.sum(sizes), out, jnp.nan).astype(out.dtype)

    class FakeQArray:
        def __init__(self, qvalue, scale, qtype):
            self.qvalue, self.scale, self.qtype = qvalue, scale, qtype

    class FakeOp:
        def __init__(self, config=None):
            self.config = config

    fake_pmg = types.SimpleNamespace(
        PallasMosaicGpuRaggedDot=FakeOp, Config=lambda **kw: kw,
        common=types.SimpleNamespace(MatmulDimension=int))
    fake_tokamax = types.SimpleNamespace(ragged_dot=fake_ragged_dot, __version__="stand-in")
    monkeypatch.setattr(gg, "_tokamax", lambda: ((fake_tokamax, fake_pmg, FakeQArray), None))
    monkeypatch.setattr(gg, "_is_hopper", lambda device: True)
    return calls


@pytest.mark.parametrize("case", ["uneven", "empty", "short", "over", "all_empty", "odd_rows"])
def test_tokamax_wrapper_zeroes_the_tail_and_clamps(rng, stand_in_kernel, case):
    m, sizes = CASES[case]
    x, w, gs = _inputs(rng, m, sizes, k=128, n=64, dtype=jnp.bfloat16)
    got = gg.ragged_dot(x, w, gs, preferred_element_type=jnp.float32)
    assert stand_in_kernel, "auto should take the tokamax path on a (stand-in) Hopper GPU"
    passed_sizes = stand_in_kernel[-1][0]
    assert sum(passed_sizes) == min(sum(sizes), m)
    want = jax.lax.ragged_dot(x, w, gs, preferred_element_type=jnp.float32)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("case", ["uneven", "short", "over", "odd_rows"])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_tokamax_wrapper_leaves_the_tail_when_asked(rng, stand_in_kernel, case, fp8):
    """rows_past_groups="unspecified": the rows inside the groups are the zeroing path's, bit
    for bit, and the rows past them are what the kernel left (the stand-in's NaN)."""
    m, sizes = CASES[case]
    if fp8:
        x, _, w, gs = _fp8_inputs(rng, m, sizes)
    else:
        x, w, gs = _inputs(rng, m, sizes, k=128, n=64, dtype=jnp.bfloat16)
    zeroed = np.asarray(gg.ragged_dot(x, w, gs, preferred_element_type=jnp.float32))
    left = np.asarray(gg.ragged_dot(x, w, gs, preferred_element_type=jnp.float32,
                                    rows_past_groups="unspecified"))
    total = min(sum(sizes), m)
    np.testing.assert_array_equal(left[:total], zeroed[:total])
    assert np.isnan(left[total:]).all() and not zeroed[total:].any()


def test_tuned_config_classes(stand_in_kernel):
    """The issue's shapes get the config measured best for them (stand-in Hopper device)."""
    assert gg.tuned_config(1024, 7168, 2048, 256) == gg.SM90_CONFIGS["decode"]    # 4 rows/group
    assert gg.tuned_config(1024, 4096, 1536, 16) == gg.SM90_CONFIGS["decode"]     # 64 rows/group
    assert gg.tuned_config(32768, 7168, 2048, 32) == gg.SM90_CONFIGS["prefill"]   # 1024
    assert gg.tuned_config(32768, 4096, 1536, 16) == gg.SM90_CONFIGS["prefill"]   # 2048


def test_tokamax_wrapper_dispatch_rule(rng, stand_in_kernel):
    m, sizes = CASES["uneven"]
    x, w, gs = _inputs(rng, m, sizes, k=128, n=64, dtype=jnp.bfloat16)
    for kwargs in (dict(precision=jax.lax.Precision.HIGHEST),
                   dict(preferred_element_type=jnp.float64 if jax.config.x64_enabled
                        else jnp.int32)):
        chosen, reason = gg.implementation_for(x, w, **kwargs)
        assert chosen == "lax", reason
    assert gg.implementation_for(x.astype(jnp.float32), w)[0] == "lax"          # f32 inputs
    assert gg.implementation_for(x[:, :96], w[:, :96])[0] == "lax"              # K % 128
    assert gg.implementation_for(x, w[:, :, :40])[0] == "lax"                   # N % 64
    assert gg.implementation_for(x, w)[0] == "tokamax"
    gg.ragged_dot(x, w, gs)
    assert stand_in_kernel[-1][1] == gg.tuned_config(m, 128, 64, len(sizes))


# ---------------------------------------------------------------------- CPU: fp8 weights
def _fp8_inputs(rng, m, sizes, k=256, n=256, block=(128, 128), dtype=jnp.bfloat16):
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    w = rng.standard_normal((len(sizes), k, n)) / np.sqrt(k)
    w *= np.exp(rng.uniform(-3, 1, (len(sizes), 1, n)))  # blocks of very different sizes
    w8 = gg.BlockFp8Weights.quantize(jnp.asarray(w, jnp.float32), block)
    return x, w, w8, jnp.asarray(sizes, jnp.int32)


@pytest.mark.parametrize("k,n,block", [(256, 192, (128, 128)), (200, 72, (128, 128)),
                                       (96, 40, (16, 32))])
def test_fp8_quantize_dequantize_match_the_checkpoint_format(rng, k, n, block):
    """Codes [G, N, K] with [G, ceil(N/bn), ceil(K/bk)] f32 scales dequantize like
    models/fp8_weights.py's numpy dequantization of each expert's [out, in] weight."""
    from jax_moe.models.fp8_weights import dequantize_block_fp8
    _, w, w8, _ = _fp8_inputs(rng, 4, [4, 0, 0], k=k, n=n, block=block)
    assert w8.codes.shape == (3, n, k) and w8.codes.dtype == jnp.float8_e4m3fn
    assert w8.scales.shape == (3, -(-n // block[0]), -(-k // block[1])) and w8.shape == (3, k, n)
    got = np.asarray(w8.dequantize(jnp.float32))
    for e in range(3):
        want = dequantize_block_fp8(np.asarray(w8.codes[e]), np.asarray(w8.scales[e]), block)
        np.testing.assert_array_equal(got[e], want.T)
    # e4m3 keeps 3 mantissa bits: at most 2^-4 relative per element, about 2.5% overall
    err = np.linalg.norm(got - w) / np.linalg.norm(w)
    assert err < 0.04, err
    assert np.asarray(jnp.abs(w8.codes.astype(jnp.float32))).max() <= gg.FP8_MAX


def test_fp8_weights_check_their_shapes():
    codes = jnp.zeros((2, 64, 256), jnp.float8_e4m3fn)
    gg.BlockFp8Weights(codes, jnp.ones((2, 1, 2), jnp.float32))
    with pytest.raises(ValueError, match="scales must have shape"):
        gg.BlockFp8Weights(codes, jnp.ones((2, 2, 1), jnp.float32))
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        gg.BlockFp8Weights(codes.astype(jnp.bfloat16), jnp.ones((2, 1, 2), jnp.float32))
    with pytest.raises(ValueError, match=r"codes must be \[G, N, K\]"):
        gg.BlockFp8Weights(codes[0], jnp.ones((1, 2), jnp.float32))


@pytest.mark.parametrize("case", sorted(CASES))
def test_fp8_lax_path_is_lax_ragged_dot_of_the_dequantized_weights(rng, case):
    m, sizes = CASES[case]
    x, _, w8, gs = _fp8_inputs(rng, m, sizes)
    for impl in ("auto", "lax"):
        chosen, _ = gg.implementation_for(x, w8, gs, preferred_element_type=jnp.float32,
                                          implementation=impl)
        if chosen != "lax":  # auto on a Hopper GPU with tokamax: the GPU tests cover it
            continue
        got = gg.ragged_dot(x, w8, gs, preferred_element_type=jnp.float32, implementation=impl)
        want = jax.lax.ragged_dot(x, w8.dequantize(jnp.bfloat16), gs,
                                  preferred_element_type=jnp.float32)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert not np.asarray(got)[min(sum(sizes), m):].any()
    got = jax.jit(gg.ragged_dot)(x, w8.for_kernel(), gs)  # a pytree through jit; dtype of x
    assert got.dtype == jnp.bfloat16 and got.shape == (m, 256)


def test_fp8_kernel_scales(rng):
    """The kernel's f16 scales: block scales over their columns, times 2^p with the largest in
    [64, 128); times the unit they give the block scales back to f16's rounding."""
    _, _, w8, _ = _fp8_inputs(rng, 4, [4, 0], k=256, n=200)
    w8 = w8.for_kernel()
    scales, unit = np.asarray(w8.kernel_scales, np.float64), float(w8.kernel_unit)
    assert w8.kernel_scales.dtype == jnp.float16 and scales.shape == (2, 2, 200)
    assert 64 <= scales.max() < 128 and np.log2(unit) == int(np.log2(unit))
    want = np.repeat(np.asarray(w8.scales, np.float64).transpose(0, 2, 1), 128, axis=2)[..., :200]
    np.testing.assert_allclose(scales * unit, want, rtol=2.0 ** -11)
    assert np.isfinite(scales * gg.FP8_MAX).all() and (scales * gg.FP8_MAX).max() < 65504
    assert w8.nbytes == 2 * 200 * 256 + 2 * 2 * 2 * 4 + 2 * 2 * 200 * 2


def test_fp8_bad_arguments(rng):
    x, _, w8, gs = _fp8_inputs(rng, *CASES["uneven"])
    with pytest.raises(ValueError, match="contraction size K"):
        gg.ragged_dot(x[:, :128], w8, gs)
    with pytest.raises(ValueError, match="one entry per group"):
        gg.ragged_dot(x, w8, gs[:2])
    with pytest.raises(TypeError, match="integer"):
        gg.ragged_dot(x, w8, gs.astype(jnp.float32))
    with pytest.raises(ValueError, match="implementation must be one of"):
        gg.ragged_dot(x, w8, gs, implementation="cublas")


# ------------------------------------------------------------- CPU: the CUTLASS path's checks
def test_cutlass_refuses_clearly_where_it_does_not_apply(rng):
    x, w, gs = _inputs(rng, *CASES["uneven"], k=256, n=256, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="cutlass' does not apply: rhs is not a BlockFp8Weights"):
        gg.ragged_dot(x, w, gs, implementation="cutlass")
    _, _, w8, _ = _fp8_inputs(rng, *CASES["uneven"])
    if gg.cutlass_status()[0] and gg._is_hopper(jax.devices()[0]):
        return  # it applies here: the GPU tests below run it
    why = "not a Hopper GPU" if gg.cutlass_status()[0] else "no CUTLASS kernels"
    with pytest.raises(ValueError, match=f"cutlass' does not apply: .*{why}"):
        gg.ragged_dot(x, w8, gs, implementation="cutlass")
    assert gg.implementation_for(x, w8)[0] != "cutlass"  # "auto" never picks it on a CPU


def test_cutlass_status_follows_the_build():
    available, reason = gg.cutlass_status()
    version = jm.build_info().get("cutlass_version")
    assert available == bool(version)
    assert (version in reason) if available else ("fetch_headers.sh" in reason)
    configs = gg.cutlass_configs()
    assert (set(gg.CUTLASS_CONFIGS.values()) <= set(configs)) if available else configs == []


@pytest.mark.parametrize("change,error,match", [
    (dict(x_codes=jnp.zeros((8, 256), jnp.bfloat16)), TypeError, "x_codes must be float8_e4m3fn"),
    (dict(x_scales=jnp.ones((8, 1), jnp.float32)), ValueError, r"x_scales must be \[M, K/128\]"),
    (dict(x_codes=jnp.zeros((8, 384), jnp.float8_e4m3fn)), ValueError, "must share K"),
    (dict(group_sizes=jnp.ones((3,), jnp.int32)), ValueError, r"group_sizes must be \[G\]"),
    (dict(config="nope"), ValueError, "config must be one of|no CUTLASS kernels"),
])
def test_cutlass_fp8_entry_checks_its_arguments(rng, change, error, match):
    _, _, w8, _ = _fp8_inputs(rng, 8, [8, 0])
    args = dict(x_codes=jnp.zeros((8, 256), jnp.float8_e4m3fn),
                x_scales=jnp.ones((8, 2), jnp.float32), group_sizes=jnp.asarray([8, 0]),
                config=None)
    args.update(change)
    with pytest.raises(error, match=match):
        gg.cutlass_ragged_dot_fp8(args["x_codes"], args["x_scales"], w8, args["group_sizes"],
                                  config=args["config"])


@pytest.mark.parametrize("case", ["uneven", "empty", "short", "over", "all_empty", "odd_rows"])
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32, jnp.float16])
def test_fp8_tokamax_wrapper_on_a_stand_in_kernel(rng, stand_in_kernel, case, out_dtype):
    """The wrapper hands the kernel f16 x, codes as a [G, K, N] transpose, f16 scales [G, K/128,
    N] times 2^p, clamped sizes and a block_n of one 128-byte output row; it undoes 2^p and
    zeroes the rows past the groups."""
    m, sizes = CASES[case]
    x, _, w8, gs = _fp8_inputs(rng, m, sizes)
    assert gg.implementation_for(x, w8)[0] == "tokamax"
    for weights in (w8, w8.for_kernel()):
        got = gg.ragged_dot(x, weights, gs, preferred_element_type=out_dtype)
        passed_sizes, config, operands = stand_in_kernel[-1]
        assert sum(passed_sizes) == min(sum(sizes), m)
        kernel_out = jnp.bfloat16  # f32 and f16 results are cast from the kernel's bf16
        assert operands == dict(lhs=jnp.float16, qvalue=(len(sizes), 256, 256),
                                scale=jnp.float16, scale_shape=(len(sizes), 2, 256),
                                out=kernel_out)
        assert config == gg.tuned_fp8_config(m, len(sizes)) and config["block_n"] == 64
        want = jax.lax.ragged_dot(x, w8.dequantize(jnp.bfloat16), gs,
                                  preferred_element_type=jnp.float32)
        assert got.dtype == out_dtype
        _assert_fp8_close(got, want, x, w8, sizes, out_dtype)
        assert not np.asarray(got, np.float32)[min(sum(sizes), m):].any()


def test_fp8_tuned_config_classes(stand_in_kernel):
    """DeepSeek decode (4 rows per group) gets 16-row tiles, Qwen3 decode (64) the decode ones."""
    small = {**gg.SM90_FP8_CONFIGS["decode-small"], "block_n": 64}
    assert gg.tuned_fp8_config(1024, 256) == small
    assert gg.tuned_fp8_config(1024, 16) == {**gg.SM90_FP8_CONFIGS["decode"], "block_n": 64}
    assert gg.tuned_fp8_config(32768, 32) == {**gg.SM90_FP8_CONFIGS["prefill"], "block_n": 64}


def test_fp8_dispatch_rule(rng, stand_in_kernel):
    x, _, w8, gs = _fp8_inputs(rng, *CASES["uneven"])
    assert gg.implementation_for(x, w8)[0] == "tokamax"
    assert gg.implementation_for(x.astype(jnp.float16), w8)[0] == "tokamax"
    assert gg.implementation_for(x.astype(jnp.float32), w8)[0] == "lax"
    assert gg.implementation_for(x, w8, precision=jax.lax.Precision.HIGHEST)[0] == "lax"
    _, _, small_blocks, _ = _fp8_inputs(rng, 8, [8], k=256, n=192, block=(128, 64))
    assert gg.implementation_for(x, small_blocks)[0] == "lax"             # K block % 128
    _, _, odd_n, _ = _fp8_inputs(rng, 8, [8], k=256, n=72)
    assert gg.implementation_for(x, odd_n)[0] == "lax"                    # N % 64
    _, _, n192, _ = _fp8_inputs(rng, 8, [8], k=256, n=192)
    assert gg.implementation_for(x, n192)[0] == "lax"                     # N % 128 (tile pairs)
    _, _, odd_k, _ = _fp8_inputs(rng, 8, [8], k=200, n=192)
    assert gg.implementation_for(x[:, :200], odd_k)[0] == "lax"           # K % block
    assert gg.implementation_for(x, w8, implementation="lax")[0] == "lax"
    with pytest.raises(ValueError, match="does not apply"):
        gg.implementation_for(x.astype(jnp.float32), w8, implementation="tokamax")


def _fp8_expert_layer(rng, tp=False):
    """A RoutedExperts of 8 block-fp8 experts (D 256, F 128) over 2 CPU devices (one tp pair
    with tp), random weights, and its inputs."""
    from jax_moe.models.moe import CommunicatorPool, RoutedExperts
    from jax_moe.models.sharding import ShardingRules

    E, D, F, K, T = 8, 256, 128, 2, 16
    mesh = make_mesh(2)  # skips with fewer than 2 devices
    if tp:
        mesh = jax.sharding.Mesh(mesh.devices.reshape(1, 2), ("dp", "tp"))
    rules = ShardingRules.of_mesh(mesh, None, "tp" if tp else None)
    layer = RoutedExperts(E, D, F, experts_per_token=K, rules=rules,
                          pool=CommunicatorPool(rules, "xla"), dtype=jnp.bfloat16, wire="bf16",
                          fp8_block=(128, 128))
    for variable in (layer.w_gate_edf, layer.w_up_edf, layer.w_down_efd):
        g, k, n = variable.get_value().shape
        w = rng.standard_normal((g, k, n)).astype(np.float32) / np.sqrt(k)
        q = gg.BlockFp8Weights.quantize(w, (128, 128))
        like = variable.get_value()
        variable.set_value(gg.BlockFp8Weights(
            jax.device_put(q.codes, like.codes.sharding),
            jax.device_put(q.scales, like.scales.sharding), q.block))
    x = jnp.asarray(rng.standard_normal((T, D)), jnp.bfloat16)
    ids = jnp.asarray(np.stack([rng.permutation(E)[:K] for _ in range(T)]), jnp.int32)
    layer.pool.prepare(T)
    return layer, (x, ids, jnp.full((T, K), 1.0 / K, jnp.float32))


@pytest.mark.parametrize("tp", [False, True], ids=["ep", "dp_tp"])
def test_models_fp8_kernel_scales_built_once_give_the_same_bits(rng, stand_in_kernel, tp):
    """RoutedExperts.precompute_kernel_scales (stand-in Hopper with tokamax): each shard's
    operands are those the GEMM builds per call, so the layer's output is bit-identical, and
    the kernel got the precomputed f16 scales."""
    from flax import nnx

    layer, inputs = _fp8_expert_layer(rng, tp)
    run = lambda: np.asarray(nnx.jit(lambda m, *a: m(*a))(layer, *inputs), np.float32)  # noqa: E731
    before = run()
    assert layer.precompute_kernel_scales()
    w = layer.w_gate_edf.get_value()
    assert w.kernel_scales.shape == (8, 256 // 128, 128) and w.kernel_scales.dtype == jnp.float16
    assert w.kernel_unit.shape == (2,)  # one per shard
    stand_in_kernel.clear()
    np.testing.assert_array_equal(run(), before)
    assert stand_in_kernel and all(call[2]["scale"] == jnp.float16 for call in stand_in_kernel)
    assert not layer.precompute_kernel_scales()  # already built


def test_models_bf16_experts_take_gate_and_up_in_one_gemm(rng, stand_in_kernel, monkeypatch):
    """bf16 RoutedExperts on a stand-in Hopper with tokamax: two kernel calls a layer (gate and
    up side by side, N = 2F, then down), finite, and bit for bit what lax.ragged_dot gives."""
    from flax import nnx
    from jax_moe.models import moe
    from jax_moe.models.moe import CommunicatorPool, RoutedExperts
    from jax_moe.models.sharding import ShardingRules

    E, D, F, K, T = 8, 256, 128, 2, 21
    rules = ShardingRules(make_mesh(1))
    layer = RoutedExperts(E, D, F, experts_per_token=K, rules=rules,
                          pool=CommunicatorPool(rules, "xla"), dtype=jnp.bfloat16, wire="bf16")
    assert [v.get_value().shape for v in layer.weight_variables()] == [(E, D, 2, F), (E, F, D)]
    for variable in layer.weight_variables():
        shape = variable.get_value().shape
        variable.set_value(jnp.asarray(rng.standard_normal(shape) / np.sqrt(shape[1]),
                                       jnp.bfloat16))
    x = jnp.asarray(rng.standard_normal((T, D)), jnp.bfloat16)
    ids = jnp.asarray(np.stack([rng.permutation(E)[:K] for _ in range(T)]), jnp.int32)
    weights = jnp.full((T, K), 1.0 / K, jnp.float32)
    layer.pool.prepare(T)
    run = lambda: np.asarray(nnx.jit(lambda m, *a: m(*a))(layer, x, ids, weights), np.float32)  # noqa: E731
    got = run()
    assert len(stand_in_kernel) == 2, stand_in_kernel
    monkeypatch.setattr(moe, "GEMM_IMPLEMENTATION", "lax")
    np.testing.assert_array_equal(got, run())
    assert np.isfinite(got).all()


def test_models_fp8_kernel_scales_are_not_built_for_the_lax_path(rng, monkeypatch):
    from jax_moe.models import moe

    layer, _ = _fp8_expert_layer(rng)
    assert not layer.precompute_kernel_scales()  # CPU: lax.ragged_dot, nothing to build
    assert layer.w_gate_edf.get_value().kernel_scales is None
    monkeypatch.setattr(moe, "GEMM_IMPLEMENTATION", "lax")
    assert not layer.precompute_kernel_scales()


def _assert_fp8_close(got, want, x, w8, sizes, out_dtype):
    """got (the kernel: f16 x, weights codes * f16 scale in f16) against x times the
    bf16-dequantized weights: their weights differ by the bf16 rounding (2^-9 relative) plus
    the f16 roundings of scale and product (2 * 2^-11), so |got - want| <= 2^-8 * sum|x*w|
    (with room), plus one bf16 ulp of the result (the kernel writes bf16)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    magnitude = gg.reference_ragged_dot(np.abs(np.asarray(x, np.float64)),
                                        np.abs(np.asarray(w8.dequantize(jnp.float32),
                                                          np.float64)), sizes)
    bound = 2.0 ** -8 * magnitude + 2.0 ** -7 * np.abs(want) + 1e-30
    excess = np.abs(got - want) - bound
    assert (excess <= 0).all(), f"max excess {excess.max():.3g}"


# ----------------------------------------------------------------------------------- GPU
def _needs_hopper_and(status):
    available, reason = status()
    if not available:
        pytest.skip(reason)
    device = jax.devices()[0]
    if not gg._is_hopper(device):
        pytest.skip(f"{device.device_kind} is not a Hopper GPU")


def _needs_tokamax():
    _needs_hopper_and(gg.tokamax_status)


def _assert_close(got, want, x, w, sizes, out_dtype):
    """Within the f32 summation-order bound, plus one bf16 rounding for bf16 outputs."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    magnitude = gg.reference_ragged_dot(np.abs(np.asarray(x, np.float64)),
                                        np.abs(np.asarray(w, np.float64)), sizes)
    bound = x.shape[1] * 2.0 ** -24 * magnitude
    if jnp.dtype(out_dtype) != jnp.float32:
        bound = bound + 2.0 ** -7 * np.abs(want) + 1e-30  # one bf16 ulp of either rounding
    excess = np.abs(got - want) - bound
    assert (excess <= 0).all(), f"max excess {excess.max():.3g} at {np.unravel_index(excess.argmax(), excess.shape)}"


GPU_CASES = {
    "uneven": (1000, [3, 170, 1, 0, 411, 88, 0, 327]),      # empty groups, sum 1000 = M
    "short": (1024, [64, 0, 129, 7, 0, 300, 0, 1]),         # sum 501 < 1024
    "decode": (64, [1, 0, 5, 2, 0, 0, 9, 3]),               # few rows per group
    "over": (256, [200, 0, 90, 40, 0, 0, 0, 0]),            # sum 330 > 256
    # M above 8 and not a multiple of 8: the kernel's TMA tiles refuse such an x (seen at 12,
    # a two-batch micro-batch of the tiny Qwen3-MoE); the wrapper pads it
    "odd_rows": (12, [5, 0, 4, 3]),
    "odd_many": (1001, [500, 0, 1, 300, 0, 0, 100, 90]),   # sum 991 < 1001
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(GPU_CASES))
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
def test_gpu_tokamax_matches_lax(rng, case, out_dtype):
    _needs_tokamax()
    m, sizes = GPU_CASES[case]
    x, w, gs = _inputs(rng, m, sizes, k=512, n=256, dtype=jnp.bfloat16)
    assert gg.implementation_for(x, w, preferred_element_type=out_dtype)[0] == "tokamax"
    want = jax.jit(lambda a, b, c: jax.lax.ragged_dot(a, b, c, preferred_element_type=out_dtype))(
        x, w, gs)
    for impl in ("auto", "tokamax"):
        got = jax.jit(lambda a, b, c: gg.ragged_dot(a, b, c, preferred_element_type=out_dtype,
                                                    implementation=impl))(x, w, gs)
        assert got.dtype == want.dtype
        _assert_close(got, want, x, w, sizes, out_dtype)
        assert not np.asarray(got, np.float32)[min(sum(sizes), m):].any()


@pytest.mark.gpu
@pytest.mark.parametrize("config_name", ["heuristics", *sorted(gg.SM90_CONFIGS)])
def test_gpu_every_tuned_config_matches_lax(rng, config_name):
    _needs_tokamax()
    config = None if config_name == "heuristics" else gg.SM90_CONFIGS[config_name]
    for case in ("uneven", "short"):
        m, sizes = GPU_CASES[case]
        x, w, gs = _inputs(rng, m, sizes, k=512, n=256, dtype=jnp.bfloat16)
        got = jax.jit(lambda a, b, c: gg.tokamax_ragged_dot(a, b, c, config=config))(x, w, gs)
        want = jax.lax.ragged_dot(x, w, gs)
        _assert_close(got, want, x, w, sizes, jnp.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(GPU_CASES))
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
def test_gpu_fp8_matches_the_dequantized_reference(rng, case, out_dtype):
    """tokamax's sm90 quantized kernel (fp8 codes in HBM) against lax.ragged_dot of x with the
    bf16-dequantized weights: uneven and empty groups, sum < M, sum > M, decode-sized groups."""
    _needs_tokamax()
    m, sizes = GPU_CASES[case]
    x, _, w8, gs = _fp8_inputs(rng, m, sizes, k=512, n=256)
    assert gg.implementation_for(x, w8, preferred_element_type=out_dtype)[0] == "tokamax"
    want = jax.jit(lambda a, b, c: jax.lax.ragged_dot(a, b.dequantize(jnp.bfloat16), c,
                                                      preferred_element_type=jnp.float32))(
        x, w8, gs)
    # kernel scales made once (for_kernel) for bf16 outputs, in the call for f32 ones
    weights = w8.for_kernel() if out_dtype == jnp.bfloat16 else w8
    got = jax.jit(lambda a, b, c: gg.ragged_dot(a, b, c, preferred_element_type=out_dtype))(
        x, weights, gs)
    assert got.dtype == out_dtype
    _assert_fp8_close(got, want, x, w8, sizes, out_dtype)
    assert not np.asarray(got, np.float32)[min(sum(sizes), m):].any()
    err = np.linalg.norm(np.asarray(got, np.float64) - np.asarray(want, np.float64))
    print(f"fp8 {case} {jnp.dtype(out_dtype).name}: relative error "
          f"{err / np.linalg.norm(np.asarray(want, np.float64)):.2e}")


_FP8_CONFIGS = list(gg.SM90_FP8_CONFIGS.values())
_FP8_CONFIG_NAMES = ["heuristics"] + [name for i, (name, c) in enumerate(gg.SM90_FP8_CONFIGS.items())
                                      if c not in _FP8_CONFIGS[:i]]  # the distinct ones


@pytest.mark.gpu
@pytest.mark.parametrize("config_name", _FP8_CONFIG_NAMES)
def test_gpu_every_fp8_config_matches(rng, config_name):
    _needs_tokamax()
    for case in ("short",):  # (each config's compile takes seconds)
        m, sizes = GPU_CASES[case]
        x, _, w8, gs = _fp8_inputs(rng, m, sizes, k=512, n=256)
        config = None
        if config_name != "heuristics":
            config = {**gg.SM90_FP8_CONFIGS[config_name], "block_n": 64}
        got = jax.jit(lambda a, b, c: gg.tokamax_ragged_dot_fp8(
            a, b, c, preferred_element_type=jnp.bfloat16, config=config))(x, w8.for_kernel(), gs)
        want = jax.lax.ragged_dot(x, w8.dequantize(jnp.bfloat16), gs,
                                  preferred_element_type=jnp.float32)
        _assert_fp8_close(got, want, x, w8, sizes, jnp.bfloat16)


def _needs_cutlass():
    _needs_hopper_and(gg.cutlass_status)


def _w8a8_reference(q, scales, w8, sizes):
    """f64 product of the dequantized fp8 rows and weights (module semantics)."""
    from jax_moe.quantization import dequantize_fp8
    x = np.asarray(dequantize_fp8(q, scales, jnp.float32), np.float64)
    w = np.asarray(w8.dequantize(jnp.float32), np.float64)
    return x, w, gg.reference_ragged_dot(x, w, sizes)


def _assert_w8a8_close(got, x, w, want, sizes):
    """Both operands are exact in f32 and every product of two e4m3 values is too; what the
    kernel adds: Hopper's fp8 wgmma accumulates a 128-deep K block with ~14 significant bits
    (DeepSeek-V3's report; measured here: errors up to ~2^-14 of sum|x*w|), then CUTLASS adds
    the scaled blocks in f32, and the output is rounded once to bf16 (half an ulp: 2^-8
    relative at most). Bound: 2^-13 * sum|x*w| + 2^-8 * |result|."""
    got = np.asarray(got, np.float64)
    magnitude = gg.reference_ragged_dot(np.abs(x), np.abs(w), sizes)
    bound = 2.0 ** -13 * magnitude + 2.0 ** -8 * np.abs(want) + 1e-30
    excess = np.abs(got - want) - bound
    assert (excess <= 0).all(), (
        f"max excess {excess.max():.3g} at {np.unravel_index(excess.argmax(), excess.shape)}")


CUTLASS_CASES = {
    **GPU_CASES,
    "negative": (300, [100, -5, 80, 0, 120, 0, 0, 0]),      # a negative size counts as 0
    "all_empty": (64, [0] * 8),
    # more groups than the argument kernel's 256 threads: its scan runs in chunks
    "many_groups": (1200, list(np.random.default_rng(7).integers(0, 9, 300))),
}


@pytest.mark.gpu
@pytest.mark.parametrize("config", gg.cutlass_configs() or ["(no CUTLASS build)"])
@pytest.mark.parametrize("case", sorted(CUTLASS_CASES))
def test_gpu_cutlass_fp8_matches_the_dequantized_product(rng, case, config):
    """The CUTLASS fp8 x fp8 kernel on dispatch-style fp8 rows (quantize_fp8, scales of very
    different sizes per block) against the f64 product of both dequantized operands. The rows
    past the groups hold NaN codes and scales: they must not reach any result, and they come
    back as zeros (zero_tail) or are left alone (not compared)."""
    _needs_cutlass()
    from jax_moe.quantization import quantize_fp8
    m, sizes = CUTLASS_CASES[case]
    g = len(sizes)
    x = rng.standard_normal((m, 512)) * np.exp(rng.uniform(-4, 2, (m, 1)))
    q, scales = quantize_fp8(jnp.asarray(x, jnp.float32), 128)
    total = min(sum(max(s, 0) for s in sizes), m)
    q = q.at[total:].set(jnp.nan)  # e4m3fn NaN
    scales = scales.at[total:].set(jnp.nan)
    _, _, w8, gs = _fp8_inputs(rng, m, sizes, k=512, n=384)
    xd, wd, want = _w8a8_reference(q[:total], scales[:total], w8, np.maximum(sizes, 0))
    for zero_tail in (True, False):
        got = jax.jit(lambda a, b, c, d: gg.cutlass_ragged_dot_fp8(
            a, b, c, d, zero_tail=zero_tail, config=config))(q, scales, w8, gs)
        assert got.dtype == jnp.bfloat16 and got.shape == (m, 384)
        got = np.asarray(got, np.float64)
        _assert_w8a8_close(got[:total], xd, wd, want, np.maximum(sizes, 0))
        if zero_tail:
            assert not got[total:].any()


@pytest.mark.gpu
def test_gpu_cutlass_one_compiled_call_follows_the_group_sizes(rng):
    """The group sizes reach CUTLASS through the device only: one jitted call, fed several
    size vectors (empty groups moving around), is right for each."""
    _needs_cutlass()
    m, g = 256, 6
    x = jnp.asarray(rng.standard_normal((m, 256)), jnp.bfloat16)
    _, _, w8, _ = _fp8_inputs(rng, m, [0] * g, k=256, n=256)
    fn = jax.jit(lambda a, b, c: gg.ragged_dot(a, b, c, implementation="cutlass",
                                               preferred_element_type=jnp.float32))
    from jax_moe.quantization import quantize_fp8
    q, scales = quantize_fp8(x.astype(jnp.float32), 128)
    for sizes in ([256, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 256], [40, 0, 100, 0, 16, 100],
                  [1, 1, 1, 1, 1, 1], [0] * g):
        got = fn(x, w8, jnp.asarray(sizes, jnp.int32))
        assert got.dtype == jnp.float32
        xd, wd, want = _w8a8_reference(q, scales, w8, sizes)
        total = sum(sizes)
        _assert_w8a8_close(np.asarray(got)[:total], xd[:total], wd, want[:total], sizes)
        assert not np.asarray(got)[total:].any()


@pytest.mark.gpu
def test_gpu_cutlass_against_bf16_weights_states_the_error(rng):
    """What w8a8 costs against the bf16 product (the accuracy the issue asks to state): the
    relative Frobenius error of the CUTLASS path against x @ w in f64 at DeepSeek-V3-like
    magnitudes stays under 5% (e4m3's 2^-4 relative rounding of both operands, averaged)."""
    _needs_cutlass()
    m, sizes = GPU_CASES["uneven"]
    x, w, w8, gs = _fp8_inputs(rng, m, sizes, k=512, n=256)
    got = np.asarray(jax.jit(lambda a, b, c: gg.ragged_dot(a, b, c, implementation="cutlass"))(
        x, w8, gs), np.float64)
    want = gg.reference_ragged_dot(np.asarray(x, np.float64), w, sizes)
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    print(f"cutlass w8a8 against the f64 product of x and the unquantized w: {err:.3e}")
    assert err < 0.05, err


@pytest.mark.gpu
def test_gpu_inside_shard_map(rng):
    _needs_tokamax()
    mesh = make_mesh(1)
    m, sizes = GPU_CASES["uneven"]
    x, w, gs = _inputs(rng, m, sizes, k=256, n=128, dtype=jnp.bfloat16)
    fn = jax.jit(shard_map(lambda a, b, c: gg.ragged_dot(a[0], b[0], c[0])[None], mesh,
                           in_specs=(P("ep"), P("ep"), P("ep")), out_specs=P("ep")))
    got = fn(x[None], w[None], gs[None])[0]
    _assert_close(got, jax.lax.ragged_dot(x, w, gs), x, w, sizes, jnp.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("exchange", ["xla", "cuda"])
def test_gpu_models_expert_layer_with_tokamax(monkeypatch, exchange):
    """RoutedExperts (bf16, 1 GPU) gives the same output through tokamax as through
    lax.ragged_dot, within the bf16 rounding of the hidden activation and output. A quarter of
    the slots are -1, so the dispatched rows end before the capacity: the GEMMs leave the rows
    past the groups unspecified (rows_past_groups="unspecified") and nothing may read them."""
    _needs_tokamax()
    from flax import nnx
    from jax_moe.models import moe
    from jax_moe.models.moe import CommunicatorPool, RoutedExperts
    from jax_moe.models.sharding import ShardingRules

    E, D, F, K, T = 8, 256, 128, 2, 64
    if exchange not in jm.available_backends():
        pytest.skip(f"backend {exchange} is not built here")
    rules = ShardingRules(make_mesh(1))
    layer = RoutedExperts(E, D, F, experts_per_token=K, rules=rules,
                          pool=CommunicatorPool(rules, exchange), dtype=jnp.bfloat16, wire="bf16")
    rng = np.random.default_rng(1)
    _, state = nnx.split(layer)
    for _, variable in nnx.to_flat_state(state):
        shape = variable.get_value().shape
        variable.set_value(jnp.asarray(rng.standard_normal(shape) / np.sqrt(shape[1]),
                                       jnp.bfloat16))
    x = jnp.asarray(rng.standard_normal((T, D)), jnp.bfloat16)
    ids = np.stack([rng.permutation(E)[:K] for _ in range(T)])
    ids = jnp.asarray(np.where(rng.random((T, K)) < 0.25, -1, ids), jnp.int32)
    weights = jnp.full((T, K), 1.0 / K, jnp.float32)
    layer.pool.prepare(T)
    outs = {}
    for impl in ("lax", "auto"):
        monkeypatch.setattr(moe, "GEMM_IMPLEMENTATION", impl)
        outs[impl] = np.asarray(nnx.jit(lambda m, a, b, c: m(a, b, c))(layer, x, ids, weights),
                                np.float32)
    scale = np.abs(outs["lax"]).max()
    np.testing.assert_allclose(outs["auto"], outs["lax"], atol=2.0 ** -6 * scale)


# ----------------------------------------------------------------------------- the benchmark
def test_bench_grouped_gemm_quick_runs_on_cpu(tmp_path):
    """benchmarks/bench_grouped_gemm.py --quick end to end on one host device (seconds)."""
    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    done = subprocess.run([sys.executable, str(repo / "benchmarks" / "bench_grouped_gemm.py"),
                           "--quick", "--groups", "uneven", "--out", str(tmp_path)],
                          cwd=repo, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    payload = json.loads((tmp_path / "grouped_gemm_cpu.json").read_text())
    assert {r["status"] for r in payload["results"] if r["family"] in ("lax", "einsum", "auto")} \
        == {"ok"}
    # (no sign asserted: on a busy CPU the difference of two tiny loop times can be negative)
    floors = payload["floors"]
    assert np.isfinite([floors["peak"]["tflops"], floors["copy"]["tb_per_s"]]).all()
    assert sum(payload["shapes"]["prefill-tiny"]["group_sizes"]) == 512
