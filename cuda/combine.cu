// Combine over NVLink: combine_send (expert rank) returns each dispatched row, or in "expert"
// mode one weighted partial per (source, token), into the source's combine region;
// combine_recv (source rank) waits for every rank and sums in the reference order.
// Buffer layout: cuda/layout.cuh.
#include <algorithm>

#include "cuda/api.cuh"
#include "cuda/rows.cuh"
#include "cuda/sync.cuh"

namespace jax_moe {
namespace {

constexpr int kBatch = 8;  // rows loaded before they are summed (memory-level parallelism)
constexpr int kChunksPerLane = 2;  // vectors one lane sums at once (loads in flight x2)

// Source mode: one warp per slot (s, t, k) held here; y[row] goes to comb[t][k] on source s
// (zeros for a slot dropped by capacity overflow, so it adds nothing there).
// Expert mode: one warp per (s, t) with a slot here and part of hidden (`parts` per row, so
// that a decode-sized call spreads over every warp of the grid); p = sum in k order of
// w * y[row] in f32, stored in partial dtype at part[this rank][t] on source s.
// The last block publishes the sequence to every rank.
__global__ void __launch_bounds__(kThreads)
combine_send_kernel(CommView v, const uint4* y, const int32_t* slot_rows,
                    const float* row_weights, int32_t* done, int parts) {
  const MoeDims& d = v.dims;
  const BufferLayout lay = buffer_layout(d);
  const int R = d.world, T = d.max_tokens, K = d.topk, C = d.capacity, me = d.rank;
  const int chunks = d.hidden / 8;  // 16-byte vectors of bf16 per row
  const uint64_t seq = v.counters->combine_seq + 1;
  // Never overwrite a combine region its source has not consumed yet.
  block_wait_all(v, v.local, lay.combine_ack, seq - 1, kStageCombineSend);
  const int lane = lane_id();

  if (!d.reduce_expert) {
    for (int task = global_warp(); task < R * T * K; task += global_warps()) {
      const int row = slot_rows[task];
      if (row == -1) continue;
      const int s = task / (T * K), slot = task % (T * K);
      uint4* dst = reinterpret_cast<uint4*>(v.peers[s] + lay.combine) + size_t(slot) * chunks;
      if (row >= 0 && row < C) {
        const uint4* src = y + size_t(row) * chunks;
        warp_copy(0, chunks, [&](int c) { return src[c]; },
                  [&](int c, uint4 value) { dst[c] = value; });
      } else {
        for (int c = lane; c < chunks; c += 32) dst[c] = make_uint4(0, 0, 0, 0);
      }
    }
  } else {
    // Rows of the slots of (s, t) that have one here, compacted in k order, and their weights.
    __shared__ int32_t warp_rows[kWarps][32];
    __shared__ float warp_weights[kWarps][32];
    const int warp = threadIdx.x / 32;
    const size_t pbytes = partial_bytes(d);
    for (int task = global_warp(); task < R * T * parts; task += global_warps()) {
      const int item = task / parts, part = task % parts;  // item = s * T + t
      int row = lane < K ? slot_rows[size_t(item) * K + lane] : -1;
      if (row >= C || row < -1) row = -2;  // held here but no row: contributes nothing
      if (!__ballot_sync(kFullMask, row != -1)) continue;
      const unsigned with_row = __ballot_sync(kFullMask, row >= 0);
      const int rows_here = __popc(with_row);
      if (row >= 0) {
        const int i = __popc(with_row & ((1u << lane) - 1));  // k order kept
        warp_rows[warp][i] = row;
        warp_weights[warp][i] = row_weights[row];
      }
      __syncwarp();
      const int s = item / T, t = item % T;
      char* dst = v.peers[s] + lay.combine + (size_t(me) * T + t) * d.hidden * pbytes;
      const int begin = part_begin(chunks, part, parts), end = part_begin(chunks, part + 1, parts);
      // Each lane sums kChunksPerLane vectors at once: up to kBatch * kChunksPerLane loads in
      // flight before the sums, which run in k order for every element.
      for (int c0 = begin + lane; c0 < end; c0 += 32 * kChunksPerLane) {
        float acc[kChunksPerLane][8];
#pragma unroll
        for (int j = 0; j < kChunksPerLane; ++j)
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[j][i] = 0.f;
        for (int i0 = 0; i0 < rows_here; i0 += kBatch) {
          uint4 rows[kBatch][kChunksPerLane];
#pragma unroll
          for (int u = 0; u < kBatch; ++u) {
            if (i0 + u >= rows_here) continue;
            const uint4* src = y + size_t(warp_rows[warp][i0 + u]) * chunks;
#pragma unroll
            for (int j = 0; j < kChunksPerLane; ++j)
              if (c0 + 32 * j < end) rows[u][j] = src[c0 + 32 * j];
          }
#pragma unroll
          for (int u = 0; u < kBatch; ++u) {
            if (i0 + u >= rows_here) continue;
            const float w = warp_weights[warp][i0 + u];
#pragma unroll
            for (int j = 0; j < kChunksPerLane; ++j) {
              if (c0 + 32 * j >= end) continue;
              float f[8];
              bf16x8_to_f32(rows[u][j], f);
              accumulate_scaled(acc[j], w, f);
            }
          }
        }
#pragma unroll
        for (int j = 0; j < kChunksPerLane; ++j) {
          const int c = c0 + 32 * j;
          if (c >= end) continue;
          if (d.partial_bf16) {
            reinterpret_cast<uint4*>(dst)[c] = f32_to_bf16x8(acc[j]);
          } else {
            float4* out = reinterpret_cast<float4*>(dst) + 2 * c;
            out[0] = make_float4(acc[j][0], acc[j][1], acc[j][2], acc[j][3]);
            out[1] = make_float4(acc[j][4], acc[j][5], acc[j][6], acc[j][7]);
          }
        }
      }
      __syncwarp();
    }
  }

  if (blockIdx.x == 0 && threadIdx.x == 0) *done = 0;
  if (last_block_done(v, kDoneCombineSend) && threadIdx.x == 0) {
    for (int p = 0; p < R; ++p) store_release_sys(flag_at(v.peers[p], lay.combine_flag, me), seq);
    v.counters->combine_seq = seq;
  }
}

// One warp per (token t, part of hidden): waits for every rank, then out[t] = bf16(sum in
// f32) over its valid slots in k order (source mode) or over the ranks holding one of its
// slots in rank order (expert mode). Tokens with no valid slot (and t >= num_tokens) come out
// zero. The last block acknowledges every rank: this rank's combine region may be overwritten.
__global__ void __launch_bounds__(kThreads)
combine_recv_kernel(CommView v, const int32_t* send_dest, const float* topk_weights,
                    uint4* out, int parts) {
  const MoeDims& d = v.dims;
  const BufferLayout lay = buffer_layout(d);
  const int R = d.world, T = d.max_tokens, K = d.topk, me = d.rank;
  const int chunks = d.hidden / 8;
  const uint64_t seq = v.counters->combine_seq;
  block_wait_all(v, v.local, lay.combine_flag, seq, kStageCombineRecv);

  __shared__ int32_t warp_dest[kWarps][32];
  __shared__ float warp_weights[kWarps][32];
  const int lane = lane_id();
  const int warp = threadIdx.x / 32;
  const uint4* comb = reinterpret_cast<const uint4*>(v.local + lay.combine);
  for (int task = global_warp(); task < T * parts; task += global_warps()) {
    const int t = task / parts, part = task % parts;
    int dest = lane < K ? send_dest[t * K + lane] : -1;
    if (dest < 0 || dest >= R) dest = -1;
    warp_dest[warp][lane] = dest;
    warp_weights[warp][lane] = lane < K ? topk_weights[t * K + lane] : 0.f;
    __syncwarp();
    uint64_t ranks = 0;
    for (int k = 0; k < K; ++k)
      if (warp_dest[warp][k] >= 0) ranks |= 1ull << warp_dest[warp][k];
    const int begin = part_begin(chunks, part, parts), end = part_begin(chunks, part + 1, parts);
    // Each lane sums kChunksPerLane vectors at once (twice the loads in flight); every element
    // is still summed in k order (source mode) or rank order (expert mode) from 0.
    for (int c0 = begin + lane; c0 < end; c0 += 32 * kChunksPerLane) {
      float acc[kChunksPerLane][8];
#pragma unroll
      for (int j = 0; j < kChunksPerLane; ++j)
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[j][i] = 0.f;
      if (!d.reduce_expert) {
        for (int k0 = 0; k0 < K; k0 += kBatch) {
          uint4 rows[kBatch][kChunksPerLane];
#pragma unroll
          for (int u = 0; u < kBatch; ++u) {
            if (k0 + u >= K || warp_dest[warp][k0 + u] < 0) continue;
            const uint4* src = comb + (size_t(t) * K + k0 + u) * chunks;
#pragma unroll
            for (int j = 0; j < kChunksPerLane; ++j)
              if (c0 + 32 * j < end) rows[u][j] = __ldcg(src + c0 + 32 * j);
          }
#pragma unroll
          for (int u = 0; u < kBatch; ++u) {
            if (k0 + u >= K || warp_dest[warp][k0 + u] < 0) continue;
            const float w = warp_weights[warp][k0 + u];
#pragma unroll
            for (int j = 0; j < kChunksPerLane; ++j) {
              if (c0 + 32 * j >= end) continue;
              float f[8];
              bf16x8_to_f32(rows[u][j], f);
              accumulate_scaled(acc[j], w, f);
            }
          }
        }
      } else {
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
              const float4* src =
                  reinterpret_cast<const float4*>(comb) + (part_row * chunks + c) * 2;
              const float4 a = __ldcg(src), b = __ldcg(src + 1);
              f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w;
              f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
            }
#pragma unroll
            for (int i = 0; i < 8; ++i) acc[j][i] = __fadd_rn(acc[j][i], f[i]);
          }
        }
      }
#pragma unroll
      for (int j = 0; j < kChunksPerLane; ++j)
        if (c0 + 32 * j < end) out[size_t(t) * chunks + c0 + 32 * j] = f32_to_bf16x8(acc[j]);
    }
    __syncwarp();
  }

  if (last_block_done(v, kDoneCombineRecv) && threadIdx.x == 0) {
    for (int p = 0; p < R; ++p) store_release_sys(flag_at(v.peers[p], lay.combine_ack, me), seq);
  }
}

}  // namespace

