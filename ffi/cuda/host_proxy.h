// The host proxy of a CUDA rank whose peers are reached through the host (other nodes, or
// every peer when JAX_MOE_FORCE_REMOTE=1; jax_moe/backends/cuda_proxy.py decides). The rank's
// exchange is the host backend's protocol (ffi/host/exchange.h) on a host rank state with the
// same (comm id, ordinal): peers in this process or on this host share host memory, peers on
// other hosts are written through the TransferEngine (ffi/host_fabric/), and the results are
// the host backend's, bit for bit the NVLink kernels' (docs/semantics.md).
//
// The GPU does every row's work; the proxy thread only waits, keeps the per-slot bookkeeping
// (sequences, counts, slot rows, spans), publishes flags and posts writes. At start the proxy
// maps into the device the host memory the rows live in: the rank's host buffer, its mappings
// of the near ranks' buffers (processes of the same host share them) and its staging copies of
// the remote ranks (cudaHostRegister; the other local ranks' proxies map theirs).
// One request of the stream (CudaProxy::dispatch_send etc., same arguments as the launchers
// of cuda/api.cuh) is: ring the doorbell for the half's first CPU phase and wait for it
// (CudaProxy::request), the half's kernel (cuda/proxy_rows.cuh) on the mapped memory, and for a
// send half ring for the second CPU phase (in a fused op, together with the receive half's
// first: Joint); a receive half's second phase rides on the next request.
// Everything is stream-ordered device work with fixed addresses, so it can be captured into a
// command buffer.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "cuda/api.cuh"
#include "cuda/comm_view.cuh"
#include "cuda/proxy_rows.cuh"
#include "ffi/cuda/device_staging.h"

namespace jax_moe {

namespace host {
struct HostRankState;
}

// One served request (a CPU phase), for the proxy-overhead measurement.
struct ProxySample {
  uint32_t op;
  int64_t seen_to_first_post_ns;  // doorbell seen -> first RMA write posted; -1 if none posted
  int64_t serve_ns;               // doorbell seen -> done reported
  // The previous request answered -> this doorbell seen: the GPU's part between two requests
  // (its kernels, and its wait for a time slice when processes share it); -1 for the first.
  int64_t since_answer_ns;
};

// The name of a doorbell op ("dispatch_send.begin", ...; "unknown" for other values), so
// the samples say which phase they timed without a second copy of the op codes.
const char* proxy_op_name(uint32_t op);

// Which rows stay in device memory: those between the ranks of this host (`near`,
// JAX_MOE_PROXY_NEAR_ROWS=device: each rank's device buffer in the host layout, the rank
// state's PeerBuffers::local, which the others map), and those to and from ranks on other
// hosts (`remote`, JAX_MOE_PROXY_HMEM: the TransferEngine reads them from device staging
// copies and writes them into that device buffer, FI_HMEM).
struct DeviceRows {
  bool near = false;
  bool remote = false;
};

class CudaProxy {
 public:
  // Allocates the mapped staging, scratch and the doorbell for a rank of `dims` on device
  // `ordinal` (current). With `stream_wait` the stream rings and waits for each request with
  // stream memory operations (no kernel; bounded by the proxy's own waits), else a ringing
  // kernel spins for at most `wait_ns`. Throws std::runtime_error.
  CudaProxy(const MoeDims& dims, int ordinal, uint64_t wait_ns, bool stream_wait,
            DeviceRows device_rows);
  ~CudaProxy();  // stop(), then frees the proxy's memory
  CudaProxy(const CudaProxy&) = delete;
  CudaProxy& operator=(const CudaProxy&) = delete;

  // With DeviceRows::remote: the device staging copies of `remote_ranks` (ascending), before
  // the TransferEngine registers them (host_remote.py); once. Throws std::runtime_error.
  const DeviceStaging& stage_remote_rows(const std::vector<int>& remote_ranks);

  // Maps the host memory of `host_state` (connected) into the device and starts serving the
  // requests with it. `device_buffer`: the rank's device buffer in the host layout (null
  // without DeviceRows); `near_table`: every rank's device buffer as mapped here (null
  // for ranks whose rows do not come through device memory of this host; empty without near
  // device rows). Throws std::invalid_argument, std::runtime_error.
  void start(host::HostRankState* host_state, char* device_buffer,
             const std::vector<char*>& near_table);
  // Stops the thread, waits for the device and unregisters the host memory; after it the
  // host rank state (and the TransferEngine writing into device_buffer) may go. Idempotent.
  void stop();
  const DeviceRows& device_rows() const { return device_rows_; }
  // True once the host exchange gave up on a peer: the ranks' sequences no longer agree.
  bool timed_out() const;
  // The samples since the last call, oldest first (at most kMaxSamples).
  std::vector<ProxySample> take_samples();

