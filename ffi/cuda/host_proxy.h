// The host proxy of a CUDA rank whose peers are reached through the host (other nodes, or
// every peer when JAX_MOE_FORCE_REMOTE=1; jax_moe/backends/cuda_proxy.py decides). The rank's
// exchange then runs on the CPU, in one proxy thread per device, as the host backend's
// protocol (ffi/host/exchange.h) on a host rank state with the same (comm id, ordinal):
// peers in this process share host memory, peers in other processes are written through the
// TransferEngine (ffi/host_fabric/), and the results are the host backend's, bit for bit the
// NVLink kernels' (docs/semantics.md).
//
// One request of the stream (CudaProxy::dispatch_send etc., same arguments as the launchers
// of cuda/api.cuh): copy the inputs into pinned host staging, ring the doorbell and wait
// (cuda/proxy.cu), copy the outputs back. The proxy thread polls the doorbell, runs the
// exchange on the staging areas and reports it done. Everything is stream-ordered device
// work with fixed addresses, so it can be captured into a command buffer.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

#include "cuda/api.cuh"
#include "cuda/layout.cuh"

namespace jax_moe {

namespace host {
struct HostRankState;
}

// One served request, for the proxy-overhead measurement.
struct ProxySample {
  uint32_t op;
  int64_t seen_to_first_post_ns;  // doorbell seen -> first RMA write posted; -1 if none posted
  int64_t serve_ns;               // doorbell seen -> done reported
};

class CudaProxy {
 public:
  // Allocates the pinned staging and the doorbell for a rank of `dims`. A request waits at
  // most `wait_ns` for the proxy. Throws std::runtime_error.
  CudaProxy(const MoeDims& dims, uint64_t wait_ns);
  ~CudaProxy();  // stops the thread, frees the host memory
  CudaProxy(const CudaProxy&) = delete;
  CudaProxy& operator=(const CudaProxy&) = delete;

  // Starts serving the requests with `host_state` (connected; outlives this proxy's thread).
  void start(host::HostRankState* host_state);
  // True once the host exchange gave up on a peer: the ranks' sequences no longer agree.
  bool timed_out() const;
  // The samples since the last call, oldest first (at most kMaxSamples).
  std::vector<ProxySample> take_samples();

  cudaError_t dispatch_send(const CommView& v, TokenInput input, const void* x,
                            const float* x_scales, const int32_t* topk_ids,
                            const float* topk_weights, const int32_t* num_tokens,
                            int32_t* send_dest, cudaStream_t stream);
  cudaError_t dispatch_recv(const CommView& v, void* x, float* scales, float* weights,
                            int32_t* group_sizes, int32_t* tokens_per_expert, int32_t* slot_rows,
                            cudaStream_t stream);
  cudaError_t combine_send(const CommView& v, const void* y, const int32_t* slot_rows,
                           const float* row_weights, int32_t* done, cudaStream_t stream);
  cudaError_t combine_recv(const CommView& v, const int32_t* send_dest,
                           const float* topk_weights, void* out, cudaStream_t stream);

  static constexpr size_t kMaxSamples = 1 << 16;

 private:
  // Byte offsets of the staging areas in `staging_` (one pinned allocation). Inputs and
  // outputs of one request never share an area; areas are reused by later requests, which
  // the stream issues only after the previous one finished.
  struct Areas {
    size_t x_in, scales_in, topk_ids, topk_weights, num_tokens, send_dest;   // dispatch_send
    size_t x_out, scales_out, row_weights, group_sizes, tokens_per_expert;   // dispatch_recv
    size_t slot_rows;                                                        // both
    size_t y, done, out;                                                     // combine
    size_t total;
  };
  static Areas areas_for(const MoeDims& d);
  char* area(size_t offset) const { return staging_ + offset; }
  cudaError_t request(const CommView& v, uint32_t op, cudaStream_t stream);
  void run();
  void serve(uint32_t op);

  MoeDims dims_;
  uint64_t wait_ns_;
  Areas areas_{};
  char* staging_ = nullptr;                  // pinned host memory [areas_.total]
  ProxyDoorbell* doorbell_ = nullptr;        // mapped pinned host memory
  ProxyDoorbell* doorbell_device_ = nullptr; // the same, as the device addresses it
  host::HostRankState* host_ = nullptr;
  std::atomic<bool> stop_{false};
  std::thread thread_;
  std::mutex samples_mutex_;
  std::vector<ProxySample> samples_;
};

}  // namespace jax_moe
