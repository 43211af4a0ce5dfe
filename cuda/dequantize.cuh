// Launcher of the fp8 block dequantization: the CUDA implementation of
// jax_moe.dequantize_fp8 (jax_moe/quantization.py), whose pure-JAX form is its reference.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace jax_moe {

// Output element types; the handler (ffi/cuda/dequantize_ffi.cc) maps XLA's dtype to these.
enum class DequantizeOut : int {
  kBf16 = 0,
  kF32 = 1,
};

// out[r, h] = round_to(out dtype)(f32(q[r, h]) * scales[r, h / block_size]): one f32 multiply,
// then one round to nearest even, as the reference. q: e4m3fn codes [rows, hidden]; scales f32
// [rows, hidden / block_size]; out [rows, hidden]. Needs hidden and block_size multiples of 16
// (an 8-code group stays in one scale block, and every row starts 16-byte aligned), q and out
// 16-byte aligned and rows * hidden / 8 < 2^32; the handler checks them. Enqueues one kernel
// on `stream`.
cudaError_t launch_dequantize_fp8(const void* q, const float* scales, void* out,
                                  DequantizeOut out_dtype, int64_t rows, int64_t hidden,
                                  int64_t block_size, cudaStream_t stream);

}  // namespace jax_moe
