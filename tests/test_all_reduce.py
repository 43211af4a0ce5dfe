"""AllReduce where it falls back to psum (CPU, or no native CUDA), argument checks and the NVLS
gate's pure-Python part. The GPU kernels: tests/gpu/test_all_reduce_gpu.py and
tests/gpu/test_all_reduce_multiprocess.py."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_moe as jm
from support.all_reduce_checks import (DTYPES, all_reduce_reference, assert_close_to_psum,
                               one_ulp, random_inputs)
from jax_moe import all_reduce as ar_module
from jax_moe import native
from jax_moe.sharding import shard_map
from support.meshes import make_mesh

NVLS_SWITCHES = {"NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1",
                 "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


def cpu_mesh(shape, names):
    devices = jax.devices("cpu")
    size = int(np.prod(shape))
    if len(devices) < size:
        pytest.skip(f"needs {size} CPU devices")
    return Mesh(np.array(devices[:size]).reshape(shape), names)


def run_all_reduce(ar, mesh, x_r):
    """ar over mesh axis 'ep' of x_r [R, ...] (rank r holds x_r[r]) -> [R, ...]."""
    program = jax.jit(shard_map(lambda x: ar(x[0])[None], mesh, in_specs=P("ep"),
                                out_specs=P("ep")))
    return np.asarray(program(x_r))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("shape", [(), (1,), (7,), (3, 5, 7), (4097,), (2, 0)])
def test_cpu_fallback_equals_the_rank_order_sum(dtype, shape, rng):
    mesh = cpu_mesh((4,), ("ep",))
    ar = jm.AllReduce(mesh, "ep")
    assert not ar.uses_kernels
    x_r = random_inputs(rng, 4, shape, dtype)
    got = run_all_reduce(ar, mesh, x_r)
    for rank in range(4):
        assert_close_to_psum(got[rank], all_reduce_reference(x_r), x_r, f"rank {rank}")


def test_cpu_fallback_on_one_axis_of_a_two_axis_mesh(rng):
    mesh = cpu_mesh((2, 4), ("dp", "tp"))
    ar = jm.AllReduce(mesh, "tp")
    x = random_inputs(rng, 8, (16,), np.float32).reshape(2, 4, 16)
    program = jax.jit(shard_map(lambda v: ar(v), mesh, in_specs=P("dp", "tp"),
                                out_specs=P("dp", "tp")))
    got = np.asarray(program(x))
    for d in range(2):
        want = all_reduce_reference(x[d])
        for t in range(4):
            assert_close_to_psum(got[d, t], want, x[d], f"dp {d} tp {t}")


def test_every_algorithm_name_is_psum_on_cpu():
    mesh = cpu_mesh((2,), ("ep",))
    for algorithm in ("auto", "psum"):
        ar = jm.AllReduce(mesh, "ep", max_bytes=1024, algorithm=algorithm)
        assert [ar.algorithm_for(n) for n in (0, 4, 1024, 1025)] == ["psum"] * 4
        ar.check()
        ar.close()


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(axis="tp"), ValueError, "axis must name a mesh axis"),
    (dict(axis=0), ValueError, "axis must name a mesh axis"),
    (dict(max_bytes=0), ValueError, "max_bytes must be an int"),
    (dict(max_bytes=-5), ValueError, "max_bytes must be an int"),
    (dict(max_bytes=1.5), ValueError, "max_bytes must be an int"),
    (dict(max_bytes=True), ValueError, "max_bytes must be an int"),
    (dict(max_bytes=(1 << 30) + 1), ValueError, "max_bytes must be an int"),
    (dict(algorithm="ring"), ValueError, "algorithm must be one of"),
    (dict(algorithm="one_shot"), ValueError, "needs GPUs"),
    (dict(algorithm="two_shot"), ValueError, "needs GPUs"),
    (dict(algorithm="nvls"), ValueError, "needs GPUs"),
])
def test_bad_arguments_are_refused_with_the_argument_named(kwargs, error, match):
    mesh = cpu_mesh((2,), ("ep",))
    kwargs = {"axis": "ep", **kwargs}
    with pytest.raises(error, match=match):
        jm.AllReduce(mesh, **kwargs)


def test_mesh_must_be_a_mesh():
    with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh"):
        jm.AllReduce(jax.devices("cpu"), "ep")


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.int8, jnp.float8_e4m3fn, jnp.bool_])
def test_bad_dtype_is_refused_at_trace_time(dtype):
    mesh = cpu_mesh((2,), ("ep",))
    ar = jm.AllReduce(mesh, "ep")
    program = jax.jit(shard_map(lambda x: ar(x), mesh, in_specs=P("ep"), out_specs=P("ep")))
    with pytest.raises(TypeError, match="x must have dtype float32, bfloat16 or float16"):
        program.lower(jax.ShapeDtypeStruct((4,), dtype))


def test_call_outside_shard_map_or_over_another_axis_is_refused():
    mesh = cpu_mesh((2, 2), ("ep", "tp"))
    ar = jm.AllReduce(mesh, "ep")
    with pytest.raises(ValueError, match="inside jax.shard_map over axis 'ep'.*not bound here"):
        ar(jnp.ones(4))
    other = jm.AllReduce(cpu_mesh((4,), ("ep",)), "ep")  # axis "ep" of size 4, bound here as 2
    program = jax.jit(shard_map(lambda x: other(x), mesh, in_specs=P("ep"), out_specs=P("ep")))
    with pytest.raises(ValueError, match="of size 4.*of size 2"):
        program.lower(jax.ShapeDtypeStruct((4,), jnp.float32))


def test_non_array_is_refused():
    ar = jm.AllReduce(cpu_mesh((2,), ("ep",)), "ep")
    with pytest.raises(TypeError, match="x must be an array"):
        ar([1.0, 2.0])


@pytest.mark.parametrize("name", sorted(NVLS_SWITCHES))
def test_nvls_gate_refuses_for_each_switch_before_looking_at_devices(name):
    environ = {name: NVLS_SWITCHES[name]}
    # No devices at all: the switch alone must decide, before any device or native query.
    assert ar_module.nvls_refusal([], environ) == f"{name}={NVLS_SWITCHES[name]} is set"


def test_nvls_gate_reads_the_process_environment(monkeypatch):
    for name in NVLS_SWITCHES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NVSHMEM_DISABLE_NVLS", "1")
    assert ar_module.nvls_refusal([]) == "NVSHMEM_DISABLE_NVLS=1 is set"


def test_nvls_gate_ignores_switches_set_to_allow():
    environ = {"NCCL_NVLS_ENABLE": "1", "NVSHMEM_DISABLE_NVLS": "0",
               "TORCH_SYMM_MEM_DISABLE_MULTICAST": "0"}
    assert ar_module.nvls_refusal([], environ) == "no devices given"
    reason = ar_module.nvls_refusal(jax.devices("cpu")[:2], environ)
    assert reason == "platform 'cpu' has no NVLink multicast"


def test_one_ulp_is_the_spacing_of_each_dtype():
    assert one_ulp(1.0, np.dtype(jnp.bfloat16)) == 2.0**-7
    assert one_ulp(1.5, np.dtype(jnp.float16)) == 2.0**-10
    assert one_ulp(-3.0, np.dtype(np.float32)) == 2.0**-22
    assert one_ulp(0.0, np.dtype(jnp.bfloat16)) == 2.0**-133


def test_reference_sums_in_rank_order_in_f32_and_rounds_once():
    # bf16: 1 + 2**-8 + 2**-8 rounds to 1 + 2**-7 only when summed in f32 before rounding.
    x_r = np.array([[1.0], [2.0**-8], [2.0**-8]], np.float32).astype(jnp.bfloat16)
    assert float(all_reduce_reference(x_r)[0]) == 1.0 + 2.0**-7
    with pytest.raises(AssertionError, match="more than 2 ulp"):
        assert_close_to_psum(np.array([1.0 + 2.0**-5], jnp.bfloat16), np.array([1.0], jnp.bfloat16),
                             x_r, "x")


def test_make_mesh_helper_mesh_works_with_all_reduce(rng):
    mesh = make_mesh(2)
    ar = jm.AllReduce(mesh, "ep")
    x_r = random_inputs(rng, 2, (5,), np.float32)
    got = run_all_reduce(ar, mesh, x_r)
    assert_close_to_psum(got[1], all_reduce_reference(x_r), x_r, "rank 1")


needs_native_cuda = pytest.mark.skipif(not native.has_cuda(),
                                       reason="jax_moe._native built without CUDA")


@needs_native_cuda
@pytest.mark.parametrize("name", sorted(NVLS_SWITCHES))
def test_native_gate_and_setup_refuse_for_each_switch_without_a_device(name, monkeypatch):
    """The C++ gate reads the switches before any CUDA call, so it answers here without a GPU,
    and cuda_setup_nvls raises before its first driver call (no such rank state exists)."""
    for other in NVLS_SWITCHES:
        monkeypatch.delenv(other, raising=False)
    monkeypatch.setenv(name, NVLS_SWITCHES[name])
    expected = f"{name}={NVLS_SWITCHES[name]} is set"
    module = native.load()
    assert module.cuda_nvls_refusal(0) == expected
    with pytest.raises(ValueError, match=f"refused: {expected}"):
        module.cuda_setup_nvls(123456, [0])
    module.cuda_teardown_nvls(123456)  # nothing was built: a no-op


def test_bench_all_reduce_runs_on_cpu_and_writes_its_table(tmp_path):
    """benchmarks/bench_all_reduce.py end to end on 2 host devices (psum only there); no
    timing is asserted."""
    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=2")
    args = ["--sizes", "4KiB,16KiB", "--iters", "3", "--short-iters", "1", "--reps", "1",
            "--out", str(tmp_path)]
    done = subprocess.run([sys.executable, str(repo / "benchmarks" / "bench_all_reduce.py"),
                           *args], cwd=repo, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    payload = json.loads((tmp_path / "all_reduce_cpu-x2_bfloat16.json").read_text())
    assert {(r["size_bytes"], r["method"], r["mode"]) for r in payload["results"]} == {
        (size, method, mode) for size in (4096, 16384) for method in ("auto", "psum")
        for mode in ("loop", "chain")}
    assert all(r["status"] == "ok" and r["max_abs_diff_vs_psum"] == 0.0
               for r in payload["results"])
    assert [row["size_bytes"] for row in payload["crossovers"]["chain"]["table"]] == [4096, 16384]
    assert (tmp_path / "all_reduce_cpu-x2_bfloat16.png").exists()
