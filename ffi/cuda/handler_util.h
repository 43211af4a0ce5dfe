// Shared pieces of the CUDA FFI handlers: state lookup at handler entry, the current device
// and launch status
// (argument checks: ffi/handler_checks.h).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "ffi/cuda/state.h"
#include "ffi/handler_checks.h"
#include "xla/ffi/api/ffi.h"

namespace jax_moe {

// The connected state of (comm_id, ordinal) with the device made current, or an error when
// it is missing or a timeout broke the communicator.
ffi::ErrorOr<CudaRankState*> begin_call(const CallSite& site, int64_t comm_id, int32_t ordinal);

// Makes `ordinal` the current device, or an error naming the handler and the device.
ffi::Error set_device(const CallSite& site, int32_t ordinal);

// Success, or an error naming the CUDA failure.
ffi::Error launch_result(const CallSite& site, cudaError_t status);

}  // namespace jax_moe
