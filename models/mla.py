"""Multi-head latent attention (DeepSeek-V2/V3) with a compressed KV cache.

Every token's keys and values come from one latent: c = RMSNorm(x W_dkv) [C = kv_lora_rank]
plus one rotary key k_r [R = qk_rope_head_dim] shared by all heads. Per head h,
k_h = [c W_uk_h, k_r] and v_h = c W_uv_h (W_uk, W_uv: the two parts of kv_b_proj).

The cache holds c and the rotated k_r (C + R numbers per token; 576 for DeepSeek-V3
against 2 * 128 heads * 192 = 49152 for expanded keys and values), which is what makes
long-context decode fit. Attention over latents runs one of two ways, picked per call from
the static shapes by counting multiply-adds (`uses_absorbed`):
  absorbed: the key projection moves into the query (q_h . c W_uk_h = (q_h W_uk_h^T) . c)
    and the value projection after the weighted sum (sum_s p_s c_s W_uv_h), so nothing is
    expanded per key: a decode step costs O(S * H * (2C + R)).
  expanded: k and v are computed for every key once, O(S * H * C * (N + V)), and attention
    costs O(T * S * H * (N + R + V)): cheaper when many queries share the keys (prefill).

kv_b_proj is kept head-major and split, as W_uk [H, C, N] and W_uv [H, C, V] (HF stores it as
one [H * (N + V), C] Linear): both einsums then take each head's weights as stored, with heads
as their batch dimension. From the one [C, H * (N + V)] weight every decode step needed slices
of it with the heads moved major, and a 16.5 us slice fusion a layer showed in the step's
profile at DeepSeek-V3's shape (results/decode-realistic-a9ed175/), most likely that copy.

Tensor parallelism splits the heads: q_proj / q_b_proj and kv_b_proj are column-parallel
(whole heads per rank), o_proj row-parallel and summed over tp; the latent projections
(q_a_proj, kv_a_proj_with_mqa, their norms) and so the cache are replicated over tp, every
rank computing the latents its heads read.

Names: B batch, T query tokens, S key positions, D hidden, H heads, N qk_nope_head_dim,
R qk_rope_head_dim, V v_head_dim, C kv_lora_rank, Q q_lora_rank.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jax_moe import settings
from jax_moe.models import mla_decode, yarn
from jax_moe.models.layers import Linear, RMSNorm, row_parallel
from jax_moe.models.sharding import ShardingRules, param


@dataclasses.dataclass(frozen=True)
class MLAConfig:
  hidden_size: int
  num_heads: int
  q_lora_rank: int | None
  kv_lora_rank: int
  qk_nope_head_dim: int
  qk_rope_head_dim: int
  v_head_dim: int
  rms_norm_eps: float
  attention_bias: bool
  rope: yarn.RopeScaling

  @classmethod
  def from_hf(cls, config: Mapping[str, Any]) -> "MLAConfig":
    """From a DeepSeek-V3 config.json dict."""
    return cls(hidden_size=config["hidden_size"], num_heads=config["num_attention_heads"],
               q_lora_rank=config.get("q_lora_rank"), kv_lora_rank=config["kv_lora_rank"],
               qk_nope_head_dim=config["qk_nope_head_dim"],
               qk_rope_head_dim=config["qk_rope_head_dim"], v_head_dim=config["v_head_dim"],
               rms_norm_eps=config.get("rms_norm_eps", 1e-6),
               attention_bias=bool(config.get("attention_bias", False)),
               rope=yarn.rope_scaling_from_config(config))

  @property
  def qk_head_dim(self) -> int:
    return self.qk_nope_head_dim + self.qk_rope_head_dim

  @property
  def softmax_scale(self) -> float:
    return self.qk_head_dim ** -0.5 * self.rope.softmax_scale_factor


class MLACache(NamedTuple):
  """One layer's cache. Rows [0, length) are filled; `length` is kept by the caller because
  every layer shares it."""
  latent_bsc: jax.Array  # after kv_a_layernorm
  k_rope_bsr: jax.Array  # after the rotary embedding


def init_mla_cache(cfg: MLAConfig, batch: int, max_len: int, dtype: Any) -> MLACache:
  return MLACache(jnp.zeros((batch, max_len, cfg.kv_lora_rank), dtype),
                  jnp.zeros((batch, max_len, cfg.qk_rope_head_dim), dtype))


def _masked_softmax(scores_bhts: jax.Array, visible_bts: jax.Array) -> jax.Array:
  # f32 scores in; every query sees at least itself, so no row is all -inf.
  scores_bhts = jnp.where(visible_bts[:, None], scores_bhts, -jnp.inf)
  return jax.nn.softmax(scores_bhts, axis=-1)


class LatentUpProjection(nnx.Module):
  """kv_b_proj as its two per-head parts: keys' w_uk_hcn [H, C, N] and values' w_uv_hcv
  [H, C, V] (k_nope_h = c W_uk_h, v_h = c W_uv_h), heads sharded over tp."""

  def __init__(self, cfg: MLAConfig, *, rules: ShardingRules, dtype: Any):
    shape = lambda n: (cfg.num_heads, cfg.kv_lora_rank, n)
    axes = ("heads", "kv_lora", None)
    self.w_uk_hcn = param(rules, shape(cfg.qk_nope_head_dim), axes, dtype)
    self.w_uv_hcv = param(rules, shape(cfg.v_head_dim), axes, dtype)


class MultiHeadLatentAttention(nnx.Module):
  """Projections named as in Hugging Face (layers.Linear: w [in, out]); the per-head ones
  sharded over tp (module docstring), attention data-parallel over the batch. `pool`: the
  model's CommunicatorPool (its AllReduce sums o_proj's partial products)."""

  def __init__(self, cfg: MLAConfig, *, rules: ShardingRules, pool, dtype: Any):
    heads, tp = cfg.num_heads, rules.tp_size
    if heads % tp:
      raise ValueError(f"deepseek_v3: num_attention_heads ({heads}) must be divisible by tp "
                       f"({tp})")
    self.cfg = cfg
    self.rules, self.pool = rules, pool
    linear = lambda i, o, axes, bias: Linear(i, o, rules=rules, dtype=dtype, logical_axes=axes,
                                             bias=bias)
    if cfg.q_lora_rank is None:
      self.q_proj = linear(cfg.hidden_size, heads * cfg.qk_head_dim, ("embed", "heads"), False)
    else:
      self.q_a_proj = linear(cfg.hidden_size, cfg.q_lora_rank, ("embed", "q_lora"),
                             cfg.attention_bias)
      self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, rules=rules, dtype=dtype,
                                   logical_axis="q_lora")
      self.q_b_proj = linear(cfg.q_lora_rank, heads * cfg.qk_head_dim, ("q_lora", "heads"), False)
    self.kv_a_proj_with_mqa = linear(cfg.hidden_size, cfg.kv_lora_rank + cfg.qk_rope_head_dim,
                                     ("embed", "kv_lora"), cfg.attention_bias)
    self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps, rules=rules, dtype=dtype,
                                  logical_axis="kv_lora")
    self.kv_b_proj = LatentUpProjection(cfg, rules=rules, dtype=dtype)
    self.o_proj = linear(heads * cfg.v_head_dim, cfg.hidden_size, ("heads", "embed"),
                         cfg.attention_bias)

  def _queries(self, x_btd, cos_btf, sin_btf):
    cfg = self.cfg
    if cfg.q_lora_rank is None:
      q_btk = self.q_proj(x_btd)
    else:
      q_btk = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_btd)))
    q_bthk = q_btk.reshape(*x_btd.shape[:2], -1, cfg.qk_head_dim)  # this rank's heads
    q_nope_bthn = q_bthk[..., :cfg.qk_nope_head_dim]
    q_rope_bthr = yarn.apply_rope(q_bthk[..., cfg.qk_nope_head_dim:], cos_btf, sin_btf,
                                  cfg.rope.interleaved)
    return q_nope_bthn, q_rope_bthr

  def _latents(self, x_btd, cos_btf, sin_btf):
    cfg = self.cfg
    kv_btl = self.kv_a_proj_with_mqa(x_btd)
    latent_btc = self.kv_a_layernorm(kv_btl[..., :cfg.kv_lora_rank])
    # The rotary key is one head shared by all query heads.
    k_rope_btr = yarn.apply_rope(kv_btl[..., None, cfg.kv_lora_rank:], cos_btf, sin_btf,
                                 cfg.rope.interleaved)[:, :, 0]
    return latent_btc, k_rope_btr

  def uses_absorbed(self, num_queries: int, num_keys: int) -> bool:
    """Whether T queries over S keys take fewer multiply-adds absorbed than expanded.

    Absorbed: T*H*C*N (queries into latent space) + 2*T*S*H*C (scores, weighted latent sum)
    + T*H*C*V (values out). Expanded: S*H*C*(N+V) (keys and values) + T*S*H*(N+V).
    The rotary scores (T*S*H*R) are the same both ways. Without a cache (S = T) that is
    absorbed iff 2C < N + V, never for DeepSeek; one decode step (T = 1) is absorbed.
    """
    cfg = self.cfg
    C, N, V = cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.v_head_dim
    T, S = num_queries, num_keys
    absorbed = T * C * (N + V) + T * S * 2 * C
    expanded = S * C * (N + V) + T * S * (N + V)
    return absorbed < expanded

  def __call__(self, x_btd: jax.Array, positions_bt: jax.Array, cache: MLACache | None = None,
               cache_length: jax.Array | None = None) -> tuple[jax.Array, MLACache | None]:
    """Causal attention of x [B, T, D] at `positions_bt`.

    Without a cache: a full forward where token t sees tokens with position <= its own.
    With a cache: the T new tokens are written at rows [cache_length, cache_length + T) and
    attend to rows [0, cache_length + t]; `positions_bt` must then be
    cache_length + arange(T) (no padding inside a batch). Returns (y [B, T, D], cache).
    """
    spec = lambda a: self.rules.spec_for(a.shape, ("batch",) + (None,) * (a.ndim - 1))
    x_spec = spec(x_btd)
    if cache is None:
      y_btd = self.rules.per_device(MultiHeadLatentAttention._local, self, x_btd, positions_bt,
                                    in_specs=(x_spec, spec(positions_bt)), out_specs=x_spec)
      return y_btd, None
    if cache_length is None:
      raise ValueError("MultiHeadLatentAttention: cache_length is required with a cache")
    if x_btd.shape[1] > cache.latent_bsc.shape[1]:
      raise ValueError(f"MultiHeadLatentAttention: {x_btd.shape[1]} new tokens do not fit a "
                       f"cache of {cache.latent_bsc.shape[1]} positions")
    cache_specs = MLACache(*map(spec, cache))
    return self.rules.per_device(
        MultiHeadLatentAttention._local, self, x_btd, positions_bt, cache, cache_length,
        in_specs=(x_spec, spec(positions_bt), cache_specs, P()),
        out_specs=(x_spec, cache_specs))

  def _local(self, x_btd, positions_bt, cache=None, cache_length=None):
    """One device's heads of __call__ (per_device): the cache whole on every tp rank."""
    cfg = self.cfg
    cos_btf, sin_btf = yarn.rope_cos_sin(positions_bt, cfg.rope)
    q_nope_bthn, q_rope_bthr = self._queries(x_btd, cos_btf, sin_btf)
    latent_btc, k_rope_btr = self._latents(x_btd, cos_btf, sin_btf)
    w_uk_hcn, w_uv_hcv = self.kv_b_proj.w_uk_hcn[...], self.kv_b_proj.w_uv_hcv[...]

    if cache is None:
      keys_latent_bsc, keys_rope_bsr = latent_btc, k_rope_btr
      visible_bts = positions_bt[:, None, :] <= positions_bt[:, :, None]
    else:
      start = (0, cache_length, 0)
      cache = MLACache(
          jax.lax.dynamic_update_slice(cache.latent_bsc, latent_btc.astype(cache.latent_bsc.dtype),
                                       start),
          jax.lax.dynamic_update_slice(cache.k_rope_bsr, k_rope_btr.astype(cache.k_rope_bsr.dtype),
                                       start))
      keys_latent_bsc, keys_rope_bsr = cache
      rows_s = jnp.arange(keys_latent_bsc.shape[1])
      query_rows_bt = cache_length + jnp.arange(x_btd.shape[1])[None, :]
      visible_bts = rows_s[None, None, :] <= query_rows_bt[:, :, None]
    # Scores accumulate and stay in f32 whatever the model dtype; probabilities go back to
    # the value dtype for the weighted sum, as transformers' eager attention does.
    f32 = dict(preferred_element_type=jnp.float32)
    if cache is not None and x_btd.shape[1] == 1:
      # One decode step (absorbed: uses_absorbed(1, S) always holds): query row cache_length
      # sees rows [0, cache_length], in one kernel over the cache (mla_decode).
      q_latent_bthc = jnp.einsum("bthn,hcn->bthc", q_nope_bthn, w_uk_hcn)
      out_bthc = mla_decode.decode_attention(
          q_latent_bthc[:, 0], q_rope_bthr[:, 0], keys_latent_bsc, keys_rope_bsr,
          cache_length + 1, cfg.softmax_scale, implementation=settings.mla_decode())[:, None]
      out_bthv = jnp.einsum("bthc,hcv->bthv", out_bthc, w_uv_hcv)
    elif self.uses_absorbed(x_btd.shape[1], keys_latent_bsc.shape[1]):
      q_latent_bthc = jnp.einsum("bthn,hcn->bthc", q_nope_bthn, w_uk_hcn)
      scores_bhts = jnp.einsum("bthr,bsr->bhts", q_rope_bthr, keys_rope_bsr, **f32)
      scores_bhts += jnp.einsum("bthc,bsc->bhts", q_latent_bthc, keys_latent_bsc, **f32)
      probs_bhts = _masked_softmax(scores_bhts * cfg.softmax_scale, visible_bts)
      out_bthc = jnp.einsum("bhts,bsc->bthc", probs_bhts.astype(keys_latent_bsc.dtype),
                            keys_latent_bsc)
      out_bthv = jnp.einsum("bthc,hcv->bthv", out_bthc, w_uv_hcv)
    else:
      k_nope_bshn = jnp.einsum("bsc,hcn->bshn", keys_latent_bsc, w_uk_hcn)
      v_bshv = jnp.einsum("bsc,hcv->bshv", keys_latent_bsc, w_uv_hcv)
      scores_bhts = jnp.einsum("bthr,bsr->bhts", q_rope_bthr, keys_rope_bsr, **f32)
      scores_bhts += jnp.einsum("bthn,bshn->bhts", q_nope_bthn, k_nope_bshn, **f32)
      probs_bhts = _masked_softmax(scores_bhts * cfg.softmax_scale, visible_bts)
      out_bthv = jnp.einsum("bhts,bshv->bthv", probs_bhts.astype(v_bshv.dtype), v_bshv)
    y_btd = row_parallel(self.o_proj, out_bthv.reshape(*x_btd.shape[:2], -1), self.pool)
    return y_btd if cache is None else (y_btd, cache)
