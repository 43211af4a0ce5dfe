// Buffer layout of the host protocol: the host backend (ffi/host/exchange.cc) and the cuda
// backend's host proxies, whose kernels (cuda/proxy_rows.cu) move rows in the same buffers.
// The NVLink kernels' layout is ffi/protocol/nvlink_layout.h. Header-only, host and device.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

#include "ffi/protocol/dims.h"

namespace jax_moe {

// The host protocol (ffi/host/exchange.cc): byte offsets inside the buffer of one rank (one
// allocation, written by every peer):
//   u64 dispatch_flag[R]      source s stores its dispatch sequence at [s] after its rows
//   u64 dispatch_ack[R]       destination d stores the dispatch sequence it consumed at [d]
//   u64 combine_flag[R]       expert rank d stores its combine sequence at [d] after its rows
//   u64 combine_ack[R]        source s stores the combine sequence it consumed at [s]
//   routes[R]                 route_bytes(d) each, source s's block at [s]:
//                               i32 num_tokens at byte 0 (already clamped to [0, T]),
//                               RouteEntry [T][K] from byte 16 ({expert id or -1, weight} of
//                               slot (t, k)); a source fills it up to its num_tokens, so one
//                               write carries all of its routes
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
  size_t routes;
  size_t recv_tokens;
  size_t combine;
  size_t total;
};

// One slot's route: its expert id (-1 when the slot holds no token) and router weight.
struct RouteEntry {
  int32_t id;
  float weight;
};

constexpr size_t kRouteHeaderBytes = 16;  // num_tokens, padded so the entries stay aligned

JAX_MOE_HD inline size_t route_bytes(const MoeDims& d) {
  return align_up(kRouteHeaderBytes + sizeof(RouteEntry) * d.max_tokens * d.topk, 256);
}

JAX_MOE_HD inline BufferLayout buffer_layout(const MoeDims& d) {
  const size_t R = d.world, T = d.max_tokens, K = d.topk, H = d.hidden;
  BufferLayout b;
  b.dispatch_flag = 0;
  b.dispatch_ack = b.dispatch_flag + 8 * R;
  b.combine_flag = b.dispatch_ack + 8 * R;
  b.combine_ack = b.combine_flag + 8 * R;
  b.routes = align_up(b.combine_ack + 8 * R, 256);
  b.recv_tokens = b.routes + R * route_bytes(d);
  b.combine = align_up(b.recv_tokens + R * T * token_bytes(d), 256);
  const size_t combine_bytes = d.reduce_expert ? R * T * H * partial_bytes(d) : T * K * H * 2;
  b.total = align_up(b.combine + combine_bytes, 256);
  return b;
}

// Source `src`'s route block in `buffer` (a rank's buffer or a staging copy of one): its token
// count, and its RouteEntry [T][K].
JAX_MOE_HD inline size_t route_block(const BufferLayout& lay, const MoeDims& d, int src) {
  return lay.routes + size_t(src) * route_bytes(d);
}
JAX_MOE_HD inline int32_t* route_tokens(char* buffer, const BufferLayout& lay, const MoeDims& d,
                                        int src) {
  return reinterpret_cast<int32_t*>(buffer + route_block(lay, d, src));
}
JAX_MOE_HD inline RouteEntry* route_entries(char* buffer, const BufferLayout& lay,
                                            const MoeDims& d, int src) {
  return reinterpret_cast<RouteEntry*>(buffer + route_block(lay, d, src) + kRouteHeaderBytes);
}

// Source `src`'s rows recv_tokens[src] [T], and token t's slot among them.
JAX_MOE_HD inline size_t token_block(const BufferLayout& lay, const MoeDims& d, int src) {
  return lay.recv_tokens + size_t(src) * d.max_tokens * token_bytes(d);
}
JAX_MOE_HD inline char* token_slot(char* buffer, const BufferLayout& lay, const MoeDims& d,
                                   int src, int t) {
  return buffer + token_block(lay, d, src) + size_t(t) * token_bytes(d);
}

// Expert mode: expert rank `sender`'s partials part[sender] [T][H] in the combine region.
JAX_MOE_HD inline size_t partial_block(const BufferLayout& lay, const MoeDims& d, int sender) {
  return lay.combine + size_t(sender) * d.max_tokens * d.hidden * partial_bytes(d);
}

// The bytes of a rank's buffer that rank `sender` writes, ascending and disjoint: its route
// block, its rows recv_tokens[sender], and in the combine region its partials part[sender]
// (expert mode) or all of comb (source mode: any slot of the rank's tokens may be held by the
// sender). A staging copy of a remote rank holds only these (ffi/host/staging_extents.h).
struct ByteRange {
  size_t offset;
  size_t length;
};

inline std::array<ByteRange, 3> sender_ranges(const MoeDims& d, int sender) {
  const BufferLayout lay = buffer_layout(d);
  const size_t T = d.max_tokens;
  return {ByteRange{route_block(lay, d, sender), route_bytes(d)},
          ByteRange{token_block(lay, d, sender), T * token_bytes(d)},
          d.reduce_expert
              ? ByteRange{partial_block(lay, d, sender), T * size_t(d.hidden) * partial_bytes(d)}
              : ByteRange{lay.combine, lay.total - lay.combine}};
}

}  // namespace jax_moe
