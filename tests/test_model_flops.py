"""benchmarks/flops.py: the prefill FLOPs of the tiny models, counted again by hand from
their config.json values (every projection written out per model family)."""

from pathlib import Path

import jax
import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]

from benchmarks import flops  # noqa: E402
from jax_moe import models  # noqa: E402
from jax_moe.models.tiny import TINY_CONFIGS  # noqa: E402

B, S = 2, 5


def _by_hand(name):
    c = TINY_CONFIGS[name]
    D, L, V = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
    F, I, K = c["moe_intermediate_size"], c["intermediate_size"], c["num_experts_per_tok"]
    if name == "tiny-qwen3-moe":
        H, kv, hd, E = (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"],
                        c["num_experts"])
        attention = D * H * hd + 2 * D * kv * hd + H * hd * D          # q, k, v, o
        dense_layers = len(c["mlp_only_layers"])
        moe_extra = D * E                                              # router
        qk = v = hd
    else:
        H, E = c["num_attention_heads"], c["n_routed_experts"]
        nope, rope, vd = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
        attention = (D * c["q_lora_rank"] + c["q_lora_rank"] * H * (nope + rope)
                     + D * (c["kv_lora_rank"] + rope) + c["kv_lora_rank"] * H * (nope + vd)
                     + H * vd * D)
        dense_layers = c["first_k_dense_replace"]
        moe_extra = D * E + 3 * D * F * c["n_shared_experts"]          # router, shared
        qk, v = nope + rope, vd
    moe_layers = L - dense_layers
    dense = L * attention + dense_layers * 3 * D * I + moe_layers * moe_extra
    return {"dense": 2 * B * S * dense,
            "routed_experts": 2 * B * S * moe_layers * K * 3 * D * F,
            "attention": L * 2 * B * H * (qk + v) * S * (S + 1) // 2,
            "lm_head": 2 * B * D * V}


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_prefill_flops_match_a_count_by_hand(name):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("ep",))
    got = flops.prefill_flops(models.tiny(name, mesh=mesh), B, S)
    want = _by_hand(name)
    want["total"] = sum(want.values())
    assert got == want


def test_a_fused_shared_expert_counts_as_the_separate_one():
    """fuse_shared_experts moves the shared expert's weights into the routed experts'
    slots; the model's FLOPs (and their parts) stay what they are."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("ep",))
    separate = flops.prefill_flops(models.tiny("tiny-deepseek-v3", mesh=mesh), B, S)
    fused = flops.prefill_flops(models.tiny("tiny-deepseek-v3", mesh=mesh,
                                            fuse_shared_experts=True), B, S)
    assert fused == separate


def test_peak_by_device_kind():
    assert flops.bf16_peak_flops("NVIDIA H200") == 989.4e12
    assert flops.bf16_peak_flops("cpu") is None
