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
  w = model.layers[0].mlp.experts.w_gate_up_ed2f[...]
  R = ep_mesh.devices.size
  assert [s.data.shape for s in w.addressable_shards] == [(8 // R, 32, 2, 16)] * R
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


class _ArrayReader:
  """A checkpoint reader over numpy arrays in memory."""

  def __init__(self, arrays):
    self.arrays = arrays

  def has(self, name):
    return name in self.arrays

  def shape(self, name):
    return self.arrays[name].shape

  def read(self, name, index):
    return self.arrays[name][index]


def test_head_rows_take_each_heads_block_head_major(rng):
  """MLA's kv_b_proj [H * (N + V), C]: a head's N key rows then its V value rows; HeadRows
  gives [H, C, rows] and reads a device's heads and rows only."""
  from jax_moe.models.checkpoint import CheckpointError, HeadRows

  heads, n, v, c = 4, 3, 5, 6
  w = rng.normal(size=(heads * (n + v), c)).astype(np.float32)
  reader = _ArrayReader({"kv_b.weight": w})
  keys, values = HeadRows("kv_b.weight", heads, 0, n), HeadRows("kv_b.weight", heads, n, v)
  assert keys.shape(reader) == (heads, c, n) and values.shape(reader) == (heads, c, v)
  everything = (slice(None),) * 3
  for h in range(heads):
    rows = w[h * (n + v):(h + 1) * (n + v)]
    np.testing.assert_array_equal(keys.read(reader, everything)[h], rows[:n].T)
    np.testing.assert_array_equal(values.read(reader, everything)[h], rows[n:].T)
  part = (slice(1, 3), slice(2, 5), slice(1, 4))  # heads 1-2, latent dims 2-4, value rows 1-3
  np.testing.assert_array_equal(values.read(reader, part),
                                values.read(reader, everything)[part])
  with pytest.raises(CheckpointError, match=r"32 rows do not hold 4 heads with rows \[3, 12\)"):
    HeadRows("kv_b.weight", heads, 3, 9).shape(reader)  # 8 rows a head
  with pytest.raises(CheckpointError, match=r"30 rows do not hold 4 heads"):
    keys.shape(_ArrayReader({"kv_b.weight": w[:30]}))


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_expert_pair_puts_gate_and_up_side_by_side(rng, layout):
  """routed_expert_sources(gate_up_paired=True): [E, D, 2, F] with gate at [..., 0, :] and up
  at [..., 1, :], from per-expert Linear weights or transformers' fused gate_up_proj; a
  device's slice of any axis reads only that slice; block-fp8 experts keep them apart."""
  from jax_moe.models.checkpoint import CheckpointError, ExpertPair, routed_expert_sources

  E, D, F = 3, 5, 4
  gate, up = (rng.normal(size=(E, F, D)).astype(np.float32) for _ in range(2))  # [E, out, in]
  if layout == "per_expert":
    arrays = {f"m.experts.{e}.{proj}.weight": w[e] for e in range(E)
              for proj, w in (("gate_proj", gate), ("up_proj", up))}
  else:
    arrays = {"m.experts.gate_up_proj": np.concatenate([gate, up], axis=1)}
  reader = _ArrayReader(arrays)
  sources = routed_expert_sources(("experts",), "m.experts", E, gate_up_paired=True)
  assert set(sources) == {("experts", "w_gate_up_ed2f"), ("experts", "w_down_efd")}
  pair = sources[("experts", "w_gate_up_ed2f")]
  assert pair.shape(reader) == (E, D, 2, F)
  whole = pair.read(reader, (slice(None),) * 4)
  np.testing.assert_array_equal(whole[:, :, 0], np.swapaxes(gate, 1, 2))
  np.testing.assert_array_equal(whole[:, :, 1], np.swapaxes(up, 1, 2))
  part = (slice(1, 3), slice(0, 4), slice(1, 2), slice(2, 4))  # experts 1-2, up, F 2-3
  np.testing.assert_array_equal(pair.read(reader, part), whole[part])
  apart = routed_expert_sources(("experts",), "m.experts", E, gate_up_paired=False)
  assert set(apart) == {("experts", n) for n in ("w_gate_edf", "w_up_edf", "w_down_efd")}
  if layout == "per_expert":  # an up of another width cannot sit beside gate
    arrays.update({f"m.experts.{e}.up_proj.weight": up[e, :3] for e in range(E)})
    with pytest.raises(CheckpointError, match="must match to sit side by side"):
      ExpertPair(apart[("experts", "w_gate_edf")], apart[("experts", "w_up_edf")]).shape(reader)


def test_random_weights_draw_the_gate_up_pair_at_its_fan_in(ep_mesh):
  """The [E, D, 2, F] pair is drawn with std D^-1/2 (its fan-in is D, not the pair axis), its
  two halves from different keys."""
  model = models.tiny("tiny-qwen3-moe", mesh=ep_mesh, backend="xla", dtype=jnp.float32, seed=3)
  layer = next(layer for layer in model.layers if layer.is_moe)
  pair = np.asarray(layer.mlp.experts.w_gate_up_ed2f[...])
  D = pair.shape[1]
  assert abs(pair.std() * D ** 0.5 - 1) < 0.1, pair.std()
  assert not np.array_equal(pair[:, :, 0], pair[:, :, 1])
