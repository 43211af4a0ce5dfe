"""DeepSeek-V3 with `overlap_shared_experts`: the shared experts run between dispatch_send and
dispatch_recv (models/moe.py, RoutedExperts.overlapped).

The logits equal the option-off logits bit for bit on CPU (the halves give the fused
dispatch's bits, docs/semantics.md) for every backend here, f32 and bf16, every wire, on the
1-D mesh and on a (dp, tp) mesh, jitted (a prefill and a cached step) and, on the host
backend, eager. The traced program puts the shared experts where the option says: their GEMMs
depend on the exchange's send and the routed experts' GEMMs depend on them, which the
option-off program does not do (so a silently ignored option fails). Models without shared
experts do not take the option.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import jax_moe as jm
from support import hf_tiny
from support.jaxpr_deps import dependencies, holds, inner_eqns
from jax_moe import cli, models
from jax_moe.cli import generate
from jax_moe.models import stages

MODEL = "tiny-deepseek-v3"
CASES = {  # name -> (mesh shape, dtype, wire)
    "ep8_f32_exact": ((8,), jnp.float32, None),
    "ep8_bf16": ((8,), jnp.bfloat16, None),
    "ep8_bf16_fp8_wire": ((8,), jnp.bfloat16, "fp8"),
    "dp4_tp2_bf16": ((4, 2), jnp.bfloat16, None),
}


def _mesh(shape):
    devices = jax.devices()
    if len(devices) < np.prod(shape):
        pytest.skip(f"needs {np.prod(shape)} devices")
    names = ("ep",) if len(shape) == 1 else models.TP_MESH_AXES
    return Mesh(np.array(devices[:np.prod(shape)]).reshape(shape), names)


def _tiny(mesh, backend, dtype=jnp.float32, wire=None, overlap=False):
    return models.tiny(MODEL, mesh=mesh, backend=backend, dtype=dtype, wire=wire, seed=5,
                       overlap_shared_experts=overlap)


@pytest.mark.parametrize("case", sorted(CASES))
def test_overlap_gives_the_same_logits_bit_for_bit(rng, backend, case):
    shape, dtype, wire = CASES[case]
    mesh = _mesh(shape)
    ids = hf_tiny.random_ids(rng, batch=4, seq=5, vocab=512)
    got = {}
    for overlap in (False, True):
        model = _tiny(mesh, backend, dtype, wire, overlap)
        assert model.cfg.overlap_shared_experts is overlap
        got[overlap] = hf_tiny.prefill_and_step(model, ids)
        model.pool.check()
        model.pool.close()
    for off, on in zip(got[False], got[True]):
        assert np.isfinite(off).all()
        np.testing.assert_array_equal(on, off)


def test_overlap_outside_jit_gives_the_same_layer_output(rng, ep_mesh):
    """Eager, the halves run as programs of their own, the shared experts' between them: on
    the host backend the pending half waits in the native state from one program to the next
    (the xla backend's halves are pure functions, and an eager run of them takes a minute)."""
    if "host" not in jm.available_backends():
        pytest.skip("the host backend is not built")
    x_bsd = jnp.asarray(rng.normal(size=(2, 3, 128)), jnp.bfloat16)
    got = {}
    for overlap in (False, True):
        model = _tiny(ep_mesh, "host", jnp.bfloat16, overlap=overlap)
        got[overlap] = np.asarray(model.layers[1].mlp(x_bsd).astype(jnp.float32))
        model.pool.check()
        model.pool.close()
    np.testing.assert_array_equal(got[True], got[False])


# --- where the shared experts run in the traced program ---------------------------------

def _is_send(backend):
    """The exchange's send: the host backend's FFI target (the fused dispatch sends too); the
    xla backend's all_to_all in the dispatch scope (its dispatch_send moves the rows,
    dispatch_recv places them locally)."""
    if backend == "host":
        return lambda e: e.params.get("target") in ("jax_moe_dispatch_send", "jax_moe_dispatch")
    return lambda e: (e.primitive.name == "all_to_all"
                      and stages.DISPATCH in str(e.source_info.name_stack))


def _placement(moe, x_bsd, backend):
    """(shared experts after the send, routed GEMMs after the shared experts, the FFI targets)
    in the traced program of one MoE layer."""
    jaxpr = jax.make_jaxpr(moe)(x_bsd).jaxpr
    eqns = jaxpr.eqns
    deps = dependencies(jaxpr)
    is_dot = lambda e: e.primitive.name == "dot_general"  # noqa: E731
    shared = [i for i, e in enumerate(eqns)
              if stages.SHARED_EXPERTS in str(e.source_info.name_stack) and holds(e, is_dot)]
    sends = [i for i, e in enumerate(eqns) if holds(e, _is_send(backend))]
    routed = [i for i, e in enumerate(eqns)
              if holds(e, lambda e: e.primitive.name.startswith("ragged_dot"))]
    assert shared and sends and routed, (shared, sends, routed)
    targets = {inner.params["target"] for e in eqns for inner in (e, *inner_eqns(e))
               if "target" in inner.params}
    return (all(set(sends) & deps[i] for i in shared),
            all(set(shared) & deps[i] for i in routed), targets)


def test_shared_experts_run_between_the_dispatch_halves(rng, ep_mesh, backend):
    x_bsd = jnp.asarray(rng.normal(size=(2, 3, 128)), jnp.float32)
    for overlap in (False, True):
        model = _tiny(ep_mesh, backend, overlap=overlap)
        model.prepare(2, 3)
        after_send, before_routed, targets = _placement(model.layers[1].mlp, x_bsd, backend)
        # Off, nothing ties the shared experts to the exchange: the check can see the difference.
        assert (after_send, before_routed) == (overlap, overlap)
        if backend == "host":
            halves = {"jax_moe_dispatch_send", "jax_moe_dispatch_recv"}
            assert (halves <= targets, "jax_moe_dispatch" in targets) == (overlap, not overlap)
        model.pool.close()


# --- where the option travels ------------------------------------------------------------

def test_models_without_shared_experts_do_not_take_the_option(ep_mesh):
    qwen = models.tiny("tiny-qwen3-moe", mesh=ep_mesh, backend="xla",
                       overlap_shared_experts=True)
    assert not hasattr(qwen.cfg, "overlap_shared_experts")
    assert "shared experts" not in qwen.layout()
    config = dict(models.TINY_CONFIGS[MODEL], n_shared_experts=0)
    model = models.from_config(config, mesh=ep_mesh, backend="xla", overlap_shared_experts=True)
    assert not model.cfg.overlap_shared_experts


def test_generate_and_bench_decode_flags_reach_the_model(ep_mesh):
    from benchmarks import bench_decode

    for flags, want in (([], False), (["--overlap-shared-experts"], True)):
        args = cli._parser().parse_args(["generate", "--model", MODEL, "--backend", "xla",
                                         *flags])
        model, _ = generate._build_model(args, None, ep_mesh)
        assert model.cfg.overlap_shared_experts is want
        assert model.layout().endswith("shared experts between the dispatch halves") is want
        bench_args = bench_decode.parse_args(flags)
        assert bench_args.overlap_shared_experts is want
        model = bench_decode._build(MODEL, ep_mesh, "xla", jnp.float32, "exact", 0,
                                    overlap_shared_experts=bench_args.overlap_shared_experts)
        assert model.cfg.overlap_shared_experts is want
