// Launchers of the CUDA dispatch/combine kernels: plain pointers, sizes and a stream.
// Every launcher enqueues its kernels on `stream` and returns the launch status; none blocks
// the host. Buffers are row-major; shapes use the MoeDims names (T, H, K, R, L, C = capacity).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/layout.cuh"

namespace jax_moe {

// How dispatch_send receives the token rows.
enum TokenInput : int {
  kInputBf16 = 0,          // x bf16 [T, H], sent as bf16
  kInputBf16Quantize = 1,  // x bf16 [T, H], quantized to fp8 + scales on the way out
  kInputFp8 = 2,           // x fp8 e4m3fn [T, H] with x_scales f32 [T, H/bs], sent as given
};

// Source half of dispatch. Writes every routed token to each rank that holds one of its
// slots, the routes to every rank, then publishes the sequence. `num_tokens` is int32 [1];
// `send_dest` int32 [T, K] gets the rank of each valid slot, -1 otherwise.
cudaError_t launch_dispatch_send(const CommView& view, TokenInput input, const void* x,
                                 const float* x_scales, const int32_t* topk_ids,
                                 const float* topk_weights, const int32_t* num_tokens,
                                 int32_t* send_dest, cudaStream_t stream);

// Destination half of dispatch. Waits for every source, then writes the deterministic
// layout: x [C, H] (fp8 or bf16), scales f32 [C, H/bs] (fp8 only, else unused), weights f32 [C],
// group_sizes / tokens_per_expert int32 [L], slot_rows int32 [R, T, K] (row of slot (s, t, k)
// here; -1 when the slot is not on this rank; -2 when it was dropped by capacity overflow).
cudaError_t launch_dispatch_recv(const CommView& view, void* x, float* scales, float* weights,
                                 int32_t* group_sizes, int32_t* tokens_per_expert,
                                 int32_t* slot_rows, cudaStream_t stream);

// Expert half of combine. y bf16 [C, H]; slot_rows and row_weights ([C]) from dispatch_recv.
// `done` int32 [1] is a marker output that orders combine_recv after this call.
cudaError_t launch_combine_send(const CommView& view, const void* y, const int32_t* slot_rows,
                                const float* row_weights, int32_t* done, cudaStream_t stream);

// Source half of combine. send_dest int32 [T, K] from dispatch_send, topk_weights f32 [T, K];
// out bf16 [T, H].
cudaError_t launch_combine_recv(const CommView& view, const int32_t* send_dest,
                                const float* topk_weights, void* out, cudaStream_t stream);

}  // namespace jax_moe
