// All-reduce (sum) over NVLink for small and medium messages: one-shot and two-shot through
// peer-mapped buffers. Buffer layout and the parity argument: ffi/protocol/all_reduce_layout.h;
// how a message is cut into vectors and blocks: cuda/all_reduce_common.cuh. Flags hold the
// call's sequence number (kept in device memory, advanced by the last block), which makes the
// launch independent of host state and so capturable in a command buffer.
//
// Reduction order: element i is sum_{p = 0..R-1} x_p[i] accumulated in f32 starting from rank
// 0's value, in rank order on every rank, then rounded once to the element type.
#include "cuda/all_reduce_common.cuh"
#include "cuda/api.cuh"

namespace jax_moe {
namespace {

// One-shot. Block b: push its vectors of x into data[h][me] of every peer, raise flag set 0,
// wait for every peer's, then reduce its vectors from x (own) and data[h][p] (peers).
template <typename T>
__global__ void __launch_bounds__(kThreads)
one_shot_kernel(CommView v, AllReduceLayout lay, const T* x, T* out, int64_t n) {
  const int R = v.dims.world, me = v.dims.rank;
  const uint64_t seq = v.counters->all_reduce_seq + 1;
  const int64_t vectors = (n + Vec<T>::kN - 1) / Vec<T>::kN;
  const Range mine = block_share({0, vectors});
  copy_range<T>(mine, n, x, R, [&](int p) {
    return p == me ? nullptr : slot<T>(v.peers[p], lay, R, seq, me);
  });
  signal_peers(v, lay, kFlagFirst, seq);
  wait_peers(v, lay, kFlagFirst, seq, kStageAllReduceOneShot);
  reduce_range<T>(mine, n, R,
                  [&](int p) { return p == me ? x : slot<T>(v.local, lay, R, seq, p); }, 1,
                  [&](int) { return out; });
  finish_call(v, seq);
}

// Two-shot. Block b takes share b of every segment. Phase 1: push its share of segment s to
// data[h][me] of rank s, raise flag set 0; wait; reduce its share of segment `me` and store it
// to out and to data[h][me] of every peer (at the segment's own place, which phase 1 leaves
// unused there), raise flag set 1. Phase 2: wait, copy its share of every other segment s
// from data[h][s] here to out.
template <typename T>
__global__ void __launch_bounds__(kThreads)
two_shot_kernel(CommView v, AllReduceLayout lay, const T* x, T* out, int64_t n) {
  const int R = v.dims.world, me = v.dims.rank;
  const uint64_t seq = v.counters->all_reduce_seq + 1;
  const int64_t vectors = (n + Vec<T>::kN - 1) / Vec<T>::kN;
  for (int s = 0; s < R; ++s) {
    if (s == me) continue;
    copy_range<T>(block_share(segment(vectors, s, R)), n, x, 1,
                  [&](int) { return slot<T>(v.peers[s], lay, R, seq, me); });
  }
  signal_peers(v, lay, kFlagFirst, seq);
  wait_peers(v, lay, kFlagFirst, seq, kStageAllReduceScatter);
  reduce_range<T>(block_share(segment(vectors, me, R)), n, R,
                  [&](int p) { return p == me ? x : slot<T>(v.local, lay, R, seq, p); }, R,
                  [&](int p) { return p == me ? out : slot<T>(v.peers[p], lay, R, seq, me); });
  signal_peers(v, lay, kFlagSecond, seq);
  wait_peers(v, lay, kFlagSecond, seq, kStageAllReduceGather);
  for (int s = 0; s < R; ++s) {
    if (s == me) continue;
    copy_range<T>(block_share(segment(vectors, s, R)), n, slot<T>(v.local, lay, R, seq, s), 1,
                  [&](int) { return out; });
  }
  finish_call(v, seq);
}

template <typename T>
cudaError_t launch_kernel(bool two_shot, const CommView& view, const AllReduceLayout& lay,
                          const void* x, void* out, int64_t n, cudaStream_t stream) {
  const int64_t vectors = (n + Vec<T>::kN - 1) / Vec<T>::kN;
  // A phase covers all vectors (one-shot) or one segment (two-shot).
  const int blocks = all_reduce_blocks(
      two_shot ? (vectors + view.dims.world - 1) / view.dims.world : vectors);
  const T* in = static_cast<const T*>(x);
  T* result = static_cast<T*>(out);
  if (two_shot) two_shot_kernel<T><<<blocks, kThreads, 0, stream>>>(view, lay, in, result, n);
  else one_shot_kernel<T><<<blocks, kThreads, 0, stream>>>(view, lay, in, result, n);
  return cudaGetLastError();
}

cudaError_t launch_by_dtype(bool two_shot, const CommView& view, const AllReduceLayout& lay,
                            ReduceDtype dtype, const void* x, void* out, int64_t n,
                            cudaStream_t stream) {
  if (!aligned16(x, out)) return cudaErrorMisalignedAddress;
  switch (dtype) {
    case kReduceF32: return launch_kernel<float>(two_shot, view, lay, x, out, n, stream);
    case kReduceBf16: return launch_kernel<__nv_bfloat16>(two_shot, view, lay, x, out, n, stream);
    case kReduceF16: return launch_kernel<__half>(two_shot, view, lay, x, out, n, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t launch_all_reduce_one_shot(const CommView& view, const AllReduceLayout& lay,
                                       ReduceDtype dtype, const void* x, void* out, int64_t n,
                                       cudaStream_t stream) {
  return launch_by_dtype(false, view, lay, dtype, x, out, n, stream);
}

cudaError_t launch_all_reduce_two_shot(const CommView& view, const AllReduceLayout& lay,
                                       ReduceDtype dtype, const void* x, void* out, int64_t n,
                                       cudaStream_t stream) {
  return launch_by_dtype(true, view, lay, dtype, x, out, n, stream);
}

}  // namespace jax_moe
