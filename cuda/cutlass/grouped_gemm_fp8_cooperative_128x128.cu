// One tile config of the fp8 grouped GEMM (cuda/cutlass/grouped_gemm_fp8.cuh): two consumer
// warpgroups share each 128 x 128 tile.
#include "cuda/cutlass/grouped_gemm_fp8.cuh"

namespace jax_moe::fp8gemm {

const Fp8ConfigOps kCooperative128x128Ops = GroupedGemmFp8<
    cute::Shape<cute::_128, cute::_128, cute::_128>,
    cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise,
    cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>::ops();

}  // namespace jax_moe::fp8gemm
