#include "ffi/cuda/host_proxy.h"

#include <chrono>
#include <cstring>
#include <stdexcept>
#include <string>

#include "ffi/cuda/driver.h"
#include "ffi/host/exchange.h"
#include "ffi/host/state.h"
#include "ffi/thread_names.h"

namespace jax_moe {
namespace {

// The doorbell's op byte: which CPU phase the proxy runs (ffi/host/exchange.h). A send half
// is its first phase, its kernel (cuda/proxy_rows.cuh), its second phase; in a fused op the
// send half's second phase and the receive half's first are served for one doorbell (9, 10).
// A receive half is its first phase and its kernel: its second phase (the acknowledgement)
// runs at the start of the next request, which the stream rings after the kernel read the
// rows (CudaProxy::pending_ack_), so it costs no doorbell of its own. The peers need it only
// before their next send of that kind, and every rank's next request comes before that.
enum ProxyOp : uint32_t {
  kOpDispatchSend = 1,     // order check, wait for the acknowledgements
  kOpDispatchSendEnd = 2,  // errors the kernel found, publish, post routes and rows
  kOpDispatchRecv = 3,     // wait for routes and rows, the plan of the layout
  kOpCombineSend = 5,      // order check, wait for the acknowledgements
  kOpCombineSendEnd = 6,   // publish, post rows or partials
  kOpCombineRecv = 7,      // wait for rows or partials
  kOpDispatchJoint = 9,    // kOpDispatchSendEnd, then kOpDispatchRecv
  kOpCombineJoint = 10,    // kOpCombineSendEnd, then kOpCombineRecv
};

// The ops after which a kernel reads `go`: they open a phase.
bool opens_phase(uint32_t op) { return op % 2 == 1 || op == kOpCombineJoint; }

}  // namespace

const char* proxy_op_name(uint32_t op) {
  switch (op) {
    case kOpDispatchSend: return "dispatch_send.begin";
    case kOpDispatchSendEnd: return "dispatch_send.end";
    case kOpDispatchRecv: return "dispatch_recv.begin";
    case kOpCombineSend: return "combine_send.begin";
    case kOpCombineSendEnd: return "combine_send.end";
    case kOpCombineRecv: return "combine_recv.begin";
    case kOpDispatchJoint: return "dispatch_send.end+recv.begin";
    case kOpCombineJoint: return "combine_send.end+recv.begin";
    default: return "unknown";
  }
}

namespace {

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

// The first failure of a sequence of stream operations.
#define JAX_MOE_RETURN_IF_ERROR(expr)          \
  do {                                         \
    const cudaError_t status_ = (expr);        \
    if (status_ != cudaSuccess) return status_; \
  } while (0)

// Copies a host table of `world` device addresses to its device array `device`.
void upload_table(char** device, const std::vector<char*>& host, const char* what) {
  check_cuda(cudaMemcpy(device, host.data(), sizeof(char*) * host.size(),
                        cudaMemcpyHostToDevice),
             what);
}

// The driver's cuStreamBatchMemOp (CUDA 12 ABI). Throws std::runtime_error.
decltype(&cuStreamBatchMemOp) stream_mem_ops_entry() {
  void* fn = driver_entry_point("cuStreamBatchMemOp", 12000);
  if (fn == nullptr) {
    throw std::runtime_error(
        "jax_moe cuda proxy: the CUDA driver has no cuStreamBatchMemOp for "
        "JAX_MOE_PROXY_WAIT=stream; set JAX_MOE_PROXY_WAIT=kernel");
  }
  return reinterpret_cast<decltype(&cuStreamBatchMemOp)>(fn);
}

}  // namespace

CudaProxy::Areas CudaProxy::areas_for(const MoeDims& d) {
  const size_t T = d.max_tokens, K = d.topk, R = d.world, C = d.capacity, L = d.local_experts;
  Areas a{};
  size_t next = 0;
  auto take = [&next](size_t bytes) {
    const size_t at = next;
    next = align_up(next + bytes, 64);
    return at;
  };
  a.control = take(sizeof(ProxyControl));
  a.slot_rows = take(R * T * K * 4);
  a.weights = take(C * 4);
  a.group_sizes = take(L * 4);
  a.tokens_per_expert = take(L * 4);
  a.tokens = take(R * T * 4);
  a.zero_rows = take(C * 4);
  a.send_dest = take(T * K * 4);
  a.total = next;
  return a;
}

CudaProxy::CudaProxy(const MoeDims& dims, int ordinal, uint64_t wait_ns, bool stream_wait,
                     DeviceRows device_rows)
    : dims_(dims),
      ordinal_(ordinal),
      wait_ns_(wait_ns),
      device_rows_(device_rows),
      areas_(areas_for(dims)) {
  if (stream_wait) mem_ops_ = stream_mem_ops_entry();
  try {
    constexpr unsigned kMapped = cudaHostAllocMapped | cudaHostAllocPortable;
    check_cuda(cudaHostAlloc(reinterpret_cast<void**>(&staging_), areas_.total, kMapped),
               "cudaHostAlloc(staging)");
    std::memset(staging_, 0, areas_.total);
    check_cuda(cudaHostGetDevicePointer(reinterpret_cast<void**>(&staging_device_), staging_, 0),
               "cudaHostGetDevicePointer(staging)");
    control_ = area<ProxyControl>(areas_.control);
    check_cuda(cudaHostAlloc(reinterpret_cast<void**>(&doorbell_), sizeof(ProxyDoorbell), kMapped),
               "cudaHostAlloc(doorbell)");
    std::memset(doorbell_, 0, sizeof(ProxyDoorbell));
    check_cuda(cudaHostGetDevicePointer(reinterpret_cast<void**>(&doorbell_device_), doorbell_, 0),
               "cudaHostGetDevicePointer(doorbell)");
    check_cuda(cudaMalloc(reinterpret_cast<void**>(&control_copy_), sizeof(ProxyControl)),
               "cudaMalloc(control copy)");
    check_cuda(cudaMalloc(reinterpret_cast<void**>(&scratch_), sizeof(ProxyScratch)),
               "cudaMalloc(scratch)");
    const ProxyScratch fresh{~0ull, 0};
    check_cuda(cudaMemcpy(scratch_, &fresh, sizeof(fresh), cudaMemcpyHostToDevice),
               "cudaMemcpy(scratch)");
    check_cuda(cudaMalloc(reinterpret_cast<void**>(&peers_device_), sizeof(char*) * dims.world),
               "cudaMalloc(peers)");
    check_cuda(cudaMalloc(reinterpret_cast<void**>(&rows_to_), sizeof(char*) * dims.world),
               "cudaMalloc(rows_to)");
    check_cuda(cudaMalloc(reinterpret_cast<void**>(&terms_to_), sizeof(char*) * dims.world),
               "cudaMalloc(terms_to)");
    check_cuda(cudaMalloc(reinterpret_cast<void**>(&rows_from_), sizeof(char*) * dims.world),
               "cudaMalloc(rows_from)");
    check_cuda(cudaMalloc(reinterpret_cast<void**>(&self_), self_layout(dims).total),
               "cudaMalloc(self rows)");
  } catch (...) {
    cudaFree(self_);
    cudaFree(rows_to_);
    cudaFree(terms_to_);
    cudaFree(rows_from_);
    cudaFree(peers_device_);
    cudaFree(scratch_);
    cudaFree(control_copy_);
    if (doorbell_) cudaFreeHost(doorbell_);
    if (staging_) cudaFreeHost(staging_);
    throw;
  }
}

void CudaProxy::stop() {
  stop_.store(true);
  if (thread_.joinable()) thread_.join();
  // No kernel may use the mappings when they go; the host memory itself is freed later, with
  // the host rank state.
  cudaSetDevice(ordinal_);
  cudaDeviceSynchronize();
  for (void* memory : registered_) cudaHostUnregister(memory);
  registered_.clear();
  cudaGetLastError();
}

CudaProxy::~CudaProxy() {
  stop();
  device_staging_.reset();
  cudaFree(self_);
  cudaFree(rows_to_);
  cudaFree(terms_to_);
  cudaFree(rows_from_);
  cudaFree(peers_device_);
  cudaFree(scratch_);
  cudaFree(control_copy_);
  cudaFreeHost(doorbell_);
  cudaFreeHost(staging_);
}

void CudaProxy::register_host(void* memory, size_t bytes) {
  check_cuda(cudaHostRegister(memory, bytes, cudaHostRegisterMapped | cudaHostRegisterPortable),
             "cudaHostRegister");
  registered_.push_back(memory);
}

const DeviceStaging& CudaProxy::stage_remote_rows(const std::vector<int>& remote_ranks) {
  if (!device_rows_.remote || device_staging_ || thread_.joinable())
    throw std::invalid_argument("jax_moe cuda proxy: device staging copies are made once, "
                                "before the proxy starts, for ranks with remote device rows");
  check_cuda(cudaSetDevice(ordinal_), "cudaSetDevice");
  device_staging_ = std::make_unique<DeviceStaging>(dims_, int(remote_ranks.size()));
  staged_ranks_ = remote_ranks;
  return *device_staging_;
}

void CudaProxy::start(host::HostRankState* host_state, char* device_buffer,
                      const std::vector<char*>& near_table) {
  if (thread_.joinable()) throw std::invalid_argument("jax_moe cuda proxy: already started");
  if (host_state == nullptr || !host_state->connected)
    throw std::invalid_argument("jax_moe cuda proxy: the host rank state must be connected first");
  if ((device_rows_.near || device_rows_.remote) != (device_buffer != nullptr) ||
      (!near_table.empty() && int(near_table.size()) != dims_.world))
    throw std::invalid_argument("jax_moe cuda proxy: the device rows buffer or table does not "
                                "match the rank's DeviceRows");
  check_cuda(cudaSetDevice(ordinal_), "cudaSetDevice");
  // The kernels address every rank's host buffer by its host address, which needs registered
  // memory mapped at the same address: this rank's, its mappings of the near ranks' buffers
  // (other processes of its host), its staging copies of the remote ranks' (the other local
  // ranks' proxies register theirs).
  int same_address = 0;
  check_cuda(cudaDeviceGetAttribute(&same_address, cudaDevAttrCanUseHostPointerForRegisteredMem,
                                    ordinal_),
             "cudaDeviceGetAttribute");
  if (!same_address)
    throw std::runtime_error("jax_moe cuda proxy: the device cannot address registered host "
                             "memory by its host pointer");
  register_host(host_state->storage.data(), host_state->storage.bytes());
  for (const host::MappedPages& near : host_state->near) {
    if (near.data() != nullptr) register_host(near.data(), near.bytes());
  }
  if (host_state->remote != nullptr) {
    for (const auto& [memory, bytes] : host_state->remote->staging_memory())
      register_host(memory, bytes);
  }
  buffer_device_ = host_state->buffer;
  upload_table(peers_device_, host_state->peers, "cudaMemcpy(peers)");
  // Where the rows to and from each rank go (ProxyRowsView): the mapped device buffers of
  // near ranks; with remote device rows, this rank's device staging copy of a rank on
  // another host and its own device buffer (the TransferEngines move the rows between them,
  // host_remote.py connects them); host memory for the rest.
  std::vector<char*> to(host_state->peers), from(dims_.world, host_state->buffer);
  for (int p = 0; p < dims_.world; ++p) {
    if (!near_table.empty() && near_table[p] != nullptr) {
      to[p] = near_table[p];
      from[p] = device_buffer;
    }
  }
  std::vector<char*> terms(to);
  for (size_t i = 0; i < staged_ranks_.size(); ++i) {
    const int p = staged_ranks_[i];
    to[p] = device_staging_->layout_base(int(i), 0);
    terms[p] = device_staging_->layout_base(int(i), 1);
    from[p] = device_buffer;
  }
  upload_table(rows_to_, to, "cudaMemcpy(rows_to)");
  upload_table(terms_to_, terms, "cudaMemcpy(terms_to)");
  upload_table(rows_from_, from, "cudaMemcpy(rows_from)");
  if (device_rows_.remote) {
    int options = 0;
    check_cuda(cudaDeviceGetAttribute(&options, cudaDevAttrGPUDirectRDMAFlushWritesOptions,
                                      ordinal_),
               "cudaDeviceGetAttribute(GPUDirectRDMAFlushWritesOptions)");
    flush_remote_writes_ = (options & cudaFlushGPUDirectRDMAWritesOptionHost) != 0;
  }
  host_ = host_state;
  thread_ = std::thread([this] { run(); });
  name_thread(thread_, kHostProxyThreadName);
}

bool CudaProxy::timed_out() const { return host_ != nullptr && host_->timed_out.load(); }

std::vector<ProxySample> CudaProxy::take_samples() {
  std::lock_guard<std::mutex> lock(samples_mutex_);
  std::vector<ProxySample> out;
  out.swap(samples_);
  return out;
}

cudaError_t CudaProxy::request(const CommView& v, uint32_t op, cudaStream_t stream) {
  if (mem_ops_ == nullptr) return launch_proxy_request(v, doorbell_device_, op, wait_ns_, stream);
  if (op > 0xff) return cudaErrorInvalidValue;
  // Clear the answer, ring, wait for the answer: one batch, in order, each write after every
  // earlier operation of the stream (the default flags: a memory barrier before the write).
  // The wait has no timeout of its own: the proxy answers every request it takes, its waits
  // bounded by the host exchange's timeout (failures included: control_->go then stays 0).
  CUstreamBatchMemOpParams ops[3] = {};
  ops[0].writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_32;
  ops[0].writeValue.address = reinterpret_cast<CUdeviceptr>(&doorbell_device_->answered);
  ops[0].writeValue.value = 0;
  ops[1].writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_32;
  ops[1].writeValue.address = reinterpret_cast<CUdeviceptr>(&doorbell_device_->request);
  ops[1].writeValue.value = kProxyRung | op;
  ops[2].waitValue.operation = CU_STREAM_MEM_OP_WAIT_VALUE_32;
  ops[2].waitValue.address = reinterpret_cast<CUdeviceptr>(&doorbell_device_->answered);
  ops[2].waitValue.value = 1;
  ops[2].waitValue.flags = CU_STREAM_WAIT_VALUE_EQ;
  const CUresult status = mem_ops_(stream, 3, ops, 0);
  return status == CUDA_SUCCESS                ? cudaSuccess
         : status == CUDA_ERROR_NOT_SUPPORTED ? cudaErrorNotSupported
                                              : cudaErrorUnknown;
}

cudaError_t CudaProxy::begin(const CommView& v, uint32_t op, cudaStream_t stream) {
  JAX_MOE_RETURN_IF_ERROR(request(v, op, stream));
  return cudaMemcpyAsync(control_copy_, control_, sizeof(ProxyControl), cudaMemcpyHostToDevice,
                         stream);
}

ProxyRowsView CudaProxy::rows_view(const CommView& v) const {
  ProxyRowsView r{};
  r.dims = dims_;
  r.peers = peers_device_;
  r.buffer = buffer_device_;
  r.rows_to = rows_to_;
  r.terms_to = terms_to_;
  r.rows_from = rows_from_;
  r.self = self_;
  r.control = device_area<ProxyControl>(areas_.control);
  r.control_copy = control_copy_;
  r.scratch = scratch_;
  r.aborted = &v.counters->aborted;
  r.slot_rows = device_area<int32_t>(areas_.slot_rows);
  r.weights = device_area<float>(areas_.weights);
  r.group_sizes = device_area<int32_t>(areas_.group_sizes);
  r.tokens_per_expert = device_area<int32_t>(areas_.tokens_per_expert);
  r.tokens = device_area<int32_t>(areas_.tokens);
  r.zero_rows = device_area<int32_t>(areas_.zero_rows);
  return r;
}

void CudaProxy::run() {
  cudaSetDevice(ordinal_);  // for the flush of remote writes (serve)
  int64_t answered_at = -1;
  auto last_request = Clock::now();
  while (!stop_.load(std::memory_order_relaxed)) {
    const uint32_t request = __atomic_load_n(&doorbell_->request, __ATOMIC_ACQUIRE);
    if (!(request & kProxyRung)) {
      if (Clock::now() - last_request > kHotPoll) std::this_thread::sleep_for(kIdlePoll);
      else __builtin_ia32_pause();
      continue;
    }
    const int64_t seen = now_ns();
    const uint32_t op = request & 0xff;
    // Taken: the stream rings the next request only after this one's answer.
    __atomic_store_n(&doorbell_->request, 0u, __ATOMIC_RELAXED);
    host_->first_post_ns = 0;
    try {
      serve(op);
    } catch (...) {
      // The exchange turns transport failures into TIMEOUT; what may still throw here is an
      // allocation (or anything else: an exception must not end the thread, or the stream
      // would wait for an answer that never comes). The ranks' sequences then no longer
      // agree, so the rank is broken as after a timeout, and the stream still gets its answer
      // (control_->go stays 0).
      host_->record_error(kTimeout, kStageProxy, host_->dims.rank);
      host_->timed_out = true;
    }
    __atomic_store_n(&doorbell_->answered, 1u, __ATOMIC_RELEASE);
    const int64_t finished = now_ns();
    last_request = Clock::now();
    const int64_t first_post = host_->first_post_ns;
    std::lock_guard<std::mutex> lock(samples_mutex_);
    if (samples_.size() < kMaxSamples)
      samples_.push_back({op, first_post ? first_post - seen : -1, finished - seen,
                          answered_at < 0 ? -1 : seen - answered_at});
    answered_at = finished;
  }
}

void CudaProxy::serve(uint32_t op) {
  host::HostRankState& s = *host_;
  ProxyControl& c = *control_;
  // The previous receive half's acknowledgement: its kernel is done reading the rows.
  const Ack ack = pending_ack_;
  pending_ack_ = Ack::kNone;
  if (ack == Ack::kDispatch) host::dispatch_recv_end(s);
  if (ack == Ack::kCombine) host::combine_recv_end(s);
  // A closing phase runs only when its half's opening phase succeeded.
  const bool opened = phase_ok_;
  if (opens_phase(op)) {  // `go` stays 0 unless this phase succeeds (also when it throws)
    c.go = 0;
    phase_ok_ = false;
  }
  // The send halves' closing phases, alone or joined with the receive half's opening.
  if (opened && (op == kOpDispatchSendEnd || op == kOpDispatchJoint))
    host::dispatch_send_end(s, c.given_tokens, c.first_bad != ~0ull,
                            static_cast<int32_t>(c.first_bad & 0xffffffffu));
  if (opened && (op == kOpCombineSendEnd || op == kOpCombineJoint))
    host::combine_send_end(s, area<int32_t>(areas_.slot_rows));
  switch (op) {
    case kOpDispatchSend:
      phase_ok_ = host::dispatch_send_begin(s);
      break;
    case kOpDispatchRecv:
    case kOpDispatchJoint: {
      host::RecvPlan plan{area<int32_t>(areas_.slot_rows), area<float>(areas_.weights),
                          area<int32_t>(areas_.group_sizes),
                          area<int32_t>(areas_.tokens_per_expert), area<int32_t>(areas_.tokens),
                          area<int32_t>(areas_.zero_rows)};
      phase_ok_ = host::dispatch_recv_begin(s, plan);
      c.token_count = plan.token_count;
      c.zero_count = plan.zero_count;
      if (phase_ok_) pending_ack_ = Ack::kDispatch;
      break;
    }
    case kOpCombineSend:
      phase_ok_ = host::combine_send_begin(s);
      break;
    case kOpCombineRecv:
    case kOpCombineJoint:
      phase_ok_ = host::combine_recv_begin(s, area<int32_t>(areas_.send_dest));
      if (phase_ok_) pending_ack_ = Ack::kCombine;
      break;
    default:  // the send halves' closing phases ran above
      break;
  }
  // Rows written into the device buffer by a NIC (GPUDirect RDMA) are visible to the next
  // kernel only after a flush where the device asks for one; the receive half's kernel reads
  // them after this answer: when a receive half's first phase succeeded, which owes its
  // acknowledgement now. (A failure breaks the rank: run() records it.)
  if (pending_ack_ != Ack::kNone && flush_remote_writes_)
    check_cuda(cudaDeviceFlushGPUDirectRDMAWrites(cudaFlushGPUDirectRDMAWritesTargetCurrentDevice,
                                                  cudaFlushGPUDirectRDMAWritesToOwner),
               "cudaDeviceFlushGPUDirectRDMAWrites");
  if (opens_phase(op)) c.go = phase_ok_ ? 1 : 0;
}

cudaError_t CudaProxy::dispatch_send(const CommView& v, TokenInput input, const void* x,
                                     const float* x_scales, const int32_t* topk_ids,
                                     const float* topk_weights, const int32_t* num_tokens,
                                     int32_t* send_dest, Joint joint, cudaStream_t stream) {
  JAX_MOE_RETURN_IF_ERROR(begin(v, kOpDispatchSend, stream));
  JAX_MOE_RETURN_IF_ERROR(launch_proxy_dispatch_send(rows_view(v), input, x, x_scales, topk_ids,
                                                     topk_weights, num_tokens, send_dest,
                                                     stream));
  return joint == Joint::kAlone ? request(v, kOpDispatchSendEnd, stream) : cudaSuccess;
}

cudaError_t CudaProxy::dispatch_recv(const CommView& v, void* x, float* scales, float* weights,
                                     int32_t* group_sizes, int32_t* tokens_per_expert,
                                     int32_t* slot_rows, Joint joint, cudaStream_t stream) {
  JAX_MOE_RETURN_IF_ERROR(
      begin(v, joint == Joint::kAlone ? kOpDispatchRecv : kOpDispatchJoint, stream));
  return launch_proxy_dispatch_recv(rows_view(v), x, scales, weights, group_sizes,
                                    tokens_per_expert, slot_rows, stream);
}

cudaError_t CudaProxy::combine_send(const CommView& v, const void* y, const int32_t* slot_rows,
                                    const float* row_weights, int32_t* done, Joint joint,
                                    cudaStream_t stream) {
  JAX_MOE_RETURN_IF_ERROR(begin(v, kOpCombineSend, stream));
  JAX_MOE_RETURN_IF_ERROR(
      launch_proxy_combine_send(rows_view(v), y, slot_rows, row_weights, done, stream));
  return joint == Joint::kAlone ? request(v, kOpCombineSendEnd, stream) : cudaSuccess;
}

cudaError_t CudaProxy::combine_recv(const CommView& v, const int32_t* send_dest,
                                    const float* topk_weights, void* out, Joint joint,
                                    cudaStream_t stream) {
  // The CPU's wait counts the writes each expert rank posts, which follow from send_dest
  // [T, K]: the one per-slot copy to the host.
  JAX_MOE_RETURN_IF_ERROR(cudaMemcpyAsync(area<int32_t>(areas_.send_dest), send_dest,
                                          size_t(dims_.max_tokens) * dims_.topk * 4,
                                          cudaMemcpyDeviceToHost, stream));
  JAX_MOE_RETURN_IF_ERROR(
      begin(v, joint == Joint::kAlone ? kOpCombineRecv : kOpCombineJoint, stream));
  return launch_proxy_combine_recv(rows_view(v), send_dest, topk_weights, out, stream);
}

}  // namespace jax_moe
