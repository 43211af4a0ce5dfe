"""Run-time errors: recorded in the communicator's error word, raised by comm.check().

Each test uses its own communicators (purpose="errors"), so a pending error never leaks into
the parity tests. Inputs follow docs/semantics.md "Errors": the first error wins until
check() raises and clears it.
"""

import dataclasses
import time

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_moe as jm
from support import reference as ref
from support.checks import assert_dispatch_matches, check_combine
from support.meshes import make_mesh
from support.moe_runner import AXIS, Setup, make_inputs, runner
from jax_moe.sharding import shard_map
from support.routing_cases import routing

DISPATCH_SEND, DISPATCH_RECV, COMBINE_SEND = 1, 2, 3


def run_with(setup, rng, routing_):
    run = runner(setup)
    inputs = make_inputs(setup, rng, routing_)
    result = inputs.run(run)
    expected = ref.dispatch_reference(setup.geometry, routing_, inputs.rows, inputs.row_scales)
    return run, inputs, result, expected


def expect_error(comm, code, stage, rank, detail):
    with pytest.raises(jm.CommError) as info:
        comm.check()
    err = info.value
    got = (int(err.code), int(err.stage), err.rank, err.detail)
    assert got[0] == code and got[2] == rank and got[3] == detail, f"(code, stage, rank, detail) = {got}"
    assert got[1] in stage, f"stage {got[1]}, expected one of {stage}"
    comm.check()  # raising cleared it


@pytest.mark.parametrize("bad_id", (16, 19, -2, -7))
def test_invalid_expert_id_is_recorded_and_the_slot_unrouted(backend, bad_id, rng):
    setup = Setup(backend, 4, "fp8", purpose="errors")
    good = routing(rng, setup.geometry, "random")
    ids = good.topk_ids.copy()
    ids[2, 5, 1] = bad_id
    run, inputs, result, expected = run_with(setup, rng, dataclasses.replace(good, topk_ids=ids))
    assert ref.invalid_ids(setup.geometry, inputs.routing) == [(2, 5, 1, bad_id)]
    expect_error(run.comm, 1, {DISPATCH_SEND}, rank=2, detail=bad_id)
    # the slot counts as -1: every other row and the combine are unaffected
    assert_dispatch_matches(result.first, expected)
    check_combine(setup, inputs, result, expected)
    # a clean call afterwards records nothing
    run_with(setup, rng, good)
    run.comm.check()


@pytest.mark.parametrize("dispatch, expert_padding", (("bf16", 1), ("fp8", 16)))
def test_capacity_overflow_is_recorded_and_drops_only_rows_past_capacity(
        backend, dispatch, expert_padding, rng):
    # Every token of both ranks picks K=4 distinct experts of rank 1 (experts 8..15):
    # rank 1 needs 2 * 16 * 4 = 128 rows (plus padding), max_recv_tokens gives it 40;
    # rank 0 receives nothing.
    setup = Setup(backend, 2, dispatch, expert_padding, max_recv_tokens=40, purpose="errors")
    g = setup.geometry
    keys = rng.random((2, g.max_tokens, 8))
    ids = (8 + np.argsort(keys, axis=-1)[..., :4]).astype(np.int32)
    overflowing = ref.Routing(ids, rng.uniform(0, 1, (2, g.max_tokens, 4)).astype(np.float32),
                              np.full(2, g.max_tokens, np.int32))
    run, inputs, result, expected = run_with(setup, rng, overflowing)
    needed = expected.ranks[1].rows_needed  # "rows that needed a place": sum(group_sizes)
    assert expected.ranks[1].tokens_per_expert.sum() == 128 and not expected.ranks[0].overflow
    expect_error(run.comm, 2, {DISPATCH_SEND, DISPATCH_RECV}, rank=1, detail=needed)
    # true counts, rows below capacity in place, dropped rows contribute nothing to combine
    assert_dispatch_matches(result.first, expected)
    check_combine(setup, inputs, result, expected, against_dense=False)


@pytest.mark.parametrize("bad_count", (-1, 17, 1000))
def test_bad_num_tokens_is_recorded(backend, bad_count, rng):
    setup = Setup(backend, 4, "bf16", purpose="errors")
    r = routing(rng, setup.geometry, "random")
    num_tokens = r.num_tokens.copy()
    num_tokens[3] = bad_count
    run = runner(setup)
    make_inputs(setup, rng, dataclasses.replace(r, num_tokens=num_tokens)).run(run)
    expect_error(run.comm, 4, {DISPATCH_SEND}, rank=3, detail=bad_count)


def test_the_reported_error_is_the_cause_not_a_wait_on_a_stuck_rank():
    """check()'s rule (jax_moe.errors.first_to_report): lowest rank, but a TIMEOUT that waited
    on a rank with an error of its own gives way to that error."""
    T = int(jm.ErrorCode.TIMEOUT)
    pick = jm.errors.first_to_report
    assert pick([None, None]) is None
    # rank 0 waited on rank 2, which waited on rank 5 (another process, dead): rank 2's
    assert pick([(T, 4, 0, 2), None, (T, 4, 2, 5)]) == (T, 4, 2, 5)
    # rank 0 waited on rank 5 itself: the lowest rank's, as before
    assert pick([(T, 4, 0, 5), (T, 4, 2, 5)]) == (T, 4, 0, 5)
    # other codes are causes: the lowest rank's
    assert pick([(1, 1, 3, 99), (T, 2, 1, 3)]) == (1, 1, 3, 99)
    assert pick([(4, 1, 1, -1), (1, 1, 3, 99)]) == (4, 1, 1, -1)
    # waits on each other and nothing else: the lowest rank's
    assert pick([(T, 2, 1, 0), (T, 2, 0, 1)]) == (T, 2, 0, 1)


