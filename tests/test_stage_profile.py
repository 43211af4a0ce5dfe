"""benchmarks/stage_profile.py and models/stages.py: named scopes reach the compiled
program's op_name metadata, and a CPU trace's thunks are charged to their stages."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

REPO = Path(__file__).resolve().parents[1]

from benchmarks import stage_profile  # noqa: E402
from jax_moe.models import stages  # noqa: E402


def test_stage_of_takes_the_innermost_stage():
    assert stages.stage_of("jit(decode)/while/body/attention/dot_general") == "attention"
    assert stages.stage_of("jit(f)/shared_experts/dense_mlp/mul") == "dense_mlp"
    assert stages.stage_of("jit(f)/experts_like/add") == "other"  # whole components only
    assert stages.stage_of("") == "other"


FUSED = """
%fc (param_0: f32[4]) -> f32[4] {
  %param_0 = f32[4]{0} parameter(0)
  %exp.1 = f32[4]{0} exponential(%param_0), metadata={op_name="jit(f)/dense_mlp/exp"}
  ROOT %add.1 = f32[4]{0} add(%exp.1, %param_0), metadata={op_name="jit(f)/add"}
}

ENTRY %main.2 (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  ROOT %loop_add_fusion = f32[4]{0} fusion(%x), calls=%fc, metadata={op_name="jit(f)/add"}
}
"""


def test_a_fusion_rooted_outside_every_stage_takes_its_fused_ops_stage():
    names = stage_profile.instruction_stages(FUSED)
    assert names["loop_add_fusion"] == "dense_mlp" and names["add.1"] == "other"


def _program():
    @jax.jit
    def f(x, n):
        def body(_, x):
            with jax.named_scope(stages.ATTENTION):
                x = jnp.tanh(x @ x)
            with jax.named_scope(stages.EXPERTS):
                x = jnp.sin(x @ x.T)
            return x
        return jax.lax.fori_loop(0, n, body, x)
    return f, jnp.asarray(np.random.default_rng(0).standard_normal((256, 256)), jnp.float32)


def test_instructions_carry_their_stage_and_control_flow_is_marked():
    f, x = _program()
    names = stage_profile.instruction_stages(f.lower(x, 2).compile().as_text())
    assert {"attention", "experts"} <= set(names.values())
    assert None in names.values()  # the while loop: its body's thunks count, not it


def test_a_cpu_trace_is_charged_to_the_scoped_stages():
    f, x = _program()
    compiled = f.lower(x, 3).compile()
    got = stage_profile.profile_stages(lambda: f(x, 3), compiled, steps=3)
    per_stage = got["stages_us"]
    assert per_stage["attention"] > 0 and per_stage["experts"] > 0
    assert per_stage["router"] == per_stage["combine"] == 0
    assert got["unmatched_us"] == 0 and got["devices"] == 1
    assert abs(got["total_us"] - sum(per_stage.values())) < 1e-6
    top = got["top_by_stage"]
    assert {"attention", "experts"} <= set(top) <= {"attention", "experts", "other"}
    for stage, rows in top.items():  # each stage's largest events sum to at most its time
        assert 0 < sum(us for _, us, _, _ in rows) <= per_stage[stage] + 1e-6
        assert all(per_step > 0 for _, _, per_step, _ in rows)
    # each row says what its instruction computes: its result type and where it comes from
    assert any(stage in note for stage in ("attention", "experts")
               for rows in top.values() for *_, note in rows)
    assert all("[" in note for rows in top.values() for *_, note in rows), top


def test_gpu_events_are_named_by_instruction_kernel_or_project_kernel():
    """A GPU kernel is matched by its hlo_op (the instruction), by its kernel name (XLA names a
    fusion's kernel after it, '.' as '_'), or, for this project's custom calls, by name."""
    by_name = {"loop_add_fusion.3": "dense_mlp", "while.1": None}
    by_kernel = stage_profile.kernel_names(by_name)
    assert stage_profile.event_stage("loop_add_fusion.3", by_name, by_kernel) == (True, "dense_mlp")
    assert stage_profile.event_stage("loop_add_fusion_3", by_name, by_kernel) == (True, "dense_mlp")
    mangled = "_ZN7jax_moe12_GLOBAL__N_121dispatch_local_kernelILNS_10TokenInputE1ELi1EEEv"
    assert stage_profile.event_stage(mangled, by_name, by_kernel) == (True, "dispatch")
    assert stage_profile.event_stage("combine_kernel<2>", by_name, by_kernel) == (True, "combine")
    assert stage_profile.event_stage("gemm_fusion_9", by_name, by_kernel) == (False, "other")
