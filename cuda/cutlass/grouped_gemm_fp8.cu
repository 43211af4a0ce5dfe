// fp8 x fp8 grouped GEMM with DeepSeek-V3's block scales (w8a8), on CUTLASS's Hopper
// ptr-array kernel with blockwise scaling (TMA loads, warp-specialized cooperative wgmma, the
// f32 partial sum of every 128-deep K block scaled and accumulated in registers). Contract:
// cuda/cutlass/grouped_gemm.cuh. Why CUTLASS and not tokamax: tokamax 0.0.17 has no fp8 x fp8
// kernel for sm90 (it dequantizes fp8 activations to bf16 first) and its weight-only fp8
// kernel writes 64-column tiles (docs/perf-notes.md, "Expert GEMMs with fp8 weights").
//
// The group sizes live on the device, so the per-group arguments CUTLASS reads (problem shape,
// operand pointers, strides, scale layouts) are built by a kernel (`prepare_kernel`) into the
// workspace, and CUTLASS's host side never sees a group's size (its "device problem shapes
// only" mode). The same kernel moves the scales into the layout this CUTLASS kernel reads
// for sm90: M-major within a group for x's, N-major within a group for w's.
#include <cub/block/block_scan.cuh>

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
#include "cutlass/util/packed_stride.hpp"

