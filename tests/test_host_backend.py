"""What only the host backend has: its own timeouts, program order on XLA:CPU, teardown.

Parity, layout and recorded errors of the host backend run in the shared suites
(test_parity.py, test_runtime_errors.py, test_validation.py) through the `backend` fixture.
"""

import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_moe as jm
from jax_moe.errors import ErrorCode, Stage
from jax_moe.sharding import shard_map
from support.meshes import make_mesh

pytestmark = pytest.mark.skipif("host" not in jm.available_backends("cpu"),
                                reason="jax_moe._native is not built (no host backend)")

AXIS = "ep"
R, T, K, E, H = 4, 8, 2, 8, 128


def make_comm(monkeypatch, timeout_s="10"):
    monkeypatch.setenv("JAX_MOE_TIMEOUT_S", timeout_s)  # read when the Communicator is built
    cfg = jm.MoEConfig(num_experts=E, experts_per_token=K, hidden=H, max_tokens=T,
                       dispatch_dtype=jnp.bfloat16)
    return jm.Communicator(cfg, make_mesh(R), axis=AXIS, backend="host")


def inputs(rng):
    x = jnp.asarray(rng.standard_normal((R * T, H)), jnp.bfloat16)
    ids = jnp.asarray(rng.integers(0, E, (R * T, K)), jnp.int32)
    weights = jnp.asarray(rng.random((R * T, K)), jnp.float32)
    return x, ids, weights


def sharded(comm, body):
    return jax.jit(shard_map(body, comm.mesh, in_specs=P(AXIS), out_specs=P(AXIS)))


def test_a_rank_that_never_comes_times_out_naming_it(monkeypatch, rng):
    # Only rank 0 dispatches: its receive waits for the other ranks' routes, which never come.
    comm = make_comm(monkeypatch, timeout_s="0.5")

    def body(x, ids, weights):
        return jax.lax.cond(jax.lax.axis_index(AXIS) == 0,
                            lambda: comm.dispatch(x, ids, weights).weights,
                            lambda: jnp.zeros((comm.capacity,), jnp.float32))

    start = time.monotonic()
    jax.block_until_ready(sharded(comm, body)(*inputs(rng)))
    assert time.monotonic() - start < 0.5 + 5
    with pytest.raises(jm.CommError) as info:
        comm.check()
    assert info.value.code == ErrorCode.TIMEOUT and info.value.stage == Stage.DISPATCH_RECV
    assert 0 < info.value.detail < R  # a peer waited for
    # The ranks' sequences now disagree: rank 0's later calls give up at once, return zeros
    # and record TIMEOUT again (they do not fail the program: see ffi/host/state.h).
    program = sharded(comm, lambda x, ids, weights: comm.dispatch(x, ids, weights).x)
    start = time.monotonic()
    out = jax.block_until_ready(program(*inputs(rng)))
    assert time.monotonic() - start < 5
    assert not np.asarray(out, np.float32)[:comm.capacity].any()  # rank 0's rows
    with pytest.raises(jm.CommError) as info:
        comm.check()
    assert info.value.code == ErrorCode.TIMEOUT and info.value.rank == 0
    comm.close()


def test_independent_calls_run_in_program_order(monkeypatch, rng):
    # Nothing but program order links the second exchange to the first (no data dependency):
    # XLA:CPU would start them in any order; the ordered effect keeps them in sequence.
    comm = make_comm(monkeypatch)
    x, ids, weights = inputs(rng)

    def body(x, ids, weights):
        a = comm.dispatch_recv(comm.dispatch_send(x, ids, weights))
        b = comm.dispatch_recv(comm.dispatch_send(-x, ids, weights))
        return a.x, b.x

    a, b = sharded(comm, body)(x, ids, weights)
    comm.check()
    np.testing.assert_array_equal(np.asarray(b, np.float32), -np.asarray(a, np.float32))
    assert np.abs(np.asarray(a, np.float32)).sum() > 0
    comm.close()


CLOSED_SCRIPT = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, PartitionSpec as P
import jax_moe as jm
from jax_moe.sharding import shard_map
mesh = Mesh(np.array(jax.devices()[:2]), ("ep",))
cfg = jm.MoEConfig(num_experts=4, experts_per_token=2, hidden=128, max_tokens=4,
                   dispatch_dtype=jnp.bfloat16)
comm = jm.Communicator(cfg, mesh, axis="ep", backend="host")
program = jax.jit(shard_map(lambda x, i, w: comm.dispatch(x, i, w).x, mesh,
                            in_specs=P("ep"), out_specs=P("ep")))
args = (jnp.ones((8, 128), jnp.bfloat16), jnp.zeros((8, 2), jnp.int32), jnp.ones((8, 2)))
jax.block_until_ready(program(*args))
comm.close()
try:
    jax.block_until_ready(program(*args))
except Exception as e:
    print("raised:", e)
"""


def test_a_closed_communicator_is_a_clear_error():
    # In its own process: a failed ordered call fails every later host program of the
    # process (JAX's runtime token carries the error).
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    done = subprocess.run([sys.executable, "-c", CLOSED_SCRIPT], capture_output=True, text=True,
                          timeout=120, env=env)
    assert "raised:" in done.stdout, done.stdout + done.stderr
    assert "no connected host communicator state" in done.stdout, done.stdout


@pytest.mark.parametrize("setup_args", [
    dict(dispatch="bf16", combine_reduce="source"),
    dict(dispatch="fp8", combine_reduce="expert", partial_dtype="bfloat16"),
    dict(dispatch="bf16", combine_reduce="expert", expert_padding=16),
], ids=lambda a: ",".join(f"{k}={v}" for k, v in a.items()))
def test_row_loops_on_several_threads_give_the_same_bits(monkeypatch, rng, setup_args):
    """JAX_MOE_HOST_THREADS splits each rank's row loops (ffi/host/parallel.h): same bits as
    one thread, sizes large enough that every loop is split."""
    from support.moe_runner import Runner, Setup, make_inputs
    from support.routing_cases import routing

    setup = Setup("host", 2, num_experts=8, experts_per_token=4, max_tokens=192, **setup_args)
    runs = {}
    for threads in ("1", "3"):
        monkeypatch.setenv("JAX_MOE_HOST_THREADS", threads)  # read when the Communicator is built
        runs[threads] = Runner(setup)
    for scenario in ("random", "skewed", "partial_tokens", "unused_slots"):
        case = make_inputs(setup, rng, routing(rng, setup.geometry, scenario))
        one, three = case.run(runs["1"]), case.run(runs["3"])
        for name in ("first", "second"):
            a, b = getattr(one, name), getattr(three, name)
            for field in a:
                if a[field] is not None:
                    np.testing.assert_array_equal(np.asarray(a[field]), np.asarray(b[field]),
                                                  err_msg=f"{scenario}: {name}.{field}")
        for name in ("out_given", "out_scaled"):
            np.testing.assert_array_equal(np.asarray(getattr(one, name)),
                                          np.asarray(getattr(three, name)),
                                          err_msg=f"{scenario}: {name}")
    for run in runs.values():
        run.comm.check()
        run.comm.close()


@pytest.mark.parametrize("bad", ["0", "65", "two", ""])
def test_thread_counts_outside_1_to_64_are_refused(monkeypatch, bad):
    monkeypatch.setenv("JAX_MOE_HOST_THREADS", bad)
    with pytest.raises(ValueError, match=r"JAX_MOE_HOST_THREADS must be a number of threads in \[1, 64\]"):
        make_comm(monkeypatch)
