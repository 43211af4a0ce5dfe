// The six dispatch/combine FFI handlers, written once over a platform: the cuda backend
// (ffi/cuda/exchange_ffi.cc) and the host backend (ffi/host/handlers.cc). A handler finds the
// rank state, checks every buffer against it (ffi/exchange_checks.h) before anything runs,
// so a bad call leaves no half-done exchange, and hands the platform raw pointers. Operand
// order is jax_moe/backends/native_backend.py's.
//
// A platform P provides
//   State, Call          its rank state, and what a handler gets besides the device ordinal
//                        and the communicator id (the CUDA stream; nothing on the host)
//   begin_call(site, comm_id, ordinal) -> ffi::ErrorOr<State*>
//   dispatch_send(site, call, state, TokenInput, DispatchSendArgs) -> ffi::Error
//   dispatch_recv(site, call, state, DispatchRecvArgs)
//   dispatch(site, call, state, TokenInput, DispatchSendArgs, DispatchRecvArgs)
//   combine_send(site, call, state, CombineSendArgs)
//   combine_recv(site, call, state, CombineRecvArgs)
//   combine(site, call, state, CombineSendArgs, CombineRecvArgs)
// and binds ExchangeHandlers<P>::* behind its own prefix of the bind_* operand lists below.
#pragma once

#include <cstdint>
#include <utility>

#include "ffi/exchange_checks.h"

namespace jax_moe {

// The buffers of each half, checked, as the platforms' launchers take them.
struct DispatchSendArgs {
  const void* x;             // bf16 or fp8 [T, H]
  const float* x_scales;     // [T, H/bs] with fp8 input, else unused
  const int32_t* topk_ids;   // [T, K]
  const float* topk_weights; // [T, K]
  const int32_t* num_tokens; // [1]
  int32_t* send_dest;        // [T, K]
};

struct DispatchRecvArgs {
  void* x;                   // [C, H] fp8 codes or bf16
  float* scales;             // [C, H/bs] (fp8 rows)
  float* weights;            // [C]
  int32_t* group_sizes;      // [L]
  int32_t* tokens_per_expert;// [L]
  int32_t* slot_rows;        // [R, T, K]
};

struct CombineSendArgs {
  const void* y;             // bf16 [C, H]
  const int32_t* slot_rows;  // [R, T, K]
  const float* row_weights;  // [C]
  int32_t* done;             // [1]
};

struct CombineRecvArgs {
  const int32_t* send_dest;  // [T, K]
  const float* topk_weights; // [T, K]
  void* out;                 // bf16 [T, H]
};

template <typename P>
struct ExchangeHandlers {
  using Call = typename P::Call;
  using Int = ffi::Buffer<ffi::S32>;
  using Float = ffi::Buffer<ffi::F32>;
  using Bf16 = ffi::Buffer<ffi::BF16>;
  template <typename T>
  using Out = ffi::Result<T>;

  static ffi::Error dispatch_send(Call call, int32_t ordinal, int64_t comm_id, ffi::AnyBuffer x,
                                  ffi::AnyBuffer x_scales, Int topk_ids, Float topk_weights,
                                  Int num_tokens, Out<Int> send_dest) {
    const CallSite site{"jax_moe_dispatch_send", "Communicator.dispatch_send"};
    auto state = P::begin_call(site, comm_id, ordinal);
    if (state.has_error()) return state.error();
    auto input = check_dispatch_send(site, (*state)->dims, x, x_scales, topk_ids, topk_weights,
                                     num_tokens, *send_dest);
    if (input.has_error()) return input.error();
    return P::dispatch_send(site, call, **state, *input,
                            send_args(x, x_scales, topk_ids, topk_weights, num_tokens,
                                      send_dest));
  }

  // send_dest (from dispatch_send) is taken only so XLA orders this call after it.
  static ffi::Error dispatch_recv(Call call, int32_t ordinal, int64_t comm_id, Int send_dest,
                                  Out<ffi::AnyBuffer> x, Out<Float> scales, Out<Float> weights,
                                  Out<Int> group_sizes, Out<Int> tokens_per_expert,
                                  Out<Int> slot_rows) {
    const CallSite site{"jax_moe_dispatch_recv", "Communicator.dispatch_recv"};
    auto state = P::begin_call(site, comm_id, ordinal);
    if (state.has_error()) return state.error();
    const MoeDims& d = (*state)->dims;
    if (auto err = expect_shape(site, "send_dest", send_dest.dimensions(),
                                {{"max_tokens", d.max_tokens}, {"experts_per_token", d.topk}});
        err.failure())
      return err;
    if (auto err = check_dispatch_recv(site, d, x, scales, weights, group_sizes,
                                       tokens_per_expert, slot_rows);
        err.failure())
      return err;
    return P::dispatch_recv(site, call, **state,
                            recv_args(x, scales, weights, group_sizes, tokens_per_expert,
                                      slot_rows));
  }

