// Scalar conversions of the host backend, bit-exact with docs/semantics.md and the CUDA
// kernels (cuda/rows.cuh): bf16 <-> f32 and the fp8 e4m3fn quantization of one value.
// Compiled with -ffp-contract=off (CMakeLists.txt): every multiply and add rounds on its own.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace jax_moe::host {

inline float bf16_to_f32(uint16_t bits) {
  const uint32_t wide = uint32_t(bits) << 16;
  float f;
  std::memcpy(&f, &wide, 4);
  return f;
}

// Round to nearest even; NaN stays a (quiet) NaN.
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

constexpr float kInv448 = 1.0f / 448.0f;  // the f32 nearest 1/448

// max(a, b) that keeps a NaN (std::fmax drops it): a block's amax is NaN when any value is,
// as in the spec's formula (docs/semantics.md, non-finite values).
inline float max_keep_nan(float a, float b) { return (a > b || std::isnan(a)) ? a : b; }

// e4m3fn code of x * multiplier clipped to [-448, 448], nearest even (as
// __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3)); a NaN product gives the NaN code. e4m3fn: bias 7, 3 mantissa bits,
// subnormals m * 2^-9, no infinities, 0x7f is NaN, 448 = 0x7e the largest finite.
inline uint8_t quantize_e4m3(float x, float multiplier) {
  const float product = x * multiplier;
  if (std::isnan(product)) return 0x7f;  // clip keeps a NaN (std::fmax would not)
  const float v = std::fmin(std::fmax(product, -448.f), 448.f);
  const uint8_t sign = std::signbit(v) ? 0x80 : 0;
  const float a = std::fabs(v);
  if (a < 0x1p-6f) {
    // Subnormal (or rounding up to the smallest normal, code 8): a * 2^9 is exact.
    return sign | uint8_t(std::nearbyint(a * 0x1p9f));
  }
  uint32_t u;
  std::memcpy(&u, &a, 4);
  u += 0x7ffffu + ((u >> 20) & 1u);  // round the 23-bit mantissa to 3 bits, nearest even
  const int exponent = int(u >> 23) - 127 + 7;
  const uint32_t code = (uint32_t(exponent) << 3) | ((u >> 20) & 7u);
  return sign | uint8_t(code > 0x7e ? 0x7e : code);
}

}  // namespace jax_moe::host
