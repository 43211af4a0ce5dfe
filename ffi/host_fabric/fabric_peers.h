// RemotePeers (ffi/host/remote_peers.h) over one TransferEngine per rank: the engine's rank is
// the rank's index on the communicator axis, so an immediate's source names the sending rank.
// Registered with the engine: the rank's own buffer (remote peers write into it) and the
// extents of one staging copy per remote peer (the sources of this rank's writes,
// ffi/host/staging_extents.h). Exists only in builds with libfabric.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "ffi/host/page_memory.h"
#include "ffi/host/remote_peers.h"
#include "ffi/host/staging_extents.h"
#include "ffi/transport/transfer_engine.h"

namespace jax_moe::host {

class FabricPeers : public RemotePeers {
 public:
  // Opens the engine of rank dims.rank and registers `buffer` (buffer_layout(dims).total
  // bytes) and a staging copy for every rank in `remote_ranks`. Throws TransportError.
  FabricPeers(const transport::Config& config, const MoeDims& dims,
              const std::vector<int>& remote_ranks, char* buffer);
  ~FabricPeers() override;

  // What a remote peer needs: this engine's address card and the descriptor of the buffer.
  std::string address() const { return engine_.address(); }
  std::string buffer_descriptor() const { return engine_.region_descriptor(buffer_region_); }
  // Adds remote rank `peer` (its card and buffer descriptor); every remote rank once.
  void connect(int peer, const std::string& card, const std::string& descriptor);

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

  transport::TransferEngine engine_;
  uint64_t buffer_bytes_;
  int buffer_region_ = -1;
  std::vector<int> staging_index_;  // [world] index of the peer's staging copy, -1 if local
  uint64_t staging_stride_ = 0;     // bytes between staging copies: the buffer in whole pages
  ReservedPages staging_storage_;   // [remote peers][staging_stride_] (page_memory.h)
  std::vector<std::vector<Extent>> staging_regions_;  // [copy][extent] (staging_extents.h)
  std::vector<int> group_of_;  // [world] one-member group of a connected remote peer, else -1
};

}  // namespace jax_moe::host
