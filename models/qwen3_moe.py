"""Qwen3-MoE (transformers' Qwen3MoeForCausalLM) in Flax NNX on jax_moe's expert exchange.

Per layer: x += o(attn(rope(q_norm(q x)), rope(k_norm(k x)), v x)) after input RMSNorm, then
x += mlp(post-attention RMSNorm(x)) where mlp is the routed MoE (softmax over E experts in
f32, top-k, renormalised when `norm_topk_prob`) on layers with (i + 1) % decoder_sparse_step
== 0 that are not in `mlp_only_layers`, and a dense SwiGLU MLP elsewhere.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jax_moe.models import layers, stages
from jax_moe.models.attention import gqa_attention, update_kv
from jax_moe.models.base import Cache, CausalLM
from jax_moe.models.checkpoint import (CheckpointError, Tensor, dense_mlp_sources, linear,
                                       routed_expert_sources)
from jax_moe.models.moe import RoutedExperts
from jax_moe.models.sharding import ShardingRules


@dataclasses.dataclass(frozen=True)
class Qwen3MoeConfig:
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  moe_intermediate_size: int
  num_hidden_layers: int
  num_attention_heads: int
  num_key_value_heads: int
  head_dim: int
  num_experts: int
  num_experts_per_tok: int
  norm_topk_prob: bool
  decoder_sparse_step: int
  mlp_only_layers: tuple[int, ...]
  rms_norm_eps: float
  rope_theta: float
  tie_word_embeddings: bool
  attention_bias: bool

  @classmethod
  def from_hf(cls, config: dict) -> "Qwen3MoeConfig":
    def need(key, *aliases):
      for name in (key, *aliases):
        if name in config:
          return config[name]
      raise CheckpointError(f"qwen3_moe config.json has no {key!r}")

    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
      raise NotImplementedError(f"qwen3_moe: rope_type {rope_type!r} is not supported (default only)")
    if config.get("use_sliding_window"):
      raise NotImplementedError("qwen3_moe: use_sliding_window=true is not supported")
    hidden, heads = need("hidden_size"), need("num_attention_heads")
    return cls(
        vocab_size=need("vocab_size"), hidden_size=hidden,
        intermediate_size=need("intermediate_size"),
        moe_intermediate_size=need("moe_intermediate_size"),
        num_hidden_layers=need("num_hidden_layers"), num_attention_heads=heads,
        num_key_value_heads=config.get("num_key_value_heads", heads),
        head_dim=config.get("head_dim") or hidden // heads,
        num_experts=need("num_experts", "num_local_experts"),
        num_experts_per_tok=need("num_experts_per_tok"),
        norm_topk_prob=bool(config.get("norm_topk_prob", False)),
        decoder_sparse_step=config.get("decoder_sparse_step", 1),
        mlp_only_layers=tuple(config.get("mlp_only_layers") or ()),
        rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_bias=bool(config.get("attention_bias", False)))

  def is_moe_layer(self, i: int) -> bool:
    return (i not in self.mlp_only_layers and self.num_experts > 0
            and (i + 1) % self.decoder_sparse_step == 0)


class Attention(nnx.Module):
  """GQA attention, heads tensor-parallel: q, k, v column-parallel (whole heads per rank), o
  row-parallel and summed over tp. When tp exceeds the kv heads (Qwen3-235B: 4 kv heads on
  8 ranks) the k and v weights are replicated and each rank projects only the one kv head
  its query heads read; the cache then holds tp kv heads, copy c of kv head c // (tp / K)."""

  def __init__(self, cfg: Qwen3MoeConfig, *, rules: ShardingRules, pool, dtype):
    D, N, K, H = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    tp = rules.tp_size
    if N % tp:
      raise ValueError(f"qwen3_moe: num_attention_heads ({N}) must be divisible by tp ({tp})")
    if K % tp and tp % K:
      raise ValueError(f"qwen3_moe: num_key_value_heads ({K}) must divide or be divisible by "
                       f"tp ({tp})")
    self.num_heads, self.num_kv_heads, self.head_dim = N, K, H
    self.rules, self.pool = rules, pool
    self.kv_sharded = K % tp == 0
    self.cache_kv_heads = K if self.kv_sharded else tp
    kv_axis = "kv_heads" if self.kv_sharded else None
    kw = dict(rules=rules, dtype=dtype, bias=cfg.attention_bias)
    self.q = layers.Linear(D, N * H, logical_axes=("embed", "heads"), **kw)
    self.k = layers.Linear(D, K * H, logical_axes=("embed", kv_axis), **kw)
    self.v = layers.Linear(D, K * H, logical_axes=("embed", kv_axis), **kw)
    self.o = layers.Linear(N * H, D, logical_axes=("heads", "embed"), **kw)
    self.q_norm = layers.RMSNorm(H, cfg.rms_norm_eps, rules=rules, dtype=dtype,
                                 logical_axis="head_dim")
    self.k_norm = layers.RMSNorm(H, cfg.rms_norm_eps, rules=rules, dtype=dtype,
                                 logical_axis="head_dim")

  def __call__(self, x_bsd, cos, sin, positions_bs, kv_cache=None, index=None):
    """(y [B, S, D], new kv cache or None); batch data-parallel, heads over tp."""
    spec = lambda a, *axes: self.rules.spec_for(a.shape, ("batch",) + axes)
    x_spec = spec(x_bsd, None, None)
    in_specs = [x_spec, spec(cos, None, None), spec(sin, None, None), spec(positions_bs, None)]
    args = [x_bsd, cos, sin, positions_bs]
    out_specs = x_spec
    if kv_cache is not None:
      cache_spec = spec(kv_cache[0], None, "kv_heads", None)
      args += [*kv_cache, index]
      in_specs += [cache_spec, cache_spec, P()]
      out_specs = (x_spec, (cache_spec, cache_spec))
    out = self.rules.per_device(Attention._local, self, *args, in_specs=tuple(in_specs),
                                out_specs=out_specs)
    return out if kv_cache is not None else (out, None)

  def _kv(self, linear, x_bsd):
    """This rank's kv heads of x: its columns of a sharded weight, or, from a replicated one,
    the one kv head its query heads read."""
    if self.kv_sharded:
      return linear(x_bsd)
    H, tp = self.head_dim, self.rules.tp_size
    start = jax.lax.axis_index(self.rules.tp_axis) // (tp // self.num_kv_heads) * H
    w = jax.lax.dynamic_slice_in_dim(linear.w[...], start, H, axis=1)
    y = jnp.einsum("...d,dh->...h", x_bsd, w)
    return y if linear.b is None else y + jax.lax.dynamic_slice_in_dim(linear.b[...], start, H)

  def _local(self, x_bsd, cos, sin, positions_bs, *cache_and_index):
    B, S, _ = x_bsd.shape
    q_bsnh = self.q_norm(self.q(x_bsd).reshape(B, S, -1, self.head_dim))
    k_bskh = self.k_norm(self._kv(self.k, x_bsd).reshape(B, S, -1, self.head_dim))
    v_bskh = self._kv(self.v, x_bsd).reshape(B, S, -1, self.head_dim)
    q_bsnh, k_bskh = layers.apply_rope(q_bsnh, cos, sin), layers.apply_rope(k_bskh, cos, sin)
    if not cache_and_index:
      k_btkh, v_btkh = k_bskh, v_bskh
    else:
      cache_k, cache_v, index = cache_and_index
      k_btkh, v_btkh = update_kv(cache_k, cache_v, k_bskh, v_bskh, index)
    kv_positions_t = jnp.arange(k_btkh.shape[1], dtype=jnp.int32)
    out = gqa_attention(q_bsnh, k_btkh, v_btkh, positions_bs, kv_positions_t,
                        self.head_dim ** -0.5)
    y_bsd = layers.row_parallel(self.o, out.reshape(B, S, -1), self.pool)
    return y_bsd if not cache_and_index else (y_bsd, (k_btkh, v_btkh))


