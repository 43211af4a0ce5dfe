// The kernels of the cuda host proxies' halves (cuda/proxy_rows.cuh). One block per item
// (token, slot, or (source, token)); its threads cut the row into 16-byte vectors. Rows in
// host memory are reached over PCIe, so every loop keeps several loads in flight per thread.
#include "cuda/proxy_rows.cuh"
#include "cuda/rows.cuh"
#include "cuda/sync.cuh"

namespace jax_moe {
namespace {

constexpr int kMaxBlocks = 528;  // 4 per SM of an H100/H200: enough to cover PCIe latency
constexpr int kInFlight = 4;     // loads a thread issues before their stores or sums

int grid_for(long long items) {
  return static_cast<int>(items < 1 ? 1 : (items < kMaxBlocks ? items : kMaxBlocks));
}

__device__ inline int read_volatile(const int32_t* p) {
  return *reinterpret_cast<const volatile int32_t*>(p);
}

// store(c, load(c)) for vectors c in [0, n), kInFlight loads per thread ahead of its stores.
template <typename Load, typename Store>
__device__ void block_copy(int n, Load load, Store store) {
  for (int c0 = threadIdx.x; c0 < n; c0 += blockDim.x * kInFlight) {
    uint4 v[kInFlight];
#pragma unroll
    for (int u = 0; u < kInFlight; ++u)
      if (c0 + u * int(blockDim.x) < n) v[u] = load(c0 + u * blockDim.x);
#pragma unroll
    for (int u = 0; u < kInFlight; ++u)
      if (c0 + u * int(blockDim.x) < n) store(c0 + u * blockDim.x, v[u]);
  }
}

// This rank's own token t's row slot, in device memory (SelfLayout).
__device__ inline char* self_token(const ProxyRowsView& v, int t) {
  return v.self + self_layout(v.dims).tokens + size_t(t) * token_bytes(v.dims);
}

// Where this rank writes its rows and its combine terms for rank p (ProxyRowsView).
__device__ inline char* rows_of(const ProxyRowsView& v, int p) { return v.rows_to[p]; }
__device__ inline char* terms_of(const ProxyRowsView& v, int p) { return v.terms_to[p]; }

// This rank's buffer where the rows and combine terms of rank p land (ProxyRowsView).
__device__ inline char* rows_from(const ProxyRowsView& v, int p) { return v.rows_from[p]; }

// Token t's row slot of source `src` as this rank's receive side reads it: device memory for
// its own tokens, recv_tokens[src][t] of rows_from(src) for the others'.
__device__ inline const char* received_token(const ProxyRowsView& v, const BufferLayout& lay,
                                             int src, int t) {
  if (src == v.dims.rank) return self_token(v, t);
  return token_slot(rows_from(v, src), lay, v.dims, src, t);
}

// Where the combine term of this rank for source `src` lands: part[me][t] (expert mode,
// `index` = t) or comb[t][k] (source mode, `index` = t * K + k) of terms_of(src), or of
// `self` when src is this rank.
__device__ inline char* combine_term(const ProxyRowsView& v, const BufferLayout& lay, int src,
                                     size_t index) {
  const MoeDims& d = v.dims;
  const size_t row_bytes = d.reduce_expert ? size_t(d.hidden) * partial_bytes(d)
                                           : size_t(d.hidden) * 2;
  if (src == d.rank) return v.self + self_layout(d).combine + index * row_bytes;
  const size_t region = d.reduce_expert ? partial_block(lay, d, d.rank) : lay.combine;
  return terms_of(v, src) + region + index * row_bytes;
}

template <typename F>
__device__ inline void for_each_rank(uint64_t mask, F f) {
  for (; mask; mask &= mask - 1) f(__ffsll(static_cast<long long>(mask)) - 1);
}

// Token t's row into token_slot(rows_of(p), me, t) of every rank p of `mask` (its layout:
// fp8 codes [H] then f32 scales [H/bs] at byte H, or bf16 [H]).
template <TokenInput kInput>
__device__ void send_row(const ProxyRowsView& v, const BufferLayout& lay, const void* x,
                         const float* x_scales, int t, uint64_t mask) {
  const MoeDims& d = v.dims;
  const int H = d.hidden, me = d.rank;
  auto slot = [&](int p) {
    return p == me ? self_token(v, t) : token_slot(rows_of(v, p), lay, d, me, t);
  };
  if constexpr (kInput == kInputBf16) {
    const uint4* row = static_cast<const uint4*>(x) + size_t(t) * H / 8;
    block_copy(H / 8, [&](int c) { return row[c]; }, [&](int c, uint4 value) {
      for_each_rank(mask, [&](int p) { reinterpret_cast<uint4*>(slot(p))[c] = value; });
    });
  } else if constexpr (kInput == kInputFp8) {
    const uint4* row = reinterpret_cast<const uint4*>(static_cast<const char*>(x) + size_t(t) * H);
    block_copy(H / 16, [&](int c) { return row[c]; }, [&](int c, uint4 value) {
      for_each_rank(mask, [&](int p) { reinterpret_cast<uint4*>(slot(p))[c] = value; });
    });
    const int nb = scale_blocks(d);
    for (int b = threadIdx.x; b < nb; b += blockDim.x) {
      const float s = x_scales[size_t(t) * nb + b];
      for_each_rank(mask, [&](int p) { reinterpret_cast<float*>(slot(p) + H)[b] = s; });
    }
  } else {
    // docs/semantics.md "fp8", as send_quantized of cuda/dispatch.cu computes it: `group`
    // lanes per scale block, each over `per_lane` vectors; the amax is an integer max over
    // bf16 bits (abs_max_bits). Two passes over the row (the second hits the cache).
    const uint4* row = static_cast<const uint4*>(x) + size_t(t) * H / 8;
    const int vectors = d.block_size / 8, nb = scale_blocks(d);
    const int group = vectors < 32 ? vectors : 32, per_warp = 32 / group;
    const int lane = lane_id(), sub = lane % group, warps = blockDim.x / 32;
    // The loop is warp-uniform: every lane reaches the shuffles.
    for (int b0 = (threadIdx.x / 32) * per_warp; b0 < nb; b0 += warps * per_warp) {
      const int b = b0 + lane / group;
      const bool active = b < nb;
      uint32_t pair = 0;
      if (active)
        for (int c = sub; c < vectors; c += group) pair = abs_max_bits(row[b * vectors + c], pair);
      const BlockQuant q = block_quant(pair, group);
      if (!active) continue;
      for (int c = sub; c < vectors; c += group) {
        const uint2 codes = quantize8_e4m3(row[b * vectors + c], q);
        for_each_rank(mask,
                      [&](int p) { reinterpret_cast<uint2*>(slot(p))[b * vectors + c] = codes; });
      }
      if (sub == 0)
        for_each_rank(mask, [&](int p) { reinterpret_cast<float*>(slot(p) + H)[b] = q.scale; });
    }
  }
}

template <TokenInput kInput>
__global__ void __launch_bounds__(kThreads)
    proxy_dispatch_send_kernel(ProxyRowsView v, const void* x, const float* x_scales,
                               const int32_t* topk_ids, const float* topk_weights,
                               const int32_t* num_tokens, int32_t* send_dest) {
  const MoeDims& d = v.dims;
  const int R = d.world, T = d.max_tokens, K = d.topk, me = d.rank;
  const BufferLayout lay = buffer_layout(d);
  const bool go = !read_volatile(v.aborted) && v.control_copy->go;
  const int given = *num_tokens;
  const int ntok = go ? min(max(given, 0), T) : 0;
  if (go && blockIdx.x == 0 && threadIdx.x < R) {
    *route_tokens(v.peers[threadIdx.x], lay, d, me) = ntok;
    if (threadIdx.x == 0) v.control->given_tokens = given;
  }
  __shared__ uint64_t dest_mask;  // bit p: the token has a slot on rank p
  for (int t = blockIdx.x; t < T; t += gridDim.x) {
    if (threadIdx.x < 32) {
      // Lane k: slot (t, k), its entry in this rank's route block of every rank's view.
      const int k = threadIdx.x;
      int dest = -1;
      if (t < ntok && k < K) {
        int id = topk_ids[t * K + k];
        if (id < -1 || id >= d.num_experts) {
          atomicMin(&v.scratch->first_bad, (uint64_t(t * K + k) << 32) | uint32_t(id));
          id = -1;
        }
        dest = id >= 0 ? id / d.local_experts : -1;
        const RouteEntry entry{id, topk_weights[t * K + k]};
        for (int p = 0; p < R; ++p) route_entries(v.peers[p], lay, d, me)[t * K + k] = entry;
      }
      if (k < K) send_dest[t * K + k] = dest;
      const uint64_t bit = dest >= 0 ? 1ull << dest : 0;
      const uint32_t lo = __reduce_or_sync(kFullMask, uint32_t(bit));
      const uint32_t hi = __reduce_or_sync(kFullMask, uint32_t(bit >> 32));
      if (k == 0) dest_mask = lo | uint64_t(hi) << 32;
    }
    __syncthreads();
    const uint64_t mask = dest_mask;
    if (mask) send_row<kInput>(v, lay, x, x_scales, t, mask);
    __syncthreads();  // dest_mask is rewritten for the next token
  }
  // The writes above reach host memory before the proxy's next phase reads or posts them;
  // the last block hands the first invalid slot to the proxy and resets the scratch.
  __threadfence_system();
  __syncthreads();
  __shared__ bool last;
  if (threadIdx.x == 0) last = atomicAdd(&v.scratch->blocks_done, 1u) == gridDim.x - 1;
  __syncthreads();
  if (last && threadIdx.x == 0) {
    __threadfence();
    v.control->first_bad = atomicExch(&v.scratch->first_bad, ~0ull);
    v.scratch->blocks_done = 0;
    __threadfence_system();
  }
}

__global__ void __launch_bounds__(kThreads)
    proxy_dispatch_recv_kernel(ProxyRowsView v, void* x, float* scales, float* weights,
                               int32_t* group_sizes, int32_t* tokens_per_expert,
                               int32_t* slot_rows) {
  const MoeDims& d = v.dims;
  const int T = d.max_tokens, K = d.topk, C = d.capacity, L = d.local_experts;
  const int nb = scale_blocks(d);
  const BufferLayout lay = buffer_layout(d);
  const int stride = gridDim.x * blockDim.x;
  const int first = blockIdx.x * blockDim.x + threadIdx.x;
  for (int i = first; i < d.world * T * K; i += stride) slot_rows[i] = v.slot_rows[i];
  for (int i = first; i < C; i += stride) weights[i] = v.weights[i];
  for (int i = first; i < L; i += stride) {
    group_sizes[i] = v.group_sizes[i];
    tokens_per_expert[i] = v.tokens_per_expert[i];
  }
  if (read_volatile(v.aborted)) return;  // the plan was not made for this call
  // x rows: fp8 codes [H] or bf16 [H]; scales [C][H/bs].
  const int vectors = d.fp8 ? d.hidden / 16 : d.hidden / 8;
  uint4* x_rows = static_cast<uint4*>(x);
  __shared__ int32_t rows[32];
  const int tokens = v.control_copy->token_count;
  for (int i = blockIdx.x; i < tokens; i += gridDim.x) {
    const int token = v.tokens[i];  // source * T + t
    if (threadIdx.x < K) rows[threadIdx.x] = v.slot_rows[size_t(token) * K + threadIdx.x];
    __syncthreads();
    const char* slot = received_token(v, lay, token / T, token % T);
    const uint4* in = reinterpret_cast<const uint4*>(slot);
    block_copy(vectors, [&](int c) { return in[c]; }, [&](int c, uint4 value) {
      for (int k = 0; k < K; ++k)
        if (rows[k] >= 0) x_rows[size_t(rows[k]) * vectors + c] = value;
    });
    for (int b = threadIdx.x; b < nb; b += blockDim.x) {
      const float s = reinterpret_cast<const float*>(slot + d.hidden)[b];
      for (int k = 0; k < K; ++k)
        if (rows[k] >= 0) scales[size_t(rows[k]) * nb + b] = s;
    }
    __syncthreads();  // rows is rewritten for the next token
  }
  // Padding rows inside the segments are zero (x and scales; their weights already are).
  const int zeros = v.control_copy->zero_count;
  for (int i = blockIdx.x; i < zeros; i += gridDim.x) {
    const size_t row = v.zero_rows[i];
    for (int c = threadIdx.x; c < vectors; c += blockDim.x)
      x_rows[row * vectors + c] = make_uint4(0, 0, 0, 0);
    for (int b = threadIdx.x; b < nb; b += blockDim.x) scales[row * nb + b] = 0.f;
  }
}

// Eight f32 of vector c of a partial row (bf16 [H] or f32 [H]).
__device__ inline void load_partial_vector(const MoeDims& d, const char* src, int c,
                                           float f[8]) {
  if (d.partial_bf16) {
    bf16x8_to_f32(reinterpret_cast<const uint4*>(src)[c], f);
  } else {
    const float4* in = reinterpret_cast<const float4*>(src) + 2 * c;
    const float4 a = in[0], b = in[1];
    f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w, f[4] = b.x, f[5] = b.y, f[6] = b.z,
    f[7] = b.w;
  }
}

// For each vector c of a row owned by this thread: acc = sum over terms i < count in i order
// of weight[i] * row_i[c] (both roundings explicit, from +0), then store(c, acc). Loads of
// kInFlight terms are issued before their sums. weight null: plain sums.
template <typename Load, typename Store>
__device__ void sum_terms(int vectors, int count, const float* weight, Load load, Store store) {
  for (int c = threadIdx.x; c < vectors; c += blockDim.x) {
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int i0 = 0; i0 < count; i0 += kInFlight) {
      // Terms past `count` are zero rather than undefined (an undefined one keeps the last
      // iteration's value, which ptxas spilled around the loads).
      float f[kInFlight][8] = {};
#pragma unroll
      for (int u = 0; u < kInFlight; ++u)
        if (i0 + u < count) load(i0 + u, c, f[u]);
#pragma unroll
      for (int u = 0; u < kInFlight; ++u) {
        if (i0 + u >= count) continue;
        if (weight != nullptr) {
          accumulate_scaled(acc, weight[i0 + u], f[u]);
        } else {
#pragma unroll
          for (int j = 0; j < 8; ++j) acc[j] = __fadd_rn(acc[j], f[u][j]);
        }
      }
    }
    store(c, acc);
  }
}

__global__ void __launch_bounds__(kThreads)
    proxy_combine_send_kernel(ProxyRowsView v, const uint4* y, const int32_t* slot_rows,
                              const float* row_weights, int32_t* done) {
  const MoeDims& d = v.dims;
  const int R = d.world, T = d.max_tokens, K = d.topk, C = d.capacity, H = d.hidden;
  const BufferLayout lay = buffer_layout(d);
  const int first = blockIdx.x * blockDim.x + threadIdx.x;
  if (first == 0) *done = 0;
  // Writes into host memory are fenced before the kernel ends: the proxy's next phase reads
  // the slot rows and posts the rows from there.
  for (int i = first; i < R * T * K; i += gridDim.x * blockDim.x) v.slot_rows[i] = slot_rows[i];
  __threadfence_system();
  if (read_volatile(v.aborted) || !v.control_copy->go) return;
  if (!d.reduce_expert) {
    // Slot (src, t, k) held here: y[row] to comb[t][k] of src (bf16 [T][K][H]); zeros for a
    // slot dropped by capacity overflow.
    for (int j = blockIdx.x; j < R * T * K; j += gridDim.x) {
      const int row = slot_rows[j];
      if (row == -1) continue;
      uint4* dst = reinterpret_cast<uint4*>(combine_term(v, lay, j / (T * K), j % (T * K)));
      const bool kept = row >= 0 && row < C;
      block_copy(H / 8, [&](int c) { return kept ? y[size_t(row) * H / 8 + c] : uint4{}; },
                 [&](int c, uint4 value) { dst[c] = value; });
    }
    __threadfence_system();
    return;
  }
  // (src, t) with a slot here: the sum in k order of w * y[row] over its kept rows, in the
  // partial dtype at part[this rank][t] of src ([R][T][H]).
  __shared__ int32_t rows[32];
  __shared__ float w[32];
  __shared__ int count;
  for (int task = blockIdx.x; task < R * T; task += gridDim.x) {
    if (threadIdx.x < 32) {
      const int k = threadIdx.x;
      const int row = k < K ? slot_rows[size_t(task) * K + k] : -1;
      const bool kept = row >= 0 && row < C;
      const unsigned any = __ballot_sync(kFullMask, row != -1);
      const unsigned keep = __ballot_sync(kFullMask, kept);
      if (kept) {
        const int at = __popc(keep & ((1u << k) - 1));
        rows[at] = row;
        w[at] = row_weights[row];
      }
      if (k == 0) count = any ? __popc(keep) : -1;
    }
    __syncthreads();
    if (count >= 0) {
      const int src = task / T, t = task % T;
      char* dst = combine_term(v, lay, src, t);
      sum_terms(H / 8, count, w,
                [&](int i, int c, float f[8]) { bf16x8_to_f32(y[size_t(rows[i]) * H / 8 + c], f); },
                [&](int c, const float acc[8]) { store_partial(d, dst, c, acc); });
    }
    __syncthreads();  // rows, w and count are rewritten for the next task
  }
  __threadfence_system();
}

__global__ void __launch_bounds__(kThreads)
    proxy_combine_recv_kernel(ProxyRowsView v, const int32_t* send_dest,
                              const float* topk_weights, uint4* out) {
  const MoeDims& d = v.dims;
  const int R = d.world, T = d.max_tokens, K = d.topk, H = d.hidden;
  const BufferLayout lay = buffer_layout(d);
  const bool go = !read_volatile(v.aborted) && v.control_copy->go;
  const char* own = v.self + self_layout(d).combine;
  // Terms of token t: source mode, comb[t][k] (bf16 [T][K][H]) of each valid slot with its
  // weight, in k order; expert mode, part[p][t] ([R][T][H]) of each rank p holding one of
  // its slots, in rank order. This rank's own terms are in `self` (device memory).
  __shared__ const char* term[64];
  __shared__ float w[32];
  __shared__ int count;
  for (int t = blockIdx.x; t < T; t += gridDim.x) {
    if (threadIdx.x < 32) {
      const int k = threadIdx.x;
      const int dest = go && k < K ? send_dest[t * K + k] : -1;
      const bool valid = dest >= 0 && dest < R;
      if (!d.reduce_expert) {
        const unsigned mask = __ballot_sync(kFullMask, valid);
        if (valid) {
          const int at = __popc(mask & ((1u << k) - 1));
          term[at] = (dest == d.rank ? own : rows_from(v, dest) + lay.combine) +
                     (size_t(t) * K + k) * H * 2;
          w[at] = topk_weights[t * K + k];
        }
        if (k == 0) count = __popc(mask);
      } else {
        const uint64_t bit = valid ? 1ull << dest : 0;
        const uint64_t ranks = __reduce_or_sync(kFullMask, uint32_t(bit)) |
                               uint64_t(__reduce_or_sync(kFullMask, uint32_t(bit >> 32))) << 32;
        if (k == 0) {
          int n = 0;
          for_each_rank(ranks, [&](int p) {
            term[n++] = (p == d.rank ? own : rows_from(v, p) + partial_block(lay, d, p)) +
                        size_t(t) * H * partial_bytes(d);
          });
          count = n;
        }
      }
    }
    __syncthreads();
    uint4* row = out + size_t(t) * H / 8;
    auto store = [&](int c, const float acc[8]) { row[c] = f32_to_bf16x8(acc); };
    if (!d.reduce_expert) {
      sum_terms(H / 8, count, w, [&](int i, int c, float f[8]) {
        bf16x8_to_f32(reinterpret_cast<const uint4*>(term[i])[c], f);
      }, store);
    } else {
      sum_terms(H / 8, count, nullptr,
                [&](int i, int c, float f[8]) { load_partial_vector(d, term[i], c, f); }, store);
    }
    __syncthreads();  // term, w and count are rewritten for the next token
  }
}

}  // namespace

