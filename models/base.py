"""The model registry and the contract every model class implements.

Registry: `model_class(model_type)` maps config.json's `model_type` to a class, importing
its module lazily (`qwen3_moe` -> `jax_moe.models.qwen3_moe.Qwen3MoeForCausalLM`,
`deepseek_v3` -> `jax_moe.models.deepseek_v3.DeepseekV3ForCausalLM`).

A model class subclasses `CausalLM` (an `nnx.Module`), which is built as
`cls(config: dict, *, rules: ShardingRules, backend="auto", dtype=bf16, wire=None,
expert_weights="dtype", overlap_shared_experts=False, two_batch_overlap=False,
fuse_shared_experts=False)` with `config` the parsed config.json;
`expert_weights` is how the routed experts hold their weights: "dtype" (the model dtype) or
"fp8" (block-fp8, `grouped_gemm.BlockFp8Weights`, with the block of config.json's
`quantization_config`, else 128 x 128; see jax_moe.models.moe). `overlap_shared_experts`
runs the shared experts between the halves of each MoE layer's dispatch (off by default: the
gain is not measured yet); it goes into the config of models with shared experts
(`n_shared_experts`, DeepSeek-V3) and changes nothing in the others. `two_batch_overlap` runs
a batch as two micro-batches, one's layers while the other's dispatch is in flight
(models.two_batch; off by default, the gain is not measured yet). `fuse_shared_experts` runs
a model's one shared expert as one more expert slot of every token, in the routed experts'
grouped GEMMs (jax_moe.models.moe: `shared_expert`; its weights then sit in the routed
experts' parameters); like the overlap, models without shared experts ignore it. The class
declares

  config_class
      `config_class.from_hf(config)` -> a frozen dataclass (hashable, static values only: no
      dicts or lists of numbers, nnx would make them pytree leaves) with vocab_size,
      hidden_size, rms_norm_eps, tie_word_embeddings and num_hidden_layers; kept as `self.cfg`.
  layer_class
      `layer_class(cfg, i, rules=, pool=, dtype=, wire=, fp8_block=)`: decoder layer i, its
      parameters abstract (`sharding.param`: shape, dtype, NamedSharding; no memory); its
      RoutedExperts take `pool` (the model's CommunicatorPool), `wire` and `fp8_block` (None
      for experts in the model dtype). Its `steps(x, ..., slot=None)` is the layer as a
      generator (stages.pre_norm_residual) for `run_layers`.

and implements:
  checkpoint_map(self) -> dict[tuple, source]
      every parameter path (as in `nnx.to_flat_state(nnx.state(model, nnx.Param))`) to a
      `checkpoint.Tensor` / `checkpoint.StackedExperts`; the loader checks that the map
      covers every parameter, that each tensor exists and that the shapes agree.
  __call__(self, input_ids_bs, *, cache=None, logits_to_keep=0)
      input_ids [B, S] int32. Without a cache: logits [B, S, V] (f32) of a full causal
      forward from position 0. With a cache (from `init_cache`): the tokens sit at positions
      [cache.index, cache.index + S); returns (logits [B, S, V], updated cache with index
      advanced by S). `logits_to_keep` = n > 0 gives the logits of the last n positions only
      ([B, n, V]; transformers' argument of that name): a prefill that samples one token
      needs 1, and skips the LM head's GEMM over the other positions. Batch is
      data-parallel over the data-parallel axis (`rules.constrain(x, "batch", ...)`),
      attention heads and dense MLPs split over the tensor-parallel axis when there is one,
      experts sharded over both.
  init_cache(self, batch, max_len) -> Cache
      zeros for `max_len` positions per sequence, `layers` a tuple with one pytree per
      layer (whatever that attention caches), batch dim sharded like activations.

The base class gives `vocab_size`, `prepare(batch, seq)` (build the communicators for a call of that
shape, outside jit), `layout()` (a one-line description of the parallel plan), the random
init scale `init_scale(path, shape)` (override for special tensors), and the decoder trunk
shared by the models: the constructor creates `embed_tokens`, `layers`, `norm` and `lm_head`
(None when the embeddings are tied); `token_positions`, `run_layers`, `final_logits` and
`trunk_checkpoint_map` (the HF names of embed_tokens, norm and lm_head).
"""

from __future__ import annotations

import dataclasses
import importlib

import jax
import jax.numpy as jnp
from flax import nnx

