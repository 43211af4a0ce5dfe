"""jm.quantize_fp8 / jm.dequantize_fp8 against the numpy spec, bit for bit."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_moe as jm
from support import reference as ref
from support.checks import assert_bitwise_equal


@jax.jit
def _quantize_128(x):
    return jm.quantize_fp8(x, block_size=128)


def _blocks_of(rng, dtype):
    """[8, 512] rows whose 128-blocks cover the cases the spec singles out."""
    x = rng.standard_normal((8, 512)).astype(np.float32)
    x[0] *= 1e3  # large values: amax far above 448
    x[1, :128] = 0.0  # a block of zeros: amax floored at 1e-4, codes 0
    x[1, 128:256] = rng.uniform(-5e-5, 5e-5, 128)  # below the floor: scale stays 1e-4 / 448
    x[1, 256:384] = -np.abs(x[1, 256:384])  # all negative
    x[2, :128] = 448.0  # exactly representable, saturating code 0x7e
    x[2, 128:256] = -3.0e38  # near f32 max: the scaled values saturate at -448
    x[3] = rng.uniform(1e-3, 1.0, 512) * rng.choice((-1, 1), 512)  # subnormal fp8 codes appear
    x[4] *= 2.0**-20  # tiny but above the floor
    return x.astype(dtype)


@pytest.mark.parametrize("dtype", (np.float32, ml_dtypes.bfloat16))
def test_quantize_matches_spec_bitwise(dtype, rng):
    x = _blocks_of(rng, dtype)
    q, scales = _quantize_128(jnp.asarray(x))
    want_q, want_scales = ref.quantize_fp8(x, 128)
    assert_bitwise_equal(np.asarray(q), want_q, "q")
    assert_bitwise_equal(np.asarray(scales), want_scales, "scales")


def test_quantize_spec_cases_hold(rng):
    """The reference itself: zero blocks, floor, saturation and sign as the spec states."""
    q, scales = ref.quantize_fp8(_blocks_of(rng, np.float32), 128)
    codes = q.view(np.uint8)
    assert (codes[1, :128] == 0).all()
    assert scales[1, 0] == scales[1, 1] == np.float32(1e-4) * ref.INV_FP8_MAX
    assert ((codes[1, 256:384] & 0x80) != 0).all()  # negative values keep their sign bit
    assert (codes[2, :128] == 0x7E).all() and (codes[2, 128:256] == 0xFE).all()
    assert not np.isnan(q.astype(np.float32)).any()


def _non_finite_rows(rng):
    """[4, 512] f32 rows with NaN and +-Inf in some 128-blocks (docs/semantics.md cases)."""
    x = rng.standard_normal((4, 512)).astype(np.float32)
    x[0, 3] = np.nan  # block (0, 0): NaN
    x[1, 130] = np.inf  # block (1, 1): +Inf
    x[1, 300] = -np.inf  # block (1, 2): -Inf
    x[2, 0], x[2, 1] = np.inf, np.nan  # block (2, 0): NaN with Inf, NaN wins
    return x


NAN_BLOCKS, INF_BLOCKS = ((0, 0), (2, 0)), ((1, 1), (1, 2))


def test_non_finite_blocks_follow_the_formula_in_the_reference(rng):
    x = _non_finite_rows(rng)
    q, scales = ref.quantize_fp8(x, 128)
    codes = q.view(np.uint8).reshape(4, 4, 128)
    for b in NAN_BLOCKS:
        assert np.isnan(scales[b]) and (codes[b] == 0x7F).all()
    for b in INF_BLOCKS:
        row = x.reshape(4, 4, 128)[b]
        assert scales[b] == np.inf
        assert (codes[b][np.isinf(row)] == 0x7F).all()  # Inf * 0 is NaN
        assert (np.abs(q.reshape(4, 4, 128)[b][np.isfinite(row)].astype(np.float32)) == 0).all()
    deq = ref.dequantize_fp8(q, scales).reshape(4, 4, 128)
    finite = np.ones((4, 4), bool)
    for b in NAN_BLOCKS + INF_BLOCKS:
        finite[b] = False
        assert np.isnan(deq[b]).all()
    assert np.isfinite(deq[finite]).all()


@pytest.mark.parametrize("dtype", (np.float32, ml_dtypes.bfloat16))
def test_quantize_non_finite_matches_spec(dtype, rng):
    x = _non_finite_rows(rng).astype(dtype)
    q, scales = _quantize_128(jnp.asarray(x))
    want_q, want_scales = ref.quantize_fp8(x, 128)
    assert_bitwise_equal(np.asarray(q), want_q, "q")
    assert_bitwise_equal(np.asarray(scales), want_scales, "scales", nan_equal=True)


def test_quantize_round_half_to_even_at_the_saturation_edge():
    """Values whose scaled f32 lands just above 448 round back to 448, never to NaN."""
    amax = np.float32(6.7062445)  # amax * (448 / amax) rounds to 448.00003 in f32
    assert amax * (ref.FP8_MAX / amax) > ref.FP8_MAX
    x = np.full((1, 128), amax, np.float32)
    q, _ = _quantize_128(jnp.asarray(x))
    assert (np.asarray(q).view(np.uint8) == 0x7E).all()


@pytest.mark.parametrize("block_size", (32, 128))
def test_quantize_other_block_sizes(block_size, rng):
    x = (rng.standard_normal((4, 256)) * 3).astype(ml_dtypes.bfloat16)
    q, scales = jax.jit(lambda v: jm.quantize_fp8(v, block_size=block_size))(x)
    want_q, want_scales = ref.quantize_fp8(x, block_size)
    assert scales.shape == (4, 256 // block_size)
    assert_bitwise_equal(np.asarray(q), want_q, "q")
    assert_bitwise_equal(np.asarray(scales), want_scales, "scales")


@pytest.mark.parametrize("dtype", (jnp.float32, jnp.bfloat16))
def test_dequantize_matches_spec_bitwise(dtype, rng):
    q, scales = ref.quantize_fp8(_blocks_of(rng, np.float32), 128)
    got = jax.jit(lambda a, b: jm.dequantize_fp8(a, b, dtype=dtype))(q, scales)
    want = ref.dequantize_fp8(q, scales, dtype=np.dtype(dtype))
    assert_bitwise_equal(np.asarray(got), want, f"dequantize_fp8 to {np.dtype(dtype).name}")


def test_dequantize_inverts_quantize_within_fp8_precision(rng):
    x = rng.standard_normal((4, 256)).astype(np.float32)
    back = np.asarray(jm.dequantize_fp8(*jm.quantize_fp8(jnp.asarray(x), 128)))
    amax = np.abs(x.reshape(4, 2, 128)).max(-1, keepdims=True)
    # e4m3fn keeps 4 significant bits: relative error <= 2**-4 above its subnormal range,
    # absolute error <= half the subnormal step 2**-10 of the block's scale below it.
    # (1 + 2**-20) covers the f32 roundings of the scale and of the product.
    bound = np.maximum(np.abs(x).reshape(4, 2, 128) * 2.0**-4, amax / 448 * 2.0**-10) * (1 + 2.0**-20)
    assert (np.abs(back - x).reshape(4, 2, 128) <= bound).all()


@pytest.mark.parametrize("dtype", (jnp.float32, jnp.bfloat16))
def test_dequantize_implementations_agree_here(dtype, rng):
    """The default ("auto"), "auto" and "xla" give the spec's bits on this machine's devices (on
    a GPU "auto" is the kernel: tests/gpu/test_dequantize_gpu.py), also batched by vmap (its
    gradient: below)."""
    q, scales = ref.quantize_fp8(_blocks_of(rng, np.float32), 128)
    want = ref.dequantize_fp8(q, scales, dtype=np.dtype(dtype))
    default = jax.jit(lambda a, b: jm.dequantize_fp8(a, b, dtype))(q, scales)
    assert_bitwise_equal(np.asarray(default), want, "dequantize_fp8 (default)")
    for impl in ("auto", "xla"):
        got = jax.jit(lambda a, b: jm.dequantize_fp8(a, b, dtype, implementation=impl))(q, scales)
        assert_bitwise_equal(np.asarray(got), want, f"dequantize_fp8 ({impl})")
    batched = jax.jit(jax.vmap(lambda a, b: jm.dequantize_fp8(a, b, dtype, implementation="auto")))(
        q[None], scales[None])
    assert_bitwise_equal(np.asarray(batched)[0], want, "dequantize_fp8 under vmap")


def test_dequantize_auto_is_differentiable(rng):
    q, scales = ref.quantize_fp8(rng.standard_normal((4, 256)).astype(np.float32), 128)
    grad = jax.grad(lambda s: jm.dequantize_fp8(jnp.asarray(q), s, implementation="auto").sum())(
        jnp.asarray(scales))
    want = q.astype(np.float32).reshape(4, 2, 128).sum(-1)
    np.testing.assert_allclose(np.asarray(grad), want, rtol=1e-5)


def test_dequantize_rejects_bad_arguments(rng):
    q, scales = ref.quantize_fp8(rng.standard_normal((4, 256)).astype(np.float32), 128)
    with pytest.raises(ValueError, match="implementation must be one of"):
        jm.dequantize_fp8(q, scales, implementation="triton")
    with pytest.raises(ValueError, match="does not tile"):
        jm.dequantize_fp8(q, scales[:, :1].repeat(3, axis=1))
    with pytest.raises(ValueError, match="does not tile"):
        jm.dequantize_fp8(q, scales[:3])
    # implementation="cuda" names why the kernel cannot take the call, at trace time.
    with pytest.raises(ValueError, match="implementation='cuda'.*(float16|CUDA)"):
        jm.dequantize_fp8(q, scales, jnp.float16, implementation="cuda")
    q48, s48 = ref.quantize_fp8(rng.standard_normal((2, 96)).astype(np.float32), 24)
    with pytest.raises(ValueError, match="implementation='cuda'.*(multiples of 16|CUDA)"):
        jm.dequantize_fp8(q48, s48, implementation="cuda")
    assert jm.dequantize_fp8(q[:0], scales[:0], implementation="cuda").shape == (0, 256)
