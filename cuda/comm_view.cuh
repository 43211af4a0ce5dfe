// The cuda backend's device-side state as its kernels see it: the doorbell of a rank's host
// proxy, the per-device counters, and the view a launch gets of its rank (CommView). Header-only;
// the layouts it points into are in ffi/protocol/.
#pragma once

#include <cstdint>

#include "ffi/protocol/dims.h"

namespace jax_moe {

// A device's requests to its host proxy thread (ffi/cuda/host_proxy.h), in mapped pinned host
// memory. The stream clears `answered`, then stores `kProxyRung | op` into `request`, both after
// the request's inputs are in host memory; the proxy takes the request (stores 0 into
// `request`), runs that phase and stores 1 into `answered`. The stream then goes on once it
// saw `answered` == 1. With stream waits the three are one batch of stream memory operations
// (cuStreamBatchMemOp: no kernel, so no SM, or the GPU's time slice when processes share a
// GPU, is held while the proxy works); else a one-thread kernel stores them and spins. The
// values carry no sequence, so a command buffer's replays ring like the first capture. One
// request at a time: the stream waits for each (so inputs and outputs can be reused).
struct ProxyDoorbell {
  uint32_t request;
  uint32_t answered;
};
constexpr uint32_t kProxyRung = 1u << 31;  // `request` holds a request (its op in the low byte)

// Per-device bookkeeping in device memory, touched only by this device's kernels.
// (The NVLink dispatch/combine keep per-chunk sequences instead: ffi/protocol/nvlink_layout.h.)
struct DeviceCounters {
  uint64_t all_reduce_seq;   // sequence of the last all-reduce (advanced by its last block)
  uint32_t blocks_done[1];   // last-block-done counters, one per kernel that publishes (see kDone*)
  int32_t error_claimed;     // 0 until a kernel claims the error record (first error wins)
  int32_t aborted;           // set on a timeout so every other waiter gives up at once
};

enum DoneCounter : int {
  kDoneAllReduce = 0,
};

// Everything a kernel needs to reach this rank's state and its peers' buffers.
struct CommView {
  MoeDims dims;
  char* local;               // this rank's buffer (nvlink_layout, or all_reduce_layout)
  char* const* peers;        // device array [R]: every rank's buffer as mapped on this device
  DeviceCounters* counters;  // device memory
  ErrorRecord* error;        // device pointer to the mapped host record
  uint64_t* chunk_seq;       // device memory [kChunkCounters][chunks] (nvlink_layout.h)
  uint64_t* stage_clock;     // device [kClockKernels][grid][kClockMarks] or null
                             // (ffi/protocol/stage_clock.h)
  uint64_t timeout_ns;       // every spin-wait gives up after this long
  int chunks;                // token chunks of the NVLink protocol, equal on every rank
  int grid;                  // blocks of a dispatch/combine launch (<= chunks), MoEConfig.num_sms
};

}  // namespace jax_moe

