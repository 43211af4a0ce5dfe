"""Assertions shared by the parity tests, with messages that point at the first bad element."""

import numpy as np

from support import reference as ref


def _bits(a):
    a = np.ascontiguousarray(a)
    return a.view(np.dtype(f"u{a.dtype.itemsize}"))


def assert_bitwise_equal(actual, expected, what, nan_equal=False):
    """Bit for bit; with nan_equal, any NaN matches any NaN (the spec fixes that a value is NaN,
    not its payload: fp8 scales of a block holding NaN)."""
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape}, expected {expected.shape}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype}, expected {expected.dtype}"
    differ = _bits(actual) != _bits(expected)
    if nan_equal:
        differ &= ~(np.isnan(actual.astype(np.float32)) & np.isnan(expected.astype(np.float32)))
    if differ.any():
        first = tuple(int(i) for i in np.argwhere(differ)[0])
        raise AssertionError(
            f"{what}: {int(differ.sum())} of {differ.size} elements differ; first at {first}: "
            f"got {actual[first]!r}, expected {expected[first]!r}")


def assert_dispatch_matches(fields, expected):
    """fields: DISPATCH_FIELDS -> [R, ...] from a run; expected: reference.DispatchReference.

    Every weight must match (zero past the rows in use); x and scales only in the rows in use,
    [0, min(sum(group_sizes), capacity)): the rows past them are unspecified (docs/semantics.md).
    """
    for rank, want in enumerate(expected.ranks):
        for name in ("group_sizes", "tokens_per_expert"):
            got = fields[name][rank]
            assert got.dtype == np.int32, f"{name} dtype {got.dtype}, expected int32"
            np.testing.assert_array_equal(got, getattr(want, name), err_msg=f"{name} on rank {rank}")
        assert_bitwise_equal(fields["weights"][rank], want.weights, f"weights on rank {rank}")
        used = min(int(want.group_sizes.sum()), want.x.shape[0])
        assert_bitwise_equal(fields["x"][rank][:used], want.x[:used], f"x rows on rank {rank}")
        if want.scales is None:
            assert fields["scales"] is None, "scales must be None for bf16 dispatch"
        else:
            assert_bitwise_equal(fields["scales"][rank][:used], want.scales[:used],
                                 f"scales on rank {rank}", nan_equal=True)


def assert_same_dispatch(actual, expected, what):
    """Two runs' dispatch fields (DISPATCH_FIELDS -> [R, ...]) agree bit for bit wherever the
    contract fixes them: counts, every weight, and x and scales in the rows in use (the rows
    past them are unspecified, so two paths may leave different bytes there)."""
    for rank in range(expected["group_sizes"].shape[0]):
        for name in ("group_sizes", "tokens_per_expert", "weights"):
            assert_bitwise_equal(actual[name][rank], expected[name][rank], f"{what}: {name}")
        used = min(int(expected["group_sizes"][rank].sum()), expected["x"].shape[1])
        for name in ("x", "scales"):
            if expected[name] is None:
                assert actual[name] is None, f"{what}: {name} must be None"
            else:
                assert_bitwise_equal(actual[name][rank][:used], expected[name][rank][:used],
                                     f"{what}: {name} rows on rank {rank}", nan_equal=True)


def assert_combine_within(actual, expected, bound, what):
    """|actual - expected| <= bound elementwise; both bf16 [R, T, H]."""
    assert actual.dtype == ref.BF16, f"{what}: dtype {actual.dtype}, expected bfloat16"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape}, expected {expected.shape}"
    error = np.abs(actual.astype(np.float32) - expected.astype(np.float32))
    bad = ~(error <= bound)  # NaN in actual counts as bad
    if bad.any():
        first = tuple(int(i) for i in np.argwhere(bad)[0])
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.size} elements outside the bound; first at "
            f"(rank, token, h) = {first}: got {actual[first]!r}, expected {expected[first]!r}, "
            f"error {error[first]:.3g} > bound {bound[first]:.3g}")


def combine_bound(actual, expected, summands):
    """The bound held against a reference.CombineReference (see combine_tolerance)."""
    return ref.combine_tolerance(actual, expected.out, expected.term_magnitude, summands,
                                 extra=expected.partial_rounding)


def check_combine(setup, inputs, result, expected, against_dense=True):
    """Both combine outputs of a run (moe_runner) against the reference.

    Tolerances (all outputs are bf16 roundings of f32 sums):
    - Against the spec formula (reference.combine_reference): one bf16 ulp, plus the f32 error
      bound of the sum in another order, (K + R) * 2**-24 * sum|w * y|, which exceeds a bf16
      ulp only under cancellation; with bf16 partials also one bf16 ulp per partial, since a
      partial whose f32 sum differs in its last bit may round to the neighbouring bf16 value.
    - Against the dense MoE result (no layout involved): the same bound for "source" and
      "expert" with f32 partials (docs/semantics.md: within one bf16 ulp); with bf16 partials
      half a bf16 ulp per partial on top, the one extra rounding the spec allows.
    The dense result knows nothing of rows dropped by capacity overflow: runs that overflow
    pass against_dense=False.
    """
    g = setup.geometry
    summands = g.experts_per_token + g.axis_size
    bf16_partials = setup.combine_reduce == "expert" and setup.partial_dtype == "bfloat16"
    partial = ref.BF16 if bf16_partials else np.float32

    given = ref.combine_reference(g, inputs.routing, expected, inputs.y_given,
                                  setup.combine_reduce, partial)
    assert_combine_within(result.out_given, given.out, combine_bound(result.out_given, given, summands),
                          "combine(random y) vs spec formula")
    if not against_dense:
        return

    # y = bf16(dequant(row) * (expert + 1)) against the dense MoE result, which knows no layout.
    rows = (ref.dequantize_fp8(inputs.rows, inputs.row_scales) if inputs.row_scales is not None
            else inputs.rows.astype(np.float32))
    dense, magnitude = ref.dense_moe_reference(g, inputs.routing, rows, ref.scaled_by_expert)
    scaled = ref.combine_reference(g, inputs.routing, expected, _scaled_y(setup, expected),
                                   setup.combine_reduce, partial)
    extra = scaled.partial_rounding / 2  # one rounding of each bf16 partial: half an ulp
    bound = ref.combine_tolerance(result.out_scaled, dense, magnitude, summands, extra=extra)
    assert_combine_within(result.out_scaled, dense, bound, "combine(expert_fn(y)) vs dense MoE")


def _scaled_y(setup, expected):
    """The runner's per-expert function applied to the expected layout, per rank."""
    g = setup.geometry
    ys = []
    for rank, want in enumerate(expected.ranks):
        rows = (ref.dequantize_fp8(want.x, want.scales) if want.scales is not None
                else want.x.astype(np.float32))
        expert = rank * g.local_experts + np.searchsorted(np.cumsum(want.group_sizes),
                                                          np.arange(g.capacity), side="right")
        ys.append((rows * (expert + 1).astype(np.float32)[:, None]).astype(ref.BF16))
    return np.stack(ys)
