"""Assertions shared by the parity tests, with messages that point at the first bad element."""

import numpy as np

from reference import BF16, combine_tolerance


def _bits(a):
    a = np.ascontiguousarray(a)
    return a.view(np.dtype(f"u{a.dtype.itemsize}"))


def assert_bitwise_equal(actual, expected, what):
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape}, expected {expected.shape}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype}, expected {expected.dtype}"
    differ = _bits(actual) != _bits(expected)
    if differ.any():
        first = tuple(int(i) for i in np.argwhere(differ)[0])
        raise AssertionError(
            f"{what}: {int(differ.sum())} of {differ.size} elements differ; first at {first}: "
            f"got {actual[first]!r}, expected {expected[first]!r}")


def assert_dispatch_matches(fields, expected):
    """fields: DISPATCH_FIELDS -> [R, ...] from a run; expected: reference.DispatchReference."""
    for rank, want in enumerate(expected.ranks):
        for name in ("group_sizes", "tokens_per_expert"):
            got = fields[name][rank]
            assert got.dtype == np.int32, f"{name} dtype {got.dtype}, expected int32"
            np.testing.assert_array_equal(got, getattr(want, name), err_msg=f"{name} on rank {rank}")
        assert_bitwise_equal(fields["weights"][rank], want.weights, f"weights on rank {rank}")
        assert_bitwise_equal(fields["x"][rank], want.x, f"x rows on rank {rank}")
        if want.scales is None:
            assert fields["scales"] is None, "scales must be None for bf16 dispatch"
        else:
            assert_bitwise_equal(fields["scales"][rank], want.scales, f"scales on rank {rank}")


def assert_combine_within(actual, expected, bound, what):
    """|actual - expected| <= bound elementwise; both bf16 [R, T, H]."""
    assert actual.dtype == BF16, f"{what}: dtype {actual.dtype}, expected bfloat16"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape}, expected {expected.shape}"
    error = np.abs(actual.astype(np.float32) - expected.astype(np.float32))
    bad = ~(error <= bound)  # NaN in actual counts as bad
    if bad.any():
        first = tuple(int(i) for i in np.argwhere(bad)[0])
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.size} elements outside the bound; first at "
            f"(rank, token, h) = {first}: got {actual[first]!r}, expected {expected[first]!r}, "
            f"error {error[first]:.3g} > bound {bound[first]:.3g}")


def combine_bound(actual, reference, summands):
    """The bound held against a reference.CombineReference (see combine_tolerance)."""
    return combine_tolerance(actual, reference.out, reference.term_magnitude, summands,
                             extra=reference.partial_rounding)
