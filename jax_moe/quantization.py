"""fp8 (e4m3fn) block quantization along the hidden dimension.

Every backend quantizes exactly like this (docs/semantics.md), so dispatched codes and
scales agree bit for bit across backends.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

FP8_MAX = 448.0
AMAX_FLOOR = 1e-4
# The f32 nearest to 1/448. XLA turns `amax / 448` into a multiply by this rounded
# reciprocal, so the spec uses the multiply and CUDA kernels use the same constant.
INV_FP8_MAX = np.float32(1.0 / 448.0)


def _fp8_max_over(amax: jax.Array) -> jax.Array:
  """448 / amax rounded to nearest even, for normal positive f32 `amax`, bit-exact everywhere.

  XLA's f32 division is not correctly rounded on every platform (on GPU one ulp off at
  times, which moves fp8 codes at ties), so the quotient's 24 significand bits come from a
  restoring long division of the significands in uint32, then one round-to-nearest-even.
  448 = 0xE00000 * 2^-15 and amax = m * 2^(e - 150) with m = 1.f in 24 bits.
  """
  bits = jax.lax.bitcast_convert_type(amax, jnp.uint32)
  m = (bits & 0x7FFFFF) | 0x800000
  # 448 = 1.75 * 2^8 and amax = 1.f * 2^(e_biased - 127): the quotient's biased exponent is
  # 8 - (e_biased - 127) + 127 before the significand ratio is normalised.
  exponent = 262 - ((bits >> 23) & 0xFF).astype(jnp.int32)
  numerator = jnp.uint32(0xE00000)
  below = numerator < m  # significand ratio in (0.5, 1): shift one place
  remainder = jnp.where(below, numerator << 1, numerator)
  exponent = exponent - below.astype(jnp.int32)
  quotient = jnp.zeros_like(m)
  for _ in range(24):
    bit = remainder >= m
    quotient = (quotient << 1) | bit.astype(jnp.uint32)
    remainder = (remainder - jnp.where(bit, m, 0)) << 1  # remainder < 2m < 2^25
  round_up = (remainder > m) | ((remainder == m) & ((quotient & 1) == 1))
  quotient = quotient + round_up.astype(jnp.uint32)
  carry = quotient >> 24  # rounding overflowed into a 25th bit: 2.0 * 2^e
  exponent = exponent + carry.astype(jnp.int32)
  out = (exponent.astype(jnp.uint32) << 23) | (quotient >> carry) & 0x7FFFFF
  return jax.lax.bitcast_convert_type(out, jnp.float32)


def _round_to_e4m3(v: jax.Array) -> jax.Array:
  """Rounds f32 `v` (|v| <= 448) to the nearest e4m3fn value, ties to even, staying in f32.

  Done with exact f32 arithmetic because XLA's own f32 -> f8 conversion is not the same on
  every platform (on GPU it can round through f16 first, and double rounding moves ties);
  the cast that follows is then exact everywhere. The e4m3 quantum at |v| in [2^e, 2^(e+1))
  is 2^(e-3), with e clamped to the subnormal floor -6; scaling by a power of two is exact.
  """
  bits = jax.lax.bitcast_convert_type(v, jnp.int32)
  exponent = jnp.maximum(((bits >> 23) & 0xFF) - 127, -6)
  to_units = jax.lax.bitcast_convert_type((127 + 3 - exponent) << 23, jnp.float32)
  to_value = jax.lax.bitcast_convert_type((127 - 3 + exponent) << 23, jnp.float32)
  return jax.lax.round(v * to_units, jax.lax.RoundingMethod.TO_NEAREST_EVEN) * to_value


def _blocks(x: jax.Array, block_size: int) -> jax.Array:
  if x.shape[-1] % block_size:
    raise ValueError(f"quantize_fp8: x.shape[-1] ({x.shape[-1]}) must be a multiple of "
                     f"block_size ({block_size})")
  return x.reshape(*x.shape[:-1], x.shape[-1] // block_size, block_size)


def quantize_fp8(x: jax.Array, block_size: int = 128) -> tuple[jax.Array, jax.Array]:
  """Returns `(q, scales)`: q float8_e4m3fn with x's shape, scales f32 [..., hidden // block_size]."""
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"quantize_fp8: x must be floating point, got {x.dtype}")
  xb = _blocks(x.astype(jnp.float32), block_size)
  # NaN is tracked by hand: XLA may lower max/min to NaN-dropping instructions (XLA:CPU does
  # inside larger fusions), while the spec's max and clip keep NaN (docs/semantics.md).
  amax = jnp.maximum(jnp.max(jnp.abs(xb), axis=-1), np.float32(AMAX_FLOOR))
  amax = jnp.where(jnp.any(jnp.isnan(xb), axis=-1), jnp.float32(jnp.nan), amax)
  scales = amax * INV_FP8_MAX
  # 448 / amax of a non-finite amax: 0 for +Inf, NaN for NaN (the long division wants normal
  # f32; the floor keeps a finite amax normal).
  multiplier = jnp.where(jnp.isfinite(amax), _fp8_max_over(amax),
                         jnp.where(jnp.isnan(amax), jnp.float32(jnp.nan), jnp.float32(0)))
  scaled = xb * multiplier[..., None]
  rounded = _round_to_e4m3(jnp.clip(scaled, -FP8_MAX, FP8_MAX))
  # Every NaN is the one NaN code 0x7f (a product's NaN may carry a sign bit: 0xff).
  q = jnp.where(jnp.isnan(scaled), jnp.float32(jnp.nan), rounded).astype(jnp.float8_e4m3fn)
  return q.reshape(x.shape), scales


