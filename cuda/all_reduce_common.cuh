// Pieces shared by the all-reduce kernels (cuda/all_reduce.cu, cuda/all_reduce_nvls.cu):
// 16-byte vectors of each element type, how a message is cut into segments and block shares,
// the per-block flags, and block-wide copy and reduce loops.
//
// A message of n elements is cut into 16-byte vectors (4 f32 or 8 bf16/f16); only the last
// vector of a message may be partial, and it is handled element by element. Every rank cuts
// the vectors into the same blocks, and block b of a rank exchanges flags only with block b of
// the others, so no kernel needs a grid-wide barrier.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstring>

#include "cuda/rows.cuh"
#include "cuda/sync.cuh"
#include "ffi/protocol/all_reduce_layout.h"

namespace jax_moe {

constexpr int kVectorsPerThread = 4;  // a block takes up to kThreads * 4 vectors (16 KiB)

// 16-byte vectors of each element type, converted to and from f32 exactly / to nearest even.
template <typename T>
struct Vec;

template <>
struct Vec<float> {
  static constexpr int kN = 4;
  __device__ static void to_f32(const uint4& v, float f[4]) {
    f[0] = __uint_as_float(v.x);
    f[1] = __uint_as_float(v.y);
    f[2] = __uint_as_float(v.z);
    f[3] = __uint_as_float(v.w);
  }
  __device__ static uint4 from_f32(const float f[4]) {
    return make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]),
                      __float_as_uint(f[3]));
  }
  __device__ static float scalar_to_f32(float x) { return x; }
};

template <>
struct Vec<__nv_bfloat16> {
  static constexpr int kN = 8;
  __device__ static void to_f32(const uint4& v, float f[8]) { bf16x8_to_f32(v, f); }
  __device__ static uint4 from_f32(const float f[8]) { return f32_to_bf16x8(f); }
  __device__ static float scalar_to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
};

template <>
struct Vec<__half> {
  static constexpr int kN = 8;
  __device__ static void to_f32(const uint4& v, float f[8]) {
    const __half2* h = reinterpret_cast<const __half2*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 pair = __half22float2(h[i]);
      f[2 * i] = pair.x;
      f[2 * i + 1] = pair.y;
    }
  }
  __device__ static uint4 from_f32(const float f[8]) {
    uint4 v;
    __half2* h = reinterpret_cast<__half2*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = __floats2half2_rn(f[2 * i], f[2 * i + 1]);
    return v;
  }
  __device__ static float scalar_to_f32(__half x) { return __half2float(x); }
};

// Vectors [begin, end) of part `part` when [0, count) is cut into `parts` contiguous parts.
struct Range {
  int64_t begin, end;
};
__device__ inline Range part_of(int64_t count, int part, int parts) {
  return {count * part / parts, count * (part + 1) / parts};
}

// Segment s of a two-shot message: the vectors rank s reduces.
__device__ inline Range segment(int64_t vectors, int s, int world) {
  return part_of(vectors, s, world);
}

// Block b's share of `r`.
__device__ inline Range block_share(Range r) {
  const Range p = part_of(r.end - r.begin, blockIdx.x, gridDim.x);
  return {r.begin + p.begin, r.begin + p.end};
}

// data[h][source] of `buffer`, h the parity of `seq`, as elements of T.
template <typename T>
__device__ inline T* slot(char* buffer, const AllReduceLayout& lay, int world, uint64_t seq,
                          int source) {
  const size_t index = size_t(seq & 1) * world + source;
  return reinterpret_cast<T*>(buffer + lay.data + index * lay.slot_bytes);
}

__device__ inline uint64_t* ar_flag(char* buffer, const AllReduceLayout& lay, int world,
                                    int set, int source) {
  return reinterpret_cast<uint64_t*>(buffer + lay.flags) +
         (size_t(set) * kAllReduceMaxBlocks + blockIdx.x) * world + source;
}

// After this block's writes into the peers' buffers: raise flag[set][b][me] = seq on every
// peer. The barrier orders the block's writes before thread p's system-scope fence and
// release store (cumulativity), so a peer that acquires the flag sees them.
__device__ inline void signal_peers(const CommView& v, const AllReduceLayout& lay, int set,
                                    uint64_t seq) {
  __syncthreads();
  const int p = threadIdx.x, R = v.dims.world;
  if (p < R && p != v.dims.rank) {
    __threadfence_system();
    store_release_sys(ar_flag(v.peers[p], lay, R, set, v.dims.rank), seq);
  }
}

// Threads p < R wait (with the timeout) for flag[set][b][p] >= seq here, then the block syncs.
// ">=": a peer may already be one call ahead; its writes of that call go to the other parity.
__device__ inline void wait_peers(const CommView& v, const AllReduceLayout& lay, int set,
                                  uint64_t seq, int32_t stage) {
  const int p = threadIdx.x, R = v.dims.world;
  if (p < R && p != v.dims.rank) wait_at_least(v, ar_flag(v.local, lay, R, set, p), seq, stage, p);
  __syncthreads();
}

// Calls fn(j, vector_count) for each vector j of [r.begin, r.end) of this thread, up to
// kVectorsPerThread at once so that many loads are in flight before their uses.
template <typename Fn>
__device__ inline void for_each_vector(Range r, Fn fn) {
  const int64_t step = int64_t(blockDim.x) * kVectorsPerThread;
  for (int64_t j = r.begin + threadIdx.x; j < r.end; j += step) {
    const int64_t left = (r.end - j + blockDim.x - 1) / blockDim.x;  // >= 1
    fn(j, static_cast<int>(left < kVectorsPerThread ? left : kVectorsPerThread));
  }
}

