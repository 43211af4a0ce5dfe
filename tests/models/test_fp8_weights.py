"""DeepSeek block-fp8 weight dequantization against a per-element numpy reference."""

import ml_dtypes
import numpy as np
import pytest

from jax_moe.models import fp8_weights


def _reference_dequant(codes, scales, block):
  # Element by element: the scale of the block that holds (r, c).
  out = np.empty(codes.shape, np.float32)
  for r in range(codes.shape[0]):
    for c in range(codes.shape[1]):
      out[r, c] = np.float32(codes[r, c]) * scales[r // block[0], c // block[1]]
  return out


def _random_fp8(rng, shape, block):
  codes = rng.normal(0, 100, shape).clip(-448, 448).astype(ml_dtypes.float8_e4m3fn)
  scales = rng.uniform(1e-4, 1e-2, (-(-shape[0] // block[0]), -(-shape[1] // block[1])))
  return codes, scales.astype(np.float32)


@pytest.mark.parametrize("shape,block", [((256, 128), (128, 128)),   # whole blocks
                                         ((200, 300), (128, 128)),   # partial last blocks both dims
                                         ((7, 130), (128, 128)),     # smaller than one block
                                         ((33, 17), (16, 8))])       # other block shapes
def test_dequant_matches_reference(rng, shape, block):
  codes, scales = _random_fp8(rng, shape, block)
  got = fp8_weights.dequantize_block_fp8(codes, scales, block)
  assert got.dtype == np.float32 and got.shape == shape
  np.testing.assert_array_equal(got, _reference_dequant(codes, scales, block))


def test_dequant_bf16_output_is_the_rounded_f32(rng):
  codes, scales = _random_fp8(rng, (130, 140), (128, 128))
  got = fp8_weights.dequantize_block_fp8(codes, scales, dtype=ml_dtypes.bfloat16)
  want = _reference_dequant(codes, scales, (128, 128)).astype(ml_dtypes.bfloat16)
  np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))


def test_bad_scale_shape_names_expected_shape(rng):
  codes, scales = _random_fp8(rng, (200, 300), (128, 128))
  with pytest.raises(ValueError, match=r"scale_inv must have shape \(2, 3\)"):
    fp8_weights.dequantize_block_fp8(codes, scales[:, :2])
  with pytest.raises(ValueError, match="must be 2-D"):
    fp8_weights.dequantize_block_fp8(codes[None], scales)


def test_checkpoint_tensors_dequantized_and_scales_dropped(rng):
  codes, scales = _random_fp8(rng, (150, 40), (128, 128))
  norm = rng.normal(size=40).astype(np.float32)
  out = fp8_weights.dequantize_checkpoint_tensors(
      {"a.weight": codes, "a.weight_scale_inv": scales, "norm.weight": norm})
  assert sorted(out) == ["a.weight", "norm.weight"]
  np.testing.assert_array_equal(out["a.weight"], _reference_dequant(codes, scales, (128, 128)))
  assert out["norm.weight"] is norm


def test_checkpoint_tensors_mismatched_pairs_raise(rng):
  codes, scales = _random_fp8(rng, (8, 8), (128, 128))
  with pytest.raises(KeyError, match="a.weight_scale_inv but not the weight"):
    fp8_weights.dequantize_checkpoint_tensors({"a.weight_scale_inv": scales})
  with pytest.raises(KeyError, match="fp8 tensor a.weight without a.weight_scale_inv"):
    fp8_weights.dequantize_checkpoint_tensors({"a.weight": codes})


def test_block_size_from_config():
  assert fp8_weights.block_size_from_config({}) is None
  cfg = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [64, 32]}}
  assert fp8_weights.block_size_from_config(cfg) == (64, 32)
  with pytest.raises(ValueError, match="quant_method must be 'fp8'"):
    fp8_weights.block_size_from_config({"quantization_config": {"quant_method": "awq"}})
