// MoeDims (cuda/layout.cuh) from the values a backend passes to its *_create_rank binding.
#pragma once

#include "cuda/layout.cuh"

namespace jax_moe {

inline MoeDims moe_dims(int rank, int world, int max_tokens, int hidden, int topk,
                        int num_experts, int block_size, int expert_padding, int capacity,
                        bool fp8, bool reduce_expert, bool partial_bf16) {
  MoeDims d{};
  d.world = world;
  d.rank = rank;
  d.max_tokens = max_tokens;
  d.hidden = hidden;
  d.topk = topk;
  d.num_experts = num_experts;
  d.local_experts = num_experts / world;
  d.block_size = block_size;
  d.expert_padding = expert_padding;
  d.capacity = capacity;
  d.fp8 = fp8;
  d.reduce_expert = reduce_expert;
  d.partial_bf16 = partial_bf16;
  return d;
}

}  // namespace jax_moe
