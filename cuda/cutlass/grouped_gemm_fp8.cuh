// fp8 x fp8 grouped GEMM with DeepSeek-V3's block scales (w8a8) on CUTLASS's Hopper ptr-array
// kernels with blockwise scaling (TMA loads, warp-specialized wgmma; the partial sum of every
// 128-deep K block is scaled and added in f32 registers: Hopper's fp8 wgmma keeps only ~14
// significant bits while it accumulates, so CUTLASS promotes each block). Contract:
// cuda/cutlass/grouped_gemm.cuh. Why CUTLASS and not tokamax: tokamax 0.0.17 has no fp8 x fp8
// kernel for sm90 (it dequantizes fp8 activations to bf16 first) and its weight-only fp8
// kernel writes 64-column tiles (docs/perf-notes.md, "Expert GEMMs with fp8 weights").
//
// What every tile config shares lives here: operand types, the scale layouts, the workspace
// and the argument-building kernel's outputs. grouped_gemm_fp8.cu builds the arguments and
// picks the config; grouped_gemm_fp8_<config>.cu each compile one CUTLASS kernel
// (`Fp8ConfigOps` below), in files of their own so the build compiles them in parallel.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "cuda/cutlass/grouped_gemm.cuh"
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/dispatch_policy.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"

namespace jax_moe::fp8gemm {

constexpr int kBlock = kGroupedGemmFp8Block;

using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;  // (M, N, K)
using GroupShape = ProblemShape::UnderlyingProblemShape;

using ElementA = cutlass::float_e4m3_t;  // x codes [M, K]: K contiguous
using LayoutA = cutlass::layout::RowMajor;
using ElementB = cutlass::float_e4m3_t;  // w codes [N, K] per group: K contiguous
using LayoutB = cutlass::layout::ColumnMajor;
using ElementD = cutlass::bfloat16_t;    // y [M, N]: N contiguous
using LayoutD = cutlass::layout::RowMajor;
constexpr int kAlignA = 16, kAlignB = 16, kAlignD = 8;  // 16-byte TMA units, in elements

using StrideA = cute::remove_pointer_t<cutlass::gemm::TagToStrideA_t<LayoutA*>>;
using StrideB = cute::remove_pointer_t<cutlass::gemm::TagToStrideB_t<LayoutB*>>;
using StrideD = cute::remove_pointer_t<cutlass::gemm::TagToStrideC_t<LayoutD*>>;

// One scale per row of x and per 128 K; one per 128 x 128 block of w. sm90's kernel reads
// both M/N-major (the scales of consecutive rows adjacent), hence the transposes that
// grouped_gemm_fp8.cu makes into the workspace.
using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, kBlock, kBlock>;
using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());

// The workspace: [shapes G][ptr_a G][ptr_b G][ptr_sfa G][ptr_sfb G][ptr_d G][stride_a G]
// [stride_b G][stride_d G][layout_sfa G][layout_sfb G][sfa M*KB f32][sfb G*KB*NB f32]
// [CUTLASS's own], every piece on a 256-byte boundary. sfa: group g's x scales at rows'
// offset start_g * KB, as [KB][m_g] (M-major); sfb: group g's w scales at g * KB * NB, as
// [KB][NB] (N-major).
struct Workspace {
  GroupShape* shapes;
  const ElementA** ptr_a;
  const ElementB** ptr_b;
  const float** ptr_sfa;
  const float** ptr_sfb;
  ElementD** ptr_d;
  StrideA* stride_a;
  StrideB* stride_b;
  StrideD* stride_d;
  LayoutSFA* layout_sfa;
  LayoutSFB* layout_sfb;
  float* sfa;
  float* sfb;
  void* cutlass;
  size_t bytes;  // all of the above, CUTLASS's part included
};

// The pieces of a workspace at `base` (null: only `bytes`, for sizing).
Workspace carve(char* base, int64_t groups, int64_t m, int64_t n, int64_t k,
                size_t cutlass_bytes);

// One compiled CUTLASS kernel: its workspace need and its launch on a prepared workspace.
struct Fp8ConfigOps {
  size_t (*cutlass_workspace_bytes)(int32_t groups, int32_t sm_count);
  cudaError_t (*run)(const Workspace& w, const GroupedGemmFp8Args& a, const char** detail,
                     cudaStream_t stream);
};
extern const Fp8ConfigOps kCooperative128x128Ops;
extern const Fp8ConfigOps kPingpong64x128Ops;

// The CUTLASS kernel of one tile config; `ops()` is what grouped_gemm_fp8.cu calls.
template <class TileShape, class KernelSchedule, class EpilogueSchedule>
struct GroupedGemmFp8 {
  using ClusterShape = cute::Shape<cute::_1, cute::_1, cute::_1>;
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      void, LayoutD*, kAlignD,  // no source operand C
      ElementD, LayoutD*, kAlignD, EpilogueSchedule,
      cutlass::epilogue::fusion::LinearCombination<ElementD, float, void, float>>::CollectiveOp;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA,
      cute::tuple<LayoutA*, LayoutSFA*>, kAlignA, ElementB, cute::tuple<LayoutB*, LayoutSFB*>,
      kAlignB, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<
          static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;
  using Kernel =
      cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  static_assert(std::is_same_v<typename Kernel::InternalStrideA, StrideA> &&
                std::is_same_v<typename Kernel::InternalStrideB, StrideB> &&
                std::is_same_v<typename Kernel::InternalStrideD, StrideD>,
                "the workspace's stride types must be the kernel's");

  static typename Gemm::Arguments arguments(const Workspace& w, int32_t groups,
                                            int32_t sm_count, int32_t device) {
    cutlass::KernelHardwareInfo hw;
    hw.device_id = device;
    hw.sm_count = sm_count;
    typename Gemm::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGrouped,
        {groups, w.shapes, nullptr},  // device problem shapes only
        {w.ptr_a, w.stride_a, w.ptr_b, w.stride_b, w.ptr_sfa, w.layout_sfa, w.ptr_sfb,
         w.layout_sfb},
        {{}, nullptr, w.stride_d, w.ptr_d, w.stride_d},
        hw};
    args.epilogue.thread.alpha = 1.0f;
    args.epilogue.thread.beta = 0.0f;
    return args;
  }

  static size_t cutlass_workspace_bytes(int32_t groups, int32_t sm_count) {
    const Workspace none = carve(nullptr, groups, 0, 0, 0, 0);
    return Gemm::get_workspace_size(arguments(none, groups, sm_count, 0));
  }

  static cudaError_t run(const Workspace& w, const GroupedGemmFp8Args& a, const char** detail,
                         cudaStream_t stream) {
    auto refuse = [&](const char* why) {
      if (detail != nullptr) *detail = why;
      return cudaErrorInvalidValue;
    };
    Gemm gemm;
    const auto args = arguments(w, a.groups, a.sm_count, a.device);
    if (gemm.can_implement(args) != cutlass::Status::kSuccess)
      return refuse("grouped GEMM: CUTLASS cannot implement this problem");
    if (gemm.initialize(args, w.cutlass, stream) != cutlass::Status::kSuccess)
      return refuse("grouped GEMM: CUTLASS initialize failed");
    if (gemm.run(stream) != cutlass::Status::kSuccess) {
      const cudaError_t err = cudaGetLastError();
      return err != cudaSuccess ? err : refuse("grouped GEMM: CUTLASS run failed");
    }
    return cudaGetLastError();
  }

  static constexpr Fp8ConfigOps ops() { return {&cutlass_workspace_bytes, &run}; }
};

}  // namespace jax_moe::fp8gemm
