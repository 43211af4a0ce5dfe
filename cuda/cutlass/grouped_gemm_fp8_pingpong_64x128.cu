// One tile config of the fp8 grouped GEMM (cuda/cutlass/grouped_gemm_fp8.cuh): two consumer
// warpgroups take alternate 64 x 128 tiles, one's epilogue overlapping the other's mainloop.
#include "cuda/cutlass/grouped_gemm_fp8.cuh"

namespace jax_moe::fp8gemm {

const Fp8ConfigOps kPingpong64x128Ops = GroupedGemmFp8<
    cute::Shape<cute::_64, cute::_128, cute::_128>,
    cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8Blockwise,
    cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong>::ops();

}  // namespace jax_moe::fp8gemm
