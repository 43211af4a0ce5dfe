// Python bindings of the protocol's shared pieces (declared in ffi/native_protocol.h).
#include <nanobind/nanobind.h>

#include <stdexcept>
#include <string>

#include "ffi/native_protocol.h"
#include "ffi/protocol/host_layout.h"
#include "ffi/protocol/nvlink_layout.h"

namespace nb = nanobind;

namespace jax_moe {

void check_dims(const MoeDims& d) {
  auto fail = [](const std::string& what) { throw nb::value_error(("MoeDims: " + what).c_str()); };
  if (d.world < 1) fail("world must be >= 1, got " + std::to_string(d.world));
  if (d.rank < 0 || d.rank >= d.world)
    fail("rank must be in [0, world = " + std::to_string(d.world) + "), got " +
         std::to_string(d.rank));
  if (d.local_experts * d.world != d.num_experts)
    fail("local_experts (" + std::to_string(d.local_experts) + ") x world (" +
         std::to_string(d.world) + ") must be num_experts (" + std::to_string(d.num_experts) +
         ")");
  if (d.max_tokens < 1 || d.hidden < 1 || d.topk < 1 || d.block_size < 1 ||
      d.expert_padding < 1 || d.capacity < 1)
    fail("max_tokens, hidden, topk, block_size, expert_padding and capacity must be >= 1");
}

void bind_protocol(nb::module_& m) {
  // One field per MoeDims member, under its C++ name: Python sets them by name, so the struct
  // is the one definition of what a rank is told.
  nb::class_<MoeDims>(m, "MoeDims", "ffi/protocol/dims.h MoeDims: the sizes of one rank")
      .def(nb::init<>())
      .def_rw("world", &MoeDims::world)
      .def_rw("rank", &MoeDims::rank)
      .def_rw("max_tokens", &MoeDims::max_tokens)
      .def_rw("hidden", &MoeDims::hidden)
      .def_rw("topk", &MoeDims::topk)
      .def_rw("num_experts", &MoeDims::num_experts)
      .def_rw("local_experts", &MoeDims::local_experts)
      .def_rw("block_size", &MoeDims::block_size)
      .def_rw("expert_padding", &MoeDims::expert_padding)
      .def_rw("capacity", &MoeDims::capacity)
      .def_rw("fp8", &MoeDims::fp8)
      .def_rw("reduce_expert", &MoeDims::reduce_expert)
      .def_rw("partial_bf16", &MoeDims::partial_bf16);
  m.def(
      "protocol_enums",
      [] {
        // The values Python mirrors (jax_moe/errors.py, jax_moe/all_reduce.py), from the enums
        // of ffi/protocol/dims.h; tests/test_protocol_enums.py holds the two sides together.
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
      "The protocol's enums as {enum: {name: value}} (ffi/protocol/dims.h).");
  m.def(
      "buffer_bytes",
      [](const MoeDims& d, int chunks) {
        check_dims(d);
        nb::dict out;
        out["nvlink"] = nvlink_layout(d, chunks).total;  // ffi/protocol/nvlink_layout.h
        out["host"] = buffer_layout(d).total;            // ffi/protocol/host_layout.h
        return out;
      },
      nb::arg("dims"), nb::arg("chunks"),
      "Bytes of one rank's communication buffer in each protocol's layout: 'nvlink' (the cuda "
      "kernels, both parities) and 'host' (the host backend and the cuda host proxies).");
}

}  // namespace jax_moe
