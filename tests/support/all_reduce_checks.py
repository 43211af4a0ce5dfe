"""Reference and checks of the all-reduce tests (tests/test_all_reduce.py, tests/gpu/).

The kernels sum an element's R values in rank order in f32, starting from rank 0's value, and
round once to the element type: `all_reduce_reference` does the same in numpy, so the kernels
must match it bit for bit. XLA's psum (NCCL on GPUs, XLA:CPU's own loop) may sum in another
order and, for bf16 and f16, round to the element type after every partial sum: up to R - 1
roundings of half an ulp of a partial sum, each bounded by sum_r |x_r|. Against psum the tests
allow R - 1 ulps of the element type at sum_r |x_r| (`assert_close_to_psum`): one ulp at R = 2,
where both are the exact sum rounded once up to the tie direction.
"""

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from support.checks import assert_bitwise_equal

DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16))


def random_inputs(rng, ranks, shape, dtype):
    """[ranks, *shape] standard normal values rounded to dtype (fresh per call)."""
    return rng.standard_normal((ranks, *shape), dtype=np.float32).astype(dtype)


def all_reduce_reference(x_r):
    """sum over axis 0 of x_r [R, ...] in rank order, in f32 from rank 0's value, rounded once."""
    acc = x_r[0].astype(np.float32)
    for r in range(1, x_r.shape[0]):
        acc = acc + x_r[r].astype(np.float32)
    return acc.astype(x_r.dtype)


def one_ulp(values, dtype):
    """The spacing of `dtype` numbers at |values| (the subnormal spacing below the normals)."""
    info = ml_dtypes.finfo(dtype)
    v = np.abs(np.asarray(values, np.float32)).astype(np.float64)
    tiny = float(info.smallest_normal)
    _, exponent = np.frexp(np.maximum(v, tiny))  # v = m * 2**exponent, m in [0.5, 1)
    return np.ldexp(1.0, exponent - 1 - info.nmant)


def assert_all_reduce_exact(actual, x_r, what):
    assert_bitwise_equal(np.asarray(actual), all_reduce_reference(x_r), what)


def assert_close_to_psum(actual, expected, x_r, what):
    """|actual - expected| <= (R - 1) ulps at sum_r |x_r| (at least one ulp of either value)."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape}, expected {expected.shape}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype}, expected {expected.dtype}"
    a, e = actual.astype(np.float64), expected.astype(np.float64)
    magnitude = np.maximum(np.abs(x_r.astype(np.float64)).sum(0), np.maximum(np.abs(a), np.abs(e)))
    bound = max(x_r.shape[0] - 1, 1) * one_ulp(magnitude, actual.dtype)
    bad = ~(np.abs(a - e) <= bound)
    if bad.any():
        first = tuple(int(i) for i in np.argwhere(bad)[0])
        raise AssertionError(f"{what}: {int(bad.sum())} of {bad.size} elements differ by more "
                             f"than {x_r.shape[0] - 1} ulp; first at {first}: got "
                             f"{actual[first]!r}, expected {expected[first]!r}")