cudaError_t launch_combine_send(const CommView& view, const void* y, const int32_t* slot_rows,
                                const float* row_weights, int32_t* done, cudaStream_t stream) {
  const MoeDims& d = view.dims;
  // Expert mode splits each (source, token) along hidden, at most 8 parts of >= 32 vectors.
  const int parts = d.reduce_expert ? parts_per_item(d.world * d.max_tokens,
                                                     std::max(1, std::min(8, d.hidden / 8 / 32)),
                                                     view.max_blocks)
                                    : 1;
  const int tasks = d.reduce_expert ? d.world * d.max_tokens * parts
                                    : d.world * d.max_tokens * d.topk;
  combine_send_kernel<<<grid_for(tasks, view.max_blocks), kThreads, 0, stream>>>(
      view, static_cast<const uint4*>(y), slot_rows, row_weights, done, parts);
  return cudaGetLastError();
}

cudaError_t launch_combine_recv(const CommView& view, const int32_t* send_dest,
                                const float* topk_weights, void* out, cudaStream_t stream) {
  const MoeDims& d = view.dims;
  const int parts = parts_per_item(d.max_tokens, std::max(1, std::min(8, d.hidden / 8 / 32)),
                                   view.max_blocks);
  combine_recv_kernel<<<grid_for(d.max_tokens * parts, view.max_blocks), kThreads, 0, stream>>>(
      view, send_dest, topk_weights, static_cast<uint4*>(out), parts);
  return cudaGetLastError();
}

}  // namespace jax_moe
