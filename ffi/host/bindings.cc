// Python bindings of the host backend (declared in ffi/native_host.h); used by
// jax_moe/backends/host.py.
#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>

#include <vector>

#include "cuda/nvlink_layout.cuh"
#include "ffi/host/state.h"
#include "ffi/moe_dims.h"
#include "ffi/native_host.h"

namespace nb = nanobind;

namespace jax_moe {

void bind_host(nb::module_& m) {
  m.def(
      "host_create_rank",
      [](int64_t comm_id, int ordinal, int rank, int world, int max_tokens, int hidden, int topk,
         int num_experts, int block_size, int expert_padding, int capacity, bool fp8,
         bool reduce_expert, bool partial_bf16, double timeout_s) {
        host::create_host_rank(comm_id, ordinal,
                               moe_dims(rank, world, max_tokens, hidden, topk, num_experts,
                                        block_size, expert_padding, capacity, fp8, reduce_expert,
                                        partial_bf16),
                               timeout_s);
      },
      nb::arg("comm_id"), nb::arg("ordinal"), nb::arg("rank"), nb::arg("world"),
      nb::arg("max_tokens"), nb::arg("hidden"), nb::arg("topk"), nb::arg("num_experts"),
      nb::arg("block_size"), nb::arg("expert_padding"), nb::arg("capacity"), nb::arg("fp8"),
      nb::arg("reduce_expert"), nb::arg("partial_bf16"), nb::arg("timeout_s"),
      "Allocates the buffer of one rank of a host communicator on CPU device `ordinal`.");
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
      "protocol_enums",
      [] {
        // The values Python mirrors (jax_moe/errors.py, jax_moe/all_reduce.py), from the enums
        // of cuda/layout.cuh; tests/test_protocol_enums.py holds the two sides together.
        nb::dict codes, stages, algorithms, out;
        codes["INVALID_EXPERT_ID"] = int(kInvalidExpertId);
        codes["CAPACITY_OVERFLOW"] = int(kCapacityOverflow);
        codes["TIMEOUT"] = int(kTimeout);
        codes["BAD_NUM_TOKENS"] = int(kBadNumTokens);
        codes["CALL_ORDER"] = int(kCallOrder);
        stages["DISPATCH_SEND"] = int(kStageDispatchSend);
        stages["DISPATCH_RECV"] = int(kStageDispatchRecv);
        stages["COMBINE_SEND"] = int(kStageCombineSend);
        stages["COMBINE_RECV"] = int(kStageCombineRecv);
        stages["ALL_REDUCE_ONE_SHOT"] = int(kStageAllReduceOneShot);
        stages["ALL_REDUCE_SCATTER"] = int(kStageAllReduceScatter);
        stages["ALL_REDUCE_GATHER"] = int(kStageAllReduceGather);
        stages["ALL_REDUCE_NVLS"] = int(kStageAllReduceNvls);
        stages["PROXY"] = int(kStageProxy);
        algorithms["one_shot"] = int(kOneShot);
        algorithms["two_shot"] = int(kTwoShot);
        algorithms["nvls"] = int(kNvls);
        out["ErrorCode"] = codes;
        out["Stage"] = stages;
        out["AllReduceAlgorithm"] = algorithms;
        return out;
      },
      "The protocol's enums as {enum: {name: value}} (cuda/layout.cuh).");
  m.def(
      "buffer_bytes",
      [](int world, int max_tokens, int hidden, int topk, int num_experts, int block_size,
         int expert_padding, int capacity, bool fp8, bool reduce_expert, bool partial_bf16,
         int chunks) {
        const MoeDims d = moe_dims(0, world, max_tokens, hidden, topk, num_experts, block_size,
                                   expert_padding, capacity, fp8, reduce_expert, partial_bf16);
        nb::dict out;
        out["nvlink"] = nvlink_layout(d, chunks).total;  // cuda/nvlink_layout.cuh
        out["host"] = buffer_layout(d).total;            // cuda/layout.cuh (host protocol)
        return out;
      },
      nb::arg("world"), nb::arg("max_tokens"), nb::arg("hidden"), nb::arg("topk"),
      nb::arg("num_experts"), nb::arg("block_size"), nb::arg("expert_padding"),
      nb::arg("capacity"), nb::arg("fp8"), nb::arg("reduce_expert"), nb::arg("partial_bf16"),
      nb::arg("chunks"),
      "Bytes of one rank's communication buffer in each protocol's layout: 'nvlink' (the cuda "
      "kernels, both parities) and 'host' (the host backend and the cuda host proxies).");
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
