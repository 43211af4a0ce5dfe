#include "ffi/cuda/host_proxy.h"

#include <chrono>
#include <cstring>
#include <stdexcept>
#include <string>

#include "ffi/exchange_checks.h"
#include "ffi/host/exchange.h"
#include "ffi/host/state.h"

namespace jax_moe {
namespace {

// The doorbell's op byte: which exchange the proxy runs.
enum ProxyOp : uint32_t {
  kOpDispatchSend = 1,  // + TokenInput (1..3)
  kOpDispatchRecv = 4,
  kOpCombineSend = 5,
  kOpCombineRecv = 6,
};

using Clock = std::chrono::steady_clock;
// After a request the thread polls without pausing for this long (the next layer's request
// usually follows within it), then sleeps between polls so an idle proxy leaves its core.
constexpr auto kHotPoll = std::chrono::milliseconds(200);
constexpr auto kIdlePoll = std::chrono::microseconds(50);

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
      .count();
}

void check_cuda(cudaError_t status, const char* what) {
  if (status != cudaSuccess)
    throw std::runtime_error(std::string("jax_moe cuda proxy: ") + what + " failed: " +
                             cudaGetErrorString(status));
}

cudaError_t to_host(char* dst, const void* src, size_t bytes, cudaStream_t stream) {
  if (bytes == 0) return cudaSuccess;
  return cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream);
}

cudaError_t to_device(void* dst, const char* src, size_t bytes, cudaStream_t stream) {
  if (bytes == 0) return cudaSuccess;
  return cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream);
}

// The first failure of a sequence of stream operations.
#define JAX_MOE_RETURN_IF_ERROR(expr)          \
  do {                                         \
    const cudaError_t status_ = (expr);        \
    if (status_ != cudaSuccess) return status_; \
  } while (0)

}  // namespace

CudaProxy::Areas CudaProxy::areas_for(const MoeDims& d) {
  const size_t T = d.max_tokens, H = d.hidden, K = d.topk, R = d.world, C = d.capacity;
  const size_t L = d.local_experts, nb = scale_blocks(d);
  Areas a{};
  size_t next = 0;
  auto take = [&next](size_t bytes) {
    const size_t at = next;
    next = align_up(next + bytes, 64);
    return at;
  };
  a.x_in = take(T * H * 2);  // bf16 or fp8 codes
  a.scales_in = take(T * nb * 4);
  a.topk_ids = take(T * K * 4);
  a.topk_weights = take(T * K * 4);
  a.num_tokens = take(4);
  a.send_dest = take(T * K * 4);
  a.x_out = take(C * H * (d.fp8 ? 1 : 2));
  a.scales_out = take(C * nb * 4);
  a.row_weights = take(C * 4);
  a.group_sizes = take(L * 4);
  a.tokens_per_expert = take(L * 4);
  a.slot_rows = take(R * T * K * 4);
  a.y = take(C * H * 2);
  a.done = take(4);
  a.out = take(T * H * 2);
  a.total = next;
  return a;
}

CudaProxy::CudaProxy(const MoeDims& dims, uint64_t wait_ns)
    : dims_(dims), wait_ns_(wait_ns), areas_(areas_for(dims)) {
  try {
    check_cuda(cudaHostAlloc(reinterpret_cast<void**>(&staging_), areas_.total,
                             cudaHostAllocPortable),
               "cudaHostAlloc(staging)");
    std::memset(staging_, 0, areas_.total);
    check_cuda(cudaHostAlloc(reinterpret_cast<void**>(&doorbell_), sizeof(ProxyDoorbell),
                             cudaHostAllocMapped | cudaHostAllocPortable),
               "cudaHostAlloc(doorbell)");
    std::memset(doorbell_, 0, sizeof(ProxyDoorbell));
    check_cuda(cudaHostGetDevicePointer(reinterpret_cast<void**>(&doorbell_device_), doorbell_, 0),
               "cudaHostGetDevicePointer(doorbell)");
  } catch (...) {
    if (doorbell_) cudaFreeHost(doorbell_);
    if (staging_) cudaFreeHost(staging_);
    throw;
  }
}

CudaProxy::~CudaProxy() {
  stop_.store(true);
  if (thread_.joinable()) thread_.join();
  cudaFreeHost(doorbell_);
  cudaFreeHost(staging_);
}

