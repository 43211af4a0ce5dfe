// fp8 (e4m3fn) block dequantization, 8 codes a thread a step and kGroups steps in flight,
// converted with the hardware's e4m3x2 -> f16x2 instruction (exact: every e4m3 value is an
// f16). XLA's own fusion of the same expression moves 2.35 / 2.54 TB/s at 1024 / 32768 rows of
// 7168 on an H100; this kernel's first version was slower (docs/perf-notes.md).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "cuda/dequantize.cuh"

namespace jax_moe {
namespace {

constexpr int kThreads = 256;
constexpr int kGroups = 8;  // 8-code loads a thread issues before its first convert

// Codes [4i, 4i + 4) of a group as f32, scaled by `scale` (one correctly rounded multiply).
__device__ inline void scaled_four(uint32_t codes, float scale, float v[4]) {
  const float2 lo = __half22float2(
      __half2(__nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(codes & 0xffffu), __NV_E4M3)));
  const float2 hi = __half22float2(
      __half2(__nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(codes >> 16), __NV_E4M3)));
  v[0] = __fmul_rn(lo.x, scale);
  v[1] = __fmul_rn(lo.y, scale);
  v[2] = __fmul_rn(hi.x, scale);
  v[3] = __fmul_rn(hi.y, scale);
}

__device__ inline uint32_t bf16x2_bits(float a, float b) {
  const __nv_bfloat162 pair = __floats2bfloat162_rn(a, b);  // .x (a) in the low half
  return *reinterpret_cast<const uint32_t*>(&pair);
}

// Group g: codes [8 g, 8 g + 8) of the flattened q, of `groups`; row_groups = hidden / 8,
// block_groups = block_size / 8, row_scales = hidden / block_size. A warp's lanes take
// consecutive groups, so each load instruction reads 256 contiguous bytes and each bf16
// store writes 512 (v1 took 16 codes a lane and wrote each lane's 32 bytes as two 16-byte
// stores 32 bytes apart: half a sector run per instruction, and slower than XLA's fusion).
template <DequantizeOut kOut>
__global__ void __launch_bounds__(kThreads)
dequantize_fp8_kernel(const uint2* __restrict__ q, const float* __restrict__ scales,
                      uint4* __restrict__ out, uint32_t groups, uint32_t row_groups,
                      uint32_t block_groups, uint32_t row_scales) {
  const uint32_t first = blockIdx.x * (kThreads * kGroups) + threadIdx.x;
  uint2 codes[kGroups];
  float scale[kGroups];
#pragma unroll
  for (int j = 0; j < kGroups; ++j) {
    const uint32_t g = first + j * kThreads;
    codes[j] = make_uint2(0, 0);  // defined when out of range: no stack copy
    scale[j] = 0.f;
    if (g < groups) {
      const uint32_t row = g / row_groups, col = g - row * row_groups;
      codes[j] = __ldg(q + g);
      scale[j] = __ldg(scales + size_t(row) * row_scales + col / block_groups);
    }
  }
#pragma unroll
  for (int j = 0; j < kGroups; ++j) {
    const uint32_t g = first + j * kThreads;
    if (g >= groups) continue;
    float f[8];
    scaled_four(codes[j].x, scale[j], f);
    scaled_four(codes[j].y, scale[j], f + 4);
    if constexpr (kOut == DequantizeOut::kBf16) {  // 8 bf16: one 16-byte store
      out[g] = make_uint4(bf16x2_bits(f[0], f[1]), bf16x2_bits(f[2], f[3]),
                          bf16x2_bits(f[4], f[5]), bf16x2_bits(f[6], f[7]));
    } else {  // 8 f32: two 16-byte stores
      out[2 * size_t(g)] = make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]),
                                      __float_as_uint(f[2]), __float_as_uint(f[3]));
      out[2 * size_t(g) + 1] = make_uint4(__float_as_uint(f[4]), __float_as_uint(f[5]),
                                          __float_as_uint(f[6]), __float_as_uint(f[7]));
    }
  }
}

}  // namespace

cudaError_t launch_dequantize_fp8(const void* q, const float* scales, void* out,
                                  DequantizeOut out_dtype, int64_t rows, int64_t hidden,
                                  int64_t block_size, cudaStream_t stream) {
  const uint64_t groups = uint64_t(rows) * uint64_t(hidden) / 8;
  if (groups == 0) return cudaSuccess;
  const unsigned grid = unsigned((groups + kThreads * kGroups - 1) / (kThreads * kGroups));
  const auto* in = static_cast<const uint2*>(q);
  auto* to = static_cast<uint4*>(out);
  const uint32_t n = uint32_t(groups), row_groups = uint32_t(hidden / 8);
  const uint32_t block_groups = uint32_t(block_size / 8), row_scales = uint32_t(hidden / block_size);
  if (out_dtype == DequantizeOut::kBf16)
    dequantize_fp8_kernel<DequantizeOut::kBf16><<<grid, kThreads, 0, stream>>>(
        in, scales, to, n, row_groups, block_groups, row_scales);
  else
    dequantize_fp8_kernel<DequantizeOut::kF32><<<grid, kThreads, 0, stream>>>(
        in, scales, to, n, row_groups, block_groups, row_scales);
  return cudaGetLastError();
}

}  // namespace jax_moe
