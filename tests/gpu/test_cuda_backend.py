"""The cuda backend on GPUs, beyond the shared parity tests (tests/test_parity.py runs it too).

- Against the numpy reference and the xla backend on the same inputs, with the device memory
  the outputs will land in filled with a non-zero pattern first, so a row the kernels forget
  to write shows up.
- A rank that never reaches the exchange makes its peer time out: TIMEOUT is recorded, and
  the communicator refuses further calls instead of waiting again.
Both run on the two paths of the backend: the kernels over NVLink, and every peer forced
remote (JAX_MOE_FORCE_REMOTE=1: each GPU exchanges through its host proxy,
backends/cuda_proxy.py; in one process the proxies share host memory).
benchmarks/gpu_run.sh also runs this file with XLA command buffers off and forced on.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_moe as jm
from support import reference as ref
from jax_moe.backends.cuda_proxy import ProxyRanks
from support.checks import (assert_bitwise_equal, assert_combine_within, assert_dispatch_matches,
                            assert_same_dispatch, check_combine)
from support.meshes import make_mesh
from support.moe_runner import AXIS, Runner, Setup, dequantize_rows, describe, make_inputs, runner
from jax_moe.sharding import shard_map
from support.routing_cases import routing

pytestmark = pytest.mark.gpu

CASES = (
    dict(axis_size=1, dispatch="fp8"),
    dict(axis_size=1, dispatch="bf16", combine_reduce="expert", expert_padding=16),
    dict(axis_size=2, dispatch="fp8", expert_padding=16),
    dict(axis_size=2, dispatch="bf16"),
    dict(axis_size=2, dispatch="fp8-prequantized", combine_reduce="expert"),
    dict(axis_size=2, dispatch="bf16", combine_reduce="expert", partial_dtype="bfloat16",
         split=True),
    dict(axis_size=2, dispatch="fp8", expert_padding=16, split=True),
)
SCENARIOS = ("random", "skewed", "one_expert", "silent_ranks", "unused_slots",
             "partial_tokens", "duplicates")
POISON_BYTE = 0xA5  # non-zero in every dtype the outputs use, and no valid row or count


def poison_device_memory(setup):
    """Fills, then frees, buffers of each output's size on every device of the setup.

    XLA's allocator hands freed blocks to the next allocations of similar size, so the next
    run's outputs start out holding the pattern rather than zeros.
    """
    g = setup.geometry
    C, T, H, K, R = g.capacity, g.max_tokens, g.hidden, g.experts_per_token, g.axis_size
    sizes = (C * H * 2, C * H, C * (H // setup.block_size) * 4, C * 4, T * H * 2, R * T * K * 4)
    junk = [jax.device_put(np.full(n, POISON_BYTE, np.uint8), device)
            for device in jax.devices()[:R] for n in sizes for _ in range(2)]
    jax.block_until_ready(junk)
    del junk


def combine_bound(setup, routing_, y_max, got, want):
    """One bf16 ulp, plus the f32 error of summing K + R terms in another order (cancellation).

    y_max bounds |y| over every row, so |w| summed over a token's slots times y_max bounds the
    magnitude of its terms.
    """
    magnitude = np.abs(routing_.topk_weights).sum(-1, keepdims=True) * np.float32(y_max)
    summands = setup.experts_per_token + setup.axis_size
    bound = ref.bf16_ulp(np.maximum(np.abs(got.astype(np.float32)), np.abs(want.astype(np.float32))))
    if setup.combine_reduce == "expert" and setup.partial_dtype == "bfloat16":
        bound = bound * (1 + setup.axis_size)  # each bf16 partial may round to a neighbour
    return bound + summands * np.float32(2.0**-24) * magnitude


@pytest.fixture(params=("nvlink", "host-proxy"))
def path(request, monkeypatch):
    monkeypatch.setenv("JAX_MOE_FORCE_REMOTE", "1" if request.param == "host-proxy" else "0")
    return request.param


def assert_path(comm, path):
    assert isinstance(comm._backend._ranks, ProxyRanks) == (path == "host-proxy")


@pytest.mark.parametrize("case", CASES, ids=describe)
def test_cuda_on_poisoned_memory_matches_reference_and_xla(case, path, rng):
    """Dispatch bit for bit and combine against the numpy reference (tests/reference.py);
    combine of given rows also against the xla backend on the same GPUs."""
    cuda, xla = Setup("cuda", **case), Setup("xla", **case)
    # runner() caches one program per setup; the proxy path gets its own communicator.
    cuda_run = runner(cuda) if path == "nvlink" else Runner(cuda)
    xla_run = runner(xla)
    assert_path(cuda_run.comm, path)
    for scenario in SCENARIOS:
        inputs = make_inputs(cuda, rng, routing(rng, cuda.geometry, scenario))
        expected = ref.dispatch_reference(cuda.geometry, inputs.routing, inputs.rows,
                                          inputs.row_scales)
        want = inputs.run(xla_run)
        poison_device_memory(cuda)
        got = inputs.run(cuda_run)
        cuda_run.comm.check()
        xla_run.comm.check()
        assert_dispatch_matches(got.first, expected)
        assert_dispatch_matches(got.second, expected)
        check_combine(cuda, inputs, got, expected)
        given_max = np.abs(inputs.y_given.astype(np.float32)).max()
        assert_combine_within(got.out_given, want.out_given,
                              combine_bound(cuda, inputs.routing, given_max, got.out_given,
                                            want.out_given),
                              f"{scenario}: combine(random y) vs xla backend")
    if path == "host-proxy":
        cuda_run.comm.close()


def test_missing_peer_times_out_and_the_communicator_refuses_further_calls(path, monkeypatch):
    mesh = make_mesh(2)
    monkeypatch.setenv("JAX_MOE_TIMEOUT_S", "0.5")
    cfg = jm.MoEConfig(num_experts=4, experts_per_token=2, hidden=128, max_tokens=8,
                       dispatch_dtype=jnp.bfloat16)
    comm = jm.Communicator(cfg, mesh, axis=AXIS, backend="cuda")
    assert_path(comm, path)

    def per_shard(x, topk_ids, topk_weights):
        # Only rank 0 dispatches; it waits for rank 1's flag until the timeout.
        return jax.lax.cond(jax.lax.axis_index(AXIS) == 0,
                            lambda: comm.dispatch(x, topk_ids, topk_weights).weights,
                            lambda: jnp.zeros((comm.capacity,), jnp.float32))

    program = jax.jit(shard_map(per_shard, mesh, in_specs=P(AXIS), out_specs=P(AXIS)))
    x = jnp.ones((16, 128), jnp.bfloat16)
    ids = jnp.tile(jnp.array([[0, 3]], jnp.int32), (16, 1))
    weights = jnp.full((16, 2), 0.5, jnp.float32)
    jax.block_until_ready(program(x, ids, weights))
    with pytest.raises(jm.CommError) as info:
        comm.check()
    err = info.value
    assert (err.code, err.stage, err.rank, err.detail) == (
        jm.ErrorCode.TIMEOUT, jm.Stage.DISPATCH_RECV, 0, 1)
    with pytest.raises(Exception, match="jax_moe CommError"):
        jax.block_until_ready(program(x, ids, weights))
    comm.close()


# Marks each kernel writes, in order: the buffer protocol's (the halves at world 1, every
# launch at R > 1) and the world-1 fused kernels' (no buffer, so no sends, flags or route).
STAGE_ORDER = {
    "halves": {"dispatch": ("send_start", "sent", "recv_start", "counts_seen", "segments",
                            "data_seen", "recv_done"),
               "combine": ("send_start", "sent", "recv_start", "data_seen", "recv_done")},
    "fused": {"dispatch": ("send_start", "counts_seen", "segments", "ranked", "recv_done"),
              "combine": ("send_start", "recv_done")},
}


@pytest.mark.parametrize("op", ("halves", "fused"))
def test_stage_clocks_follow_each_block_through_its_stages(op, monkeypatch, rng):
    """JAX_MOE_STAGE_CLOCKS=1: every block of the kernels reaches every stage of its kernel,
    in order (ffi/protocol/stage_clock.h), and the buffer dispatch's route block publishes."""
    monkeypatch.setenv("JAX_MOE_FORCE_REMOTE", "0")
    monkeypatch.setenv("JAX_MOE_STAGE_CLOCKS", "1")
    mesh = make_mesh(1)
    cfg = jm.MoEConfig(num_experts=16, experts_per_token=4, hidden=256, max_tokens=64,
                       dispatch_dtype=jnp.float8_e4m3fn, combine_reduce="expert")
    comm = jm.Communicator(cfg, mesh, axis=AXIS, backend="cuda")
    x = jnp.asarray(rng.standard_normal((64, 256)), jnp.bfloat16)
    ids = jnp.asarray(np.argsort(rng.random((64, 16)), axis=1)[:, :4], jnp.int32)
    weights = jnp.asarray(rng.random((64, 4)), jnp.float32)

    def step(x, ids, weights):
        if op == "halves":
            r = comm.dispatch_recv(comm.dispatch_send(x, ids, weights))
        else:
            r = comm.dispatch(x, ids, weights)
        y = dequantize_rows(r.x, r.scales, cfg.block_size).astype(jnp.bfloat16)
        if op == "halves":
            return comm.combine_recv(comm.combine_send(y, r.handle))
        return comm.combine(y, r.handle)

    program = jax.jit(shard_map(step, mesh, in_specs=P(AXIS), out_specs=P(AXIS)))
    jax.block_until_ready(program(x, ids, weights))
    comm.check()
    (clocks,) = comm.stage_clocks().values()
    for kernel, marks in STAGE_ORDER[op].items():
        at = np.stack([np.asarray(clocks[kernel][m], np.int64) for m in marks])
        assert (at > 0).all(), f"{kernel}: a block missed a stage"
        assert (np.diff(at, axis=0) >= 0).all(), f"{kernel}: stages out of order"
    routed = (np.asarray(clocks["dispatch"]["routed"]) > 0).sum()
    assert routed == (1 if op == "halves" else 0)  # one route part here; none without a buffer
    comm.close()


