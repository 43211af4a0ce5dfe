// Dispatch over NVLink, one kernel with a send phase and a receive phase (the fused op runs
// both, dispatch_send / dispatch_recv one each). Protocol and buffer layout:
// ffi/protocol/nvlink_layout.h; the output layout: docs/semantics.md.
//
// Send (every rank, as a source):
//   the first route_blocks blocks first route, each a part of the slots: validate the ids,
//   rank every slot among this source's slots of the same expert ((t, k) order, so segments
//   keep their order), and write to every rank its tokens count, its per-expert row counts
//   and each slot's code, then raise route_flag per part;
//   every block then sends the token rows of its chunks, once to each rank that holds a slot
//   of the token (fp8-quantized on the way when asked), and raises rows_flag per chunk.
// Receive (every rank, as a destination):
//   every block waits for every source's route flags (the counts give each expert's
//   segment), then per chunk for the sources' rows of that chunk, and copies each token to
//   its rows.
#include <algorithm>

#include "cuda/api.cuh"
#include "cuda/exchange.cuh"
#include "cuda/rows.cuh"

namespace jax_moe {
namespace {

// A warp's destinations (the ranks or rows a token goes to; every lane holds the same): the
// first kHeld in registers, the rest read from the warp's table in shared memory when used.
// A store to every held destination is then its address and the store. Reading the table at
// each store (a dependent shared-memory load, the address arithmetic and a branch per
// destination, in a loop not unrolled) made addressing most of the world-1 prefill
// dispatch's instructions (its SASS, session 24).
template <typename T, int kHeld>
struct HeldDests {
  T held[kHeld];
  const T* table;
  int count;
  __device__ HeldDests(const T* table_, int count_) : table(table_), count(count_) {
#pragma unroll
    for (int i = 0; i < kHeld; ++i) held[i] = i < count ? table[i] : T{};
  }
  template <typename F>
  __device__ void each(F f) const {
#pragma unroll
    for (int i = 0; i < kHeld; ++i)
      if (i < count) f(held[i]);
#pragma unroll 1
    for (int i = kHeld; i < count; ++i) f(table[i]);
  }
};

// Destinations held: every one of a top-8 token's, except in the world-1 kernels whose
// quantizing loop needs more registers (block sizes of 512 and 2048: kCPL 2 and 8). There 8
// held took the kernel past 128 registers, into a stack frame; 6 fit (ptxas -v, session 24).
constexpr int kHeldDests = 8;
template <int kCPL>
constexpr int kHeldRows = kCPL == 2 || kCPL == 8 ? 6 : kHeldDests;

// Where one warp sends a token: its slot in this source's region on each rank that holds one
// of its slots (a per-warp table in shared memory, held as HeldDests).
__device__ inline HeldDests<char*, kHeldDests> token_dests(const CommView& v,
                                                          const NvlinkLayout& lay, uint64_t seq,
                                                          uint64_t dest_mask, int t) {
  static __shared__ char* warp_slots[kExchangeWarps][32];  // <= min(K, R) <= 32 ranks
  const MoeDims& d = v.dims;
  const int lane = lane_id();
  // Lane i takes the i-th rank of the mask.
  uint64_t m = dest_mask;
  for (int i = 0; i < lane && m; ++i) m &= m - 1;
  __syncwarp();
  if (m) {
    const int p = __ffsll(static_cast<long long>(m)) - 1;
    warp_slots[block_warp()][lane] = parity_region(block_peers[p], lay, seq) + lay.tokens +
                                     (size_t(d.rank) * d.max_tokens + t) * token_bytes(d);
  }
  __syncwarp();
  return HeldDests<char*, kHeldDests>(warp_slots[block_warp()], __popcll(dest_mask));
}

// Where the send writes one token's pieces: a sink takes 16-byte vectors (vector), 8-byte
// groups of fp8 codes (codes, index in 8-byte units) and runs of f32 scales (scale_run: lanes
// [0, n) of the warp give the scales of blocks [b, b + n), so a row's scales go out as whole
// sectors, not one float per store).
// SlotSink writes the token's slot on every destination rank (codes, then the scales from
// byte `scales_at`; the tokens region of ffi/protocol/nvlink_layout.h).
struct SlotSink {
  HeldDests<char*, kHeldDests> dests;
  size_t scales_at;
  __device__ void vector(int c, uint4 value) const {
    dests.each([&](char* slot) { reinterpret_cast<uint4*>(slot)[c] = value; });
  }
  __device__ void codes(int c, uint2 value) const {
    dests.each([&](char* slot) { reinterpret_cast<uint2*>(slot)[c] = value; });
  }
  __device__ void scale_run(int b, int n, float value) const {
    if (lane_id() >= n) return;
    dests.each(
        [&](char* slot) { reinterpret_cast<float*>(slot + scales_at)[b + lane_id()] = value; });
  }
};

// RowSink writes rows of the dispatched output directly (the world-1 kernel): x [C][row_bytes]
// (fp8 codes or bf16), scales [C][nb]; `rows` are the rows the token goes to.
template <int kHeld>
struct RowSink {
  char* x;
  float* scales;
  HeldDests<uint32_t, kHeld> rows;
  uint32_t row_bytes;
  int nb;
  // Row r's byte c of x: the 32 x 32 -> 64-bit multiply-add a held row takes per store.
  __device__ char* at(uint32_t r, size_t c) const { return x + c + size_t(r) * row_bytes; }
  __device__ void vector(int c, uint4 value) const {
    rows.each([&](uint32_t r) { *reinterpret_cast<uint4*>(at(r, size_t(c) * 16)) = value; });
  }
  __device__ void codes(int c, uint2 value) const {
    rows.each([&](uint32_t r) { *reinterpret_cast<uint2*>(at(r, size_t(c) * 8)) = value; });
  }
  __device__ void scale_run(int b, int n, float value) const {
    if (lane_id() >= n) return;
    rows.each([&](uint32_t r) { scales[size_t(r) * nb + b + lane_id()] = value; });
  }
};

constexpr int kRouteUnroll = 4;  // slots per lane loaded at once (one pass at 2048-slot parts)

// Route pass, part `part` of route_blocks(d, chunks) (one block each; all threads take part,
// warps [0, route_warps) count). Slots are j = t * K + k over the ntok tokens given; the part
// takes a contiguous range of them, each warp a contiguous piece of that:
// (a) every warp counts its hits per global expert into its row of table [warps][E];
// (b) per expert, with several parts, the part's total goes to part_counts[part] (this
//     rank's buffer), and once the earlier parts have published theirs, an exclusive scan
//     over the earlier parts and this part's warps turns each row into the warp's first rank;
//     the last part also has every expert's total and sends it to the expert's rank as this
//     source's row count;
// (c) every warp goes over its piece again in order: slot j's rank = the warp's running count
//     for its expert + the lanes before it with the same expert. The record {seq, rank * L +
//     e, weight} goes to the expert's rank only (the slots region of ffi/protocol/nvlink_layout.h).
__device__ void route_slots(const CommView& v, const NvlinkLayout& lay, uint64_t seq, int part,
                            const int32_t* topk_ids, const float* topk_weights, int ntok,
                            int32_t* send_dest, int32_t* table) {
  const MoeDims& d = v.dims;
  const int K = d.topk, E = d.num_experts, L = d.local_experts, R = d.world, me = d.rank;
  const int warps = route_warps(d), warp = block_warp(), lane = lane_id();
  const int parts = route_blocks(d, v.chunks);
  const int n = ntok * K;
  const int part_begin_ = part_begin(n, part, parts), part_end = part_begin(n, part + 1, parts);
  for (int i = threadIdx.x; i < warps * E; i += blockDim.x) table[i] = 0;
  if (part == 0) {  // send_dest of slots past ntok (the loops below write the others)
    for (int j = n + threadIdx.x; j < d.max_tokens * K; j += blockDim.x) send_dest[j] = -1;
    for (int p = threadIdx.x; p < R; p += blockDim.x)
      reinterpret_cast<int32_t*>(parity_region(block_peers[p], lay, seq) + lay.num_tokens)[me] =
          ntok;
  }
  __syncthreads();

  const int span = part_end - part_begin_;
  const int begin = part_begin_ + part_begin(span, warp, warps);
  const int end = part_begin_ + part_begin(span, warp + 1, warps);
  int32_t* mine = table + warp * E;
  // Loads kRouteUnroll slots per lane (ids and weights) before using any: a loop with one
  // load in flight is bound by memory latency. A piece of one pass (every decode size) keeps
  // them in registers from (a) to (c) instead of loading them twice.
  int id[kRouteUnroll];
  float weight[kRouteUnroll];
  auto load_slots = [&](int j0, bool record) {
#pragma unroll
    for (int u = 0; u < kRouteUnroll; ++u) {
      const int j = j0 + 32 * u + lane;
      id[u] = j < end ? topk_ids[j] : -1;
      weight[u] = j < end ? topk_weights[j] : 0.f;
    }
#pragma unroll
    for (int u = 0; u < kRouteUnroll; ++u) {
      if (id[u] < -1 || id[u] >= E) {
        if (record) record_error(v, kInvalidExpertId, kStageDispatchSend, id[u]);
        id[u] = -1;
      }
    }
  };
  const bool one_pass = end - begin <= 32 * kRouteUnroll;
  if (warp < warps) {
    for (int j0 = begin; j0 < end; j0 += 32 * kRouteUnroll) {  // (a)
      load_slots(j0, true);
#pragma unroll
      for (int u = 0; u < kRouteUnroll; ++u) {
        const int j = j0 + 32 * u + lane;
        if (j < end) send_dest[j] = id[u] >= 0 ? id[u] / L : -1;
        if (id[u] >= 0) atomicAdd(&mine[id[u]], 1);
      }
    }
  }
  __syncthreads();
  int32_t* part_counts = reinterpret_cast<int32_t*>(v.local + lay.part_counts);
  if (parts > 1) {  // (b): this part's totals, for the later parts
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
      int total = 0;
      for (int w = 0; w < warps; ++w) total += table[w * E + e];
      part_counts[part * E + e] = total;
    }
    signal_flag(v.local, lay.part_flag, part, seq);
    // The earlier parts' totals (parts of one grid: lower blocks never wait for higher ones).
    bool ok = true;
    for (int q = threadIdx.x; q < part; q += blockDim.x)
      ok &= wait_at_least(v, flag_at(v.local, lay.part_flag, q), seq, kStageDispatchSend, me);
    if (!__syncthreads_and(ok)) return;
  }
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    int before = 0;
    for (int q = 0; q < part; ++q) before += __ldcg(part_counts + q * E + e);
    for (int w = 0; w < warps; ++w) {
      const int count = table[w * E + e];
      table[w * E + e] = before;
      before += count;
    }
    if (part == parts - 1) {
      int32_t* counts = reinterpret_cast<int32_t*>(parity_region(block_peers[e / L], lay, seq) +
                                                   lay.counts);
      counts[me * L + e % L] = before;
    }
  }
  __syncthreads();
  if (warp < warps) {
    const unsigned lanes_before = (1u << lane) - 1;
    for (int j0 = begin; j0 < end; j0 += 32 * kRouteUnroll) {  // (c)
      if (!one_pass) load_slots(j0, false);
#pragma unroll
      for (int u = 0; u < kRouteUnroll; ++u) {
        const int j = j0 + 32 * u + lane;
        const unsigned same = __match_any_sync(kFullMask, id[u]);
        const int before = __popc(same & lanes_before);
        const int running = id[u] >= 0 ? mine[id[u]] : 0;
        __syncwarp();
        if (id[u] >= 0 && before == 0) mine[id[u]] = running + __popc(same);
        __syncwarp();
        if (j >= end) continue;
        if (id[u] < 0) continue;
        const size_t slot = size_t(me) * d.max_tokens * K + j;  // [s][t][k]
        const uint32_t code = (running + before) * L + id[u] % L;
        char* region = parity_region(block_peers[id[u] / L], lay, seq);
        reinterpret_cast<uint4*>(region + lay.slots)[slot] =
            make_uint4(uint32_t(seq), uint32_t(seq >> 32), code, __float_as_uint(weight[u]));
      }
    }
  }
}

