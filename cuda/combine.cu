// Combine over NVLink, one kernel with a send phase and a receive phase (the fused op runs
// both, combine_send / combine_recv one each). Protocol and buffer layout:
// ffi/protocol/nvlink_layout.h; the sums: docs/semantics.md.
//
// Send (every rank, as the expert rank): per chunk of tokens of every source, each dispatched
// row ("source" mode), or one weighted partial per (source, token) ("expert" mode), goes to
// the source's combine region; then comb_flag of the chunk is raised on every rank.
// Receive (every rank, as the source): per chunk, waits for every rank's flag of that chunk
// and sums its tokens in the reference order.
#include <algorithm>

#include "cuda/api.cuh"
#include "cuda/exchange.cuh"
#include "cuda/rows.cuh"

namespace jax_moe {
namespace {

constexpr int kBatch = 8;  // rows loaded before they are summed (memory-level parallelism)
constexpr int kChunksPerLane = 2;  // vectors one lane sums at once (loads in flight x2)

// Pieces a row of H/8 vectors is cut into so that `items` warp tasks keep the block busy
// (>= 32 vectors a piece).
__device__ inline int hidden_parts(const MoeDims& d, int items) {
  const int want = items > 0 ? (kExchangeWarps + items - 1) / items : 1;
  return max(1, min(want, d.hidden / 8 / 32));
}

// The warp's vectors [begin, end) of sum over i < count of w_i * row_i, in i order from +0 in
// f32 with both roundings explicit; load(i, c) gives vector c of row i, store(c, acc) takes
// vector c's eight sums; lane i (< count <= 32) holds w_i in `weight`. Each lane sums
// kChunksPerLane vectors at once: up to kBatch * kChunksPerLane loads in flight before the
// sums. The loop bound is the warp's, not the lane's: every lane must reach the weight
// shuffle (a lane past `end` with a row of fewer than 32 vectors, hidden 128, left it waiting
// for ever).
template <typename Load, typename Store>
__device__ void sum_weighted_rows(int count, float weight, int begin, int end, Load load,
                                  Store store) {
  const int lane = lane_id();
  for (int base = begin; base < end; base += 32 * kChunksPerLane) {
    const int c0 = base + lane;
    float acc[kChunksPerLane][8];
#pragma unroll
    for (int j = 0; j < kChunksPerLane; ++j)
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[j][i] = 0.f;
    for (int i0 = 0; i0 < count; i0 += kBatch) {
      uint4 vals[kBatch][kChunksPerLane];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        if (i0 + u >= count) continue;
#pragma unroll
        for (int j = 0; j < kChunksPerLane; ++j)
          if (c0 + 32 * j < end) vals[u][j] = load(i0 + u, c0 + 32 * j);
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const float w = __shfl_sync(kFullMask, weight, (i0 + u) & 31);
        if (i0 + u >= count) continue;
#pragma unroll
        for (int j = 0; j < kChunksPerLane; ++j) {
          if (c0 + 32 * j >= end) continue;
          float f[8];
          bf16x8_to_f32(vals[u][j], f);
          accumulate_scaled(acc[j], w, f);
        }
      }
    }
#pragma unroll
    for (int j = 0; j < kChunksPerLane; ++j)
      if (c0 + 32 * j < end) store(c0 + 32 * j, acc[j]);
  }
}

// load() of sum_weighted_rows for rows of y [C][chunks] listed in a per-warp table in shared
// memory; rows[i] < 0 is a zero row, whose w_i * 0 still enters the sum, as the zero rows the
// source mode sends do.
struct TableRows {
  const uint4* y;
  int chunks;
  const int32_t* rows;
  __device__ uint4 operator()(int i, int c) const {
    const int row = rows[i];
    return row >= 0 ? y[size_t(row) * chunks + c] : make_uint4(0, 0, 0, 0);
  }
};

// Source mode, one chunk: one warp per (source s, token t, slot k, part of hidden) held here:
// y[row] to comb[t][k] on s (zeros for a slot dropped by capacity overflow, so it adds nothing
// there).
__device__ void send_rows(const CommView& v, const NvlinkLayout& lay, uint64_t seq,
                          const uint4* y, const int32_t* slot_rows, int t0, int t1) {
  const MoeDims& d = v.dims;
  const int T = d.max_tokens, K = d.topk, C = d.capacity, chunks = d.hidden / 8;
  const int tokens = t1 - t0, items = d.world * tokens * K;
  const int parts = hidden_parts(d, items);
  for (int task = block_warp(); task < items * parts; task += kExchangeWarps) {
    const int item = task / parts, part = task % parts;
    const int s = item / (tokens * K), t = t0 + item / K % tokens, k = item % K;
    const int row = slot_rows[(size_t(s) * T + t) * K + k];
    if (row == -1) continue;
    uint4* dst = reinterpret_cast<uint4*>(parity_region(block_peers[s], lay, seq) + lay.combine) +
                 (size_t(t) * K + k) * chunks;
    const int begin = part_begin(chunks, part, parts), end = part_begin(chunks, part + 1, parts);
    if (row >= 0 && row < C) {
      const uint4* src = y + size_t(row) * chunks;
      warp_copy(begin, end, [&](int c) { return src[c]; },
                [&](int c, uint4 value) { dst[c] = value; });
    } else {
      for (int c = begin + lane_id(); c < end; c += 32) dst[c] = make_uint4(0, 0, 0, 0);
    }
  }
}

// Expert mode, one chunk: one warp per (source s, token t with a slot here, part of hidden):
// p = sum in k order of w * y[row] in f32, stored in the partial dtype at part[this rank][t]
// on s.
__device__ void send_partials(const CommView& v, const NvlinkLayout& lay, uint64_t seq,
                              const uint4* y, const int32_t* slot_rows,
                              const float* row_weights, int t0, int t1) {
  const MoeDims& d = v.dims;
  const int T = d.max_tokens, K = d.topk, C = d.capacity, me = d.rank, chunks = d.hidden / 8;
  const int lane = lane_id(), warp = block_warp();
  const int tokens = t1 - t0, items = d.world * tokens;
  const int parts = hidden_parts(d, items);
  const size_t pbytes = partial_bytes(d);
  // Rows of the slots of (s, t) that have one here, compacted in k order.
  __shared__ int32_t warp_rows[kExchangeWarps][32];
  for (int task = warp; task < items * parts; task += kExchangeWarps) {
    const int item = task / parts, part = task % parts;
    const int s = item / tokens, t = t0 + item % tokens;
    int row = lane < K ? slot_rows[(size_t(s) * T + t) * K + lane] : -1;
    if (row >= C || row < -1) row = -2;  // held here but no row: contributes nothing
    if (!__ballot_sync(kFullMask, row != -1)) continue;
    const unsigned with_row = __ballot_sync(kFullMask, row >= 0);
    const int rows_here = __popc(with_row);
    // Lane i holds the weight of the i-th row: its load is in flight with the rows' loads
    // below (it is only needed by the sums, through a shuffle).
    if (row >= 0) {
      const int i = __popc(with_row & ((1u << lane) - 1));  // k order kept
      warp_rows[warp][i] = row;
    }
    __syncwarp();
    const float weight = lane < rows_here ? row_weights[warp_rows[warp][lane]] : 0.f;
    char* dst = parity_region(block_peers[s], lay, seq) + lay.combine +
                (size_t(me) * T + t) * d.hidden * pbytes;
    const int begin = part_begin(chunks, part, parts), end = part_begin(chunks, part + 1, parts);
    sum_weighted_rows(rows_here, weight, begin, end, TableRows{y, chunks, warp_rows[warp]},
                      [&](int c, const float acc[8]) { store_partial(d, dst, c, acc); });
    __syncwarp();
  }
}

// Receive, one chunk: one warp per (token t, part of hidden): out[t] = bf16(sum in f32) over
// its valid slots in k order (source mode) or over the ranks holding one of its slots in rank
// order (expert mode). Tokens with no valid slot (and t >= num_tokens) come out zero.
__device__ void sum_chunk(const CommView& v, const char* region, const NvlinkLayout& lay,
                          const int32_t* send_dest, const float* topk_weights, uint4* out,
                          int t0, int t1) {
  const MoeDims& d = v.dims;
  const int R = d.world, T = d.max_tokens, K = d.topk, chunks = d.hidden / 8;
  const int lane = lane_id(), warp = block_warp();
  const int tokens = t1 - t0;
  const int parts = hidden_parts(d, tokens);
  __shared__ int32_t warp_dest[kExchangeWarps][32];  // expert mode: each slot's rank
  __shared__ int32_t warp_k[kExchangeWarps][32];     // source mode: the slots summed, in k order
  const uint4* comb = reinterpret_cast<const uint4*>(region + lay.combine);
  for (int task = warp; task < tokens * parts; task += kExchangeWarps) {
    const int t = t0 + task / parts, part = task % parts;
    int dest = lane < K ? send_dest[t * K + lane] : -1;
    if (dest < 0 || dest >= R) dest = -1;
    const int begin = part_begin(chunks, part, parts), end = part_begin(chunks, part + 1, parts);
    uint4* dst = out + size_t(t) * chunks;
    if (!d.reduce_expert) {
      // The slots with a rank, in k order: lane i takes the i-th one's k and weight.
      const float w = lane < K ? topk_weights[t * K + lane] : 0.f;
      const bool sent = dest >= 0;
      const unsigned summed = __ballot_sync(kFullMask, sent);
      if (sent) warp_k[warp][__popc(summed & ((1u << lane) - 1))] = lane;
      __syncwarp();
      const float weight = __shfl_sync(kFullMask, w, __fns(summed, 0, lane + 1) & 31);
      const uint4* token_rows = comb + size_t(t) * K * chunks;  // [k][chunks]
      sum_weighted_rows(__popc(summed), weight, begin, end,
                        [&](int i, int c) {
                          return __ldcg(token_rows + size_t(warp_k[warp][i]) * chunks + c);
                        },
                        [&](int c, const float acc[8]) { dst[c] = f32_to_bf16x8(acc); });
      __syncwarp();
      continue;
    }
    warp_dest[warp][lane] = dest;
    __syncwarp();
    uint64_t ranks = 0;
    for (int k = 0; k < K; ++k)
      if (warp_dest[warp][k] >= 0) ranks |= 1ull << warp_dest[warp][k];
    // Expert mode: each lane sums kChunksPerLane vectors at once (twice the loads in flight);
    // every element is still summed in rank order from 0.
    for (int c0 = begin + lane; c0 < end; c0 += 32 * kChunksPerLane) {
      float acc[kChunksPerLane][8];
#pragma unroll
      for (int j = 0; j < kChunksPerLane; ++j)
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[j][i] = 0.f;
      for (int p = 0; p < R; ++p) {
        if (!((ranks >> p) & 1)) continue;
        const size_t part_row = size_t(p) * T + t;
#pragma unroll
        for (int j = 0; j < kChunksPerLane; ++j) {
          const int c = c0 + 32 * j;
          if (c >= end) continue;
          float f[8];
          if (d.partial_bf16) {
            bf16x8_to_f32(__ldcg(comb + part_row * chunks + c), f);
          } else {
            const float4* src = reinterpret_cast<const float4*>(comb) + (part_row * chunks + c) * 2;
            const float4 a = __ldcg(src), b = __ldcg(src + 1);
            f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w;
            f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
          }
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[j][i] = __fadd_rn(acc[j][i], f[i]);
        }
      }
#pragma unroll
      for (int j = 0; j < kChunksPerLane; ++j)
        if (c0 + 32 * j < end) dst[c0 + 32 * j] = f32_to_bf16x8(acc[j]);
    }
    __syncwarp();
  }
}

// World 1: the fused combine without the buffer (as dispatch_local_kernel): each token's sum
// straight from y, one warp per (token, part of hidden), in the order and roundings of the
// buffer path. Expert mode: the one rank's partial (rows held here in k order) in the partial
// dtype, then the source's sum over ranks, +0 + partial, when send_dest names the rank.
// Source mode: the slots send_dest names in k order, a slot without a row here (dropped) as a
// zero row. Both weigh slot (t, k) by topk_weights[t, k]: the value the dispatch copied to
// row_weights[row], read without waiting for the row.
__device__ void combine_local_chunk(const MoeDims& d, const uint4* y, const int32_t* slot_rows,
                                    const int32_t* send_dest, const float* topk_weights,
                                    uint4* out, int t0, int t1) {
  const int K = d.topk, C = d.capacity, chunks = d.hidden / 8;
  const int lane = lane_id(), warp = block_warp();
  const unsigned lanes_before = (1u << lane) - 1;
  const int tokens = t1 - t0;
  const int parts = hidden_parts(d, tokens);
  __shared__ int32_t warp_rows[kExchangeWarps][32];
  for (int task = warp; task < tokens * parts; task += kExchangeWarps) {
    const int t = t0 + task / parts, part = task % parts;
    const bool sent = lane < K && send_dest[t * K + lane] == 0;
    const float w = lane < K ? topk_weights[t * K + lane] : 0.f;
    int row = lane < K ? slot_rows[t * K + lane] : -1;
    if (row >= C || row < -1) row = -2;
    const int begin = part_begin(chunks, part, parts), end = part_begin(chunks, part + 1, parts);
    uint4* dst = out + size_t(t) * chunks;
    // The slots summed, in k order: lane i takes the i-th one's row and weight.
    const unsigned summed = __ballot_sync(kFullMask, d.reduce_expert ? row >= 0 : sent);
    if ((summed >> lane) & 1) warp_rows[warp][__popc(summed & lanes_before)] = row;
    __syncwarp();
    const int count = __popc(summed);
    const float weight = __shfl_sync(kFullMask, w, __fns(summed, 0, lane + 1) & 31);
    if (d.reduce_expert) {
      const bool to_rank = __ballot_sync(kFullMask, sent) != 0;
      sum_weighted_rows(count, weight, begin, end, TableRows{y, chunks, warp_rows[warp]},
                        [&](int c, const float acc[8]) {
        float p[8];
        if (d.partial_bf16) bf16x8_to_f32(f32_to_bf16x8(acc), p);
#pragma unroll
        for (int i = 0; i < 8; ++i)
          p[i] = to_rank ? __fadd_rn(0.f, d.partial_bf16 ? p[i] : acc[i]) : 0.f;
        dst[c] = f32_to_bf16x8(p);
      });
    } else {  // rows -1 / -2 of summed slots read as zero rows
      sum_weighted_rows(count, weight, begin, end, TableRows{y, chunks, warp_rows[warp]},
                        [&](int c, const float acc[8]) { dst[c] = f32_to_bf16x8(acc); });
    }
    __syncwarp();
  }
}

__global__ void __launch_bounds__(kExchangeThreads, 1)
combine_local_kernel(CommView v, const uint4* y, const int32_t* slot_rows,
                     const float* /*row_weights: topk_weights instead*/, int32_t* done,
                     const int32_t* send_dest, const float* topk_weights, uint4* out) {
  const MoeDims& d = v.dims;
  const CallCounts calls = load_call_counts(v, kSeqCombineSend, kSeqCombineRecv);
  if (!in_call_order(v, calls, kPhaseBoth, kStageCombineSend, kStageCombineRecv)) return;
  clock_mark(v, kClockCombine, kMarkSendStart);
  if (done && blockIdx.x == 0 && threadIdx.x == 0) *done = 0;
  for (int c = blockIdx.x; c < v.chunks; c += gridDim.x) {
    const uint64_t seq = chunk_seq(v, kSeqCombineSend, c);
    combine_local_chunk(d, y, slot_rows, send_dest, topk_weights, out, chunk_begin(v, c),
                        chunk_begin(v, c + 1));
    __syncthreads();
    finish_chunk(v, kSeqCombineSend, c, seq);
    finish_chunk(v, kSeqCombineRecv, c, seq);
  }
  clock_mark(v, kClockCombine, kMarkRecvDone);
}

// Block b handles chunks b, b + grid, ... of each phase it runs (one instance per phase set).
template <int kPhases>
__global__ void __launch_bounds__(kExchangeThreads, 1)
combine_kernel(CommView v, const uint4* y, const int32_t* slot_rows,
               const float* row_weights, int32_t* done, const int32_t* send_dest,
               const float* topk_weights, uint4* out) {
  const MoeDims& d = v.dims;
  const NvlinkLayout lay = nvlink_layout(d, v.chunks);
  if (!begin_launch(v, kSeqCombineSend, kSeqCombineRecv, kPhases, kStageCombineSend,
                    kStageCombineRecv))
    return;
  if (kPhases & kPhaseSend) {
    clock_mark(v, kClockCombine, kMarkSendStart);
    const uint64_t seq = chunk_seq(v, kSeqCombineSend, blockIdx.x);
    if (done && blockIdx.x == 0 && threadIdx.x == 0) *done = 0;
    for (int c = blockIdx.x; c < v.chunks; c += gridDim.x) {
      const int t0 = chunk_begin(v, c), t1 = chunk_begin(v, c + 1);
      if (d.reduce_expert) send_partials(v, lay, seq, y, slot_rows, row_weights, t0, t1);
      else send_rows(v, lay, seq, y, slot_rows, t0, t1);
      signal_peers(v, lay.comb_flag, d.rank * v.chunks + c, seq);
      finish_chunk(v, kSeqCombineSend, c, seq);
    }
    clock_mark(v, kClockCombine, kMarkSent);
  }
  if (kPhases & kPhaseRecv) {
    clock_mark(v, kClockCombine, kMarkRecvStart);
    const uint64_t seq = chunk_seq(v, kSeqCombineRecv, blockIdx.x);
    const char* region = parity_region(v.local, lay, seq);
    for (int c = blockIdx.x; c < v.chunks; c += gridDim.x) {
      if (!wait_peers(v, lay.comb_flag, v.chunks, c, seq, kStageCombineRecv)) return;
      if (c == blockIdx.x) clock_mark(v, kClockCombine, kMarkDataSeen);
      sum_chunk(v, region, lay, send_dest, topk_weights, out, chunk_begin(v, c),
                chunk_begin(v, c + 1));
      __syncthreads();
      finish_chunk(v, kSeqCombineRecv, c, seq);
    }
    clock_mark(v, kClockCombine, kMarkRecvDone);
  }
}

}  // namespace

cudaError_t launch_combine(const CommView& view, int phases, const void* y,
                           const int32_t* slot_rows, const float* row_weights, int32_t* done,
                           const int32_t* send_dest, const float* topk_weights, void* out,
                           cudaStream_t stream) {
  auto kernel = phases == kPhaseBoth && view.dims.world == 1 ? combine_local_kernel
                : phases == kPhaseSend                       ? combine_kernel<kPhaseSend>
                : phases == kPhaseRecv                       ? combine_kernel<kPhaseRecv>
                                                             : combine_kernel<kPhaseBoth>;
  kernel<<<view.grid, kExchangeThreads, 0, stream>>>(
      view, static_cast<const uint4*>(y), slot_rows, row_weights, done, send_dest,
      topk_weights, static_cast<uint4*>(out));
  return cudaGetLastError();
}

}  // namespace jax_moe
