// Buffer layout of one rank of the NVLink dispatch/combine (cuda/dispatch.cu, cuda/combine.cu),
// shared by the kernels and the host state (ffi/cuda/state.cc). The host backend and the
// host proxies keep their own protocol (ffi/protocol/host_layout.h).
//
// Work is cut into `chunks` contiguous token ranges, the same on every rank (the communicator
// fixes the count): chunk c of every rank covers tokens [T*c/chunks, T*(c+1)/chunks). A
// block of the sending rank that finished chunk c raises one flag per destination for it,
// and the block of the receiving rank that handles chunk c waits for exactly those flags, so
// a receiver starts on a chunk as soon as it has landed (no grid-wide wait, no last block).
//
// Data regions are double-buffered by call parity (seq & 1). Rank d sends call n+1 only
// after its call n finished reading (stream order), and every rank's call n+1 waits for
// every peer's route flag of n+1 before it ends, so when a rank starts call n+2 in the parity
// of n, every reader of n is done: no acknowledgement flags and no wait before sending.
#pragma once

#include "ffi/protocol/dims.h"

namespace jax_moe {

// A source routes its slots in `route_blocks` contiguous parts, one block each (the first
// blocks of the grid), so the pass is not one block's serial work at prefill sizes: one part
// per kRouteSlotsPerBlock of the T * K slots, at most kMaxRouteBlocks and chunks. (Decode
// sizes get one part: the parts' exchange of counts costs more than it saves there.)
constexpr int kMaxRouteBlocks = 16;
constexpr int kRouteSlotsPerBlock = 2048;

JAX_MOE_HD inline int route_blocks(const MoeDims& d, int chunks) {
  const long long slots = static_cast<long long>(d.max_tokens) * d.topk;
  long long parts = (slots + kRouteSlotsPerBlock - 1) / kRouteSlotsPerBlock;
  if (parts > kMaxRouteBlocks) parts = kMaxRouteBlocks;
  if (parts > chunks) parts = chunks;
  return parts < 1 ? 1 : static_cast<int>(parts);
}

// Byte offsets inside one rank's buffer (one allocation, mapped by every peer); B =
// route_blocks(d, chunks):
//   u64 route_flag[R][B]      source s stores its dispatch seq at [s][b] after route part b
//   u64 rows_flag[R][chunks]  source s stores its dispatch seq at [s][c] after chunk c's rows
//   u64 comb_flag[R][chunks]  expert rank d stores its combine seq at [d][c] after chunk c
//   u64 part_flag[B]          used by this rank's own route blocks only: part b stores the
//                             seq here once its counts are in part_counts
//   i32 part_counts[B][E]     slots of route part b per global expert (later parts sum the
//                             earlier parts' counts to rank their own slots)
//   parity region [2], each:
//     i32 num_tokens[R]        tokens sent by source s (clamped to [0, T])
//     i32 counts[R][L]         rows of source s for local expert e
//     slots[R][T][K]           16 bytes each {u64 seq, i32 code, f32 weight}: slot (t, k) of
//                              source s, written only to the rank that holds it, with the
//                              call's dispatch seq, code rank * L + e (local expert e; rank:
//                              its place among the slots of s for that expert, in (t, k)
//                              order) and its router weight. A record of any other seq (an
//                              older call's, or none) means the slot does not come here, so
//                              a source stores T * K records, not R * T * K codes.
//     tokens[R][T]             token_bytes each: token t of source s, written only when t
//                              has a slot here (a token crosses the link once per rank)
//     combine                  source mode: bf16 [T][K][H], y row of this rank's slot (t, k);
//                              expert mode: partial [R][T][H] from expert rank d at [d]
struct NvlinkLayout {
  size_t route_flag;
  size_t rows_flag;
  size_t comb_flag;
  size_t part_flag;
  size_t part_counts;
  size_t region;        // start of parity region 0
  size_t region_bytes;  // parity region p starts at region + p * region_bytes
  // offsets inside a parity region
  size_t num_tokens;
  size_t counts;
  size_t slots;
  size_t tokens;
  size_t combine;
  size_t total;
};

JAX_MOE_HD inline NvlinkLayout nvlink_layout(const MoeDims& d, int chunks) {
  const size_t R = d.world, T = d.max_tokens, K = d.topk, H = d.hidden, L = d.local_experts;
  NvlinkLayout b;
  const size_t B = route_blocks(d, chunks);
  b.route_flag = 0;
  b.rows_flag = b.route_flag + 8 * R * B;
  b.comb_flag = b.rows_flag + 8 * R * chunks;
  b.part_flag = b.comb_flag + 8 * R * chunks;
  b.part_counts = b.part_flag + 8 * B;
  b.region = align_up(b.part_counts + 4 * B * size_t(d.num_experts), 256);
  b.num_tokens = 0;
  b.counts = align_up(b.num_tokens + 4 * R, 16);
  b.slots = align_up(b.counts + 4 * R * L, 256);
  b.tokens = align_up(b.slots + 16 * R * T * K, 256);
  b.combine = align_up(b.tokens + R * T * token_bytes(d), 256);
  const size_t combine_bytes = d.reduce_expert ? R * T * H * partial_bytes(d) : T * K * H * 2;
  b.region_bytes = align_up(b.combine + combine_bytes, 256);
  b.total = b.region + 2 * b.region_bytes;
  return b;
}

// Which halves a launch runs: the fused op runs both in one kernel.
enum ExchangePhase : int {
  kPhaseSend = 1,
  kPhaseRecv = 2,
  kPhaseBoth = 3,
};

// Per-chunk call counters in device memory, touched only by this device's kernels: the block
// that handles chunk c of a phase reads its counter, uses counter + 1 as the call's sequence
// and stores it back when done, so no block waits for another to learn the sequence.
enum ChunkCounter : int {
  kSeqDispatchSend = 0,
  kSeqDispatchRecv = 1,
  kSeqCombineSend = 2,
  kSeqCombineRecv = 3,
  kChunkCounters = 4,  // u64 [kChunkCounters][chunks]
};

// Threads of a dispatch/combine block. The route pass of dispatch keeps a [warps][E] int32
// table in shared memory, so it uses as many of the block's warps as fit in 48 KiB.
constexpr int kExchangeThreads = 512;
constexpr int kExchangeWarps = kExchangeThreads / 32;
constexpr size_t kExchangeSmem = 48 * 1024;

// The quantizing send stages each warp's row loads in shared memory, kSendRingVectors 16-byte
// vectors per lane (a ring of batches, cuda/dispatch.cu send_quantized), so that several
// batches are in flight per warp without holding them in registers.
constexpr int kSendRingVectors = 16;
constexpr size_t kSendRingBytes = size_t(kExchangeThreads) * kSendRingVectors * 16;

JAX_MOE_HD inline int route_warps(const MoeDims& d) {
  const size_t fit = kExchangeSmem / (4 * size_t(d.num_experts));
  return fit > size_t(kExchangeWarps) ? kExchangeWarps : int(fit);
}

// Shared memory of the placement: first row per (source, expert), then segment start,
// tokens and size per expert, then tokens per source (int32 each).
JAX_MOE_HD inline size_t place_smem_bytes(const MoeDims& d) {
  return 4 * (size_t(d.world) * d.local_experts + 3 * size_t(d.local_experts) + d.world);
}

}  // namespace jax_moe
