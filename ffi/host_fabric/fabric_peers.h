// RemotePeers (ffi/host/remote_peers.h) over one TransferEngine per rank: the engine's rank is
// the rank's index on the communicator axis, so an immediate's source names the sending rank.
// Registered with the engine: the rank's own buffer (remote peers write into it) and the
// extents of one staging copy per remote peer (the sources of this rank's writes,
// ffi/host/staging_extents.h); for a cuda proxy rank whose rows to and from other hosts stay
// in device memory (JAX_MOE_PROXY_HMEM), also its device buffer in the same layout and its
// device staging copies (FI_HMEM): the rows part of the layout (recv_tokens and the combine
// region) goes from those copies to the peers' device buffers, the rest (routes, which the
// CPU phases read and write) between the host copies and host buffers. Exists only in builds
// with libfabric.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "ffi/host/page_memory.h"
#include "ffi/host/remote_peers.h"
#include "ffi/host/staging_extents.h"
#include "ffi/transport/transfer_engine.h"

namespace jax_moe::host {

// A cuda proxy rank's device memory for its rows (ffi/cuda/state.h, RemoteDeviceRows), on
// CUDA device `cuda_device`: its device buffer (buffer_layout bytes), where the remote ranks
// write their rows, and its device staging copies of them (in remote_ranks order; each the
// memory of every range of device_staging_ranges), which its own rows leave from.
struct DeviceRowsMemory {
  char* buffer = nullptr;
  std::vector<std::vector<char*>> staging;
  int cuda_device = -1;
};

class FabricPeers : public RemotePeers {
 public:
  // Opens the engine of rank dims.rank and registers `buffer` (buffer_layout(dims).total
  // bytes) and a staging copy for every rank in `remote_ranks`; with `device` memory (its
  // buffer set; `config` must ask for cuda_memory) registers that too. Throws TransportError.
  FabricPeers(const transport::Config& config, const MoeDims& dims,
              const std::vector<int>& remote_ranks, char* buffer,
              const DeviceRowsMemory& device = {});
  ~FabricPeers() override;

  // What a remote peer needs: this engine's address card and the descriptors of the buffer
  // and of the device rows ("" without them).
  std::string address() const { return engine_.address(); }
  std::string buffer_descriptor() const { return engine_.region_descriptor(buffer_region_); }
  std::string device_rows_descriptor() const;
  // Adds remote rank `peer` (its card and descriptors); every remote rank once. Its rows go
  // to its device rows when it has them, which it must exactly when this rank has them.
  void connect(int peer, const std::string& card, const std::string& descriptor,
               const std::string& device_rows_descriptor);

  bool is_remote(int peer) const override;
  bool connected() const override;
  char* staging(int peer) override;
  std::vector<std::pair<char*, uint64_t>> staging_memory() const override;
  bool post(Signal signal, uint64_t seq, const std::vector<std::vector<Span>>& spans_by_peer,
            double timeout_s, int* failed_peer) override;
  bool wait(Signal signal, uint64_t seq, const std::vector<uint64_t>& writes, double timeout_s,
            int* late_peer) override;

 private:
  // One committed extent of a staging copy, registered with the engine.
  struct Extent {
    ByteRange range;  // in the buffer layout
    int region;       // engine region holding exactly `range` of the copy
  };
  // The engine region and offset in it of `span` of the staging copy of remote `peer`.
  std::pair<int, uint64_t> source_of(int peer, const Span& span) const;
  // The group `span` goes to: the peer's device rows for the rows part of the layout, when
  // it has them, else its buffer.
  int group_for(int peer, const Span& span) const;

  transport::TransferEngine engine_;
  uint64_t buffer_bytes_;
  uint64_t rows_begin_;  // where the rows part of the layout starts (BufferLayout::recv_tokens)
  int buffer_region_ = -1;
  int device_rows_region_ = -1;  // this rank's device rows, or -1
  std::vector<int> staging_index_;  // [world] index of the peer's staging copy, -1 if local
  uint64_t staging_stride_ = 0;     // bytes between staging copies: the buffer in whole pages
  MappedPages staging_storage_;     // reserved [remote peers][staging_stride_] (page_memory.h)
  std::vector<std::vector<Extent>> staging_regions_;  // [copy][extent] (staging_extents.h)
  // [copy][range] of the device staging copies (device_staging_ranges), where the rows part
  // of a span is read; empty when the rows leave from the host copies.
  std::vector<std::vector<Extent>> device_staging_regions_;
  std::vector<int> group_of_;  // [world] one-member group of a connected remote peer, else -1
  std::vector<int> rows_group_of_;  // [world] the same for the peer's device rows, else -1
  // Writes are posted through per-peer queues, in order: a write whose peer's transmit queue
  // is full waits there while the other peers' writes go out (a dead peer must not hold
  // back the writes its survivors wait for). A post returns once its writes are posted, or
  // only peers stuck for a while are left (fabric_peers.cc, kStuck); their writes are posted
  // again by the next post or wait.
  struct Deferred {
    int group;   // the peer's buffer or device rows
    int region;  // engine region of the staging extent (or the buffer, for an empty slice)
    transport::Slice slice;
    uint32_t tag;
    transport::Clock::time_point deadline;  // of the post that queued it
  };
  std::vector<std::deque<Deferred>> backlog_;  // [world]
  // [world] since when the first queued write has met a full transmit queue; unset (epoch)
  // while the peer's writes go out.
  std::vector<transport::Clock::time_point> busy_since_;
  // [world] a queued write reached its deadline on the peer's full transmit queue: its
  // writes are dropped, and every later post names the peer.
  std::vector<bool> unreachable_;
  int newly_unreachable_ = -1;  // the first peer found unreachable since the last report

  // Posts the queued writes, each peer for at most a turn of a full transmit queue per pass,
  // passes repeated while they post anything. Returns whether writes stay queued. Throws
  // TransportError when the engine failed.
  bool drain();
  // True when every peer with queued writes has had a full transmit queue for kStuck.
  bool only_stuck_left() const;
  int take_newly_unreachable();  // -1 when none
};

}  // namespace jax_moe::host