// Quantizes scale blocks [block_begin, block_end) of bf16 row `row` [H] (docs/semantics.md:
// per block amax = max(max|x|, 1e-4), scale = amax * f32(1/448), q = e4m3fn(clip(x * (448 /
// amax)))) and hands codes and scales to `sink` (SlotSink, RowSink). One warp; a scale block
// is covered by `lanes_per_block` lanes (CPL 16-byte vectors each) that reduce its amax with
// shuffles. A batch is kSteps * CPL vectors per lane; the
// warp's `ring` in shared memory (kSendRingVectors per lane) holds kStages batches, loaded
// with cp.async kStages - 1 batches ahead of the one being quantized (with one batch in
// registers at a time the warp waited for memory on every batch). The amax is an integer max
// over bf16 bits (abs_max_bits); a block with a finite amax takes the two-values-per-
// instruction conversion, one with Inf or NaN the per-value formula.
//
// kStaged: `row` is already in shared memory (the world-1 kernel's staged chunk), so the warp
// reads it there and `ring` is not used.
template <int CPL, typename Sink, bool kStaged = false>
__device__ void send_quantized(const MoeDims& d, const uint4* row, const Sink& sink,
                               int block_begin, int block_end, uint4* ring) {
  constexpr int kSteps = CPL < 4 ? 4 / CPL : 1;
  constexpr int kVectors = kSteps * CPL;                  // per lane per batch
  constexpr int kStages = kSendRingVectors / kVectors;    // batches in the ring
  static_assert(kStages >= 2, "the send ring must hold two batches");
  const int lane = lane_id();
  const int chunks_per_block = d.block_size / 8;  // 8 bf16 per vector
  const int lanes_per_block = chunks_per_block / CPL;
  const int blocks_per_step = 32 / lanes_per_block;
  const int sub = lane % lanes_per_block;
  const int batch_blocks = blocks_per_step * kSteps;
  const int batches = (block_end - block_begin + batch_blocks - 1) / batch_blocks;
  // ring[(stage * kVectors + i) * 32 + lane]: a lane reads back only what it copied itself.
  auto issue = [&](int batch) {
    if constexpr (kStaged) return;  // nothing to load
    if (batch < batches) {
      uint4* stage = ring + (batch % kStages) * kVectors * 32 + lane;
#pragma unroll
      for (int s = 0; s < kSteps; ++s) {
        const int b = block_begin + batch * batch_blocks + s * blocks_per_step +
                      lane / lanes_per_block;
#pragma unroll
        for (int c = 0; c < CPL; ++c)
          if (b < block_end)
            copy_async16(stage + (s * CPL + c) * 32,
                         row + b * chunks_per_block + sub + c * lanes_per_block);
      }
    }
    copy_async_commit();  // an empty group past the last batch keeps the count uniform
  };
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) issue(i);
  for (int batch = 0; batch < batches; ++batch) {
    issue(batch + kStages - 1);
    if constexpr (!kStaged) copy_async_wait<kStages - 1>();
    const uint4* stage = ring + (batch % kStages) * kVectors * 32 + lane;
    const int b0 = block_begin + batch * batch_blocks;
    float run = 0.f;  // lane i: the scale of block i of the current run
#pragma unroll
    for (int s = 0; s < kSteps; ++s) {
      if (b0 + s * blocks_per_step >= block_end) break;  // warp-uniform
      const int b = b0 + s * blocks_per_step + lane / lanes_per_block;
      const bool active = b < block_end;
      uint4 values[CPL];
      uint32_t pair = 0;
#pragma unroll
      for (int c = 0; c < CPL; ++c) {
        if (active) {
          values[c] = kStaged ? row[b * chunks_per_block + sub + c * lanes_per_block]
                              : stage[(s * CPL + c) * 32];
          pair = abs_max_bits(values[c], pair);
        }
      }
      const BlockQuant q = block_quant(pair, lanes_per_block);  // the same in the block's lanes
      // The step's blocks are lanes [at, at + blocks_per_step) of the scale run: lane `at + g`
      // takes block g's scale from the block's first lane. A run ends at 32 blocks, at the
      // batch's end, or at the part's.
      const int at = (s * blocks_per_step) & 31, g = lane - at;
      const float scale =
          __shfl_sync(kFullMask, q.scale, (g & (blocks_per_step - 1)) * lanes_per_block);
      if (g >= 0 && g < blocks_per_step) run = scale;
      if (at + blocks_per_step == 32 || s == kSteps - 1 ||
          b0 + (s + 1) * blocks_per_step >= block_end) {
        const int first = b0 + s * blocks_per_step - at;
        sink.scale_run(first, min(at + blocks_per_step, block_end - first), run);
      }
      if (!active) continue;
#pragma unroll
      for (int c = 0; c < CPL; ++c) {
        const uint2 codes = quantize8_e4m3(values[c], q);
        sink.codes(b * chunks_per_block + sub + c * lanes_per_block, codes);
      }
    }
  }
  if constexpr (!kStaged) copy_async_wait<0>();  // the ring is free for the warp's next task
}

