// A cuda proxy rank's device staging copies of its remote ranks' buffers (JAX_MOE_PROXY_HMEM):
// the proxy kernels write the rows and combine terms for a rank on another host into its copy
// (ProxyRowsView::rows_to, terms_to), and the TransferEngine writes them from there into that
// rank's device buffer (FI_HMEM), so no row crosses PCIe. Like a host staging copy
// (ffi/host/staging_extents.h) a copy holds only what this rank sends that rank: its token rows
// and its combine terms (device_staging_ranges), one cudaMalloc each (memory the providers can
// share between processes, as shm's CUDA IPC protocol needs for a write's source).
#pragma once

#include <array>
#include <cstddef>
#include <vector>

#include "ffi/protocol/dims.h"

namespace jax_moe {

class DeviceStaging {
 public:
  // Allocates `copies` copies for a rank of `dims` on the current device. Throws
  // std::runtime_error.
  DeviceStaging(const MoeDims& dims, int copies);
  ~DeviceStaging();
  DeviceStaging(const DeviceStaging&) = delete;
  DeviceStaging& operator=(const DeviceStaging&) = delete;

  // Copy `i`'s memory of range `r` of device_staging_ranges: the bytes that sit at buffer
  // offset device_staging_ranges(dims)[r].offset in the buffer layout.
  char* range(int i, int r) const { return memory_[size_t(i) * kRanges + r]; }
  // A pointer that addresses copy `i`'s range `r` by buffer-layout offsets: base + offset lands
  // in the range for the offsets it holds (and nowhere valid outside them).
  char* layout_base(int i, int r) const;

  static constexpr int kRanges = 2;

 private:
  std::array<size_t, kRanges> offsets_{};
  std::vector<char*> memory_;  // [copy][range]
};

}  // namespace jax_moe
