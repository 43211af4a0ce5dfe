// The NVLS gate (see multicast.h). The driver is reached through cudaGetDriverEntryPointByVersion
// because libcuda is not linked (ffi/native_cuda.h).
#include "ffi/cuda/multicast.h"

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>

namespace jax_moe {
namespace {

// The switches of NCCL, NVSHMEM and PyTorch symmetric memory that forbid multicast, with the
// value that forbids it.
struct Switch {
  const char* name;
  const char* refusing_value;
};
constexpr Switch kSwitches[] = {
    {"NCCL_NVLS_ENABLE", "0"},
    {"NVSHMEM_DISABLE_NVLS", "1"},
    {"TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"},
};

using DeviceGetAttribute = CUresult (*)(int*, CUdevice_attribute, CUdevice);

}  // namespace

std::string nvls_refusal(int ordinal) {
  for (const Switch& s : kSwitches) {
    const char* value = std::getenv(s.name);
    if (value != nullptr && std::strcmp(value, s.refusing_value) == 0)
      return std::string(s.name) + "=" + s.refusing_value + " is set";
  }
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  if (cudaGetDriverEntryPointByVersion("cuDeviceGetAttribute", &fn, 12000, cudaEnableDefault,
                                       &found) != cudaSuccess ||
      found != cudaDriverEntryPointSuccess || fn == nullptr) {
    cudaGetLastError();
    return "the CUDA driver has no cuDeviceGetAttribute";
  }
  int sms = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, ordinal) != cudaSuccess) {
    cudaGetLastError();
    return "device " + std::to_string(ordinal) + " is not a CUDA device here";
  }
  // A CUdevice is the driver's ordinal, which is the runtime's device index (both count the
  // devices CUDA_VISIBLE_DEVICES leaves).
  int supported = 0;
  const CUresult status = reinterpret_cast<DeviceGetAttribute>(fn)(
      &supported, CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED, static_cast<CUdevice>(ordinal));
  if (status != CUDA_SUCCESS)
    return "cuDeviceGetAttribute(MULTICAST_SUPPORTED) failed on device " + std::to_string(ordinal);
  if (!supported)
    return "device " + std::to_string(ordinal) + " reports no multicast support";
  return "";
}

}  // namespace jax_moe
