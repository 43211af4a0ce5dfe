// NVLS: the gate and the multicast object of an AllReduce group (see multicast.h). The driver
// is reached through ffi/cuda/driver.h because libcuda is not linked.
#include "ffi/cuda/multicast.h"

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <stdexcept>
#include <utility>

#include "ffi/cuda/driver.h"
#include "ffi/cuda/state.h"

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
  void* fn = driver_entry_point("cuDeviceGetAttribute", 12000);
  if (fn == nullptr) return "the CUDA driver has no cuDeviceGetAttribute";
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

namespace {

// Driver entry points of the multicast and virtual-memory calls (libcuda is not linked).
template <typename Fn>
Fn driver_entry(const char* name) {
  void* fn = driver_entry_point(name, 12010);
  if (fn == nullptr) {
    throw std::runtime_error(std::string("AllReduce(algorithm='nvls'): the CUDA driver has no ") +
                             name);
  }
  return reinterpret_cast<Fn>(fn);
}
#define JAX_MOE_DRIVER(fn) driver_entry<decltype(&fn)>(#fn)

struct Driver {
  decltype(&cuDeviceGet) device_get = JAX_MOE_DRIVER(cuDeviceGet);
  decltype(&cuMulticastGetGranularity) granularity = JAX_MOE_DRIVER(cuMulticastGetGranularity);
  decltype(&cuMulticastCreate) create = JAX_MOE_DRIVER(cuMulticastCreate);
  decltype(&cuMulticastAddDevice) add_device = JAX_MOE_DRIVER(cuMulticastAddDevice);
  decltype(&cuMulticastBindMem) bind = JAX_MOE_DRIVER(cuMulticastBindMem);
  decltype(&cuMulticastUnbind) unbind = JAX_MOE_DRIVER(cuMulticastUnbind);
  decltype(&cuMemCreate) mem_create = JAX_MOE_DRIVER(cuMemCreate);
  decltype(&cuMemRelease) release = JAX_MOE_DRIVER(cuMemRelease);
  decltype(&cuMemAddressReserve) reserve = JAX_MOE_DRIVER(cuMemAddressReserve);
  decltype(&cuMemAddressFree) address_free = JAX_MOE_DRIVER(cuMemAddressFree);
  decltype(&cuMemMap) map = JAX_MOE_DRIVER(cuMemMap);
  decltype(&cuMemUnmap) unmap = JAX_MOE_DRIVER(cuMemUnmap);
  decltype(&cuMemSetAccess) set_access = JAX_MOE_DRIVER(cuMemSetAccess);
};
#undef JAX_MOE_DRIVER

void check_driver(CUresult status, const char* what) {
  if (status != CUDA_SUCCESS)
    throw std::runtime_error(std::string("AllReduce(algorithm='nvls'): ") + what +
                             " failed with CUresult " + std::to_string(int(status)));
}

// One multicast object and what is bound to and mapped from it; each step is recorded as it
// succeeds so that release() undoes exactly those.
struct NvlsGroup {
  std::vector<int> ordinals;
  std::vector<CUdevice> devices;
  size_t size = 0;
  CUmemGenericAllocationHandle multicast_handle = 0;
  bool created = false;
  std::vector<CUmemGenericAllocationHandle> memory;  // per rank
  size_t bound = 0;                                  // ranks bound to the multicast object
  std::vector<CUdeviceptr> unicast;                  // per rank, reserved
  size_t unicast_mapped = 0;
  CUdeviceptr multicast = 0;
  bool multicast_mapped = false;
};

void release(const Driver& d, NvlsGroup& g) {
  // Best effort, in reverse order; the devices are synchronized first so no kernel still uses
  // the memory.
  for (int o : g.ordinals) {
    cudaSetDevice(o);
    cudaDeviceSynchronize();
  }
  if (g.multicast_mapped) d.unmap(g.multicast, g.size);
  if (g.multicast) d.address_free(g.multicast, g.size);
  for (size_t r = 0; r < g.unicast.size(); ++r) {
    if (r < g.unicast_mapped) d.unmap(g.unicast[r], g.size);
    d.address_free(g.unicast[r], g.size);
  }
  for (size_t r = 0; r < g.bound; ++r) d.unbind(g.multicast_handle, g.devices[r], 0, g.size);
  for (CUmemGenericAllocationHandle h : g.memory) d.release(h);
  if (g.created) d.release(g.multicast_handle);
  cudaGetLastError();
}

CUmemAccessDesc read_write(int ordinal) {
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = ordinal;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  return access;
}

void build(const Driver& d, NvlsGroup& g, size_t bytes) {
  const unsigned R = static_cast<unsigned>(g.ordinals.size());
  for (int o : g.ordinals) {
    CUdevice dev;
    check_driver(d.device_get(&dev, o), "cuDeviceGet");
    g.devices.push_back(dev);
  }
  CUmulticastObjectProp prop{};
  prop.numDevices = R;
  prop.size = bytes;
  prop.handleTypes = 0;  // this process only
  size_t granularity = 0;
  check_driver(d.granularity(&granularity, &prop, CU_MULTICAST_GRANULARITY_RECOMMENDED),
               "cuMulticastGetGranularity");
  g.size = (bytes + granularity - 1) / granularity * granularity;
  prop.size = g.size;
  check_driver(d.create(&g.multicast_handle, &prop), "cuMulticastCreate");
  g.created = true;
  for (CUdevice dev : g.devices)
    check_driver(d.add_device(g.multicast_handle, dev), "cuMulticastAddDevice");
  // Every device joins before any memory is bound.
  std::vector<CUmemAccessDesc> everyone;
  for (unsigned r = 0; r < R; ++r) {
    CUmemAllocationProp memory{};
    memory.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    memory.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    memory.location.id = g.ordinals[r];
    CUmemGenericAllocationHandle handle;
    check_driver(d.mem_create(&handle, g.size, &memory, 0), "cuMemCreate");
    g.memory.push_back(handle);
    check_driver(d.bind(g.multicast_handle, 0, handle, 0, g.size, 0), "cuMulticastBindMem");
    g.bound = r + 1;
    CUdeviceptr address;
    check_driver(d.reserve(&address, g.size, granularity, 0, 0), "cuMemAddressReserve");
    g.unicast.push_back(address);
    check_driver(d.map(address, g.size, 0, handle, 0), "cuMemMap(unicast)");
    g.unicast_mapped = r + 1;
    const CUmemAccessDesc mine = read_write(g.ordinals[r]);
    check_driver(d.set_access(address, g.size, &mine, 1), "cuMemSetAccess(unicast)");
    everyone.push_back(mine);
  }
  check_driver(d.reserve(&g.multicast, g.size, granularity, 0, 0), "cuMemAddressReserve");
  check_driver(d.map(g.multicast, g.size, 0, g.multicast_handle, 0), "cuMemMap(multicast)");
  g.multicast_mapped = true;
  check_driver(d.set_access(g.multicast, g.size, everyone.data(), everyone.size()),
               "cuMemSetAccess(multicast)");
}

std::mutex nvls_mutex;
std::map<int64_t, std::vector<NvlsGroup>>& nvls_groups() {
  static auto* groups = new std::map<int64_t, std::vector<NvlsGroup>>();
  return *groups;
}

}  // namespace

