// Python bindings of the CUDA backend (state setup, peer mapping, error record, teardown, the
// NVLS gate)
// and its FFI target capsules. Declared in ffi/native_cuda.h; used by jax_moe/backends/cuda.py.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <vector>

#include "ffi/cuda/handlers.h"
#include "ffi/cuda/multicast.h"
#include "ffi/cuda/state.h"
#include "ffi/native_cuda.h"
#include "ffi/native_protocol.h"
#include "ffi/protocol/stage_clock.h"

namespace nb = nanobind;

namespace jax_moe {

void bind_cuda(nb::module_& m) {
  m.def(
      "cuda_create_rank",
      [](int64_t comm_id, int ordinal, const MoeDims& dims, double timeout_s, bool proxy,
         int chunks, bool stage_clocks, bool stream_wait, bool near_rows_device,
         bool remote_rows_device) {
        check_dims(dims);
        if (proxy)
          create_proxy_rank_state(comm_id, ordinal, dims, timeout_s, stream_wait,
                                  DeviceRows{near_rows_device, remote_rows_device});
        else create_rank_state(comm_id, ordinal, dims, chunks, timeout_s, stage_clocks);
      },
      nb::arg("comm_id"), nb::arg("ordinal"), nb::arg("dims"), nb::arg("timeout_s"),
      nb::arg("proxy") = false, nb::arg("chunks") = 0, nb::arg("stage_clocks") = false,
      nb::arg("stream_wait") = true, nb::arg("near_rows_device") = false,
      nb::arg("remote_rows_device") = false,
      "Allocates the buffers of one rank of a CUDA communicator on local device `ordinal` "
      "(NVLink protocol of `chunks` token chunks, equal on every rank; with `stage_clocks` "
      "also the kernels' per-block stage timestamps); with `proxy`, the pinned staging and "
      "doorbell of its host proxy instead (the host rank state of the same ids then does the "
      "exchange; `stream_wait`: the stream waits for the proxy with stream memory operations, "
      "else a kernel spins; `near_rows_device`: rows from ranks of this host land in device "
      "memory that those ranks map, cuda_connect_rank before cuda_start_proxy; "
      "`remote_rows_device`: rows from ranks on other hosts land there too, written by the "
      "TransferEngine (host_open_remote with cuda_device_rows).");
  m.def(
      "cuda_device_rows",
      [](int64_t comm_id, int ordinal, const std::vector<int>& remote_ranks) {
        const RemoteDeviceRows rows = stage_remote_device_rows(comm_id, ordinal, remote_ranks);
        std::vector<std::vector<uintptr_t>> staging;
        for (const std::vector<char*>& copy : rows.staging) {
          staging.emplace_back();
          for (char* range : copy) staging.back().push_back(reinterpret_cast<uintptr_t>(range));
        }
        return nb::make_tuple(reinterpret_cast<uintptr_t>(rows.buffer), staging);
      },
      nb::arg("comm_id"), nb::arg("ordinal"), nb::arg("remote_ranks"),
      "(device buffer, [[memory of each device staging range] per remote rank]) of a proxy "
      "rank made with remote_rows_device, as device addresses: what host_open_remote "
      "registers with FI_HMEM (the staging copies are made here, once).");
  m.def(
      "cuda_stage_clocks",
      [](int64_t comm_id, int ordinal) -> nb::object {
        int grid = 0;
        const std::vector<uint64_t> raw = read_stage_clocks(comm_id, ordinal, &grid);
        if (raw.empty()) return nb::none();
        nb::dict out;
        for (int k = 0; k < kClockKernels; ++k) {
          nb::dict marks;
          for (int m = 0; m < kClockMarks; ++m) {
            std::vector<uint64_t> per_block(grid);
            for (int b = 0; b < grid; ++b)
              per_block[b] = raw[(size_t(k) * grid + b) * kClockMarks + m];
            marks[kClockMarkNames[m]] = per_block;
          }
          out[kClockKernelNames[k]] = marks;
        }
        return out;
      },
      nb::arg("comm_id"), nb::arg("ordinal"),
      "{kernel: {mark: [globaltimer ns per block]}} of the rank's latest dispatch/combine "
      "launches (ffi/protocol/stage_clock.h; 0 where a mark was never reached); None when the rank "
      "was built without stage clocks. Synchronizes the device.");
  m.def("cuda_create_all_reduce_rank", &create_all_reduce_state, nb::arg("comm_id"),
        nb::arg("ordinal"), nb::arg("rank"), nb::arg("world"), nb::arg("max_bytes"),
        nb::arg("timeout_s"),
        "Allocates the buffers of one rank of an AllReduce on local device `ordinal`.");
  m.def("cuda_nvls_refusal", &nvls_refusal, nb::arg("ordinal"),
        "Why NVLS must not be used on device `ordinal`, or '' when it may (no multicast call).");
  m.def("cuda_setup_nvls", &setup_nvls, nb::arg("comm_id"), nb::arg("ordinals"),
        "Gate, then one multicast object over the AllReduce group on local devices `ordinals` "
        "(rank order).");
  m.def("cuda_teardown_nvls", &teardown_nvls, nb::arg("comm_id"),
        "Releases the AllReduce's multicast objects, if any.");
  m.def(
      "cuda_ipc_handle",
      [](int64_t comm_id, int ordinal) {
        const std::string handle = rank_ipc_handle(comm_id, ordinal);
        return nb::bytes(handle.data(), handle.size());
      },
      nb::arg("comm_id"), nb::arg("ordinal"),
      "CUDA IPC handle of the rank's buffer, for peers in other processes.");
  m.def(
      "cuda_connect_rank",
      [](int64_t comm_id, int ordinal, const std::vector<int>& local_ordinals,
         const std::vector<nb::bytes>& ipc_handles) {
        std::vector<std::string> handles;
        for (const nb::bytes& h : ipc_handles) handles.emplace_back(h.c_str(), h.size());
        connect_rank_state(comm_id, ordinal, local_ordinals, handles);
      },
      nb::arg("comm_id"), nb::arg("ordinal"), nb::arg("local_ordinals"), nb::arg("ipc_handles"),
      "Maps every rank's buffer: local_ordinals[p] >= 0 for ranks of this process, else "
      "ipc_handles[p].");
  m.def("cuda_start_proxy", &start_rank_proxy, nb::arg("comm_id"), nb::arg("ordinal"),
        "Starts the proxy thread of a proxy rank; its host rank state must be connected.");
  m.def(
      "cuda_proxy_samples",
      [](int64_t comm_id, int ordinal) {
        std::vector<std::tuple<std::string, int64_t, int64_t, int64_t>> out;
        for (const ProxySample& p : take_proxy_samples(comm_id, ordinal))
          out.emplace_back(proxy_op_name(p.op), p.seen_to_first_post_ns, p.serve_ns,
                           p.since_answer_ns);
        return out;
      },
      nb::arg("comm_id"), nb::arg("ordinal"),
      "(op name, doorbell seen -> first remote write posted ns or -1, doorbell seen -> done "
      "ns, previous request answered -> this doorbell seen ns or -1) of each request the "
      "proxy served since the last call.");
  m.def(
      "cuda_take_error",
      [](int64_t comm_id, int ordinal) -> nb::object {
        ErrorRecord e{};
        if (!take_rank_error(comm_id, ordinal, &e)) return nb::none();
        return nb::make_tuple(e.code, e.stage, e.rank, e.detail);
      },
      nb::arg("comm_id"), nb::arg("ordinal"),
      "(code, stage, rank, detail) of the recorded error, cleared; None when none.");
  m.def("cuda_stop_proxy", &stop_rank_proxy, nb::arg("comm_id"), nb::arg("ordinal"),
        "Stops a proxy rank's thread and releases its host mappings (before host_destroy_rank; "
        "nothing for other ranks).");
  m.def("cuda_destroy_rank", &destroy_rank_state, nb::arg("comm_id"), nb::arg("ordinal"),
        "Synchronizes the device and frees the rank's buffers.");
}

void add_cuda_targets(nb::dict& targets) {
  auto capsule = [](XLA_FFI_Error* (*fn)(XLA_FFI_CallFrame*)) {
    return nb::capsule(reinterpret_cast<void*>(fn));
  };
  targets["jax_moe_dispatch_send"] = capsule(DispatchSendFfi);
  targets["jax_moe_dispatch_recv"] = capsule(DispatchRecvFfi);
  targets["jax_moe_dispatch"] = capsule(DispatchFfi);
  targets["jax_moe_combine_send"] = capsule(CombineSendFfi);
  targets["jax_moe_combine_recv"] = capsule(CombineRecvFfi);
  targets["jax_moe_combine"] = capsule(CombineFfi);
  targets["jax_moe_all_reduce"] = capsule(AllReduceFfi);
  targets["jax_moe_dequantize_fp8"] = capsule(DequantizeFp8Ffi);
}

}  // namespace jax_moe