  // How a half meets the other half of its op. kAlone: its own opening and closing requests.
  // kJoined (the fused ops): the send half leaves its closing phase to the receive half,
  // whose opening request serves both (one doorbell round trip less); a send half run
  // kJoined must be followed on the same stream by its receive half run kJoined.
  enum class Joint { kAlone, kJoined };

  cudaError_t dispatch_send(const CommView& v, TokenInput input, const void* x,
                            const float* x_scales, const int32_t* topk_ids,
                            const float* topk_weights, const int32_t* num_tokens,
                            int32_t* send_dest, Joint joint, cudaStream_t stream);
  cudaError_t dispatch_recv(const CommView& v, void* x, float* scales, float* weights,
                            int32_t* group_sizes, int32_t* tokens_per_expert, int32_t* slot_rows,
                            Joint joint, cudaStream_t stream);
  cudaError_t combine_send(const CommView& v, const void* y, const int32_t* slot_rows,
                           const float* row_weights, int32_t* done, Joint joint,
                           cudaStream_t stream);
  cudaError_t combine_recv(const CommView& v, const int32_t* send_dest,
                           const float* topk_weights, void* out, Joint joint,
                           cudaStream_t stream);

  static constexpr size_t kMaxSamples = 1 << 16;

 private:
  // Byte offsets of the areas in `staging_` (one mapped pinned allocation): the control
  // block and the per-slot arrays of ProxyRowsView, and send_dest [T, K] (combine_recv's
  // input, copied for the CPU's wait). Reused by later requests, which the stream issues
  // only after the previous one finished.
  struct Areas {
    size_t control, slot_rows, weights, group_sizes, tokens_per_expert, tokens, zero_rows;
    size_t send_dest;
    size_t total;
  };
  static Areas areas_for(const MoeDims& d);
  template <typename T>
  T* area(size_t offset) const { return reinterpret_cast<T*>(staging_ + offset); }
  template <typename T>
  T* device_area(size_t offset) const { return reinterpret_cast<T*>(staging_device_ + offset); }
  cudaError_t request(const CommView& v, uint32_t op, cudaStream_t stream);
  // request() for a half's first CPU phase, then the copy of its control words into device
  // memory for the kernel that follows (ProxyRowsView::control_copy).
  cudaError_t begin(const CommView& v, uint32_t op, cudaStream_t stream);
  ProxyRowsView rows_view(const CommView& v) const;
  void register_host(void* memory, size_t bytes);
  void run();
  void serve(uint32_t op);

  MoeDims dims_;
  int ordinal_;
  uint64_t wait_ns_;
  DeviceRows device_rows_;
  // A receive half's first phase makes the rows that landed in device memory through the
  // NIC visible to the kernel that follows (GPUDirect RDMA writes: a flush), where the
  // device needs it.
  bool flush_remote_writes_ = false;
  // cuStreamBatchMemOp (the driver's, reached through the runtime: libcuda is not linked),
  // when the stream rings and waits with memory operations; null: a kernel rings and spins.
  decltype(&cuStreamBatchMemOp) mem_ops_ = nullptr;
  Areas areas_{};
  char* staging_ = nullptr;                  // mapped pinned host memory [areas_.total]
  char* staging_device_ = nullptr;           // the same, as the device addresses it
  ProxyControl* control_ = nullptr;          // in staging_
  ProxyDoorbell* doorbell_ = nullptr;        // mapped pinned host memory
  ProxyDoorbell* doorbell_device_ = nullptr; // the same, as the device addresses it
  ProxyControl* control_copy_ = nullptr;     // device memory: *control_ after a first phase
  ProxyScratch* scratch_ = nullptr;          // device memory
  char** peers_device_ = nullptr;            // device [R]: the host state's peers, mapped
  char** rows_to_ = nullptr;                 // device [R]: ProxyRowsView::rows_to
  char** terms_to_ = nullptr;                // device [R]: ProxyRowsView::terms_to
  char** rows_from_ = nullptr;               // device [R]: ProxyRowsView::rows_from
  std::unique_ptr<DeviceStaging> device_staging_;  // copies of the remote ranks (stage_remote_rows)
  std::vector<int> staged_ranks_;            // their ranks, in copy order
  char* self_ = nullptr;                     // device [self_layout]: the rank's rows to itself
  char* buffer_device_ = nullptr;            // the host state's buffer, mapped
  std::vector<void*> registered_;            // host memory this proxy registered
  bool phase_ok_ = false;                    // the last first phase succeeded (proxy thread)
  // The acknowledgement the last receive half owes its senders, sent at the next request
  // (proxy thread; host_proxy.cc, ProxyOp).
  enum class Ack { kNone, kDispatch, kCombine };
  Ack pending_ack_ = Ack::kNone;
  host::HostRankState* host_ = nullptr;
  std::atomic<bool> stop_{false};
  std::thread thread_;
  std::mutex samples_mutex_;
  std::vector<ProxySample> samples_;
};

}  // namespace jax_moe
