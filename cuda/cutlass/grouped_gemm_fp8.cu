// The fp8 grouped GEMM's launcher (cuda/cutlass/grouped_gemm.cuh): the kernel that builds the
// groups' CUTLASS arguments on the device, then the chosen config's CUTLASS kernel.
//
// The group sizes live on the device, so the per-group arguments CUTLASS reads (problem shape,
// operand pointers, strides, scale layouts) are built by `prepare_kernel` into the workspace,
// and CUTLASS's host side never sees a group's size (its "device problem shapes only" mode).
// The same kernel moves the scales into the layout this CUTLASS kernel reads for sm90: M-major
// within a group for x's, N-major within a group for w's.
#include <cub/block/block_scan.cuh>

#include <algorithm>

#include "cuda/cutlass/grouped_gemm_fp8.cuh"
#include "cutlass/util/packed_stride.hpp"

namespace jax_moe {
namespace fp8gemm {
namespace {

constexpr size_t kAlign = 256;
constexpr size_t align_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

const Fp8ConfigOps* config_ops(int32_t config) {
  switch (config) {
    case kFp8Cooperative128x128: return &kCooperative128x128Ops;
    case kFp8Pingpong64x128: return &kPingpong64x128Ops;
    default: return nullptr;
  }
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
    if (g < g_count)
      starts[g] = static_cast<int32_t>(cute::min(int64_t{running} + before, int64_t{m}));
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

Workspace carve(char* base, int64_t groups, int64_t m, int64_t n, int64_t k,
                size_t cutlass_bytes) {
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

}  // namespace fp8gemm

const char* grouped_gemm_fp8_config_name(int32_t config) {
  switch (config) {
    case kFp8Cooperative128x128: return "cooperative_128x128";
    case kFp8Pingpong64x128: return "pingpong_64x128";
    default: return nullptr;
  }
}

size_t grouped_gemm_fp8_workspace_bytes(int32_t config, int32_t groups, int64_t m, int64_t n,
                                        int64_t k, int32_t sm_count) {
  const fp8gemm::Fp8ConfigOps* ops = fp8gemm::config_ops(config);
  if (ops == nullptr) return 0;
  return fp8gemm::carve(nullptr, groups, m, n, k, ops->cutlass_workspace_bytes(groups, sm_count))
      .bytes;
}

cudaError_t launch_grouped_gemm_fp8(const GroupedGemmFp8Args& a, const char** detail,
                                    cudaStream_t stream) {
  using namespace fp8gemm;
  auto refuse = [&](const char* why) {
    if (detail != nullptr) *detail = why;
    return cudaErrorInvalidValue;
  };
  const Fp8ConfigOps* ops = config_ops(a.config);
  if (ops == nullptr) return refuse("grouped GEMM: unknown config");
  if (a.groups < 1 || a.m < 0 || a.n % kBlock != 0 || a.k % kBlock != 0 || a.n <= 0 ||
      a.k <= 0 || a.m > INT32_MAX || a.n > INT32_MAX || a.k > INT32_MAX)
    return refuse("grouped GEMM: needs groups >= 1, N and K positive multiples of 128, "
                  "M, N, K < 2^31");
  const Workspace w = carve(static_cast<char*>(a.workspace), a.groups, a.m, a.n, a.k,
                            ops->cutlass_workspace_bytes(a.groups, a.sm_count));
  if (a.workspace_bytes < w.bytes) return refuse("grouped GEMM: workspace too small");

  const size_t shared = (static_cast<size_t>(a.groups) + 1) * sizeof(int32_t);
  if (shared > 48 * 1024) return refuse("grouped GEMM: more than 12287 groups");
  // enough blocks to spread the scale transposes; every block rescans the group sizes
  const int64_t work =
      a.m * (a.k / kBlock) + int64_t{a.groups} * (a.n / kBlock) * (a.k / kBlock);
  const int blocks = static_cast<int>(std::max<int64_t>(
      1, std::min<int64_t>(2 * std::max(a.sm_count, 1),
                           (work + 8 * kPrepThreads - 1) / (8 * kPrepThreads))));
  prepare_kernel<<<blocks, kPrepThreads, shared, stream>>>(a, w);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
  if (a.m == 0) return cudaSuccess;
  return ops->run(w, a, detail, stream);
}

}  // namespace jax_moe
