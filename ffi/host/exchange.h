// The four halves of dispatch/combine on CPU, for one rank, run by the FFI handler of that
// rank's device thread. They follow the CUDA kernels (cuda/dispatch.cu, cuda/combine.cu) step
// for step on the same buffer layout (cuda/layout.cuh) and produce the same bits
// (docs/semantics.md). A wait that times out records TIMEOUT naming the peer and returns
// early (outputs then hold zeros); errors are read by Communicator.check().
#pragma once

#include <cstdint>

#include "ffi/exchange_checks.h"
#include "ffi/host/state.h"

namespace jax_moe::host {

// x: bf16 [T, H] or fp8 codes [T, H] (with x_scales f32 [T, H/bs]); topk_ids/topk_weights
// [T, K]; num_tokens int32 [1]; send_dest int32 [T, K] gets each valid slot's rank, else -1.
void dispatch_send(HostRankState& s, RowInput input, const void* x, const float* x_scales,
                   const int32_t* topk_ids, const float* topk_weights, const int32_t* num_tokens,
                   int32_t* send_dest);

// x [C, H] (fp8 codes or bf16), scales f32 [C, H/bs] (fp8 only), weights f32 [C],
// group_sizes / tokens_per_expert int32 [L], slot_rows int32 [R, T, K] (row of slot (s, t, k)
// here; -1 not on this rank; -2 dropped by capacity overflow).
void dispatch_recv(HostRankState& s, void* x, float* scales, float* weights,
                   int32_t* group_sizes, int32_t* tokens_per_expert, int32_t* slot_rows);

// y bf16 [C, H] in the dispatched layout; slot_rows and row_weights from dispatch_recv.
void combine_send(HostRankState& s, const uint16_t* y, const int32_t* slot_rows,
                  const float* row_weights, int32_t* done);

// send_dest [T, K] from dispatch_send, topk_weights f32 [T, K]; out bf16 [T, H].
void combine_recv(HostRankState& s, const int32_t* send_dest, const float* topk_weights,
                  uint16_t* out);

}  // namespace jax_moe::host
