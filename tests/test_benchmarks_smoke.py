"""benchmarks/: the dispatch/combine script end to end on CPU, and its peers and checks.

The script runs in a subprocess on 8 host devices with tiny sizes; no timing is asserted.
The peers and the reference checks are also exercised in-process on host devices, with
unrouted slots, which the script's random routing never produces.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

REPO = Path(__file__).resolve().parents[1]

from benchmarks import methods, peers, reference  # noqa: E402
from jax_moe.sharding import shard_map  # noqa: E402
from benchmarks.problem import Shape, make_inputs, traffic  # noqa: E402

SCRIPT = REPO / "benchmarks" / "bench_dispatch_combine.py"


def test_bench_dispatch_combine_runs_every_method_and_all_pass(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=8")
    args = ["--hidden", "256", "--experts", "16", "--topk", "4", "--phases", "tiny=8",
            "--dispatch-dtypes", "fp8", "--iters", "2", "--short-iters", "1", "--reps", "1",
            "--out", str(tmp_path)]
    done = subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    payload = json.loads((tmp_path / "dispatch_combine_cpu-x8_tiny.json").read_text())
    assert (tmp_path / "dispatch_combine_cpu-x8_tiny.png").stat().st_size > 0
    assert payload["environment"]["device_count"] == 8
    backends = payload["config"]["backends"]
    assert "xla" in backends
    expected_ok = {"all_gather fp8", "all_to_all fp8", "replicated_psum_scatter fp8",
                   "psum [T,H] bf16", "fanout [T*K,H] fp8", "weighted_sum [T,K,H] bf16"}
    for backend in backends:
        expected_ok |= {f"{backend} dispatch fp8"}
        for reduce in ("source", "expert"):
            expected_ok |= {f"{backend} {op} fp8 {reduce}" for op in ("fused", "combine", "split")}
    expected_skipped = {"ragged_all_to_all fp8", "p2p ppermute 256MiB", "p2p ppermute 1MiB"}

    by_label = {r["label"]: r for r in payload["results"]}
    assert set(by_label) == expected_ok | expected_skipped
    for label in expected_ok:
        record = by_label[label]
        assert record["status"] == "ok", record
        assert record["correctness"]["passed"] and record["correctness_after_timing"]["passed"]
        assert record["time"]["n_long"] > record["time"]["n_short"]
    for label in expected_skipped:
        assert by_label[label]["status"] == "skipped" and by_label[label]["reason"]
    assert "median us" in done.stdout


def _host_mesh(ranks):
    return Mesh(np.array(jax.devices("cpu")[:ranks]), ("ep",))


def _inputs_with_unrouted_slots(shape):
    inputs = make_inputs(shape, "skewed", seed=3)
    ids = inputs.topk_ids.copy()
    ids[::3, -1] = -1      # some tokens use fewer slots
    ids[5, :] = -1         # one token is not routed at all
    return type(inputs)(x=inputs.x, topk_ids=ids, topk_weights=inputs.topk_weights)


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                               recv_sizes, *, axis_name, axis_index_groups=None):
    """jax.lax.ragged_all_to_all as its docstring defines it, from all_gathers (XLA:CPU has no
    ragged-all-to-all). A receiver whose recv_sizes disagree with the sender's send_sizes
    writes nothing, as the real collective requires them to agree."""
    assert axis_index_groups is None
    me = jax.lax.axis_index(axis_name)
    gather = lambda a: jax.lax.all_gather(a, axis_name)
    operands, starts, sizes, targets = map(gather, (operand, input_offsets, send_sizes,
                                                    output_offsets))
    rows = jnp.arange(output.shape[0])
    result = output
    for source in range(operands.shape[0]):
        size = jnp.where(recv_sizes[source] == sizes[source, me], recv_sizes[source], 0)
        begin = targets[source, me]
        inside = (rows >= begin) & (rows < begin + size)
        src = jnp.clip(starts[source, me] + rows - begin, 0, operand.shape[0] - 1)
        mask = inside.reshape((-1,) + (1,) * (output.ndim - 1))
        result = jnp.where(mask, operands[source][src], result)
    return result


@pytest.mark.parametrize("tokens_in", ["fp8 quantized", "fp8 from bf16", "bf16"])
@pytest.mark.parametrize("peer", sorted(peers.PEERS))
def test_peer_exchange_matches_dense_reference(peer, tokens_in, monkeypatch):
    monkeypatch.setattr(jax.lax, "ragged_all_to_all", emulated_ragged_all_to_all)
    shape = Shape(ranks=4, tokens=16, hidden=256, experts=16, topk=4,
                  fp8=tokens_in.startswith("fp8"), block_size=128)
    inputs = _inputs_with_unrouted_slots(shape)
    mesh = _host_mesh(shape.ranks)
    ctx = methods.make_context(mesh, shape, inputs, traffic(shape, inputs))
    method = methods.peer_method(ctx, peer)
    spec = PartitionSpec("ep")
    put = lambda a: jax.device_put(a, NamedSharding(mesh, spec))
    x = put(inputs.x)
    if tokens_in == "fp8 quantized":
        x = (put(ctx.expected.rows), put(ctx.expected.scales))
    args = (x, put(inputs.topk_ids), put(inputs.topk_weights))
    final = lambda state: method.final(method.init(*state))  # the replicated peer gathers
    run = jax.jit(shard_map(final, mesh, in_specs=(spec,), out_specs=spec))
    verdict = method.check(jax.device_get(run(args)), 0)
    assert verdict["passed"], verdict
    assert np.all(np.asarray(run(args))[5] == 0)  # the unrouted token


@pytest.mark.parametrize("partial", ["f32", "bf16"])
@pytest.mark.parametrize("op", methods.REPLICATED_OPS)
def test_replicated_input_methods_match_dense_reference(op, partial):
    """The replicated-input mode as the benchmark runs it: tokens gathered once (init), the
    exchange on all R*T tokens, each rank's own rows checked."""
    shape = Shape(ranks=4, tokens=16, hidden=256, experts=16, topk=4, fp8=True, block_size=128)
    inputs = _inputs_with_unrouted_slots(shape)
    mesh = _host_mesh(shape.ranks)
    ctx = methods.make_context(mesh, shape, inputs, traffic(shape, inputs))
    comm = methods.make_communicator(ctx, methods.REPLICATED, "expert", partial, 1)
    (method,) = methods.replicated_methods(ctx, comm, (op,))
    spec = PartitionSpec("ep")
    put = lambda a: jax.device_put(a, NamedSharding(mesh, spec))
    args = ((put(ctx.expected.rows), put(ctx.expected.scales)), put(inputs.topk_ids),
            put(inputs.topk_weights))
    final = lambda state: method.final(method.init(*state))
    out = jax.jit(shard_map(final, mesh, in_specs=(spec,), out_specs=spec))(args)
    comm.check()
    verdict = method.check(jax.device_get(out), 0)
    assert verdict["passed"], verdict
    assert np.all(np.asarray(out)[5] == 0)  # the unrouted token
    comm.close()