class SparseMoe(nnx.Module):
  """Softmax top-k router + routed experts (no shared expert in Qwen3-MoE)."""

  def __init__(self, cfg: Qwen3MoeConfig, *, rules, pool, dtype, wire, fp8_block):
    self.top_k = cfg.num_experts_per_tok
    self.norm_topk_prob = cfg.norm_topk_prob
    self.rules = rules
    self.router = layers.Linear(cfg.hidden_size, cfg.num_experts, logical_axes=("embed", None),
                                rules=rules, dtype=dtype)
    self.experts = RoutedExperts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                                 experts_per_token=cfg.num_experts_per_tok, rules=rules,
                                 pool=pool, dtype=dtype, wire=wire, fp8_block=fp8_block)

  def __call__(self, x_bsd):
    return self.experts(x_bsd, *self._route(x_bsd))

  def steps(self, x_bsd, slot: int):
    """__call__ as a generator, the dispatch as halves (RoutedExperts.steps)."""
    return (yield from self.experts.steps(x_bsd, *self._route(x_bsd), slot))

  def _route(self, x_bsd):
    """(topk ids int32, topk weights f32) of each token."""
    with jax.named_scope(stages.ROUTER):
      logits = self.router(x_bsd)
      probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
      weights, ids = self.rules.rowwise(lambda p: jax.lax.top_k(p, self.top_k), probs)
      if self.norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
      # transformers casts the routing weights to the activation dtype before using them
      weights = weights.astype(x_bsd.dtype).astype(jnp.float32)
    return ids.astype(jnp.int32), weights


