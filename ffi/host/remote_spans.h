// What a host rank writes into the buffers of its remote ranks (spans of its staging copies
// of them, ffi/host/remote_peers.h) and how many writes it expects from each. Writes cover
// runs of consecutive slots or tokens, so a sender posts one write per run; the receiver
// finds the same runs from what it knows (send_dest, or routes that arrived first). Where a
// region belongs to one sender (its tokens' rows, its partials), runs closer than
// merge_gap_bytes(d) are one write that carries the rows between them too (unused there): a
// write costs about as much as moving that many bytes, so at decode sizes a peer gets one
// write per phase instead of one per run (EP8: ~30 runs of 128 tokens). The gap shrinks
// with the world size: the peers share the rank's link, and at EP64 a token reaches one peer
// in eight, so wide gaps would multiply the bytes instead of saving writes.
#pragma once

#include <cstdint>
#include <vector>

#include "ffi/host/state.h"
#include "ffi/protocol/host_layout.h"

namespace jax_moe::host {

inline bool is_remote(const HostRankState& s, int peer) {
  return s.remote != nullptr && s.remote->is_remote(peer);
}

constexpr uint64_t kMergeGapBytes = 64 << 10;  // up to world 8, then 8 / world of it

inline uint64_t merge_gap_bytes(const MoeDims& d) {
  return d.world <= 8 ? kMergeGapBytes : kMergeGapBytes * 8 / uint64_t(d.world);
}

// dispatch_send first writes (Signal::kDispatch) its route block up to its `ntok` tokens
// (token count and route entries, ffi/protocol/host_layout.h): one span, the same for every
// peer.
constexpr uint64_t kDispatchRouteWrites = 1;
std::vector<std::vector<Span>> dispatch_route_spans(const MoeDims& d, const BufferLayout& lay,
                                                    int ntok);

// Then (Signal::kDispatchRows) the rows of the tokens with a slot on remote rank p (bit p of
// dest_masks[t]): one span per run of such tokens in recv_tokens[me][T] of p.
std::vector<std::vector<Span>> dispatch_row_spans(const HostRankState& s, const BufferLayout& lay,
                                                  const std::vector<uint64_t>& dest_masks);

// Row writes dispatch_recv expects from each remote source: one per run of its tokens with a
// slot here (ntok[src] tokens), read from its routes; at least one.
std::vector<uint64_t> dispatch_row_writes(const HostRankState& s, const BufferLayout& lay,
                                          const std::vector<int>& ntok);

// combine_send's writes into each remote source (Signal::kCombine). Source mode: one span per
// run of that source's slots held here (rows of comb[T][K][H]; other ranks write the rows
// between runs, so runs never merge); expert mode: one per merged run of its tokens with a
// slot here, of part[me][T][H].
std::vector<std::vector<Span>> combine_spans(const HostRankState& s, const BufferLayout& lay,
                                             const int32_t* slot_rows);

// Writes combine_recv expects from each remote rank p: one per run of this rank's slots
// (source mode) or merged run of tokens (expert mode) that p holds; at least one.
std::vector<uint64_t> combine_writes(const HostRankState& s, const int32_t* send_dest);

}  // namespace jax_moe::host
