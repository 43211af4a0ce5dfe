// NVLS all-reduce: the NVSwitch sums through a multicast object (multimem.ld_reduce) and
// stores the sum into every rank's copy at once (multimem.st). Only for machines that allow
// NVLink multicast; the host refuses to build it otherwise (ffi/cuda/multicast.cc). Written
// and compiled, not yet run: the machines it was developed on forbid multicast.
//
// Multicast region, every rank's copy ([2][2][slot_bytes]): in[h] then out[h] for parity h.
// Block b, share b of every segment (cuda/all_reduce_common.cuh):
//   1. copy x into in[h] of this rank's copy (unicast), raise flag set 0 on every peer, wait;
//   2. for its share of segment `me`: ld_reduce in[h] over all copies, multimem.st the sum to
//      out[h] of all copies; raise flag set 1, wait;
//   3. copy its share of every segment from out[h] of this rank's copy to out.
// The last vector of a message may be partial: the switch then sums the whole 16 bytes, the
// bytes past n being whatever the copies hold there, and step 3 copies only the elements < n.
#include "cuda/all_reduce_common.cuh"
#include "cuda/api.cuh"

namespace jax_moe {
namespace {

template <typename T>
struct Multimem;

template <>
struct Multimem<float> {
  __device__ static uint4 ld_reduce(const void* address) {
    uint4 v;
    asm volatile("multimem.ld_reduce.relaxed.sys.global.add.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(address)
                 : "memory");
    return v;
  }
};

// bf16 and f16 pairs: the switch accumulates in f32 (.acc::f32) and rounds once.
template <>
struct Multimem<__nv_bfloat16> {
  __device__ static uint4 ld_reduce(const void* address) {
    uint4 v;
    asm volatile(
        "multimem.ld_reduce.relaxed.sys.global.add.acc::f32.v4.bf16x2 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(address)
        : "memory");
    return v;
  }
};

template <>
struct Multimem<__half> {
  __device__ static uint4 ld_reduce(const void* address) {
    uint4 v;
    asm volatile(
        "multimem.ld_reduce.relaxed.sys.global.add.acc::f32.v4.f16x2 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(address)
        : "memory");
    return v;
  }
};

__device__ inline void multimem_store(void* address, const uint4& v) {
  asm volatile("multimem.st.relaxed.sys.global.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(address),
               "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

// in[h] (region 0) or out[h] (region 1) of a copy of the multicast region.
template <typename T>
__device__ inline T* region(char* base, const AllReduceLayout& lay, uint64_t seq, int which) {
  return reinterpret_cast<T*>(base + (size_t(seq & 1) * 2 + which) * lay.slot_bytes);
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
nvls_kernel(CommView v, AllReduceLayout lay, char* multicast, char* unicast, const T* x, T* out,
            int64_t n) {
  const int R = v.dims.world, me = v.dims.rank;
  const uint64_t seq = v.counters->all_reduce_seq + 1;
  const int64_t vectors = (n + Vec<T>::kN - 1) / Vec<T>::kN;
  for (int s = 0; s < R; ++s)
    copy_range<T>(block_share(segment(vectors, s, R)), n, x, 1,
                  [&](int) { return region<T>(unicast, lay, seq, 0); });
  signal_peers(v, lay, kFlagFirst, seq);
  wait_peers(v, lay, kFlagFirst, seq, kStageAllReduceNvls);
  const Range mine = block_share(segment(vectors, me, R));
  const uint4* sums_from = reinterpret_cast<const uint4*>(region<T>(multicast, lay, seq, 0));
  uint4* sums_to = reinterpret_cast<uint4*>(region<T>(multicast, lay, seq, 1));
  for (int64_t j = mine.begin + threadIdx.x; j < mine.end; j += blockDim.x)
    multimem_store(sums_to + j, Multimem<T>::ld_reduce(sums_from + j));
  // The multimem stores must reach every copy before the peers' flags rise: a system-scope
  // fence by every thread that stored, then the release of signal_peers.
  __threadfence_system();
  signal_peers(v, lay, kFlagSecond, seq);
  wait_peers(v, lay, kFlagSecond, seq, kStageAllReduceNvls);
  for (int s = 0; s < R; ++s)
    copy_range<T>(block_share(segment(vectors, s, R)), n, region<T>(unicast, lay, seq, 1), 1,
                  [&](int) { return out; });
  finish_call(v, seq);
}

template <typename T>
cudaError_t launch_nvls(const CommView& view, const AllReduceLayout& lay, char* multicast,
                        char* unicast, const void* x, void* out, int64_t n, cudaStream_t stream) {
  const int64_t vectors = (n + Vec<T>::kN - 1) / Vec<T>::kN;
  const int blocks = all_reduce_blocks((vectors + view.dims.world - 1) / view.dims.world);
  nvls_kernel<T><<<blocks, kThreads, 0, stream>>>(
      view, lay, multicast, unicast, static_cast<const T*>(x), static_cast<T*>(out), n);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_all_reduce_nvls(const CommView& view, const AllReduceLayout& lay,
                                   char* multicast, char* unicast, ReduceDtype dtype,
                                   const void* x, void* out, int64_t n, cudaStream_t stream) {
  if (!aligned16(x, out)) return cudaErrorMisalignedAddress;
  switch (dtype) {
    case kReduceF32: return launch_nvls<float>(view, lay, multicast, unicast, x, out, n, stream);
    case kReduceBf16:
      return launch_nvls<__nv_bfloat16>(view, lay, multicast, unicast, x, out, n, stream);
    case kReduceF16: return launch_nvls<__half>(view, lay, multicast, unicast, x, out, n, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace jax_moe
