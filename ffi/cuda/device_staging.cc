#include "ffi/cuda/device_staging.h"

#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "ffi/host/staging_extents.h"

namespace jax_moe {

DeviceStaging::DeviceStaging(const MoeDims& dims, int copies) {
  const std::array<ByteRange, 2> ranges = host::device_staging_ranges(dims);
  for (int r = 0; r < kRanges; ++r) offsets_[r] = ranges[r].offset;
  try {
    for (int i = 0; i < copies; ++i) {
      for (const ByteRange& range : ranges) {
        void* memory = nullptr;
        const cudaError_t status = cudaMalloc(&memory, range.length);
        if (status != cudaSuccess)
          throw std::runtime_error(std::string("jax_moe cuda proxy: cudaMalloc(device staging, ") +
                                   std::to_string(range.length) + " bytes) failed: " +
                                   cudaGetErrorString(status));
        memory_.push_back(static_cast<char*>(memory));
      }
    }
  } catch (...) {
    for (char* memory : memory_) cudaFree(memory);
    throw;
  }
}

DeviceStaging::~DeviceStaging() {
  for (char* memory : memory_) cudaFree(memory);
}

char* DeviceStaging::layout_base(int i, int r) const {
  // Integer arithmetic: the base itself points nowhere; the kernels add layout offsets to it.
  return reinterpret_cast<char*>(reinterpret_cast<uintptr_t>(range(i, r)) - offsets_[r]);
}

}  // namespace jax_moe