void CudaProxy::start(host::HostRankState* host_state) {
  if (thread_.joinable()) throw std::invalid_argument("jax_moe cuda proxy: already started");
  if (host_state == nullptr || !host_state->connected)
    throw std::invalid_argument("jax_moe cuda proxy: the host rank state must be connected first");
  host_ = host_state;
  thread_ = std::thread([this] { run(); });
}

bool CudaProxy::timed_out() const { return host_ != nullptr && host_->timed_out.load(); }

std::vector<ProxySample> CudaProxy::take_samples() {
  std::lock_guard<std::mutex> lock(samples_mutex_);
  std::vector<ProxySample> out;
  out.swap(samples_);
  return out;
}

cudaError_t CudaProxy::request(const CommView& v, uint32_t op, cudaStream_t stream) {
  return launch_proxy_request(v, doorbell_device_, op, wait_ns_, stream);
}

void CudaProxy::run() {
  uint64_t served = 0;
  auto last_request = Clock::now();
  while (!stop_.load(std::memory_order_relaxed)) {
    const uint64_t request = __atomic_load_n(&doorbell_->request, __ATOMIC_ACQUIRE);
    if ((request >> 8) == served) {
      if (Clock::now() - last_request > kHotPoll) std::this_thread::sleep_for(kIdlePoll);
      else __builtin_ia32_pause();
      continue;
    }
    const int64_t seen = now_ns();
    host_->first_post_ns = 0;
    try {
      serve(static_cast<uint32_t>(request & 0xff));
    } catch (const std::exception&) {
      // The exchange turns transport failures into TIMEOUT; what may still throw here is an
      // allocation. The ranks' sequences then no longer agree, so the rank is broken as
      // after a timeout, and the stream still gets its answer.
      host_->record_error(kTimeout, kStageProxy, host_->dims.rank);
      host_->timed_out = true;
    }
    served = request >> 8;
    __atomic_store_n(&doorbell_->done, served, __ATOMIC_RELEASE);
    const int64_t finished = now_ns();
    last_request = Clock::now();
    const int64_t first_post = host_->first_post_ns;
    std::lock_guard<std::mutex> lock(samples_mutex_);
    if (samples_.size() < kMaxSamples)
      samples_.push_back({static_cast<uint32_t>(request & 0xff),
                          first_post ? first_post - seen : -1, finished - seen});
  }
}

void CudaProxy::serve(uint32_t op) {
  host::HostRankState& s = *host_;
  if (op >= kOpDispatchSend && op < kOpDispatchRecv) {
    host::dispatch_send(s, static_cast<RowInput>(op - kOpDispatchSend), area(areas_.x_in),
                        reinterpret_cast<const float*>(area(areas_.scales_in)),
                        reinterpret_cast<const int32_t*>(area(areas_.topk_ids)),
                        reinterpret_cast<const float*>(area(areas_.topk_weights)),
                        reinterpret_cast<const int32_t*>(area(areas_.num_tokens)),
                        reinterpret_cast<int32_t*>(area(areas_.send_dest)));
  } else if (op == kOpDispatchRecv) {
    host::dispatch_recv(s, area(areas_.x_out), reinterpret_cast<float*>(area(areas_.scales_out)),
                        reinterpret_cast<float*>(area(areas_.row_weights)),
                        reinterpret_cast<int32_t*>(area(areas_.group_sizes)),
                        reinterpret_cast<int32_t*>(area(areas_.tokens_per_expert)),
                        reinterpret_cast<int32_t*>(area(areas_.slot_rows)));
  } else if (op == kOpCombineSend) {
    host::combine_send(s, reinterpret_cast<const uint16_t*>(area(areas_.y)),
                       reinterpret_cast<const int32_t*>(area(areas_.slot_rows)),
                       reinterpret_cast<const float*>(area(areas_.row_weights)),
                       reinterpret_cast<int32_t*>(area(areas_.done)));
  } else if (op == kOpCombineRecv) {
    host::combine_recv(s, reinterpret_cast<const int32_t*>(area(areas_.send_dest)),
                       reinterpret_cast<const float*>(area(areas_.topk_weights)),
                       reinterpret_cast<uint16_t*>(area(areas_.out)));
  }
}

