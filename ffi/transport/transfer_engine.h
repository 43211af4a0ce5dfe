// TransferEngine: libfabric RDM endpoints (one per rail: a NIC), their registered memory,
// peers and peer groups, and one progress thread that drains the completion queues (callers
// blocked in wait/flush poll them too, so a message costs no thread wake-up).
//
// Operations (all writes carry a 32-bit immediate, see immediate.h):
// - scatter: one local source region, a different slice to a different offset on each member
//   of a peer group; every member receives exactly one immediate per scatter, also when its
//   slice is empty, so receivers know how many to expect.
// - barrier: an immediate to every member of a group, then wait for every member's.
// - wait: block until (tag, source) immediates reached an expected count, then consume them.
// Nothing depends on delivery order; shuffle mode (Config::shuffle_seed != 0) permutes the
// posting order of each scatter and holds back completions to apply them in random order.
//
// Several NICs (Config::domains): the engine opens an endpoint on each and shards its peers
// across them, not the bytes of a write: every write to peer p leaves on local rail
// (rank + p) % local rails and arrives on the peer's rail (rank + p) % its rails. For a
// sender its peers spread over its NICs, and for a receiver its senders spread over its NICs;
// every region is registered on every rail, so any rail may write into it.
//
// Not tested here (no hardware): providers efa and verbs;ofi_rxm, FI_MR_LOCAL / PROV_KEY /
// ENDPOINT registration paths (shm and tcp;ofi_rxm ask only FI_MR_VIRT_ADDR or nothing),
// FI_HMEM (CUDA memory), and rails on distinct NICs (the tests open several on one domain).
//
// Thread safety: every public method may be called from any thread (the endpoints are opened
// FI_THREAD_SAFE); close() must not race other calls.
#pragma once

#include <rdma/fabric.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "ffi/transport/deadline.h"
#include "ffi/transport/wire.h"

namespace jax_moe::transport {

struct Config {
  uint32_t rank = 0;            // this engine's rank; the source field of its immediates
  std::string provider;         // "shm", "tcp;ofi_rxm", "verbs;ofi_rxm", "efa"; "": any
  std::string node;             // source address for socket providers ("127.0.0.1"); "" = default
  double timeout_s = 10.0;      // default bound of every wait and of a post retried on FI_EAGAIN
  uint64_t shuffle_seed = 0;    // != 0: test mode that reorders posts and completions
  bool cuda_memory = false;     // ask for FI_HMEM (device buffers); needs a provider with it
  // One endpoint (rail) per entry: the domain names of the NICs to use, e.g. the EFA devices
  // next to the GPU (`fi_info -p efa` lists them); a name may repeat. Empty: one rail on the
  // provider's first domain (or the one `node` selects).
  std::vector<std::string> domains;
};

// One slice of a scatter, for the member at the same position in the group.
struct Slice {
  uint64_t src_offset = 0;  // in the local source region
  uint64_t length = 0;      // 0: the member still gets the immediate
  uint64_t dst_offset = 0;  // in the member's destination region
};

// Facts about the opened endpoint, for tests, benchmarks and logs.
struct FabricFacts {
  std::string provider;
  std::string fabric;
  std::vector<std::string> domains;  // each rail's, in rail order
  uint64_t mr_mode = 0;            // the FI_MR_* bits the provider asked us to follow
  uint64_t max_msg_size = 0;       // the smallest of the rails'
  uint64_t inject_size = 0;
  bool cuda_memory = false;        // FI_HMEM was granted on every rail
};

class TransferEngine {
 public:
  explicit TransferEngine(const Config& config);
  ~TransferEngine();
  TransferEngine(const TransferEngine&) = delete;
  TransferEngine& operator=(const TransferEngine&) = delete;

  // This engine's address card (wire.h), for its peers.
  std::string address() const;
  const FabricFacts& facts() const { return facts_; }
  uint32_t rank() const { return config_.rank; }

  // Inserts a peer's address card into the address vector (a card of this engine's own rank
  // is accepted too: a group may include self). Throws on a provider mismatch or a bad card.
  void add_peer(const std::string& card);

  // Registers [ptr, ptr + size) of host memory (or CUDA memory on `cuda_device` when
  // Config::cuda_memory was granted) with every rail, for local reads and remote writes;
  // returns a region id.
  int register_memory(void* ptr, uint64_t size, int cuda_device = -1);
  std::string region_descriptor(int region) const;
  void deregister_memory(int region);

  // A group of (peer rank, descriptor of that peer's destination region); the per-member
  // write templates (address, key, descriptor, remote base) are filled here, once.
  int create_group(const std::vector<std::pair<uint32_t, std::string>>& members);
  size_t group_size(int group) const;

