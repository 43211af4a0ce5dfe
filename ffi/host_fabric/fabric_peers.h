// RemotePeers (ffi/host/remote_peers.h) over one TransferEngine per rank: the engine's rank is
// the rank's index on the communicator axis, so an immediate's source names the sending rank.
// Registered with the engine: the rank's own buffer (remote peers write into it) and one
// staging copy per remote peer (the source of this rank's writes). Exists only in builds
// with libfabric.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "ffi/host/page_memory.h"
#include "ffi/host/remote_peers.h"
#include "ffi/transport/transfer_engine.h"

namespace jax_moe::host {

class FabricPeers : public RemotePeers {
 public:
  // Opens the engine of rank `rank` of `world` and registers `buffer` ([buffer_bytes]) and a
  // staging copy for every rank in `remote_ranks`. Throws TransportError.
  FabricPeers(const transport::Config& config, int world, const std::vector<int>& remote_ranks,
              char* buffer, uint64_t buffer_bytes);
  ~FabricPeers() override;

  // What a remote peer needs: this engine's address card and the descriptor of the buffer.
  std::string address() const { return engine_.address(); }
  std::string buffer_descriptor() const { return engine_.region_descriptor(buffer_region_); }
  // Adds remote rank `peer` (its card and buffer descriptor); every remote rank once.
  void connect(int peer, const std::string& card, const std::string& descriptor);

  bool is_remote(int peer) const override;
  bool connected() const override;
  char* staging(int peer) override;
  char* staging_memory() override { return reinterpret_cast<char*>(staging_storage_.get()); }
  uint64_t staging_memory_bytes() const override { return staging_storage_bytes_; }
  bool post(Signal signal, uint64_t seq, const std::vector<std::vector<Span>>& spans_by_peer,
            double timeout_s, int* failed_peer) override;
  bool wait(Signal signal, uint64_t seq, const std::vector<uint64_t>& writes, double timeout_s,
            int* late_peer) override;

 private:
  transport::TransferEngine engine_;
  uint64_t buffer_bytes_;
  int buffer_region_ = -1;
  std::vector<int> staging_index_;  // [world] index of the peer's staging copy, -1 if local
  PageMemory staging_storage_;  // [remote peers][buffer_bytes], page-aligned (page_memory.h)
  uint64_t staging_storage_bytes_ = 0;  // whole pages
  int staging_region_ = -1;
  std::vector<int> group_of_;  // [world] one-member group of a connected remote peer, else -1
};

}  // namespace jax_moe::host
