"""DeepSeek-V3 in Flax NNX against transformers' own modules (fp32, CPU, tiny configs)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.sharding import Mesh
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

from jax_moe.models import mla, yarn
from jax_moe.models.sharding import ShardingRules

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 16, "beta_fast": 32, "beta_slow": 1,
        "mscale": 0.9, "mscale_all_dim": 0.707}
DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 5000.0}


def tiny_config(**overrides):
  """A DeepseekV3Config small enough for CPU tests; attn 'eager' so the math is plain."""
  kw = dict(vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
            n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
            n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=12, kv_lora_rank=16,
            qk_rope_head_dim=8, qk_nope_head_dim=6, v_head_dim=10, max_position_embeddings=64,
            rope_parameters=dict(YARN), initializer_range=0.2, num_nextn_predict_layers=0)
  kw.update(overrides)
  config = DeepseekV3Config(**kw)
  config._attn_implementation = "eager"
  return config


def _np(t):
  return t.detach().numpy()


def _close(got, want, rel=1e-4):
  """|got - want| within rel of want's largest magnitude; returns the relative error."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  err = np.max(np.abs(got - want)) / np.max(np.abs(want))
  assert err <= rel, f"max error {err:.3g} of max |want| (bound {rel})"
  return err


# --- rotary embedding and YaRN -----------------------------------------------------------

@pytest.mark.parametrize("rope", [DEFAULT_ROPE, YARN,
                                  dict(YARN, mscale=None, mscale_all_dim=None),
                                  dict(YARN, attention_factor=1.3, beta_fast=8, truncate=False)])
def test_rope_frequencies_and_scales_match_transformers(rope):
  config = tiny_config(rope_parameters=dict(rope))
  rotary = hf.DeepseekV3RotaryEmbedding(config)
  ours = yarn.rope_scaling_from_config(config.to_dict())
  np.testing.assert_allclose(ours.inv_freq_f, _np(rotary.inv_freq), rtol=1e-6)
  assert ours.cos_sin_scale == pytest.approx(rotary.attention_scaling, rel=1e-12)
  attention = hf.DeepseekV3Attention(config, layer_idx=0)
  assert ours.softmax_scale_factor * config.qk_head_dim ** -0.5 == pytest.approx(
      attention.scaling, rel=1e-12)


def test_rope_config_spellings_agree():
  """DeepSeek's own config.json (rope_scaling with `type`, top-level rope_theta) and the
  transformers >= 5 spelling give the same rotary settings."""
  new = {"qk_rope_head_dim": 8, "max_position_embeddings": 64, "rope_parameters": dict(YARN)}
  legacy_scaling = {k: v for k, v in YARN.items() if k not in ("rope_type", "rope_theta")}
  old = {"qk_rope_head_dim": 8, "max_position_embeddings": 64, "rope_theta": 10000.0,
         "rope_scaling": dict(legacy_scaling, type="yarn")}
  a, b = yarn.rope_scaling_from_config(new), yarn.rope_scaling_from_config(old)
  np.testing.assert_array_equal(a.inv_freq_f, b.inv_freq_f)
  assert (a.cos_sin_scale, a.softmax_scale_factor) == (b.cos_sin_scale, b.softmax_scale_factor)
  with pytest.raises(ValueError, match="rope_type must be one of"):
    yarn.rope_scaling_from_config(dict(new, rope_parameters={"rope_type": "longrope"}))


@pytest.mark.parametrize("interleaved", [True, False])
def test_apply_rope_matches_transformers(rng, interleaved):
  config = tiny_config(rope_interleave=interleaved)
  rotary = hf.DeepseekV3RotaryEmbedding(config)
  b, t, h, r = 2, 5, 3, config.qk_rope_head_dim
  positions = rng.integers(0, 60, (b, t))
  q = rng.normal(size=(b, t, h, r)).astype(np.float32)
  k = rng.normal(size=(b, t, 1, r)).astype(np.float32)
  cos, sin = rotary(torch.zeros(1), torch.from_numpy(positions))
  apply = hf.apply_rotary_pos_emb_interleave if interleaved else hf.apply_rotary_pos_emb
  # transformers keeps heads before time: [B, heads, T, R].
  q_want, k_want = apply(torch.from_numpy(q).transpose(1, 2), torch.from_numpy(k).transpose(1, 2),
                         cos, sin)
  rope = yarn.rope_scaling_from_config(config.to_dict())
  cos_btf, sin_btf = yarn.rope_cos_sin(jnp.asarray(positions), rope)
  _close(yarn.apply_rope(jnp.asarray(q), cos_btf, sin_btf, interleaved),
         _np(q_want.transpose(1, 2)), 1e-6)
  _close(yarn.apply_rope(jnp.asarray(k), cos_btf, sin_btf, interleaved),
         _np(k_want.transpose(1, 2)), 1e-6)


