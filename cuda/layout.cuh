// Sizes of one rank of a dispatch/combine communicator, its error record and counters, and the
// buffer layout of the host protocol (the host backend and the cuda backend's host proxies;
// the NVLink kernels' layout is cuda/nvlink_layout.cuh). Header-only, no XLA types.
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

// The first error a device records; lives in mapped pinned host memory so the host reads it
// without synchronizing. `code` is written last, so a non-zero code means the rest is valid.
struct ErrorRecord {
  int32_t code;
  int32_t stage;
  int32_t rank;
  int32_t detail;
};

// A device's requests to its host proxy thread (ffi/cuda/host_proxy.h), in mapped pinned host
// memory. The stream stores `seq << 8 | op` into `request` after the request's inputs are in
// host memory; the proxy runs that exchange, stores `seq` into `done`, and the stream goes on.
// One request at a time: the stream waits for each (so inputs and outputs can be reused).
struct ProxyDoorbell {
  uint64_t request;
  uint64_t done;
};

// Per-device bookkeeping in device memory, touched only by this device's kernels.
// (The NVLink dispatch/combine keep per-chunk sequences instead: cuda/nvlink_layout.cuh.)
struct DeviceCounters {
  uint64_t all_reduce_seq;   // sequence of the last all-reduce (advanced by its last block)
  uint64_t proxy_seq;        // sequence of the last request rung on the proxy's doorbell
  uint32_t blocks_done[1];   // last-block-done counters, one per kernel that publishes (see kDone*)
  int32_t error_claimed;     // 0 until a kernel claims the error record (first error wins)
  int32_t aborted;           // set on a timeout so every other waiter gives up at once
};

enum DoneCounter : int {
  kDoneAllReduce = 0,
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

// The host protocol (ffi/host/exchange.cc): byte offsets inside the buffer of one rank (one
// allocation, written by every peer):
//   u64 dispatch_flag[R]      source s stores its dispatch sequence at [s] after its rows
//   u64 dispatch_ack[R]       destination d stores the dispatch sequence it consumed at [d]
//   u64 combine_flag[R]       expert rank d stores its combine sequence at [d] after its rows
//   u64 combine_ack[R]        source s stores the combine sequence it consumed at [s]
//   i32 recv_num_tokens[R]    tokens sent by source s (already clamped to [0, T])
//   i32 recv_ids[R][T][K]     expert id of slot (t, k) of source s; -1 when not routed
//   f32 recv_weights[R][T][K] router weight of that slot
//   recv_tokens[R][T]         token_bytes each: source s writes token t at [s][t] only when
//                             t has a slot on this rank (a token crosses the link once)
//   combine region            source mode: bf16 comb[T][K][H], row of slot (t, k) of this
//                             rank's tokens, written by the rank that holds the slot;
//                             expert mode: partial part[R][T][H], written by expert rank d at [d]
struct BufferLayout {
  size_t dispatch_flag;
  size_t dispatch_ack;
  size_t combine_flag;
  size_t combine_ack;
  size_t recv_num_tokens;
  size_t recv_ids;
  size_t recv_weights;
  size_t recv_tokens;
  size_t combine;
  size_t total;
};

JAX_MOE_HD inline BufferLayout buffer_layout(const MoeDims& d) {
  const size_t R = d.world, T = d.max_tokens, K = d.topk, H = d.hidden;
  BufferLayout b;
  b.dispatch_flag = 0;
  b.dispatch_ack = b.dispatch_flag + 8 * R;
  b.combine_flag = b.dispatch_ack + 8 * R;
  b.combine_ack = b.combine_flag + 8 * R;
  b.recv_num_tokens = align_up(b.combine_ack + 8 * R, 256);
  b.recv_ids = align_up(b.recv_num_tokens + 4 * R, 256);
  b.recv_weights = align_up(b.recv_ids + 4 * R * T * K, 256);
  b.recv_tokens = align_up(b.recv_weights + 4 * R * T * K, 256);
  b.combine = align_up(b.recv_tokens + R * T * token_bytes(d), 256);
  const size_t combine_bytes = d.reduce_expert ? R * T * H * partial_bytes(d) : T * K * H * 2;
  b.total = align_up(b.combine + combine_bytes, 256);
  return b;
}

// Everything a kernel needs to reach this rank's state and its peers' buffers.
struct CommView {
  MoeDims dims;
  char* local;               // this rank's buffer (nvlink_layout, or all_reduce_layout)
  char* const* peers;        // device array [R]: every rank's buffer as mapped on this device
  DeviceCounters* counters;  // device memory
  ErrorRecord* error;        // device pointer to the mapped host record
  uint64_t* chunk_seq;       // device memory [kChunkCounters][chunks] (nvlink_layout.cuh)
  uint64_t* stage_clock;     // device [kClockKernels][grid][kClockMarks] or null
                             // (cuda/stage_clock.cuh)
  uint64_t timeout_ns;       // every spin-wait gives up after this long
  int chunks;                // token chunks of the NVLink protocol, equal on every rank
  int grid;                  // blocks of a dispatch/combine launch (<= chunks), MoEConfig.num_sms
};

}  // namespace jax_moe
