// Checks of the dispatch/combine FFI buffers against one rank's dims, shared by the cuda and
// host handlers (same targets, same argument order: jax_moe/backends/cuda.py).
#pragma once

#include "ffi/handler_checks.h"
#include "ffi/protocol/dims.h"

namespace jax_moe {

// dispatch_send arguments; `x_scales` is the empty f32 [0] when x is bf16. Returns how the
// rows come (TokenInput, ffi/protocol/dims.h).
ffi::ErrorOr<TokenInput> check_dispatch_send(const CallSite& site, const MoeDims& d,
                                             ffi::AnyBuffer x, ffi::AnyBuffer x_scales,
                                             ffi::Buffer<ffi::S32> topk_ids,
                                             ffi::Buffer<ffi::F32> topk_weights,
                                             ffi::Buffer<ffi::S32> num_tokens,
                                             ffi::Buffer<ffi::S32> send_dest);

// dispatch_recv outputs; `scales` is the empty f32 [0] with bf16 dispatch.
ffi::Error check_dispatch_recv(const CallSite& site, const MoeDims& d,
                               ffi::Result<ffi::AnyBuffer> x,
                               ffi::Result<ffi::Buffer<ffi::F32>> scales,
                               ffi::Result<ffi::Buffer<ffi::F32>> weights,
                               ffi::Result<ffi::Buffer<ffi::S32>> group_sizes,
                               ffi::Result<ffi::Buffer<ffi::S32>> tokens_per_expert,
                               ffi::Result<ffi::Buffer<ffi::S32>> slot_rows);

ffi::Error check_combine_send(const CallSite& site, const MoeDims& d, ffi::Buffer<ffi::BF16> y,
                              ffi::Buffer<ffi::S32> slot_rows, ffi::Buffer<ffi::F32> row_weights);

ffi::Error check_combine_recv(const CallSite& site, const MoeDims& d,
                              ffi::Buffer<ffi::S32> send_dest, ffi::Buffer<ffi::F32> topk_weights,
                              ffi::Buffer<ffi::BF16> out);

}  // namespace jax_moe
