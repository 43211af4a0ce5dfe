// Allocation, peer mapping and teardown of the per-device state (see state.h).
#include "ffi/cuda/state.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <utility>

#include "ffi/host/state.h"
#include "ffi/protocol/nvlink_layout.h"
#include "ffi/protocol/stage_clock.h"

namespace jax_moe {
namespace {

using Key = std::pair<int64_t, int>;  // (comm id, device ordinal)

std::mutex registry_mutex;
std::map<Key, std::unique_ptr<CudaRankState>>& registry() {
  static auto* states = new std::map<Key, std::unique_ptr<CudaRankState>>();
  return *states;
}

void check_cuda(cudaError_t status, const char* what) {
  if (status != cudaSuccess)
    throw std::runtime_error(std::string("jax_moe cuda backend: ") + what + " failed: " +
                             cudaGetErrorString(status));
}

std::string key_text(int64_t comm_id, int ordinal) {
  return "comm_id=" + std::to_string(comm_id) + ", device ordinal=" + std::to_string(ordinal);
}

CudaRankState& lookup(int64_t comm_id, int ordinal) {
  auto it = registry().find({comm_id, ordinal});
  if (it == registry().end())
    throw std::invalid_argument("jax_moe cuda backend: no rank state for " +
                                key_text(comm_id, ordinal));
  return *it->second;
}

void validate_dims(const MoeDims& d) {
  auto fail = [](const std::string& text) {
    throw std::invalid_argument("Communicator(backend='cuda'): " + text);
  };
  if (d.world < 1 || d.world > 64) fail("axis size must be in [1, 64], got " + std::to_string(d.world));
  if (d.rank < 0 || d.rank >= d.world) fail("rank out of range: " + std::to_string(d.rank));
  if (d.topk < 1 || d.topk > 32)
    fail("MoEConfig.experts_per_token must be in [1, 32], got " + std::to_string(d.topk));
  if (d.hidden % (d.fp8 ? 16 : 8))
    fail("MoEConfig.hidden must be a multiple of " + std::string(d.fp8 ? "16" : "8") + ", got " +
         std::to_string(d.hidden));
  if (d.fp8) {
    const int chunks = d.block_size / 8;
    if (d.block_size % 8 || (chunks & (chunks - 1)) || d.hidden % d.block_size)
      fail("MoEConfig.block_size must be 8 times a power of two dividing hidden, got " +
           std::to_string(d.block_size));
  }
  if (d.local_experts * d.world != d.num_experts) fail("num_experts must be divisible by the axis size");
}

// What only the NVLink kernels need (the host proxies keep the host protocol's limits).
void validate_nvlink(const MoeDims& d, int chunks) {
  auto fail = [](const std::string& text) {
    throw std::invalid_argument("Communicator(backend='cuda'): " + text);
  };
  if (chunks < 1 || chunks > 4096)
    fail("MoEConfig.num_sms must be in [1, 4096], got " + std::to_string(chunks));
  if (d.fp8 && d.block_size > 2048)
    fail("MoEConfig.block_size must be <= 2048 for fp8 dispatch, got " +
         std::to_string(d.block_size));
  if (route_warps(d) < 1 || place_smem_bytes(d) > kExchangeSmem)
    fail("MoEConfig.num_experts too large for one block's shared memory (at most " +
         std::to_string(kExchangeSmem / 4) + "), got " + std::to_string(d.num_experts));
  // A slot's code is rank * L + e with rank < T * K (ffi/protocol/nvlink_layout.h), in an int32.
  if (double(d.max_tokens) * d.topk * d.local_experts >= 2147483647.0)
    fail("max_tokens * experts_per_token * local experts must be below 2^31");
}

void free_state(CudaRankState& s) {
  // Best effort: teardown must not throw half-way; the device is synchronized first so no
  // kernel still uses the memory.
  cudaSetDevice(s.ordinal);
  cudaDeviceSynchronize();
  s.proxy.reset();  // stops its thread before the host rank state it serves can go
  for (char* p : s.peers.ipc_opened) cudaIpcCloseMemHandle(p);
  cudaFree(s.peers.table_device);
  cudaFree(s.peers.local);
  if (s.nvlink) {
    cudaFree(s.nvlink->chunk_seq);
    cudaFree(s.nvlink->stage_clock);
  }
  cudaFree(s.counters);
  if (s.error_host) cudaFreeHost(s.error_host);
  cudaGetLastError();
}

void check_timeout(double timeout_s) {
  if (!(timeout_s > 0)) throw std::invalid_argument("JAX_MOE_TIMEOUT_S must be positive");
}

// Allocates what every kind of state has (counters, error record), then the feature's part
// (`feature(s)`), and registers the state; frees everything when any step throws.
template <typename Feature>
void create_state(std::unique_ptr<CudaRankState> state, Feature feature) {
  CudaRankState& s = *state;
  std::lock_guard<std::mutex> lock(registry_mutex);
  if (registry().count({s.comm_id, s.ordinal}))
    throw std::invalid_argument("jax_moe cuda backend: rank state exists for " +
                                key_text(s.comm_id, s.ordinal));
  try {
    check_cuda(cudaSetDevice(s.ordinal), "cudaSetDevice");
    check_cuda(cudaMalloc(&s.counters, sizeof(DeviceCounters)), "cudaMalloc(counters)");
    check_cuda(cudaMemset(s.counters, 0, sizeof(DeviceCounters)), "cudaMemset(counters)");
    check_cuda(cudaHostAlloc(&s.error_host, sizeof(ErrorRecord),
                             cudaHostAllocMapped | cudaHostAllocPortable),
               "cudaHostAlloc(error record)");
    std::memset(s.error_host, 0, sizeof(ErrorRecord));
    check_cuda(cudaHostGetDevicePointer(reinterpret_cast<void**>(&s.error_device), s.error_host, 0),
               "cudaHostGetDevicePointer(error record)");
    feature(s);
    check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  } catch (...) {
    free_state(s);
    throw;
  }
  registry()[{s.comm_id, s.ordinal}] = std::move(state);
}

// The buffer every peer maps ([bytes], zeroed) and the device's table of the peers' buffers
// (filled by connect_rank_state).
void alloc_peer_buffers(CudaRankState& s, size_t bytes) {
  check_cuda(cudaMalloc(&s.peers.local, bytes), "cudaMalloc(communication buffer)");
  check_cuda(cudaMemset(s.peers.local, 0, bytes), "cudaMemset(communication buffer)");
  check_cuda(cudaMalloc(&s.peers.table_device, sizeof(char*) * s.dims.world),
             "cudaMalloc(peer table)");
}

// A state whose rank has a buffer the peers map (not a proxy rank), or throws naming `what`.
CudaRankState& buffer_rank(int64_t comm_id, int ordinal, const char* what) {
  CudaRankState& s = lookup(comm_id, ordinal);
  if (s.peers.local == nullptr)
    throw std::invalid_argument(std::string("jax_moe cuda backend: ") + what +
                                ": the rank has no buffer its peers map (a host proxy rank): " +
                                key_text(comm_id, ordinal));
  return s;
}

std::unique_ptr<CudaRankState> new_state(int64_t comm_id, int ordinal, const MoeDims& dims,
                                         double timeout_s) {
  auto state = std::make_unique<CudaRankState>();
  state->comm_id = comm_id;
  state->ordinal = ordinal;
  state->dims = dims;
  state->timeout_ns = static_cast<uint64_t>(timeout_s * 1e9);
  return state;
}

}  // namespace

CommView CudaRankState::view() const {
  CommView v;
  v.dims = dims;
  v.local = peers.local;
  v.peers = peers.table_device;
  v.counters = counters;
  v.error = error_device;
  v.chunk_seq = nvlink ? nvlink->chunk_seq : nullptr;
  v.stage_clock = nvlink ? nvlink->stage_clock : nullptr;
  v.timeout_ns = timeout_ns;
  v.chunks = nvlink ? nvlink->chunks : 1;
  v.grid = nvlink ? nvlink->grid : 1;
  return v;
}

int32_t CudaRankState::pending_error() const {
  return *reinterpret_cast<volatile int32_t*>(&error_host->code);
}

void create_rank_state(int64_t comm_id, int ordinal, const MoeDims& dims, int chunks,
                       double timeout_s, bool stage_clocks) {
  validate_dims(dims);
  validate_nvlink(dims, chunks);
  check_timeout(timeout_s);
  create_state(new_state(comm_id, ordinal, dims, timeout_s), [=](CudaRankState& s) {
    int sms = 0;
    check_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, s.ordinal),
               "cudaDeviceGetAttribute(multiProcessorCount)");
    s.nvlink = std::make_unique<NvlinkExchange>();
    NvlinkExchange& n = *s.nvlink;
    n.chunks = chunks;
    n.grid = std::max(1, std::min(chunks, sms));
    const int route_parts = route_blocks(s.dims, chunks);
    if (n.grid < route_parts)
      throw std::invalid_argument(
          "Communicator(backend='cuda'): MoEConfig.num_sms (" + std::to_string(chunks) +
          ") needs at least " + std::to_string(route_parts) + " SMs on device " +
          std::to_string(s.ordinal) + ", which has " + std::to_string(sms));
    alloc_peer_buffers(s, nvlink_layout(s.dims, chunks).total);
    const size_t bytes = sizeof(uint64_t) * kChunkCounters * chunks;
    check_cuda(cudaMalloc(&n.chunk_seq, bytes), "cudaMalloc(chunk sequences)");
    check_cuda(cudaMemset(n.chunk_seq, 0, bytes), "cudaMemset(chunk sequences)");
    if (stage_clocks) {
      const size_t clock_bytes = sizeof(uint64_t) * kClockKernels * n.grid * kClockMarks;
      check_cuda(cudaMalloc(&n.stage_clock, clock_bytes), "cudaMalloc(stage clocks)");
      check_cuda(cudaMemset(n.stage_clock, 0, clock_bytes), "cudaMemset(stage clocks)");
    }
  });
}

