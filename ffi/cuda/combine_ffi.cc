// FFI handlers of combine: decode and check the buffers against the rank state, then launch
// cuda/combine.cu's kernel (one launch per call, the fused op included) or call the rank's
// host proxy. Argument order matches
// jax_moe/backends/cuda.py.
#include <cuda_runtime.h>

#include "cuda/api.cuh"
#include "ffi/cuda/handler_util.h"
#include "ffi/cuda/handlers.h"
#include "ffi/exchange_checks.h"

namespace jax_moe {
namespace {

// The kernel (one launch, `phases` of it), or the rank's host proxy (ffi/cuda/host_proxy.h).
cudaError_t send_half(CudaRankState& s, const void* y, const int32_t* slot_rows,
                      const float* row_weights, int32_t* done, cudaStream_t stream) {
  if (s.proxy) return s.proxy->combine_send(s.view(), y, slot_rows, row_weights, done, stream);
  return launch_combine(s.view(), kPhaseSend, y, slot_rows, row_weights, done, nullptr, nullptr,
                        nullptr, stream);
}

cudaError_t recv_half(CudaRankState& s, const int32_t* send_dest, const float* topk_weights,
                      void* out, cudaStream_t stream) {
  if (s.proxy) return s.proxy->combine_recv(s.view(), send_dest, topk_weights, out, stream);
  return launch_combine(s.view(), kPhaseRecv, nullptr, nullptr, nullptr, nullptr, send_dest,
                        topk_weights, out, stream);
}

ffi::Error CombineSendImpl(cudaStream_t stream, int32_t ordinal, int64_t comm_id,
                           ffi::Buffer<ffi::BF16> y, ffi::Buffer<ffi::S32> slot_rows,
                           ffi::Buffer<ffi::F32> row_weights,
                           ffi::Result<ffi::Buffer<ffi::S32>> done) {
  const CallSite site{"jax_moe_combine_send", "Communicator.combine_send"};
  auto state = begin_call(site, comm_id, ordinal);
  if (state.has_error()) return state.error();
  CudaRankState& s = **state;
  if (auto err = check_combine_send(site, s.dims, y, slot_rows, row_weights); err.failure())
    return err;
  if (auto err = expect_shape(site, "done (output)", done->dimensions(), {{"1", 1}});
      err.failure())
    return err;
  return launch_result(site, send_half(s, y.untyped_data(),
                                                 slot_rows.typed_data(),
                                                 row_weights.typed_data(), done->typed_data(),
                                                 stream));
}

// `done` (from combine_send) is taken only so XLA orders this call after it.
ffi::Error CombineRecvImpl(cudaStream_t stream, int32_t ordinal, int64_t comm_id,
                           ffi::Buffer<ffi::S32> done, ffi::Buffer<ffi::S32> send_dest,
                           ffi::Buffer<ffi::F32> topk_weights,
                           ffi::Result<ffi::Buffer<ffi::BF16>> out) {
  const CallSite site{"jax_moe_combine_recv", "Communicator.combine_recv"};
  auto state = begin_call(site, comm_id, ordinal);
  if (state.has_error()) return state.error();
  CudaRankState& s = **state;
  if (auto err = expect_shape(site, "done", done.dimensions(), {{"1", 1}}); err.failure())
    return err;
  if (auto err = check_combine_recv(site, s.dims, send_dest, topk_weights, *out); err.failure())
    return err;
  return launch_result(site, recv_half(s, send_dest.typed_data(),
                                                 topk_weights.typed_data(), out->untyped_data(),
                                                 stream));
}

ffi::Error CombineImpl(cudaStream_t stream, int32_t ordinal, int64_t comm_id,
                       ffi::Buffer<ffi::BF16> y, ffi::Buffer<ffi::S32> slot_rows,
                       ffi::Buffer<ffi::F32> row_weights, ffi::Buffer<ffi::S32> send_dest,
                       ffi::Buffer<ffi::F32> topk_weights, ffi::Result<ffi::Buffer<ffi::BF16>> out,
                       ffi::Result<ffi::Buffer<ffi::S32>> done) {
  const CallSite site{"jax_moe_combine", "Communicator.combine"};
  auto state = begin_call(site, comm_id, ordinal);
  if (state.has_error()) return state.error();
  CudaRankState& s = **state;
  if (auto err = check_combine_send(site, s.dims, y, slot_rows, row_weights); err.failure())
    return err;
  if (auto err = check_combine_recv(site, s.dims, send_dest, topk_weights, *out); err.failure())
    return err;
  if (auto err = expect_shape(site, "done (output)", done->dimensions(), {{"1", 1}});
      err.failure())
    return err;
  if (!s.proxy)  // one kernel: the send phase, then the receive phase in the same blocks
    return launch_result(site, launch_combine(s.view(), kPhaseBoth, y.untyped_data(),
                                              slot_rows.typed_data(), row_weights.typed_data(),
                                              done->typed_data(), send_dest.typed_data(),
                                              topk_weights.typed_data(), out->untyped_data(),
                                              stream));
  if (auto err = launch_result(site, send_half(s, y.untyped_data(), slot_rows.typed_data(),
                                               row_weights.typed_data(), done->typed_data(),
                                               stream));
      err.failure())
    return err;
  return launch_result(site, recv_half(s, send_dest.typed_data(), topk_weights.typed_data(),
                                       out->untyped_data(), stream));
}

}  // namespace
}  // namespace jax_moe

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(CombineSendFfi, jax_moe::CombineSendImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Attr<int64_t>("comm_id")
                                  .Arg<ffi::Buffer<ffi::BF16>>()   // y
                                  .Arg<ffi::Buffer<ffi::S32>>()    // slot_rows
                                  .Arg<ffi::Buffer<ffi::F32>>()    // row_weights
                                  .Ret<ffi::Buffer<ffi::S32>>(),   // done
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(CombineRecvFfi, jax_moe::CombineRecvImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Attr<int64_t>("comm_id")
                                  .Arg<ffi::Buffer<ffi::S32>>()    // done
                                  .Arg<ffi::Buffer<ffi::S32>>()    // send_dest
                                  .Arg<ffi::Buffer<ffi::F32>>()    // topk_weights
                                  .Ret<ffi::Buffer<ffi::BF16>>(),  // out
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(CombineFfi, jax_moe::CombineImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Attr<int64_t>("comm_id")
                                  .Arg<ffi::Buffer<ffi::BF16>>()   // y
                                  .Arg<ffi::Buffer<ffi::S32>>()    // slot_rows
                                  .Arg<ffi::Buffer<ffi::F32>>()    // row_weights
                                  .Arg<ffi::Buffer<ffi::S32>>()    // send_dest
                                  .Arg<ffi::Buffer<ffi::F32>>()    // topk_weights
                                  .Ret<ffi::Buffer<ffi::BF16>>()   // out
                                  .Ret<ffi::Buffer<ffi::S32>>(),   // done
                              {ffi::Traits::kCmdBufferCompatible});
