// Per-device state of the CUDA backend: one rank of one communicator (a MoE Communicator or
// an AllReduce) on one local GPU. Created and connected from Python (ffi/cuda/bindings.cc)
// outside jit; looked up by the FFI handlers by (comm id, device ordinal), from XLA's per-GPU
// threads. Every kind has the counters and the error record; the rest is the part of its
// feature (NVLink exchange, host proxy, all-reduce).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "cuda/comm_view.cuh"
#include "ffi/cuda/host_proxy.h"
#include "ffi/protocol/all_reduce_layout.h"

namespace jax_moe {

// The parts of a rank state, one per feature, which CudaRankState holds.

// The buffer every peer maps (NVLink exchange and AllReduce ranks, and proxy ranks whose
// same-host rows stay in device memory): this rank's buffer, and every rank's buffer as this
// device addresses it (null for a proxy rank's ranks on other hosts).
struct PeerBuffers {
  char* local = nullptr;           // this rank's buffer (nvlink_layout or all_reduce_layout)
  char** table_device = nullptr;   // device array [R] of every rank's buffer, mapped here
  std::vector<char*> table;        // the same on the host (empty until connected)
  std::vector<char*> ipc_opened;   // buffers of ranks in other processes, through CUDA IPC
};

// The NVLink dispatch/combine of a MoE rank (ffi/protocol/nvlink_layout.h).
struct NvlinkExchange {
  int chunks = 1;                  // token chunks of the protocol (the same on every rank)
  int grid = 1;                    // blocks per dispatch/combine launch, <= chunks
  uint64_t* chunk_seq = nullptr;   // device [kChunkCounters][chunks]
  uint64_t* stage_clock = nullptr; // device, ffi/protocol/stage_clock.h; null unless asked for
};

// An AllReduce rank: its buffer's layout and, where NVLS was set up (ffi/cuda/multicast.h;
// never where multicast is refused), this rank's mapping of the multicast region and its own
// copy of it.
struct AllReduceRank {
  AllReduceLayout layout{};
  char* multicast = nullptr;
  char* multicast_local = nullptr;
};

struct CudaRankState {
  int64_t comm_id = 0;
  int ordinal = 0;
  MoeDims dims{};                         // an AllReduce sets only world and rank
  uint64_t timeout_ns = 0;
  DeviceCounters* counters = nullptr;     // device memory
  ErrorRecord* error_host = nullptr;      // mapped pinned host memory
  ErrorRecord* error_device = nullptr;    // the same record as the kernels address it
  bool connected = false;
  bool timed_out = false;  // a TIMEOUT was taken: the ranks' sequences no longer agree

  // The feature: a MoE rank over NVLink (peers and nvlink), a MoE rank whose exchanges go
  // through its host proxy (proxy, ffi/cuda/host_proxy.h), or an AllReduce rank (peers and
  // all_reduce).
  PeerBuffers peers;
  std::unique_ptr<NvlinkExchange> nvlink;
  std::unique_ptr<CudaProxy> proxy;
  std::unique_ptr<AllReduceRank> all_reduce;

  // What a launch sees of the rank (the NVLink fields stay at their defaults without nvlink).
  CommView view() const;
  // The pending error code (0 when none), read without synchronizing the device.
  int32_t pending_error() const;
};

// The functions below throw std::runtime_error / std::invalid_argument (for the bindings).
// `chunks`: token chunks of the NVLink protocol, the same on every rank of the communicator
// (MoEConfig.num_sms, or the smallest SM count of its devices); a launch runs
// min(chunks, SMs of this device) blocks.
// `stage_clocks` also allocates the per-block stage timestamps (ffi/protocol/stage_clock.h).
void create_rank_state(int64_t comm_id, int ordinal, const MoeDims& dims, int chunks,
                       double timeout_s, bool stage_clocks);
// The state of one rank of an AllReduce of messages up to max_bytes.
void create_all_reduce_state(int64_t comm_id, int ordinal, int rank, int world, int64_t max_bytes,
                             double timeout_s);
// The state of a rank whose exchanges go through its host proxy (ffi/cuda/host_proxy.h);
// `stream_wait`: the stream waits for the proxy with stream memory operations;
// `device_rows`: which rows stay in device memory, in a device buffer in the host layout
// (peers.local): those of this host's ranks, which map it (connect_rank_state, before
// start_rank_proxy), and those to and from other hosts, which the TransferEngines move
// (stage_remote_device_rows).
void create_proxy_rank_state(int64_t comm_id, int ordinal, const MoeDims& dims, double timeout_s,
                             bool stream_wait, DeviceRows device_rows);
// What the TransferEngine of a proxy rank with DeviceRows::remote registers: the rank's
// device buffer (buffer_layout bytes; the remote ranks write their rows there) and its device
// staging copies of `remote_ranks` (made here, once; device_staging.h): per copy, the memory
// of each of device_staging_ranges(dims).
struct RemoteDeviceRows {
  char* buffer;
  std::vector<std::vector<char*>> staging;
};
RemoteDeviceRows stage_remote_device_rows(int64_t comm_id, int ordinal,
                                          const std::vector<int>& remote_ranks);
// Starts the proxy of a rank made by create_proxy_rank_state, serving with the host rank
// state of the same (comm id, ordinal), which must be connected; the rank is then connected.
void start_rank_proxy(int64_t comm_id, int ordinal);
// Stops the proxy thread of a rank and releases its mappings of host memory: before the host
// rank state goes (its TransferEngine may write the rank's device rows until it is closed),
// and before destroy_rank_state. Does nothing for other ranks.
void stop_rank_proxy(int64_t comm_id, int ordinal);
// The proxy's samples since the last call (ffi/cuda/host_proxy.h).
std::vector<ProxySample> take_proxy_samples(int64_t comm_id, int ordinal);
// CUDA IPC handle (64 bytes) of the rank's buffer, for peers in other processes.
std::string rank_ipc_handle(int64_t comm_id, int ordinal);
// Maps every rank's buffer: rank p is driven by this process on device local_ordinals[p]
// (>= 0), or lives in another process and ipc_handles[p] maps it. A proxy rank maps only the
// ranks of its host: an empty handle of a rank in another process marks a rank on another
// host (no mapping).
void connect_rank_state(int64_t comm_id, int ordinal, const std::vector<int>& local_ordinals,
                        const std::vector<std::string>& ipc_handles);
// The stage timestamps of the rank's latest launches, [kClockKernels][grid][kClockMarks]
// (ffi/protocol/stage_clock.h); empty when the rank was built without them. Synchronizes the
// device.
std::vector<uint64_t> read_stage_clocks(int64_t comm_id, int ordinal, int* grid);
// Returns the recorded error and clears it; false when none is pending.
bool take_rank_error(int64_t comm_id, int ordinal, ErrorRecord* out);
void destroy_rank_state(int64_t comm_id, int ordinal);

// For handlers: never throws; nullptr when no such state exists.
CudaRankState* find_rank_state(int64_t comm_id, int ordinal);

}  // namespace jax_moe
