// Ranks of a host communicator that live in other processes. A rank cannot write into their
// buffers directly, so it writes into a local staging copy of each one (same layout,
// ffi/protocol/host_layout.h), and then asks RemotePeers to copy chosen byte spans of that copy
// to the same offsets of the real buffer, as RMA writes whose immediates the receiver counts
// (ffi/host_fabric/ implements it with the TransferEngine; builds without libfabric have no
// implementation, and their communicators never have remote peers).
//
// Protocol per signal kind and call sequence: a sender posts to every remote peer the spans
// of that call (at least one write: an empty list still sends one immediate), and the
// receiver waits for exactly as many immediates from that peer. Both sides derive the count
// from what they both know, so nothing depends on the order in which writes land.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

namespace jax_moe::host {

// What a write belongs to; with the call's sequence number it makes the immediate's tag.
enum class Signal : uint32_t {
  kDispatch = 1,     // routes of a dispatch_send (token count, expert ids, weights)
  kDispatchAck = 2,  // the receiver consumed them (its dispatch_recv finished)
  kCombine = 3,      // combine rows or partials of a combine_send
  kCombineAck = 4,   // the source consumed them (its combine_recv finished)
  kDispatchRows = 5, // rows of a dispatch_send (their number follows from its routes)
};

// [offset, offset + length) of the buffer layout: read from the staging copy of the peer,
// written to the peer's buffer at the same offset.
struct Span {
  uint64_t offset = 0;
  uint64_t length = 0;
};

class RemotePeers {
 public:
  virtual ~RemotePeers() = default;

  // True when rank `peer` lives in another process.
  virtual bool is_remote(int peer) const = 0;
  // True once every remote rank is connected.
  virtual bool connected() const = 0;
  // The staging copy of remote rank `peer`: a full buffer layout of address space in which
  // only what this rank writes into that peer's buffer is memory (staging_extents.h).
  virtual char* staging(int peer) = 0;
  // Every staging copy's committed extents (whole pages), for the cuda host proxies to
  // register with CUDA.
  virtual std::vector<std::pair<char*, uint64_t>> staging_memory() const = 0;
  // Posts spans_by_peer[p] to every remote peer p (one write each; one immediate-only write
  // when the list is empty) and returns once they are posted, or queued behind a full
  // transmit queue (the next post or wait posts them): nothing waits for their local
  // completion, because a staging copy is rewritten only after its receiver acknowledged the
  // call it carried (the halves wait for the acknowledgements first), and by then every
  // write of that call has landed. A peer whose queue stays full does not hold back the
  // writes to the others. False on a transport failure, or when a peer's queue stayed full
  // past a post's `timeout_s` (its writes are dropped, and every later post fails too),
  // naming the peer in `failed_peer`; a write that fails after it was posted stops the
  // engine, and the next post or wait reports it.
  virtual bool post(Signal signal, uint64_t seq,
                    const std::vector<std::vector<Span>>& spans_by_peer, double timeout_s,
                    int* failed_peer) = 0;
  // Waits until every remote peer p sent `writes[p]` writes of (signal, seq) (entries of
  // local ranks are ignored), for at most `timeout_s`, posting queued writes meanwhile. False
  // on timeout or failure, naming the first peer found short (or one whose queue stayed full
  // past its post's timeout) in `late_peer`.
  virtual bool wait(Signal signal, uint64_t seq, const std::vector<uint64_t>& writes,
                    double timeout_s, int* late_peer) = 0;
};

// How many writes a sender posts for a list of spans (the receiver expects as many).
inline uint64_t writes_for(const std::vector<Span>& spans) {
  return spans.empty() ? 1 : spans.size();
}

}  // namespace jax_moe::host