void setup_nvls(int64_t comm_id, const std::vector<int>& ordinals) {
  if (ordinals.empty()) throw std::invalid_argument("AllReduce(algorithm='nvls'): no devices");
  // The gate, for every device, before anything multicast.
  for (int o : ordinals) {
    const std::string why = nvls_refusal(o);
    if (!why.empty()) throw std::invalid_argument("AllReduce(algorithm='nvls') refused: " + why);
  }
  std::vector<CudaRankState*> states;
  for (size_t r = 0; r < ordinals.size(); ++r) {
    CudaRankState* s = find_rank_state(comm_id, ordinals[r]);
    if (s == nullptr || !s->all_reduce || s->dims.rank != int(r) ||
        s->dims.world != int(ordinals.size()))
      throw std::invalid_argument("AllReduce(algorithm='nvls'): device " +
                                  std::to_string(ordinals[r]) + " holds no rank " +
                                  std::to_string(r) + " of AllReduce comm_id=" +
                                  std::to_string(comm_id));
    states.push_back(s);
  }
  const Driver d;
  NvlsGroup g;
  g.ordinals = ordinals;
  try {
    build(d, g, 4 * states[0]->all_reduce->layout.slot_bytes);  // in[h] and out[h], h = 0, 1
  } catch (...) {
    release(d, g);
    throw;
  }
  for (size_t r = 0; r < states.size(); ++r) {
    states[r]->all_reduce->multicast = reinterpret_cast<char*>(g.multicast);
    states[r]->all_reduce->multicast_local = reinterpret_cast<char*>(g.unicast[r]);
  }
  std::lock_guard<std::mutex> lock(nvls_mutex);
  nvls_groups()[comm_id].push_back(std::move(g));
}

void teardown_nvls(int64_t comm_id) {
  std::vector<NvlsGroup> groups;
  {
    std::lock_guard<std::mutex> lock(nvls_mutex);
    auto it = nvls_groups().find(comm_id);
    if (it == nvls_groups().end()) return;
    groups = std::move(it->second);
    nvls_groups().erase(it);
  }
  const Driver d;
  for (NvlsGroup& g : groups) {
    for (int o : g.ordinals) {
      CudaRankState* s = find_rank_state(comm_id, o);
      if (s && s->all_reduce) s->all_reduce->multicast = s->all_reduce->multicast_local = nullptr;
    }
    release(d, g);
  }
}

}  // namespace jax_moe
