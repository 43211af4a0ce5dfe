// CUDA driver functions for the host side of the CUDA handlers. libcuda is not linked (the
// module imports on machines without a driver, ffi/native_cuda.h), so each driver function is
// looked up through the runtime.
#pragma once

#include <cuda_runtime.h>

namespace jax_moe {

// The driver's `name` as of driver ABI `version` (12000 for CUDA 12.0), or nullptr when this
// driver has none; a failed lookup leaves no sticky runtime error behind.
inline void* driver_entry_point(const char* name, int version) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  if (cudaGetDriverEntryPointByVersion(name, &fn, version, cudaEnableDefault, &found) !=
          cudaSuccess ||
      found != cudaDriverEntryPointSuccess) {
    cudaGetLastError();
    return nullptr;
  }
  return fn;
}

}  // namespace jax_moe
