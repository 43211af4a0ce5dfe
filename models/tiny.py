"""Small configs embedded in the package: `jax-moe generate --model tiny-qwen3-moe` needs no
download. Weights are random (fixed seed); the configs are config.json dicts as Hugging Face
writes them, with 16 routed experts so that 1, 2, 4, 8 or 16 devices split them evenly.
"""

TINY_CONFIGS = {
    "tiny-qwen3-moe": {
        "model_type": "qwen3_moe", "vocab_size": 512, "hidden_size": 128,
        "intermediate_size": 256, "moe_intermediate_size": 64, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "num_experts": 16, "num_experts_per_tok": 4, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [0], "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "max_position_embeddings": 4096, "tie_word_embeddings": False,
    },
    "tiny-deepseek-v3": {
        "model_type": "deepseek_v3", "vocab_size": 512, "hidden_size": 128,
        "intermediate_size": 256, "moe_intermediate_size": 64, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 16,
        "n_shared_experts": 1, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2,
        "first_k_dense_replace": 1, "moe_layer_freq": 1, "routed_scaling_factor": 2.5,
        "norm_topk_prob": True, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
        "q_lora_rank": 64, "kv_lora_rank": 32, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16,
        "v_head_dim": 32, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "max_position_embeddings": 4096, "tie_word_embeddings": False, "hidden_act": "silu",
    },
}
