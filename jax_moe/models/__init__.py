"""Flax NNX MoE language models on jax_moe's expert-parallel exchange (DESIGN.md, Models).

    from jax_moe import models
    model = models.from_pretrained(path, mesh=None, backend="auto", dtype=jnp.bfloat16)
    logits = model(input_ids)                                   # [B, S, V] f32, eager
    logits = models.forward(model, input_ids)                   # the same, jit-compiled
    tokens = models.generate(model, input_ids, max_new_tokens=32)

`mesh=None` puts all local devices on one expert-parallel axis "ep": attention is
data-parallel over the batch, experts are sharded over every device.
"""

from __future__ import annotations

import jax.numpy as jnp

from jax_moe.models import loader
from jax_moe.models.base import MODEL_TYPES, Cache, CausalLM, model_class
from jax_moe.models.checkpoint import CheckpointError
from jax_moe.models.generation import Generator, forward, generate
from jax_moe.models.sharding import DEFAULT_AXIS, ShardingRules, default_mesh
from jax_moe.models.tiny import TINY_CONFIGS


def _build(config: dict, mesh, axis: str, backend: str, dtype, wire, expert_weights="dtype"):
  if not isinstance(config, dict):
    raise TypeError(f"config must be a config.json dict, got {type(config).__name__}")
  cls = model_class(config.get("model_type"))
  rules = ShardingRules(mesh if mesh is not None else default_mesh(axis=axis), axis)
  return cls(config, rules=rules, backend=backend, dtype=dtype, wire=wire,
             expert_weights=expert_weights)


def from_pretrained(path: str, mesh=None, backend: str = "auto", dtype=jnp.bfloat16, *,
                    axis: str = DEFAULT_AXIS, wire: str | None = None,
                    expert_weights: str = "dtype", progress: bool = True):
  """Loads a Hugging Face checkpoint directory (config.json + safetensors) onto `mesh`.

  wire: how the MoE exchange moves tokens ("bf16", "fp8" or "exact"; default "exact" for
  f32 models, else "bf16"); see jax_moe.models.moe.
  expert_weights: "dtype" (the routed experts' weights in `dtype`; block-fp8 ones are
  dequantized on load) or "fp8" (block-fp8 weights kept as codes and scales and fed to the
  grouped GEMM as such; a checkpoint without them is quantized on load); see base.
  """
  reader = loader.CheckpointReader(path)
  model = _build(reader.config, mesh, axis, backend, dtype, wire, expert_weights)
  return loader.load_weights(model, reader, progress)


def from_config(config: dict, mesh=None, backend: str = "auto", dtype=jnp.bfloat16, *,
                axis: str = DEFAULT_AXIS, wire: str | None = None,
                expert_weights: str = "dtype", seed: int = 0):
  """A model of a config.json dict with random weights (fixed seed), placed on `mesh`;
  with expert_weights="fp8" the experts' random weights are block-fp8 quantized."""
  return loader.random_weights(
      _build(config, mesh, axis, backend, dtype, wire, expert_weights), seed)


def tiny(name: str, **kwargs):
  """One of the embedded tiny models (`TINY_CONFIGS`) with random weights."""
  if name not in TINY_CONFIGS:
    raise ValueError(f"unknown tiny model {name!r}; embedded: {sorted(TINY_CONFIGS)}")
  return from_config(TINY_CONFIGS[name], **kwargs)


__all__ = ["MODEL_TYPES", "TINY_CONFIGS", "Cache", "CausalLM", "CheckpointError", "Generator",
           "ShardingRules", "default_mesh", "forward", "from_config", "from_pretrained", "generate",
           "model_class", "tiny"]
