"""DeepSeek fp8 checkpoint weights: e4m3 codes with one f32 scale per 128x128 block.

DeepSeek-V3's released checkpoint stores each quantized linear weight `W [out, in]` as
`...weight` (float8_e4m3fn) plus `...weight_scale_inv` (f32, [ceil(out/128), ceil(in/128)]):
W = codes * scale_inv of the block holding the element. The last block along a dim is
partial when that dim is not a multiple of 128; its scale covers only the elements present.
Done on the host in numpy, tensor by tensor, before the weights go to devices.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

SCALE_SUFFIX = "_scale_inv"
DEFAULT_BLOCK = (128, 128)


def block_size_from_config(config: Mapping[str, Any]) -> tuple[int, int] | None:
  """The (rows, cols) block of a config.json's fp8 `quantization_config`, or None if the
  checkpoint is not fp8 block-quantized."""
  quant = config.get("quantization_config")
  if not quant:
    return None
  if quant.get("quant_method") != "fp8":
    raise ValueError("quantization_config.quant_method must be 'fp8' (DeepSeek block fp8), "
                     f"got {quant.get('quant_method')!r}")
  block = quant.get("weight_block_size", DEFAULT_BLOCK)
  if len(block) != 2 or min(block) < 1:
    raise ValueError("quantization_config.weight_block_size must be two positive ints, "
                     f"got {block}")
  return int(block[0]), int(block[1])


def dequantize_block_fp8(w_oi: np.ndarray, scale_inv_OI: np.ndarray,
                         block: tuple[int, int] = DEFAULT_BLOCK,
                         dtype: Any = np.float32) -> np.ndarray:
  """W [out, in] in `dtype` from fp8 codes [out, in] and block scales [ceil(out/bo), ceil(in/bi)].

  The product is formed in f32 (exact for e4m3 codes times an f32 scale up to one rounding)
  and only then cast to `dtype`.
  """
  if w_oi.ndim != 2:
    raise ValueError(f"dequantize_block_fp8: w must be 2-D [out, in], got shape {w_oi.shape}")
  block_o, block_i = block
  rows, cols = w_oi.shape
  expected = (-(-rows // block_o), -(-cols // block_i))
  if tuple(scale_inv_OI.shape) != expected:
    raise ValueError(f"dequantize_block_fp8: scale_inv must have shape {expected} for w of shape "
                     f"{w_oi.shape} and block {block}, got {tuple(scale_inv_OI.shape)}")
  # Each block's scale spread over its rows and cols, then the partial last blocks cropped.
  scale_oi = np.repeat(np.repeat(scale_inv_OI.astype(np.float32), block_o, axis=0),
                       block_i, axis=1)[:rows, :cols]
  return (w_oi.astype(np.float32) * scale_oi).astype(dtype)


def dequantize_checkpoint_tensors(tensors: Mapping[str, np.ndarray],
                                  block: tuple[int, int] = DEFAULT_BLOCK,
                                  dtype: Any = np.float32) -> dict[str, np.ndarray]:
  """Replaces each `X.weight` that has an `X.weight_scale_inv` by its dequantized value and
  drops the scales; other tensors pass through unchanged. An fp8 tensor without a scale or

  a scale without its weight means a truncated or mismatched shard set: an error, not a skip.
  """
  out = {}
  for name, value in tensors.items():
    if name.endswith(SCALE_SUFFIX):
      if name[:-len(SCALE_SUFFIX)] not in tensors:
        raise KeyError(f"checkpoint has {name} but not the weight it scales "
                       f"({name[:-len(SCALE_SUFFIX)]})")
      continue
    scale = tensors.get(name + SCALE_SUFFIX)
    if scale is None and "float8" in np.dtype(value.dtype).name:
      raise KeyError(f"checkpoint has fp8 tensor {name} without {name + SCALE_SUFFIX}")
    out[name] = value if scale is None else dequantize_block_fp8(value, scale, block, dtype)
  return out