def test_pending_error_raises_at_the_next_trace(backend, rng):
    setup = Setup(backend, 2, "bf16", purpose="errors-next-trace")
    r = routing(rng, setup.geometry, "random")
    ids = r.topk_ids.copy()
    ids[1, 0, 0] = 99
    run = runner(setup)
    make_inputs(setup, rng, dataclasses.replace(r, topk_ids=ids)).run(run)

    def per_shard(x, topk_ids, topk_weights):
        return run.comm.dispatch(x, topk_ids, topk_weights).x

    g = setup.geometry
    shapes = (jax.ShapeDtypeStruct((2 * g.max_tokens, g.hidden), jax.numpy.bfloat16),
              jax.ShapeDtypeStruct((2 * g.max_tokens, g.experts_per_token), np.int32),
              jax.ShapeDtypeStruct((2 * g.max_tokens, g.experts_per_token), np.float32))
    with pytest.raises(jm.CommError) as info:
        jax.eval_shape(shard_map(per_shard, run.mesh, in_specs=P(AXIS), out_specs=P(AXIS)), *shapes)
    assert (int(info.value.code), info.value.rank, info.value.detail) == (1, 1, 99)


def _order_case(backend):
    """A two-rank communicator of `backend` and of the xla backend (the reference), bf16."""
    if backend == "xla":
        pytest.skip("the xla backend's halves are pure functions of their inputs: it has no "
                    "call order to keep")
    mesh = make_mesh(min(2, len(jax.devices())))  # one rank suffices: the order is local
    cfg = jm.MoEConfig(num_experts=8, experts_per_token=2, hidden=128, max_tokens=8,
                       dispatch_dtype=jax.numpy.bfloat16, combine_reduce="expert")
    return mesh, jm.Communicator(cfg, mesh, axis=AXIS, backend=backend), jm.Communicator(
        cfg, mesh, axis=AXIS, backend="xla")


def _order_inputs(rng, mesh):
    n = 8 * mesh.devices.size  # max_tokens per rank
    x = jax.numpy.asarray(rng.standard_normal((n, 128)), jax.numpy.bfloat16)
    ids = np.argsort(rng.random((n, 8)), axis=1)[:, :2].astype(np.int32)
    return x, ids, rng.random((n, 2)).astype(np.float32)


def _sharded(mesh, fn):
    return jax.jit(shard_map(fn, mesh, in_specs=P(AXIS), out_specs=P(AXIS)))


@pytest.mark.parametrize("half", ("dispatch", "combine"))
def test_a_second_send_before_the_receive_is_refused_at_once(backend, half, rng, monkeypatch):
    """Halves alternate (docs/semantics.md, CALL_ORDER): the second send records CALL_ORDER
    at once (no wait for the timeout) and does nothing; the first is still received whole."""
    monkeypatch.setenv("JAX_MOE_TIMEOUT_S", "20")
    mesh, comm, reference = _order_case(backend)

    def twice(comm):
        def body(x, ids, w):
            if half == "dispatch":
                first = comm.dispatch_send(x, ids, w)
                comm.dispatch_send(x, ids, w)
                r = comm.dispatch_recv(first)
                return r.weights, jax.numpy.where(r.weights[:, None] != 0, r.x, 0)
            r = comm.dispatch(x, ids, w)
            first = comm.combine_send(r.x, r.handle)
            comm.combine_send(r.x, r.handle)
            return comm.combine_recv(first)
        return body

    def once(comm):
        def body(x, ids, w):
            if half == "dispatch":
                r = comm.dispatch(x, ids, w)
                return r.weights, jax.numpy.where(r.weights[:, None] != 0, r.x, 0)
            r = comm.dispatch(x, ids, w)
            return comm.combine(r.x, r.handle)
        return body

    inputs = _order_inputs(rng, mesh)
    start = time.monotonic()
    got = jax.block_until_ready(_sharded(mesh, twice(comm))(*inputs))
    assert time.monotonic() - start < 10  # refused, not timed out
    stage = DISPATCH_SEND if half == "dispatch" else COMBINE_SEND
    expect_error(comm, int(jm.ErrorCode.CALL_ORDER), {stage}, rank=0, detail=1)
    want = _sharded(mesh, once(reference))(*inputs)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
    # in order again: nothing recorded
    jax.block_until_ready(_sharded(mesh, once(comm))(*inputs))
    comm.check()
    comm.close()
    reference.close()


def test_a_receive_without_a_pending_send_is_refused(backend, rng):
    mesh, comm, reference = _order_case(backend)
    reference.close()
    inputs = _order_inputs(rng, mesh)
    pending = _sharded(mesh, lambda x, ids, w: comm.dispatch_send(x, ids, w))(*inputs)
    receive = jax.jit(shard_map(lambda p: comm.dispatch_recv(p).weights, mesh, in_specs=P(AXIS),
                                out_specs=P(AXIS)))
    first = jax.block_until_ready(receive(pending))
    comm.check()
    again = jax.block_until_ready(receive(pending))
    expect_error(comm, int(jm.ErrorCode.CALL_ORDER), {DISPATCH_RECV}, rank=0, detail=0)
    assert np.asarray(first).any() and again.shape == first.shape  # refused: unspecified
    comm.close()
