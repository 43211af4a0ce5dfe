// Optional per-block timestamps of the NVLink dispatch/combine kernels' stages, for finding
// where a kernel's time goes below what a kernel-level profile shows (JAX_MOE_STAGE_CLOCKS=1;
// read by benchmarks/profile_kernels.py --stages through Communicator.stage_clocks()). The
// kernels write them with clock_mark() (cuda/exchange.cuh).
//
// Layout (device memory, allocated only when asked for; CommView.stage_clock is null
// otherwise and a mark is one branch not taken):
//   u64 clock[kClockKernels][grid][kClockMarks]   %globaltimer (ns) when thread 0 of block b
//                                                 reached the mark in the latest launch
// A launch writes only the marks of the phases it runs; the others keep older values.
#pragma once

namespace jax_moe {

enum ClockKernel : int {
  kClockDispatch = 0,
  kClockCombine = 1,
  kClockKernels = 2,
};

// One list for both kernels (the route and segment marks are dispatch's only).
enum ClockMark : int {
  kMarkSendStart = 0,   // send phase entered (peer table loaded)
  kMarkRouted = 1,      // dispatch: this route block published its route part
  kMarkSent = 2,        // every chunk of this block sent and flagged
  kMarkRecvStart = 3,   // receive phase entered
  kMarkCountsSeen = 4,  // dispatch: every source's route flags seen
  kMarkSegments = 5,    // dispatch: segments built and written
  kMarkDataSeen = 6,    // the flags of this block's first chunk seen
  kMarkRecvDone = 7,    // every chunk of this block placed (dispatch) or summed (combine)
  kMarkRanked = 8,      // world-1 dispatch: the slots of this block's first chunk have rows
  kClockMarks = 9,
};

// Names the bindings give Python (index = ClockKernel / ClockMark).
constexpr const char* kClockKernelNames[kClockKernels] = {"dispatch", "combine"};
constexpr const char* kClockMarkNames[kClockMarks] = {
    "send_start", "routed", "sent", "recv_start", "counts_seen", "segments", "data_seen",
    "recv_done", "ranked"};

}  // namespace jax_moe
