// The 32-bit immediate carried by every write the TransferEngine posts:
//   bits 31..12: tag (what the write belongs to: a call, a stage, a barrier),
//   bits 11..0 : the sending rank.
// The receiver counts arrivals per (tag, source), so completion never depends on the order
// in which writes land, and a timeout can name the peers that are missing.
#pragma once

#include <cstdint>

namespace jax_moe::transport {

constexpr int kSourceBits = 12;
constexpr uint32_t kMaxRanks = 1u << kSourceBits;        // ranks 0..4095
constexpr uint32_t kMaxTag = (1u << (32 - kSourceBits)) - 1;

constexpr uint32_t make_immediate(uint32_t tag, uint32_t source) {
  return (tag << kSourceBits) | source;
}
constexpr uint32_t immediate_tag(uint32_t immediate) { return immediate >> kSourceBits; }
constexpr uint32_t immediate_source(uint32_t immediate) {
  return immediate & (kMaxRanks - 1);
}

}  // namespace jax_moe::transport
