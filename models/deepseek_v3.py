"""DeepSeek-V3 (transformers' DeepseekV3ForCausalLM) in Flax NNX on jax_moe's expert exchange.

Per layer: x += o(MLA(input RMSNorm(x))), then x += mlp(post-attention RMSNorm(x)), where mlp
is a dense SwiGLU on the first `first_k_dense_replace` layers and elsewhere the DeepSeek MoE:
routed experts chosen by sigmoid scores with group-limited top-k, plus shared experts that
every token goes through. Multi-token-prediction layers (`num_nextn_predict_layers`, stored
after the last decoder layer as `model.layers.{num_hidden_layers + i}`) are not part of the
causal LM: the checkpoint map never names them, so the loader leaves them on disk.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jax_moe.models import layers, stages
from jax_moe.models.base import Cache, CausalLM
from jax_moe.models.checkpoint import (CheckpointError, HeadRows, Tensor, dense_mlp_sources,
                                       linear, routed_expert_sources)
from jax_moe.models.mla import MLAConfig, MultiHeadLatentAttention, init_mla_cache
from jax_moe.models.moe import RoutedExperts
from jax_moe.models.sharding import ShardingRules, param


@dataclasses.dataclass(frozen=True)
class RoutingConfig:
  num_experts: int
  top_k: int
  n_group: int
  topk_group: int
  norm_topk_prob: bool
  routed_scaling_factor: float

  def __post_init__(self):
    if self.n_group < 1 or self.num_experts % self.n_group:
      raise CheckpointError(f"deepseek_v3: n_routed_experts ({self.num_experts}) must divide "
                            f"into n_group ({self.n_group}) equal groups")
    per_group = self.num_experts // self.n_group
    if per_group < 2:
      # A group's score is the sum of its two best experts.
      raise CheckpointError(f"deepseek_v3: each of the n_group={self.n_group} groups needs at "
                            f"least 2 experts, got {per_group}")
    if not 1 <= self.topk_group <= self.n_group:
      raise CheckpointError(f"deepseek_v3: topk_group must be in [1, n_group={self.n_group}], "
                            f"got {self.topk_group}")
    if not 1 <= self.top_k <= self.topk_group * per_group:
      raise CheckpointError(f"deepseek_v3: num_experts_per_tok must be in [1, topk_group * "
                            f"experts per group = {self.topk_group * per_group}], got {self.top_k}")


@dataclasses.dataclass(frozen=True)
class DeepseekV3Config:
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  moe_intermediate_size: int
  num_hidden_layers: int
  n_shared_experts: int
  first_k_dense_replace: int
  rms_norm_eps: float
  tie_word_embeddings: bool
  routing: RoutingConfig
  attention: MLAConfig
  # A run option, not read from config.json (base.CausalLM sets it): the shared experts run
  # between the dispatch's halves, while the routed rows travel. Off until the gain is
  # measured on GPUs (benchmarks/bench_decode.py --overlap-shared-experts).
  overlap_shared_experts: bool = False
  # A run option as well: the shared expert (one, of the routed experts' width) runs as one
  # more expert slot of every token in the routed experts' grouped GEMMs
  # (RoutedExperts.shared_expert; bench_decode.py --fuse-shared-experts).
  fuse_shared_experts: bool = False

  @classmethod
  def from_hf(cls, config: dict) -> "DeepseekV3Config":
    def need(key):
      if config.get(key) is None:
        raise CheckpointError(f"deepseek_v3 config.json has no {key!r}")
      return config[key]

    # What DeepSeek-V3's own config.json states about its MoE; other values mean another
    # model (DeepSeek-V2's softmax greedy routing, MoE on every k-th layer) built otherwise.
    for key, supported in (("hidden_act", "silu"), ("scoring_func", "sigmoid"),
                           ("topk_method", "noaux_tc"), ("moe_layer_freq", 1)):
      if config.get(key, supported) != supported:
        raise NotImplementedError(f"deepseek_v3: {key}={config[key]!r} is not supported "
                                  f"(only {supported!r})")
    num_experts = need("n_routed_experts")
    routing = RoutingConfig(
        num_experts=num_experts, top_k=need("num_experts_per_tok"),
        n_group=config.get("n_group") or 1, topk_group=config.get("topk_group") or 1,
        norm_topk_prob=bool(config.get("norm_topk_prob", True)),
        routed_scaling_factor=float(config.get("routed_scaling_factor", 1.0)))
    for key in ("hidden_size", "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim",
                "qk_rope_head_dim", "v_head_dim"):
      need(key)
    return cls(vocab_size=need("vocab_size"), hidden_size=need("hidden_size"),
               intermediate_size=need("intermediate_size"),
               moe_intermediate_size=need("moe_intermediate_size"),
               num_hidden_layers=need("num_hidden_layers"),
               n_shared_experts=config.get("n_shared_experts") or 0,
               first_k_dense_replace=config.get("first_k_dense_replace") or 0,
               rms_norm_eps=config.get("rms_norm_eps", 1e-6),
               tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
               routing=routing, attention=MLAConfig.from_hf(config))

  def is_moe_layer(self, i: int) -> bool:
    return i >= self.first_k_dense_replace


def route(logits_te: jax.Array, bias_e: jax.Array, cfg: RoutingConfig):
  """DeepSeek-V3 routing: (expert ids [T, K] int32, weights [T, K] f32) from router logits.

  Scores are sigmoid(logits). Selection uses score + bias (the load-balancing correction,
  learned outside the loss), limited to the `topk_group` groups whose two best biased scores
  sum highest; the weights are the unbiased scores of the chosen experts, normalised to sum
  1 when `norm_topk_prob`, then multiplied by `routed_scaling_factor`.
  """
  T, E = logits_te.shape
  G = cfg.n_group
  scores_te = jax.nn.sigmoid(logits_te.astype(jnp.float32))
  choice_te = scores_te + bias_e.astype(jnp.float32)
  # The group selection as reductions and compares, which XLA fuses into a few kernels (two
  # lax.top_k and a scatter were ~10 small kernels a layer, ~17 us, on an H200), with
  # lax.top_k's results: a group's score is its best plus its second best (the best with one
  # occurrence of the maximum removed: ties count twice, as in top_k), and a group is kept
  # when fewer than topk_group groups beat it (a higher score, or an equal one at a lower
  # index: top_k's tie order).
  choice_tgn = choice_te.reshape(T, G, E // G)
  first_tg = jnp.argmax(choice_tgn, axis=-1)
  n_iota = jax.lax.broadcasted_iota(jnp.int32, choice_tgn.shape, 2)
  second_tg = jnp.max(jnp.where(n_iota == first_tg[..., None], -jnp.inf, choice_tgn), axis=-1)
  group_tg = jnp.max(choice_tgn, axis=-1) + second_tg
  g_iota = jnp.arange(G)
  beats_tgh = ((group_tg[:, None, :] > group_tg[:, :, None])
               | ((group_tg[:, None, :] == group_tg[:, :, None])
                  & (g_iota[None, :] < g_iota[:, None])[None]))     # group h beats group g
  group_kept_tg = beats_tgh.sum(-1) < cfg.topk_group
  expert_kept_te = jnp.repeat(group_kept_tg, E // G, axis=1)
  _, ids_tk = jax.lax.top_k(jnp.where(expert_kept_te, choice_te, -jnp.inf), cfg.top_k)
  weights_tk = jnp.take_along_axis(scores_te, ids_tk, axis=1)
  if cfg.norm_topk_prob:
    weights_tk = weights_tk / (weights_tk.sum(-1, keepdims=True) + 1e-20)
  return ids_tk.astype(jnp.int32), weights_tk * cfg.routed_scaling_factor


class TopkRouter(nnx.Module):
  """Router weight and selection bias, both f32 whatever the model dtype (as transformers
  keeps them): the choice between near-equal experts should not depend on bf16 rounding."""

  def __init__(self, cfg: RoutingConfig, hidden: int, *, rules: ShardingRules):
    self.cfg = cfg
    self.rules = rules
    self.w_de = param(rules, (hidden, cfg.num_experts), ("embed", None), jnp.float32)
    self.e_score_correction_bias = param(rules, (cfg.num_experts,), (None,), jnp.float32)

  def __call__(self, x_td):
    # Full f32 products (no TF32/bf16 passes on GPU): the router is tiny next to the experts.
    logits_te = jnp.einsum("td,de->te", x_td.astype(jnp.float32), self.w_de[...],
                           precision=jax.lax.Precision.HIGHEST)
    bias_e = self.e_score_correction_bias[...]
    return self.rules.rowwise(lambda logits: route(logits, bias_e, self.cfg), logits_te)


class DeepseekV3MoE(nnx.Module):
  """Routed experts through jax_moe's exchange, plus the shared experts on every token."""

  def __init__(self, cfg: DeepseekV3Config, *, rules, pool, dtype, wire, fp8_block):
    routing = cfg.routing
    self.gate = TopkRouter(routing, cfg.hidden_size, rules=rules)
    self.experts = RoutedExperts(routing.num_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                                 experts_per_token=routing.top_k, rules=rules, pool=pool,
                                 dtype=dtype, wire=wire, fp8_block=fp8_block,
                                 shared_expert=cfg.fuse_shared_experts)
    # fused, the shared expert lives in the routed experts' slots (RoutedExperts.shared_expert)
    self.shared_experts = (layers.DenseMLP(cfg.hidden_size,
                                           cfg.moe_intermediate_size * cfg.n_shared_experts,
                                           rules=rules, pool=pool, dtype=dtype)
                           if cfg.n_shared_experts and not cfg.fuse_shared_experts else None)
    self.overlap_shared_experts = cfg.overlap_shared_experts

  def steps(self, x_bsd, slot: int):
    """__call__ as a generator, the dispatch as halves (RoutedExperts.steps); the shared
    experts run after the receive (the other micro-batch fills the gap between the halves)."""
    ids_tk, weights_tk = self._route(x_bsd)
    y_bsd = yield from self.experts.steps(x_bsd, ids_tk, weights_tk, slot)
    if self.shared_experts is None:
      return y_bsd
    with jax.named_scope(stages.SHARED_EXPERTS):
      return y_bsd + self.shared_experts(x_bsd)

  def _route(self, x_bsd):
    with jax.named_scope(stages.ROUTER):
      return self.gate(x_bsd.reshape(-1, x_bsd.shape[-1]))

  def __call__(self, x_bsd):
    ids_tk, weights_tk = self._route(x_bsd)
    if self.shared_experts is None:
      return self.experts(x_bsd, ids_tk, weights_tk)
    if self.overlap_shared_experts:
      # dispatch_send -> shared experts -> dispatch_recv: their GEMMs run while the routed
      # rows travel.
      y_bsd, shared_bsd = self.experts.overlapped(x_bsd, ids_tk, weights_tk,
                                                  self.shared_experts, stages.SHARED_EXPERTS)
      with jax.named_scope(stages.SHARED_EXPERTS):
        return y_bsd + shared_bsd
    y_bsd = self.experts(x_bsd, ids_tk, weights_tk)
    with jax.named_scope(stages.SHARED_EXPERTS):
      return y_bsd + self.shared_experts(x_bsd)


