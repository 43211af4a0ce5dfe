// NVLS for the all-reduce: the gate that says whether NVLink multicast may be used on a device,
// and the multicast object of one AllReduce group, built only after the gate allowed every
// device of the group (nothing multicast is called when it refuses).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace jax_moe {

// Why NVLS must not be used on local device `ordinal`, or "" when it may. Refuses, in this
// order and before touching any multicast API: NCCL_NVLS_ENABLE=0, NVSHMEM_DISABLE_NVLS=1,
// TORCH_SYMM_MEM_DISABLE_MULTICAST=1 (the switches other libraries honour, read at each call),
// a driver without cuDeviceGetAttribute, and a device whose
// CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED is 0.
std::string nvls_refusal(int ordinal);

// Builds one multicast object over the AllReduce group whose rank r is driven by this process
// on device ordinals[r] (every rank in this process: sharing a multicast object with another
// process needs exported handles, not built), binds an [2][2][slot_bytes] region of each
// device to it, and stores both mappings in the ranks' states (CudaRankState::multicast,
// multicast_local). Throws std::invalid_argument when the gate refuses any device, before any
// multicast call; std::runtime_error on a driver failure, after undoing what was done.
// Written and compiled, never run: the machines it was developed on forbid multicast.
void setup_nvls(int64_t comm_id, const std::vector<int>& ordinals);

// Synchronizes the devices, then unmaps and releases every multicast object of `comm_id`
// and clears the ranks' pointers. A no-op when there is none.
void teardown_nvls(int64_t comm_id);

}  // namespace jax_moe
