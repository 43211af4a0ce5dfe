// Dispatch over NVLink: dispatch_send (source rank) pushes routes and token rows into every
// destination's buffer; dispatch_recv (destination rank) waits for all sources and writes the
// deterministic layout of docs/semantics.md. Buffer layout: cuda/layout.cuh.
#include "cuda/api.cuh"
#include "cuda/rows.cuh"
#include "cuda/sync.cuh"

namespace jax_moe {
namespace {

// Calls store(rank) for every rank set in mask, lowest first.
template <typename Store>
__device__ inline void for_each_rank(uint64_t mask, Store store) {
  for (; mask; mask &= mask - 1) store(__ffsll(static_cast<long long>(mask)) - 1);
}

// Quantizes scale blocks [block_begin, block_end) of bf16 token row `row` [H]
// (docs/semantics.md: per block amax = max(max|x|, 1e-4), scale = amax * f32(1/448),
// q = e4m3fn(clip(x * (448 / amax)))) and stores codes and scales into slot t of this
// source's region on every rank of dest_mask. One warp; each scale block is covered by
// `lanes_per_block` lanes that reduce its amax with shuffles.
__device__ void send_quantized(const CommView& v, const BufferLayout& lay, const uint4* row,
                               int t, uint64_t dest_mask, int block_begin, int block_end) {
  const MoeDims& d = v.dims;
  const int lane = lane_id();
  const int chunks_per_block = d.block_size / 8;  // 8 bf16 per 16-byte chunk
  const int lanes_per_block = chunks_per_block < 32 ? chunks_per_block : 32;
  const int chunks_per_lane = chunks_per_block / lanes_per_block;
  const int blocks_per_step = 32 / lanes_per_block;
  const int sub = lane % lanes_per_block;
  for (int b0 = block_begin; b0 < block_end; b0 += blocks_per_step) {
    const int b = b0 + lane / lanes_per_block;
    const bool active = b < block_end;
    float amax = 0.f;
    if (active) {
      for (int c = 0; c < chunks_per_lane; ++c) {
        float f[8];
        bf16x8_to_f32(row[b * chunks_per_block + sub + c * lanes_per_block], f);
#pragma unroll
        for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(f[i]));
      }
    }
    for (int offset = lanes_per_block / 2; offset > 0; offset >>= 1)
      amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, offset));
    if (!active) continue;
    amax = fmaxf(amax, 1e-4f);
    const float scale = __fmul_rn(amax, kInv448);
    const float multiplier = __fdiv_rn(448.f, amax);
    for (int c = 0; c < chunks_per_lane; ++c) {
      const int chunk = b * chunks_per_block + sub + c * lanes_per_block;
      float f[8];
      bf16x8_to_f32(row[chunk], f);
      uint32_t lo = 0, hi = 0;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        lo |= quantize_e4m3(f[i], multiplier) << (8 * i);
        hi |= quantize_e4m3(f[4 + i], multiplier) << (8 * i);
      }
      for_each_rank(dest_mask, [&](int p) {
        char* slot = token_slot(v.peers[p], lay, d, d.rank, t);
        reinterpret_cast<uint2*>(slot)[chunk] = make_uint2(lo, hi);
      });
    }
    if (sub == 0) {
      for_each_rank(dest_mask, [&](int p) {
        char* slot = token_slot(v.peers[p], lay, d, d.rank, t);
        reinterpret_cast<float*>(slot + d.hidden)[b] = scale;
      });
    }
  }
}

// Copies 16-byte vectors [chunk_begin, chunk_end) of `row`, and floats [scale_begin,
// scale_end) of `scales` (stored from byte scales_at of the slot on), into slot t of this
// source's region on every rank of dest_mask. One warp.
__device__ void send_as_is(const CommView& v, const BufferLayout& lay, const uint4* row,
                           int chunk_begin, int chunk_end, const float* scales, int scale_begin,
                           int scale_end, size_t scales_at, int t, uint64_t dest_mask) {
  const MoeDims& d = v.dims;
  warp_copy(chunk_begin, chunk_end, [&](int c) { return row[c]; }, [&](int c, uint4 value) {
    for_each_rank(dest_mask, [&](int p) {
      reinterpret_cast<uint4*>(token_slot(v.peers[p], lay, d, d.rank, t))[c] = value;
    });
  });
  for (int b = scale_begin + lane_id(); b < scale_end; b += 32) {
    const float value = scales[b];
    for_each_rank(dest_mask, [&](int p) {
      char* slot = token_slot(v.peers[p], lay, d, d.rank, t);
      reinterpret_cast<float*>(slot + scales_at)[b] = value;
    });
  }
}

