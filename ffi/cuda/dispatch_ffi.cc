// FFI handlers of dispatch: decode and check the buffers against the rank state, then launch
// cuda/dispatch.cu's kernel (one launch per call, the fused op included) or call the rank's
// host proxy (ffi/cuda/host_proxy.h). Argument
// order matches jax_moe/backends/cuda.py.
#include <cuda_runtime.h>

#include "cuda/api.cuh"
#include "ffi/cuda/handler_util.h"
#include "ffi/cuda/handlers.h"
#include "ffi/exchange_checks.h"

namespace jax_moe {
namespace {

// The token input of dispatch_send's arguments, after checking them against the rank state.
ffi::ErrorOr<TokenInput> send_input(const CallSite& site, CudaRankState& s, ffi::AnyBuffer x,
                                    ffi::AnyBuffer x_scales, ffi::Buffer<ffi::S32> topk_ids,
                                    ffi::Buffer<ffi::F32> topk_weights,
                                    ffi::Buffer<ffi::S32> num_tokens,
                                    ffi::Result<ffi::Buffer<ffi::S32>>& send_dest) {
  auto input = check_dispatch_send(site, s.dims, x, x_scales, topk_ids, topk_weights,
                                   num_tokens, *send_dest);
  if (input.has_error()) return ffi::Unexpected(input.error());
  return static_cast<TokenInput>(*input);
}

// The host-proxy path of the halves (ffi/cuda/host_proxy.h).
ffi::Error proxy_send(const CallSite& site, CudaRankState& s, cudaStream_t stream,
                      TokenInput input, ffi::AnyBuffer x, ffi::AnyBuffer x_scales,
                      ffi::Buffer<ffi::S32> topk_ids, ffi::Buffer<ffi::F32> topk_weights,
                      ffi::Buffer<ffi::S32> num_tokens,
                      ffi::Result<ffi::Buffer<ffi::S32>> send_dest) {
  const auto* scales = static_cast<const float*>(x_scales.untyped_data());
  return launch_result(site, s.proxy->dispatch_send(
                                 s.view(), input, x.untyped_data(), scales,
                                 topk_ids.typed_data(), topk_weights.typed_data(),
                                 num_tokens.typed_data(), send_dest->typed_data(), stream));
}

ffi::Error proxy_recv(const CallSite& site, CudaRankState& s, cudaStream_t stream,
                      ffi::Result<ffi::AnyBuffer> x, ffi::Result<ffi::Buffer<ffi::F32>> scales,
                      ffi::Result<ffi::Buffer<ffi::F32>> weights,
                      ffi::Result<ffi::Buffer<ffi::S32>> group_sizes,
                      ffi::Result<ffi::Buffer<ffi::S32>> tokens_per_expert,
                      ffi::Result<ffi::Buffer<ffi::S32>> slot_rows) {
  return launch_result(site, s.proxy->dispatch_recv(
                                 s.view(), x->untyped_data(), scales->typed_data(),
                                 weights->typed_data(), group_sizes->typed_data(),
                                 tokens_per_expert->typed_data(), slot_rows->typed_data(),
                                 stream));
}

ffi::Error DispatchSendImpl(cudaStream_t stream, int32_t ordinal, int64_t comm_id,
                            ffi::AnyBuffer x, ffi::AnyBuffer x_scales,
                            ffi::Buffer<ffi::S32> topk_ids, ffi::Buffer<ffi::F32> topk_weights,
                            ffi::Buffer<ffi::S32> num_tokens,
                            ffi::Result<ffi::Buffer<ffi::S32>> send_dest) {
  const CallSite site{"jax_moe_dispatch_send", "Communicator.dispatch_send"};
  auto state = begin_call(site, comm_id, ordinal);
  if (state.has_error()) return state.error();
  CudaRankState& s = **state;
  auto input = send_input(site, s, x, x_scales, topk_ids, topk_weights, num_tokens, send_dest);
  if (input.has_error()) return input.error();
  if (s.proxy)
    return proxy_send(site, s, stream, *input, x, x_scales, topk_ids, topk_weights, num_tokens,
                send_dest);
  return launch_result(
      site, launch_dispatch(s.view(), kPhaseSend, *input, x.untyped_data(),
                            static_cast<const float*>(x_scales.untyped_data()),
                            topk_ids.typed_data(), topk_weights.typed_data(),
                            num_tokens.typed_data(), send_dest->typed_data(), nullptr, nullptr,
                            nullptr, nullptr, nullptr, nullptr, stream));
}

// send_dest (from dispatch_send) is taken only so XLA orders this call after it.
ffi::Error DispatchRecvImpl(cudaStream_t stream, int32_t ordinal, int64_t comm_id,
                            ffi::Buffer<ffi::S32> send_dest, ffi::Result<ffi::AnyBuffer> x,
                            ffi::Result<ffi::Buffer<ffi::F32>> scales,
                            ffi::Result<ffi::Buffer<ffi::F32>> weights,
                            ffi::Result<ffi::Buffer<ffi::S32>> group_sizes,
                            ffi::Result<ffi::Buffer<ffi::S32>> tokens_per_expert,
                            ffi::Result<ffi::Buffer<ffi::S32>> slot_rows) {
  const CallSite site{"jax_moe_dispatch_recv", "Communicator.dispatch_recv"};
  auto state = begin_call(site, comm_id, ordinal);
  if (state.has_error()) return state.error();
  if (auto err = expect_shape(site, "send_dest", send_dest.dimensions(),
                              {{"max_tokens", (*state)->dims.max_tokens},
                               {"experts_per_token", (*state)->dims.topk}});
      err.failure())
    return err;
  CudaRankState& s = **state;
  if (auto err = check_dispatch_recv(site, s.dims, x, scales, weights, group_sizes,
                                     tokens_per_expert, slot_rows);
      err.failure())
    return err;
  if (s.proxy)
    return proxy_recv(site, s, stream, x, scales, weights, group_sizes, tokens_per_expert,
                      slot_rows);
  return launch_result(
      site, launch_dispatch(s.view(), kPhaseRecv, kInputBf16, nullptr, nullptr, nullptr,
                            nullptr, nullptr, nullptr, x->untyped_data(), scales->typed_data(),
                            weights->typed_data(), group_sizes->typed_data(),
                            tokens_per_expert->typed_data(), slot_rows->typed_data(), stream));
}

ffi::Error DispatchImpl(cudaStream_t stream, int32_t ordinal, int64_t comm_id, ffi::AnyBuffer x,
                        ffi::AnyBuffer x_scales, ffi::Buffer<ffi::S32> topk_ids,
                        ffi::Buffer<ffi::F32> topk_weights, ffi::Buffer<ffi::S32> num_tokens,
                        ffi::Result<ffi::Buffer<ffi::S32>> send_dest,
                        ffi::Result<ffi::AnyBuffer> x_out,
                        ffi::Result<ffi::Buffer<ffi::F32>> scales,
                        ffi::Result<ffi::Buffer<ffi::F32>> weights,
                        ffi::Result<ffi::Buffer<ffi::S32>> group_sizes,
                        ffi::Result<ffi::Buffer<ffi::S32>> tokens_per_expert,
                        ffi::Result<ffi::Buffer<ffi::S32>> slot_rows) {
  const CallSite site{"jax_moe_dispatch", "Communicator.dispatch"};
  auto state = begin_call(site, comm_id, ordinal);
  if (state.has_error()) return state.error();
  CudaRankState& s = **state;
  // Check everything before launching anything, so a bad call leaves no half-done exchange.
  if (auto err = check_dispatch_recv(site, s.dims, x_out, scales, weights, group_sizes,
                                     tokens_per_expert, slot_rows);
      err.failure())
    return err;
  auto input = send_input(site, s, x, x_scales, topk_ids, topk_weights, num_tokens, send_dest);
  if (input.has_error()) return input.error();
  if (s.proxy) {
    if (auto err = proxy_send(site, s, stream, *input, x, x_scales, topk_ids, topk_weights,
                        num_tokens, send_dest);
        err.failure())
      return err;
    return proxy_recv(site, s, stream, x_out, scales, weights, group_sizes, tokens_per_expert,
                slot_rows);
  }
  // One kernel: the send phase, then the receive phase in the same blocks.
  return launch_result(
      site, launch_dispatch(s.view(), kPhaseBoth, *input, x.untyped_data(),
                            static_cast<const float*>(x_scales.untyped_data()),
                            topk_ids.typed_data(), topk_weights.typed_data(),
                            num_tokens.typed_data(), send_dest->typed_data(),
                            x_out->untyped_data(), scales->typed_data(), weights->typed_data(),
                            group_sizes->typed_data(), tokens_per_expert->typed_data(),
                            slot_rows->typed_data(), stream));
}

}  // namespace
}  // namespace jax_moe

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(DispatchSendFfi, jax_moe::DispatchSendImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Attr<int64_t>("comm_id")
                                  .Arg<ffi::AnyBuffer>()           // x
                                  .Arg<ffi::AnyBuffer>()           // x_scales
                                  .Arg<ffi::Buffer<ffi::S32>>()    // topk_ids
                                  .Arg<ffi::Buffer<ffi::F32>>()    // topk_weights
                                  .Arg<ffi::Buffer<ffi::S32>>()    // num_tokens
                                  .Ret<ffi::Buffer<ffi::S32>>(),   // send_dest
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(DispatchRecvFfi, jax_moe::DispatchRecvImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Attr<int64_t>("comm_id")
                                  .Arg<ffi::Buffer<ffi::S32>>()    // send_dest
                                  .Ret<ffi::AnyBuffer>()           // x
                                  .Ret<ffi::Buffer<ffi::F32>>()    // scales
                                  .Ret<ffi::Buffer<ffi::F32>>()    // weights
                                  .Ret<ffi::Buffer<ffi::S32>>()    // group_sizes
                                  .Ret<ffi::Buffer<ffi::S32>>()    // tokens_per_expert
                                  .Ret<ffi::Buffer<ffi::S32>>(),   // slot_rows
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(DispatchFfi, jax_moe::DispatchImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Attr<int64_t>("comm_id")
                                  .Arg<ffi::AnyBuffer>()           // x
                                  .Arg<ffi::AnyBuffer>()           // x_scales
                                  .Arg<ffi::Buffer<ffi::S32>>()    // topk_ids
                                  .Arg<ffi::Buffer<ffi::F32>>()    // topk_weights
                                  .Arg<ffi::Buffer<ffi::S32>>()    // num_tokens
                                  .Ret<ffi::Buffer<ffi::S32>>()    // send_dest
                                  .Ret<ffi::AnyBuffer>()           // x
                                  .Ret<ffi::Buffer<ffi::F32>>()    // scales
                                  .Ret<ffi::Buffer<ffi::F32>>()    // weights
                                  .Ret<ffi::Buffer<ffi::S32>>()    // group_sizes
                                  .Ret<ffi::Buffer<ffi::S32>>()    // tokens_per_expert
                                  .Ret<ffi::Buffer<ffi::S32>>(),   // slot_rows
                              {ffi::Traits::kCmdBufferCompatible});
