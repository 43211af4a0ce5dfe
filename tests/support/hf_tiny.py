"""Shared helpers for model parity tests: tiny random transformers models saved as safetensors.

    hf_model, path = save_tiny(Qwen3MoeConfig(**qwen3_moe_kwargs(norm_topk_prob=True)), tmp_path)
    ids = random_ids(rng, batch=2, seq=7, vocab=hf_model.config.vocab_size)
    ref = hf_logits(hf_model, ids)          # [B, S, V] f32 numpy

`save_tiny` builds the model with torch's fp32 CPU init under a fixed seed and writes it with
`save_pretrained` (safetensors). `fused_experts=True` keeps transformers' in-memory expert
layout (`save_original_format=False`: `experts.gate_up_proj` [E, 2F, D],
`experts.down_proj` [E, D, F]) instead of the per-expert keys the default writes.
"""

import json
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf


def qwen3_moe_kwargs(**overrides) -> dict:
  """A Qwen3-MoE small enough for CPU tests; 8 experts so 8 devices hold one each."""
  kwargs = dict(vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
                max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False)
  kwargs.update(overrides)
  return kwargs


def save_tiny(config, directory, seed: int = 0, fused_experts: bool = False,
              init_std: float | None = 0.1, max_shard_size: str | None = None):
  """Builds AutoModelForCausalLM.from_config(config) in fp32 and saves it to `directory`.

  init_std: re-draws every weight matrix from N(0, init_std^2) (norm weights around 1) so
  the tiny model has routing and logits spread out enough to compare (HF's 0.02 init gives
  near-uniform router probabilities, i.e. near-ties in the top-k). max_shard_size (e.g.
  "20KB") splits the checkpoint into shards with a model.safetensors.index.json.
  """
  torch.manual_seed(seed)
  model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
  if init_std is not None:
    with torch.no_grad():
      for name, p in model.named_parameters():
        if p.ndim == 1:
          p.copy_(1.0 + 0.1 * torch.randn_like(p))
        else:
          p.normal_(0.0, init_std)
  extra = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
  model.save_pretrained(str(directory), save_original_format=not fused_experts, **extra)
  return model, str(directory)


def random_ids(rng: np.random.Generator, batch: int, seq: int, vocab: int) -> np.ndarray:
  return rng.integers(0, vocab, size=(batch, seq), dtype=np.int32)


def prefill_and_step(model, ids: np.ndarray) -> list[np.ndarray]:
  """f32 logits of a jax_moe model's full forward, and of a prefill of all but the last
  token then one cached step (the option tests compare these with the option on and off)."""
  from jax_moe import models

  B, S = ids.shape
  full = models.forward(model, ids)
  logits, cache = models.forward(model, ids[:, :-1], model.init_cache(B, S))
  step, _ = models.forward(model, ids[:, -1:], cache)
  return [np.asarray(a, np.float32) for a in (full, logits, step)]


def hf_logits(model, ids: np.ndarray) -> np.ndarray:
  with torch.no_grad():
    return model(torch.from_numpy(ids.astype(np.int64))).logits.float().numpy()


def hf_greedy(model, ids: np.ndarray, max_new_tokens: int):
  """transformers' greedy generate: (tokens [B, S + N], per-step logits [N, B, V])."""
  with torch.no_grad():
    out = model.generate(torch.from_numpy(ids.astype(np.int64)), max_new_tokens=max_new_tokens,
                         min_new_tokens=max_new_tokens, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
  return out.sequences.numpy(), np.stack([l.float().numpy() for l in out.logits])


# ------------------------------------------------------------------- DeepSeek-V3
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 16, "beta_fast": 32, "beta_slow": 1,
        "mscale": 0.9, "mscale_all_dim": 0.707}


def deepseek_v3_config(**overrides):
  """A DeepseekV3Config small enough for CPU tests; attn 'eager' so the math is plain."""
  kw = dict(vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
            n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
            n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=12, kv_lora_rank=16,
            qk_rope_head_dim=8, qk_nope_head_dim=6, v_head_dim=10, max_position_embeddings=64,
            rope_parameters=dict(YARN), num_nextn_predict_layers=0)
  kw.update(overrides)
  config = DeepseekV3Config(**kw)
  config._attn_implementation = "eager"
  return config


def save_deepseek_v3(directory, seed, **overrides):
  """A tiny transformers DeepSeek-V3 saved as safetensors, with a random selection bias
  (a buffer, so save_tiny's re-draw of the parameters leaves it at zero)."""
  model, path = save_tiny(deepseek_v3_config(**overrides), directory, seed=seed)
  with torch.no_grad():
    for layer in model.model.layers:
      if isinstance(layer.mlp, hf.DeepseekV3MoE):
        layer.mlp.gate.e_score_correction_bias.normal_(0, 0.3)
  model.save_pretrained(path)
  return model, path


# ------------------------------------------------------------------- greedy comparisons
def first_near_tie(step_logits_nbv, tolerance):
  """Per row, the first decode step whose top-2 logits are closer than tolerance (or N)."""
  top2 = np.sort(step_logits_nbv, axis=-1)[..., -2:]
  near = (top2[..., 1] - top2[..., 0]) < tolerance                   # [N, B]
  return np.where(near.any(0), near.argmax(0), near.shape[0])


def quantize_block_fp8(w_oi, block):
  """DeepSeek's format from a torch f32 weight: (e4m3 codes, scale_inv [ceil(O/bo), ceil(I/bi)])."""
  rows, cols = w_oi.shape
  bo, bi = block
  padded = torch.nn.functional.pad(w_oi, (0, -cols % bi, 0, -rows % bo))
  blocks = padded.reshape(padded.shape[0] // bo, bo, padded.shape[1] // bi, bi)
  scale_inv = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12) / 448.0
  scale_oi = scale_inv.repeat_interleave(bo, 0).repeat_interleave(bi, 1)[:rows, :cols]
  codes = (w_oi / scale_oi).to(torch.float8_e4m3fn)
  return codes, scale_inv, codes.float() * scale_oi


def is_quantized_in_deepseek(name, tensor):
  # DeepSeek-V3 keeps embeddings, the output head, norms and the router in high precision.
  return (tensor.ndim == 2 and name.endswith("proj.weight") and "embed" not in name
          and "lm_head" not in name)


def save_block_fp8_copy(path, directory, block) -> str:
  """The checkpoint at `path` with every weight DeepSeek-V3 quantizes as block-fp8 codes and
  scale_inv (its `quantization_config`), saved in `directory`."""
  from safetensors.torch import load_file, save_file

  fp8 = {}
  for name, w in load_file(f"{path}/model.safetensors").items():
    if is_quantized_in_deepseek(name, w):
      fp8[name], fp8[name + "_scale_inv"], _ = quantize_block_fp8(w, block)
    else:
      fp8[name] = w
  directory = Path(directory)
  save_file({k: v.contiguous() for k, v in fp8.items()}, str(directory / "model.safetensors"),
            metadata={"format": "pt"})
  config = json.load(open(f"{path}/config.json"))
  config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                   "activation_scheme": "dynamic",
                                   "weight_block_size": list(block)}
  json.dump(config, open(directory / "config.json", "w"))
  return str(directory)
