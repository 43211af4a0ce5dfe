// Device-side signalling between ranks: release/acquire flags at system scope, bounded
// spin-waits, the error record, and the last-block-done pattern that publishes a kernel's
// writes once every block has finished them.
#pragma once

#include <cstdint>

#include "cuda/comm_view.cuh"

namespace jax_moe {

constexpr int kThreads = 256;
constexpr unsigned kFullMask = 0xffffffffu;

__device__ inline uint64_t load_acquire_sys(const uint64_t* flag) {
  uint64_t value;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(value) : "l"(flag) : "memory");
  return value;
}

__device__ inline void store_release_sys(uint64_t* flag, uint64_t value) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(flag), "l"(value) : "memory");
}

__device__ inline uint32_t load_acquire_sys(const uint32_t* flag) {
  uint32_t value;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(value) : "l"(flag) : "memory");
  return value;
}

__device__ inline void store_release_sys(uint32_t* flag, uint32_t value) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(flag), "r"(value) : "memory");
}

__device__ inline uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ inline uint64_t* flag_at(char* buffer, size_t offset, int index) {
  return reinterpret_cast<uint64_t*>(buffer + offset) + index;
}

// Records (code, stage, this rank, detail) unless an error is already recorded.
__device__ inline void record_error(const CommView& v, int32_t code, int32_t stage,
                                    int32_t detail) {
  if (atomicCAS(&v.counters->error_claimed, 0, 1) != 0) return;
  volatile ErrorRecord* e = v.error;
  e->stage = stage;
  e->rank = v.dims.rank;
  e->detail = detail;
  __threadfence_system();
  e->code = code;
  __threadfence_system();
}

// Spins until *flag >= target. Gives up after v.timeout_ns (recording TIMEOUT with the peer)
// or at once when another waiter of this device already timed out. Returns false on giving up.
__device__ inline bool wait_at_least(const CommView& v, const uint64_t* flag, uint64_t target,
                                     int32_t stage, int32_t peer) {
  if (load_acquire_sys(flag) >= target) return true;
  const uint64_t start = global_timer_ns();
  volatile int32_t* aborted = &v.counters->aborted;
  while (load_acquire_sys(flag) < target) {
    if (*aborted) return false;
    if (global_timer_ns() - start > v.timeout_ns) {
      record_error(v, kTimeout, stage, peer);
      atomicExch(&v.counters->aborted, 1);
      return false;
    }
    __nanosleep(64);
  }
  return true;
}

// Call from every thread after the block's writes. Returns true in exactly one block, the
// last to finish, once the writes of all blocks are visible system-wide; that block then
// publishes (and the counter is reset for the next launch).
__device__ inline bool last_block_done(const CommView& v, DoneCounter which) {
  __shared__ bool is_last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    const unsigned prev = atomicAdd(&v.counters->blocks_done[which], 1u);
    is_last = prev == gridDim.x - 1;
    if (is_last) {
      v.counters->blocks_done[which] = 0;
      __threadfence_system();
    }
  }
  __syncthreads();
  return is_last;
}

__device__ inline int lane_id() { return threadIdx.x & 31; }

// First index of part `part` when [0, n) is cut into `parts` contiguous parts.
__device__ inline int part_begin(int n, int part, int parts) {
  return static_cast<int>(static_cast<long long>(n) * part / parts);
}

}  // namespace jax_moe
