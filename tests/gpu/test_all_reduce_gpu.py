"""AllReduce's kernels on one process's GPUs: 1 GPU (R = 1) and 2 GPUs (R = 2).

Every result is checked bit for bit against tests/all_reduce_checks.all_reduce_reference (the
kernels' own summation order) and against jax.lax.psum on the same GPUs within (R - 1) ulps
(all_reduce_checks explains the bound). Sizes run from one element to 64 MiB, odd ones
included, in every dtype, through one-shot, two-shot and auto; repeated calls run in a Python
loop, chained in one jit and in lax.fori_loop (where a stale buffer half would show). A peer
that never arrives makes the waiting rank record TIMEOUT (CommError) instead of hanging.
The two-process case: tests/gpu/test_all_reduce_multiprocess.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_moe as jm
from support.all_reduce_checks import (DTYPES, all_reduce_reference, assert_all_reduce_exact,
                               assert_close_to_psum, random_inputs)
from jax_moe import all_reduce as ar_module
from jax_moe import native
from jax_moe.sharding import shard_map
from support.meshes import make_mesh

pytestmark = pytest.mark.gpu

AXIS = "ep"
MAX_BYTES = 64 << 20
ALGORITHMS = ("one_shot", "two_shot", "auto")
# Elements per rank: tiny, around the 16-byte vector (4 f32, 8 bf16/f16), odd, and past the
# 256-thread x 4-vector block share; 64 MiB runs separately.
ELEMENTS = (1, 2, 3, 7, 8, 9, 31, 33, 1000, 4097, 65_537, 262_147, 1_048_579)
NVLS_SWITCHES = {"NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1",
                 "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


def per_shard_program(mesh, fn):
    """jit(shard_map(fn)) over x_r [R, ...]: rank r gets x_r[r] and returns fn(x_r[r])."""
    return jax.jit(shard_map(lambda x: fn(x[0])[None], mesh, in_specs=P(AXIS),
                             out_specs=P(AXIS)))


@pytest.fixture(scope="module", params=(1, 2), ids=lambda r: f"R{r}")
def world(request):
    """(mesh, {algorithm: AllReduce}, psum program factory) for R GPUs in this process."""
    mesh = make_mesh(request.param)
    reducers = {a: jm.AllReduce(mesh, AXIS, max_bytes=MAX_BYTES, algorithm=a) for a in ALGORITHMS}
    yield mesh, reducers
    for r in reducers.values():
        r.close()


def check_one(mesh, reducers, x_r, what):
    psum = np.asarray(per_shard_program(mesh, lambda x: jax.lax.psum(x, AXIS))(x_r))
    for name, ar in reducers.items():
        assert ar.uses_kernels
        got = np.asarray(per_shard_program(mesh, ar)(x_r))
        ar.check()
        for rank in range(x_r.shape[0]):
            where = f"{what} {name} rank {rank}"
            assert_all_reduce_exact(got[rank], x_r, where)
            assert_close_to_psum(got[rank], psum[rank], x_r, where + " vs psum")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_every_size_matches_reference_and_psum(world, dtype, rng):
    mesh, reducers = world
    R = mesh.devices.size
    for n in ELEMENTS if R > 1 else ELEMENTS[::3]:  # R = 1 is a copy: fewer sizes
        check_one(mesh, reducers, random_inputs(rng, R, (n,), dtype), f"{dtype.name} n={n}")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_64_mib_matches_reference_and_psum(world, dtype, rng):
    mesh, reducers = world
    n = MAX_BYTES // dtype.itemsize
    check_one(mesh, reducers, random_inputs(rng, mesh.devices.size, (n,), dtype),
              f"{dtype.name} 64 MiB")


@pytest.mark.parametrize("shape", [(), (3, 5, 7), (2, 0), (17, 129)])
def test_any_shape(world, shape, rng):
    mesh, reducers = world
    check_one(mesh, reducers, random_inputs(rng, mesh.devices.size, shape, np.dtype(jnp.bfloat16)),
              f"shape {shape}")


def test_above_max_bytes_uses_psum_and_still_sums(rng):
    mesh = make_mesh(2)
    with jm.AllReduce(mesh, AXIS, max_bytes=1024) as ar:
        assert ar.algorithm_for(1024) == "one_shot" and ar.algorithm_for(1025) == "psum"
        x_r = random_inputs(rng, 2, (257,), np.float32)
        got = np.asarray(per_shard_program(mesh, ar)(x_r))
        for rank in range(2):
            assert_close_to_psum(got[rank], all_reduce_reference(x_r), x_r, f"rank {rank}")


def test_repeated_calls_in_a_python_loop(rng):
    """Fresh inputs every call, sizes and algorithms alternating on one buffer pair."""
    mesh = make_mesh(2)
    with jm.AllReduce(mesh, AXIS, max_bytes=4 << 20) as ar:
        one = per_shard_program(mesh, ar)
        for i in range(24):
            n = (5, 70_001, 1_048_573)[i % 3]  # 10 B, 140 KB, 2 MB
            x_r = random_inputs(rng, 2, (n,), np.dtype(jnp.bfloat16))
            got = np.asarray(one(x_r))
            for rank in range(2):
                assert_all_reduce_exact(got[rank], x_r, f"call {i} n={n} rank {rank}")
        ar.check()


def simulate_chain(x_r, steps):
    """numpy twin of chain_step over `steps` steps: y = sum; x_r' = y * 0.5 + (rank + step)."""
    for step in range(steps):
        y = all_reduce_reference(x_r)
        x_r = np.stack([y * np.float32(0.5) + np.float32(r + step) for r in range(len(x_r))])
    return all_reduce_reference(x_r)


