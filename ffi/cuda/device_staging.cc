#include "ffi/cuda/device_staging.h"

#include <stdexcept>
#include <string>

#include "ffi/cuda/driver.h"
#include "ffi/host/staging_extents.h"

namespace jax_moe {
namespace {

// The driver's virtual memory management functions (CUDA 12 ABI), looked up once: libcuda is
// not linked (ffi/cuda/driver.h).
struct Vmm {
  decltype(&cuDeviceGet) device;
  decltype(&cuDeviceGetAttribute) attribute;
  decltype(&cuMemGetAllocationGranularity) granularity;
  decltype(&cuMemAddressReserve) reserve;
  decltype(&cuMemAddressFree) free;
  decltype(&cuMemCreate) create;
  decltype(&cuMemRelease) release;
  decltype(&cuMemMap) map;
  decltype(&cuMemUnmap) unmap;
  decltype(&cuMemSetAccess) set_access;
};

template <typename F>
F entry(const char* name) {
  void* fn = driver_entry_point(name, 12000);
  if (fn == nullptr)
    throw std::runtime_error(std::string("jax_moe device staging: the CUDA driver has no ") +
                             name + " (needed by JAX_MOE_PROXY_HMEM; set it to off)");
  return reinterpret_cast<F>(fn);
}

const Vmm& vmm() {
  static const Vmm api{
      entry<decltype(&cuDeviceGet)>("cuDeviceGet"),
      entry<decltype(&cuDeviceGetAttribute)>("cuDeviceGetAttribute"),
      entry<decltype(&cuMemGetAllocationGranularity)>("cuMemGetAllocationGranularity"),
      entry<decltype(&cuMemAddressReserve)>("cuMemAddressReserve"),
      entry<decltype(&cuMemAddressFree)>("cuMemAddressFree"),
      entry<decltype(&cuMemCreate)>("cuMemCreate"),
      entry<decltype(&cuMemRelease)>("cuMemRelease"),
      entry<decltype(&cuMemMap)>("cuMemMap"),
      entry<decltype(&cuMemUnmap)>("cuMemUnmap"),
      entry<decltype(&cuMemSetAccess)>("cuMemSetAccess"),
  };
  return api;
}

void check(CUresult status, const char* what) {
  if (status != CUDA_SUCCESS)
    throw std::runtime_error(std::string("jax_moe device staging: ") + what +
                             " failed (CUresult " + std::to_string(int(status)) + ")");
}

}  // namespace

DeviceStaging::DeviceStaging(const MoeDims& dims, int ordinal, int copies) {
  const Vmm& api = vmm();
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = ordinal;
  // A NIC reads the copies (GPUDirect RDMA) where the device allows it for such memory.
  CUdevice device = 0;
  int rdma = 0;
  check(api.device(&device, ordinal), "cuDeviceGet");
  check(api.attribute(&rdma, CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED, device),
        "cuDeviceGetAttribute(GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED)");
  prop.allocFlags.gpuDirectRDMACapable = rdma ? 1 : 0;
  check(api.granularity(&granule_, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
        "cuMemGetAllocationGranularity");
  stride_ = align_up(buffer_layout(dims).total, granule_);
  try {
    reserved_ = stride_ * size_t(copies);
    if (reserved_ == 0) return;
    check(api.reserve(&base_, reserved_, granule_, 0, 0), "cuMemAddressReserve");
    CUmemAccessDesc access{};
    access.location = prop.location;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    const std::vector<ByteRange> extents = host::device_staging_extents(dims, granule_);
    for (int i = 0; i < copies; ++i) {
      for (const ByteRange& e : extents) {
        Mapped m{base_ + CUdeviceptr(i * stride_ + e.offset), e.length, 0};
        check(api.create(&m.handle, m.bytes, &prop, 0), "cuMemCreate");
        if (const CUresult status = api.map(m.at, m.bytes, 0, m.handle, 0);
            status != CUDA_SUCCESS) {
          api.release(m.handle);
          check(status, "cuMemMap");
        }
        mapped_.push_back(m);
        check(api.set_access(m.at, m.bytes, &access, 1), "cuMemSetAccess");
      }
    }
  } catch (...) {
    release();
    throw;
  }
}

DeviceStaging::~DeviceStaging() { release(); }

void DeviceStaging::release() {
  const Vmm& api = vmm();
  for (const Mapped& m : mapped_) {
    api.unmap(m.at, m.bytes);
    api.release(m.handle);
  }
  mapped_.clear();
  if (base_ != 0) api.free(base_, reserved_);
  base_ = 0;
}

char* DeviceStaging::copy(int i) const {
  return reinterpret_cast<char*>(base_ + CUdeviceptr(size_t(i) * stride_));
}

}  // namespace jax_moe
