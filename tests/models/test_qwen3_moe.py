"""Qwen3-MoE against transformers on tiny random configs saved as safetensors.

f32 models use the "exact" MoE wire (moe.py), so the only differences from torch are f32
summation orders: logits agree within 1e-4 of their largest magnitude. Every test runs with
each MoE exchange backend available here, on all devices (8 CPU devices, or the GPUs).
"""

import jax.numpy as jnp
import numpy as np
import pytest
from transformers import Qwen3MoeConfig

from support.hf_tiny import hf_logits, qwen3_moe_kwargs, random_ids, save_tiny
from jax_moe import models

CONFIGS = {
    "untied": dict(),
    "norm_topk_tied": dict(norm_topk_prob=True, tie_word_embeddings=True),
    "sparse_step_2": dict(decoder_sparse_step=2, num_hidden_layers=3, norm_topk_prob=True),
    "mlp_only_fused": dict(mlp_only_layers=[0], fused_experts=True),
}


def _save(tmp_path, name, seed=0):
  kwargs = dict(CONFIGS[name])
  fused = kwargs.pop("fused_experts", False)
  return save_tiny(Qwen3MoeConfig(**qwen3_moe_kwargs(**kwargs)), tmp_path / name, seed=seed,
                   fused_experts=fused)


def _rel_error(out, ref):
  return float(np.abs(np.asarray(out) - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_f32_logits_match_transformers(tmp_path, rng, ep_mesh, backend, name):
  hf_model, path = _save(tmp_path, name)
  ids = random_ids(rng, batch=2, seq=6, vocab=hf_model.config.vocab_size)
  model = models.from_pretrained(path, mesh=ep_mesh, backend=backend, dtype=jnp.float32,
                                 progress=False)
  assert _rel_error(models.forward(model, ids), hf_logits(hf_model, ids)) < 1e-4


def test_expert_parallel_equals_one_device(tmp_path, rng, mesh_of, ep_mesh, backend):
  """f32: the same numbers up to summation order. (bf16 EP against a bound on the MoE block
  alone is in test_moe_block.py: through several layers, bf16 rounding flips that depend on
  XLA's fusion of each sharding compound, so the model-level bf16 gap has no tight bound.)"""
  _, path = _save(tmp_path, "untied")
  ids = jnp.asarray(random_ids(rng, batch=4, seq=5, vocab=96))
  if ep_mesh.devices.size == 1:
    pytest.skip("needs more than one device")
  one, many = (models.forward(models.from_pretrained(path, mesh=mesh, backend=backend,
                                                     dtype=jnp.float32, progress=False), ids)
               for mesh in (mesh_of(1), ep_mesh))
  assert _rel_error(many, np.asarray(one)) <= 1e-6


def test_cached_decode_equals_full_forward(tmp_path, rng, ep_mesh, backend):
  _, path = _save(tmp_path, "sparse_step_2")
  model = models.from_pretrained(path, mesh=ep_mesh, backend=backend, dtype=jnp.float32,
                                 progress=False)
  ids = jnp.asarray(random_ids(rng, batch=2, seq=7, vocab=96))
  full = np.asarray(models.forward(model, ids))
  cache = model.init_cache(batch=2, max_len=9)
  logits, cache = models.forward(model, ids[:, :4], cache)
  steps = [np.asarray(logits)]
  for t in range(4, 7):
    logits, cache = models.forward(model, ids[:, t:t + 1], cache)
    steps.append(np.asarray(logits))
  assert int(cache.index) == 7
  assert _rel_error(np.concatenate(steps, axis=1), full) < 1e-5
