// Per-rank state of the host backend: one rank of one communicator on one CPU device of this
// process. Created and connected from Python (ffi/host/bindings.cc) outside jit; the FFI
// handlers (ffi/host/handlers.cc) look it up by (comm id, device ordinal) from XLA's
// per-device threads, which run concurrently. Ranks of one process share memory: each writes
// straight into its peers' buffers (layout: ffi/protocol/host_layout.h, shared with the cuda
// backend's host proxies). So do "near" ranks, in other processes of the same host (group,
// JAX_MOE_HOST_GROUP): their buffers are POSIX shared memory that each maps. Ranks in other
// processes of other hosts are reached through `remote` (ffi/host/remote_peers.h): this rank
// writes into a staging copy of their buffer and `remote` copies the written spans over.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "ffi/host/page_memory.h"
#include "ffi/host/remote_peers.h"
#include "ffi/protocol/host_layout.h"

namespace jax_moe::host {

struct HostRankState {
  int64_t comm_id = 0;
  int ordinal = 0;
  MoeDims dims{};
  // The buffer (whole pages, page_memory.h): private memory, or the shared-memory object
  // `shared_name` when near ranks map it (the name is removed once they did, or with the
  // state).
  MappedPages storage;
  std::string shared_name;
  char* buffer = nullptr;
  // [R] this process's mappings of the near ranks' buffers (empty for the others).
  std::vector<MappedPages> near;
  // Ranks in other processes; null when every rank is in this process. Declared after
  // `storage` so it closes (and stops writing into the buffer) before the buffer is freed.
  std::unique_ptr<RemotePeers> remote;
  // [R] every rank's buffer (this one included; a near rank's as mapped here); a remote rank's
  // staging copy instead.
  std::vector<char*> peers;
  std::vector<int32_t> expert_counts;   // scratch [R][L]
  std::vector<int32_t> slot_rank;       // scratch [R][T][K]
  uint64_t dispatch_seq = 0;            // advanced by dispatch_send, used by dispatch_recv
  uint64_t combine_seq = 0;
  // The last seq each receive half took: a send needs it equal to the send sequence (every
  // send received), a receive needs one send pending (docs/semantics.md, CALL_ORDER).
  uint64_t dispatch_recv_seq = 0;
  uint64_t combine_recv_seq = 0;
  double timeout_s = 10.0;
  int threads = 1;  // threads of the row loops (parallel.h; JAX_MOE_HOST_THREADS)
  bool connected = false;
  // A wait gave up: the ranks' sequences disagree, so every later call records TIMEOUT
  // (naming timeout_peer) and returns zeros. Handlers never fail at run time for it: JAX
  // threads one token through the ordered calls (backends/ordered_ffi.py), and a failed call
  // would fail every later host program of the process.
  std::atomic<bool> timed_out{false};
  int32_t timeout_peer = -1;
  // Steady-clock ns of the first post to a remote peer since a CUDA proxy (ffi/cuda/host_proxy.h)
  // cleared it to 0 before serving a request: the proxy-overhead measurement.
  int64_t first_post_ns = 0;

  // The first error wins until take_error clears it (docs/semantics.md "Errors").
  void record_error(int32_t code, int32_t stage, int32_t detail);
  bool take_error(ErrorRecord* out);

  ~HostRankState();  // removes the name of its shared buffer, if still there

 private:
  std::mutex error_mutex_;
  bool has_error_ = false;
  ErrorRecord error_{};
};

// The functions below throw std::invalid_argument (for the bindings), std::runtime_error for
// shared memory the system refuses.
// `shared`: the buffer is a shared-memory object that near ranks map (host_shared_name).
void create_host_rank(int64_t comm_id, int ordinal, const MoeDims& dims, double timeout_s,
                      bool shared);
// The name near ranks map the rank's buffer by (create_host_rank with `shared`).
std::string host_shared_name(int64_t comm_id, int ordinal);
// Maps the buffer of near rank `peer` (its host_shared_name) into this process for the rank.
void map_near_rank(int64_t comm_id, int ordinal, int peer, const std::string& name);
// Removes the name of the rank's shared buffer once every near rank mapped it: nothing is
// left behind in /dev/shm when a process dies. The mappings stay.
void unlink_host_shared(int64_t comm_id, int ordinal);
// Points rank `ordinal` at every rank's buffer: rank p lives on local device ordinals[p], or
// in another process when ordinals[p] is -1: a near rank (mapped by map_near_rank) or a
// remote one (then `remote` must have it, connected).
void connect_host_rank(int64_t comm_id, int ordinal, const std::vector<int>& ordinals);
// Threads of the rank's row loops (ffi/host/parallel.h), in [1, 64].
void set_host_threads(int64_t comm_id, int ordinal, int threads);
bool take_host_error(int64_t comm_id, int ordinal, ErrorRecord* out);
void destroy_host_rank(int64_t comm_id, int ordinal);

// For handlers: never throws; nullptr when no such state exists.
HostRankState* find_host_rank(int64_t comm_id, int ordinal);

}  // namespace jax_moe::host
