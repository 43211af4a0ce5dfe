"""Rotary position embedding for DeepSeek-V3: plain RoPE or YaRN, interleaved or half-split.

Follows the math of transformers' DeepseekV3RotaryEmbedding (`_compute_yarn_parameters`)
and DeepseekV3Attention (`yarn_apply_mscale`, `apply_rotary_pos_emb[_interleave]`), so a
Hugging Face checkpoint gives the same logits here. Only the rotary part of each head
(`qk_rope_head_dim` wide) is rotated; frequencies are computed once on the host in f32,
exactly as transformers does, so positions far into the context agree too.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe.models import layers

_SUPPORTED_ROPE_TYPES = ("default", "yarn")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """The rotary settings of one model, normalised from either config.json spelling.

  `inv_freq_f` has one f32 value per rotated pair (F = rope_dim // 2), kept as a tuple of
  Python floats (exact for f32) so the settings hash: models keep them as static attributes.
  `cos_sin_scale` multiplies
  cos and sin (YaRN's attention factor); `softmax_scale_factor` multiplies the usual
  1/sqrt(qk_head_dim) softmax scale (DeepSeek's mscale_all_dim correction, squared because
  it stands for scaling both q and k).
  """
  inv_freq_f: tuple[float, ...]
  cos_sin_scale: float
  softmax_scale_factor: float
  interleaved: bool


def _mscale(factor: float, mscale: float = 1.0) -> float:
  # YaRN's attention temperature: 0.1 * m * ln(s) + 1 for a context extension s > 1.
  if factor <= 1:
    return 1.0
  return 0.1 * mscale * math.log(factor) + 1.0


def rope_parameters(config: Mapping[str, Any]) -> dict[str, Any]:
  """The rope settings of a config.json dict as one dict with `rope_type` and `rope_theta`.

  transformers >= 5 writes `rope_parameters`; DeepSeek's own checkpoints (and older
  transformers) write `rope_theta` at top level and `rope_scaling` with `type` or `rope_type`.
  """
  params = config.get("rope_parameters") or config.get("rope_scaling") or {}
  params = dict(params)
  if "rope_type" not in params:
    params["rope_type"] = params.pop("type", "default")
  params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
  if params["rope_type"] not in _SUPPORTED_ROPE_TYPES:
    raise ValueError(f"rope_parameters.rope_type must be one of {_SUPPORTED_ROPE_TYPES}, "
                     f"got {params['rope_type']!r}")
  return params


def _yarn_inv_freq(params: Mapping[str, Any], dim: int, factor: float) -> np.ndarray:
  """YaRN frequencies: interpolated (divided by `factor`) for the slow dims, extrapolated
  (unchanged) for the fast ones, with a linear ramp between the correction-range bounds."""
  base = float(params["rope_theta"])
  original_max = params["original_max_position_embeddings"]
  beta_fast = params.get("beta_fast") or 32
  beta_slow = params.get("beta_slow") or 1

  def correction_dim(num_rotations):
    # The pair index whose wavelength fits `num_rotations` times into the original context.
    return dim * math.log(original_max / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

  low, high = correction_dim(beta_fast), correction_dim(beta_slow)
  if params.get("truncate", True):
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, dim - 1)
  if low == high:
    high += 0.001  # a zero-width ramp would divide by zero
  # f32 throughout, as transformers computes it, so the frequencies agree to the bit.
  pos_freqs_f = np.float32(base) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
  extrapolated_f = np.float32(1.0) / pos_freqs_f
  interpolated_f = np.float32(1.0) / (np.float32(factor) * pos_freqs_f)
  ramp_f = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low))
                   / np.float32(high - low), 0, 1).astype(np.float32)
  extrapolation_share_f = np.float32(1) - ramp_f
  return (interpolated_f * (1 - extrapolation_share_f)
          + extrapolated_f * extrapolation_share_f).astype(np.float32)


def rope_scaling_from_config(config: Mapping[str, Any]) -> RopeScaling:
  """RopeScaling for a DeepSeek-V3 config.json dict (rope width = qk_rope_head_dim)."""
  params = rope_parameters(config)
  dim = int(config["qk_rope_head_dim"])
  if dim % 2:
    raise ValueError(f"qk_rope_head_dim must be even, got {dim}")
  interleaved = bool(config.get("rope_interleave", True))
  if params["rope_type"] == "default":
    inv_freq_f = layers.rope_inv_freq(dim, params["rope_theta"])
    return RopeScaling(tuple(inv_freq_f.tolist()), 1.0, 1.0, interleaved)

  factor = params.get("factor")
  if factor is None:
    # DeepSeek's convention when only the two context lengths are given.
    factor = config["max_position_embeddings"] / params["original_max_position_embeddings"]
  mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
  cos_sin_scale = params.get("attention_factor")
  if cos_sin_scale is None:
    if mscale and mscale_all_dim:
      cos_sin_scale = _mscale(factor, mscale) / _mscale(factor, mscale_all_dim)
    else:
      cos_sin_scale = _mscale(factor)
  softmax_scale_factor = _mscale(factor, mscale_all_dim) ** 2 if mscale_all_dim else 1.0
  return RopeScaling(tuple(_yarn_inv_freq(params, dim, factor).tolist()), float(cos_sin_scale),
                     float(softmax_scale_factor), interleaved)


def rope_cos_sin(positions_bt: jax.Array, rope: RopeScaling) -> tuple[jax.Array, jax.Array]:
  """cos and sin [B, T, F] in f32 for integer positions [B, T]."""
  inv_freq_f = jnp.asarray(rope.inv_freq_f, jnp.float32)
  angles_btf = positions_bt.astype(jnp.float32)[..., None] * inv_freq_f
  return jnp.cos(angles_btf) * rope.cos_sin_scale, jnp.sin(angles_btf) * rope.cos_sin_scale


def apply_rope(x_bthr: jax.Array, cos_btf: jax.Array, sin_btf: jax.Array,
               interleaved: bool) -> jax.Array:
  """Rotates the rope dims R = 2F of x [B, T, heads, R] by the angles of each position.

  Interleaved (DeepSeek's layout): pairs are (x0, x1), (x2, x3), ...; the result is written
  de-interleaved, all first members then all second members, as transformers does. Queries
  and keys get the same permutation, so their dot products are those of the interleaved
  rotation. Half-split: pairs are (x_i, x_{i+F}).
  """
  cos_bt1f, sin_bt1f = cos_btf[:, :, None, :], sin_btf[:, :, None, :]
  if interleaved:
    first, second = x_bthr[..., 0::2], x_bthr[..., 1::2]
  else:
    half = x_bthr.shape[-1] // 2
    first, second = x_bthr[..., :half], x_bthr[..., half:]
  rotated = jnp.concatenate([first * cos_bt1f - second * sin_bt1f,
                             second * cos_bt1f + first * sin_bt1f], axis=-1)
  return rotated.astype(x_bthr.dtype)