cudaError_t CudaProxy::dispatch_send(const CommView& v, TokenInput input, const void* x,
                                     const float* x_scales, const int32_t* topk_ids,
                                     const float* topk_weights, const int32_t* num_tokens,
                                     int32_t* send_dest, cudaStream_t stream) {
  const MoeDims& d = dims_;
  const size_t T = d.max_tokens, H = d.hidden, K = d.topk;
  const bool fp8_in = input == kInputFp8;
  JAX_MOE_RETURN_IF_ERROR(to_host(area(areas_.x_in), x, T * H * (fp8_in ? 1 : 2), stream));
  if (fp8_in)
    JAX_MOE_RETURN_IF_ERROR(
        to_host(area(areas_.scales_in), x_scales, T * scale_blocks(d) * 4, stream));
  JAX_MOE_RETURN_IF_ERROR(to_host(area(areas_.topk_ids), topk_ids, T * K * 4, stream));
  JAX_MOE_RETURN_IF_ERROR(to_host(area(areas_.topk_weights), topk_weights, T * K * 4, stream));
  JAX_MOE_RETURN_IF_ERROR(to_host(area(areas_.num_tokens), num_tokens, 4, stream));
  JAX_MOE_RETURN_IF_ERROR(request(v, kOpDispatchSend + input, stream));
  return to_device(send_dest, area(areas_.send_dest), T * K * 4, stream);
}

cudaError_t CudaProxy::dispatch_recv(const CommView& v, void* x, float* scales, float* weights,
                                     int32_t* group_sizes, int32_t* tokens_per_expert,
                                     int32_t* slot_rows, cudaStream_t stream) {
  const MoeDims& d = dims_;
  const size_t C = d.capacity, H = d.hidden, L = d.local_experts;
  JAX_MOE_RETURN_IF_ERROR(request(v, kOpDispatchRecv, stream));
  JAX_MOE_RETURN_IF_ERROR(to_device(x, area(areas_.x_out), C * H * (d.fp8 ? 1 : 2), stream));
  JAX_MOE_RETURN_IF_ERROR(to_device(scales, area(areas_.scales_out), C * scale_blocks(d) * 4,
                                    stream));
  JAX_MOE_RETURN_IF_ERROR(to_device(weights, area(areas_.row_weights), C * 4, stream));
  JAX_MOE_RETURN_IF_ERROR(to_device(group_sizes, area(areas_.group_sizes), L * 4, stream));
  JAX_MOE_RETURN_IF_ERROR(
      to_device(tokens_per_expert, area(areas_.tokens_per_expert), L * 4, stream));
  return to_device(slot_rows, area(areas_.slot_rows),
                   size_t(d.world) * d.max_tokens * d.topk * 4, stream);
}

cudaError_t CudaProxy::combine_send(const CommView& v, const void* y, const int32_t* slot_rows,
                                    const float* row_weights, int32_t* done,
                                    cudaStream_t stream) {
  const MoeDims& d = dims_;
  const size_t C = d.capacity;
  JAX_MOE_RETURN_IF_ERROR(to_host(area(areas_.y), y, C * d.hidden * 2, stream));
  JAX_MOE_RETURN_IF_ERROR(to_host(area(areas_.slot_rows), slot_rows,
                                  size_t(d.world) * d.max_tokens * d.topk * 4, stream));
  JAX_MOE_RETURN_IF_ERROR(to_host(area(areas_.row_weights), row_weights, C * 4, stream));
  JAX_MOE_RETURN_IF_ERROR(request(v, kOpCombineSend, stream));
  return to_device(done, area(areas_.done), 4, stream);
}

cudaError_t CudaProxy::combine_recv(const CommView& v, const int32_t* send_dest,
                                    const float* topk_weights, void* out, cudaStream_t stream) {
  const MoeDims& d = dims_;
  const size_t T = d.max_tokens, K = d.topk;
  JAX_MOE_RETURN_IF_ERROR(to_host(area(areas_.send_dest), send_dest, T * K * 4, stream));
  JAX_MOE_RETURN_IF_ERROR(to_host(area(areas_.topk_weights), topk_weights, T * K * 4, stream));
  JAX_MOE_RETURN_IF_ERROR(request(v, kOpCombineRecv, stream));
  return to_device(out, area(areas_.out), T * d.hidden * 2, stream);
}

}  // namespace jax_moe