  static ffi::Error dispatch(Call call, int32_t ordinal, int64_t comm_id, ffi::AnyBuffer x,
                             ffi::AnyBuffer x_scales, Int topk_ids, Float topk_weights,
                             Int num_tokens, Out<Int> send_dest, Out<ffi::AnyBuffer> x_out,
                             Out<Float> scales, Out<Float> weights, Out<Int> group_sizes,
                             Out<Int> tokens_per_expert, Out<Int> slot_rows) {
    const CallSite site{"jax_moe_dispatch", "Communicator.dispatch"};
    auto state = P::begin_call(site, comm_id, ordinal);
    if (state.has_error()) return state.error();
    const MoeDims& d = (*state)->dims;
    if (auto err = check_dispatch_recv(site, d, x_out, scales, weights, group_sizes,
                                       tokens_per_expert, slot_rows);
        err.failure())
      return err;
    auto input = check_dispatch_send(site, d, x, x_scales, topk_ids, topk_weights, num_tokens,
                                     *send_dest);
    if (input.has_error()) return input.error();
    return P::dispatch(site, call, **state, *input,
                       send_args(x, x_scales, topk_ids, topk_weights, num_tokens, send_dest),
                       recv_args(x_out, scales, weights, group_sizes, tokens_per_expert,
                                 slot_rows));
  }

  static ffi::Error combine_send(Call call, int32_t ordinal, int64_t comm_id, Bf16 y,
                                 Int slot_rows, Float row_weights, Out<Int> done) {
    const CallSite site{"jax_moe_combine_send", "Communicator.combine_send"};
    auto state = P::begin_call(site, comm_id, ordinal);
    if (state.has_error()) return state.error();
    if (auto err = check_combine_send(site, (*state)->dims, y, slot_rows, row_weights);
        err.failure())
      return err;
    if (auto err = expect_shape(site, "done (output)", done->dimensions(), {{"1", 1}});
        err.failure())
      return err;
    return P::combine_send(site, call, **state,
                           {y.untyped_data(), slot_rows.typed_data(), row_weights.typed_data(),
                            done->typed_data()});
  }

  // `done` (from combine_send) is taken only so XLA orders this call after it.
  static ffi::Error combine_recv(Call call, int32_t ordinal, int64_t comm_id, Int done,
                                 Int send_dest, Float topk_weights, Out<Bf16> out) {
    const CallSite site{"jax_moe_combine_recv", "Communicator.combine_recv"};
    auto state = P::begin_call(site, comm_id, ordinal);
    if (state.has_error()) return state.error();
    if (auto err = expect_shape(site, "done", done.dimensions(), {{"1", 1}}); err.failure())
      return err;
    if (auto err = check_combine_recv(site, (*state)->dims, send_dest, topk_weights, *out);
        err.failure())
      return err;
    return P::combine_recv(site, call, **state,
                           {send_dest.typed_data(), topk_weights.typed_data(),
                            out->untyped_data()});
  }

  static ffi::Error combine(Call call, int32_t ordinal, int64_t comm_id, Bf16 y, Int slot_rows,
                            Float row_weights, Int send_dest, Float topk_weights, Out<Bf16> out,
                            Out<Int> done) {
    const CallSite site{"jax_moe_combine", "Communicator.combine"};
    auto state = P::begin_call(site, comm_id, ordinal);
    if (state.has_error()) return state.error();
    const MoeDims& d = (*state)->dims;
    if (auto err = check_combine_send(site, d, y, slot_rows, row_weights); err.failure())
      return err;
    if (auto err = check_combine_recv(site, d, send_dest, topk_weights, *out); err.failure())
      return err;
    if (auto err = expect_shape(site, "done (output)", done->dimensions(), {{"1", 1}});
        err.failure())
      return err;
    return P::combine(site, call, **state,
                      {y.untyped_data(), slot_rows.typed_data(), row_weights.typed_data(),
                       done->typed_data()},
                      {send_dest.typed_data(), topk_weights.typed_data(), out->untyped_data()});
  }