class DecoderLayer(nnx.Module):
  def __init__(self, cfg: Qwen3MoeConfig, i: int, *, rules, pool, dtype, wire, fp8_block):
    self.input_norm = layers.RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, rules=rules, dtype=dtype)
    self.attn = Attention(cfg, rules=rules, pool=pool, dtype=dtype)
    self.post_attn_norm = layers.RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, rules=rules,
                                         dtype=dtype)
    self.is_moe = cfg.is_moe_layer(i)
    if self.is_moe:
      self.mlp = SparseMoe(cfg, rules=rules, pool=pool, dtype=dtype, wire=wire,
                           fp8_block=fp8_block)
    else:
      self.mlp = layers.DenseMLP(cfg.hidden_size, cfg.intermediate_size, rules=rules,
                                 pool=pool, dtype=dtype)

  def __call__(self, x_bsd, cos, sin, positions_bs, kv_cache=None, index=None):
    return stages.finish(self.steps(x_bsd, cos, sin, positions_bs, kv_cache, index))

  def steps(self, x_bsd, cos, sin, positions_bs, kv_cache=None, index=None, slot=None):
    """__call__ as a generator; with `slot` (a micro-batch of the two-batch overlap) the MoE
    block's dispatch goes as halves with a yield between (stages.mlp_steps)."""
    attention = lambda h: self.attn(h, cos, sin, positions_bs, kv_cache, index)  # noqa: E731
    return (yield from stages.pre_norm_residual(
        x_bsd, self.input_norm, attention, self.post_attn_norm,
        stages.mlp_steps(self.mlp, self.is_moe, slot), self.is_moe))


class Qwen3MoeForCausalLM(CausalLM):
  """Qwen3-MoE causal LM; see base.CausalLM for the contract."""

  config_class = Qwen3MoeConfig
  layer_class = DecoderLayer

  def __call__(self, input_ids_bs, *, cache: Cache | None = None, logits_to_keep: int = 0):
    index, positions_bs = self.token_positions(input_ids_bs, cache)
    inv_freq = layers.rope_inv_freq(self.cfg.head_dim, self.cfg.rope_theta)
    cos, sin = layers.rope_cos_sin(positions_bs, inv_freq, self.dtype)
    x_bsd, new_layers = self.run_layers(
        self.embed_tokens(input_ids_bs), cache, (cos, sin, positions_bs),
        lambda layer, x_bsd, kv, per_token, slot: layer.steps(x_bsd, *per_token, kv, index,
                                                              slot))
    return self.final_logits(x_bsd, self.embed_tokens, cache, new_layers, logits_to_keep)

  def init_cache(self, batch: int, max_len: int) -> Cache:
    """k and v [B, T, kv heads, H] per layer: batch data-parallel, kv heads over tp (tp
    copies of them when tp exceeds them, see Attention)."""
    shape = (batch, max_len, self.layers[0].attn.cache_kv_heads, self.cfg.head_dim)
    sharding = self.rules.sharding(shape, ("batch", None, "kv_heads", None))
    zeros = lambda: jax.device_put(jnp.zeros(shape, self.dtype), sharding)
    return Cache(layers=tuple((zeros(), zeros()) for _ in self.layers), index=jnp.int32(0))

  def checkpoint_map(self) -> dict:
    cfg = self.cfg
    sources = self.trunk_checkpoint_map()
    for i, layer in enumerate(self.layers):
      p = f"model.layers.{i}"
      sources[("layers", i, "input_norm", "weight")] = Tensor(f"{p}.input_layernorm.weight")
      sources[("layers", i, "post_attn_norm", "weight")] = Tensor(
          f"{p}.post_attention_layernorm.weight")
      for name in ("q", "k", "v", "o"):
        sources[("layers", i, "attn", name, "w")] = linear(f"{p}.self_attn.{name}_proj")
        if cfg.attention_bias:
          sources[("layers", i, "attn", name, "b")] = Tensor(f"{p}.self_attn.{name}_proj.bias")
      for name in ("q_norm", "k_norm"):
        sources[("layers", i, "attn", name, "weight")] = Tensor(f"{p}.self_attn.{name}.weight")
      if layer.is_moe:
        sources[("layers", i, "mlp", "router", "w")] = linear(f"{p}.mlp.gate")
        sources.update(routed_expert_sources(("layers", i, "mlp", "experts"),
                                             f"{p}.mlp.experts", cfg.num_experts,
                                             gate_up_paired=self.expert_fp8_block is None))
      else:
        sources.update(dense_mlp_sources(("layers", i, "mlp"), f"{p}.mlp"))
    return sources