cudaError_t launch_proxy_dispatch_send(const ProxyRowsView& v, TokenInput input, const void* x,
                                       const float* x_scales, const int32_t* topk_ids,
                                       const float* topk_weights, const int32_t* num_tokens,
                                       int32_t* send_dest, cudaStream_t stream) {
  const int grid = grid_for(v.dims.max_tokens);
  switch (input) {
    case kInputBf16:
      proxy_dispatch_send_kernel<kInputBf16><<<grid, kThreads, 0, stream>>>(
          v, x, x_scales, topk_ids, topk_weights, num_tokens, send_dest);
      break;
    case kInputBf16Quantize:
      proxy_dispatch_send_kernel<kInputBf16Quantize><<<grid, kThreads, 0, stream>>>(
          v, x, x_scales, topk_ids, topk_weights, num_tokens, send_dest);
      break;
    case kInputFp8:
      proxy_dispatch_send_kernel<kInputFp8><<<grid, kThreads, 0, stream>>>(
          v, x, x_scales, topk_ids, topk_weights, num_tokens, send_dest);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

cudaError_t launch_proxy_dispatch_recv(const ProxyRowsView& v, void* x, float* scales,
                                       float* weights, int32_t* group_sizes,
                                       int32_t* tokens_per_expert, int32_t* slot_rows,
                                       cudaStream_t stream) {
  const MoeDims& d = v.dims;
  proxy_dispatch_recv_kernel<<<grid_for(1ll * d.world * d.max_tokens), kThreads, 0, stream>>>(
      v, x, scales, weights, group_sizes, tokens_per_expert, slot_rows);
  return cudaGetLastError();
}

cudaError_t launch_proxy_combine_send(const ProxyRowsView& v, const void* y,
                                      const int32_t* slot_rows, const float* row_weights,
                                      int32_t* done, cudaStream_t stream) {
  const MoeDims& d = v.dims;
  const long long items = 1ll * d.world * d.max_tokens * (d.reduce_expert ? 1 : d.topk);
  proxy_combine_send_kernel<<<grid_for(items), kThreads, 0, stream>>>(
      v, static_cast<const uint4*>(y), slot_rows, row_weights, done);
  return cudaGetLastError();
}

cudaError_t launch_proxy_combine_recv(const ProxyRowsView& v, const int32_t* send_dest,
                                      const float* topk_weights, void* out,
                                      cudaStream_t stream) {
  proxy_combine_recv_kernel<<<grid_for(v.dims.max_tokens), kThreads, 0, stream>>>(
      v, send_dest, topk_weights, static_cast<uint4*>(out));
  return cudaGetLastError();
}

}  // namespace jax_moe