class DecoderLayer(nnx.Module):
  def __init__(self, cfg: DeepseekV3Config, i: int, *, rules, pool, dtype, wire, fp8_block):
    norm = lambda: layers.RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, rules=rules, dtype=dtype)
    self.input_layernorm = norm()
    self.self_attn = MultiHeadLatentAttention(cfg.attention, rules=rules, pool=pool, dtype=dtype)
    self.post_attention_layernorm = norm()
    self.is_moe = cfg.is_moe_layer(i)
    if self.is_moe:
      self.mlp = DeepseekV3MoE(cfg, rules=rules, pool=pool, dtype=dtype, wire=wire,
                               fp8_block=fp8_block)
    else:
      self.mlp = layers.DenseMLP(cfg.hidden_size, cfg.intermediate_size, rules=rules,
                                 pool=pool, dtype=dtype)

  def __call__(self, x_bsd, positions_bs, cache=None, index=None):
    return stages.finish(self.steps(x_bsd, positions_bs, cache, index))

  def steps(self, x_bsd, positions_bs, cache=None, index=None, slot=None):
    """__call__ as a generator; with `slot` (a micro-batch of the two-batch overlap) the MoE
    block's dispatch goes as halves with a yield between (stages.mlp_steps)."""
    attention = lambda h: self.self_attn(h, positions_bs, cache, index)  # noqa: E731
    return (yield from stages.pre_norm_residual(
        x_bsd, self.input_layernorm, attention, self.post_attention_layernorm,
        stages.mlp_steps(self.mlp, self.is_moe, slot), self.is_moe))