// Copies vectors of `r` from `src` to every destination that `dest(k)` names for k in
// [0, count) (nullptr: skip). The last vector of the message (element n - 1) may be partial.
template <typename T, typename Dest>
__device__ void copy_range(Range r, int64_t n, const T* src, int count, Dest dest) {
  constexpr int kN = Vec<T>::kN;
  for_each_vector(r, [&](int64_t j0, int m) {
    uint4 values[kVectorsPerThread];
#pragma unroll
    for (int u = 0; u < kVectorsPerThread; ++u) {
      const int64_t j = j0 + int64_t(u) * blockDim.x;
      if (u < m && (j + 1) * kN <= n) values[u] = reinterpret_cast<const uint4*>(src)[j];
    }
    for (int k = 0; k < count; ++k) {
      T* out = dest(k);
      if (out == nullptr) continue;
#pragma unroll
      for (int u = 0; u < kVectorsPerThread; ++u) {
        const int64_t j = j0 + int64_t(u) * blockDim.x;
        if (u >= m) continue;
        if ((j + 1) * kN <= n) reinterpret_cast<uint4*>(out)[j] = values[u];
        else
          for (int64_t i = j * kN; i < n; ++i) out[i] = src[i];
      }
    }
  });
}

// out[j] = sum over p in rank order of source(p)[j] for the vectors of `r`, stored to every
// non-null dest(k), k in [0, count).
template <typename T, typename Source, typename Dest>
__device__ void reduce_range(Range r, int64_t n, int world, Source source, int count, Dest dest) {
  using V = Vec<T>;
  constexpr int kN = V::kN;
  for_each_vector(r, [&](int64_t j0, int m) {
    float acc[kVectorsPerThread][kN];
    for (int p = 0; p < world; ++p) {
      const T* src = source(p);
      uint4 values[kVectorsPerThread];
#pragma unroll
      for (int u = 0; u < kVectorsPerThread; ++u) {
        const int64_t j = j0 + int64_t(u) * blockDim.x;
        if (u < m && (j + 1) * kN <= n) values[u] = reinterpret_cast<const uint4*>(src)[j];
      }
#pragma unroll
      for (int u = 0; u < kVectorsPerThread; ++u) {
        const int64_t j = j0 + int64_t(u) * blockDim.x;
        if (u >= m) continue;
        float f[kN];
        if ((j + 1) * kN <= n) {
          V::to_f32(values[u], f);
        } else {
#pragma unroll
          for (int i = 0; i < kN; ++i)
            f[i] = j * kN + i < n ? V::scalar_to_f32(src[j * kN + i]) : 0.f;
        }
#pragma unroll
        for (int i = 0; i < kN; ++i) acc[u][i] = p == 0 ? f[i] : __fadd_rn(acc[u][i], f[i]);
      }
    }
#pragma unroll
    for (int u = 0; u < kVectorsPerThread; ++u) {
      const int64_t j = j0 + int64_t(u) * blockDim.x;
      if (u >= m) continue;
      const bool full = (j + 1) * kN <= n;
      const uint4 packed = V::from_f32(acc[u]);
      for (int k = 0; k < count; ++k) {
        T* out = dest(k);
        if (out == nullptr) continue;
        if (full) {
          reinterpret_cast<uint4*>(out)[j] = packed;
        } else {
          // The message's last, partial vector: the elements of `packed` (from_f32 rounds each
          // value on its own) that are inside it. Constant indices only: a variable index into
          // a register array puts the array on the stack.
          T elements[kN];
          memcpy(elements, &packed, sizeof(packed));
#pragma unroll
          for (int i = 0; i < kN; ++i)
            if (j * kN + i < n) out[j * kN + i] = elements[i];
        }
      }
    }
  });
}

// Stores `seq` as the latest call, which the next launch reads (kernel boundaries order it).
// One block: every thread read the sequence before signal_peers' barrier, so thread 0 may
// advance it at once (saving the last-block atomics on small messages). Several blocks: the
// last block to finish advances it.
__device__ inline void finish_call(const CommView& v, uint64_t seq) {
  if (gridDim.x == 1) {
    if (threadIdx.x == 0) v.counters->all_reduce_seq = seq;
    return;
  }
  if (last_block_done(v, kDoneAllReduce) && threadIdx.x == 0) v.counters->all_reduce_seq = seq;
}

// Blocks of a launch whose phases each cover `vectors_per_phase` vectors: a function of the
// message size and R only, so the same on every rank.
inline int all_reduce_blocks(int64_t vectors_per_phase) {
  const int64_t per_block = int64_t(kThreads) * kVectorsPerThread;
  const int64_t blocks = (vectors_per_phase + per_block - 1) / per_block;
  if (blocks < 1) return 1;
  return static_cast<int>(blocks > kAllReduceMaxBlocks ? kAllReduceMaxBlocks : blocks);
}

inline bool aligned16(const void* a, const void* b) {
  return ((reinterpret_cast<uintptr_t>(a) | reinterpret_cast<uintptr_t>(b)) % 16) == 0;
}

}  // namespace jax_moe
