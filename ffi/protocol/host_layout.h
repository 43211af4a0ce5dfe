// Buffer layout of the host protocol: the host backend (ffi/host/exchange.cc) and the cuda
// backend's host proxies, whose kernels (cuda/proxy_rows.cu) move rows in the same buffers.
// The NVLink kernels' layout is ffi/protocol/nvlink_layout.h. Header-only, host and device.
#pragma once

#include <cstddef>

#include "ffi/protocol/dims.h"

namespace jax_moe {

// The host protocol (ffi/host/exchange.cc): byte offsets inside the buffer of one rank (one
// allocation, written by every peer):
//   u64 dispatch_flag[R]      source s stores its dispatch sequence at [s] after its rows
//   u64 dispatch_ack[R]       destination d stores the dispatch sequence it consumed at [d]
//   u64 combine_flag[R]       expert rank d stores its combine sequence at [d] after its rows
//   u64 combine_ack[R]        source s stores the combine sequence it consumed at [s]
//   i32 recv_num_tokens[R]    tokens sent by source s (already clamped to [0, T])
//   i32 recv_ids[R][T][K]     expert id of slot (t, k) of source s; -1 when not routed
//   f32 recv_weights[R][T][K] router weight of that slot
//   recv_tokens[R][T]         token_bytes each: source s writes token t at [s][t] only when
//                             t has a slot on this rank (a token crosses the link once)
//   combine region            source mode: bf16 comb[T][K][H], row of slot (t, k) of this
//                             rank's tokens, written by the rank that holds the slot;
//                             expert mode: partial part[R][T][H], written by expert rank d at [d]
struct BufferLayout {
  size_t dispatch_flag;
  size_t dispatch_ack;
  size_t combine_flag;
  size_t combine_ack;
  size_t recv_num_tokens;
  size_t recv_ids;
  size_t recv_weights;
  size_t recv_tokens;
  size_t combine;
  size_t total;
};

JAX_MOE_HD inline BufferLayout buffer_layout(const MoeDims& d) {
  const size_t R = d.world, T = d.max_tokens, K = d.topk, H = d.hidden;
  BufferLayout b;
  b.dispatch_flag = 0;
  b.dispatch_ack = b.dispatch_flag + 8 * R;
  b.combine_flag = b.dispatch_ack + 8 * R;
  b.combine_ack = b.combine_flag + 8 * R;
  b.recv_num_tokens = align_up(b.combine_ack + 8 * R, 256);
  b.recv_ids = align_up(b.recv_num_tokens + 4 * R, 256);
  b.recv_weights = align_up(b.recv_ids + 4 * R * T * K, 256);
  b.recv_tokens = align_up(b.recv_weights + 4 * R * T * K, 256);
  b.combine = align_up(b.recv_tokens + R * T * token_bytes(d), 256);
  const size_t combine_bytes = d.reduce_expert ? R * T * H * partial_bytes(d) : T * K * H * 2;
  b.total = align_up(b.combine + combine_bytes, 256);
  return b;
}

}  // namespace jax_moe
