// FFI handlers of the host backend (platform "cpu"): the same targets, arguments and checks
// as the cuda handlers (ffi/cuda/dispatch_ffi.cc, combine_ffi.cc; jax_moe/backends/cuda.py), run on
// the thread XLA gives each CPU device; the work is in ffi/host/exchange.cc.
#include <string>

#include "ffi/exchange_checks.h"
#include "ffi/host/exchange.h"
#include "ffi/host/state.h"
#include "ffi/native_host.h"

namespace jax_moe {
namespace {

using host::HostRankState;

ffi::ErrorOr<HostRankState*> begin_call(const CallSite& site, int64_t comm_id, int32_t ordinal) {
  HostRankState* s = host::find_host_rank(comm_id, ordinal);
  if (s == nullptr || !s->connected) {
    return ffi::Unexpected(ffi::Error::InvalidArgument(
        std::string(site.target) + ": no connected host communicator state for comm_id=" +
        std::to_string(comm_id) + " on CPU device " + std::to_string(ordinal) + "; " +
        site.python_fn + " must run on a device of the mesh given to " +
        "Communicator(backend='host'), which must not be closed"));
  }
  return s;
}

ffi::Error send(const CallSite& site, HostRankState& s, ffi::AnyBuffer x,
                ffi::AnyBuffer x_scales, ffi::Buffer<ffi::S32> topk_ids,
                ffi::Buffer<ffi::F32> topk_weights, ffi::Buffer<ffi::S32> num_tokens,
                ffi::Result<ffi::Buffer<ffi::S32>> send_dest) {
  auto input = check_dispatch_send(site, s.dims, x, x_scales, topk_ids, topk_weights,
                                   num_tokens, *send_dest);
  if (input.has_error()) return input.error();
  host::dispatch_send(s, *input, x.untyped_data(),
                      static_cast<const float*>(x_scales.untyped_data()), topk_ids.typed_data(),
                      topk_weights.typed_data(), num_tokens.typed_data(),
                      send_dest->typed_data());
  return ffi::Error::Success();
}

void recv(HostRankState& s, ffi::Result<ffi::AnyBuffer> x,
          ffi::Result<ffi::Buffer<ffi::F32>> scales, ffi::Result<ffi::Buffer<ffi::F32>> weights,
          ffi::Result<ffi::Buffer<ffi::S32>> group_sizes,
          ffi::Result<ffi::Buffer<ffi::S32>> tokens_per_expert,
          ffi::Result<ffi::Buffer<ffi::S32>> slot_rows) {
  host::dispatch_recv(s, x->untyped_data(), scales->typed_data(), weights->typed_data(),
                      group_sizes->typed_data(), tokens_per_expert->typed_data(),
                      slot_rows->typed_data());
}

ffi::Error DispatchSendImpl(int32_t ordinal, int64_t comm_id, ffi::Token, ffi::Result<ffi::Token>,
                            ffi::AnyBuffer x,
                            ffi::AnyBuffer x_scales, ffi::Buffer<ffi::S32> topk_ids,
                            ffi::Buffer<ffi::F32> topk_weights, ffi::Buffer<ffi::S32> num_tokens,
                            ffi::Result<ffi::Buffer<ffi::S32>> send_dest) {
  const CallSite site{"jax_moe_dispatch_send", "Communicator.dispatch_send"};
  auto state = begin_call(site, comm_id, ordinal);
  if (state.has_error()) return state.error();
  return send(site, **state, x, x_scales, topk_ids, topk_weights, num_tokens, send_dest);
}

// send_dest (from dispatch_send) is taken only so XLA orders this call after it.
ffi::Error DispatchRecvImpl(int32_t ordinal, int64_t comm_id, ffi::Token, ffi::Result<ffi::Token>,
                            ffi::Buffer<ffi::S32> send_dest,
                            ffi::Result<ffi::AnyBuffer> x,
                            ffi::Result<ffi::Buffer<ffi::F32>> scales,
                            ffi::Result<ffi::Buffer<ffi::F32>> weights,
                            ffi::Result<ffi::Buffer<ffi::S32>> group_sizes,
                            ffi::Result<ffi::Buffer<ffi::S32>> tokens_per_expert,
                            ffi::Result<ffi::Buffer<ffi::S32>> slot_rows) {
  const CallSite site{"jax_moe_dispatch_recv", "Communicator.dispatch_recv"};
  auto state = begin_call(site, comm_id, ordinal);
  if (state.has_error()) return state.error();
  HostRankState& s = **state;
  if (auto err = expect_shape(site, "send_dest", send_dest.dimensions(),
                              {{"max_tokens", s.dims.max_tokens},
                               {"experts_per_token", s.dims.topk}});
      err.failure())
    return err;
  if (auto err = check_dispatch_recv(site, s.dims, x, scales, weights, group_sizes,
                                     tokens_per_expert, slot_rows);
      err.failure())
    return err;
  recv(s, x, scales, weights, group_sizes, tokens_per_expert, slot_rows);
  return ffi::Error::Success();
}

ffi::Error DispatchImpl(int32_t ordinal, int64_t comm_id, ffi::Token, ffi::Result<ffi::Token>,
                        ffi::AnyBuffer x, ffi::AnyBuffer x_scales, ffi::Buffer<ffi::S32> topk_ids,
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
  HostRankState& s = **state;
  // Check everything before sending anything, so a bad call leaves no half-done exchange.
  if (auto err = check_dispatch_recv(site, s.dims, x_out, scales, weights, group_sizes,
                                     tokens_per_expert, slot_rows);
      err.failure())
    return err;
  if (auto err = send(site, s, x, x_scales, topk_ids, topk_weights, num_tokens, send_dest);
      err.failure())
    return err;
  recv(s, x_out, scales, weights, group_sizes, tokens_per_expert, slot_rows);
  return ffi::Error::Success();
}

ffi::Error CombineSendImpl(int32_t ordinal, int64_t comm_id, ffi::Token, ffi::Result<ffi::Token>,
                            ffi::Buffer<ffi::BF16> y,
                           ffi::Buffer<ffi::S32> slot_rows, ffi::Buffer<ffi::F32> row_weights,
                           ffi::Result<ffi::Buffer<ffi::S32>> done) {
  const CallSite site{"jax_moe_combine_send", "Communicator.combine_send"};
  auto state = begin_call(site, comm_id, ordinal);
  if (state.has_error()) return state.error();
  HostRankState& s = **state;
  if (auto err = check_combine_send(site, s.dims, y, slot_rows, row_weights); err.failure())
    return err;
  if (auto err = expect_shape(site, "done (output)", done->dimensions(), {{"1", 1}});
      err.failure())
    return err;
  host::combine_send(s, reinterpret_cast<const uint16_t*>(y.untyped_data()),
                     slot_rows.typed_data(), row_weights.typed_data(), done->typed_data());
  return ffi::Error::Success();
}

// `done` (from combine_send) is taken only so XLA orders this call after it.
ffi::Error CombineRecvImpl(int32_t ordinal, int64_t comm_id, ffi::Token, ffi::Result<ffi::Token>,
                            ffi::Buffer<ffi::S32> done,
                           ffi::Buffer<ffi::S32> send_dest, ffi::Buffer<ffi::F32> topk_weights,
                           ffi::Result<ffi::Buffer<ffi::BF16>> out) {
  const CallSite site{"jax_moe_combine_recv", "Communicator.combine_recv"};
  auto state = begin_call(site, comm_id, ordinal);
  if (state.has_error()) return state.error();
  HostRankState& s = **state;
  if (auto err = expect_shape(site, "done", done.dimensions(), {{"1", 1}}); err.failure())
    return err;
  if (auto err = check_combine_recv(site, s.dims, send_dest, topk_weights, *out); err.failure())
    return err;
  host::combine_recv(s, send_dest.typed_data(), topk_weights.typed_data(),
                     reinterpret_cast<uint16_t*>(out->untyped_data()));
  return ffi::Error::Success();
}

ffi::Error CombineImpl(int32_t ordinal, int64_t comm_id, ffi::Token, ffi::Result<ffi::Token>,
                            ffi::Buffer<ffi::BF16> y,
                       ffi::Buffer<ffi::S32> slot_rows, ffi::Buffer<ffi::F32> row_weights,
                       ffi::Buffer<ffi::S32> send_dest, ffi::Buffer<ffi::F32> topk_weights,
                       ffi::Result<ffi::Buffer<ffi::BF16>> out,
                       ffi::Result<ffi::Buffer<ffi::S32>> done) {
  const CallSite site{"jax_moe_combine", "Communicator.combine"};
  auto state = begin_call(site, comm_id, ordinal);
  if (state.has_error()) return state.error();
  HostRankState& s = **state;
  if (auto err = check_combine_send(site, s.dims, y, slot_rows, row_weights); err.failure())
    return err;
  if (auto err = check_combine_recv(site, s.dims, send_dest, topk_weights, *out); err.failure())
    return err;
  if (auto err = expect_shape(site, "done (output)", done->dimensions(), {{"1", 1}});
      err.failure())
    return err;
  host::combine_send(s, reinterpret_cast<const uint16_t*>(y.untyped_data()),
                     slot_rows.typed_data(), row_weights.typed_data(), done->typed_data());
  host::combine_recv(s, send_dest.typed_data(), topk_weights.typed_data(),
                     reinterpret_cast<uint16_t*>(out->untyped_data()));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_moe

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(HostDispatchSendFfi, jax_moe::DispatchSendImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Attr<int64_t>("comm_id")
                                  .Arg<ffi::Token>()               // program order (ordered_ffi.py)
                                  .Ret<ffi::Token>()
                                  .Arg<ffi::AnyBuffer>()           // x
                                  .Arg<ffi::AnyBuffer>()           // x_scales
                                  .Arg<ffi::Buffer<ffi::S32>>()    // topk_ids
                                  .Arg<ffi::Buffer<ffi::F32>>()    // topk_weights
                                  .Arg<ffi::Buffer<ffi::S32>>()    // num_tokens
                                  .Ret<ffi::Buffer<ffi::S32>>());  // send_dest

XLA_FFI_DEFINE_HANDLER_SYMBOL(HostDispatchRecvFfi, jax_moe::DispatchRecvImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Attr<int64_t>("comm_id")
                                  .Arg<ffi::Token>()               // program order (ordered_ffi.py)
                                  .Ret<ffi::Token>()
                                  .Arg<ffi::Buffer<ffi::S32>>()    // send_dest
                                  .Ret<ffi::AnyBuffer>()           // x
                                  .Ret<ffi::Buffer<ffi::F32>>()    // scales
                                  .Ret<ffi::Buffer<ffi::F32>>()    // weights
                                  .Ret<ffi::Buffer<ffi::S32>>()    // group_sizes
                                  .Ret<ffi::Buffer<ffi::S32>>()    // tokens_per_expert
                                  .Ret<ffi::Buffer<ffi::S32>>());  // slot_rows

XLA_FFI_DEFINE_HANDLER_SYMBOL(HostDispatchFfi, jax_moe::DispatchImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Attr<int64_t>("comm_id")
                                  .Arg<ffi::Token>()               // program order (ordered_ffi.py)
                                  .Ret<ffi::Token>()
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
                                  .Ret<ffi::Buffer<ffi::S32>>());  // slot_rows

XLA_FFI_DEFINE_HANDLER_SYMBOL(HostCombineSendFfi, jax_moe::CombineSendImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Attr<int64_t>("comm_id")
                                  .Arg<ffi::Token>()               // program order (ordered_ffi.py)
                                  .Ret<ffi::Token>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()   // y
                                  .Arg<ffi::Buffer<ffi::S32>>()    // slot_rows
                                  .Arg<ffi::Buffer<ffi::F32>>()    // row_weights
                                  .Ret<ffi::Buffer<ffi::S32>>());  // done

XLA_FFI_DEFINE_HANDLER_SYMBOL(HostCombineRecvFfi, jax_moe::CombineRecvImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Attr<int64_t>("comm_id")
                                  .Arg<ffi::Token>()               // program order (ordered_ffi.py)
                                  .Ret<ffi::Token>()
                                  .Arg<ffi::Buffer<ffi::S32>>()    // done
                                  .Arg<ffi::Buffer<ffi::S32>>()    // send_dest
                                  .Arg<ffi::Buffer<ffi::F32>>()    // topk_weights
                                  .Ret<ffi::Buffer<ffi::BF16>>()); // out

XLA_FFI_DEFINE_HANDLER_SYMBOL(HostCombineFfi, jax_moe::CombineImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Attr<int64_t>("comm_id")
                                  .Arg<ffi::Token>()               // program order (ordered_ffi.py)
                                  .Ret<ffi::Token>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()   // y
                                  .Arg<ffi::Buffer<ffi::S32>>()    // slot_rows
                                  .Arg<ffi::Buffer<ffi::F32>>()    // row_weights
                                  .Arg<ffi::Buffer<ffi::S32>>()    // send_dest
                                  .Arg<ffi::Buffer<ffi::F32>>()    // topk_weights
                                  .Ret<ffi::Buffer<ffi::BF16>>()   // out
                                  .Ret<ffi::Buffer<ffi::S32>>());  // done