// Hands 16-byte vectors [chunk_begin, chunk_end) of `row`, and floats [scale_begin,
// scale_end) of `scales`, to `sink` as they are. One warp.
template <typename Sink>
__device__ void send_as_is(const uint4* row, int chunk_begin, int chunk_end,
                           const float* scales, int scale_begin, int scale_end,
                           const Sink& sink) {
  warp_copy(chunk_begin, chunk_end, [&](int c) { return row[c]; },
            [&](int c, uint4 value) { sink.vector(c, value); });
  for (int b = scale_begin; b < scale_end; b += 32) {
    const int n = min(32, scale_end - b);
    sink.scale_run(b, n, lane_id() < n ? scales[b + lane_id()] : 0.f);
  }
}

// Pieces a token row is cut into along hidden so a chunk of `tokens` tokens keeps every warp
// of the block busy: bf16 rows anywhere (>= 32 vectors a piece), fp8 only between scale blocks.
__device__ inline int row_parts(const MoeDims& d, TokenInput input, int tokens) {
  const int want = tokens > 0 ? (kExchangeWarps + tokens - 1) / tokens : 1;
  const int most = input == kInputBf16 ? max(1, d.hidden / 8 / 32)
                   : input == kInputFp8 && d.block_size % 16 ? 1
                   : d.hidden / d.block_size;
  return max(1, min(want, most));
}

// Part `part` of `parts` (row_parts) of token t's row to `sink`, in the form kInput asks for:
// quantized on the way (kCPL vectors a lane per scale block, send_quantized; `ring`: this
// warp's kSendRingVectors * 32 vectors of shared memory), or fp8 / bf16 as given. One warp.
template <TokenInput kInput, int kCPL, typename Sink>
__device__ void send_token_part(const MoeDims& d, const void* x, const float* x_scales, int t,
                                int part, int parts, const Sink& sink, uint4* ring) {
  const int H = d.hidden, nb = H / d.block_size;
  const int b_begin = part_begin(nb, part, parts), b_end = part_begin(nb, part + 1, parts);
  if constexpr (kInput == kInputBf16Quantize) {
    const uint4* row = static_cast<const uint4*>(x) + size_t(t) * (H / 8);
    send_quantized<kCPL>(d, row, sink, b_begin, b_end, ring);
  } else if constexpr (kInput == kInputFp8) {
    // A part covers whole scale blocks, codes and scales (parts > 1 only when a block is a
    // whole number of 16-byte vectors).
    const int per_block = d.block_size / 16;
    send_as_is(static_cast<const uint4*>(x) + size_t(t) * (H / 16),
               parts == 1 ? 0 : b_begin * per_block, parts == 1 ? H / 16 : b_end * per_block,
               x_scales + size_t(t) * nb, b_begin, b_end, sink);
  } else {
    send_as_is(static_cast<const uint4*>(x) + size_t(t) * (H / 8),
               part_begin(H / 8, part, parts), part_begin(H / 8, part + 1, parts), nullptr, 0,
               0, sink);
  }
}

// This warp's part of the block's send ring (dynamic shared memory from byte 0).
__device__ inline uint4* warp_ring(int32_t* smem) {
  return reinterpret_cast<uint4*>(smem) + block_warp() * kSendRingVectors * 32;
}

// Send phase of one chunk: the rows of tokens [t0, t1) (those < ntok), one warp per (token,
// part of its row).
template <TokenInput kInput, int kCPL>
__device__ void send_chunk(const CommView& v, const NvlinkLayout& lay, uint64_t seq,
                           const void* x, const float* x_scales, const int32_t* topk_ids,
                           int t0, int t1, int32_t* smem) {
  const MoeDims& d = v.dims;
  const int K = d.topk, lane = lane_id();
  const int tokens = max(0, t1 - t0);
  const int parts = row_parts(d, kInput, tokens);
  for (int task = block_warp(); task < tokens * parts; task += kExchangeWarps) {
    const int t = t0 + task / parts, part = task % parts;
    int dest = -1;
    if (lane < K) {
      const int id = topk_ids[t * K + lane];
      if (id >= 0 && id < d.num_experts) dest = id / d.local_experts;
    }
    uint64_t dest_mask = 0;
    for (int k = 0; k < K; ++k) {
      const int dk = __shfl_sync(kFullMask, dest, k);
      if (dk >= 0) dest_mask |= 1ull << dk;
    }
    if (!dest_mask) continue;
    const SlotSink sink{token_dests(v, lay, seq, dest_mask, t), size_t(d.hidden)};
    send_token_part<kInput, kCPL>(d, x, x_scales, t, part, parts, sink, warp_ring(smem));
  }
}

// The segments of this rank's experts, from every source's counts (shared memory, the
// place_smem_bytes layout).
struct Segments {
  int32_t* first_row;   // [R][L] first row of (source s, expert e)
  int32_t* start;       // [L]
  int32_t* tokens;      // [L] tokens_per_expert
  int32_t* size;        // [L] group_sizes
  int32_t* ntok;        // [R] tokens sent by each source
  int total;            // sum(group_sizes)
};

__device__ Segments segments_at(const MoeDims& d, int32_t* smem) {
  const int R = d.world, L = d.local_experts;
  Segments g;
  g.first_row = smem;
  g.start = g.first_row + R * L;
  g.tokens = g.start + L;
  g.size = g.tokens + L;
  g.ntok = g.size + L;
  return g;
}

// With every source's row counts in g.first_row ([s][e]) and its tokens in g.ntok (the block
// synced after writing them): sizes, starts and each (source, expert)'s first row.
__device__ void finish_segments(const MoeDims& d, Segments& g) {
  const int R = d.world, L = d.local_experts;
  __shared__ int32_t total_rows;
  for (int e = threadIdx.x; e < L; e += blockDim.x) {
    int sum = 0;
    for (int s = 0; s < R; ++s) sum += g.first_row[s * L + e];
    g.tokens[e] = sum;
    g.size[e] = (sum + d.expert_padding - 1) / d.expert_padding * d.expert_padding;
  }
  __syncthreads();
  if (threadIdx.x < 32) {  // exclusive scan of the sizes: lane i sums a contiguous run
    const int lane = threadIdx.x, per_lane = (L + 31) / 32;
    const int first = min(L, lane * per_lane), last = min(L, first + per_lane);
    int run = 0;
    for (int e = first; e < last; ++e) run += g.size[e];
    int inclusive = run;
    for (int offset = 1; offset < 32; offset <<= 1) {
      const int other = __shfl_up_sync(kFullMask, inclusive, offset);
      if (lane >= offset) inclusive += other;
    }
    int acc = inclusive - run;
    for (int e = first; e < last; ++e) {
      g.start[e] = acc;
      acc += g.size[e];
    }
    if (lane == 31) total_rows = inclusive;
  }
  __syncthreads();
  for (int e = threadIdx.x; e < L; e += blockDim.x) {
    int row = g.start[e];
    for (int s = 0; s < R; ++s) {
      const int count = g.first_row[s * L + e];
      g.first_row[s * L + e] = row;
      row += count;
    }
  }
  __syncthreads();
  g.total = total_rows;
}

