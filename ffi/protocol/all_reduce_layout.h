// Sizes and buffer layout of one rank of the all-reduce (cuda/all_reduce.cu), shared with the
// host state (ffi/cuda/state.cc). Header-only, no XLA types.
#pragma once

#include <cstddef>
#include <cstdint>

#include "ffi/protocol/dims.h"

namespace jax_moe {

// Grid cap of every all-reduce kernel: under half an H200's 132 SMs, as the MoE kernels take,
// so other streams keep the rest. Large messages need many SMs: pushing to a peer ran at about
// 4 GB/s per SM on 2 x H200 (64 MiB one-shot with 32 blocks: 127 GB/s). A constant, not derived
// from the device, because every rank must cut a message into the same blocks: block b of one
// rank signals block b of the others.
constexpr int kAllReduceMaxBlocks = 64;

// Flag sets: one-shot arrival and two-shot scatter share set 0 (a call uses one algorithm,
// and the sequence advances every call); the two-shot gather and NVLS second barrier use set 1.
constexpr int kFlagFirst = 0;
constexpr int kFlagSecond = 1;
constexpr int kFlagSets = 2;

// Byte offsets inside one rank's all-reduce buffer (one allocation, mapped by every peer):
//   u64 flag[kFlagSets][kAllReduceMaxBlocks][R]  flag[f][b][p]: sequence of the last call whose
//                                                block b on rank p finished its phase-f writes
//                                                into this buffer (monotonic, never reset)
//   data[2][R][slot_bytes]                       data[h][p]: written by rank p in calls whose
//                                                sequence has parity h. One-shot: p's whole input.
//                                                Two-shot: p's input for the segment this rank
//                                                reduces, and p's reduced segment at its own place.
// Two parities: a rank may start call n+1 while a slower peer still reads call n's data (it
// cannot be two calls ahead: call n+1 waits for every peer's call-n+1 flags, which a peer
// raises only after its call n has finished), so writes of n+1 go to the other half.
struct AllReduceLayout {
  size_t flags;
  size_t data;
  size_t slot_bytes;  // max_bytes rounded up to 256
  size_t total;
};

JAX_MOE_HD inline AllReduceLayout all_reduce_layout(int world, size_t max_bytes) {
  AllReduceLayout lay;
  lay.flags = 0;
  lay.data = align_up(8 * size_t(kFlagSets) * kAllReduceMaxBlocks * world, 256);
  lay.slot_bytes = align_up(max_bytes, 256);
  lay.total = lay.data + 2 * size_t(world) * lay.slot_bytes;
  return lay;
}

}  // namespace jax_moe