@pytest.mark.parametrize("expert_padding", (1, 16))
@pytest.mark.parametrize("fault", ("invalid_id", "capacity"))
def test_world1_fused_dispatch_records_errors_as_the_reference_says(fault, expert_padding, rng):
    """The world-1 fused dispatch (the decode kernel at padding 1, dispatch_local_kernel at 16)
    with an invalid expert id (the slot counts as -1) or more rows than capacity (the rows
    past it dropped, the true counts kept): the outputs the reference gives and the error."""
    setup = Setup("cuda", 1, "fp8", expert_padding, max_tokens=64,
                  max_recv_tokens=40 if fault == "capacity" else None,
                  purpose=f"errors-world1-{fault}-{expert_padding}")
    g = setup.geometry
    r = routing(rng, g, "random")
    ids = r.topk_ids.copy()
    if fault == "invalid_id":
        ids[0, 5, 1] = 19
        r = dataclasses.replace(r, topk_ids=ids)
    inputs = make_inputs(setup, rng, r)
    expected = ref.dispatch_reference(g, inputs.routing, inputs.rows, inputs.row_scales)
    poison_device_memory(setup)
    got = inputs.run(runner(setup))
    assert_dispatch_matches(got.first, expected)
    with pytest.raises(jm.CommError) as info:
        runner(setup).comm.check()
    if fault == "invalid_id":
        assert (int(info.value.code), info.value.detail) == (1, 19)
    else:
        assert expected.ranks[0].overflow
        assert (int(info.value.code), info.value.detail) == (2, expected.ranks[0].rows_needed)