namespace jax_moe {
namespace {

constexpr int kBlock = kGroupedGemmFp8Block;

// ---- the CUTLASS kernel ------------------------------------------------------------------
using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;  // (M, N, K)
using GroupShape = ProblemShape::UnderlyingProblemShape;

using ElementA = cutlass::float_e4m3_t;  // x codes [M, K]: K contiguous
using LayoutA = cutlass::layout::RowMajor;
using ElementB = cutlass::float_e4m3_t;  // w codes [N, K] per group: K contiguous
using LayoutB = cutlass::layout::ColumnMajor;
using ElementD = cutlass::bfloat16_t;    // y [M, N]: N contiguous
using LayoutD = cutlass::layout::RowMajor;
constexpr int kAlignA = 16, kAlignB = 16, kAlignD = 8;  // 16-byte TMA units, in elements

using TileShape = cute::Shape<cute::_128, cute::_128, cute::_128>;
using ClusterShape = cute::Shape<cute::_1, cute::_1, cute::_1>;
// One scale per row of x and per 128 K; one per 128 x 128 block of w. sm90's kernel reads
// both M/N-major (scales of consecutive rows adjacent), hence the transposes below.
using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, kBlock, kBlock>;
using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());

using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float,
    void, LayoutD*, kAlignD,  // no source operand C
    ElementD, LayoutD*, kAlignD, cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative,
    cutlass::epilogue::fusion::LinearCombination<ElementD, float, void, float>>::CollectiveOp;

using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA,
    cute::tuple<LayoutA*, LayoutSFA*>, kAlignA, ElementB, cute::tuple<LayoutB*, LayoutSFB*>,
    kAlignB, float, TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<
        static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
    cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise>::CollectiveOp;

using GemmKernel =
    cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;

using StrideA = typename GemmKernel::InternalStrideA;
using StrideB = typename GemmKernel::InternalStrideB;
using StrideD = typename GemmKernel::InternalStrideD;

// ---- workspace ---------------------------------------------------------------------------
// [shapes G][ptr_a G][ptr_b G][ptr_sfa G][ptr_sfb G][ptr_d G][stride_a G][stride_b G]
// [stride_d G][layout_sfa G][layout_sfb G][sfa M*KB f32][sfb G*KB*NB f32][CUTLASS's own],
// every piece starting on a 256-byte boundary. sfa: group g's scales at rows' offset
// start_g * KB, as [KB][m_g] (M-major); sfb: group g's at g * KB * NB, as [KB][NB] (N-major).
constexpr size_t kAlign = 256;
constexpr size_t align_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

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

Workspace carve(char* base, int64_t groups, int64_t m, int64_t n, int64_t k, size_t cutlass_bytes) {
  Workspace w{};
  size_t at = 0;
  auto take = [&](auto*& ptr, size_t count) {
    using T = std::remove_reference_t<decltype(*ptr)>;
    ptr = base == nullptr ? nullptr : reinterpret_cast<T*>(base + at);
    at += align_up(count * sizeof(T));
  };
  const int64_t kb = k / kBlock, nb = n / kBlock;
  take(w.shapes, groups);
  take(w.ptr_a, groups);
  take(w.ptr_b, groups);
  take(w.ptr_sfa, groups);
  take(w.ptr_sfb, groups);
  take(w.ptr_d, groups);
  take(w.stride_a, groups);
  take(w.stride_b, groups);
  take(w.stride_d, groups);
  take(w.layout_sfa, groups);
  take(w.layout_sfb, groups);
  take(w.sfa, m * kb);
  take(w.sfb, groups * kb * nb);
  w.cutlass = base == nullptr ? nullptr : base + at;
  w.bytes = at + align_up(cutlass_bytes);
  return w;
}

typename Gemm::Arguments gemm_arguments(const Workspace& w, int32_t groups, int32_t sm_count,
                                        int32_t device) {
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
  auto& fusion = args.epilogue.thread;
  fusion.alpha = 1.0f;
  fusion.beta = 0.0f;
  return args;
}

size_t cutlass_workspace_bytes(int32_t groups, int32_t sm_count) {
  const Workspace none = carve(nullptr, groups, 0, 0, 0, 0);
  return Gemm::get_workspace_size(gemm_arguments(none, groups, sm_count, 0));
}

// ---- the argument-building kernel ------------------------------------------------------------
constexpr int kPrepThreads = 256;
using PrepScan = cub::BlockScan<int32_t, kPrepThreads>;

// Every block: the groups' starts (clamped prefix sums of the sizes) into shared memory
// (starts[G] = the rows covered). Block 0 then writes the per-group arguments; all blocks share
// the scale transposes (grid-stride over x's and then w's scales).
__global__ void __launch_bounds__(kPrepThreads)
prepare_kernel(GroupedGemmFp8Args a, Workspace w) {
  extern __shared__ int32_t starts[];  // [G + 1]
  __shared__ typename PrepScan::TempStorage scan;
  const int32_t g_count = a.groups, m = static_cast<int32_t>(a.m);
  const int32_t n = static_cast<int32_t>(a.n), k = static_cast<int32_t>(a.k);
  const int32_t kb = k / kBlock, nb = n / kBlock;

  int32_t running = 0;
  for (int32_t base = 0; base < g_count; base += kPrepThreads) {
    const int32_t g = base + static_cast<int32_t>(threadIdx.x);
    const int32_t size = g < g_count ? max(a.group_sizes[g], 0) : 0;
    int32_t before, chunk;
    PrepScan(scan).ExclusiveSum(size, before, chunk);
    // sizes are int32 and so is M: clamp before adding so a huge size cannot wrap
    if (g < g_count) starts[g] = static_cast<int32_t>(cute::min(int64_t{running} + before, int64_t{m}));
    running = static_cast<int32_t>(cute::min(int64_t{running} + chunk, int64_t{m}));
    __syncthreads();  // `scan` is reused by the next chunk
  }
  if (threadIdx.x == 0) starts[g_count] = running;
  __syncthreads();
  const int32_t total = starts[g_count];

  if (blockIdx.x == 0) {
    for (int32_t g = threadIdx.x; g < g_count; g += kPrepThreads) {
      const int32_t start = starts[g], rows = starts[g + 1] - start;
      // An empty group gets null operand pointers, as CUTLASS's own grouped examples do.
      const bool empty = rows == 0;
      w.shapes[g] = GroupShape{rows, n, k};
      w.ptr_a[g] = empty ? nullptr
                         : static_cast<const ElementA*>(a.x_codes) + int64_t{start} * k;
      w.ptr_b[g] = static_cast<const ElementB*>(a.w_codes) + int64_t{g} * n * k;
      w.ptr_sfa[g] = empty ? nullptr : w.sfa + int64_t{start} * kb;
      w.ptr_sfb[g] = w.sfb + int64_t{g} * kb * nb;
      w.ptr_d[g] = empty ? nullptr : static_cast<ElementD*>(a.y) + int64_t{start} * n;
      w.stride_a[g] = cutlass::make_cute_packed_stride(StrideA{}, {rows, k, 1});
      w.stride_b[g] = cutlass::make_cute_packed_stride(StrideB{}, {n, k, 1});
      w.stride_d[g] = cutlass::make_cute_packed_stride(StrideD{}, {rows, n, 1});
      w.layout_sfa[g] = ScaleConfig::tile_atom_to_shape_SFA(cute::make_shape(rows, n, k, 1));
      w.layout_sfb[g] = ScaleConfig::tile_atom_to_shape_SFB(cute::make_shape(rows, n, k, 1));
    }
  }

  const int64_t stride = int64_t{gridDim.x} * kPrepThreads;
  const int64_t first = int64_t{blockIdx.x} * kPrepThreads + threadIdx.x;
  // x scales [M, KB] -> group g's [KB][m_g] at start_g * KB (reads coalesced along K blocks)
  const int64_t sfa_count = int64_t{total} * kb;
  for (int64_t e = first; e < sfa_count; e += stride) {
    const int32_t r = static_cast<int32_t>(e / kb), b = static_cast<int32_t>(e % kb);
    // the last group starting at or before r (empty groups share their start with the next)
    int32_t lo = 0, hi = g_count - 1;
    while (lo < hi) {
      const int32_t mid = (lo + hi + 1) / 2;
      if (starts[mid] <= r) lo = mid; else hi = mid - 1;
    }
    const int32_t start = starts[lo], rows = starts[lo + 1] - start;
    w.sfa[int64_t{start} * kb + int64_t{b} * rows + (r - start)] = a.x_scales[e];
  }
  // w scales [G, NB, KB] -> [G][KB][NB]
  const int64_t sfb_count = int64_t{g_count} * nb * kb;
  for (int64_t e = first; e < sfb_count; e += stride) {
    const int64_t g = e / (int64_t{nb} * kb), within = e % (int64_t{nb} * kb);
    const int64_t row = within / kb, b = within % kb;
    w.sfb[g * nb * kb + b * nb + row] = a.w_scales[e];
  }
}

}  // namespace