__device__ Segments build_segments(const CommView& v, const char* region,
                                   const NvlinkLayout& lay, int32_t* smem) {
  const MoeDims& d = v.dims;
  Segments g = segments_at(d, smem);
  const int32_t* counts = reinterpret_cast<const int32_t*>(region + lay.counts);
  const int32_t* ntok = reinterpret_cast<const int32_t*>(region + lay.num_tokens);
  for (int i = threadIdx.x; i < d.world * d.local_experts; i += blockDim.x)
    g.first_row[i] = __ldcg(counts + i);
  for (int s = threadIdx.x; s < d.world; s += blockDim.x)
    g.ntok[s] = min(max(__ldcg(ntok + s), 0), d.max_tokens);
  __syncthreads();
  finish_segments(d, g);
  return g;
}

// What every call writes besides the token rows, spread over the grid: group_sizes and
// tokens_per_expert (block 0), the weights of rows past the total (zero), and padding rows
// inside segments (x, scales and weights zero). Rows past the total keep whatever x and
// scales they held (docs/semantics.md).
__device__ void write_segments(const CommView& v, const Segments& g, void* x_out,
                               float* scales_out, float* weights_out, int32_t* group_sizes,
                               int32_t* tokens_per_expert) {
  const MoeDims& d = v.dims;
  const int L = d.local_experts, C = d.capacity, nb = scale_blocks(d);
  const int row_chunks = d.fp8 ? d.hidden / 16 : d.hidden / 8;
  if (blockIdx.x == 0) {
    for (int e = threadIdx.x; e < L; e += blockDim.x) {
      group_sizes[e] = g.size[e];
      tokens_per_expert[e] = g.tokens[e];
    }
    if (threadIdx.x == 0 && g.total > C)
      record_error(v, kCapacityOverflow, kStageDispatchRecv, g.total);
  }
  for (int r = g.total + blockIdx.x * blockDim.x + threadIdx.x; r < C; r += gridDim.x * blockDim.x)
    weights_out[r] = 0.f;
  const int pad = d.expert_padding - 1;
  if (pad == 0) return;
  uint4* x_rows = static_cast<uint4*>(x_out);
  const int warp = blockIdx.x * kExchangeWarps + block_warp(), warps = gridDim.x * kExchangeWarps;
  for (int task = warp; task < L * pad; task += warps) {
    const int e = task / pad;
    const int r = g.start[e] + g.tokens[e] + task % pad;
    if (r >= g.start[e] + g.size[e] || r >= C) continue;
    for (int c = lane_id(); c < row_chunks; c += 32)
      x_rows[size_t(r) * row_chunks + c] = make_uint4(0, 0, 0, 0);
    for (int b = lane_id(); b < nb; b += 32) scales_out[size_t(r) * nb + b] = 0.f;
    if (lane_id() == 0) weights_out[r] = 0.f;
  }
}

// Receive phase of one chunk: tokens [t0, t1) of every source, one warp per (source, token,
// part of its row): its slots' rows (slot_rows, weights), and its row copied to each of them.
__device__ void place_chunk(const CommView& v, const NvlinkLayout& lay, const char* region,
                            uint64_t seq, const Segments& g, int t0, int t1, void* x_out,
                            float* scales_out, float* weights_out, int32_t* slot_rows) {
  const MoeDims& d = v.dims;
  const int T = d.max_tokens, K = d.topk, L = d.local_experts, C = d.capacity;
  const int nb = scale_blocks(d), lane = lane_id(), warp = block_warp();
  const int row_chunks = d.fp8 ? d.hidden / 16 : d.hidden / 8;  // 16-byte vectors per row
  const int tokens = t1 - t0;
  const int parts = max(1, min(max(1, row_chunks / 32),
                               (kExchangeWarps + d.world * tokens - 1) / max(1, d.world * tokens)));
  __shared__ int32_t warp_rows[kExchangeWarps][32];
  const uint4* records = reinterpret_cast<const uint4*>(region + lay.slots);
  uint4* x_rows = static_cast<uint4*>(x_out);
  for (int task = warp; task < d.world * tokens * parts; task += kExchangeWarps) {
    const int item = task / parts, part = task % parts;
    const int s = item / tokens, t = t0 + item % tokens;
    const size_t slot = (size_t(s) * T + t) * K + lane;
    int row = -1;
    float weight = 0.f;
    if (lane < K && t < g.ntok[s]) {
      const uint4 record = __ldcg(records + slot);
      if ((uint64_t(record.y) << 32 | record.x) == seq) {  // this call's: the slot comes here
        const int code = int(record.z);
        row = g.first_row[s * L + code % L] + code / L;
        if (row >= C || row < 0) row = -2;  // dropped: capacity overflow
        weight = __uint_as_float(record.w);
      }
    }
    if (part == 0 && lane < K) {
      slot_rows[slot] = row;
      if (row >= 0) weights_out[row] = weight;
    }
    const unsigned placed = __ballot_sync(kFullMask, row >= 0);
    if (!placed) continue;
    warp_rows[warp][lane] = row;
    __syncwarp();
    const char* src = region + lay.tokens + (size_t(s) * T + t) * token_bytes(d);
    warp_copy(part_begin(row_chunks, part, parts), part_begin(row_chunks, part + 1, parts),
              [&](int c) { return __ldcg(reinterpret_cast<const uint4*>(src) + c); },
              [&](int c, uint4 value) {
                for (unsigned m = placed; m; m &= m - 1)
                  x_rows[size_t(warp_rows[warp][__ffs(m) - 1]) * row_chunks + c] = value;
              });
    const float* src_scales = reinterpret_cast<const float*>(src + size_t(row_chunks) * 16);
    const int b_end = part_begin(nb, part + 1, parts);
    for (int b = part_begin(nb, part, parts) + lane; b < b_end; b += 32) {
      const float value = __ldcg(src_scales + b);
      for (unsigned m = placed; m; m &= m - 1)
        scales_out[size_t(warp_rows[warp][__ffs(m) - 1]) * nb + b] = value;
    }
    __syncwarp();
  }
}

// World 1. With one rank the exchange is a permutation on one GPU: no peer needs the routes
// or the rows, so the fused op skips the buffer and its flags. Every block computes the
// segments itself from all T * K ids (read from L2 by every block: 4 KiB at decode, 128 KiB
// at prefill), ranks the slots of its own chunks and writes their rows straight from x;
// no block waits for another. The halves keep the buffer protocol (their two launches must
// hand the rows over through it).

// Dynamic shared memory of the world-1 kernel, from byte 0: the send ring (kSendRingBytes),
// the segments (place_smem_bytes), running[E] (slots of each expert before the block's
// current position), then for the chunk being placed its rows, ids and weights
// ([kLocalChunkSlots] each; a larger chunk reads them from global memory).
constexpr int kLocalChunkSlots = 1024;

size_t local_dispatch_smem_bytes(const MoeDims& d) {
  return kSendRingBytes + place_smem_bytes(d) +
         4 * (size_t(d.num_experts) + 3 * kLocalChunkSlots);
}

// The ids and weights of slots [begin, end) into shared memory, all threads (every slot of
// a chunk is inside [0, T * K); whether it holds a token is the ranking's to judge).
__device__ void stage_chunk(const int32_t* ids, const float* weights, int begin, int end,
                            int32_t* chunk_ids, float* chunk_w) {
  for (int j = begin + threadIdx.x; j < end; j += blockDim.x) {
    chunk_ids[j - begin] = ids[j];
    chunk_w[j - begin] = weights[j];
  }
}