class DeepseekV3ForCausalLM(CausalLM):
  """DeepSeek-V3 causal LM; see base.CausalLM for the contract. The KV cache holds MLA's
  compressed latent and rotary key per layer (mla.MLACache)."""

  config_class = DeepseekV3Config
  layer_class = DecoderLayer

  def __call__(self, input_ids_bs, *, cache: Cache | None = None, logits_to_keep: int = 0):
    index, positions_bs = self.token_positions(input_ids_bs, cache)
    x_bsd, new_layers = self.run_layers(
        self.embed_tokens(input_ids_bs), cache, (positions_bs,),
        lambda layer, x_bsd, layer_cache, per_token, slot: layer.steps(
            x_bsd, *per_token, layer_cache, index, slot))
    return self.final_logits(x_bsd, self.embed_tokens, cache, new_layers, logits_to_keep)

  def layout(self) -> str:
    cfg = self.cfg
    return super().layout() + (
        ", shared experts between the dispatch halves" if cfg.overlap_shared_experts else
        ", the shared expert in the routed experts' GEMMs" if cfg.fuse_shared_experts else "")

  def init_cache(self, batch: int, max_len: int) -> Cache:
    def place(array_bsx):
      return jax.device_put(array_bsx, self.rules.sharding(array_bsx.shape, ("batch", None, None)))

    return Cache(layers=tuple(
        jax.tree.map(place, init_mla_cache(self.cfg.attention, batch, max_len, self.dtype))
        for _ in self.layers), index=jnp.int32(0))

  def init_scale(self, path: tuple, shape: tuple) -> float | None:
    # The selection bias starts at zero in training; ones would do too (a shift common to
    # all experts), but zeros say what it is.
    if path[-1] == "e_score_correction_bias":
      return 0.0
    return super().init_scale(path, shape)

  def checkpoint_map(self) -> dict:
    cfg = self.cfg
    sources = self.trunk_checkpoint_map()
    for i, layer in enumerate(self.layers):
      p = f"model.layers.{i}"
      at = lambda *names: ("layers", i, *names)
      for norm in ("input_layernorm", "post_attention_layernorm"):
        sources[at(norm, "weight")] = Tensor(f"{p}.{norm}.weight")
      sources.update(_attention_sources(layer.self_attn, at("self_attn"), f"{p}.self_attn"))
      if layer.is_moe:
        sources[at("mlp", "gate", "w_de")] = linear(f"{p}.mlp.gate")
        sources[at("mlp", "gate", "e_score_correction_bias")] = Tensor(
            f"{p}.mlp.gate.e_score_correction_bias")
        shared = ((f"{p}.mlp.shared_experts", layer.mlp.experts.experts_per_shard)
                  if cfg.fuse_shared_experts else None)
        sources.update(routed_expert_sources(at("mlp", "experts"), f"{p}.mlp.experts",
                                              cfg.routing.num_experts,
                                              gate_up_paired=self.expert_fp8_block is None,
                                              shared=shared))
        if layer.mlp.shared_experts is not None:
          sources.update(dense_mlp_sources(at("mlp", "shared_experts"),
                                            f"{p}.mlp.shared_experts"))
      else:
        sources.update(dense_mlp_sources(at("mlp"), f"{p}.mlp"))
    return sources


def _attention_sources(attn: MultiHeadLatentAttention, path: tuple, prefix: str) -> dict:
  """Every Linear (w, and b where present) and RMSNorm of one MLA under its HF name, and
  kv_b_proj's two head-major parts from its one weight (each head's N key rows, then V)."""
  cfg = attn.cfg
  kv_b = f"{prefix}.kv_b_proj.weight"
  sources = {
      (*path, "kv_b_proj", "w_uk_hcn"): HeadRows(kv_b, cfg.num_heads, 0, cfg.qk_nope_head_dim),
      (*path, "kv_b_proj", "w_uv_hcv"): HeadRows(kv_b, cfg.num_heads, cfg.qk_nope_head_dim,
                                                 cfg.v_head_dim)}
  for name, module in vars(attn).items():
    if isinstance(module, layers.Linear):
      sources[(*path, name, "w")] = Tensor(f"{prefix}.{name}.weight", transpose=True)
      if module.b is not None:
        sources[(*path, name, "b")] = Tensor(f"{prefix}.{name}.bias")
    elif isinstance(module, layers.RMSNorm):
      sources[(*path, name, "weight")] = Tensor(f"{prefix}.{name}.weight")
  return sources
