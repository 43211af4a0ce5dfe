// The device side of the host proxy: ring the doorbell, and wait for the proxy unless the
// stream does (cuda/api.cuh).
#include "cuda/api.cuh"
#include "cuda/sync.cuh"

namespace jax_moe {
namespace {

__global__ void proxy_request_kernel(CommView v, ProxyDoorbell* doorbell, uint32_t op,
                                     uint64_t wait_ns, bool spin) {
  volatile uint32_t* answered = &doorbell->answered;
  if (*reinterpret_cast<volatile int32_t*>(&v.counters->aborted)) {
    *answered = 1;
    __threadfence_system();
    return;
  }
  const uint64_t seq = v.counters->proxy_seq + 1;
  v.counters->proxy_seq = seq;
  // The request's inputs were written to host memory by earlier operations of this stream,
  // which completed before this kernel started; the release orders the doorbell after them
  // and after the cleared answer (the proxy sets it only once it saw this request).
  *answered = 0;
  store_release_sys(&doorbell->request, seq << 8 | op);
  if (!spin) {
    __threadfence_system();  // both stores out before the stream's wait reads `answered`
    return;
  }
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
                                 uint64_t wait_ns, bool spin, cudaStream_t stream) {
  if (op > 0xff) return cudaErrorInvalidValue;
  proxy_request_kernel<<<1, 1, 0, stream>>>(view, doorbell, op, wait_ns, spin);
  return cudaGetLastError();
}

}  // namespace jax_moe
