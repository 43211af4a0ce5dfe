"""The model registry and the contract every model class implements.

Registry: `model_class(model_type)` maps config.json's `model_type` to a class, importing
its module lazily (`qwen3_moe` -> `jax_moe.models.qwen3_moe.Qwen3MoeForCausalLM`,
`deepseek_v3` -> `jax_moe.models.deepseek_v3.DeepseekV3ForCausalLM`).

A model class subclasses `CausalLM` (an `nnx.Module`) and implements:

  __init__(self, config: dict, *, rules: ShardingRules, backend: str = "auto", dtype=bf16,
           wire: str | None = None)
      `config` is the parsed config.json (a plain dict). Builds every parameter abstract
      (`sharding.param`: shape, dtype, NamedSharding; no memory) and calls
      `super().__init__(rules, backend, dtype)` first, which sets `self.rules`, `self.dtype`
      and `self.pool` (the CommunicatorPool that the model's RoutedExperts share; pass it as
      `pool=self.pool`, with `wire=wire`). Keep only hashable, static Python values as
      non-parameter attributes (parse the dict into a frozen dataclass; no dicts or lists
      of numbers: nnx would make them pytree leaves).
  checkpoint_map(self) -> dict[tuple, source]
      every parameter path (as in `nnx.to_flat_state(nnx.state(model, nnx.Param))`) to a
      `checkpoint.Tensor` / `checkpoint.StackedExperts`; the loader checks that the map
      covers every parameter, that each tensor exists and that the shapes agree.
  __call__(self, input_ids_bs, *, cache=None)
      input_ids [B, S] int32. Without a cache: logits [B, S, V] (f32) of a full causal
      forward from position 0. With a cache (from `init_cache`): the tokens sit at positions
      [cache.index, cache.index + S); returns (logits [B, S, V], updated cache with index
      advanced by S). Batch is data-parallel over the expert axis (`rules.constrain(x,
      "batch", ...)`), experts sharded over it.
  init_cache(self, batch, max_len) -> Cache
      zeros for `max_len` positions per sequence, `layers` a tuple with one pytree per
      layer (whatever that attention caches), batch dim sharded like activations.
  vocab_size (property)

The base class gives `prepare(batch, seq)` (build the communicators for a call of that
shape, outside jit), `layout()` (a one-line description of the parallel plan), the random
init scale `init_scale(path, shape)` (override for special tensors), and the decoder trunk
shared by the models: `init_trunk` (creates `embed_tokens`, `layers`, `norm` and `lm_head`,
None when the embeddings are tied), `token_positions`, `run_layers`, `final_logits` and
`trunk_checkpoint_map` (the HF names of embed_tokens, norm and lm_head).
"""

from __future__ import annotations

import dataclasses
import importlib

import jax
import jax.numpy as jnp
from flax import nnx

from jax_moe.models import layers
from jax_moe.models.checkpoint import CheckpointError, Tensor, linear
from jax_moe.models.moe import CommunicatorPool
from jax_moe.models.sharding import ShardingRules

MODEL_TYPES = {
    "qwen3_moe": ("jax_moe.models.qwen3_moe", "Qwen3MoeForCausalLM"),
    "deepseek_v3": ("jax_moe.models.deepseek_v3", "DeepseekV3ForCausalLM"),
}


def model_class(model_type: str) -> type:
  """The class for config.json's `model_type`; a clear error for unknown or missing ones."""
  if model_type not in MODEL_TYPES:
    raise CheckpointError(f"unknown model_type {model_type!r} in config.json; jax_moe.models "
                          f"supports {sorted(MODEL_TYPES)}")
  module_name, class_name = MODEL_TYPES[model_type]
  try:
    module = importlib.import_module(module_name)
    return getattr(module, class_name)
  except (ImportError, AttributeError) as e:
    raise NotImplementedError(f"model_type {model_type!r}: {module_name}.{class_name} is not "
                              f"available in this build ({e})") from e


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Cache:
  """Decode state: one pytree per layer and the number of positions already filled.

  All sequences of the batch share `index` (prompts of equal length, no padding).
  """
  layers: tuple
  index: jax.Array  # int32 scalar