@pytest.mark.parametrize("num_sms,max_tokens", ((1, 300), (5, 64), (300, 64), (64, 128),
                                                (None, 64)))
@pytest.mark.parametrize("expert_padding", (1, 16))
@pytest.mark.parametrize("dispatch,combine_reduce", (("fp8", "expert"), ("bf16", "source"),
                                                     ("fp8-prequantized", "source")))
def test_world1_fused_kernels_equal_the_buffer_halves_for_any_chunking(
        num_sms, max_tokens, expert_padding, dispatch, combine_reduce, rng):
    """At world 1 the fused ops skip the buffer (cuda/dispatch.cu dispatch_local_kernel, and
    dispatch_local_decode_kernel where every block has one chunk of at most 16 slots and the
    padding is 1: here (64, 128) and (None, 64) with padding 1); the halves keep it. Bit for
    bit the same outputs and the reference layout, with one chunk of 1200 slots (past the
    kernel's shared-memory table), a few chunks, and more chunks than SMs (a block takes
    several)."""
    args = dict(axis_size=1, dispatch=dispatch, combine_reduce=combine_reduce,
                expert_padding=expert_padding, max_tokens=max_tokens, num_sms=num_sms)
    fused, split = Setup("cuda", **args), Setup("cuda", split=True, **args)
    for scenario in ("skewed", "partial_tokens", "unused_slots"):
        inputs = make_inputs(fused, rng, routing(rng, fused.geometry, scenario))
        expected = ref.dispatch_reference(fused.geometry, inputs.routing, inputs.rows,
                                          inputs.row_scales)
        poison_device_memory(fused)
        got = inputs.run(runner(fused))
        want = inputs.run(runner(split))
        runner(fused).comm.check()
        runner(split).comm.check()
        assert_dispatch_matches(got.first, expected)
        assert_same_dispatch(got.first, want.first, f"{scenario}: fused against halves")
        assert_bitwise_equal(got.out_given, want.out_given, f"{scenario}: combine(random y)")
        assert_bitwise_equal(got.out_scaled, want.out_scaled, f"{scenario}: combine(expert_fn(y))")