DEQUANTIZE_TARGET = "jax_moe_dequantize_fp8"  # ffi/cuda/dequantize_ffi.cc
DEQUANTIZE_IMPLEMENTATIONS = ("auto", "xla", "cuda")


def _check_dequantize(q: jax.Array, scales: jax.Array) -> None:
  if q.ndim < 1 or q.shape[:-1] != scales.shape[:-1] or scales.shape[-1] == 0 or (
      q.shape[-1] % scales.shape[-1]):
    raise ValueError(f"dequantize_fp8: scales shape {scales.shape} does not tile q shape "
                     f"{q.shape} along the last axis")


def _dequantize_xla(q: jax.Array, scales: jax.Array, dtype) -> jax.Array:
  """The reference: f32(q) * scale per block (one f32 multiply), cast to `dtype`."""
  block_size = q.shape[-1] // scales.shape[-1]
  xb = _blocks(q.astype(jnp.float32), block_size) * scales.astype(jnp.float32)[..., None]
  return xb.reshape(q.shape).astype(dtype)


def _cuda_blocker(q: jax.Array, scales: jax.Array, dtype) -> str | None:
  """Why the CUDA kernel cannot serve this call (None when it can)."""
  from jax_moe import native

  if not native.has_cuda():
    return "the native module has no CUDA kernels (jax_moe.build_info())"
  if q.dtype != jnp.float8_e4m3fn or scales.dtype != jnp.float32:
    return f"it takes float8_e4m3fn q and float32 scales, got {q.dtype} and {scales.dtype}"
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
    return f"it writes bfloat16 or float32, got dtype {jnp.dtype(dtype)}"
  hidden, block_size = q.shape[-1], q.shape[-1] // scales.shape[-1]
  if hidden % 16 or block_size % 16:
    return (f"it needs hidden and block_size multiples of 16, got hidden {hidden} and "
            f"block_size {block_size}")
  if q.size // 8 >= 2**32:
    return f"it takes fewer than 2^35 elements, got {q.size}"
  return None


def dequantize_fp8(q: jax.Array, scales: jax.Array, dtype=jnp.float32, *,
                   implementation: str = "auto") -> jax.Array:
  """Inverse of quantize_fp8 up to rounding: f32(q) * scale per block, cast to `dtype`.

  `implementation`: "auto" (default) takes the CUDA kernel where the computation runs on a
  CUDA device and the call qualifies, else "xla"; "xla" is the pure-JAX expression; "cuda" is
  the custom call (jax_moe_dequantize_fp8, cuda/dequantize.cu) or a trace-time error naming
  why it cannot take the call. The kernel gives the same result bit for bit (NaN codes stay
  NaN) for float8_e4m3fn q, float32 scales, bfloat16 or float32 out, hidden and block_size
  multiples of 16; it is the default because it beats XLA's own fusion of the expression on
  an H100 (7.5 against 9.5 us at 1024 x 7168, 242.8 against 280.2 us at 32768 x 7168:
  docs/perf-notes.md, benchmarks/bench_dequantize.py). Differentiable in every implementation
  (the kernel's derivative is the reference's).
  """
  if implementation not in DEQUANTIZE_IMPLEMENTATIONS:
    raise ValueError(f"dequantize_fp8: implementation must be one of "
                     f"{DEQUANTIZE_IMPLEMENTATIONS}, got {implementation!r}")
  _check_dequantize(q, scales)
  reference = functools.partial(_dequantize_xla, dtype=dtype)
  if implementation == "xla" or q.size == 0:  # nothing to launch for an empty q
    return reference(q, scales)
  blocker = _cuda_blocker(q, scales, dtype)
  if blocker is not None:
    if implementation == "cuda":
      raise ValueError(f"dequantize_fp8(implementation='cuda'): {blocker}")
    return reference(q, scales)
  from jax_moe import native

  native.register_targets()
  kernel = jax.ffi.ffi_call(DEQUANTIZE_TARGET, jax.ShapeDtypeStruct(q.shape, dtype),
                            vmap_method="broadcast_all")
  pick = kernel if implementation == "cuda" else (
      lambda q, s: jax.lax.platform_dependent(q, s, cuda=kernel, default=reference))

  @jax.custom_jvp
  def dequantize(q, s):
    return pick(q, s)

  dequantize.defjvp(lambda primals, tangents: jax.jvp(reference, primals, tangents))
  return dequantize(q, scales)
