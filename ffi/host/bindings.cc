// Python bindings of the host backend (declared in ffi/native_host.h); used by
// jax_moe/backends/host.py.
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <vector>

#include "ffi/host/staging_extents.h"
#include "ffi/host/state.h"
#include "ffi/native_host.h"
#include "ffi/native_protocol.h"

namespace nb = nanobind;

namespace jax_moe {

void bind_host(nb::module_& m) {
  m.def(
      "host_create_rank",
      [](int64_t comm_id, int ordinal, const MoeDims& dims, double timeout_s, bool shared) {
        check_dims(dims);
        host::create_host_rank(comm_id, ordinal, dims, timeout_s, shared);
      },
      nb::arg("comm_id"), nb::arg("ordinal"), nb::arg("dims"), nb::arg("timeout_s"),
      nb::arg("shared") = false,
      "Allocates the buffer of one rank of a host communicator on CPU device `ordinal`; "
      "`shared`: in shared memory that ranks in other processes of this host map.");
  m.def("host_shared_name", &host::host_shared_name, nb::arg("comm_id"), nb::arg("ordinal"),
        "The name other processes of this host map the rank's shared buffer by.");
  m.def("host_map_near", &host::map_near_rank, nb::arg("comm_id"), nb::arg("ordinal"),
        nb::arg("peer"), nb::arg("name"),
        "Maps the shared buffer of rank `peer` (another process of this host) for the rank.");
  m.def("host_unlink_shared", &host::unlink_host_shared, nb::arg("comm_id"), nb::arg("ordinal"),
        "Removes the name of the rank's shared buffer (every near rank mapped it).");
  m.def("host_connect_rank", &host::connect_host_rank, nb::arg("comm_id"), nb::arg("ordinal"),
        nb::arg("ordinals"),
        "Points the rank at every rank's buffer: rank p lives on CPU device ordinals[p].");
  m.def(
      "host_take_error",
      [](int64_t comm_id, int ordinal) -> nb::object {
        ErrorRecord e{};
        if (!host::take_host_error(comm_id, ordinal, &e)) return nb::none();
        return nb::make_tuple(e.code, e.stage, e.rank, e.detail);
      },
      nb::arg("comm_id"), nb::arg("ordinal"),
      "(code, stage, rank, detail) of the recorded error, cleared; None when none.");
  m.def("host_set_threads", &host::set_host_threads, nb::arg("comm_id"), nb::arg("ordinal"),
        nb::arg("threads"), "Threads of the rank's row loops (1 to 64; default 1).");
  m.def("host_destroy_rank", &host::destroy_host_rank, nb::arg("comm_id"), nb::arg("ordinal"),
        "Frees the rank's buffer.");
  m.def(
      "host_staging_bytes",
      [](const MoeDims& dims, bool rows_on_device) {
        check_dims(dims);
        return host::staging_bytes(dims, host::page_size(), rows_on_device);
      },
      nb::arg("dims"), nb::arg("rows_on_device") = false,
      "Bytes rank dims.rank commits for its staging copy of one remote rank's buffer "
      "(ffi/host/staging_extents.h: what it writes there, in whole pages; only its routes "
      "when its rows leave from device staging, JAX_MOE_PROXY_HMEM).");
  m.def(
      "host_device_staging_ranges",
      [](const MoeDims& dims) {
        check_dims(dims);
        std::vector<std::pair<size_t, size_t>> out;
        for (const ByteRange& r : host::device_staging_ranges(dims))
          out.emplace_back(r.offset, r.length);
        return out;
      },
      nb::arg("dims"),
      "[(buffer offset, bytes)] a cuda proxy rank dims.rank allocates for its device staging "
      "copy of one remote rank's buffer (ffi/host/staging_extents.h, JAX_MOE_PROXY_HMEM).");
}

void add_host_targets(nb::dict& targets) {
  auto capsule = [](XLA_FFI_Error* (*fn)(XLA_FFI_CallFrame*)) {
    return nb::capsule(reinterpret_cast<void*>(fn));
  };
  targets["jax_moe_dispatch_send"] = capsule(HostDispatchSendFfi);
  targets["jax_moe_dispatch_recv"] = capsule(HostDispatchRecvFfi);
  targets["jax_moe_dispatch"] = capsule(HostDispatchFfi);
  targets["jax_moe_combine_send"] = capsule(HostCombineSendFfi);
  targets["jax_moe_combine_recv"] = capsule(HostCombineRecvFfi);
  targets["jax_moe_combine"] = capsule(HostCombineFfi);
}

}  // namespace jax_moe
