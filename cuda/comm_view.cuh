// The cuda backend's device-side state as its kernels see it: the doorbell of a rank's host
// proxy, the per-device counters, and the view a launch gets of its rank (CommView). Header-only;
// the layouts it points into are in ffi/protocol/.
#pragma once

#include <cstdint>

#include "ffi/protocol/dims.h"

namespace jax_moe {

// A device's requests to its host proxy thread (ffi/cuda/host_proxy.h), in mapped pinned host
// memory. A one-thread kernel of the stream clears `answered` and stores `seq << 8 | op` into
// `request` after the request's inputs are in host memory; the proxy runs that phase, stores
// `seq` into `done` and 1 into `answered`. The stream then goes on: with stream waits, once a
// stream memory operation (cuStreamWaitValue32) saw `answered` == 1, so no kernel holds an
// SM, or the GPU's time slice when processes share a GPU, while the proxy works; else once
// the ringing kernel, spinning, saw `done` reach `seq`. One request at a time: the stream
// waits for each (so inputs and outputs can be reused).
struct ProxyDoorbell {
  uint64_t request;
  uint64_t done;
  uint32_t answered;
  uint32_t unused;
};

// Per-device bookkeeping in device memory, touched only by this device's kernels.
// (The NVLink dispatch/combine keep per-chunk sequences instead: ffi/protocol/nvlink_layout.h.)
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

