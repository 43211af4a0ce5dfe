"""Flax NNX MoE language models on jax_moe's expert-parallel exchange (DESIGN.md, Models).

    from jax_moe import models
    model = models.from_pretrained(path, mesh=None, backend="auto", dtype=jnp.bfloat16)
    logits = model(input_ids)                                   # [B, S, V] f32, eager
    logits = models.forward(model, input_ids)                   # the same, jit-compiled
    tokens = models.generate(model, input_ids, max_new_tokens=32)

`mesh=None` puts all local devices on one expert-parallel axis "ep": attention is
data-parallel over the batch, experts are sharded over every device. A ("dp", "tp") mesh
runs attention tensor-parallel inside each tp group (heads, dense MLPs and shared experts
split over "tp", outputs summed by jm.AllReduce) and data-parallel over "dp", experts over
all dp * tp devices (sharding.py has the rules; `axis` / `tp_axis` name other axes).
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jax_moe.models import loader
from jax_moe.models.base import MODEL_TYPES, Cache, CausalLM, model_class
from jax_moe.models.checkpoint import CheckpointError
from jax_moe.models.generation import Generator, forward, generate
from jax_moe.models.moe import RoutedExperts
from jax_moe.models.sharding import DEFAULT_AXIS, TP_MESH_AXES, ShardingRules, default_mesh
from jax_moe.models.tiny import TINY_CONFIGS


def _build(config: dict, mesh, axis: str | None, backend: str, dtype, wire,
           expert_weights="dtype", tp_axis: str | None = None,
           overlap_shared_experts: bool = False, two_batch_overlap: bool = False,
           fuse_shared_experts: bool = False):
  if not isinstance(config, dict):
    raise TypeError(f"config must be a config.json dict, got {type(config).__name__}")
  cls = model_class(config.get("model_type"))
  if mesh is None:
    mesh = default_mesh(axis=axis or DEFAULT_AXIS)
  elif not isinstance(mesh, Mesh):
    raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
  rules = ShardingRules.of_mesh(mesh, axis, tp_axis)
  return cls(config, rules=rules, backend=backend, dtype=dtype, wire=wire,
             expert_weights=expert_weights, overlap_shared_experts=overlap_shared_experts,
             two_batch_overlap=two_batch_overlap, fuse_shared_experts=fuse_shared_experts)


def _kernel_ready(model):
  """`model` with its block-fp8 experts' kernel scale operands built once, where their GEMM
  takes tokamax's kernel (RoutedExperts.precompute_kernel_scales)."""
  for _, node in nnx.iter_graph(model):
    if isinstance(node, RoutedExperts):
      node.precompute_kernel_scales()
  return model


def from_pretrained(path: str, mesh=None, backend: str = "auto", dtype=jnp.bfloat16, *,
                    axis: str | None = None, tp_axis: str | None = None,
                    wire: str | None = None, expert_weights: str = "dtype",
                    overlap_shared_experts: bool = False, two_batch_overlap: bool = False,
                    fuse_shared_experts: bool = False, progress: bool = True):
  """Loads a Hugging Face checkpoint directory (config.json + safetensors) onto `mesh`.

  mesh: None (every local device on "ep"), a 1-D mesh, or a ("dp", "tp") mesh; `axis` and
  `tp_axis` name the data- and tensor-parallel axes of a mesh named otherwise.
  wire: how the MoE exchange moves tokens ("bf16", "fp8" or "exact"; default "exact" for
  f32 models, else "bf16"); see jax_moe.models.moe.
  expert_weights: "dtype" (the routed experts' weights in `dtype`; block-fp8 ones are
  dequantized on load) or "fp8" (block-fp8 weights kept as codes and scales and fed to the
  grouped GEMM as such; a checkpoint without them is quantized on load); see base.
  overlap_shared_experts: run the shared experts (DeepSeek-V3's) between the halves of each
  MoE layer's dispatch, while the routed rows travel; the same logits. Off by default: the
  gain is not measured yet. Models without shared experts ignore it.
  two_batch_overlap: run each batch that splits into two micro-batches per shard as two, one's
  layers while the other's dispatch travels (models.two_batch); the logits up to the halves'
  roundings. Off by default: the gain is not measured yet.
  fuse_shared_experts: run the shared expert (DeepSeek-V3's one) as one more expert slot of
  every token, in the routed experts' grouped GEMMs (its weights loaded into their slots);
  the bf16 or fp8 wire, no tp axis. Models without shared experts
  ignore it.
  """
  reader = loader.CheckpointReader(path)
  model = _build(reader.config, mesh, axis, backend, dtype, wire, expert_weights, tp_axis,
                 overlap_shared_experts, two_batch_overlap, fuse_shared_experts)
  return _kernel_ready(loader.load_weights(model, reader, progress))


def from_config(config: dict, mesh=None, backend: str = "auto", dtype=jnp.bfloat16, *,
                axis: str | None = None, tp_axis: str | None = None,
                wire: str | None = None, expert_weights: str = "dtype",
                overlap_shared_experts: bool = False, two_batch_overlap: bool = False,
                fuse_shared_experts: bool = False, seed: int = 0):
  """A model of a config.json dict with random weights (fixed seed), placed on `mesh` (as
  from_pretrained takes it, options included); with expert_weights="fp8" the experts' random
  weights are block-fp8 quantized."""
  return _kernel_ready(loader.random_weights(
      _build(config, mesh, axis, backend, dtype, wire, expert_weights, tp_axis,
             overlap_shared_experts, two_batch_overlap, fuse_shared_experts), seed))


def tiny(name: str, **kwargs):
  """One of the embedded tiny models (`TINY_CONFIGS`) with random weights."""
  if name not in TINY_CONFIGS:
    raise ValueError(f"unknown tiny model {name!r}; embedded: {sorted(TINY_CONFIGS)}")
  return from_config(TINY_CONFIGS[name], **kwargs)


__all__ = ["MODEL_TYPES", "TINY_CONFIGS", "TP_MESH_AXES", "Cache", "CausalLM", "CheckpointError",
           "Generator", "ShardingRules", "default_mesh", "forward", "from_config",
           "from_pretrained", "generate", "model_class", "tiny"]
