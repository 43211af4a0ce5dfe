// Shared pieces of the CUDA FFI handlers: argument checks whose messages name the Python
// function that must agree, state lookup at handler entry, and launch status.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>
#include <string>

#include "ffi/cuda/state.h"
#include "xla/ffi/api/ffi.h"

namespace jax_moe {
namespace ffi = xla::ffi;

// One expected dimension: its name in MoEConfig / docs terms, and its size.
struct NamedDim {
  const char* name;
  int64_t size;
};

// Which handler and which Python method it serves, for error messages.
struct CallSite {
  const char* target;     // e.g. "jax_moe_dispatch_send"
  const char* python_fn;  // e.g. "Communicator.dispatch_send"
};

// Error unless `dims` equals `expected`, e.g. "jax_moe_dispatch_send: x has shape [64,512],
// Communicator.dispatch_send expects [max_tokens=128, hidden=512]".
ffi::Error expect_shape(const CallSite& site, const char* arg, ffi::Span<const int64_t> dims,
                        std::initializer_list<NamedDim> expected);

// Error unless `dtype` is `expected`.
ffi::Error expect_dtype(const CallSite& site, const char* arg, ffi::DataType dtype,
                        ffi::DataType expected);

// The connected state of (comm_id, ordinal) with the device made current, or an error when
// it is missing or a timeout broke the communicator.
ffi::ErrorOr<CudaRankState*> begin_call(const CallSite& site, int64_t comm_id, int32_t ordinal);

// Success, or an error naming the CUDA failure.
ffi::Error launch_result(const CallSite& site, cudaError_t status);

}  // namespace jax_moe
