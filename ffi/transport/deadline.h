// Deadlines of the TransferEngine's bounded waits, and of its callers that split one bound
// over several engine calls (ffi/host_fabric/fabric_peers.cc).
#pragma once

#include <algorithm>
#include <chrono>

namespace jax_moe::transport {

using Clock = std::chrono::steady_clock;

inline Clock::time_point deadline_after(double seconds) {
  return Clock::now() +
         std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

// Seconds left until `deadline`, never 0 (the engine reads a timeout of 0 as its default).
inline double seconds_left(Clock::time_point deadline) {
  const double left = std::chrono::duration<double>(deadline - Clock::now()).count();
  return std::max(left, 1e-3);
}

}  // namespace jax_moe::transport