  // Posts one write per member (slices[i] for member i) from region `source`, each with the
  // immediate (tag, this rank). Returns once posted; flush() waits for local completion.
  // Posting all of them gives up after timeout_s (0: the engine's timeout) of a full
  // transmit queue, counted from the call, not per write (TransportBusy; the writes before
  // the one that could not be posted are posted).
  void scatter(int group, int source, const std::vector<Slice>& slices, uint32_t tag,
               double timeout_s = 0);
  // Writes the immediate (tag, this rank) to every member, then waits for (tag, member)
  // from every member; the posts and the wait share one timeout_s.
  void barrier(int group, uint32_t tag, double timeout_s);
  // Waits until (tag, source) arrived counts[i].second times for every (source, count), then
  // consumes them. Throws naming the stage `what`, the tag and every short source on timeout
  // (TransportTimeout; nothing is consumed then).
  void wait(uint32_t tag, const std::vector<std::pair<uint32_t, uint64_t>>& counts,
            double timeout_s, const std::string& what);
  // Waits until every write posted so far completed locally (its source may be reused).
  void flush(double timeout_s);
  // Immediates (tag, source) that arrived and were not consumed yet.
  uint64_t arrived(uint32_t tag, uint32_t source);
  // The peer of the failed write that stopped this engine; -1 when none failed, or the
  // failure names no write (a remote write into this engine, a queue error).
  int failed_peer();

  // Registered regions, the internal signal region included (0 once closed).
  size_t open_regions() const;
  // Writes posted on each rail so far (barrier and empty-slice writes included).
  std::vector<uint64_t> rail_writes();

  // Stops the progress thread, closes regions, endpoint, queues, domain, fabric. Idempotent;
  // every other call on a closed engine throws.
  void close();

 private:
  struct Region;
  struct Member;
  struct Group;
  struct WriteContext;
  // One endpoint on one domain (NIC), with its own completion queue and address vector.
  struct Rail {
    fi_info* info = nullptr;
    fid_fabric* fabric = nullptr;
    fid_domain* domain = nullptr;
    fid_cq* cq = nullptr;
    fid_av* av = nullptr;
    fid_ep* ep = nullptr;
    std::string endpoint_name;
  };
  struct Peer {
    uint32_t rail = 0;         // the local rail that talks to this peer
    uint32_t remote_rail = 0;  // the peer's rail that receives from this engine
    fi_addr_t addr = FI_ADDR_UNSPEC;  // in rails_[rail]'s address vector
    uint64_t engine_id = 0;
    RegionDescriptor signal;  // where barrier writes and empty slices go
  };
  struct Completion {
    uint64_t flags = 0;
    uint64_t data = 0;
    void* context = nullptr;
  };

  // Opens rails_[index] on `domain` ("": the provider's first) and checks it agrees with
  // rail 0 (provider, registration rules).
  void open_rail(size_t index, const std::string& domain);
  // Posts one write; retries a full transmit queue until `deadline` (`limit_s` after the
  // caller's start, for the error message).
  void post_write(const Member& member, void* local, uint64_t length, void* local_desc,
                  uint64_t remote_addr, uint64_t key, uint32_t immediate,
                  Clock::time_point deadline, double limit_s);
  void progress_loop();
  size_t poll_once();
  void read_error_entry(fid_cq* cq);
  void apply(const Completion& completion);
  void release_held(bool all);
  void fail(const std::string& message);
  void require_open(const char* what) const;
  // Open, not failed, and `tag` fits the immediate (scatter and barrier).
  void check_can_post(const char* what, uint32_t tag);
  void throw_if_failed();
  const Group& group_at(int group) const;
  const Region& region_at(int region) const;
  double bound(double timeout_s) const { return timeout_s > 0 ? timeout_s : config_.timeout_s; }

  Config config_;
  uint64_t engine_id_ = 0;  // this incarnation, stamped into its card and descriptors
  FabricFacts facts_;
  std::vector<Rail> rails_;  // sized once in the constructor

  // The signal region: a small buffer every peer may write to (barrier, empty slices).
  std::vector<uint8_t> signal_buffer_;
  int signal_region_ = -1;

  mutable std::mutex state_mutex_;  // regions_, peers_, groups_, next_key_
  std::map<int, std::unique_ptr<Region>> regions_;
  std::unordered_map<uint32_t, Peer> peers_;
  std::vector<std::unique_ptr<Group>> groups_;
  int next_region_ = 0;
  uint64_t next_key_ = 1;

  // Arrivals and local completions, guarded by progress_mutex_.
  std::mutex progress_mutex_;
  std::unordered_map<uint32_t, uint64_t> arrived_;  // immediate -> unconsumed arrivals
  uint64_t posted_ = 0;
  uint64_t completed_ = 0;
  std::vector<uint64_t> rail_writes_;  // [rails] writes posted on each
  std::string failure_;  // first CQ error (or fatal progress error); sticky
  int failed_peer_ = -1;  // the peer of the write that failure_ reports, if it is one
  // Contexts of writes in flight come from this pool (owned here, reused after completion).
  std::vector<std::unique_ptr<WriteContext>> context_pool_;
  std::vector<WriteContext*> free_contexts_;
  std::vector<Completion> held_;  // shuffle mode: completions waiting to be applied
  uint64_t shuffle_state_ = 0;

  std::atomic<int> waiters_{0};  // callers blocked in wait/flush: the poller spins for them
  std::atomic<bool> stop_{false};
  std::thread progress_thread_;
  std::atomic<bool> closed_{false};
};

}  // namespace jax_moe::transport
