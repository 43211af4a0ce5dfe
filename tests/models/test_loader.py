"""Checkpoint loading: sharded and single-file layouts, and clear errors for bad checkpoints."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from transformers import Qwen3MoeConfig

from support.hf_tiny import qwen3_moe_kwargs, random_ids, save_tiny
from jax_moe import models
from jax_moe.models import base


@pytest.fixture
def checkpoint(tmp_path):
  _, path = save_tiny(Qwen3MoeConfig(**qwen3_moe_kwargs()), tmp_path / "ckpt")
  return path


def _edit_config(path, **changes):
  config_path = os.path.join(path, "config.json")
  with open(config_path) as f:
    config = json.load(f)
  config.update(changes)
  with open(config_path, "w") as f:
    json.dump(config, f)


def test_sharded_checkpoint_loads_like_single_file(tmp_path, rng, ep_mesh, checkpoint):
  _, sharded = save_tiny(Qwen3MoeConfig(**qwen3_moe_kwargs()), tmp_path / "sharded",
                         max_shard_size="20KB")
  assert os.path.isfile(os.path.join(sharded, "model.safetensors.index.json"))
  ids = random_ids(rng, 2, 4, 96)
  single_logits, sharded_logits = (
      np.asarray(models.forward(models.from_pretrained(p, mesh=ep_mesh, dtype=jnp.float32,
                                                       progress=False), ids))
      for p in (checkpoint, sharded))
  np.testing.assert_array_equal(single_logits, sharded_logits)


def test_weights_are_sharded_over_experts(ep_mesh, checkpoint):
  model = models.from_pretrained(checkpoint, mesh=ep_mesh, dtype=jnp.float32, progress=False)
  w = model.layers[0].mlp.experts.w_gate_edf[...]
  R = ep_mesh.devices.size
  assert [s.data.shape for s in w.addressable_shards] == [(8 // R, 32, 16)] * R
  assert model.embed_tokens.table_vd[...].sharding.is_fully_replicated


def test_missing_tensor(checkpoint):
  file = os.path.join(checkpoint, "model.safetensors")
  tensors = load_file(file)
  del tensors["model.layers.1.mlp.experts.3.up_proj.weight"]
  save_file(tensors, file, metadata={"format": "pt"})
  with pytest.raises(models.CheckpointError,
                     match=r"missing tensor 'model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight'"):
    models.from_pretrained(checkpoint, progress=False)


def test_shape_mismatch(checkpoint):
  _edit_config(checkpoint, moe_intermediate_size=24)
  with pytest.raises(models.CheckpointError, match=r"down_proj.weight' gives shape \(8, 16, 32\) for parameter "
                     r"layers\.0\.mlp\.experts\.w_down_efd, the config expects \(8, 24, 32\)"):
    models.from_pretrained(checkpoint, progress=False)


def test_unknown_model_type(checkpoint):
  _edit_config(checkpoint, model_type="llama")
  with pytest.raises(models.CheckpointError, match="unknown model_type 'llama'"):
    models.from_pretrained(checkpoint, progress=False)


def test_not_a_model_directory(tmp_path):
  with pytest.raises(models.CheckpointError, match="no config.json"):
    models.from_pretrained(str(tmp_path), progress=False)
  (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
  with pytest.raises(models.CheckpointError, match="neither model.safetensors"):
    models.from_pretrained(str(tmp_path), progress=False)


def test_registered_class_missing_from_build(monkeypatch):
  monkeypatch.setitem(base.MODEL_TYPES, "qwen3_moe", ("jax_moe.models.no_such_module", "X"))
  with pytest.raises(NotImplementedError, match="not available in this build"):
    base.model_class("qwen3_moe")
