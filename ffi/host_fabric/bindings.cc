// Python bindings that give a host rank its remote peers (ffi/host_fabric/fabric_peers.h);
// jax_moe/backends/host_remote.py exchanges what they return through the jax.distributed
// key-value store. Errors are ValueError (bad use) or TransportError (the fabric).
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "ffi/host/state.h"
#include "ffi/host_fabric/fabric_peers.h"
#include "ffi/native_host_fabric.h"

namespace nb = nanobind;

namespace jax_moe {
namespace {

host::HostRankState& rank_state(int64_t comm_id, int ordinal) {
  host::HostRankState* s = host::find_host_rank(comm_id, ordinal);
  if (s == nullptr) {
    throw std::invalid_argument("jax_moe host backend: no rank state for comm_id=" +
                                std::to_string(comm_id) + ", device " + std::to_string(ordinal));
  }
  return *s;
}

host::FabricPeers& fabric_peers(host::HostRankState& s) {
  auto* peers = dynamic_cast<host::FabricPeers*>(s.remote.get());
  if (peers == nullptr) {
    throw std::invalid_argument("jax_moe host backend: rank " + std::to_string(s.dims.rank) +
                                " has no remote peers opened (call host_open_remote first)");
  }
  return *peers;
}

nb::bytes as_bytes(const std::string& s) { return nb::bytes(s.data(), s.size()); }

}  // namespace

void bind_host_fabric(nb::module_& m) {
  m.def(
      "host_open_remote",
      [](int64_t comm_id, int ordinal, const std::vector<int>& remote_ranks,
         const std::string& provider, const std::string& node,
         const std::vector<std::string>& domains, uint64_t shuffle_seed, uintptr_t device_rows,
         const std::vector<std::vector<uintptr_t>>& device_staging, int cuda_device) {
        host::HostRankState& s = rank_state(comm_id, ordinal);
        if (s.remote != nullptr || s.connected) {
          throw std::invalid_argument("jax_moe host backend: rank " +
                                      std::to_string(s.dims.rank) +
                                      " already has its peers connected");
        }
        transport::Config config;
        config.rank = uint32_t(s.dims.rank);
        config.provider = provider;
        config.node = node;
        config.domains = domains;
        config.timeout_s = s.timeout_s;
        config.shuffle_seed = shuffle_seed;
        config.cuda_memory = device_rows != 0;
        host::DeviceRowsMemory device;
        device.buffer = reinterpret_cast<char*>(device_rows);
        for (const std::vector<uintptr_t>& copy : device_staging) {
          device.staging.emplace_back();
          for (uintptr_t range : copy)
            device.staging.back().push_back(reinterpret_cast<char*>(range));
        }
        device.cuda_device = cuda_device;
        auto peers = std::make_unique<host::FabricPeers>(config, s.dims, remote_ranks, s.buffer,
                                                         device);
        nb::tuple card = nb::make_tuple(as_bytes(peers->address()),
                                        as_bytes(peers->buffer_descriptor()),
                                        as_bytes(peers->device_rows_descriptor()));
        s.remote = std::move(peers);
        return card;
      },
      nb::arg("comm_id"), nb::arg("ordinal"), nb::arg("remote_ranks"), nb::arg("provider"),
      nb::arg("node"), nb::arg("domains"), nb::arg("shuffle_seed"), nb::arg("device_rows") = 0,
      nb::arg("device_staging") = std::vector<std::vector<uintptr_t>>{},
      nb::arg("cuda_device") = -1,
      "Opens the TransferEngine of a host rank whose communicator has ranks in other "
      "processes (`remote_ranks`); returns (address card, buffer descriptor, device rows "
      "descriptor or b'') for them. `device_rows`, `device_staging`: a cuda proxy rank's "
      "cuda_device_rows on device `cuda_device` (0 for none): the rows to and from those "
      "ranks move between device memories (FI_HMEM).");
  m.def(
      "host_connect_remote",
      [](int64_t comm_id, int ordinal, int peer, const nb::bytes& card,
         const nb::bytes& descriptor, const nb::bytes& device_rows_descriptor) {
        fabric_peers(rank_state(comm_id, ordinal))
            .connect(peer, std::string(card.c_str(), card.size()),
                     std::string(descriptor.c_str(), descriptor.size()),
                     std::string(device_rows_descriptor.c_str(), device_rows_descriptor.size()));
      },
      nb::arg("comm_id"), nb::arg("ordinal"), nb::arg("peer"), nb::arg("card"),
      nb::arg("descriptor"), nb::arg("device_rows_descriptor"),
      "Connects a host rank to remote rank `peer` (what host_open_remote returned there).");
}

}  // namespace jax_moe