class CausalLM(nnx.Module):
  """Base of the model classes; see the module docstring for the contract."""

  def __init__(self, rules: ShardingRules, backend: str = "auto", dtype=jnp.bfloat16):
    self.rules = rules
    self.dtype = jnp.dtype(dtype)
    self.pool = CommunicatorPool(rules, backend)

  def checkpoint_map(self) -> dict:
    raise NotImplementedError

  def init_cache(self, batch: int, max_len: int) -> Cache:
    raise NotImplementedError

  def prepare(self, batch: int, seq: int) -> None:
    """Builds the communicators a call on input_ids [batch, seq] needs (outside jit)."""
    self.pool.prepare(batch * seq)

  # ---------------------------------------------------------------- decoder trunk
  def init_trunk(self, vocab: int, hidden: int, rms_norm_eps: float, tied: bool,
                 num_layers: int, make_layer) -> None:
    """embed_tokens [V, D], layers (make_layer(i) for each), final norm, lm_head (or None)."""
    kw = dict(rules=self.rules, dtype=self.dtype)
    self.embed_tokens = layers.Embedding(vocab, hidden, **kw)
    self.layers = nnx.List([make_layer(i) for i in range(num_layers)])
    self.norm = layers.RMSNorm(hidden, rms_norm_eps, **kw)
    self.lm_head = (None if tied else
                    layers.Linear(hidden, vocab, logical_axes=("embed", "vocab"), **kw))

  @staticmethod
  def token_positions(input_ids_bs, cache: Cache | None):
    """(index, positions [B, S]): the new tokens sit at [index, index + S), index 0 without
    a cache."""
    B, S = input_ids_bs.shape
    index = jnp.int32(0) if cache is None else cache.index
    return index, jnp.broadcast_to(index + jnp.arange(S, dtype=jnp.int32), (B, S))

  def run_layers(self, x_bsd, cache: Cache | None, call_layer):
    """x through every layer of `self.layers`, batch-sharded between layers.

    call_layer(layer, x_bsd, layer_cache or None) -> (x_bsd, new layer_cache or None).
    Returns (x_bsd, tuple of the new layer caches).
    """
    x_bsd = self.rules.constrain(x_bsd, "batch", None, None)
    new_layers = []
    for i, layer in enumerate(self.layers):
      x_bsd, layer_cache = call_layer(layer, x_bsd, None if cache is None else cache.layers[i])
      x_bsd = self.rules.constrain(x_bsd, "batch", None, None)
      new_layers.append(layer_cache)
    return x_bsd, tuple(new_layers)

  def final_logits(self, x_bsd, embed, cache: Cache | None, new_layers: tuple):
    """Final norm and LM head (tied to `embed` when lm_head is None): f32 logits, and the
    cache advanced past the new tokens when there is one."""
    x_bsd = self.norm(x_bsd)
    logits = embed.attend(x_bsd) if self.lm_head is None else self.lm_head(x_bsd)
    logits = logits.astype(jnp.float32)
    if cache is None:
      return logits
    return logits, Cache(layers=new_layers, index=cache.index + x_bsd.shape[1])

  def trunk_checkpoint_map(self) -> dict:
    """Sources of the parameters init_trunk creates, under their Hugging Face names."""
    sources = {("embed_tokens", "table_vd"): Tensor("model.embed_tokens.weight"),
               ("norm", "weight"): Tensor("model.norm.weight")}
    if self.lm_head is not None:
      sources[("lm_head", "w")] = linear("lm_head")
    return sources

  def init_scale(self, path: tuple, shape: tuple) -> float | None:
    """Std of the random init of one parameter; None means ones (norm weights)."""
    if len(shape) == 1:
      return None
    fan_in = shape[-2]
    return fan_in ** -0.5

  def layout(self) -> str:
    mesh = self.rules.mesh
    R = self.rules.axis_size
    return (f"mesh {dict(mesh.shape)} on {mesh.devices.size} {mesh.devices.flat[0].platform} "
            f"device(s); attention data-parallel over batch on '{self.rules.axis}', experts "
            f"sharded over '{self.rules.axis}' ({R} way), MoE exchange backend "
            f"'{self.pool.backend_name}', dtype {self.dtype.name}")
