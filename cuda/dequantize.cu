// fp8 (e4m3fn) block dequantization, one 16-code vector a thread and kVectors of them in flight.
// XLA's own fusion of the same expression converts at about 2.3 TB/s at [1024, 7168] on an
// H100 (docs/perf-notes.md); this one loads 16 codes at once and converts them with the
// hardware's e4m3x2 -> f16x2 instruction (exact: every e4m3 value is an f16).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "cuda/dequantize.cuh"

namespace jax_moe {
namespace {

constexpr int kThreads = 256;
constexpr int kVectors = 4;  // 16-byte loads a thread issues before its first convert

// Codes [4i, 4i + 4) of a vector as f32, scaled by `scale` (one correctly rounded multiply).
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

// Vector v (codes [16 v, 16 v + 16) of the flattened q) of `vectors`; row_vectors = hidden / 16,
// block_vectors = block_size / 16, row_scales = hidden / block_size.
template <DequantizeOut kOut>
__global__ void __launch_bounds__(kThreads)
dequantize_fp8_kernel(const uint4* __restrict__ q, const float* __restrict__ scales,
                      uint4* __restrict__ out, uint32_t vectors, uint32_t row_vectors,
                      uint32_t block_vectors, uint32_t row_scales) {
  const uint32_t first = blockIdx.x * (kThreads * kVectors) + threadIdx.x;
  uint4 codes[kVectors];
  float scale[kVectors];
#pragma unroll
  for (int j = 0; j < kVectors; ++j) {
    const uint32_t v = first + j * kThreads;
    codes[j] = make_uint4(0, 0, 0, 0);  // defined when out of range: no stack copy
    scale[j] = 0.f;
    if (v < vectors) {
      const uint32_t row = v / row_vectors, col = v - row * row_vectors;
      codes[j] = __ldg(q + v);
      scale[j] = __ldg(scales + size_t(row) * row_scales + col / block_vectors);
    }
  }
#pragma unroll
  for (int j = 0; j < kVectors; ++j) {
    const uint32_t v = first + j * kThreads;
    if (v >= vectors) continue;
    const uint32_t words[4] = {codes[j].x, codes[j].y, codes[j].z, codes[j].w};
    if constexpr (kOut == DequantizeOut::kBf16) {  // 16 bf16: two 16-byte stores
      uint32_t packed[8];
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        float f[4];
        scaled_four(words[w], scale[j], f);
        packed[2 * w] = bf16x2_bits(f[0], f[1]);
        packed[2 * w + 1] = bf16x2_bits(f[2], f[3]);
      }
      out[2 * size_t(v)] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
      out[2 * size_t(v) + 1] = make_uint4(packed[4], packed[5], packed[6], packed[7]);
    } else {  // 16 f32: four 16-byte stores
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        float f[4];
        scaled_four(words[w], scale[j], f);
        out[4 * size_t(v) + w] = make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]),
                                            __float_as_uint(f[2]), __float_as_uint(f[3]));
      }
    }
  }
}

}  // namespace

cudaError_t launch_dequantize_fp8(const void* q, const float* scales, void* out,
                                  DequantizeOut out_dtype, int64_t rows, int64_t hidden,
                                  int64_t block_size, cudaStream_t stream) {
  const uint64_t vectors = uint64_t(rows) * uint64_t(hidden) / 16;
  if (vectors == 0) return cudaSuccess;
  const unsigned grid = unsigned((vectors + kThreads * kVectors - 1) / (kThreads * kVectors));
  const auto* in = static_cast<const uint4*>(q);
  auto* to = static_cast<uint4*>(out);
  const uint32_t n = uint32_t(vectors), row_vectors = uint32_t(hidden / 16);
  const uint32_t block_vectors = uint32_t(block_size / 16), row_scales = uint32_t(hidden / block_size);
  if (out_dtype == DequantizeOut::kBf16)
    dequantize_fp8_kernel<DequantizeOut::kBf16><<<grid, kThreads, 0, stream>>>(
        in, scales, to, n, row_vectors, block_vectors, row_scales);
  else
    dequantize_fp8_kernel<DequantizeOut::kF32><<<grid, kThreads, 0, stream>>>(
        in, scales, to, n, row_vectors, block_vectors, row_scales);
  return cudaGetLastError();
}

}  // namespace jax_moe