// Calls f(j, ids[j]) for every j in [from, to); all threads of the block, each a strided
// share. Four ids a load where the array is 16-byte aligned, kLoads loads in flight per thread.
template <int kLoads, typename F>
__device__ __forceinline__ void for_each_id(const int32_t* ids, int from, int to, F f) {
  int head = to;
  if ((reinterpret_cast<uintptr_t>(ids) & 15) == 0) head = min(to, (from + 3) & ~3);
  for (int j = from + threadIdx.x; j < head; j += blockDim.x) f(j, ids[j]);
  const int quads = head < to ? (to - head) / 4 : 0;
  const int4* q = reinterpret_cast<const int4*>(ids + head);
  for (int i0 = threadIdx.x; i0 < quads; i0 += kLoads * blockDim.x) {
    // A quad this thread does not load is zero, not left undefined (as in warp_copy: an
    // undefined one keeps the last iteration's value, and under register pressure the
    // compiler kept those on the stack).
    int4 w[kLoads];
#pragma unroll
    for (int u = 0; u < kLoads; ++u)
      w[u] = i0 + u * blockDim.x < quads ? q[i0 + u * blockDim.x] : make_int4(0, 0, 0, 0);
#pragma unroll
    for (int u = 0; u < kLoads; ++u) {
      const int i = i0 + u * blockDim.x;
      if (i >= quads) continue;
      const int j = head + 4 * i;
      f(j, w[u].x);
      f(j + 1, w[u].y);
      f(j + 2, w[u].z);
      f(j + 3, w[u].w);
    }
  }
  for (int j = head + 4 * quads + threadIdx.x; j < to; j += blockDim.x) f(j, ids[j]);
}

// Counts slots j in [from, to) (only those < n hold a token) per expert: every one into
// `total` (unless null), those before `split` into `before`. All threads; ids past the
// range are not read. Invalid ids count nowhere (rank_local_chunk records them).
__device__ void count_slots(const MoeDims& d, const int32_t* ids, int from, int to, int n,
                            int split, int32_t* total, int32_t* before) {
  const int E = d.num_experts;
  to = min(to, n);
  auto count = [&](int j, int id) {
    if (id < 0 || id >= E) return;
    if (total) atomicAdd(total + id, 1);
    if (j < split) atomicAdd(before + id, 1);
  };
  for_each_id<8>(ids, from, to, count);
}

// An expert id as the world-1 ranking takes it: an invalid one (not -1, not in [0, E)) is
// recorded and counts as -1.
__device__ inline int checked_expert_id(const CommView& v, int id) {
  if (id >= -1 && id < v.dims.num_experts) return id;
  record_error(v, kInvalidExpertId, kStageDispatchSend, id);
  return -1;
}

// Slot j's outputs at world 1, given its (checked) id and, for a valid id, its row: -2 past
// capacity (dropped), -1 without a token; slot_rows, send_dest and the row's weight. Returns
// the row.
__device__ inline int write_local_slot(const MoeDims& d, int j, int id, int row, float weight,
                                       int32_t* slot_rows, int32_t* send_dest,
                                       float* weights_out) {
  if (id < 0) row = -1;
  else if (row >= d.capacity) row = -2;  // dropped: capacity overflow
  slot_rows[j] = row;
  send_dest[j] = id >= 0 ? 0 : -1;
  if (row >= 0) weights_out[row] = weight;
  return row;
}

// Warp 0 gives the slots [t0 * K, t1 * K) their rows in (t, k) order: slot j of expert e is
// row first_row[e] + running[e] (running moves on), -2 past capacity, -1 for no token or an
// invalid id (recorded); it writes slot_rows, send_dest and the rows' weights, and the rows
// into `chunk_rows` (shared memory) when the chunk fits. `ids` and `weights` hold the chunk's
// slots from slot t0 * K on (staged in shared memory when the chunk fits).
__device__ void rank_local_chunk(const CommView& v, const Segments& g, int32_t* running,
                                 const int32_t* ids, const float* weights, int n, int t0,
                                 int t1, int32_t* send_dest, float* weights_out,
                                 int32_t* slot_rows, int32_t* chunk_rows) {
  if (block_warp() != 0) return;
  const MoeDims& d = v.dims;
  const int K = d.topk, lane = lane_id();
  const int begin = t0 * K, end = t1 * K;
  const bool cached = end - begin <= kLocalChunkSlots;
  const unsigned lanes_before = (1u << lane) - 1;
  for (int j0 = begin; j0 < end; j0 += 32) {
    const int j = j0 + lane;
    const int id = checked_expert_id(v, j < end && j < n ? ids[j - begin] : -1);
    const unsigned same = __match_any_sync(kFullMask, id);
    const int before = __popc(same & lanes_before);
    const int rank = id >= 0 ? running[id] + before : 0;
    __syncwarp();
    if (id >= 0 && before == 0) running[id] += __popc(same);
    __syncwarp();
    if (j >= end) continue;
    const int row = write_local_slot(d, j, id, id >= 0 ? g.first_row[id] + rank : -1,
                                     weights[j - begin], slot_rows, send_dest, weights_out);
    if (cached) chunk_rows[j - begin] = row;
  }
}

// Every token t in [t0, t1) with a row goes to its rows, one warp per (token, part of its
// row); `rows` holds the chunk's slot rows from slot t0 * K on.
template <TokenInput kInput, int kCPL>
__device__ void place_local_chunk(const MoeDims& d, const void* x, const float* x_scales,
                                  const int32_t* rows, int t0, int t1, void* x_out,
                                  float* scales_out, int32_t* smem) {
  const int K = d.topk, lane = lane_id(), warp = block_warp();
  __shared__ int32_t warp_rows[kExchangeWarps][32];
  const int tokens = max(0, t1 - t0);
  const int parts = row_parts(d, kInput, tokens);
  const uint32_t row_bytes = d.fp8 ? d.hidden : 2 * d.hidden;  // x_out: fp8 codes or bf16
  for (int task = warp; task < tokens * parts; task += kExchangeWarps) {
    const int t = t0 + task / parts, part = task % parts;
    const int row = lane < K ? rows[(t - t0) * K + lane] : -1;
    const unsigned placed = __ballot_sync(kFullMask, row >= 0);
    if (!placed) continue;
    if (row >= 0) warp_rows[warp][__popc(placed & ((1u << lane) - 1))] = row;
    __syncwarp();
    const RowSink<kHeldRows<kCPL>> sink{
        static_cast<char*>(x_out), scales_out,
        {reinterpret_cast<const uint32_t*>(warp_rows[warp]), __popc(placed)}, row_bytes,
        scale_blocks(d)};
    send_token_part<kInput, kCPL>(d, x, x_scales, t, part, parts, sink, warp_ring(smem));
    __syncwarp();
  }
}

// A block's first chunk staged in shared memory (the send ring's bytes) when it fits: decode
// sizes, a token or a few a block. Its x rows are loaded with cp.async when the kernel starts,
// so the loads fly while the block counts; the warps that do not rank quantize them in shared
// memory while warp 0 ranks; then every warp copies each staged row to its rows. Only the row
// stores are left after the ranking (they were 4.3 us of the 8.2 at decode, at 2fc1d2c).
// Byte offsets from the ring's start, for n tokens:
//   in                   the chunk's x rows as given: bf16 [n][H], or fp8 codes [n][H]
//   in_scales            fp8 input: its f32 scales [n][nb]
//   out, out_scales      quantizing input: fp8 codes [n][H], f32 scales [n][nb]
// (bf16 and fp8 inputs are staged in the form their output rows take.)
struct StagedLayout {
  uint32_t in_scales;
  uint32_t out;
  uint32_t out_scales;
  uint32_t total;  // at most UINT32_MAX: the chunk is staged only when it fits kSendRingBytes
};

JAX_MOE_HD inline StagedLayout staged_layout(const MoeDims& d, TokenInput input, int n) {
  // Computed in 64 bits and kept in 32 (offsets into shared memory are small when the chunk
  // fits, and four 32-bit offsets live in registers through the world-1 kernel's loop).
  const size_t H = d.hidden, nb = d.hidden / d.block_size;
  const size_t in_scales = n * H * (input == kInputFp8 ? 1 : 2);
  const size_t in_end = align_up(in_scales + (input == kInputFp8 ? 4 * n * nb : 0), 16);
  const bool quantize = input == kInputBf16Quantize;
  const size_t out = quantize ? in_end : 0;
  const size_t out_scales = out + n * H;
  const size_t total = quantize ? align_up(out_scales + 4 * n * nb, 16) : in_end;
  if (total > UINT32_MAX) return StagedLayout{0, 0, 0, UINT32_MAX};
  return StagedLayout{uint32_t(in_scales), uint32_t(out), uint32_t(out_scales), uint32_t(total)};
}