// One warp per (token t, part of its row): validate its slots, send its route to every rank
// (part 0) and its part of the row once to each rank that holds one of its slots. Parts cut
// the row at scale-block boundaries. The last block publishes the sequence to every rank.
__global__ void __launch_bounds__(kThreads)
dispatch_send_kernel(CommView v, TokenInput input, const void* x, const float* x_scales,
                     const int32_t* topk_ids, const float* topk_weights,
                     const int32_t* num_tokens, int32_t* send_dest, int parts) {
  const MoeDims& d = v.dims;
  const BufferLayout lay = buffer_layout(d);
  const int T = d.max_tokens, K = d.topk, H = d.hidden, me = d.rank;
  const uint64_t seq = v.counters->dispatch_seq + 1;
  // Never overwrite a region its receiver has not consumed yet.
  block_wait_all(v, v.local, lay.dispatch_ack, seq - 1, kStageDispatchSend);

  const int given = *num_tokens;
  const int ntok = min(max(given, 0), T);
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    if (given != ntok) record_error(v, kBadNumTokens, kStageDispatchSend, given);
    for (int p = 0; p < d.world; ++p)
      reinterpret_cast<int32_t*>(v.peers[p] + lay.recv_num_tokens)[me] = ntok;
  }

  const int lane = lane_id();
  const int nb = H / d.block_size;
  for (int task = global_warp(); task < T * parts; task += global_warps()) {
    const int t = task / parts, part = task % parts;
    int id = -1;
    float w = 0.f;
    if (lane < K && t < ntok) {
      id = topk_ids[t * K + lane];
      if (id < -1 || id >= d.num_experts) {
        if (part == 0) record_error(v, kInvalidExpertId, kStageDispatchSend, id);
        id = -1;
      }
      w = topk_weights[t * K + lane];
    }
    const int dest = id >= 0 ? id / d.local_experts : -1;
    if (part == 0 && lane < K) send_dest[t * K + lane] = dest;
    if (t >= ntok) continue;

    uint64_t dest_mask = 0;
    for (int k = 0; k < K; ++k) {
      const int dk = __shfl_sync(kFullMask, dest, k);
      if (dk >= 0) dest_mask |= 1ull << dk;
    }
    // Every rank gets the route: each counts the slots of its own experts.
    if (part == 0 && lane < K) {
      const size_t slot = (size_t(me) * T + t) * K + lane;
      for (int p = 0; p < d.world; ++p) {
        reinterpret_cast<int32_t*>(v.peers[p] + lay.recv_ids)[slot] = id;
        reinterpret_cast<float*>(v.peers[p] + lay.recv_weights)[slot] = w;
      }
    }
    if (input == kInputBf16Quantize) {
      send_quantized(v, lay, static_cast<const uint4*>(x) + size_t(t) * (H / 8), t, dest_mask,
                     part_begin(nb, part, parts), part_begin(nb, part + 1, parts));
    } else if (input == kInputFp8) {
      // A part covers whole scale blocks, codes and scales (parts > 1 only when a block is a
      // whole number of 16-byte vectors).
      const int b_begin = part_begin(nb, part, parts), b_end = part_begin(nb, part + 1, parts);
      const int per_block = d.block_size / 16;
      send_as_is(v, lay, static_cast<const uint4*>(x) + size_t(t) * (H / 16),
                 parts == 1 ? 0 : b_begin * per_block, parts == 1 ? H / 16 : b_end * per_block,
                 x_scales + size_t(t) * nb, b_begin, b_end, H, t, dest_mask);
    } else {
      send_as_is(v, lay, static_cast<const uint4*>(x) + size_t(t) * (H / 8),
                 part_begin(H / 8, part, parts), part_begin(H / 8, part + 1, parts), nullptr, 0,
                 0, 0, t, dest_mask);
    }
  }

  if (last_block_done(v, kDoneDispatchSend) && threadIdx.x == 0) {
    for (int p = 0; p < d.world; ++p)
      store_release_sys(flag_at(v.peers[p], lay.dispatch_flag, me), seq);
    v.counters->dispatch_seq = seq;
  }
}