 private:
  static DispatchSendArgs send_args(ffi::AnyBuffer x, ffi::AnyBuffer x_scales, Int topk_ids,
                                    Float topk_weights, Int num_tokens, Out<Int>& send_dest) {
    return {x.untyped_data(), static_cast<const float*>(x_scales.untyped_data()),
            topk_ids.typed_data(), topk_weights.typed_data(), num_tokens.typed_data(),
            send_dest->typed_data()};
  }
  static DispatchRecvArgs recv_args(Out<ffi::AnyBuffer>& x, Out<Float>& scales,
                                    Out<Float>& weights, Out<Int>& group_sizes,
                                    Out<Int>& tokens_per_expert, Out<Int>& slot_rows) {
    return {x->untyped_data(), scales->typed_data(), weights->typed_data(),
            group_sizes->typed_data(), tokens_per_expert->typed_data(),
            slot_rows->typed_data()};
  }
};

// The operands of each target, appended to a platform's binding prefix `b` (its context,
// the comm_id attribute and, on the host, the ordering token), in ExchangeHandlers' order.
template <typename B>
auto bind_dispatch_send(B&& b) {
  return std::move(b)
      .template Arg<ffi::AnyBuffer>()          // x
      .template Arg<ffi::AnyBuffer>()          // x_scales
      .template Arg<ffi::Buffer<ffi::S32>>()   // topk_ids
      .template Arg<ffi::Buffer<ffi::F32>>()   // topk_weights
      .template Arg<ffi::Buffer<ffi::S32>>()   // num_tokens
      .template Ret<ffi::Buffer<ffi::S32>>();  // send_dest
}

// dispatch_recv's and dispatch's outputs after send_dest.
template <typename B>
auto bind_dispatch_outputs(B&& b) {
  return std::move(b)
      .template Ret<ffi::AnyBuffer>()          // x
      .template Ret<ffi::Buffer<ffi::F32>>()   // scales
      .template Ret<ffi::Buffer<ffi::F32>>()   // weights
      .template Ret<ffi::Buffer<ffi::S32>>()   // group_sizes
      .template Ret<ffi::Buffer<ffi::S32>>()   // tokens_per_expert
      .template Ret<ffi::Buffer<ffi::S32>>();  // slot_rows
}

template <typename B>
auto bind_dispatch_recv(B&& b) {
  return bind_dispatch_outputs(std::move(b).template Arg<ffi::Buffer<ffi::S32>>());  // send_dest
}

template <typename B>
auto bind_dispatch(B&& b) {
  return bind_dispatch_outputs(bind_dispatch_send(std::move(b)));
}

template <typename B>
auto bind_combine_send(B&& b) {
  return std::move(b)
      .template Arg<ffi::Buffer<ffi::BF16>>()  // y
      .template Arg<ffi::Buffer<ffi::S32>>()   // slot_rows
      .template Arg<ffi::Buffer<ffi::F32>>()   // row_weights
      .template Ret<ffi::Buffer<ffi::S32>>();  // done
}

template <typename B>
auto bind_combine_recv(B&& b) {
  return std::move(b)
      .template Arg<ffi::Buffer<ffi::S32>>()    // done
      .template Arg<ffi::Buffer<ffi::S32>>()    // send_dest
      .template Arg<ffi::Buffer<ffi::F32>>()    // topk_weights
      .template Ret<ffi::Buffer<ffi::BF16>>();  // out
}

template <typename B>
auto bind_combine(B&& b) {
  return std::move(b)
      .template Arg<ffi::Buffer<ffi::BF16>>()   // y
      .template Arg<ffi::Buffer<ffi::S32>>()    // slot_rows
      .template Arg<ffi::Buffer<ffi::F32>>()    // row_weights
      .template Arg<ffi::Buffer<ffi::S32>>()    // send_dest
      .template Arg<ffi::Buffer<ffi::F32>>()    // topk_weights
      .template Ret<ffi::Buffer<ffi::BF16>>()   // out
      .template Ret<ffi::Buffer<ffi::S32>>();   // done
}

}  // namespace jax_moe