// Starts the loads of tokens [t0, t0 + n)'s x rows (and fp8 scales) into `ring`; all
// threads, one cp.async group each.
template <TokenInput kInput>
__device__ void stage_rows(const MoeDims& d, const void* x, const float* x_scales, int t0,
                           int n, const StagedLayout& s, char* ring) {
  const size_t row_bytes = size_t(d.hidden) * (kInput == kInputFp8 ? 1 : 2);
  const uint4* rows = reinterpret_cast<const uint4*>(static_cast<const char*>(x) + t0 * row_bytes);
  const int vectors = static_cast<int>(n * row_bytes / 16);
  for (int i = threadIdx.x; i < vectors; i += blockDim.x)
    copy_async16(reinterpret_cast<uint4*>(ring) + i, rows + i);
  if constexpr (kInput == kInputFp8) {
    const int nb = d.hidden / d.block_size;
    float* scales = reinterpret_cast<float*>(ring + s.in_scales);
    for (int i = threadIdx.x; i < n * nb; i += blockDim.x)
      copy_async4(scales + i, x_scales + size_t(t0) * nb + i);
  }
  copy_async_commit();
}

// StagedSink writes one row of the staged chunk's quantized form (shared memory).
struct StagedSink {
  uint4* row;
  float* row_scales;
  __device__ void codes(int c, uint2 value) const { reinterpret_cast<uint2*>(row)[c] = value; }
  __device__ void scale_run(int b, int n, float value) const {
    if (lane_id() < n) row_scales[b + lane_id()] = value;
  }
};

// Warps [1, kExchangeWarps) quantize the n staged bf16 rows into their fp8 form (warp 0 is
// ranking meanwhile), each a part of a row's scale blocks.
template <int kCPL>
__device__ void quantize_staged(const MoeDims& d, const StagedLayout& s, int n, char* ring) {
  const int warps = kExchangeWarps - 1, warp = block_warp() - 1;
  if (warp < 0 || n == 0) return;  // blocks past the tokens stage none (decode, T < grid)
  const int H = d.hidden, nb = H / d.block_size;
  const int parts = max(1, min(nb, (warps + n - 1) / n));
  for (int task = warp; task < n * parts; task += warps) {
    const int i = task / parts, part = task % parts;
    const StagedSink sink{reinterpret_cast<uint4*>(ring + s.out + size_t(i) * H),
                          reinterpret_cast<float*>(ring + s.out_scales) + i * nb};
    const uint4* row = reinterpret_cast<const uint4*>(ring) + size_t(i) * (H / 8);
    send_quantized<kCPL, StagedSink, true>(d, row, sink, part_begin(nb, part, parts),
                                           part_begin(nb, part + 1, parts), nullptr);
  }
}

// Every staged row, in the form of its output rows (the quantized copy when kInput quantizes;
// scales unless the rows are bf16), to each of its slots' rows (`rows`: the chunk's slot
// rows, n * K), one warp per (slot, half a row).
template <TokenInput kInput>
__device__ void place_staged_chunk(const MoeDims& d, const StagedLayout& s, const char* ring,
                                   const int32_t* rows, int n, void* x_out, float* scales_out) {
  constexpr int kParts = 2;
  constexpr bool kQuantized = kInput == kInputBf16Quantize;
  const uint4* rows_in = reinterpret_cast<const uint4*>(ring + (kQuantized ? s.out : 0));
  const float* scales_in =
      kInput == kInputBf16
          ? nullptr
          : reinterpret_cast<const float*>(ring + (kQuantized ? s.out_scales : s.in_scales));
  const int K = d.topk, nb = scale_blocks(d);
  const int row_vectors = d.fp8 ? d.hidden / 16 : d.hidden / 8;
  uint4* out = static_cast<uint4*>(x_out);
  for (int task = block_warp(); task < n * K * kParts; task += kExchangeWarps) {
    const int j = task / kParts, part = task % kParts, row = rows[j];
    if (row < 0) continue;
    const uint4* from = rows_in + size_t(j / K) * row_vectors;
    uint4* to = out + size_t(row) * row_vectors;
    for (int c = part_begin(row_vectors, part, kParts) + lane_id();
         c < part_begin(row_vectors, part + 1, kParts); c += 32)
      to[c] = from[c];
    if (part == 0 && scales_in)
      for (int b = lane_id(); b < nb; b += 32)
        scales_out[size_t(row) * nb + b] = scales_in[(j / K) * nb + b];
  }
}

// The fused dispatch at world 1 (outputs as dispatch_kernel's). Block b handles chunks b, b +
// grid, ...; the counters still move as the fused op's, so halves may follow.
template <TokenInput kInput, int kCPL>
__global__ void __launch_bounds__(kExchangeThreads, 1)
dispatch_local_kernel(CommView v, const void* x, const float* x_scales,
                      const int32_t* topk_ids, const float* topk_weights,
                      const int32_t* num_tokens, int32_t* send_dest, void* x_out,
                      float* scales_out, float* weights_out, int32_t* group_sizes,
                      int32_t* tokens_per_expert, int32_t* slot_rows) {
  const MoeDims& d = v.dims;
  const int K = d.topk, E = d.num_experts;
  extern __shared__ __align__(16) int32_t smem[];  // local_dispatch_smem_bytes(d)
  Segments g = segments_at(d, smem + kSendRingBytes / 4);
  int32_t* running = g.ntok + 1;
  int32_t* chunk_rows = running + E;
  int32_t* chunk_ids = chunk_rows + kLocalChunkSlots;
  float* chunk_w = reinterpret_cast<float*>(chunk_ids + kLocalChunkSlots);
  clock_mark(v, kClockDispatch, kMarkSendStart);
  const int staged_t0 = chunk_begin(v, blockIdx.x);
  const int staged_n = chunk_begin(v, blockIdx.x + 1) - staged_t0;
  const StagedLayout staging = staged_layout(d, kInput, staged_n);
  const bool staged = staging.total <= kSendRingBytes && staged_n * K <= kLocalChunkSlots;
  char* ring = reinterpret_cast<char*>(smem);
  if (staged) stage_rows<kInput>(d, x, x_scales, staged_t0, staged_n, staging, ring);
  const CallCounts calls = load_call_counts(v, kSeqDispatchSend, kSeqDispatchRecv);
  const int given = *num_tokens;
  // The first chunk's ids and weights travel with the counting's loads, so its ranking reads
  // shared memory only.
  const int first = staged_t0 * K;
  const int first_end = (staged_t0 + staged_n) * K;
  if (first_end - first <= kLocalChunkSlots)
    stage_chunk(topk_ids, topk_weights, first, first_end, chunk_ids, chunk_w);
  for (int e = threadIdx.x; e < E; e += blockDim.x) g.first_row[e] = running[e] = 0;
  __syncthreads();
  const int ntok = min(max(given, 0), d.max_tokens), n = ntok * K;
  // The counts into g.first_row (a source's row counts, as finish_segments takes them) and
  // those before this block's first chunk into running.
  count_slots(d, topk_ids, 0, d.max_tokens * K, n, first, g.first_row, running);
  if (threadIdx.x == 0) g.ntok[0] = ntok;
  if (staged) copy_async_wait<0>();  // the staged rows, visible to all after the barrier
  __syncthreads();
  // Nothing is written before the order check, so a refused launch leaves no trace but its
  // error.
  if (!in_call_order(v, calls, kPhaseBoth, kStageDispatchSend, kStageDispatchRecv)) return;
  if (blockIdx.x == 0 && threadIdx.x == 0 && given != ntok)
    record_error(v, kBadNumTokens, kStageDispatchSend, given);
  clock_mark(v, kClockDispatch, kMarkCountsSeen);
  finish_segments(d, g);
  write_segments(v, g, x_out, scales_out, weights_out, group_sizes, tokens_per_expert);
  clock_mark(v, kClockDispatch, kMarkSegments);
  int counted = first;  // slots [0, counted) are in running
  for (int c = blockIdx.x; c < v.chunks; c += gridDim.x) {
    const uint64_t seq = chunk_seq(v, kSeqDispatchSend, c);
    const int t0 = chunk_begin(v, c), t1 = chunk_begin(v, c + 1);
    const bool cached = (t1 - t0) * K <= kLocalChunkSlots;
    if (c != blockIdx.x) {  // a later chunk of this block: the slots in between, its ids
      count_slots(d, topk_ids, counted, t0 * K, n, t0 * K, nullptr, running);
      if (cached) stage_chunk(topk_ids, topk_weights, t0 * K, t1 * K, chunk_ids, chunk_w);
      __syncthreads();
    }
    const bool from_stage = staged && c == blockIdx.x;
    if constexpr (kInput == kInputBf16Quantize)
      if (from_stage) quantize_staged<kCPL>(d, staging, staged_n, ring);
    rank_local_chunk(v, g, running, cached ? chunk_ids : topk_ids + t0 * K,
                     cached ? chunk_w : topk_weights + t0 * K, n, t0, t1, send_dest,
                     weights_out, slot_rows, chunk_rows);
    counted = t1 * K;
    __syncthreads();
    if (c == blockIdx.x) clock_mark(v, kClockDispatch, kMarkRanked);
    if (from_stage) {
      place_staged_chunk<kInput>(d, staging, ring, chunk_rows, staged_n, x_out, scales_out);
    } else {
      place_local_chunk<kInput, kCPL>(d, x, x_scales, cached ? chunk_rows : slot_rows + t0 * K,
                                      t0, min(t1, ntok), x_out, scales_out, smem);
    }
    __syncthreads();
    finish_chunk(v, kSeqDispatchSend, c, seq);
    finish_chunk(v, kSeqDispatchRecv, c, seq);
  }
  clock_mark(v, kClockDispatch, kMarkRecvDone);
}