from jax_moe.models import fp8_weights, layers, stages, two_batch
from jax_moe.models.checkpoint import GATE_UP_PAIR, CheckpointError, Tensor, linear
from jax_moe.models.moe import CommunicatorPool
from jax_moe.models.sharding import ShardingRules

MODEL_TYPES = {
    "qwen3_moe": ("jax_moe.models.qwen3_moe", "Qwen3MoeForCausalLM"),
    "deepseek_v3": ("jax_moe.models.deepseek_v3", "DeepseekV3ForCausalLM"),
}
EXPERT_WEIGHTS = ("dtype", "fp8")  # how routed experts hold their weights (module docstring)


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


def _check_fused_shared_experts(cfg) -> None:
  """fuse_shared_experts puts one shared expert into the routed experts' slots: it must have
  their width, and it cannot also run between the dispatch halves."""
  if cfg.n_shared_experts != 1:
    raise ValueError(f"fuse_shared_experts needs n_shared_experts == 1 (one expert slot of the "
                     f"routed experts' width), got {cfg.n_shared_experts}")
  if cfg.overlap_shared_experts:
    raise ValueError("fuse_shared_experts and overlap_shared_experts exclude each other: the "
                     "fused shared expert runs in the routed experts' GEMMs")


class CausalLM(nnx.Module):
  """Base of the model classes; see the module docstring for the contract."""

  config_class: type
  layer_class: type

  def __init__(self, config: dict, *, rules: ShardingRules, backend: str = "auto",
               dtype=jnp.bfloat16, wire: str | None = None, expert_weights: str = "dtype",
               overlap_shared_experts: bool = False, two_batch_overlap: bool = False,
               fuse_shared_experts: bool = False):
    """The decoder trunk: embed_tokens [V, D], layers, final norm, lm_head (None if tied)."""
    if expert_weights not in EXPERT_WEIGHTS:
      raise ValueError(f"expert_weights must be one of {EXPERT_WEIGHTS}, got {expert_weights!r}")
    fp8_block = self.expert_fp8_block = (
        (fp8_weights.block_size_from_config(config) or fp8_weights.DEFAULT_BLOCK)
        if expert_weights == "fp8" else None)
    self.rules = rules
    self.dtype = jnp.dtype(dtype)
    self.two_batch_overlap = bool(two_batch_overlap)
    self.pool = CommunicatorPool(rules, backend)
    cfg = self.config_class.from_hf(config)
    # Only a model with shared experts has something to overlap, and a field to hold it.
    if overlap_shared_experts and getattr(cfg, "n_shared_experts", 0):
      cfg = dataclasses.replace(cfg, overlap_shared_experts=True)
    if fuse_shared_experts and getattr(cfg, "n_shared_experts", 0):
      _check_fused_shared_experts(cfg)
      cfg = dataclasses.replace(cfg, fuse_shared_experts=True)
    self.cfg = cfg
    kw = dict(rules=rules, dtype=self.dtype)
    self.embed_tokens = layers.Embedding(cfg.vocab_size, cfg.hidden_size, **kw)
    self.layers = nnx.List([self.layer_class(cfg, i, pool=self.pool, wire=wire,
                                             fp8_block=fp8_block, **kw)
                            for i in range(cfg.num_hidden_layers)])
    self.norm = layers.RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
    self.lm_head = (None if cfg.tie_word_embeddings else
                    layers.Linear(cfg.hidden_size, cfg.vocab_size,
                                  logical_axes=("embed", "vocab"), **kw))

  @property
  def vocab_size(self) -> int:
    return self.cfg.vocab_size

  def checkpoint_map(self) -> dict:
    raise NotImplementedError

  def init_cache(self, batch: int, max_len: int) -> Cache:
    raise NotImplementedError

  def prepare(self, batch: int, seq: int) -> None:
    """Builds the communicators a call on input_ids [batch, seq] needs (outside jit): with
    the two-batch overlap, one per micro-batch of half the batch."""
    if self.two_batch_overlap and two_batch.splits(self.rules, batch):
      self.pool.prepare(batch // two_batch.MICRO_BATCHES * seq, two_batch.MICRO_BATCHES)
    else:
      self.pool.prepare(batch * seq)

  # ---------------------------------------------------------------- decoder trunk
  @staticmethod
  def token_positions(input_ids_bs, cache: Cache | None):
    """(index, positions [B, S]): the new tokens sit at [index, index + S), index 0 without
    a cache."""
    B, S = input_ids_bs.shape
    index = jnp.int32(0) if cache is None else cache.index
    return index, jnp.broadcast_to(index + jnp.arange(S, dtype=jnp.int32), (B, S))

  def run_layers(self, x_bsd, cache: Cache | None, per_token: tuple, layer_steps):
    """x through every layer of `self.layers`, batch-sharded between layers.

    layer_steps(layer, x_bsd, layer_cache or None, per_token, slot) -> the layer's `steps`
    generator, which returns (x_bsd, new layer_cache or None); `per_token` holds the
    batch-first arrays a layer takes besides x (positions, rotary tables). With
    `two_batch_overlap` and a batch that splits, the layers run as two micro-batches
    (models.two_batch), slots 0 and 1; else as one (slot None: the fused exchange).
    Returns (x_bsd, tuple of the new layer caches).
    """
    x_bsd = self.rules.constrain(x_bsd, "batch", None, None)
    layer_caches = None if cache is None else cache.layers
    if self.two_batch_overlap and two_batch.splits(self.rules, x_bsd.shape[0]):
      return two_batch.run_layers(self, x_bsd, layer_caches, per_token, layer_steps)
    new_layers = []
    for i, layer in enumerate(self.layers):
      x_bsd, layer_cache = stages.finish(layer_steps(
          layer, x_bsd, None if layer_caches is None else layer_caches[i], per_token, None))
      x_bsd = self.rules.constrain(x_bsd, "batch", None, None)
      new_layers.append(layer_cache)
    return x_bsd, tuple(new_layers)

  def final_logits(self, x_bsd, embed, cache: Cache | None, new_layers: tuple,
                   logits_to_keep: int = 0):
    """Final norm and LM head (tied to `embed` when lm_head is None): f32 logits of the last
    `logits_to_keep` positions (all when 0), and the cache advanced past the new tokens when
    there is one."""
    seq = x_bsd.shape[1]
    if not isinstance(logits_to_keep, int) or logits_to_keep < 0:
      raise ValueError(f"logits_to_keep must be an int >= 0 (0: every position), got "
                       f"{logits_to_keep!r}")
    if logits_to_keep:  # before the norm: the rows dropped are never normalized either
      x_bsd = x_bsd[:, max(seq - logits_to_keep, 0):]
    x_bsd = self.norm(x_bsd)
    logits = embed.attend(x_bsd) if self.lm_head is None else self.lm_head(x_bsd)
    logits = logits.astype(jnp.float32)
    if cache is None:
      return logits
    return logits, Cache(layers=new_layers, index=cache.index + seq)

  def trunk_checkpoint_map(self) -> dict:
    """Sources of embed_tokens, norm and lm_head, under their Hugging Face names."""
    sources = {("embed_tokens", "table_vd"): Tensor("model.embed_tokens.weight"),
               ("norm", "weight"): Tensor("model.norm.weight")}
    if self.lm_head is not None:
      sources[("lm_head", "w")] = linear("lm_head")
    return sources

  def init_scale(self, path: tuple, shape: tuple) -> float | None:
    """Std of the random init of one parameter; None means ones (norm weights)."""
    if len(shape) == 1:
      return None
    # [..., in, out]; the routed experts' gate and up pair, [E, D, 2, F], has its fan-in at D
    fan_in = shape[1] if path[-1] == GATE_UP_PAIR else shape[-2]
    return fan_in ** -0.5

  def layout(self) -> str:
    rules = self.rules
    mesh = rules.mesh
    block = self.expert_fp8_block
    experts = "" if block is None else f", routed experts block-fp8 ({block[0]}x{block[1]} blocks)"
    tp = ("" if rules.tp_axis is None else
          f", heads and dense MLPs tensor-parallel over '{rules.tp_axis}' ({rules.tp_size} way, "
          f"outputs summed by AllReduce)")
    return (f"mesh {dict(mesh.shape)} on {mesh.devices.size} {mesh.devices.flat[0].platform} "
            f"device(s); attention data-parallel over batch on '{rules.axis}'{tp}, experts "
            f"sharded over {rules.expert_axis!r} ({rules.expert_size} way), MoE exchange "
            f"backend '{self.pool.backend_name}', dtype {self.dtype.name}{experts}"
            + (", two micro-batches (two-batch overlap)" if self.two_batch_overlap else ""))
