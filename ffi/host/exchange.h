// The four halves of dispatch/combine on CPU, for one rank, run by the FFI handler of that
// rank's device thread. They follow the CUDA kernels (cuda/dispatch.cu, cuda/combine.cu) step
// for step on the same buffer layout (ffi/protocol/host_layout.h) and produce the same bits
// (docs/semantics.md). A wait that times out records TIMEOUT naming the peer and returns
// early (outputs then hold zeros); errors are read by Communicator.check().
#pragma once

#include <cstdint>

#include "ffi/exchange_checks.h"
#include "ffi/host/state.h"

namespace jax_moe::host {

// x: bf16 [T, H] or fp8 codes [T, H] (with x_scales f32 [T, H/bs]); topk_ids/topk_weights
// [T, K]; num_tokens int32 [1]; send_dest int32 [T, K] gets each valid slot's rank, else -1.
void dispatch_send(HostRankState& s, TokenInput input, const void* x, const float* x_scales,
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

// The same halves cut into the phases around their row work, for the cuda host proxies
// (ffi/cuda/host_proxy.h), whose GPU moves the rows between a half's phases (cuda/proxy_rows.cuh)
// in the host buffer and staging copies of `s`, as the halves above do on the CPU. A *_begin
// that returns false (call order, a timeout: recorded) leaves the kernel nothing to do and
// its *_end is not called.

// Order check, then the wait for the receivers' acknowledgement of the previous dispatch.
bool dispatch_send_begin(HostRankState& s);
// After the kernel wrote this rank's token count, routes (invalid ids as -1) and rows into
// every peer's view: records BAD_NUM_TOKENS (num_tokens as given) and INVALID_EXPERT_ID (the
// first invalid id in (t, k) order, if `bad_id`), publishes and posts the writes.
void dispatch_send_end(HostRankState& s, int given_tokens, bool bad_id, int32_t first_bad_id);

// The layout of dispatch_recv without the rows: slot_rows [R, T, K], weights [C],
// group_sizes / tokens_per_expert [L] as dispatch_recv writes them; tokens [R * T] the tokens
// (source * T + t) with a row here, `token_count` of them in (s, t) order; zero_rows [C] (may
// be null) the padding rows inside the segments, `zero_count` of them.
struct RecvPlan {
  int32_t* slot_rows;
  float* weights;
  int32_t* group_sizes;
  int32_t* tokens_per_expert;
  int32_t* tokens;
  int32_t* zero_rows;
  int token_count = 0;
  int zero_count = 0;
};
// Order check, waits for the routes and rows of every source, then fills `plan` (zeros and
// -1 slot rows, no tokens, when it returns false).
bool dispatch_recv_begin(HostRankState& s, RecvPlan& plan);
// After the rows were read out of the buffer: acknowledges them to every source.
void dispatch_recv_end(HostRankState& s);

// Order check, then the wait for the sources' acknowledgement of the previous combine.
bool combine_send_begin(HostRankState& s);
// After the rows or partials are in the sources' views: publishes and posts them.
void combine_send_end(HostRankState& s, const int32_t* slot_rows);

// Order check, then the wait for every expert rank's rows or partials.
bool combine_recv_begin(HostRankState& s, const int32_t* send_dest);
// After the sums were read out of the buffer: acknowledges them to every expert rank.
void combine_recv_end(HostRankState& s);

}  // namespace jax_moe::host
