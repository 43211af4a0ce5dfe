"""Every backend against the numpy reference: dispatched layout and combine.

The combine tolerances are stated in checks.check_combine.
"""

import dataclasses

import numpy as np
import pytest

import jax_moe as jm
from support import reference as ref
from support.checks import (assert_bitwise_equal, assert_dispatch_matches, assert_same_dispatch,
                            check_combine)
from support.meshes import make_mesh
from support.moe_runner import Setup, describe, make_inputs, runner
from support.routing_cases import SCENARIOS, routing

AXIS_SIZES = (1, 2, 4, 8)
DISPATCH_KINDS = ("bf16", "fp8", "fp8-prequantized")


def run_case(setup, rng, scenario):
    """Runs one scenario; returns (inputs, result, expected dispatch). No error may be recorded."""
    run = runner(setup)
    inputs = make_inputs(setup, rng, routing(rng, setup.geometry, scenario))
    result = inputs.run(run)
    expected = ref.dispatch_reference(setup.geometry, inputs.routing, inputs.rows, inputs.row_scales)
    assert not any(r.overflow for r in expected.ranks), "scenario must fit the default capacity"
    run.comm.check()
    return inputs, result, expected


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("expert_padding", (1, 16))
@pytest.mark.parametrize("dispatch", DISPATCH_KINDS)
@pytest.mark.parametrize("axis_size", AXIS_SIZES)
def test_dispatch_layout_and_source_combine(backend, axis_size, dispatch, expert_padding, scenario, rng):
    setup = Setup(backend, axis_size, dispatch, expert_padding)
    inputs, result, expected = run_case(setup, rng, scenario)
    assert_dispatch_matches(result.first, expected)
    check_combine(setup, inputs, result, expected)


@pytest.mark.parametrize("scenario", ("random", "skewed", "partial_tokens", "duplicates"))
@pytest.mark.parametrize("partial_dtype", ("float32", "bfloat16"))
@pytest.mark.parametrize("dispatch", ("bf16", "fp8"))
@pytest.mark.parametrize("axis_size", (1, 2, 8))
def test_expert_reduce_combine(backend, axis_size, dispatch, partial_dtype, scenario, rng):
    setup = Setup(backend, axis_size, dispatch, combine_reduce="expert", partial_dtype=partial_dtype)
    inputs, result, expected = run_case(setup, rng, scenario)
    assert_dispatch_matches(result.first, expected)
    check_combine(setup, inputs, result, expected)


@pytest.mark.parametrize("partial_dtype", ("float32", "bfloat16"))
@pytest.mark.parametrize("axis_size", (1, 2))
def test_expert_reduce_combine_of_rows_narrower_than_a_warp(backend, axis_size, partial_dtype,
                                                            rng):
    """hidden 128: 16 vectors a row, fewer than a warp's lanes (the cuda send once left half a
    warp out of a shuffle and hung here)."""
    setup = Setup(backend, axis_size, "bf16", combine_reduce="expert", partial_dtype=partial_dtype,
                  hidden=128)
    inputs, result, expected = run_case(setup, rng, "random")
    assert_dispatch_matches(result.first, expected)
    check_combine(setup, inputs, result, expected)


@pytest.mark.parametrize("axis_size", (1, 4))
def test_non_finite_tokens_quantize_like_the_spec(backend, axis_size, rng):
    """fp8 dispatch of tokens holding NaN and +-Inf: codes bit for bit, scales NaN/Inf as the
    formula gives (docs/semantics.md), on every backend."""
    setup = Setup(backend, axis_size, "fp8")
    g = setup.geometry
    inputs = make_inputs(setup, rng, routing(rng, g, "random"))
    x = inputs.x.astype(np.float32)
    x[0, 0, 5] = np.nan
    x[0, 1, 130] = np.inf
    x[-1, -1, -1] = -np.inf
    x = x.astype(inputs.x.dtype)
    rows, row_scales = ref.quantize_fp8(x, setup.block_size)
    inputs = dataclasses.replace(inputs, x=x, rows=rows, row_scales=row_scales)
    result = inputs.run(runner(setup))
    expected = ref.dispatch_reference(g, inputs.routing, rows, row_scales)
    assert_dispatch_matches(result.first, expected)
    runner(setup).comm.check()


def test_num_tokens_omitted_sends_every_token(backend, rng):
    setup = Setup(backend, 2, "fp8", pass_num_tokens=False)
    inputs, result, expected = run_case(setup, rng, "random")
    assert_dispatch_matches(result.first, expected)
    check_combine(setup, inputs, result, expected)


@pytest.mark.parametrize("setup_args", (
    dict(axis_size=8, dispatch="fp8", expert_padding=16),
    dict(axis_size=4, dispatch="bf16", combine_reduce="expert", partial_dtype="bfloat16"),
), ids=describe)
def test_repeated_runs_are_bit_identical(backend, setup_args, rng):
    setup = Setup(backend, **setup_args)
    run = runner(setup)
    inputs = make_inputs(setup, rng, routing(rng, setup.geometry, "random"))
    once, again = inputs.run(run), inputs.run(run)
    run.comm.check()
    assert_same_dispatch(again.first, once.first, "second run")
    assert_same_dispatch(once.second, once.first, "second dispatch of one run")
    assert_bitwise_equal(again.out_given, once.out_given, "combine(random y), second run")
    assert_bitwise_equal(again.out_scaled, once.out_scaled, "combine(expert_fn(y)), second run")


@pytest.mark.parametrize("setup_args", (
    # world 1: the cuda backend's fused ops skip the buffer the halves go through
    dict(axis_size=1, dispatch="fp8", expert_padding=16),
    dict(axis_size=1, dispatch="bf16", combine_reduce="expert", partial_dtype="bfloat16"),
    dict(axis_size=1, dispatch="fp8-prequantized", combine_reduce="expert"),
    dict(axis_size=2, dispatch="fp8", expert_padding=16),
    dict(axis_size=4, dispatch="bf16", combine_reduce="expert", partial_dtype="bfloat16"),
    dict(axis_size=8, dispatch="fp8-prequantized", combine_reduce="expert"),
), ids=describe)
def test_split_halves_equal_fused_calls(backend, setup_args, rng):
    fused = Setup(backend, **setup_args)
    split = Setup(backend, split=True, **setup_args)
    inputs = make_inputs(fused, rng, routing(rng, fused.geometry, "skewed"))
    want, got = inputs.run(runner(fused)), inputs.run(runner(split))
    runner(fused).comm.check()
    runner(split).comm.check()
    assert_same_dispatch(got.first, want.first, "dispatch_send/recv")
    assert_bitwise_equal(got.out_given, want.out_given, "combine_send/recv(random y)")
    assert_bitwise_equal(got.out_scaled, want.out_scaled, "combine_send/recv(expert_fn(y))")


@pytest.mark.parametrize("axis_size", AXIS_SIZES)
def test_communicator_reports_geometry(backend, axis_size):
    for padding, max_recv in ((1, None), (16, None), (1, 40)):
        setup = Setup(backend, axis_size, expert_padding=padding, max_recv_tokens=max_recv)
        cfg = setup.config()
        comm = jm.Communicator(cfg, make_mesh(axis_size), axis="ep", backend=backend)
        g = setup.geometry
        assert comm.axis_size == axis_size
        assert comm.num_local_experts == g.local_experts
        assert comm.capacity == g.capacity == cfg.capacity(axis_size)
