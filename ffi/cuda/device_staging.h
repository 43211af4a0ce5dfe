// A cuda proxy rank's device staging copies of its remote ranks' buffers (JAX_MOE_PROXY_HMEM):
// the proxy kernels write the rows and combine terms for a rank on another host into its copy
// (ProxyRowsView::rows_to), and the TransferEngine writes them from there into that rank's
// device buffer (FI_HMEM), so no row crosses PCIe. Like the host staging copies
// (ffi/host/staging_extents.h) each copy is address space for a whole buffer in the host
// layout in which only what this rank sends is memory (device_staging_extents: CUDA virtual
// memory management, in the device's allocation granules), so a copy costs about what the
// rank sends, not a buffer.
#pragma once

#include <cuda.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "ffi/protocol/dims.h"

namespace jax_moe {

class DeviceStaging {
 public:
  // Reserves `copies` buffers of the host layout of `dims` on device `ordinal` and maps the
  // extents of each. Throws std::runtime_error.
  DeviceStaging(const MoeDims& dims, int ordinal, int copies);
  ~DeviceStaging();  // unmaps and frees everything
  DeviceStaging(const DeviceStaging&) = delete;
  DeviceStaging& operator=(const DeviceStaging&) = delete;

  // Copy `i`: address space of a whole buffer layout, its extents mapped.
  char* copy(int i) const;
  // The allocation granule the extents are rounded to (device_staging_extents).
  size_t granule() const { return granule_; }

 private:
  void release();

  size_t granule_ = 0;
  size_t stride_ = 0;  // bytes between copies: the buffer in whole granules
  size_t reserved_ = 0;
  CUdeviceptr base_ = 0;
  struct Mapped {
    CUdeviceptr at;
    size_t bytes;
    CUmemGenericAllocationHandle handle;
  };
  std::vector<Mapped> mapped_;
};

}  // namespace jax_moe
