// FFI handler of the all-reduce: check the message against the AllReduce's state, then call
// the launcher of the chosen algorithm (cuda/all_reduce.cu, cuda/all_reduce_nvls.cu).
// Attributes and argument order match jax_moe/all_reduce.py.
#include <cuda_runtime.h>

#include <string>

#include "cuda/api.cuh"
#include "ffi/cuda/handler_util.h"
#include "ffi/cuda/handlers.h"

namespace jax_moe {
namespace {


ffi::ErrorOr<ReduceDtype> reduce_dtype(const CallSite& site, ffi::DataType dtype) {
  switch (dtype) {
    case ffi::DataType::F32: return kReduceF32;
    case ffi::DataType::BF16: return kReduceBf16;
    case ffi::DataType::F16: return kReduceF16;
    default:
      return ffi::Unexpected(ffi::Error::InvalidArgument(
          std::string(site.target) + ": x must be float32, bfloat16 or float16 (" +
          site.python_fn + ")"));
  }
}

ffi::Error AllReduceImpl(cudaStream_t stream, int32_t ordinal, int64_t comm_id,
                         int32_t algorithm, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> out) {
  const CallSite site{"jax_moe_all_reduce", "AllReduce.__call__"};
  auto state = begin_call(site, comm_id, ordinal);
  if (state.has_error()) return state.error();
  CudaRankState& s = **state;
  if (!s.all_reduce)
    return ffi::Error::InvalidArgument(std::string(site.target) + ": comm_id=" +
                                       std::to_string(comm_id) + " is not an AllReduce");
  auto dtype = reduce_dtype(site, x.element_type());
  if (dtype.has_error()) return dtype.error();
  if (auto err = expect_dtype(site, "out (output)", out->element_type(), x.element_type());
      err.failure())
    return err;
  if (out->element_count() != x.element_count())
    return ffi::Error::InvalidArgument(std::string(site.target) + ": out (output) has " +
                                       std::to_string(out->element_count()) + " elements, x " +
                                       std::to_string(x.element_count()));
  if (x.size_bytes() > s.all_reduce->layout.slot_bytes)
    return ffi::Error::InvalidArgument(
        std::string(site.target) + ": x has " + std::to_string(x.size_bytes()) +
        " bytes, more than this AllReduce's max_bytes (" +
        std::to_string(s.all_reduce->layout.slot_bytes) + " after rounding up to 256)");
  const int64_t n = static_cast<int64_t>(x.element_count());
  const CommView view = s.view();
  const AllReduceRank& r = *s.all_reduce;
  switch (algorithm) {
    case kOneShot:
      return launch_result(site, launch_all_reduce_one_shot(view, r.layout, *dtype,
                                                            x.untyped_data(), out->untyped_data(),
                                                            n, stream));
    case kTwoShot:
      return launch_result(site, launch_all_reduce_two_shot(view, r.layout, *dtype,
                                                            x.untyped_data(), out->untyped_data(),
                                                            n, stream));
    case kNvls:
      if (r.multicast == nullptr)
        return ffi::Error::InvalidArgument(std::string(site.target) +
                                           ": NVLS was not set up for this AllReduce");
      return launch_result(site, launch_all_reduce_nvls(view, r.layout, r.multicast,
                                                        r.multicast_local, *dtype,
                                                        x.untyped_data(), out->untyped_data(), n,
                                                        stream));
    default:
      return ffi::Error::InvalidArgument(std::string(site.target) + ": unknown algorithm " +
                                         std::to_string(algorithm));
  }
}

}  // namespace
}  // namespace jax_moe

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(AllReduceFfi, jax_moe::AllReduceImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Attr<int64_t>("comm_id")
                                  .Attr<int32_t>("algorithm")
                                  .Arg<ffi::AnyBuffer>()   // x
                                  .Ret<ffi::AnyBuffer>(),  // out, the shape and dtype of x
                              {ffi::Traits::kCmdBufferCompatible});