void create_all_reduce_state(int64_t comm_id, int ordinal, int rank, int world, int64_t max_bytes,
                             double timeout_s) {
  if (world < 1 || world > 64)
    throw std::invalid_argument("AllReduce: axis size must be in [1, 64], got " +
                                std::to_string(world));
  if (rank < 0 || rank >= world)
    throw std::invalid_argument("AllReduce: rank out of range: " + std::to_string(rank));
  if (max_bytes < 1)
    throw std::invalid_argument("AllReduce: max_bytes must be positive, got " +
                                std::to_string(max_bytes));
  check_timeout(timeout_s);
  MoeDims dims{};
  dims.world = world;
  dims.rank = rank;
  create_state(new_state(comm_id, ordinal, dims, timeout_s), [=](CudaRankState& s) {
    s.all_reduce = std::make_unique<AllReduceRank>();
    s.all_reduce->layout = all_reduce_layout(world, size_t(max_bytes));
    alloc_peer_buffers(s, s.all_reduce->layout.total);
  });
}

void create_proxy_rank_state(int64_t comm_id, int ordinal, const MoeDims& dims, double timeout_s,
                             bool stream_wait, DeviceRows device_rows) {
  validate_dims(dims);
  check_timeout(timeout_s);
  // The host exchange of one request may wait twice (for the peers' acknowledgement, then
  // for its own writes), each bounded by timeout_s; the stream waits longer than that, so a
  // peer's timeout is reported by the host exchange, naming the peer, and only a stuck proxy
  // by the stream's wait.
  const uint64_t wait_ns = static_cast<uint64_t>((3 * timeout_s + 1) * 1e9);
  create_state(new_state(comm_id, ordinal, dims, timeout_s),
               [wait_ns, stream_wait, device_rows](CudaRankState& s) {
    s.proxy = std::make_unique<CudaProxy>(s.dims, s.ordinal, wait_ns, stream_wait, device_rows);
    if (device_rows.near || device_rows.remote) {
      alloc_peer_buffers(s, buffer_layout(s.dims).total);
      // No rank's rows come through a mapping until connect_rank_state maps the near ones.
      check_cuda(cudaMemset(s.peers.table_device, 0, sizeof(char*) * s.dims.world),
                 "cudaMemset(peer table)");
    }
  });
}

