// Launchers of the grouped GEMMs built on CUTLASS (compiled only when the build finds CUTLASS's
// headers; JAX_MOE_WITH_CUTLASS). Plain pointers, sizes and a stream; no CUTLASS type leaks
// into this header, so the FFI handlers compile without CUTLASS.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace jax_moe {

// The scale block of the fp8 grouped GEMM: one f32 scale per 128 elements of K for each row of
// x, one per 128 x 128 (n, k) block of each group's weight (DeepSeek-V3's checkpoint format).
inline constexpr int kGroupedGemmFp8Block = 128;

// Tile configs of the fp8 grouped GEMM (CUTLASS kernel schedule, CTA tile M x N, K step 128,
// one CTA per cluster). Python reads the names through cutlass_grouped_gemm_fp8_configs().
enum GroupedGemmFp8Config : int32_t {
  kFp8Cooperative128x128 = 0,  // two consumer warpgroups share a 128 x 128 tile
  kFp8Pingpong64x128 = 1,      // two consumer warpgroups alternate 64 x 128 tiles
  kFp8ConfigCount = 2,
  // (128 x 256 tiles do not compile: CUTLASS 4.2's sm90 blockwise kernel wants one w scale
  // per N tile)
};
const char* grouped_gemm_fp8_config_name(int32_t config);  // null when out of range

// y[rows of group g] = dequant(x[rows of group g]) @ dequant(w[g])^T, for
//   x_codes   e4m3 [M, K], x_scales f32 [M, K/128] (row m, K block b: x_scales[m * K/128 + b])
//   w_codes   e4m3 [G, N, K] (each group's weight as a linear layer stores it: [out, in])
//   w_scales  f32 [G, N/128, K/128]
//   group_sizes int32 [G] (device): group g covers rows [s_g, s_g + size_g) clamped to [0, M],
//             negative sizes count as 0
//   y         bf16 [M, N]; rows past the groups are not written
//   workspace `workspace_bytes` bytes of device memory (>= grouped_gemm_fp8_workspace_bytes)
// K and N multiples of 128. Each 128-deep K block's partial sum is scaled by x's row scale
// times w's block scale and added in f32, then rounded once to bf16. Two kernels on `stream`:
// one that builds every group's CUTLASS arguments on the device (so group sizes never reach
// the host) and the CUTLASS kernel, whose persistent grid has `sm_count` CTAs at most.
struct GroupedGemmFp8Args {
  const void* x_codes;
  const float* x_scales;
  const void* w_codes;
  const float* w_scales;
  const int32_t* group_sizes;
  void* y;
  void* workspace;
  size_t workspace_bytes;
  int64_t m, n, k;
  int32_t groups;
  int32_t sm_count;
  int32_t device;
  int32_t config;  // a GroupedGemmFp8Config
};

// Device memory a launch with these sizes needs (the groups' arguments, the scales in the
// kernel's layout, CUTLASS's per-SM descriptors) on a grid of `sm_count` SMs; 0 for a config
// out of range.
size_t grouped_gemm_fp8_workspace_bytes(int32_t config, int32_t groups, int64_t m, int64_t n,
                                        int64_t k, int32_t sm_count);

// Returns the first CUDA error; `detail` (may be null) gets a message for failures that are
// not CUDA errors (bad sizes, CUTLASS refusing the problem), with cudaErrorInvalidValue.
cudaError_t launch_grouped_gemm_fp8(const GroupedGemmFp8Args& args, const char** detail,
                                    cudaStream_t stream);

}  // namespace jax_moe
