// The sizes of one rank of a dispatch/combine communicator, the enums and the error record
// that every layer shares: the kernels (cuda/), the handlers and rank states (ffi/cuda,
// ffi/host), and Python through the native module (ffi/protocol/bindings.cc exports the
// enums and binds MoeDims). Header-only, host and device, no XLA or CUDA types.
#pragma once

#include <cstddef>
#include <cstdint>

#ifdef __CUDACC__
#define JAX_MOE_HD __host__ __device__
#else
#define JAX_MOE_HD
#endif

namespace jax_moe {

// Static sizes of one communicator as seen by one rank (docs/semantics.md notation).
struct MoeDims {
  int world;           // R: ranks on the expert-parallel axis
  int rank;            // this rank's index on the axis
  int max_tokens;      // T
  int hidden;          // H, a multiple of 8 (of 16 with fp8 rows)
  int topk;            // K, at most 32 (one warp lane per slot)
  int num_experts;     // E
  int local_experts;   // L = E / R; rank d owns experts [d*L, (d+1)*L)
  int block_size;      // fp8 scale block along hidden (block_size / 8 a power of two)
  int expert_padding;  // each expert segment is rounded up to a multiple of this
  int capacity;        // rows of the dispatched output
  int fp8;             // 1: rows travel as fp8 codes + f32 scales; 0: as bf16
  int reduce_expert;   // 1: combine_reduce="expert"; 0: "source"
  int partial_bf16;    // expert mode: partial sums travel as bf16 (1) or f32 (0)
};

enum ErrorCode : int32_t {
  kInvalidExpertId = 1,  // detail: the offending id
  kCapacityOverflow = 2, // detail: rows that needed a place
  kTimeout = 3,          // detail: the peer rank waited for
  kBadNumTokens = 4,     // detail: the value given
  kCallOrder = 5,        // detail: sends not yet received when the call came (halves alternate)
};

enum Stage : int32_t {
  kStageDispatchSend = 1,
  kStageDispatchRecv = 2,
  kStageCombineSend = 3,
  kStageCombineRecv = 4,
  kStageAllReduceOneShot = 5,   // one-shot all-reduce: waiting for the peers' inputs
  kStageAllReduceScatter = 6,   // two-shot phase 1: waiting for the peers' segments
  kStageAllReduceGather = 7,    // two-shot phase 2: waiting for the peers' reduced segments
  kStageAllReduceNvls = 8,      // multimem all-reduce: waiting at one of its two barriers
  kStageProxy = 9,              // a stream waiting for its host proxy to finish an exchange
};

// The AllReduce's `algorithm` attribute (jax_moe/all_reduce.py's _KERNEL_IDS).
enum AllReduceAlgorithm : int32_t {
  kOneShot = 0,
  kTwoShot = 1,
  kNvls = 2,
};

// How dispatch_send receives the token rows (the handlers pick it from the buffers' types;
// the kernels and the host exchange are specialized on it).
enum TokenInput : int {
  kInputBf16 = 0,          // x bf16 [T, H], sent as bf16
  kInputBf16Quantize = 1,  // x bf16 [T, H], quantized to fp8 + scales on the way out
  kInputFp8 = 2,           // x fp8 e4m3fn [T, H] with x_scales f32 [T, H/bs], sent as given
};

// The first error a device records; lives in mapped pinned host memory so the host reads it
// without synchronizing. `code` is written last, so a non-zero code means the rest is valid.
struct ErrorRecord {
  int32_t code;
  int32_t stage;
  int32_t rank;
  int32_t detail;
};

JAX_MOE_HD inline size_t align_up(size_t value, size_t alignment) {
  return (value + alignment - 1) / alignment * alignment;
}

JAX_MOE_HD inline int scale_blocks(const MoeDims& d) { return d.fp8 ? d.hidden / d.block_size : 0; }

// Bytes of one token in the dispatch region: fp8 codes [H] then f32 scales [H/bs], or bf16 [H].
JAX_MOE_HD inline size_t token_bytes(const MoeDims& d) {
  return d.fp8 ? align_up(size_t(d.hidden) + 4 * size_t(scale_blocks(d)), 16)
               : size_t(d.hidden) * 2;
}

JAX_MOE_HD inline size_t partial_bytes(const MoeDims& d) { return d.partial_bf16 ? 2 : 4; }

}  // namespace jax_moe
