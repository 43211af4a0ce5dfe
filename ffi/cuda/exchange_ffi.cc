// FFI handlers of dispatch and combine on the "CUDA" platform: ffi/exchange_handlers.h's,
// which check every buffer against the rank state; then one launch of cuda/dispatch.cu's or
// cuda/combine.cu's kernel per call (the fused ops included), or the rank's host proxy
// (ffi/cuda/host_proxy.h) when its peers are reached through the host.
#include <cuda_runtime.h>

#include <string>

#include "cuda/api.cuh"
#include "ffi/cuda/handler_util.h"
#include "ffi/cuda/handlers.h"
#include "ffi/exchange_handlers.h"

namespace jax_moe {
namespace {

// The NVLink kernels' launchers take both halves' pointers; a half leaves the other's null.
constexpr DispatchSendArgs kNoSend{};
constexpr DispatchRecvArgs kNoRecv{};
constexpr CombineSendArgs kNoCombineSend{};
constexpr CombineRecvArgs kNoCombineRecv{};

cudaError_t launch(const CudaRankState& s, int phases, TokenInput input,
                   const DispatchSendArgs& a, const DispatchRecvArgs& b, cudaStream_t stream) {
  return launch_dispatch(s.view(), phases, input, a.x, a.x_scales, a.topk_ids, a.topk_weights,
                         a.num_tokens, a.send_dest, b.x, b.scales, b.weights, b.group_sizes,
                         b.tokens_per_expert, b.slot_rows, stream);
}

cudaError_t launch(const CudaRankState& s, int phases, const CombineSendArgs& a,
                   const CombineRecvArgs& b, cudaStream_t stream) {
  return launch_combine(s.view(), phases, a.y, a.slot_rows, a.row_weights, a.done,
                        b.send_dest, b.topk_weights, b.out, stream);
}

// The host proxy's halves (ffi/cuda/host_proxy.h); the fused ops run them kJoined.
using Joint = CudaProxy::Joint;

cudaError_t proxy_half(CudaRankState& s, TokenInput input, const DispatchSendArgs& a,
                       Joint joint, cudaStream_t stream) {
  return s.proxy->dispatch_send(s.view(), input, a.x, a.x_scales, a.topk_ids, a.topk_weights,
                                a.num_tokens, a.send_dest, joint, stream);
}

cudaError_t proxy_half(CudaRankState& s, const DispatchRecvArgs& b, Joint joint,
                       cudaStream_t stream) {
  return s.proxy->dispatch_recv(s.view(), b.x, b.scales, b.weights, b.group_sizes,
                                b.tokens_per_expert, b.slot_rows, joint, stream);
}

cudaError_t proxy_half(CudaRankState& s, const CombineSendArgs& a, Joint joint,
                       cudaStream_t stream) {
  return s.proxy->combine_send(s.view(), a.y, a.slot_rows, a.row_weights, a.done, joint,
                               stream);
}

cudaError_t proxy_half(CudaRankState& s, const CombineRecvArgs& b, Joint joint,
                       cudaStream_t stream) {
  return s.proxy->combine_recv(s.view(), b.send_dest, b.topk_weights, b.out, joint, stream);
}

struct CudaExchange {
  using State = CudaRankState;
  using Call = cudaStream_t;

  static ffi::ErrorOr<State*> begin_call(const CallSite& site, int64_t comm_id,
                                         int32_t ordinal) {
    auto state = jax_moe::begin_call(site, comm_id, ordinal);
    if (state.has_value() && !(*state)->nvlink && !(*state)->proxy)
      return ffi::Unexpected(ffi::Error::InvalidArgument(
          std::string(site.target) + ": comm_id=" + std::to_string(comm_id) +
          " is an AllReduce, not a Communicator; " + site.python_fn +
          " takes the Communicator's comm_id"));
    return state;
  }

  static ffi::Error dispatch_send(const CallSite& site, cudaStream_t stream, State& s,
                                  TokenInput input, const DispatchSendArgs& a) {
    return launch_result(site, s.proxy ? proxy_half(s, input, a, Joint::kAlone, stream)
                                       : launch(s, kPhaseSend, input, a, kNoRecv, stream));
  }

  static ffi::Error dispatch_recv(const CallSite& site, cudaStream_t stream, State& s,
                                  const DispatchRecvArgs& b) {
    return launch_result(site, s.proxy ? proxy_half(s, b, Joint::kAlone, stream)
                                       : launch(s, kPhaseRecv, kInputBf16, kNoSend, b, stream));
  }

  // One kernel: the send phase, then the receive phase in the same blocks.
  static ffi::Error dispatch(const CallSite& site, cudaStream_t stream, State& s,
                             TokenInput input, const DispatchSendArgs& a,
                             const DispatchRecvArgs& b) {
    if (!s.proxy) return launch_result(site, launch(s, kPhaseBoth, input, a, b, stream));
    if (auto err = launch_result(site, proxy_half(s, input, a, Joint::kJoined, stream));
        err.failure())
      return err;
    return launch_result(site, proxy_half(s, b, Joint::kJoined, stream));
  }

  static ffi::Error combine_send(const CallSite& site, cudaStream_t stream, State& s,
                                 const CombineSendArgs& a) {
    return launch_result(site, s.proxy ? proxy_half(s, a, Joint::kAlone, stream)
                                       : launch(s, kPhaseSend, a, kNoCombineRecv, stream));
  }

  static ffi::Error combine_recv(const CallSite& site, cudaStream_t stream, State& s,
                                 const CombineRecvArgs& b) {
    return launch_result(site, s.proxy ? proxy_half(s, b, Joint::kAlone, stream)
                                       : launch(s, kPhaseRecv, kNoCombineSend, b, stream));
  }

  static ffi::Error combine(const CallSite& site, cudaStream_t stream, State& s,
                            const CombineSendArgs& a, const CombineRecvArgs& b) {
    if (!s.proxy) return launch_result(site, launch(s, kPhaseBoth, a, b, stream));
    if (auto err = launch_result(site, proxy_half(s, a, Joint::kJoined, stream)); err.failure())
      return err;
    return launch_result(site, proxy_half(s, b, Joint::kJoined, stream));
  }
};

using Handlers = ExchangeHandlers<CudaExchange>;

// The binding prefix every CUDA target shares (ExchangeHandlers' leading parameters).
auto cuda_binding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Ctx<ffi::DeviceOrdinal>()
      .Attr<int64_t>("comm_id");
}

}  // namespace
}  // namespace jax_moe

namespace ffi = xla::ffi;
using jax_moe::cuda_binding;
using jax_moe::Handlers;

// Every launch is stream-ordered device work with fixed addresses: command-buffer safe.
XLA_FFI_DEFINE_HANDLER_SYMBOL(DispatchSendFfi, Handlers::dispatch_send,
                              jax_moe::bind_dispatch_send(cuda_binding()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(DispatchRecvFfi, Handlers::dispatch_recv,
                              jax_moe::bind_dispatch_recv(cuda_binding()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(DispatchFfi, Handlers::dispatch,
                              jax_moe::bind_dispatch(cuda_binding()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(CombineSendFfi, Handlers::combine_send,
                              jax_moe::bind_combine_send(cuda_binding()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(CombineRecvFfi, Handlers::combine_recv,
                              jax_moe::bind_combine_recv(cuda_binding()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(CombineFfi, Handlers::combine,
                              jax_moe::bind_combine(cuda_binding()),
                              {ffi::Traits::kCmdBufferCompatible});