def test_checks_reject_a_wrong_dispatch_and_a_wrong_combine():
    shape = Shape(ranks=4, tokens=8, hidden=256, experts=16, topk=4, fp8=True, block_size=128)
    inputs = _inputs_with_unrouted_slots(shape)
    mesh = _host_mesh(shape.ranks)
    ctx = methods.make_context(mesh, shape, inputs, traffic(shape, inputs))
    want = ctx.expected
    comm = methods.make_communicator(ctx, "xla", "source", "f32", expert_padding=4)
    method = methods.jax_moe_methods(ctx, comm, ("dispatch",))[0]
    spec = PartitionSpec("ep")
    run = jax.jit(shard_map(method.final, mesh, in_specs=(spec,), out_specs=spec))
    args = tuple(jax.device_put(a, NamedSharding(mesh, spec))
                 for a in (inputs.x, inputs.topk_ids, inputs.topk_weights))
    got = {k: (None if v is None else np.array(v)) for k, v in jax.device_get(run(args)).items()}
    assert method.check(got, 0)["passed"]
    comm.check()

    swapped = dict(got, x=got["x"].copy())
    swapped["x"][[0, 1]] = swapped["x"][[1, 0]]
    assert not method.check(swapped, 0)["passed"]
    reweighted = dict(got, weights=got["weights"].copy())
    reweighted["weights"][0] += 1e-3
    assert not method.check(reweighted, 0)["passed"]

    # Rank 0's rows: x and scales past sum(group_sizes) are unspecified, a padding row inside
    # a segment must be zero.
    L = shape.local_experts
    sizes, tokens = got["group_sizes"][:L], got["tokens_per_expert"][:L]
    total = int(sizes.sum())
    assert total < comm.capacity
    past = {k: got[k].copy() for k in ("x", "scales")}
    past["x"][total:comm.capacity] = 1
    past["scales"][total:comm.capacity] = 3.0
    assert method.check(dict(got, **past), 0)["passed"]
    e = int(np.flatnonzero(sizes > tokens)[0])
    pad_row = int(sizes[:e].sum() + tokens[e])
    padded = dict(got, x=got["x"].copy())
    padded["x"][pad_row] = 1
    assert not method.check(padded, 0)["passed"]

    exact = want.combined.astype(ml_dtypes.bfloat16)
    assert reference.check_close(exact, want.combined, want.bound, roundings=1)["passed"]
    rolled = np.roll(exact, 1, axis=0)
    assert not reference.check_close(rolled, want.combined, want.bound, roundings=1)["passed"]
    scaled = (want.combined * (1 + 2.0 ** -6)).astype(np.float32)
    assert not reference.check_close(scaled, want.combined, want.bound, roundings=1)["passed"]


def test_bench_dequantize_checks_then_times_and_writes_json(tmp_path):
    """On CPU only the xla implementation runs (the kernel's case is skipped and says so)."""
    from benchmarks import bench_dequantize

    stem = tmp_path / "dq"
    bench_dequantize.main(["--rows", "8,24", "--hidden", "256", "--reps", "1", "--n-long", "4",
                           "--out", str(stem)])
    payload = json.loads(stem.with_suffix(".json").read_text())
    assert [(r["implementation"], r["rows"]) for r in payload["results"]] == [("xla", 8),
                                                                             ("xla", 24)]
    assert all(r["bytes"] == r["rows"] * (256 + 2 * 4 + 256 * 2) for r in payload["results"])
    assert stem.with_suffix(".png").exists()