RemoteDeviceRows stage_remote_device_rows(int64_t comm_id, int ordinal,
                                          const std::vector<int>& remote_ranks) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  CudaRankState& s = lookup(comm_id, ordinal);
  if (!s.proxy || !s.proxy->device_rows().remote)
    throw std::invalid_argument("jax_moe cuda backend: " + key_text(comm_id, ordinal) +
                                " is not a proxy rank whose remote rows stay in device memory");
  for (size_t i = 0; i < remote_ranks.size(); ++i) {
    if (remote_ranks[i] < 0 || remote_ranks[i] >= s.dims.world ||
        remote_ranks[i] == s.dims.rank || (i > 0 && remote_ranks[i] <= remote_ranks[i - 1]))
      throw std::invalid_argument("jax_moe cuda backend: remote ranks must be other ranks in "
                                  "[0, " + std::to_string(s.dims.world) + "), ascending");
  }
  const DeviceStaging& staging = s.proxy->stage_remote_rows(remote_ranks);
  RemoteDeviceRows out{s.peers.local, {}};
  for (size_t i = 0; i < remote_ranks.size(); ++i) {
    std::vector<char*> ranges;
    for (int r = 0; r < DeviceStaging::kRanges; ++r) ranges.push_back(staging.range(int(i), r));
    out.staging.push_back(ranges);
  }
  return out;
}

