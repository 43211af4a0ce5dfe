// Block-level pieces of the NVLink dispatch/combine kernels (cuda/dispatch.cu,
// cuda/combine.cu): chunks, per-chunk sequences, parity regions, and the flags a block raises
// and waits for. Layout and protocol: ffi/protocol/nvlink_layout.h.
#pragma once

#include "cuda/sync.cuh"
#include "ffi/protocol/nvlink_layout.h"
#include "ffi/protocol/stage_clock.h"

namespace jax_moe {

__device__ inline int block_warp() { return threadIdx.x / 32; }

constexpr int kMaxWorld = 64;  // ranks of a communicator (state.cc refuses more)

// This block's copy of the peer table. v.peers lives in global memory, where any store the
// kernel makes might alias it, so every use inside a copy loop was a fresh global load;
// load_peers() fills this once at kernel start (begin_launch).
static __shared__ char* block_peers[kMaxWorld];

__device__ inline void load_peers(const CommView& v) {
  for (int p = threadIdx.x; p < v.dims.world; p += blockDim.x) block_peers[p] = v.peers[p];
  __syncthreads();
}

// Records when thread 0 of this block reached `mark` (ffi/protocol/stage_clock.h); nothing unless
// the communicator was built with stage clocks.
__device__ inline void clock_mark(const CommView& v, ClockKernel kernel, ClockMark mark) {
  if (v.stage_clock == nullptr || threadIdx.x != 0) return;
  v.stage_clock[(size_t(kernel) * v.grid + blockIdx.x) * kClockMarks + mark] = global_timer_ns();
}

// First token of chunk c (chunk c covers [chunk_begin(c), chunk_begin(c + 1))).
__device__ inline int chunk_begin(const CommView& v, int c) {
  return part_begin(v.dims.max_tokens, c, v.chunks);
}

// The sequence of this call for chunk c in `counter` (ChunkCounter).
__device__ inline uint64_t chunk_seq(const CommView& v, ChunkCounter counter, int c) {
  return v.chunk_seq[size_t(counter) * v.chunks + c] + 1;
}

// Where this block's first chunk stands in a phase pair (sends and receives so far).
struct CallCounts {
  uint64_t sent;
  uint64_t received;
};

__device__ inline CallCounts load_call_counts(const CommView& v, ChunkCounter send,
                                              ChunkCounter recv) {
  return CallCounts{v.chunk_seq[size_t(send) * v.chunks + blockIdx.x],
                    v.chunk_seq[size_t(recv) * v.chunks + blockIdx.x]};
}

// Whether the launch's halves come in the order the protocol needs (docs/semantics.md,
// CALL_ORDER): a send when every earlier send was received, a receive alone when exactly one
// send is pending (judged on this block's first chunk; every block's counters move together).
// Out of order, it records CALL_ORDER (detail: sends not yet received; stage: `send_stage` or
// `recv_stage`) and the launch must do nothing.
__device__ inline bool in_call_order(const CommView& v, CallCounts n, int phases,
                                     int32_t send_stage, int32_t recv_stage) {
  const bool is_send = phases & kPhaseSend;
  const bool in_order = is_send ? n.sent == n.received : n.sent == n.received + 1;
  if (!in_order && threadIdx.x == 0)
    record_error(v, kCallOrder, is_send ? send_stage : recv_stage,
                 static_cast<int32_t>(n.sent - n.received));
  return in_order;
}

// The start of every launch that exchanges with peers: this block's copy of the peer table,
// and the call-order check. The counters load before the peer table so the two round trips
// overlap.
__device__ inline bool begin_launch(const CommView& v, ChunkCounter send, ChunkCounter recv,
                                    int phases, int32_t send_stage, int32_t recv_stage) {
  const CallCounts n = load_call_counts(v, send, recv);
  load_peers(v);
  return in_call_order(v, n, phases, send_stage, recv_stage);
}

// Records that this block finished chunk c of `counter`'s phase (call once per chunk, by one
// thread, after the chunk's work).
__device__ inline void finish_chunk(const CommView& v, ChunkCounter counter, int c,
                                    uint64_t seq) {
  if (threadIdx.x == 0) v.chunk_seq[size_t(counter) * v.chunks + c] = seq;
}

// Parity region of call `seq` in a rank's buffer.
__device__ inline char* parity_region(char* buffer, const NvlinkLayout& lay, uint64_t seq) {
  return buffer + lay.region + (seq & 1) * lay.region_bytes;
}

// After this block's writes for one flag: the block syncs, then one thread stores seq into
// flag `index` at `offset` in `buffer` (release, system scope).
__device__ inline void signal_flag(char* buffer, size_t offset, int index, uint64_t seq) {
  __syncthreads();
  if (threadIdx.x == 0) store_release_sys(flag_at(buffer, offset, index), seq);
}

// After this block's writes for one flag: the block syncs, then thread p (< R) stores seq
// into flag `index` of the flags at `offset` in rank p's buffer, with release semantics at
// system scope (cumulative over the block's writes that the barrier ordered before it).
__device__ inline void signal_peers(const CommView& v, size_t offset, int index, uint64_t seq) {
  __syncthreads();
  for (int p = threadIdx.x; p < v.dims.world; p += blockDim.x)
    store_release_sys(flag_at(block_peers[p], offset, index), seq);
}

// Waits until the flags [p * stride + index + i], p < R, i < per_peer, at `offset` in this
// rank's buffer reach seq (the block's threads share them), then the block syncs. False in
// every thread when any wait gave up (timeout, recorded with peer p, or an earlier timeout of
// this device): the data behind the flags is not valid.
__device__ inline bool wait_peers(const CommView& v, size_t offset, int stride, int index,
                                  uint64_t seq, int32_t stage, int per_peer = 1) {
  int ok = 1;
  for (int i = threadIdx.x; i < v.dims.world * per_peer; i += blockDim.x) {
    const int p = i / per_peer;
    if (!wait_at_least(v, flag_at(v.local, offset, p * stride + index + i % per_peer), seq,
                       stage, p))
      ok = 0;
  }
  return __syncthreads_and(ok) != 0;
}

}  // namespace jax_moe