# --- multi-head latent attention ---------------------------------------------------------

def _load_linear(linear, hf_linear):
  linear.w.set_value(jnp.asarray(_np(hf_linear.weight).T))
  if hf_linear.bias is not None:
    linear.b.set_value(jnp.asarray(_np(hf_linear.bias)))


def _load_attention(ours, theirs):
  for name, module in theirs.named_children():
    if isinstance(module, torch.nn.Linear):
      _load_linear(getattr(ours, name), module)
    elif isinstance(module, hf.DeepseekV3RMSNorm):
      getattr(ours, name).weight.set_value(jnp.asarray(_np(module.weight)))


def _one_device_rules():
  return ShardingRules(Mesh(np.array(jax.devices()[:1]), ("ep",)))


def _random_attention(config, seed):
  torch.manual_seed(seed)
  theirs = hf.DeepseekV3Attention(config, layer_idx=0).eval()
  with torch.no_grad():
    for p in theirs.parameters():
      p.normal_(0, 0.3)
  ours = mla.MultiHeadLatentAttention(mla.MLAConfig.from_hf(config.to_dict()), rules=_one_device_rules(),
                                      dtype=jnp.float32)
  _load_attention(ours, theirs)
  return ours, theirs


def _hf_attention(theirs, config, x, positions):
  t = x.shape[1]
  mask = torch.triu(torch.full((t, t), float("-inf")), 1)[None, None]
  rotary = hf.DeepseekV3RotaryEmbedding(config)
  cos_sin = rotary(torch.zeros(1), torch.from_numpy(positions))
  with torch.no_grad():
    return _np(theirs(torch.from_numpy(x), cos_sin, mask)[0])


MLA_CASES = {
    "q_lora_yarn_interleaved": dict(),
    "no_q_lora_default_rope": dict(q_lora_rank=None, rope_parameters=dict(DEFAULT_ROPE)),
    "half_split_rope_bias": dict(rope_interleave=False, attention_bias=True),
}


@pytest.mark.parametrize("case", sorted(MLA_CASES))
def test_mla_full_forward_matches_transformers(rng, case):
  config = tiny_config(**MLA_CASES[case])
  ours, theirs = _random_attention(config, seed=len(case))
  b, t = 2, 7
  x = rng.normal(size=(b, t, config.hidden_size)).astype(np.float32)
  positions = np.tile(np.arange(t), (b, 1))
  want = _hf_attention(theirs, config, x, positions)
  got, cache = ours(jnp.asarray(x), jnp.asarray(positions))
  assert cache is None
  _close(got, want)


@pytest.mark.parametrize("case", sorted(MLA_CASES))
def test_mla_cached_steps_equal_full_forward(rng, case):
  """Prefill then one-token steps through the absorbed cache path give the full forward's
  outputs, token by token."""
  config = tiny_config(**MLA_CASES[case])
  ours, theirs = _random_attention(config, seed=len(case) + 1)
  b, t, prefill = 2, 7, 3
  x = rng.normal(size=(b, t, config.hidden_size)).astype(np.float32)
  positions = np.tile(np.arange(t), (b, 1))
  want = _hf_attention(theirs, config, x, positions)
  cache = mla.init_mla_cache(ours.cfg, b, max_len=10, dtype=jnp.float32)
  steps = [(0, prefill)] + [(s, s + 1) for s in range(prefill, t)]
  got = []
  for start, stop in steps:
    y, cache = ours(jnp.asarray(x[:, start:stop]), jnp.asarray(positions[:, start:stop]),
                    cache, jnp.int32(start))
    got.append(y)
  _close(jnp.concatenate(got, axis=1), want)
  # Rows past the written length stay zero: nothing was written out of place.
  assert not np.any(np.asarray(cache.latent_bsc[:, t:]))


def test_mla_cache_needs_length():
  config = tiny_config()
  ours, _ = _random_attention(config, seed=0)
  cache = mla.init_mla_cache(ours.cfg, 1, 4, jnp.float32)
  with pytest.raises(ValueError, match="cache_length is required"):
    ours(jnp.zeros((1, 1, config.hidden_size)), jnp.zeros((1, 1), jnp.int32), cache)