def chain_step(ar, x, step):
    """One f32 step whose next input differs per rank and per step (exact in f32)."""
    y = ar(x)
    rank = jax.lax.axis_index(AXIS).astype(jnp.float32)
    return y * np.float32(0.5) + (rank + jnp.asarray(step, jnp.float32))


@pytest.mark.parametrize("algorithm", ["one_shot", "two_shot"])
@pytest.mark.parametrize("n", [4099, 300_001])
def test_chained_calls_in_one_jit_and_in_fori_loop(algorithm, n, rng):
    mesh = make_mesh(2)
    steps = 12
    with jm.AllReduce(mesh, AXIS, max_bytes=4 << 20, algorithm=algorithm) as ar:
        def unrolled(x):
            for step in range(steps):
                x = chain_step(ar, x, step)
            return ar(x)

        def looped(x):
            x = jax.lax.fori_loop(0, steps, lambda step, v: chain_step(ar, v, step), x)
            return ar(x)

        x_r = random_inputs(rng, 2, (n,), np.float32)
        want = simulate_chain(x_r, steps)
        for name, fn in (("unrolled", unrolled), ("fori_loop", looped)):
            got = np.asarray(per_shard_program(mesh, fn)(x_r))
            for rank in range(2):
                np.testing.assert_array_equal(got[rank], want, err_msg=f"{name} rank {rank}")
        ar.check()


def test_mixed_sizes_inside_one_fori_loop(rng):
    """auto alternates one-shot and two-shot on the same buffers inside one loop."""
    mesh = make_mesh(2)
    small_n, large_n = 3001, ar_module.AUTO_ONE_SHOT_MAX_BYTES // 4 + 1001
    with jm.AllReduce(mesh, AXIS, max_bytes=4 * large_n) as ar:
        assert ar.algorithm_for(4 * small_n) == "one_shot"
        assert ar.algorithm_for(4 * large_n) == "two_shot"

        def body(step, carry):
            small, large = carry
            return chain_step(ar, small, step), chain_step(ar, large, step)

        def program(x):
            small, large = x[:small_n], x[small_n:]
            small, large = jax.lax.fori_loop(0, 10, body, (small, large))
            return jnp.concatenate([ar(small), ar(large)])

        x_r = random_inputs(rng, 2, (small_n + large_n,), np.float32)
        got = np.asarray(per_shard_program(mesh, program)(x_r))
        want = np.concatenate([simulate_chain(x_r[:, :small_n], 10),
                               simulate_chain(x_r[:, small_n:], 10)])
        for rank in range(2):
            np.testing.assert_array_equal(got[rank], want, err_msg=f"rank {rank}")


@pytest.mark.parametrize("algorithm, stage", [("one_shot", jm.Stage.ALL_REDUCE_ONE_SHOT),
                                              ("two_shot", jm.Stage.ALL_REDUCE_SCATTER)])
def test_missing_peer_times_out_into_comm_error(algorithm, stage, monkeypatch):
    mesh = make_mesh(2)
    monkeypatch.setenv("JAX_MOE_TIMEOUT_S", "0.5")
    ar = jm.AllReduce(mesh, AXIS, max_bytes=1 << 20, algorithm=algorithm)

    def per_shard(x):
        # Only rank 0 reduces; it waits for rank 1's flags until the timeout.
        return jax.lax.cond(jax.lax.axis_index(AXIS) == 0, lambda: ar(x), lambda: x)

    program = per_shard_program(mesh, per_shard)
    x_r = np.ones((2, 4096), np.float32)
    jax.block_until_ready(program(x_r))
    with pytest.raises(jm.CommError) as info:
        ar.check()
    err = info.value
    assert (err.code, err.stage, err.rank, err.detail) == (jm.ErrorCode.TIMEOUT, stage, 0, 1)
    with pytest.raises(Exception, match="jax_moe CommError"):
        jax.block_until_ready(program(x_r))
    ar.close()


@pytest.mark.parametrize("name", sorted(NVLS_SWITCHES))
def test_nvls_is_refused_for_each_switch_in_python_and_native(name, monkeypatch):
    for other in NVLS_SWITCHES:
        monkeypatch.delenv(other, raising=False)
    monkeypatch.setenv(name, NVLS_SWITCHES[name])
    expected = f"{name}={NVLS_SWITCHES[name]} is set"
    mesh = make_mesh(1)
    ordinal = mesh.devices.flat[0].local_hardware_id
    assert native.load().cuda_nvls_refusal(ordinal) == expected
    assert ar_module.nvls_refusal(mesh.devices.flat) == expected
    with pytest.raises(ValueError, match=f"algorithm 'nvls' refused: {expected}"):
        jm.AllReduce(mesh, AXIS, algorithm="nvls")


def test_nvls_without_switches_asks_the_device_and_auto_never_picks_it(monkeypatch):
    """With every switch unset the gate reads CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED only.
    Where the device refuses, AllReduce(algorithm='nvls') raises before any multicast call;
    where it allows, this test builds nothing (no multicast object on shared machines)."""
    for name in NVLS_SWITCHES:
        monkeypatch.delenv(name, raising=False)
    mesh = make_mesh(1)
    reason = native.load().cuda_nvls_refusal(mesh.devices.flat[0].local_hardware_id)
    print(f"native NVLS gate without switches: {reason!r}")  # "" where multicast is allowed
    if reason:
        with pytest.raises(ValueError, match=f"algorithm 'nvls' refused: {reason}"):
            jm.AllReduce(mesh, AXIS, algorithm="nvls")
    with jm.AllReduce(mesh, AXIS) as ar:
        assert {ar.algorithm_for(n) for n in (16, 1 << 16, 1 << 20, 8 << 20)} <= {"one_shot",
                                                                                   "two_shot"}