__device__ inline int received_tokens(const CommView& v, const BufferLayout& lay, int source) {
  const int n = __ldcg(reinterpret_cast<const int32_t*>(v.local + lay.recv_num_tokens) + source);
  return min(max(n, 0), v.dims.max_tokens);
}

// dispatch_count: up to 32 warps per block, as many as leave a [warps][L] int32 table in 48 KiB.
constexpr int kCountMaxWarps = 32;
constexpr int kCountUnroll = 8;  // slot loads in flight per lane

inline int count_warps(int local_experts) {
  const int fit = 48 * 1024 / (4 * (local_experts > 0 ? local_experts : 1));
  return fit < 1 ? 1 : (fit > kCountMaxWarps ? kCountMaxWarps : fit);
}

// Waits for every source, then one block per source s: each warp takes a contiguous range of
// the slots of s ((t, k) order), (a) counts its hits per local expert into its row of
// `warp_counts` [warps][L], (b) one exclusive scan over the warps per expert turns the rows into
// each warp's first rank (the totals are expert_counts[s][e]), (c) each warp rescans its range
// in slot order: slot_rank[s][t][k] = the slot's position among the slots of s for its expert
// (stable, so rows keep (s, t, k) order inside each segment).
// One block per SM is enough (a grid of R blocks); without the 1 ptxas caps it at 32 registers.
__global__ void __launch_bounds__(kCountMaxWarps * 32, 1) dispatch_count_kernel(CommView v) {
  const MoeDims& d = v.dims;
  const BufferLayout lay = buffer_layout(d);
  const int T = d.max_tokens, K = d.topk, L = d.local_experts;
  const uint64_t seq = v.counters->dispatch_seq;
  block_wait_all(v, v.local, lay.dispatch_flag, seq, kStageDispatchRecv);

  extern __shared__ int32_t warp_counts[];  // [warps][L]
  const int lane = lane_id();
  const int warp = threadIdx.x / 32, warps = blockDim.x / 32;
  int32_t* mine = warp_counts + warp * L;
  const unsigned lanes_before = (1u << lane) - 1;
  const int32_t* ids = reinterpret_cast<const int32_t*>(v.local + lay.recv_ids);
  const int first_expert = d.rank * L;
  for (int s = blockIdx.x; s < d.world; s += gridDim.x) {
    for (int i = threadIdx.x; i < warps * L; i += blockDim.x) warp_counts[i] = 0;
    __syncthreads();
    const int n = received_tokens(v, lay, s) * K;
    const int begin = part_begin(n, warp, warps), end = part_begin(n, warp + 1, warps);
    const int32_t* slot_ids = ids + size_t(s) * T * K;
    int32_t* ranks = v.slot_rank + size_t(s) * T * K;
    // Local expert of slot j of this warp's range, or -1 (not routed here, or past the range).
    auto local_expert = [&](int j) {
      const int e = j < end ? __ldcg(slot_ids + j) - first_expert : -1;
      return e >= 0 && e < L ? e : -1;
    };

    for (int j0 = begin; j0 < end; j0 += 32 * kCountUnroll) {  // (a)
      int e[kCountUnroll];
#pragma unroll
      for (int u = 0; u < kCountUnroll; ++u) e[u] = local_expert(j0 + 32 * u + lane);
#pragma unroll
      for (int u = 0; u < kCountUnroll; ++u)
        if (e[u] >= 0) atomicAdd(&mine[e[u]], 1);
    }
    __syncthreads();
    for (int e = threadIdx.x; e < L; e += blockDim.x) {  // (b)
      int before = 0;
      for (int w = 0; w < warps; ++w) {
        const int count = warp_counts[w * L + e];
        warp_counts[w * L + e] = before;
        before += count;
      }
      v.expert_counts[s * L + e] = before;
    }
    __syncthreads();
    for (int j0 = begin; j0 < end; j0 += 32 * kCountUnroll) {  // (c)
      int e[kCountUnroll];
#pragma unroll
      for (int u = 0; u < kCountUnroll; ++u) e[u] = local_expert(j0 + 32 * u + lane);
#pragma unroll
      for (int u = 0; u < kCountUnroll; ++u) {
        if (!__ballot_sync(kFullMask, e[u] >= 0)) continue;
        // Lanes of one expert in this step: rank = the warp's running count + lanes before.
        const unsigned same = __match_any_sync(kFullMask, e[u]);
        const int before = __popc(same & lanes_before);
        const int running = e[u] >= 0 ? mine[e[u]] : 0;
        if (e[u] >= 0) ranks[j0 + 32 * u + lane] = running + before;
        __syncwarp();
        if (e[u] >= 0 && before == 0) mine[e[u]] = running + __popc(same);
        __syncwarp();
      }
    }
    __syncthreads();  // the table is reset for the next source
  }
}

