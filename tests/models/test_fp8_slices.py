"""CheckpointReader.read of a block-fp8 weight: each slice is dequantized from the blocks it
touches only, and equals the same slice of the whole dequantized tensor (bit for bit)."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from jax_moe.models import fp8_weights, loader


@pytest.fixture
def fp8_checkpoint(tmp_path, rng):
  w = torch.from_numpy(rng.normal(0, 1, (300, 200)).astype(np.float32)).to(torch.float8_e4m3fn)
  scale = torch.from_numpy(rng.uniform(0.5, 2, (3, 2)).astype(np.float32))
  save_file({"w.weight": w, "w.weight_scale_inv": scale}, str(tmp_path / "model.safetensors"))
  config = {"model_type": "deepseek_v3",
            "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
  (tmp_path / "config.json").write_text(json.dumps(config))
  return loader.CheckpointReader(str(tmp_path))


@pytest.mark.parametrize("index", [
    (slice(None), slice(None)), (slice(0, 150), slice(None)), (slice(150, 300), slice(100, 200)),
    (slice(127, 129), slice(127, 129)), (slice(256, 300), slice(0, 1)), (slice(10, 10), slice(None)),
])
def test_fp8_slice_equals_slice_of_whole_dequantized(fp8_checkpoint, index):
  full = fp8_weights.dequantize_block_fp8(fp8_checkpoint._array("w.weight"),
                                          fp8_checkpoint._array("w.weight_scale_inv"))
  got = fp8_checkpoint.read("w.weight", index)
  np.testing.assert_array_equal(got, full[index])


def test_fp8_slice_reads_only_its_blocks(fp8_checkpoint, monkeypatch):
  shapes = []
  real = fp8_weights.dequantize_block_fp8
  monkeypatch.setattr(fp8_weights, "dequantize_block_fp8",
                      lambda w, s, *a, **k: (shapes.append(w.shape), real(w, s, *a, **k))[1])
  fp8_checkpoint.read("w.weight", (slice(130, 200), slice(0, 100)))
  assert shapes == [(128, 128)]
