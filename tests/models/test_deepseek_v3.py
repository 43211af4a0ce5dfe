"""DeepSeek-V3 in Flax NNX against transformers' own modules (fp32, CPU, tiny configs)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

from support import hf_tiny
from support.hf_tiny import YARN, deepseek_v3_config, save_deepseek_v3
from support.meshes import make_mesh
from jax_moe import models
from jax_moe.grouped_gemm import BlockFp8Weights
from jax_moe.models import deepseek_v3, loader, mla, yarn
from jax_moe.models.checkpoint import CheckpointError
from jax_moe.models.moe import CommunicatorPool
from jax_moe.models.sharding import ShardingRules

DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 5000.0}


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
  config = deepseek_v3_config(rope_parameters=dict(rope))
  rotary = hf.DeepseekV3RotaryEmbedding(config)
  ours = yarn.rope_scaling_from_config(config.to_dict())
  np.testing.assert_allclose(ours.inv_freq_f, _np(rotary.inv_freq), rtol=1e-6)
  assert hash(ours) is not None  # models keep it as a static attribute
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
  config = deepseek_v3_config(rope_interleave=interleaved)
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
    if name == "kv_b_proj":  # [H * (N + V), C]: per head its N key rows, then its V rows
      cfg = ours.cfg
      w_hxc = _np(module.weight).reshape(cfg.num_heads, -1, cfg.kv_lora_rank)
      n = cfg.qk_nope_head_dim
      ours.kv_b_proj.w_uk_hcn.set_value(jnp.asarray(w_hxc[:, :n].transpose(0, 2, 1)))
      ours.kv_b_proj.w_uv_hcv.set_value(jnp.asarray(w_hxc[:, n:].transpose(0, 2, 1)))
    elif isinstance(module, torch.nn.Linear):
      _load_linear(getattr(ours, name), module)
    elif isinstance(module, hf.DeepseekV3RMSNorm):
      getattr(ours, name).weight.set_value(jnp.asarray(_np(module.weight)))


def _one_device_rules():
  return ShardingRules(make_mesh(1))


def _random_attention(config, seed):
  torch.manual_seed(seed)
  theirs = hf.DeepseekV3Attention(config, layer_idx=0).eval()
  with torch.no_grad():
    for p in theirs.parameters():
      p.normal_(0, 0.3)
  rules = _one_device_rules()
  ours = mla.MultiHeadLatentAttention(mla.MLAConfig.from_hf(config.to_dict()), rules=rules,
                                      pool=CommunicatorPool(rules), dtype=jnp.float32)
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
  config = deepseek_v3_config(**MLA_CASES[case])
  ours, theirs = _random_attention(config, seed=len(case))
  b, t = 2, 7
  x = rng.normal(size=(b, t, config.hidden_size)).astype(np.float32)
  positions = np.tile(np.arange(t), (b, 1))
  want = _hf_attention(theirs, config, x, positions)
  got, cache = ours(jnp.asarray(x), jnp.asarray(positions))
  assert cache is None
  _close(got, want)


@pytest.mark.parametrize("prefill", [3, 20])
@pytest.mark.parametrize("case", sorted(MLA_CASES))
def test_mla_cached_steps_equal_full_forward(rng, case, prefill):
  """Prefill then one-token steps through the cache give transformers' full-forward outputs,
  token by token. A 3-token prefill attends absorbed, a 20-token one expanded; steps absorbed."""
  config = deepseek_v3_config(**MLA_CASES[case])
  ours, theirs = _random_attention(config, seed=len(case) + 1)
  b, t, max_len = 2, prefill + 3, prefill + 5
  assert ours.uses_absorbed(prefill, max_len) == (prefill == 3)
  assert ours.uses_absorbed(1, max_len) and not ours.uses_absorbed(t, t)
  x = rng.normal(size=(b, t, config.hidden_size)).astype(np.float32)
  positions = np.tile(np.arange(t), (b, 1))
  want = _hf_attention(theirs, config, x, positions)
  cache = mla.init_mla_cache(ours.cfg, b, max_len, dtype=jnp.float32)
  steps = [(0, prefill)] + [(s, s + 1) for s in range(prefill, t)]
  got = []
  for start, stop in steps:
    y, cache = ours(jnp.asarray(x[:, start:stop]), jnp.asarray(positions[:, start:stop]),
                    cache, jnp.int32(start))
    got.append(y)
  _close(jnp.concatenate(got, axis=1), want)
  # Rows past the written length stay zero: nothing was written out of place.
  assert not np.any(np.asarray(cache.latent_bsc[:, t:]))


def test_mla_cache_bad_input_is_refused():
  config = deepseek_v3_config()
  ours, _ = _random_attention(config, seed=0)
  cache = mla.init_mla_cache(ours.cfg, 1, 4, jnp.float32)
  with pytest.raises(ValueError, match="cache_length is required"):
    ours(jnp.zeros((1, 1, config.hidden_size)), jnp.zeros((1, 1), jnp.int32), cache)
  with pytest.raises(ValueError, match="5 new tokens do not fit a cache of 4 positions"):
    ours(jnp.zeros((1, 5, config.hidden_size)), jnp.zeros((1, 5), jnp.int32), cache, 0)


# --- routing -----------------------------------------------------------------------------

ROUTING_CASES = {
    "groups2_top1group_norm": dict(n_group=2, topk_group=1, num_experts_per_tok=2),
    "groups4_top2groups_k3_nonorm": dict(n_group=4, topk_group=2, num_experts_per_tok=3,
                                         norm_topk_prob=False, routed_scaling_factor=1.7),
    "one_group_k4": dict(n_group=1, topk_group=1, num_experts_per_tok=4),
}


@pytest.mark.parametrize("case", sorted(ROUTING_CASES))
def test_routing_matches_transformers(rng, case):
  config = deepseek_v3_config(n_routed_experts=16, **ROUTING_CASES[case])
  router = hf.DeepseekV3TopkRouter(config)
  with torch.no_grad():
    router.weight.normal_(0, 0.5)
    router.e_score_correction_bias.normal_(0, 0.3)
  x = rng.normal(size=(40, config.hidden_size)).astype(np.float32)
  with torch.no_grad():
    _, want_w, want_ids = router(torch.from_numpy(x))
  routing = deepseek_v3.DeepseekV3Config.from_hf(config.to_dict()).routing
  ids, weights = deepseek_v3.route(jnp.asarray(x) @ jnp.asarray(_np(router.weight).T),
                                   jnp.asarray(_np(router.e_score_correction_bias)), routing)
  # Both top-ks are unsorted: compare per token in expert order.
  order, want_order = np.argsort(ids, axis=1), np.argsort(_np(want_ids), axis=1)
  np.testing.assert_array_equal(np.take_along_axis(np.asarray(ids), order, 1),
                                np.take_along_axis(_np(want_ids), want_order, 1))
  _close(np.take_along_axis(np.asarray(weights), order, 1),
         np.take_along_axis(_np(want_w), want_order, 1), 1e-6)


def _route_with_top_k(logits_te, bias_e, cfg):
  """DeepSeek-V3's group-limited routing written with lax.top_k and a scatter (the plain
  form of deepseek_v3.route's group selection): the reference for its ties."""
  T, E = logits_te.shape
  scores_te = jax.nn.sigmoid(logits_te)
  choice_te = scores_te + bias_e
  best2, _ = jax.lax.top_k(choice_te.reshape(T, cfg.n_group, -1), 2)
  _, kept = jax.lax.top_k(best2.sum(-1), cfg.topk_group)
  kept_tg = jnp.zeros((T, cfg.n_group), bool).at[jnp.arange(T)[:, None], kept].set(True)
  masked = jnp.where(jnp.repeat(kept_tg, E // cfg.n_group, axis=1), choice_te, -jnp.inf)
  _, ids_tk = jax.lax.top_k(masked, cfg.top_k)
  return ids_tk


@pytest.mark.parametrize("groups,kept,top_k", [(8, 4, 8), (4, 2, 3), (2, 1, 2), (1, 1, 4)])
@pytest.mark.parametrize("ties", [False, True])
def test_routing_group_selection_is_top_ks(rng, groups, kept, top_k, ties):
  """route's reductions pick the same experts, in the same order, as two lax.top_k and a
  scatter, also where many scores tie (logits on a coarse grid, equal group scores)."""
  routing = deepseek_v3.RoutingConfig(num_experts=32, top_k=top_k, n_group=groups,
                                      topk_group=kept, norm_topk_prob=True,
                                      routed_scaling_factor=2.5)
  logits = rng.normal(size=(300, 32)).astype(np.float32)
  bias = rng.normal(0, 0.1, size=32).astype(np.float32)
  if ties:
    logits, bias = np.round(logits * 2) / 2, np.zeros_like(bias)
  ids, _ = deepseek_v3.route(jnp.asarray(logits), jnp.asarray(bias), routing)
  np.testing.assert_array_equal(np.asarray(ids), np.asarray(
      _route_with_top_k(jnp.asarray(logits), jnp.asarray(bias), routing)))


def test_routing_bias_selects_but_does_not_weigh():
  """A large bias on one expert makes every token pick it, with its unbiased score."""
  routing = deepseek_v3.RoutingConfig(num_experts=4, top_k=1, n_group=1, topk_group=1,
                                      norm_topk_prob=False, routed_scaling_factor=1.0)
  logits = jnp.array([[2.0, 0.0, -1.0, 1.0]])
  ids, weights = deepseek_v3.route(logits, jnp.array([0.0, 0.0, 5.0, 0.0]), routing)
  assert int(ids[0, 0]) == 2
  assert float(weights[0, 0]) == pytest.approx(1 / (1 + np.exp(1.0)))


@pytest.mark.parametrize("overrides,message", [
    (dict(n_routed_experts=8, n_group=3), "must divide into n_group"),
    (dict(n_routed_experts=8, n_group=8, topk_group=1), "at least 2 experts"),
    (dict(n_group=2, topk_group=3), "topk_group must be in"),
    (dict(n_group=2, topk_group=1, num_experts_per_tok=5), "num_experts_per_tok must be in"),
])
def test_bad_routing_config_is_refused(overrides, message):
  config = deepseek_v3_config().to_dict()
  config.update(overrides)
  with pytest.raises(CheckpointError, match=message):
    deepseek_v3.DeepseekV3Config.from_hf(config)


@pytest.mark.parametrize("key,value", [("scoring_func", "softmax"), ("topk_method", "greedy"),
                                       ("moe_layer_freq", 2), ("hidden_act", "gelu")])
def test_other_moe_variants_are_refused(key, value):
  config = dict(deepseek_v3_config().to_dict(), scoring_func="sigmoid", topk_method="noaux_tc")
  deepseek_v3.DeepseekV3Config.from_hf(config)  # DeepSeek-V3's own values are accepted
  with pytest.raises(NotImplementedError, match=f"{key}={value!r} is not supported"):
    deepseek_v3.DeepseekV3Config.from_hf(dict(config, **{key: value}))


# --- the whole model, loaded from a transformers checkpoint ------------------------------

MODEL_CASES = {
    # DeepSeek-V3's shape: q LoRA, one dense layer first, normalised top-k, YaRN, 2 groups.
    "qlora_dense1_norm_yarn_groups2": dict(),
    "noqlora_moe_only_nonorm_default_rope_bias": dict(
        q_lora_rank=None, first_k_dense_replace=0, norm_topk_prob=False, n_group=1,
        topk_group=1, rope_parameters=dict(DEFAULT_ROPE), attention_bias=True,
        routed_scaling_factor=1.0),
    "groups4_topk_group2_k3_halfsplit_tied_2shared": dict(
        n_group=4, topk_group=2, num_experts_per_tok=3, rope_interleave=False,
        tie_word_embeddings=True, n_shared_experts=2, num_hidden_layers=3),
}


def _load(path, mesh, backend, dtype=jnp.float32, **kwargs):
  return models.from_pretrained(path, mesh=mesh, backend=backend, dtype=dtype, progress=False,
                                **kwargs)




@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """case -> (transformers model, checkpoint dir), each saved once per module."""
  done = {}

  def get(case):
    if case not in done:
      done[case] = save_deepseek_v3(tmp_path_factory.mktemp(case), seed=len(case),
                                  **MODEL_CASES[case])
    return done[case]
  return get


@pytest.mark.parametrize("case", sorted(MODEL_CASES))
def test_logits_match_transformers(saved, rng, ep_mesh, backend, case):
  hf_model, path = saved(case)
  ids = hf_tiny.random_ids(rng, batch=2, seq=9, vocab=hf_model.config.vocab_size)
  want = hf_tiny.hf_logits(hf_model, ids)
  got = models.forward(_load(path, ep_mesh, backend), ids)
  err = _close(got, want)
  print(f"{case}: max |logits - transformers| / max |transformers| = {err:.2e}")


def test_expert_parallel_equals_one_device(saved, rng, mesh_of, ep_mesh, backend):
  """All devices (8 here) against one, f32; and the serving setup (bf16 weights, bf16
  exchange) near transformers' f32 logits."""
  if ep_mesh.devices.size == 1:
    pytest.skip("needs more than one device")
  hf_model, path = saved("qlora_dense1_norm_yarn_groups2")
  ids = hf_tiny.random_ids(rng, batch=2, seq=5, vocab=hf_model.config.vocab_size)
  one = models.forward(_load(path, mesh_of(1), backend), ids)
  err = _close(models.forward(_load(path, ep_mesh, backend), ids), one, 1e-6)
  print(f"EP{ep_mesh.devices.size} vs 1 device, f32: {err:.2e}")
  err = _close(models.forward(_load(path, ep_mesh, backend, jnp.bfloat16), ids),
               hf_tiny.hf_logits(hf_model, ids), 5e-2)
  print(f"EP{ep_mesh.devices.size} bf16 vs transformers f32: {err:.2e}")


def test_embedded_tiny_model_decodes_like_its_full_forward(rng, ep_mesh, backend):
  """The CLI's random-weight tiny-deepseek-v3 (legacy top-level rope_theta spelling) on all
  devices: a prefill and cached steps give the full forward's logits."""
  model = models.tiny("tiny-deepseek-v3", mesh=ep_mesh, backend=backend, dtype=jnp.float32)
  ids = hf_tiny.random_ids(rng, batch=2, seq=6, vocab=model.vocab_size)
  full = models.forward(model, ids)
  logits, cache = models.forward(model, ids[:, :4], model.init_cache(2, 6))
  steps = [logits]
  for t in (4, 5):
    logits, cache = models.forward(model, ids[:, t:t + 1], cache)
    steps.append(logits)
  _close(jnp.concatenate(steps, axis=1), full, 1e-5)


def test_cached_decode_and_greedy_generate_match_transformers(saved, rng, ep_mesh, backend):
  """generate's tokens are transformers' greedy tokens, and the logits of each cached step
  (prefill, then one token at a time) are transformers' logits of that step. (The half-split
  rope layout in the cache is covered by test_mla_cached_steps_equal_full_forward.)"""
  case = "qlora_dense1_norm_yarn_groups2"
  hf_model, path = saved(case)
  prompt, new = 6, 5
  # No token 0 in the prompt: hf_greedy names 0 the pad token, and transformers' generate
  # then masks those positions out of attention.
  ids = 1 + hf_tiny.random_ids(rng, batch=2, seq=prompt, vocab=hf_model.config.vocab_size - 1)
  want_tokens, want_logits = hf_tiny.hf_greedy(hf_model, ids, max_new_tokens=new)
  model = _load(path, ep_mesh, backend)
  np.testing.assert_array_equal(np.asarray(models.generate(model, ids, max_new_tokens=new)),
                                want_tokens)
  cache = model.init_cache(2, prompt + new)
  logits, cache = models.forward(model, ids, cache)
  got_logits = [logits[:, -1]]
  for step in range(new - 1):
    logits, cache = models.forward(model, want_tokens[:, prompt + step:prompt + step + 1], cache)
    got_logits.append(logits[:, -1])
  assert int(cache.index) == prompt + new - 1
  err = _close(jnp.stack(got_logits), want_logits)
  print(f"{case}: cached decode max error {err:.2e}")


# --- fp8 checkpoint ----------------------------------------------------------------------

FP8_BLOCK = (16, 16)  # small blocks so the tiny dims (24, 56, ...) end in partial blocks


@pytest.fixture(scope="module")
def fp8_saved(saved, tmp_path_factory):
  """(transformers model, fp8 checkpoint dir, f32 checkpoint of its dequantized weights,
  the fp8 checkpoint's tensors): codes + weight_scale_inv with partial edge blocks, and an
  MTP layer that must be skipped."""
  hf_model, path = saved("qlora_dense1_norm_yarn_groups2")
  tensors = load_file(f"{path}/model.safetensors")
  fp8, dequantized = {}, {}
  for name, w in tensors.items():
    if hf_tiny.is_quantized_in_deepseek(name, w):
      fp8[name], fp8[name + "_scale_inv"], dequantized[name] = hf_tiny.quantize_block_fp8(
          w, FP8_BLOCK)
    else:
      fp8[name] = dequantized[name] = w
  # A multi-token-prediction layer after the last decoder layer, as DeepSeek ships it.
  mtp = f"model.layers.{hf_model.config.num_hidden_layers}"
  mtp_codes, mtp_scales, _ = hf_tiny.quantize_block_fp8(torch.randn(32, 64), FP8_BLOCK)
  fp8[f"{mtp}.eh_proj.weight"], fp8[f"{mtp}.eh_proj.weight_scale_inv"] = mtp_codes, mtp_scales
  fp8[f"{mtp}.enorm.weight"] = torch.ones(32)
  config = json.load(open(f"{path}/config.json"))
  tmp_path = tmp_path_factory.mktemp("fp8")
  fp8_dir, f32_dir = tmp_path / "fp8", tmp_path / "dequantized"
  for directory, state, extra in (
      (fp8_dir, fp8, {"num_nextn_predict_layers": 1,
                      "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                                              "activation_scheme": "dynamic",
                                              "weight_block_size": list(FP8_BLOCK)}}),
      (f32_dir, dequantized, {})):
    directory.mkdir()
    save_file({k: v.contiguous() for k, v in state.items()}, str(directory / "model.safetensors"),
              metadata={"format": "pt"})
    json.dump(dict(config, **extra), open(directory / "config.json", "w"))
  return hf_model, str(fp8_dir), str(f32_dir), fp8


def test_fp8_checkpoint_loads_like_its_dequantized_weights(fp8_saved, rng, ep_mesh, backend):
  """An fp8 checkpoint gives the logits of an f32 checkpoint of its dequantized weights, and
  those are transformers' logits for the same weights."""
  hf_model, fp8_dir, f32_dir, _ = fp8_saved
  ids = hf_tiny.random_ids(rng, batch=2, seq=7, vocab=hf_model.config.vocab_size)
  from_fp8 = models.forward(_load(fp8_dir, ep_mesh, backend), ids)
  from_f32 = models.forward(_load(f32_dir, ep_mesh, backend), ids)
  np.testing.assert_array_equal(np.asarray(from_fp8), np.asarray(from_f32))
  reference = transformers.AutoModelForCausalLM.from_pretrained(f32_dir, dtype=torch.float32)
  err = _close(from_fp8, hf_tiny.hf_logits(reference.eval(), ids))
  print(f"fp8 checkpoint vs transformers on its dequantized weights: {err:.2e}")
  # The quantization really changed the weights: the original model's logits differ.
  assert not np.allclose(np.asarray(from_fp8), hf_tiny.hf_logits(hf_model, ids), atol=1e-3)


def _assert_quantized(w8, dense):
  """w8 is BlockFp8Weights.quantize(dense): the same codes, the scales (amax / 448) within
  one f32 rounding (compiled in the loader, XLA may multiply by 1/448 instead)."""
  want = BlockFp8Weights.quantize(dense, w8.block)
  np.testing.assert_array_equal(np.asarray(w8.codes).view(np.uint8),
                                np.asarray(want.codes).view(np.uint8))
  np.testing.assert_allclose(np.asarray(w8.scales), np.asarray(want.scales), rtol=2 ** -23)


# Experts kept as fp8 (expert_weights="fp8"). The exchange backend does not touch how the
# experts hold their weights: these run on "xla" only.

def test_fp8_experts_kept_give_the_dequantizing_load_logits(fp8_saved, rng, ep_mesh):
  """bf16 models of the fp8 checkpoint: the experts kept as its codes and scales (stored
  bits, block, sharded over the experts like the bf16 weights) give the logits of the default
  load, which holds bf16 copies: bit for bit on CPU, where the GEMM dequantizes them as the
  loader does (f32 product, rounded once to bf16)."""
  hf_model, fp8_dir, _, fp8 = fp8_saved
  ids = hf_tiny.random_ids(rng, batch=8, seq=3, vocab=hf_model.config.vocab_size)
  model = _load(fp8_dir, ep_mesh, "xla", jnp.bfloat16)
  kept = _load(fp8_dir, ep_mesh, "xla", jnp.bfloat16, expert_weights="fp8")
  w8 = kept.layers[1].mlp.experts.w_down_efd.get_value()
  dense = model.layers[1].mlp.experts.w_down_efd.get_value()
  assert isinstance(w8, BlockFp8Weights) and w8.block == FP8_BLOCK and w8.shape == dense.shape
  np.testing.assert_array_equal(np.asarray(w8.codes[3]).view(np.uint8),
                                fp8["model.layers.1.mlp.experts.3.down_proj.weight"].view(
                                    torch.uint8).numpy())
  for part in (w8.codes, w8.scales):
    assert part.sharding.spec[0] == dense.sharding.spec[0] == "ep"
    assert ([s.index[0] for s in part.addressable_shards]
            == [s.index[0] for s in dense.addressable_shards])
  np.testing.assert_array_equal(np.asarray(models.forward(kept, ids)),
                                np.asarray(models.forward(model, ids)))


def test_random_fp8_experts_equal_their_dequantized_copy(rng, ep_mesh):
  """f32 models (the exact exchange) with random weights: the fp8 model's experts are the
  dense model's draw quantized (BlockFp8Weights.quantize), and the dense model holding their
  dequantized copy gives its logits within f32 summation order (it runs gate and up as one
  GEMM of twice the width, the fp8 model as two); the unquantized draw is 1e-3 away."""
  config = dict(deepseek_v3_config(n_routed_experts=16, n_group=4, topk_group=2).to_dict(),
                quantization_config={"quant_method": "fp8", "weight_block_size": [16, 16]})
  build = lambda **kw: models.from_config(config, mesh=ep_mesh, backend="xla",
                                          dtype=jnp.float32, seed=3, **kw)
  fp8_model, model = build(expert_weights="fp8"), build()
  w8 = fp8_model.layers[1].mlp.experts.w_gate_edf.get_value()
  dense = model.layers[1].mlp.experts.w_gate_up_ed2f.get_value()[:, :, 0]  # the same draw
  assert w8.block == (16, 16) and w8.scales.shape == (16, 1, 2)  # 16 x 32 per expert
  _assert_quantized(w8, dense)

  ids = hf_tiny.random_ids(rng, batch=8, seq=3, vocab=config["vocab_size"])
  got = np.asarray(models.forward(fp8_model, ids))
  unquantized = np.asarray(models.forward(model, ids))
  for layer, layer_fp8 in zip(model.layers, fp8_model.layers):
    if layer.is_moe:
      dequantized = lambda name: getattr(layer_fp8.mlp.experts, name).get_value().dequantize(
          jnp.float32)
      experts = layer.mlp.experts
      for variable, w in ((experts.w_gate_up_ed2f, jnp.stack([dequantized("w_gate_edf"),
                                                               dequantized("w_up_edf")], axis=2)),
                          (experts.w_down_efd, dequantized("w_down_efd"))):
        variable.set_value(jax.device_put(w, variable.get_value().sharding))
  copy = np.asarray(models.forward(model, ids))
  assert np.max(np.abs(got - copy)) <= 1e-5 * np.max(np.abs(copy))
  err = np.max(np.abs(got - unquantized)) / np.max(np.abs(unquantized))
  print(f"fp8 experts vs their unquantized draw (f32): {err:.2e}")
  assert err > 1e-3


def test_dense_checkpoint_is_quantized_on_load(saved, ep_mesh):
  """expert_weights="fp8" from a checkpoint without fp8 tensors: the experts' weights as
  BlockFp8Weights.quantize makes them (128 x 128 blocks: no quantization_config)."""
  _, path = saved("qlora_dense1_norm_yarn_groups2")
  dense = _load(path, ep_mesh, "xla").layers[1].mlp.experts.w_gate_up_ed2f.get_value()[:, :, 1]
  w8 = _load(path, ep_mesh, "xla", expert_weights="fp8").layers[1].mlp.experts.w_up_edf.get_value()
  assert w8.block == (128, 128)
  _assert_quantized(w8, dense)


def test_fp8_checkpoint_of_another_block_is_refused(fp8_saved, ep_mesh):
  _, fp8_dir, _, _ = fp8_saved
  reader = loader.CheckpointReader(fp8_dir)
  config = dict(reader.config, quantization_config={"quant_method": "fp8",
                                                    "weight_block_size": [32, 32]})
  model = models._build(config, ep_mesh, "ep", "xla", jnp.float32, None, "fp8")
  with pytest.raises(CheckpointError, match=r"fp8 block \(16, 16\) for parameter "
                                            r"layers\.1\.mlp\.experts\.w_down_efd, the model "
                                            r"was built for \(32, 32\)"):
    loader.load_weights(model, reader, progress=False)


def test_bad_expert_weights_is_refused():
  with pytest.raises(ValueError, match=r"expert_weights must be one of \('dtype', 'fp8'\), "
                                       r"got 'int4'"):
    models.tiny("tiny-deepseek-v3", expert_weights="int4")


# --- full size, shapes only --------------------------------------------------------------

class _ShapesOnly:
  """A checkpoint reader that knows names and shapes only (check_checkpoint needs no data)."""
  path = "shapes-only"

  def __init__(self, shapes):
    self.shapes = shapes

  def has(self, name):
    return name in self.shapes

  def shape(self, name):
    return self.shapes[name]


def test_full_size_model_maps_onto_deepseek_v3_checkpoint_names(ep_mesh):
  """DeepSeek-V3's real dimensions (transformers' defaults: 61 layers, 256 experts, MLA
  1536/512/128/64/128), built abstract on all devices, match the names and shapes of its
  checkpoint: per-expert keys with fp8 scales and the MTP layer 61 as released, and
  transformers' fused expert layout."""
  config = DeepseekV3Config(rope_parameters=dict(YARN, factor=40.0,
                                                 original_max_position_embeddings=4096))
  with torch.device("meta"):
    fused = {k: tuple(v.shape) for k, v in hf.DeepseekV3ForCausalLM(config).state_dict().items()}
  per_expert = {}
  for name, shape in fused.items():
    if name.endswith("experts.gate_up_proj"):
      E, two_f, d = shape
      for e in range(E):
        for proj in ("gate_proj", "up_proj"):
          per_expert[name.replace("gate_up_proj", f"{e}.{proj}.weight")] = (two_f // 2, d)
    elif name.endswith("experts.down_proj"):
      for e in range(shape[0]):
        per_expert[name.replace("down_proj", f"{e}.down_proj.weight")] = shape[1:]
    else:
      per_expert[name] = shape
  for name, (rows, cols) in [(n, s) for n, s in per_expert.items() if n.endswith("proj.weight")]:
    per_expert[name + "_scale_inv"] = (-(-rows // 128), -(-cols // 128))
  per_expert["model.layers.61.eh_proj.weight"] = (7168, 14336)

  model = deepseek_v3.DeepseekV3ForCausalLM(config.to_dict(), rules=ShardingRules(ep_mesh),
                                            dtype=jnp.bfloat16)
  for shapes in (fused, per_expert):
    loader.check_checkpoint(model, _ShapesOnly(shapes))
  assert [layer.is_moe for layer in model.layers[:4]] == [False, False, False, True]
  experts = model.layers[3].mlp.experts.w_gate_up_ed2f.get_value()
  assert experts.shape == (256, 7168, 2, 2048) and experts.sharding.spec[0] == "ep"
  assert model.layers[3].self_attn.kv_b_proj.w_uk_hcn.get_value().sharding.is_fully_replicated
  assert model.layers[3].mlp.gate.w_de.get_value().dtype == jnp.float32
