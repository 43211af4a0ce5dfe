"""jm.dequantize_fp8's CUDA kernel (jax_moe_dequantize_fp8) against the numpy spec and the
pure-JAX implementation on the same GPU, bit for bit (any NaN matches any NaN).

Codes are random bytes, so every e4m3fn value appears, its two NaN codes and -0 included;
scales are random f32 of either sign over 80 binades (products stay normal f32). Each
checked call runs after a call of the same shape whose result is all NaN, so an element the
kernel skipped would show that call's NaN in a reused buffer.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_moe as jm
from jax_moe.sharding import shard_map
from support import reference as ref
from support.checks import assert_bitwise_equal
from support.meshes import make_mesh

pytestmark = pytest.mark.gpu

# (shape of q, block size, output dtype): the decode rows of the benchmark, odd leading dims,
# the smallest vector, a row count that leaves the last thread block part full.
CASES = (((1024, 7168), 128, jnp.bfloat16), ((3, 5, 256), 16, jnp.float32),
         ((37, 512), 128, jnp.bfloat16), ((1, 16), 16, jnp.bfloat16),
         ((129, 7168), 128, jnp.float32), ((2, 3, 4096), 64, jnp.bfloat16))


def _inputs(rng, shape, block):
    codes = rng.integers(0, 256, shape, dtype=np.uint8)
    codes.reshape(-1)[:2] = (0x7F, 0xFF)  # both NaN codes, whatever the size
    codes = codes.view(ml_dtypes.float8_e4m3fn)
    scale_shape = (*shape[:-1], shape[-1] // block)
    scales = (rng.uniform(0.5, 1.0, scale_shape) * rng.choice((-1.0, 1.0), scale_shape)
              * 2.0 ** rng.integers(-60, 20, scale_shape)).astype(np.float32)
    return codes, scales


def _run(fn, q, scales):
    """fn(q, scales) after fn on all-NaN codes of the same shape (a reused buffer's poison)."""
    poison = jnp.full(q.shape, np.uint8(0x7F)).view(jnp.float8_e4m3fn)
    assert np.isnan(np.asarray(fn(poison, jnp.asarray(scales)), np.float32)).all()
    return np.asarray(fn(jnp.asarray(q), jnp.asarray(scales)))


@pytest.mark.parametrize("shape,block,dtype", CASES,
                         ids=lambda c: "x".join(map(str, c)) if isinstance(c, tuple) else str(c))
def test_kernel_matches_spec_and_xla_bitwise(shape, block, dtype, rng):
    q, scales = _inputs(rng, shape, block)
    kernel = jax.jit(lambda a, b: jm.dequantize_fp8(a, b, dtype, implementation="cuda"))
    pure = jax.jit(lambda a, b: jm.dequantize_fp8(a, b, dtype, implementation="xla"))
    got = _run(kernel, q, scales)
    assert_bitwise_equal(got, ref.dequantize_fp8(q, scales, np.dtype(dtype)), "cuda vs spec",
                         nan_equal=True)
    assert_bitwise_equal(got, np.asarray(pure(q, scales)), "cuda vs xla", nan_equal=True)
    assert np.isnan(got.astype(np.float32)).any()  # the NaN codes came through as NaN


def test_auto_takes_the_kernel_on_gpu_and_not_otherwise(rng):
    q, scales = _inputs(rng, (8, 256), 128)
    text = lambda impl, dtype: jax.jit(lambda a, b: jm.dequantize_fp8(
        a, b, dtype, implementation=impl)).lower(q, scales).as_text()
    default = jax.jit(lambda a, b: jm.dequantize_fp8(a, b, jnp.bfloat16)).lower(q, scales)
    assert "jax_moe_dequantize_fp8" in default.as_text()  # "auto" is the default
    assert "jax_moe_dequantize_fp8" in text("auto", jnp.bfloat16)
    assert "jax_moe_dequantize_fp8" not in text("xla", jnp.bfloat16)
    assert "jax_moe_dequantize_fp8" not in text("auto", jnp.float16)  # not a kernel dtype


def test_kernel_under_shard_map_vmap_and_grad(rng):
    """As the models call it (inside shard_map), batched by vmap, and differentiated (the
    derivative is the reference's)."""
    q, scales = _inputs(rng, (4, 16, 256), 128)
    want = ref.dequantize_fp8(q, scales, ml_dtypes.bfloat16)
    mesh = make_mesh(1)
    auto = lambda a, b: jm.dequantize_fp8(a, b, jnp.bfloat16, implementation="auto")
    per_shard = jax.jit(shard_map(auto, mesh,
                                  in_specs=(P("ep"), P("ep")), out_specs=P("ep")))
    assert_bitwise_equal(np.asarray(per_shard(q, scales)), want, "shard_map", nan_equal=True)
    batched = jax.jit(jax.vmap(auto))
    assert_bitwise_equal(np.asarray(batched(q, scales)), want, "vmap", nan_equal=True)
    finite = jnp.asarray(np.where(np.isnan(q.astype(np.float32)), 0, q.astype(np.float32))
                         .astype(ml_dtypes.float8_e4m3fn))
    grad = jax.grad(lambda s: jm.dequantize_fp8(finite, s, jnp.float32,
                                                implementation="auto").sum())(scales)
    want_grad = np.asarray(finite, np.float32).reshape(4, 16, 2, 128).sum(-1)
    np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-5)
