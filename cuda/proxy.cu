// The device side of the host proxy: ring the doorbell, wait for the proxy (cuda/api.cuh).
#include "cuda/api.cuh"
#include "cuda/sync.cuh"

namespace jax_moe {
namespace {

__global__ void proxy_request_kernel(CommView v, ProxyDoorbell* doorbell, uint32_t op,
                                     uint64_t wait_ns) {
  if (*reinterpret_cast<volatile int32_t*>(&v.counters->aborted)) return;
  const uint64_t seq = v.counters->proxy_seq + 1;
  v.counters->proxy_seq = seq;
  // The request's inputs were copied to host memory by earlier operations of this stream,
  // which completed before this kernel started; the release orders the doorbell after them.
  store_release_sys(&doorbell->request, seq << 8 | op);
  const uint64_t start = global_timer_ns();
  while (load_acquire_sys(&doorbell->done) < seq) {
    if (global_timer_ns() - start > wait_ns) {
      record_error(v, kTimeout, kStageProxy, v.dims.rank);
      atomicExch(&v.counters->aborted, 1);
      return;
    }
    __nanosleep(128);
  }
}

}  // namespace

cudaError_t launch_proxy_request(const CommView& view, ProxyDoorbell* doorbell, uint32_t op,
                                 uint64_t wait_ns, cudaStream_t stream) {
  if (op > 0xff) return cudaErrorInvalidValue;
  proxy_request_kernel<<<1, 1, 0, stream>>>(view, doorbell, op, wait_ns);
  return cudaGetLastError();
}

}  // namespace jax_moe
