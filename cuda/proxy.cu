// The device side of the host proxy when a kernel waits for it (JAX_MOE_PROXY_WAIT=kernel): ring
// the doorbell and spin until the proxy answers (cuda/api.cuh).
#include "cuda/api.cuh"
#include "cuda/sync.cuh"

namespace jax_moe {
namespace {

__global__ void proxy_request_kernel(CommView v, ProxyDoorbell* doorbell, uint32_t op,
                                     uint64_t wait_ns) {
  uint32_t* answered = &doorbell->answered;
  if (*reinterpret_cast<volatile int32_t*>(&v.counters->aborted)) return;
  // The request's inputs were written to host memory by earlier operations of this stream,
  // which completed before this kernel started; the release orders the doorbell after them
  // and after the cleared answer (the proxy sets it only once it took this request).
  *reinterpret_cast<volatile uint32_t*>(answered) = 0;
  store_release_sys(&doorbell->request, kProxyRung | op);
  const uint64_t start = global_timer_ns();
  while (load_acquire_sys(answered) == 0) {
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