// Every block derives the layout from expert_counts (tiny), then warps take tasks:
// [0, R*T*parts): token (s, t) and part of its row: the part copied to each of the token's
// rows here; part 0 also writes slot_rows for its K slots and the rows' weights;
// [R*T*parts, R*T*parts + C): output row r, zeroed when it is padding or past the total.
// The last block acknowledges every source: their regions here may be overwritten.
// The grid has at most SMs/2 blocks, one per SM is all it needs: the 1 lets ptxas keep the
// 8-deep copy in registers (it capped the kernel at 64 and spilled).
__global__ void __launch_bounds__(kThreads, 1)
dispatch_place_kernel(CommView v, void* x_out, float* scales_out, float* weights_out,
                      int32_t* group_sizes, int32_t* tokens_per_expert, int32_t* slot_rows,
                      int parts) {
  const MoeDims& d = v.dims;
  const BufferLayout lay = buffer_layout(d);
  const int R = d.world, T = d.max_tokens, K = d.topk, L = d.local_experts, C = d.capacity;
  const int H = d.hidden, me = d.rank;
  const int nb = scale_blocks(d);
  const int row_chunks = d.fp8 ? H / 16 : H / 8;  // 16-byte vectors per output row

  extern __shared__ int32_t smem[];
  int32_t* first_row = smem;           // [R][L] first row of (source s, expert e)
  int32_t* seg_start = first_row + R * L;  // [L]
  int32_t* seg_tokens = seg_start + L;     // [L] tokens_per_expert
  int32_t* seg_size = seg_tokens + L;      // [L] group_sizes
  int32_t* ntok = seg_size + L;            // [R]
  __shared__ int32_t total_rows;
  __shared__ int32_t warp_rows[kWarps][32];

  for (int i = threadIdx.x; i < R * L; i += blockDim.x) first_row[i] = v.expert_counts[i];
  for (int s = threadIdx.x; s < R; s += blockDim.x) ntok[s] = received_tokens(v, lay, s);
  __syncthreads();
  for (int e = threadIdx.x; e < L; e += blockDim.x) {
    int sum = 0;
    for (int s = 0; s < R; ++s) sum += first_row[s * L + e];
    seg_tokens[e] = sum;
    seg_size[e] = (sum + d.expert_padding - 1) / d.expert_padding * d.expert_padding;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int acc = 0;
    for (int e = 0; e < L; ++e) {
      seg_start[e] = acc;
      acc += seg_size[e];
    }
    total_rows = acc;
  }
  __syncthreads();
  for (int e = threadIdx.x; e < L; e += blockDim.x) {
    int row = seg_start[e];
    for (int s = 0; s < R; ++s) {
      const int count = first_row[s * L + e];
      first_row[s * L + e] = row;
      row += count;
    }
  }
  __syncthreads();
  const int total = total_rows;
  if (blockIdx.x == 0) {
    for (int e = threadIdx.x; e < L; e += blockDim.x) {
      group_sizes[e] = seg_size[e];
      tokens_per_expert[e] = seg_tokens[e];
    }
    if (threadIdx.x == 0 && total > C) record_error(v, kCapacityOverflow, kStageDispatchRecv, total);
  }

  const int lane = lane_id();
  const int warp = threadIdx.x / 32;
  const int32_t* ids = reinterpret_cast<const int32_t*>(v.local + lay.recv_ids);
  const float* route_w = reinterpret_cast<const float*>(v.local + lay.recv_weights);
  uint4* x_rows = static_cast<uint4*>(x_out);
  const int token_tasks = R * T * parts;
  for (int task = global_warp(); task < token_tasks + C; task += global_warps()) {
    if (task < token_tasks) {
      const int item = task / parts, part = task % parts;  // item = s * T + t
      const int s = item / T, t = item % T;
      int row = -1;
      if (lane < K) {
        const size_t slot = size_t(item) * K + lane;
        if (t < ntok[s]) {
          const int e = __ldcg(ids + slot) - me * L;
          if (e >= 0 && e < L) {
            row = first_row[s * L + e] + v.slot_rank[slot];
            if (row >= C) row = -2;  // dropped: capacity overflow
          }
        }
        if (part == 0) {
          slot_rows[slot] = row;
          if (row >= 0) weights_out[row] = __ldcg(route_w + slot);
        }
      }
      const unsigned placed = __ballot_sync(kFullMask, row >= 0);
      if (!placed) continue;
      warp_rows[warp][lane] = row;
      __syncwarp();
      const char* src = token_slot(v.local, lay, d, s, t);
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
    } else {
      const int r = task - token_tasks;
      bool zero = r >= total;
      if (!zero) {
        // The segment holding r: the last e with seg_start[e] <= r (empty ones end before r).
        int lo = 0, hi = L - 1;
        while (lo < hi) {
          const int mid = (lo + hi + 1) / 2;
          if (seg_start[mid] <= r) lo = mid; else hi = mid - 1;
        }
        zero = r >= seg_start[lo] + seg_tokens[lo];
      }
      if (!zero) continue;
      for (int c = lane; c < row_chunks; c += 32) x_rows[size_t(r) * row_chunks + c] = make_uint4(0, 0, 0, 0);
      for (int b = lane; b < nb; b += 32) scales_out[size_t(r) * nb + b] = 0.f;
      if (lane == 0) weights_out[r] = 0.f;
    }
  }

  if (last_block_done(v, kDoneDispatchPlace) && threadIdx.x == 0) {
    const uint64_t seq = v.counters->dispatch_seq;
    for (int s = 0; s < R; ++s) store_release_sys(flag_at(v.peers[s], lay.dispatch_ack, me), seq);
  }
}

}  // namespace

