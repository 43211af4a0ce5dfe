// Python bindings of the TransferEngine (declared in ffi/native_transport.h). Addresses and
// descriptors cross as bytes; buffers as (address, size) pairs that jax_moe/transport.py takes
// from arrays it keeps alive. Blocking calls release the GIL.
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <utility>
#include <vector>

#include "ffi/native_transport.h"
#include "ffi/transport/errors.h"
#include "ffi/transport/immediate.h"
#include "ffi/transport/transfer_engine.h"

namespace nb = nanobind;

namespace jax_moe {
namespace {

using transport::TransferEngine;

std::string as_string(const nb::bytes& b) { return std::string(b.c_str(), b.size()); }

nb::bytes as_bytes(const std::string& s) { return nb::bytes(s.data(), s.size()); }

std::vector<transport::Slice> make_slices(const std::vector<uint64_t>& src_offsets,
                                          const std::vector<uint64_t>& lengths,
                                          const std::vector<uint64_t>& dst_offsets) {
  if (src_offsets.size() != lengths.size() || dst_offsets.size() != lengths.size()) {
    throw transport::TransportError(
        "scatter: src_offsets, lengths and dst_offsets must have one entry per member; got " +
        std::to_string(src_offsets.size()) + ", " + std::to_string(lengths.size()) + ", " +
        std::to_string(dst_offsets.size()));
  }
  std::vector<transport::Slice> slices(lengths.size());
  for (size_t i = 0; i < lengths.size(); ++i) {
    slices[i] = {src_offsets[i], lengths[i], dst_offsets[i]};
  }
  return slices;
}

}  // namespace

void bind_transport(nb::module_& m) {
  nb::exception<transport::TransportError>(m, "TransportError", PyExc_RuntimeError);
  m.attr("transport_max_ranks") = transport::kMaxRanks;
  m.attr("transport_max_tag") = transport::kMaxTag;
  m.attr("transport_max_rails") = transport::kMaxRails;

  using release_gil = nb::call_guard<nb::gil_scoped_release>;
  nb::class_<TransferEngine>(m, "TransferEngine")
      .def(
          "__init__",
          [](TransferEngine* self, uint32_t rank, const std::string& provider,
             const std::string& node, double timeout_s, uint64_t shuffle_seed, bool cuda_memory,
             const std::vector<std::string>& domains) {
            // Aggregate order: the fields of transport::Config as declared.
            new (self) TransferEngine(transport::Config{rank, provider, node, timeout_s,
                                                        shuffle_seed, cuda_memory, domains});
          },
          nb::arg("rank"), nb::arg("provider"), nb::arg("node"), nb::arg("timeout_s"),
          nb::arg("shuffle_seed"), nb::arg("cuda_memory"), nb::arg("domains"))
      .def("address", [](const TransferEngine& e) { return as_bytes(e.address()); })
      .def("facts",
           [](const TransferEngine& e) {
             const transport::FabricFacts& f = e.facts();
             nb::dict d;
             d["provider"] = f.provider;
             d["fabric"] = f.fabric;
             d["domains"] = f.domains;
             d["mr_mode"] = f.mr_mode;
             d["max_msg_size"] = f.max_msg_size;
             d["inject_size"] = f.inject_size;
             d["cuda_memory"] = f.cuda_memory;
             return d;
           })
      .def("add_peer",
           [](TransferEngine& e, const nb::bytes& card) { e.add_peer(as_string(card)); })
      .def("register_memory",
           [](TransferEngine& e, uintptr_t address, uint64_t size, int cuda_device) {
             return e.register_memory(reinterpret_cast<void*>(address), size, cuda_device);
           },
           nb::arg("address"), nb::arg("size"), nb::arg("cuda_device") = -1)
      .def("region_descriptor",
           [](const TransferEngine& e, int region) {
             return as_bytes(e.region_descriptor(region));
           })
      .def("deregister_memory", &TransferEngine::deregister_memory)
      .def("create_group",
           [](TransferEngine& e, const std::vector<std::pair<uint32_t, nb::bytes>>& members) {
             std::vector<std::pair<uint32_t, std::string>> decoded;
             for (const auto& [rank, descriptor] : members) {
               decoded.emplace_back(rank, as_string(descriptor));
             }
             return e.create_group(decoded);
           })
      .def("group_size", &TransferEngine::group_size)
      .def(
          "scatter",
          [](TransferEngine& e, int group, int source, const std::vector<uint64_t>& src_offsets,
             const std::vector<uint64_t>& lengths, const std::vector<uint64_t>& dst_offsets,
             uint32_t tag, double timeout_s) {
            e.scatter(group, source, make_slices(src_offsets, lengths, dst_offsets), tag,
                      timeout_s);
          },
          nb::arg("group"), nb::arg("source"), nb::arg("src_offsets"), nb::arg("lengths"),
          nb::arg("dst_offsets"), nb::arg("tag"), nb::arg("timeout_s") = 0.0, release_gil())
      .def("barrier", &TransferEngine::barrier, release_gil())
      .def("wait", &TransferEngine::wait, release_gil())
      .def("flush", &TransferEngine::flush, release_gil())
      .def("arrived", &TransferEngine::arrived)
      .def("open_regions", &TransferEngine::open_regions)
      .def("rail_writes", &TransferEngine::rail_writes)
      .def("close", &TransferEngine::close, release_gil());
}

}  // namespace jax_moe
