// The row work of the cuda host proxies (ffi/cuda/host_proxy.h) on the GPU: each half of the
// host protocol (ffi/host/exchange.h, buffer layout ffi/protocol/host_layout.h) runs as a CPU
// phase of the proxy thread, one of these kernels, and another CPU phase. The kernels read and
// write the host memory the protocol's buffers live in, mapped into the device: this rank's
// host buffer, the buffers of the other ranks of this host and the staging copies of the
// remote ranks (one cudaHostRegister each, at setup). Optionally the rows stay in device
// memory (ProxyRowsView::rows_to, terms_to, rows_from): between ranks of one host (NVLink or
// the same GPU), and to and from ranks on other hosts (device staging copies and the rank's
// device buffer, which the TransferEngine reads and writes: FI_HMEM); routes and flags stay in
// host memory, where the proxies' CPU phases read them. The kernels produce the host
// backend's bits (docs/semantics.md).
// Host-compilable: launchers and the structs they share with the proxy.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/api.cuh"
#include "ffi/protocol/host_layout.h"

namespace jax_moe {

// What the proxy's CPU phases and the kernels pass each other, in mapped pinned host memory.
// The CPU writes before it reports its phase done; a kernel runs after that report, and the
// next CPU phase starts after the kernel (the stream rings the next doorbell). The kernels
// read the CPU's words from a device copy the stream makes after the answer
// (ProxyRowsView::control_copy): when every warp of a grid loads the same mapped word, the
// loads are served one after another, ~1 us each (2048 warps: 2 ms, measured on an H200).
struct ProxyControl {
  int32_t go;            // the CPU phase before the kernel succeeded (else the kernel skips)
  int32_t given_tokens;  // dispatch_send kernel -> CPU: num_tokens as given
  uint64_t first_bad;    // dispatch_send kernel -> CPU: slot << 32 | uint32(id) of the first
                         // invalid id in (t, k) order; ~0 when none
  int32_t token_count;   // dispatch_recv CPU -> kernel: entries of ProxyRowsView::tokens
  int32_t zero_count;    // dispatch_recv CPU -> kernel: entries of ProxyRowsView::zero_rows
};

// Device memory of one proxy, touched only by its kernels: the dispatch_send kernel's
// first invalid slot, and its last-block counter. Initialized to {~0, 0}; the last block
// resets it.
struct ProxyScratch {
  unsigned long long first_bad;
  unsigned int blocks_done;
};

// Device memory for the rows a rank sends to itself, which never need to cross PCIe: its own
// tokens' rows (dispatch) and the combine terms it holds for its own tokens. Layout:
//   tokens   [T] token_bytes each, as the host buffer's recv_tokens[me]
//   combine  expert mode: part [T][H] in the partial dtype, as part[me] of the host buffer;
//            source mode: comb [T][K][H] bf16 (only the slots this rank holds are written)
// At R = 2 these are half the bytes the rows kernels moved through mapped host memory.
struct SelfLayout {
  size_t tokens;
  size_t combine;
  size_t total;
};

JAX_MOE_HD inline SelfLayout self_layout(const MoeDims& d) {
  const size_t T = d.max_tokens, K = d.topk, H = d.hidden;
  SelfLayout s;
  s.tokens = 0;
  s.combine = align_up(T * token_bytes(d), 256);
  s.total = s.combine + (d.reduce_expert ? T * H * partial_bytes(d) : T * K * H * 2);
  return s;
}

// Every address the kernels use, fixed for the proxy's life (command buffers replay them).
struct ProxyRowsView {
  MoeDims dims;
  char* const* peers;        // device [R]: every rank's host buffer, or this rank's staging
                             // copy of it (remote ranks), as the device maps it
  char* buffer;              // this rank's host buffer, mapped
  // Device [R]: where this rank writes its rows (rows_to) and its combine terms (terms_to)
  // for rank p, each addressed by buffer-layout offsets: p's device buffer in the host layout
  // as mapped here (near device rows, JAX_MOE_PROXY_NEAR_ROWS=device), this rank's device
  // staging copy of it (a rank on another host, JAX_MOE_PROXY_HMEM: one allocation for the
  // rows and one for the terms, ffi/cuda/device_staging.h), else `peers[p]`.
  char* const* rows_to;
  char* const* terms_to;
  // Device [R]: where the rows and combine terms of rank p land for this rank: its device
  // buffer in the host layout (near device rows, or a rank on another host whose writes
  // land in device memory), else its host buffer.
  char* const* rows_from;
  char* self;                // device [self_layout(dims).total]: rows for this rank itself
  ProxyControl* control;     // mapped: the kernels' words for the CPU
  const ProxyControl* control_copy;  // device: the CPU's words (go, token_count, zero_count)
  ProxyScratch* scratch;     // device
  const int32_t* aborted;    // the device's DeviceCounters::aborted: the doorbells gave up
  // Mapped staging of the per-slot data (ffi/host/exchange.h, RecvPlan):
  int32_t* slot_rows;        // [R, T, K] dispatch_recv's plan; combine_send's input copy
  float* weights;            // [C]
  int32_t* group_sizes;      // [L]
  int32_t* tokens_per_expert;// [L]
  int32_t* tokens;           // [R * T]
  int32_t* zero_rows;        // [C]
};

// Send half of dispatch (after the proxy waited for the acknowledgements): send_dest [T, K],
// this rank's token count, routes and weights into every peer's view, and each routed token's
// row (fp8-quantized when `input` asks) into token_slot(peer, rank, t) of every other rank
// holding one of its slots, once per rank, and into `self` when this rank holds one.
// Arguments as launch_dispatch's.
cudaError_t launch_proxy_dispatch_send(const ProxyRowsView& v, TokenInput input, const void* x,
                                       const float* x_scales, const int32_t* topk_ids,
                                       const float* topk_weights, const int32_t* num_tokens,
                                       int32_t* send_dest, cudaStream_t stream);

// Receive half of dispatch (after the proxy's plan): copies the plan's per-slot outputs and
// places each listed token from the buffer into all of its rows of x / scales (each token read
// once); zeroes the padding rows. Rows past the total keep what they held.
cudaError_t launch_proxy_dispatch_recv(const ProxyRowsView& v, void* x, float* scales,
                                       float* weights, int32_t* group_sizes,
                                       int32_t* tokens_per_expert, int32_t* slot_rows,
                                       cudaStream_t stream);

// Send half of combine (after the proxy waited for the acknowledgements): source mode, each
// slot's row of y (zeros when dropped) into comb[t][k] of its source's view; expert mode, one
// partial per (source, token) with a slot here. Copies slot_rows to the staging for the spans.
cudaError_t launch_proxy_combine_send(const ProxyRowsView& v, const void* y,
                                      const int32_t* slot_rows, const float* row_weights,
                                      int32_t* done, cudaStream_t stream);

// Receive half of combine (after the proxy's wait): out [T, H] summed from the buffer.
cudaError_t launch_proxy_combine_recv(const ProxyRowsView& v, const int32_t* send_dest,
                                      const float* topk_weights, void* out,
                                      cudaStream_t stream);

}  // namespace jax_moe
