// The NVLS gate: whether NVLink multicast may be used on a device. Every path that would
// create a multicast object asks it first, and nothing multicast is called when it refuses.
#pragma once

#include <string>

namespace jax_moe {

// Why NVLS must not be used on local device `ordinal`, or "" when it may. Refuses, in this
// order and before touching any multicast API: NCCL_NVLS_ENABLE=0, NVSHMEM_DISABLE_NVLS=1,
// TORCH_SYMM_MEM_DISABLE_MULTICAST=1 (the switches other libraries honour, read at each call),
// a driver without cuDeviceGetAttribute, and a device whose
// CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED is 0.
std::string nvls_refusal(int ordinal);

}  // namespace jax_moe