// World 1 at decode sizes: every block one chunk of at most kDecodeSlots slots, expert padding
// 1. Expert e's segment then starts at the number of slots with a smaller expert, and slot j
// of expert e is row #{j' valid : (id[j'], j') < (e, j)} (lexicographic; valid: a token's slot
// with an expert id in [0, E)). So a block ranks its chunk's slots by counting one predicate
// per slot over all T * K ids, plus one per expert whose group size it writes and one for the
// total: per-thread counts in registers, a warp reduction each, one barrier. The per-expert
// histogram, the scan and the ranking that dispatch_local_kernel chains (count -> barrier ->
// segments -> barrier -> rank -> barrier, ~3.5 us at decode) are gone; the rows are staged and
// quantized as there, and the layout is the same, bit for bit.
constexpr int kDecodeSlots = 16;
constexpr int kDecodeExperts = 4;  // experts whose sizes a block writes: E <= 4 * grid
constexpr int kDecodeTotal = kDecodeSlots + kDecodeExperts;  // counter of every valid slot
constexpr int kDecodeCounters = kDecodeTotal + 1;

// Whether launch_dispatch may take dispatch_local_decode_kernel for `input`.
bool local_decode_fits(const CommView& v, TokenInput input) {
  const MoeDims& d = v.dims;
  const int tokens = (d.max_tokens + v.chunks - 1) / v.chunks;  // the largest chunk
  return d.world == 1 && v.grid == v.chunks && d.expert_padding == 1 &&
         tokens * d.topk <= kDecodeSlots && d.num_experts <= kDecodeExperts * v.grid &&
         staged_layout(d, input, tokens).total <= kSendRingBytes;
}

template <TokenInput kInput, int kCPL>
__global__ void __launch_bounds__(kExchangeThreads, 1)
dispatch_local_decode_kernel(CommView v, const void* x, const float* x_scales,
                             const int32_t* topk_ids, const float* topk_weights,
                             const int32_t* num_tokens, int32_t* send_dest, void* x_out,
                             float* scales_out, float* weights_out, int32_t* group_sizes,
                             int32_t* tokens_per_expert, int32_t* slot_rows) {
  const MoeDims& d = v.dims;
  const int K = d.topk, E = d.num_experts, C = d.capacity, lane = lane_id();
  extern __shared__ __align__(16) int32_t smem[];  // kSendRingBytes: the staged chunk
  __shared__ int32_t warp_counts[kExchangeWarps][kDecodeCounters];
  __shared__ int32_t chunk_rows[kDecodeSlots];
  clock_mark(v, kClockDispatch, kMarkSendStart);
  const int c = blockIdx.x;  // grid == chunks
  const int t0 = chunk_begin(v, c), tokens = chunk_begin(v, c + 1) - t0;
  const StagedLayout staging = staged_layout(d, kInput, tokens);
  char* ring = reinterpret_cast<char*>(smem);
  if (tokens > 0) stage_rows<kInput>(d, x, x_scales, t0, tokens, staging, ring);
  const CallCounts calls = load_call_counts(v, kSeqDispatchSend, kSeqDispatchRecv);
  const int given = *num_tokens;
  const int ntok = min(max(given, 0), d.max_tokens), n = ntok * K;
  const int first = t0 * K, slots = tokens * K;
  // Warp 0's lane s holds slot first + s as given (its id is checked when it is ranked).
  int own_id = -1;
  float own_weight = 0.f;
  if (block_warp() == 0 && lane < slots && first + lane < n) {
    own_id = topk_ids[first + lane];
    own_weight = topk_weights[first + lane];
  }
  // Every thread: the chunk's expert ids (a broadcast load; -1 where a slot has no row).
  int slot_id[kDecodeSlots];
#pragma unroll
  for (int s = 0; s < kDecodeSlots; ++s) {
    const int id = s < slots && first + s < n ? topk_ids[first + s] : -1;
    slot_id[s] = id < E ? id : -1;
  }
  int count[kDecodeCounters] = {};
  auto add = [&](int j, int id) {
    if (id < 0 || id >= E) return;
#pragma unroll
    for (int s = 0; s < kDecodeSlots; ++s)
      count[s] += id < slot_id[s] || (id == slot_id[s] && j < first + s);
#pragma unroll
    for (int i = 0; i < kDecodeExperts; ++i) count[kDecodeSlots + i] += id == c + i * v.grid;
    count[kDecodeTotal] += 1;
  };
  for_each_id<4>(topk_ids, 0, n, add);
#pragma unroll
  for (int i = 0; i < kDecodeCounters; ++i) {
    const int sum = __reduce_add_sync(kFullMask, count[i]);
    if (lane == 0) warp_counts[block_warp()][i] = sum;
  }
  if (tokens > 0) copy_async_wait<0>();  // the staged rows, visible to all after the barrier
  __syncthreads();
  // Nothing is written before the order check, so a refused launch leaves no trace but its
  // error.
  if (!in_call_order(v, calls, kPhaseBoth, kStageDispatchSend, kStageDispatchRecv)) return;
  clock_mark(v, kClockDispatch, kMarkCountsSeen);
  auto block_count = [&](int i) {
    int sum = 0;
#pragma unroll
    for (int w = 0; w < kExchangeWarps; ++w) sum += warp_counts[w][i];
    return sum;
  };
  const int total = block_count(kDecodeTotal);
  if (c == 0 && threadIdx.x == 0) {
    if (given != ntok) record_error(v, kBadNumTokens, kStageDispatchSend, given);
    if (total > C) record_error(v, kCapacityOverflow, kStageDispatchRecv, total);
  }
  if (threadIdx.x < kDecodeExperts) {
    const int e = c + threadIdx.x * v.grid;
    if (e < E) group_sizes[e] = tokens_per_expert[e] = block_count(kDecodeSlots + threadIdx.x);
  }
  for (int r = total + c * blockDim.x + threadIdx.x; r < C; r += v.grid * blockDim.x)
    weights_out[r] = 0.f;
  clock_mark(v, kClockDispatch, kMarkSegments);
  if (block_warp() == 0 && lane < slots) {  // the chunk's slots, as rank_local_chunk does
    const int id = checked_expert_id(v, own_id);
    chunk_rows[lane] = write_local_slot(d, first + lane, id, id >= 0 ? block_count(lane) : -1,
                                        own_weight, slot_rows, send_dest, weights_out);
  }
  if constexpr (kInput == kInputBf16Quantize) quantize_staged<kCPL>(d, staging, tokens, ring);
  __syncthreads();
  clock_mark(v, kClockDispatch, kMarkRanked);
  place_staged_chunk<kInput>(d, staging, ring, chunk_rows, tokens, x_out, scales_out);
  const uint64_t seq = chunk_seq(v, kSeqDispatchSend, c);
  finish_chunk(v, kSeqDispatchSend, c, seq);
  finish_chunk(v, kSeqDispatchRecv, c, seq);
  clock_mark(v, kClockDispatch, kMarkRecvDone);
}