cudaError_t launch_dispatch_send(const CommView& view, TokenInput input, const void* x,
                                 const float* x_scales, const int32_t* topk_ids,
                                 const float* topk_weights, const int32_t* num_tokens,
                                 int32_t* send_dest, cudaStream_t stream) {
  const MoeDims& d = view.dims;
  // bf16 rows split anywhere; fp8 rows only between scale blocks.
  const int max_parts = input == kInputBf16 ? 8
                        : input == kInputFp8 && d.block_size % 16 ? 1
                        : min(8, d.hidden / d.block_size);
  const int parts = parts_per_item(d.max_tokens, max_parts, view.max_blocks);
  dispatch_send_kernel<<<grid_for(d.max_tokens * parts, view.max_blocks), kThreads, 0, stream>>>(
      view, input, x, x_scales, topk_ids, topk_weights, num_tokens, send_dest, parts);
  return cudaGetLastError();
}

cudaError_t launch_dispatch_recv(const CommView& view, void* x, float* scales, float* weights,
                                 int32_t* group_sizes, int32_t* tokens_per_expert,
                                 int32_t* slot_rows, cudaStream_t stream) {
  const MoeDims& d = view.dims;
  const int warps = count_warps(d.local_experts);
  dispatch_count_kernel<<<min(d.world, view.max_blocks), warps * 32,
                          size_t(warps) * d.local_experts * 4, stream>>>(view);
  cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess) return status;
  // Token rows split along hidden (at most 8 parts of >= 32 vectors) so that a decode-sized
  // call spreads its copies over every warp of the grid.
  const int row_chunks = d.fp8 ? d.hidden / 16 : d.hidden / 8;
  const int parts = parts_per_item(d.world * d.max_tokens, max(1, min(8, row_chunks / 32)),
                                   view.max_blocks);
  const int tasks = d.world * d.max_tokens * parts + d.capacity;
  dispatch_place_kernel<<<grid_for(tasks, view.max_blocks), kThreads,
                          place_smem_bytes(d), stream>>>(
      view, x, scales, weights, group_sizes, tokens_per_expert, slot_rows, parts);
  return cudaGetLastError();
}

}  // namespace jax_moe