void start_rank_proxy(int64_t comm_id, int ordinal) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  CudaRankState& s = lookup(comm_id, ordinal);
  if (!s.proxy)
    throw std::invalid_argument("jax_moe cuda backend: not a proxy rank: " +
                                key_text(comm_id, ordinal));
  if (s.proxy->device_rows().near && !s.connected)
    throw std::invalid_argument("jax_moe cuda backend: the device rows of " +
                                key_text(comm_id, ordinal) +
                                " are not mapped yet (cuda_connect_rank before the proxy)");
  s.proxy->start(host::find_host_rank(comm_id, ordinal), s.peers.local, s.peers.table);
  s.connected = true;
}

void stop_rank_proxy(int64_t comm_id, int ordinal) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  auto it = registry().find({comm_id, ordinal});
  if (it != registry().end() && it->second->proxy) it->second->proxy->stop();
}

std::vector<ProxySample> take_proxy_samples(int64_t comm_id, int ordinal) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  CudaRankState& s = lookup(comm_id, ordinal);
  if (!s.proxy) return {};
  return s.proxy->take_samples();
}

std::string rank_ipc_handle(int64_t comm_id, int ordinal) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  CudaRankState& s = buffer_rank(comm_id, ordinal, "rank_ipc_handle");
  check_cuda(cudaSetDevice(ordinal), "cudaSetDevice");
  cudaIpcMemHandle_t handle;
  check_cuda(cudaIpcGetMemHandle(&handle, s.peers.local), "cudaIpcGetMemHandle");
  return std::string(reinterpret_cast<const char*>(&handle), sizeof(handle));
}

