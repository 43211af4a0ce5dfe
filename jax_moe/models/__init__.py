"""Flax NNX MoE language models on jax_moe's expert-parallel exchange (DESIGN.md, Models).

    from jax_moe import models
    model = models.from_pretrained(path, mesh=None, backend="auto", dtype=jnp.bfloat16)
    logits = model(input_ids)                                   # [B, S, V]
    tokens = models.generate(model, input_ids, max_new_tokens=32)
"""

from jax_moe.models.base import MODEL_TYPES, Cache, CausalLM, model_class
from jax_moe.models.checkpoint import CheckpointError

__all__ = ["MODEL_TYPES", "Cache", "CausalLM", "CheckpointError", "model_class"]
