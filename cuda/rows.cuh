// Row helpers shared by the dispatch and combine kernels: bf16 <-> f32 on 16-byte vectors,
// the fp8 quantization of docs/semantics.md, and where a token sits in a rank's buffer.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "cuda/sync.cuh"
#include "ffi/protocol/host_layout.h"

namespace jax_moe {

// Eight bf16 (one 16-byte vector, element 0 in the low half of .x) to f32, exactly.
__device__ inline void bf16x8_to_f32(const uint4& v, float out[8]) {
  const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    out[2 * i] = __uint_as_float(words[i] << 16);
    out[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
  }
}

// Eight f32 to bf16, round to nearest even, packed like bf16x8_to_f32 reads them.
__device__ inline uint4 f32_to_bf16x8(const float in[8]) {
  uint32_t words[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t lo = __bfloat16_as_ushort(__float2bfloat16_rn(in[2 * i]));
    const uint32_t hi = __bfloat16_as_ushort(__float2bfloat16_rn(in[2 * i + 1]));
    words[i] = lo | (hi << 16);
  }
  return make_uint4(words[0], words[1], words[2], words[3]);
}

// acc[i] += w * v[i] with both roundings explicit (no FMA contraction), as the reference does.
__device__ inline void accumulate_scaled(float acc[8], float w, const float v[8]) {
#pragma unroll
  for (int i = 0; i < 8; ++i) acc[i] = __fadd_rn(acc[i], __fmul_rn(w, v[i]));
}

// Vector c of a partial sum, in the partial dtype, into the row at `dst`.
__device__ inline void store_partial(const MoeDims& d, char* dst, int c, const float acc[8]) {
  if (d.partial_bf16) {
    reinterpret_cast<uint4*>(dst)[c] = f32_to_bf16x8(acc);
  } else {
    float4* out = reinterpret_cast<float4*>(dst) + 2 * c;
    out[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
    out[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
  }
}

constexpr float kInv448 = 1.0f / 448.0f;  // the f32 nearest 1/448

// max(a, b) that keeps a NaN (fmaxf drops it): a block's amax is NaN when any value is, as in
// the spec's formula (docs/semantics.md, non-finite values; ffi/host/numerics.h has the twin).
__device__ inline float max_keep_nan(float a, float b) { return (a > b || isnan(a)) ? a : b; }

// One value of a block whose multiplier is 448 / amax: clip to +-448, e4m3fn, nearest even;
// a NaN product (a NaN in the block, or Inf * 0) gives the NaN code, as clip keeps NaN.
__device__ inline uint32_t quantize_e4m3(float x, float multiplier) {
  const float product = __fmul_rn(x, multiplier);
  if (isnan(product)) return 0x7f;
  const float v = fminf(fmaxf(product, -448.f), 448.f);
  return __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
}

// max(m, |x|) per 16-bit half over the eight bf16 of `v`, as bits: |x| of a bf16 is its bits
// without the sign, and those order like the values (any NaN, above 0x7f80, above Inf), so a
// block's amax keeps NaN (docs/semantics.md) with one integer max per two values.
__device__ inline uint32_t abs_max_bits(const uint4& v, uint32_t m) {
  constexpr uint32_t kMagnitude = 0x7fff7fffu;
  m = __vmaxu2(m, v.x & kMagnitude);
  m = __vmaxu2(m, v.y & kMagnitude);
  return __vmaxu2(__vmaxu2(m, v.z & kMagnitude), v.w & kMagnitude);
}

// One scale block's quantization (docs/semantics.md) from the abs_max_bits `pair` of each of
// its `lanes` lanes (xor neighbours, a power of two; every lane of the warp calls): the amax
// is the largest magnitude's bits, NaN kept, at least 1e-4; scale = amax * f32(1/448), and
// codes are e4m3fn(x * multiplier) with multiplier = 448 / amax (quantize8_e4m3_*); a block
// with an Inf or NaN amax is not `finite`.
struct BlockQuant {
  bool finite;
  float scale;
  float multiplier;
};
__device__ inline BlockQuant block_quant(uint32_t pair, int lanes) {
  uint32_t bits = max(pair & 0xffffu, pair >> 16);
  for (int offset = lanes / 2; offset > 0; offset >>= 1)
    bits = max(bits, __shfl_xor_sync(kFullMask, bits, offset));
  const float amax = max_keep_nan(__uint_as_float(bits << 16), 1e-4f);
  return {bits < 0x7f80u, __fmul_rn(amax, kInv448), __fdiv_rn(448.f, amax)};
}

// Eight values of a block with a finite amax to e4m3fn codes (byte i = value i):
// e4m3fn(clip(x * multiplier)) as quantize_e4m3 computes it. With a finite amax no product is
// NaN, and the saturating conversion clips to +-448 itself, two values per instruction.
__device__ inline uint2 quantize8_e4m3_finite(const float f[8], float multiplier) {
  uint32_t words[2];
#pragma unroll
  for (int w = 0; w < 2; ++w) {
    const float* x = f + 4 * w;
    const uint32_t lo = __nv_cvt_float2_to_fp8x2(
        make_float2(__fmul_rn(x[0], multiplier), __fmul_rn(x[1], multiplier)), __NV_SATFINITE,
        __NV_E4M3);
    const uint32_t hi = __nv_cvt_float2_to_fp8x2(
        make_float2(__fmul_rn(x[2], multiplier), __fmul_rn(x[3], multiplier)), __NV_SATFINITE,
        __NV_E4M3);
    words[w] = lo | (hi << 16);
  }
  return make_uint2(words[0], words[1]);
}

// The same for a block whose amax is Inf or NaN, value by value (quantize_e4m3), from the
// eight bf16 of `v` as loaded. Rare, so kept out of line: the copy loops that call it stay
// small. It takes the 16-byte vector by value, not the caller's floats: an array argument of
// a function not inlined lives in local memory, so every caller stored its eight floats to
// the stack before each conversion, finite blocks included (session 20's SASS).
static __device__ __noinline__ uint2 quantize8_e4m3_nonfinite(uint4 v, float multiplier) {
  float f[8];
  bf16x8_to_f32(v, f);
  uint2 codes = make_uint2(0, 0);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    codes.x |= quantize_e4m3(f[i], multiplier) << (8 * i);
    codes.y |= quantize_e4m3(f[4 + i], multiplier) << (8 * i);
  }
  return codes;
}

// Codes of the eight bf16 of `v` in block quantization `q`: the finite path inline, the
// non-finite one out of line.
__device__ inline uint2 quantize8_e4m3(const uint4& v, const BlockQuant& q) {
  if (!q.finite) return quantize8_e4m3_nonfinite(v, q.multiplier);
  float f[8];
  bf16x8_to_f32(v, f);
  return quantize8_e4m3_finite(f, q.multiplier);
}

// Asynchronous 16-byte copies global -> shared (cp.async, bypassing L1): a warp keeps several
// batches of a row in flight in shared memory while it computes on an earlier one.
__device__ inline void copy_async16(void* shared, const void* global) {
  const uint32_t to = static_cast<uint32_t>(__cvta_generic_to_shared(shared));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(to), "l"(global) : "memory");
}
// The same for 4 bytes (cp.async.ca: .cg takes 16-byte copies only), e.g. a row's f32 scales.
__device__ inline void copy_async4(void* shared, const void* global) {
  const uint32_t to = static_cast<uint32_t>(__cvta_generic_to_shared(shared));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(to), "l"(global) : "memory");
}
__device__ inline void copy_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// Waits until at most `kPending` of this thread's committed groups are still in flight.
template <int kPending>
__device__ inline void copy_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
}

// One warp moves 16-byte vectors [begin, end): store(c, load(c)) for each c, with kUnroll
// loads in flight per lane before their stores (a copy loop with one load in flight is bound
// by memory latency, not bandwidth).
constexpr int kUnroll = 8;
template <typename Load, typename Store>
__device__ inline void warp_copy(int begin, int end, Load load, Store store) {
  for (int c0 = begin + lane_id(); c0 < end; c0 += 32 * kUnroll) {
    // A vector this lane does not load is zero, not left undefined: an undefined one kept the
    // last iteration's value, and the compiler spilled and reloaded it around every load.
    uint4 values[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      values[u] = c0 + 32 * u < end ? load(c0 + 32 * u) : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (c0 + 32 * u < end) store(c0 + 32 * u, values[u]);
  }
}

}  // namespace jax_moe
