// FFI handlers of the host backend (platform "cpu"): ffi/exchange_handlers.h's, the cuda
// backend's targets, operands and checks, run on the thread XLA gives each CPU device; the
// work is in ffi/host/exchange.cc.
#include <string>

#include "ffi/exchange_handlers.h"
#include "ffi/host/exchange.h"
#include "ffi/host/state.h"
#include "ffi/native_host.h"

namespace jax_moe {
namespace {

using host::HostRankState;

// The host backend as a platform of ffi/exchange_handlers.h: the halves run on the calling
// CPU device's thread (ffi/host/exchange.cc).
struct HostExchange {
  using State = HostRankState;
  struct Call {};  // nothing besides the ordinal and the comm id

  static ffi::ErrorOr<State*> begin_call(const CallSite& site, int64_t comm_id,
                                         int32_t ordinal) {
    State* s = host::find_host_rank(comm_id, ordinal);
    if (s == nullptr || !s->connected) {
      return ffi::Unexpected(ffi::Error::InvalidArgument(
          std::string(site.target) + ": no connected host communicator state for comm_id=" +
          std::to_string(comm_id) + " on CPU device " + std::to_string(ordinal) + "; " +
          site.python_fn + " must run on a device of the mesh given to " +
          "Communicator(backend='host'), which must not be closed"));
    }
    return s;
  }

  static ffi::Error dispatch_send(const CallSite&, Call, State& s, TokenInput input,
                                  const DispatchSendArgs& a) {
    host::dispatch_send(s, input, a.x, a.x_scales, a.topk_ids, a.topk_weights, a.num_tokens,
                        a.send_dest);
    return ffi::Error::Success();
  }
  static ffi::Error dispatch_recv(const CallSite&, Call, State& s, const DispatchRecvArgs& a) {
    host::dispatch_recv(s, a.x, a.scales, a.weights, a.group_sizes, a.tokens_per_expert,
                        a.slot_rows);
    return ffi::Error::Success();
  }
  static ffi::Error dispatch(const CallSite& site, Call call, State& s, TokenInput input,
                             const DispatchSendArgs& send, const DispatchRecvArgs& recv) {
    dispatch_send(site, call, s, input, send);
    return dispatch_recv(site, call, s, recv);
  }
  static ffi::Error combine_send(const CallSite&, Call, State& s, const CombineSendArgs& a) {
    host::combine_send(s, static_cast<const uint16_t*>(a.y), a.slot_rows, a.row_weights,
                       a.done);
    return ffi::Error::Success();
  }
  static ffi::Error combine_recv(const CallSite&, Call, State& s, const CombineRecvArgs& a) {
    host::combine_recv(s, a.send_dest, a.topk_weights, static_cast<uint16_t*>(a.out));
    return ffi::Error::Success();
  }
  static ffi::Error combine(const CallSite& site, Call call, State& s,
                            const CombineSendArgs& send, const CombineRecvArgs& recv) {
    combine_send(site, call, s, send);
    return combine_recv(site, call, s, recv);
  }
};

using Handlers = ExchangeHandlers<HostExchange>;

// A host handler takes the program-order token (backends/ordered_ffi.py) after the comm id
// and before the buffers, and no stream: Op's (Call, ordinal, comm id, buffers...) behind
// that signature.
template <auto Op>
struct Ordered;
template <typename... Buffers,
          ffi::Error (*Op)(HostExchange::Call, int32_t, int64_t, Buffers...)>
struct Ordered<Op> {
  static ffi::Error handler(int32_t ordinal, int64_t comm_id, ffi::Token,
                            ffi::Result<ffi::Token>, Buffers... buffers) {
    return Op(HostExchange::Call{}, ordinal, comm_id, buffers...);
  }
};

// The binding prefix every host target shares (Ordered's leading parameters).
auto host_binding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::DeviceOrdinal>()
      .Attr<int64_t>("comm_id")
      .Arg<ffi::Token>()  // program order (ordered_ffi.py)
      .Ret<ffi::Token>();
}

}  // namespace
}  // namespace jax_moe

namespace ffi = xla::ffi;
using jax_moe::Handlers;
using jax_moe::Ordered;
using jax_moe::host_binding;

XLA_FFI_DEFINE_HANDLER_SYMBOL(HostDispatchSendFfi, Ordered<&Handlers::dispatch_send>::handler,
                              jax_moe::bind_dispatch_send(host_binding()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(HostDispatchRecvFfi, Ordered<&Handlers::dispatch_recv>::handler,
                              jax_moe::bind_dispatch_recv(host_binding()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(HostDispatchFfi, Ordered<&Handlers::dispatch>::handler,
                              jax_moe::bind_dispatch(host_binding()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(HostCombineSendFfi, Ordered<&Handlers::combine_send>::handler,
                              jax_moe::bind_combine_send(host_binding()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(HostCombineRecvFfi, Ordered<&Handlers::combine_recv>::handler,
                              jax_moe::bind_combine_recv(host_binding()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(HostCombineFfi, Ordered<&Handlers::combine>::handler,
                              jax_moe::bind_combine(host_binding()));