void connect_rank_state(int64_t comm_id, int ordinal, const std::vector<int>& local_ordinals,
                        const std::vector<std::string>& ipc_handles) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  CudaRankState& s = buffer_rank(comm_id, ordinal, "connect");
  const int R = s.dims.world;
  if (s.connected) throw std::invalid_argument("jax_moe cuda backend: already connected: " + key_text(comm_id, ordinal));
  if (int(local_ordinals.size()) != R || int(ipc_handles.size()) != R)
    throw std::invalid_argument("jax_moe cuda backend: connect needs one entry per rank (" +
                                std::to_string(R) + ")");
  check_cuda(cudaSetDevice(ordinal), "cudaSetDevice");
  std::vector<char*> peers(R, nullptr);
  for (int p = 0; p < R; ++p) {
    if (p == s.dims.rank) {
      peers[p] = s.peers.local;
    } else if (local_ordinals[p] >= 0) {
      CudaRankState& other = buffer_rank(comm_id, local_ordinals[p], "connect (a local peer)");
      int can = 0;
      check_cuda(cudaDeviceCanAccessPeer(&can, ordinal, other.ordinal), "cudaDeviceCanAccessPeer");
      if (!can)
        throw std::runtime_error("jax_moe cuda backend: device " + std::to_string(ordinal) +
                                 " cannot access device " + std::to_string(other.ordinal) +
                                 " (no peer access)");
      const cudaError_t status = cudaDeviceEnablePeerAccess(other.ordinal, 0);
      if (status == cudaErrorPeerAccessAlreadyEnabled) cudaGetLastError();
      else check_cuda(status, "cudaDeviceEnablePeerAccess");
      peers[p] = other.peers.local;
    } else if (s.proxy && ipc_handles[p].empty()) {
      peers[p] = nullptr;  // a rank on another host: its rows come through the host buffer
    } else {
      if (ipc_handles[p].size() != sizeof(cudaIpcMemHandle_t))
        throw std::invalid_argument("jax_moe cuda backend: IPC handle of rank " +
                                    std::to_string(p) + " must be " +
                                    std::to_string(sizeof(cudaIpcMemHandle_t)) + " bytes");
      cudaIpcMemHandle_t handle;
      std::memcpy(&handle, ipc_handles[p].data(), sizeof(handle));
      void* mapped = nullptr;
      check_cuda(cudaIpcOpenMemHandle(&mapped, handle, cudaIpcMemLazyEnablePeerAccess),
                 "cudaIpcOpenMemHandle");
      s.peers.ipc_opened.push_back(static_cast<char*>(mapped));
      peers[p] = static_cast<char*>(mapped);
    }
  }
  check_cuda(cudaMemcpy(s.peers.table_device, peers.data(), sizeof(char*) * R,
                        cudaMemcpyHostToDevice),
             "cudaMemcpy(peer table)");
  s.peers.table = peers;
  s.connected = true;
}

bool take_rank_error(int64_t comm_id, int ordinal, ErrorRecord* out) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  CudaRankState& s = lookup(comm_id, ordinal);
  volatile ErrorRecord* e = s.error_host;
  if (e->code == 0) return false;
  out->code = e->code;
  out->stage = e->stage;
  out->rank = e->rank;
  out->detail = e->detail;
  if (out->code == kTimeout) s.timed_out = true;
  // Clear: the record first, then the device claim, so a later error can be recorded.
  e->stage = e->rank = e->detail = 0;
  e->code = 0;
  check_cuda(cudaSetDevice(ordinal), "cudaSetDevice");
  const int32_t unclaimed = 0;
  check_cuda(cudaMemcpy(&s.counters->error_claimed, &unclaimed, sizeof(int32_t),
                        cudaMemcpyHostToDevice),
             "cudaMemcpy(error claim)");
  return true;
}

std::vector<uint64_t> read_stage_clocks(int64_t comm_id, int ordinal, int* grid) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  CudaRankState& s = lookup(comm_id, ordinal);
  *grid = s.nvlink ? s.nvlink->grid : 1;
  if (!s.nvlink || s.nvlink->stage_clock == nullptr) return {};
  std::vector<uint64_t> out(size_t(kClockKernels) * s.nvlink->grid * kClockMarks);
  check_cuda(cudaSetDevice(ordinal), "cudaSetDevice");
  check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  check_cuda(cudaMemcpy(out.data(), s.nvlink->stage_clock, out.size() * sizeof(uint64_t),
                        cudaMemcpyDeviceToHost),
             "cudaMemcpy(stage clocks)");
  return out;
}

void destroy_rank_state(int64_t comm_id, int ordinal) {
  std::unique_ptr<CudaRankState> state;
  {
    std::lock_guard<std::mutex> lock(registry_mutex);
    auto it = registry().find({comm_id, ordinal});
    if (it == registry().end()) return;
    state = std::move(it->second);
    registry().erase(it);
  }
  free_state(*state);
}

CudaRankState* find_rank_state(int64_t comm_id, int ordinal) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  auto it = registry().find({comm_id, ordinal});
  return it == registry().end() ? nullptr : it->second.get();
}

}  // namespace jax_moe
