// Launchers of the CUDA dispatch/combine and all-reduce kernels: plain pointers, sizes and a
// stream.
// Every launcher enqueues its kernels on `stream` and returns the launch status; none blocks
// the host. Buffers are row-major; shapes use the MoeDims names (T, H, K, R, L, C = capacity).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/comm_view.cuh"
#include "ffi/protocol/all_reduce_layout.h"
#include "ffi/protocol/host_layout.h"
#include "ffi/protocol/nvlink_layout.h"

namespace jax_moe {

// Dispatch over NVLink (protocol: ffi/protocol/nvlink_layout.h). `phases` (ExchangePhase, in
// the same header) picks the halves this launch runs; the fused op runs both in one kernel.
// Send half (source rank): writes its routes and every routed token to each rank that holds
// one of its slots. `num_tokens` is int32 [1]; `send_dest` int32 [T, K] gets the rank of each
// valid slot, -1 otherwise. Receive half (destination rank): writes the layout of
// docs/semantics.md: x [C, H] (fp8 or bf16; rows past sum(group_sizes) untouched), scales f32
// [C, H/bs] (fp8 only, else unused), weights f32 [C], group_sizes / tokens_per_expert int32
// [L], slot_rows int32 [R, T, K] (row of slot (s, t, k) here; -1 when the slot is not on this
// rank; -2 when it was dropped by capacity overflow). Pointers a launch's phases do not use
// may be null. At world 1 the fused op runs a kernel without the buffer (a permutation on
// one GPU, same outputs bit for bit); the halves always go through the buffer.
cudaError_t launch_dispatch(const CommView& view, int phases, TokenInput input, const void* x,
                            const float* x_scales, const int32_t* topk_ids,
                            const float* topk_weights, const int32_t* num_tokens,
                            int32_t* send_dest, void* x_out, float* scales_out,
                            float* weights_out, int32_t* group_sizes,
                            int32_t* tokens_per_expert, int32_t* slot_rows,
                            cudaStream_t stream);

// Combine over NVLink, halves as for dispatch. Send half (expert rank): y bf16 [C, H];
// slot_rows and row_weights ([C]) from dispatch; `done` int32 [1] (may be null) is a marker
// output that orders a later receive half after it. Receive half (source rank): send_dest
// int32 [T, K] from dispatch, topk_weights f32 [T, K]; out bf16 [T, H]. World 1 as dispatch.
cudaError_t launch_combine(const CommView& view, int phases, const void* y,
                           const int32_t* slot_rows, const float* row_weights, int32_t* done,
                           const int32_t* send_dest, const float* topk_weights, void* out,
                           cudaStream_t stream);

// Element type of an all-reduce; every type is summed in f32 and rounded once.
enum ReduceDtype : int {
  kReduceF32 = 0,
  kReduceBf16 = 1,
  kReduceF16 = 2,
};

// All-reduce (sum) of x [n] over the view's ranks into out [n] (x and out 16-byte aligned,
// n * element size <= lay.slot_bytes). Every rank sums the R values of an element in rank
// order 0..R-1 in f32 and rounds once, so all ranks get bit-identical results, and one-shot,
// two-shot and the reference agree bit for bit. Waits time out into the view's error record.
// One-shot: each rank pushes its input into every peer's buffer, then reduces all of them.
cudaError_t launch_all_reduce_one_shot(const CommView& view, const AllReduceLayout& lay,
                                       ReduceDtype dtype, const void* x, void* out, int64_t n,
                                       cudaStream_t stream);
// Two-shot: rank s reduces segment s of the message (reduce-scatter through the peers'
// buffers), then pushes it to every peer (all-gather).
cudaError_t launch_all_reduce_two_shot(const CommView& view, const AllReduceLayout& lay,
                                       ReduceDtype dtype, const void* x, void* out, int64_t n,
                                       cudaStream_t stream);
// NVLS: `multicast` is a multicast mapping (every rank's copy of one [2][2][slot_bytes]
// region), `unicast` this rank's own copy of it. Rank s sums segment s of every copy with
// multimem.ld_reduce and stores the sum to every copy with multimem.st; the view's buffer
// carries only the flags. The order of the sum is the switch's: bit-identical on every rank
// (one value is stored to all), not necessarily to the other algorithms. Not yet run.
cudaError_t launch_all_reduce_nvls(const CommView& view, const AllReduceLayout& lay,
                                   char* multicast, char* unicast, ReduceDtype dtype,
                                   const void* x, void* out, int64_t n, cudaStream_t stream);

// One request to the host proxy (ffi/cuda/host_proxy.h) by a kernel: one thread rings
// `doorbell` (mapped pinned host memory, as the device addresses it) with `op` (< 256), then
// waits until the proxy answers, giving up after `wait_ns` (TIMEOUT in stage kStageProxy, this
// rank as the detail). After any timeout of this device it rings nothing. (With stream waits
// the stream rings with stream memory operations instead: CudaProxy::request.)
cudaError_t launch_proxy_request(const CommView& view, ProxyDoorbell* doorbell, uint32_t op,
                                 uint64_t wait_ns, cudaStream_t stream);

}  // namespace jax_moe