// Block b handles chunks b, b + grid, ... of each phase it runs. One instance per phase set
// and send kind, so a profile names the halves apart and each carries only its own code.
template <int kPhases, TokenInput kInput, int kCPL>
__global__ void __launch_bounds__(kExchangeThreads, 1)
dispatch_kernel(CommView v, const void* x,
                const float* x_scales, const int32_t* topk_ids, const float* topk_weights,
                const int32_t* num_tokens, int32_t* send_dest, void* x_out, float* scales_out,
                float* weights_out, int32_t* group_sizes, int32_t* tokens_per_expert,
                int32_t* slot_rows) {
  const MoeDims& d = v.dims;
  const NvlinkLayout lay = nvlink_layout(d, v.chunks);
  extern __shared__ __align__(16) int32_t smem[];  // dispatch_smem_bytes(d)
  if (!begin_launch(v, kSeqDispatchSend, kSeqDispatchRecv, kPhases, kStageDispatchSend,
                    kStageDispatchRecv))
    return;

  if (kPhases & kPhaseSend) {
    clock_mark(v, kClockDispatch, kMarkSendStart);
    const uint64_t seq = chunk_seq(v, kSeqDispatchSend, blockIdx.x);
    const int given = *num_tokens;
    const int ntok = min(max(given, 0), d.max_tokens);
    const int route_parts = route_blocks(d, v.chunks);
    if (blockIdx.x < route_parts) {
      if (blockIdx.x == 0 && threadIdx.x == 0 && given != ntok)
        record_error(v, kBadNumTokens, kStageDispatchSend, given);
      route_slots(v, lay, seq, blockIdx.x, topk_ids, topk_weights, ntok, send_dest, smem);
      signal_peers(v, lay.route_flag, d.rank * route_parts + blockIdx.x, seq);
      clock_mark(v, kClockDispatch, kMarkRouted);
    }
    for (int c = blockIdx.x; c < v.chunks; c += gridDim.x) {
      send_chunk<kInput, kCPL>(v, lay, seq, x, x_scales, topk_ids, chunk_begin(v, c),
                               min(chunk_begin(v, c + 1), ntok), smem);
      signal_peers(v, lay.rows_flag, d.rank * v.chunks + c, seq);
      finish_chunk(v, kSeqDispatchSend, c, seq);
    }
    clock_mark(v, kClockDispatch, kMarkSent);
  }

  if (kPhases & kPhaseRecv) {
    clock_mark(v, kClockDispatch, kMarkRecvStart);
    const uint64_t seq = chunk_seq(v, kSeqDispatchRecv, blockIdx.x);
    const char* region = parity_region(v.local, lay, seq);
    // Every source's counts before any row: they place each expert's segment.
    const int route_parts = route_blocks(d, v.chunks);
    if (!wait_peers(v, lay.route_flag, route_parts, 0, seq, kStageDispatchRecv, route_parts))
      return;
    clock_mark(v, kClockDispatch, kMarkCountsSeen);
    const Segments g = build_segments(v, region, lay, smem);
    write_segments(v, g, x_out, scales_out, weights_out, group_sizes, tokens_per_expert);
    clock_mark(v, kClockDispatch, kMarkSegments);
    for (int c = blockIdx.x; c < v.chunks; c += gridDim.x) {
      if (!wait_peers(v, lay.rows_flag, v.chunks, c, seq, kStageDispatchRecv)) return;
      if (c == blockIdx.x) clock_mark(v, kClockDispatch, kMarkDataSeen);
      place_chunk(v, lay, region, seq, g, chunk_begin(v, c), chunk_begin(v, c + 1), x_out,
                  scales_out, weights_out, slot_rows);
      __syncthreads();
      finish_chunk(v, kSeqDispatchRecv, c, seq);
    }
    clock_mark(v, kClockDispatch, kMarkRecvDone);
  }
}

// Dynamic shared memory of a dispatch block, used in turn by the route table, the quantizing
// send's ring and the segments: the largest of them (the state refuses dims where the table
// or the segments need more than kExchangeSmem).
size_t dispatch_smem_bytes(const MoeDims& d) {
  const size_t route = 4 * size_t(route_warps(d)) * d.num_experts;
  const size_t place = place_smem_bytes(d);
  return std::max({route, place, kSendRingBytes});
}

// The kernels of one launch kind for each send kind (token input, quantization width): a block
// runs the code of one kind only, not every kind's inlined (the v2.1 send kernel was 207 KB
// of SASS and the world-1 kernel 383 KB, and a decode block runs its path once, cold).
using DispatchKernel = void (*)(CommView, const void*, const float*, const int32_t*,
                                const float*, const int32_t*, int32_t*, void*, float*, float*,
                                int32_t*, int32_t*, int32_t*);

template <int kPhases>
struct BufferKernels {
  template <TokenInput kInput, int kCPL>
  static DispatchKernel get() { return dispatch_kernel<kPhases, kInput, kCPL>; }
};

struct LocalKernels {
  template <TokenInput kInput, int kCPL>
  static DispatchKernel get() { return dispatch_local_kernel<kInput, kCPL>; }
};

struct LocalDecodeKernels {
  template <TokenInput kInput, int kCPL>
  static DispatchKernel get() { return dispatch_local_decode_kernel<kInput, kCPL>; }
};

// Vectors a lane quantizes per scale block (send_quantized's CPL): block_size / 8 vectors over
// at most 32 lanes.
int quantize_cpl(const MoeDims& d) {
  const int vectors = d.block_size / 8;
  return vectors / std::min(vectors, 32);
}

template <typename Kernels>
DispatchKernel pick_send(TokenInput input, const MoeDims& d) {
  if (input == kInputBf16) return Kernels::template get<kInputBf16, 1>();
  if (input == kInputFp8) return Kernels::template get<kInputFp8, 1>();
  switch (quantize_cpl(d)) {
    case 1: return Kernels::template get<kInputBf16Quantize, 1>();
    case 2: return Kernels::template get<kInputBf16Quantize, 2>();
    case 4: return Kernels::template get<kInputBf16Quantize, 4>();
    default: return Kernels::template get<kInputBf16Quantize, 8>();
  }
}

}  // namespace

cudaError_t launch_dispatch(const CommView& view, int phases, TokenInput input, const void* x,
                            const float* x_scales, const int32_t* topk_ids,
                            const float* topk_weights, const int32_t* num_tokens,
                            int32_t* send_dest, void* x_out, float* scales_out,
                            float* weights_out, int32_t* group_sizes,
                            int32_t* tokens_per_expert, int32_t* slot_rows,
                            cudaStream_t stream) {
  const bool local = phases == kPhaseBoth && view.dims.world == 1;
  const bool decode = local && local_decode_fits(view, input);
  const DispatchKernel kernel = decode  ? pick_send<LocalDecodeKernels>(input, view.dims)
                                : local ? pick_send<LocalKernels>(input, view.dims)
                                : phases == kPhaseSend ? pick_send<BufferKernels<kPhaseSend>>(
                                                             input, view.dims)
                                : phases == kPhaseRecv ? dispatch_kernel<kPhaseRecv, kInputBf16, 1>
                                                       : pick_send<BufferKernels<kPhaseBoth>>(
                                                             input, view.dims);
  const size_t smem = decode  ? kSendRingBytes
                      : local ? local_dispatch_smem_bytes(view.dims)
                              : dispatch_smem_bytes(view.dims);
  // Above 48 KiB a kernel must opt in (per device; cheap, and allowed during graph capture).
  const cudaError_t opt_in =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  if (opt_in != cudaSuccess) return opt_in;
  kernel<<<view.grid, kExchangeThreads, smem, stream>>>(
      view, x, x_scales, topk_ids, topk_weights, num_tokens, send_dest, x_out, scales_out,
      weights_out, group_sizes, tokens_per_expert, slot_rows);
  return cudaGetLastError();
}

}  // namespace jax_moe
