#include "ffi/host_fabric/fabric_peers.h"

#include <algorithm>
#include <chrono>

#include "ffi/transport/deadline.h"
#include "ffi/transport/errors.h"

namespace jax_moe::host {
namespace {

using transport::deadline_after;
using transport::seconds_left;

// Tag of an immediate: the signal kind in bits 2..0, the call's sequence (mod 2^16) above.
// Sequences of one kind never run more than one ahead of the peer (a sender waits for the
// previous call's ack), so 16 bits tell calls apart.
uint32_t tag_of(Signal signal, uint64_t seq) {
  return uint32_t((seq & 0xffff) << 3) | static_cast<uint32_t>(signal);
}

// How long a write waits for its peer's full transmit queue before the next peer's turn
// (FabricPeers::drain), and the turns of a wait while writes are deferred.
constexpr double kPostTurnSeconds = 1e-3;
// A post returns with writes still queued only when every peer they are for has had a full
// transmit queue for this long (dead or unreachable; a live peer's queue frees a slot as
// soon as one write completes). Until then it keeps posting, so the writes are on the wire
// while the caller goes on (split calls overlap them with compute).
constexpr auto kStuck = std::chrono::milliseconds(50);

}  // namespace

FabricPeers::FabricPeers(const transport::Config& config, const MoeDims& dims,
                         const std::vector<int>& remote_ranks, char* buffer,
                         const DeviceRowsMemory& device)
    : engine_(config),
      buffer_bytes_(buffer_layout(dims).total),
      rows_begin_(buffer_layout(dims).recv_tokens),
      staging_index_(dims.world, -1),
      group_of_(dims.world, -1),
      rows_group_of_(dims.world, -1),
      backlog_(dims.world),
      busy_since_(dims.world),
      unreachable_(dims.world, false) {
  int next_index = 0;
  for (int peer : remote_ranks) {
    if (peer < 0 || peer >= dims.world || peer == int(config.rank) ||
        staging_index_[peer] >= 0) {
      throw transport::TransportError("host backend: remote rank " + std::to_string(peer) +
                                      " is not another rank in [0, " +
                                      std::to_string(dims.world) + ") listed once");
    }
    staging_index_[peer] = next_index++;
  }
  // Every write is a span of the buffer, so a buffer the provider can write in one message
  // is enough (shm and tcp have no limit; efa and verbs do).
  if (buffer_bytes_ > engine_.facts().max_msg_size) {
    throw transport::TransportError(
        "host backend: the rank buffer (" + std::to_string(buffer_bytes_) +
        " bytes) exceeds the largest message of provider " + engine_.facts().provider + " (" +
        std::to_string(engine_.facts().max_msg_size) + " bytes); lower max_tokens or hidden");
  }
  buffer_region_ = engine_.register_memory(buffer, buffer_bytes_);
  if (device.buffer != nullptr) {
    const std::array<ByteRange, 2> ranges = device_staging_ranges(dims);
    bool fits = device.cuda_device >= 0 &&
                (device.staging.empty() || device.staging.size() == remote_ranks.size());
    for (const std::vector<char*>& copy : device.staging) fits &= copy.size() == ranges.size();
    if (!fits)
      throw transport::TransportError(
          "host backend: device rows need their CUDA device and, per remote rank, one device "
          "staging allocation for each of device_staging_ranges");
    device_rows_region_ =
        engine_.register_memory(device.buffer, buffer_bytes_, device.cuda_device);
    for (const std::vector<char*>& copy : device.staging) {
      std::vector<Extent> regions;
      for (size_t r = 0; r < ranges.size(); ++r)
        regions.push_back({ranges[r], engine_.register_memory(copy[r], ranges[r].length,
                                                              device.cuda_device)});
      device_staging_regions_.push_back(std::move(regions));
    }
  }
  // Each staging copy is address space for a whole buffer with only this rank's extents
  // committed and registered (staging_extents.h).
  staging_stride_ = page_rounded(buffer_bytes_);
  staging_storage_ = MappedPages::reserve(staging_stride_ * remote_ranks.size());
  // Rows that leave from device staging copies need no host pages.
  const std::vector<ByteRange> extents =
      staging_extents(dims, page_size(), !device_staging_regions_.empty());
  for (size_t copy = 0; copy < remote_ranks.size(); ++copy) {
    std::vector<Extent> regions;
    for (const ByteRange& e : extents) {
      const size_t at = copy * staging_stride_ + e.offset;
      staging_storage_.commit(at, e.length);
      regions.push_back({e, engine_.register_memory(staging_storage_.data() + at, e.length)});
    }
    staging_regions_.push_back(std::move(regions));
  }
}

FabricPeers::~FabricPeers() {
  // Posts do not wait for their completions (remote_peers.h), so this rank's last writes may
  // still be queued or on their way; a peer may be waiting for them, and closing the endpoint
  // would drop them. Posts the queued ones (each until its own deadline) and waits for them
  // for at most the engine's timeout (a dead peer's writes fail sooner).
  try {
    while (drain()) {
    }
    engine_.flush(0);
  } catch (const transport::TransportError&) {
    // A failed or late write: its peer reports it; nothing here can.
  }
  try {
    engine_.close();  // joins the progress thread before the staging memory goes
  } catch (const transport::TransportError&) {
    // A destructor cannot report; close() released what it could.
  }
}

std::string FabricPeers::device_rows_descriptor() const {
  return device_rows_region_ < 0 ? std::string() : engine_.region_descriptor(device_rows_region_);
}

void FabricPeers::connect(int peer, const std::string& card, const std::string& descriptor,
                          const std::string& device_rows_descriptor) {
  if (!is_remote(peer) || group_of_[peer] >= 0) {
    throw transport::TransportError("host backend: rank " + std::to_string(peer) +
                                    " is not a remote rank waiting to be connected");
  }
  // A rank with device rows receives them through writes into device memory, which its
  // senders post only if their engines have FI_HMEM as well: both ends must agree.
  if (device_rows_descriptor.empty() != (device_rows_region_ < 0)) {
    throw transport::TransportError(
        "host backend: rank " + std::to_string(peer) +
        (device_rows_descriptor.empty() ? " receives rows in host memory while this rank"
                                        : " receives rows in device memory while this rank") +
        " does not; every process must set the same JAX_MOE_PROXY_HMEM (and provider)");
  }
  engine_.add_peer(card);
  group_of_[peer] = engine_.create_group({{uint32_t(peer), descriptor}});
  if (!device_rows_descriptor.empty())
    rows_group_of_[peer] = engine_.create_group({{uint32_t(peer), device_rows_descriptor}});
}

bool FabricPeers::connected() const {
  for (size_t p = 0; p < group_of_.size(); ++p) {
    if (staging_index_[p] >= 0 && group_of_[p] < 0) return false;
  }
  return true;
}

bool FabricPeers::is_remote(int peer) const {
  return peer >= 0 && peer < int(staging_index_.size()) && staging_index_[peer] >= 0;
}

char* FabricPeers::staging(int peer) {
  return staging_storage_.data() + uint64_t(staging_index_[peer]) * staging_stride_;
}

std::vector<std::pair<char*, uint64_t>> FabricPeers::staging_memory() const {
  std::vector<std::pair<char*, uint64_t>> out;
  for (size_t copy = 0; copy < staging_regions_.size(); ++copy) {
    for (const Extent& e : staging_regions_[copy])
      out.emplace_back(staging_storage_.data() + copy * staging_stride_ + e.range.offset,
                       e.range.length);
  }
  return out;
}

std::pair<int, uint64_t> FabricPeers::source_of(int peer, const Span& span) const {
  const bool device = !device_staging_regions_.empty() && span.offset >= rows_begin_;
  const auto& copies = device ? device_staging_regions_ : staging_regions_;
  for (const Extent& e : copies[staging_index_[peer]]) {
    if (span.offset >= e.range.offset &&
        span.offset + span.length <= e.range.offset + e.range.length)
      return {e.region, span.offset - e.range.offset};
  }
  // The exchange writes only inside sender_ranges (host_layout.h); a span outside them is a
  // bug of the protocol code, reported like a failed post.
  throw transport::TransportError("host backend: the span [" + std::to_string(span.offset) +
                                  ", +" + std::to_string(span.length) + ") to rank " +
                                  std::to_string(peer) +
                                  " lies outside this rank's staging extents");
}

int FabricPeers::group_for(int peer, const Span& span) const {
  if (rows_group_of_[peer] < 0 || span.offset + span.length <= rows_begin_)
    return group_of_[peer];
  if (span.offset >= rows_begin_) return rows_group_of_[peer];
  // The exchange never merges routes with rows (remote_spans.h): a bug of the protocol code.
  throw transport::TransportError("host backend: the span [" + std::to_string(span.offset) +
                                  ", +" + std::to_string(span.length) + ") to rank " +
                                  std::to_string(peer) +
                                  " crosses from the routes into the rows part of the layout");
}

bool FabricPeers::post(Signal signal, uint64_t seq,
                       const std::vector<std::vector<Span>>& spans_by_peer, double timeout_s,
                       int* failed_peer) {
  const uint32_t tag = tag_of(signal, seq);
  const auto deadline = deadline_after(timeout_s);
  int failed = -1;
  int peer = -1;
  try {
    for (peer = 0; peer < int(backlog_.size()); ++peer) {
      if (!is_remote(peer)) continue;
      if (unreachable_[peer]) {
        if (failed < 0) failed = peer;
        continue;
      }
      const std::vector<Span>& spans = spans_by_peer[peer];
      if (spans.empty())
        backlog_[peer].push_back({group_of_[peer], buffer_region_, {}, tag, deadline});
      for (const Span& span : spans) {
        const auto [region, offset] = source_of(peer, span);
        backlog_[peer].push_back({group_for(peer, span), region,
                                  transport::Slice{offset, span.length, span.offset}, tag,
                                  deadline});
      }
    }
    peer = -1;
    while (drain() && !only_stuck_left()) {
    }
  } catch (const transport::TransportError&) {
    // A span outside the staging extents, or a failed write that stopped the engine
    // (remote_peers.h: posts do not wait for completions).
    const int engine_failed = engine_.failed_peer();
    *failed_peer = engine_failed >= 0 ? engine_failed : peer;
    return false;
  }
  if (failed < 0) failed = take_newly_unreachable();
  *failed_peer = failed;
  return failed < 0;
}

bool FabricPeers::drain() {
  bool posted = true;
  bool deferred = false;
  while (posted) {
    posted = false;
    deferred = false;
    for (int peer = 0; peer < int(backlog_.size()); ++peer) {
      std::deque<Deferred>& queue = backlog_[peer];
      while (!queue.empty()) {
        const Deferred& write = queue.front();
        try {
          engine_.scatter(write.group, write.region, {write.slice}, write.tag,
                          kPostTurnSeconds);
        } catch (const transport::TransportBusy&) {
          const auto now = transport::Clock::now();
          if (busy_since_[peer] == transport::Clock::time_point{}) busy_since_[peer] = now;
          if (now >= write.deadline) {
            unreachable_[peer] = true;
            if (newly_unreachable_ < 0) newly_unreachable_ = peer;
            queue.clear();
          }
          break;  // its turn is over
        }
        busy_since_[peer] = {};
        queue.pop_front();
        posted = true;
      }
      deferred |= !queue.empty();
    }
  }
  return deferred;
}

bool FabricPeers::only_stuck_left() const {
  const auto now = transport::Clock::now();
  for (size_t peer = 0; peer < backlog_.size(); ++peer) {
    if (backlog_[peer].empty()) continue;
    if (busy_since_[peer] == transport::Clock::time_point{} || now - busy_since_[peer] < kStuck)
      return false;
  }
  return true;
}

int FabricPeers::take_newly_unreachable() {
  const int peer = newly_unreachable_;
  newly_unreachable_ = -1;
  return peer;
}

bool FabricPeers::wait(Signal signal, uint64_t seq, const std::vector<uint64_t>& writes,
                       double timeout_s, int* late_peer) {
  const uint32_t tag = tag_of(signal, seq);
  const auto deadline = deadline_after(timeout_s);
  for (int peer = 0; peer < int(staging_index_.size()); ++peer) {
    if (!is_remote(peer)) continue;
    try {
      // While writes of this rank are deferred, the wait is cut into turns between which
      // they are posted again: the peer waited for may be waiting for them.
      for (;;) {
        const bool deferred = drain();
        const int gone = take_newly_unreachable();
        if (gone >= 0) {
          *late_peer = gone;
          return false;
        }
        const double left = seconds_left(deadline);
        try {
          engine_.wait(tag, {{uint32_t(peer), writes[peer]}},
                       deferred ? std::min(kPostTurnSeconds, left) : left, "host backend wait");
          break;
        } catch (const transport::TransportTimeout&) {
          if (transport::Clock::now() >= deadline) throw;
        }
      }
    } catch (const transport::TransportError&) {
      *late_peer = peer;
      return false;
    }
  }
  return true;
}

}  // namespace jax_moe::host
