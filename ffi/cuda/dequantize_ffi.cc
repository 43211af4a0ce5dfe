// FFI handler of the fp8 block dequantization (cuda/dequantize.cuh). Argument order, dtypes
// and shapes match jax_moe/quantization.py (dequantize_fp8 with implementation "cuda"), which
// checks them at trace time; these checks repeat them for direct callers.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "cuda/dequantize.cuh"
#include "ffi/cuda/handler_util.h"
#include "ffi/cuda/handlers.h"
#include "ffi/handler_checks.h"
#include "xla/ffi/api/ffi.h"

namespace jax_moe {
namespace {

const CallSite kSite{"jax_moe_dequantize_fp8", "dequantize_fp8 (implementation='cuda')"};

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

ffi::Error DequantizeFp8Impl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer q,
                             ffi::Buffer<ffi::F32> scales, ffi::Result<ffi::AnyBuffer> out) {
  if (auto err = expect_dtype(kSite, "q", q.element_type(), ffi::DataType::F8E4M3FN);
      err.failure())
    return err;
  DequantizeOut out_dtype;
  switch (out->element_type()) {
    case ffi::DataType::BF16: out_dtype = DequantizeOut::kBf16; break;
    case ffi::DataType::F32: out_dtype = DequantizeOut::kF32; break;
    default: return invalid_argument(kSite, "the output dtype must be bfloat16 or float32");
  }
  const auto qd = q.dimensions(), sd = scales.dimensions(), od = out->dimensions();
  if (qd.size() < 1)
    return invalid_argument(kSite, "q must have at least one dimension (hidden last)");
  if (sd.size() != qd.size())
    return invalid_argument(kSite, "scales must be [..., hidden / block_size], as q");
  int64_t rows = 1;
  for (size_t i = 0; i + 1 < qd.size(); ++i) {
    if (sd[i] != qd[i] || od[i] != qd[i])
      return invalid_argument(kSite,
                              "q, scales and the output must share every dimension but the last");
    rows *= qd[i];
  }
  const int64_t hidden = qd.back(), blocks = sd.back();
  if (od.size() != qd.size() || od.back() != hidden)
    return invalid_argument(kSite, "the output must have q's shape");
  if (blocks <= 0 || hidden % blocks != 0)
    return invalid_argument(kSite, "scales' last dimension (" + std::to_string(blocks) +
                                       ") must divide q's hidden (" + std::to_string(hidden) +
                                       ")");
  const int64_t block_size = hidden / blocks;
  if (hidden % 16 != 0 || block_size % 16 != 0)
    return invalid_argument(kSite, "hidden and block_size must be multiples of 16, got hidden " +
                                       std::to_string(hidden) + " and block_size " +
                                       std::to_string(block_size));
  if (rows * hidden / 8 >= (int64_t(1) << 32))
    return invalid_argument(kSite, "q must have fewer than 2^35 elements");
  if (!aligned16(q.untyped_data()) || !aligned16(out->untyped_data()))
    return invalid_argument(kSite, "q and the output must be 16-byte aligned");
  if (rows == 0) return ffi::Error::Success();
  if (auto err = set_device(kSite, ordinal); err.failure()) return err;
  return launch_result(kSite, launch_dequantize_fp8(q.untyped_data(), scales.typed_data(),
                                                    out->untyped_data(), out_dtype, rows,
                                                    hidden, block_size, stream));
}

}  // namespace
}  // namespace jax_moe

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(DequantizeFp8Ffi, jax_moe::DequantizeFp8Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()          // q [..., hidden] e4m3fn
                                  .Arg<ffi::Buffer<ffi::F32>>()   // scales [..., hidden / bs]
                                  .Ret<ffi::AnyBuffer>(),         // out [..., hidden] bf16 / f32
                              {ffi::Traits::kCmdBufferCompatible});