size_t grouped_gemm_fp8_workspace_bytes(int32_t groups, int64_t m, int64_t n, int64_t k,
                                        int32_t sm_count) {
  return carve(nullptr, groups, m, n, k, cutlass_workspace_bytes(groups, sm_count)).bytes;
}

cudaError_t launch_grouped_gemm_fp8(const GroupedGemmFp8Args& a, const char** detail,
                                    cudaStream_t stream) {
  auto refuse = [&](const char* why) {
    if (detail != nullptr) *detail = why;
    return cudaErrorInvalidValue;
  };
  if (a.groups < 1 || a.m < 0 || a.n % kBlock != 0 || a.k % kBlock != 0 || a.n <= 0 ||
      a.k <= 0 || a.m > INT32_MAX || a.n > INT32_MAX || a.k > INT32_MAX)
    return refuse("grouped GEMM: needs groups >= 1, N and K positive multiples of 128, "
                  "M, N, K < 2^31");
  const size_t cutlass_bytes = cutlass_workspace_bytes(a.groups, a.sm_count);
  const Workspace w = carve(static_cast<char*>(a.workspace), a.groups, a.m, a.n, a.k,
                            cutlass_bytes);
  if (a.workspace_bytes < w.bytes) return refuse("grouped GEMM: workspace too small");

  const size_t shared = (static_cast<size_t>(a.groups) + 1) * sizeof(int32_t);
  if (shared > 48 * 1024) return refuse("grouped GEMM: more than 12287 groups");
  // enough blocks to spread the x-scale transpose; every block rescans the group sizes
  const int64_t work = a.m * (a.k / kBlock) + int64_t{a.groups} * (a.n / kBlock) * (a.k / kBlock);
  const int blocks = static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>(2 * std::max(a.sm_count, 1),
                                             (work + 8 * kPrepThreads - 1) / (8 * kPrepThreads))));
  prepare_kernel<<<blocks, kPrepThreads, shared, stream>>>(a, w);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
  if (a.m == 0) return cudaSuccess;

  Gemm gemm;
  const typename Gemm::Arguments args = gemm_arguments(w, a.groups, a.sm_count, a.device);
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

}  // namespace jax_moe
