"""Model FLOPs of a prefill, the numerator of its fraction of peak (issue 16's prefill target).

Counted as the model defines them, not as a kernel happens to compute them: 2 per
multiply-add of every matmul a token goes through (each dense weight, its top-k routed
experts, not all of them), the LM head on the last position of each sequence only (all that
a prefill keeps; XLA may compute no more), and attention's QK^T and PV over the causal
positions (a token at position p attends p + 1 keys). Norms, activations, rope and routing
arithmetic are left out (well under 1% at the realistic shapes). Custom calls (the exchange,
tokamax's grouped GEMM) are invisible to XLA's cost analysis, so it cannot serve here.

Peak: the dense bf16 tensor-core rate of the device kind, from NVIDIA's datasheets.
"""

from __future__ import annotations

import jax
from flax import nnx

from jax_moe.models.moe import RoutedExperts

# Dense (no sparsity) bf16 tensor-core FLOP/s by device kind substring.
BF16_PEAK_FLOPS = {"H200": 989.4e12, "H100": 989.4e12}


def bf16_peak_flops(device_kind: str) -> float | None:
  for name, flops in BF16_PEAK_FLOPS.items():
    if name in device_kind:
      return flops
  return None


def _routed_layers(model):
  """{path: RoutedExperts} of every routed-experts module in `model`."""
  return {tuple(path): node for path, node in nnx.iter_graph(model)
          if isinstance(node, RoutedExperts)}


def _attention_dims(cfg) -> tuple[int, int, int]:
  """(heads, query-key width, value width) of one layer's attention: MLA's (nope + rope,
  v_head_dim) for DeepSeek-V3, head_dim for both elsewhere."""
  mla = getattr(cfg, "attention", None)
  if mla is not None:
    return mla.num_heads, mla.qk_nope_head_dim + mla.qk_rope_head_dim, mla.v_head_dim
  return cfg.num_attention_heads, cfg.head_dim, cfg.head_dim


def prefill_flops(model, batch: int, seq: int) -> dict:
  """FLOPs of model(input_ids [batch, seq]) from an empty cache, by part."""
  routed = _routed_layers(model)
  tokens = batch * seq
  dense_params = 0
  for path, leaf in jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))[0]:
    keys = tuple(getattr(k, "key", getattr(k, "idx", None)) for k in path)
    if len(leaf.shape) < 2 or any(keys[:len(p)] == p for p in routed):
      continue  # norm weights and biases; routed experts are counted per token below
    if keys[:1] == ("embed_tokens",) or keys[:1] == ("lm_head",):
      continue  # a lookup; the LM head below
    dense_params += leaf.size
  vocab, dim = model.cfg.vocab_size, model.cfg.hidden_size
  heads, qk, v = _attention_dims(model.cfg)
  # a shared expert fused into the routed experts' slots is a dense MLP every token runs
  dense_params += sum(3 * r.dim * r.hidden for r in routed.values() if r.shared_expert)
  parts = {
      "dense": 2 * tokens * dense_params,
      "routed_experts": sum(2 * tokens * r.experts_per_token * 3 * r.dim * r.hidden
                            for r in routed.values()),
      "attention": (2 * batch * heads * (qk + v) * (seq * (seq + 1) // 2)
                    * model.cfg.num_hidden_layers),
      "lm_head": 2 * batch * dim * vocab,
  }
  parts["total"] = sum(parts.values())
  return parts
