"""RoutedExperts (dispatch -> ragged_dot SwiGLU -> combine) against a dense numpy MoE.

Bounds: "exact" moves f32 unrounded, so only f32 matmul-order error remains (1e-5 of the
output scale). "bf16"/"fp8": the reference applies the same input rounding (bf16 tokens, or
fp8 quantization as docs/semantics.md specifies); what is left is the bf16 rounding of the
hidden activation, of each expert output and of the combined sum, each at most 2^-9
relative, bounded together by 2^-7 * M with M[t] = sum_k |w[t,k]| * (|h| @ |W_down|).
A lost, duplicated or misrouted row is off by O(M).
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

import jax_moe as jm
from jax_moe.models.moe import CommunicatorPool, RoutedExperts, join_f32, split_f32
from jax_moe.models.sharding import ShardingRules


def _experts(mesh, dtype, wire, backend="xla", E=16, D=128, F=32, K=4, seed=0,
             shared_expert=False):
  rules = ShardingRules(mesh)
  layer = RoutedExperts(E, D, F, experts_per_token=K, rules=rules,
                        pool=CommunicatorPool(rules, backend), dtype=dtype, wire=wire,
                        shared_expert=shared_expert)
  rng = np.random.default_rng(seed)
  graphdef, state = nnx.split(layer)
  weights = {}
  for path, variable in nnx.to_flat_state(state):
    abstract = variable.get_value()
    value = (rng.standard_normal(abstract.shape) / np.sqrt(abstract.shape[1])).astype(np.float32)
    value = np.asarray(jnp.asarray(value, dtype).astype(jnp.float32))  # what the layer holds
    weights[path[-1]] = value
    variable.set_value(jax.device_put(jnp.asarray(value, dtype), abstract.sharding))
  return nnx.merge(graphdef, state), weights


def _routing(rng, T, E, K):
  ids = np.stack([rng.permutation(E)[:K] for _ in range(T)]).astype(np.int32)
  w = rng.random((T, K)).astype(np.float32)
  return ids, w / w.sum(-1, keepdims=True)


def _dense(x, ids, w, weights, round_h):
  """out[t] = sum_k w[t,k] silu(x W_g) * (x W_u) W_d of expert ids[t,k], in f64; and M.
  `round_h` rounds to the model dtype: x W_g, x W_u (the GEMMs write the rows' dtype) and h."""
  T, K = ids.shape
  out = np.zeros((T, weights["w_down_efd"].shape[-1]))
  magnitude = np.zeros_like(out)
  for t in range(T):
    for k in range(K):
      e = ids[t, k]
      if e < 0:  # slot unused
        continue
      gate = round_h(x[t].astype(np.float64) @ weights["w_gate_up_ed2f"][e][:, 0])
      up = round_h(x[t].astype(np.float64) @ weights["w_gate_up_ed2f"][e][:, 1])
      h = gate / (1 + np.exp(-gate)) * up
      h = round_h(h)
      out[t] += w[t, k] * (h @ weights["w_down_efd"][e])
      magnitude[t] += abs(w[t, k]) * (np.abs(h) @ np.abs(weights["w_down_efd"][e]))
  return out, magnitude


# 1100 tokens on 4 devices: a prefill-sized call (275 per shard), combined in "expert" mode
# with bf16 partials (moe.EXPERT_REDUCE_MIN_TOKENS).
@pytest.mark.parametrize("wire,devices,tokens", [
    ("exact", None, 13), ("exact", 1, 5), ("bf16", None, 3), ("bf16", 4, 16), ("fp8", None, 9),
    ("bf16", 4, 1100)])
def test_routed_experts_match_dense(mesh_of, ep_mesh, backend, rng, wire, devices, tokens):
  """devices None: all of them (8 CPU devices, or the GPUs)."""
  mesh = ep_mesh if devices is None else mesh_of(devices)
  dtype = jnp.float32 if wire == "exact" else jnp.bfloat16
  layer, weights = _experts(mesh, dtype, wire, backend)
  ids, w = _routing(rng, tokens, 16, 4)
  x = rng.standard_normal((tokens, 128)).astype(np.float32)
  if wire == "exact":
    x_seen, round_h = x, lambda h: h
  else:
    x = np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))
    x_seen = x
    if wire == "fp8":  # the tokens the experts see: quantized as docs/semantics.md says
      x_seen = np.asarray(jm.dequantize_fp8(*jm.quantize_fp8(jnp.asarray(x, jnp.bfloat16)),
                                            dtype=jnp.float32))
    round_h = lambda h: h.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)
  layer.pool.prepare(tokens)
  out = np.asarray(jax.jit(layer)(jnp.asarray(x, dtype), jnp.asarray(ids), jnp.asarray(w)),
                   np.float64)
  layer.pool.check()
  ref, magnitude = _dense(x_seen, ids, w, weights, round_h)
  if wire == "exact":
    np.testing.assert_allclose(out, ref, rtol=0, atol=1e-5 * np.abs(ref).max())
  else:
    excess = np.abs(out - ref) - 2.0 ** -7 * magnitude
    assert excess.max() <= 0, f"{wire}: error over the bound by {excess.max():.3g}"


@pytest.mark.parametrize("wire,devices,tokens", [
    ("bf16", 1, 7), ("bf16", 4, 16), ("fp8", None, 9), ("bf16", 4, 1100)])
def test_shared_expert_slot_matches_dense(mesh_of, ep_mesh, backend, rng, wire, devices, tokens):
  """shared_expert=True: slot s * (L + 1) of the weights is shard s's shared expert (drawn
  apart here, so the reference sees which copy a token reached: its own shard's), every real
  token goes to it with weight 1 besides its routed slots (some -1)."""
  mesh = ep_mesh if devices is None else mesh_of(devices)
  layer, weights = _experts(mesh, jnp.bfloat16, wire, backend, shared_expert=True)
  E, K, L = layer.num_experts, layer.experts_per_token, layer.experts_per_shard
  assert weights["w_down_efd"].shape[0] == E + layer.rules.expert_size
  ids, w = _routing(rng, tokens, E, K)
  ids[rng.random(ids.shape) < 0.2] = -1
  x = np.asarray(jnp.asarray(rng.standard_normal((tokens, 128)), jnp.bfloat16), np.float32)
  x_seen = x
  if wire == "fp8":
    x_seen = np.asarray(jm.dequantize_fp8(*jm.quantize_fp8(jnp.asarray(x, jnp.bfloat16)),
                                          dtype=jnp.float32))
  layer.pool.prepare(tokens)
  out = np.asarray(jax.jit(layer)(jnp.asarray(x, jnp.bfloat16), jnp.asarray(ids),
                                  jnp.asarray(w)), np.float64)
  layer.pool.check()
  own = (np.arange(tokens) // layer.tokens_per_group(tokens)) * (L + 1)
  slot_ids = np.where(ids >= 0, ids + ids // L + 1, -1)
  ref, magnitude = _dense(x_seen, np.concatenate([slot_ids, own[:, None]], 1).astype(np.int32),
                          np.concatenate([w, np.ones((tokens, 1), np.float32)], 1), weights,
                          lambda h: h.astype(np.float32).astype(ml_dtypes.bfloat16)
                          .astype(np.float64))
  excess = np.abs(out - ref) - 2.0 ** -7 * magnitude
  assert excess.max() <= 0, f"{wire}: error over the bound by {excess.max():.3g}"


def test_prefill_sized_calls_combine_in_expert_mode_with_bf16_partials(mesh_of):
  layer, _ = _experts(mesh_of(4), jnp.bfloat16, "bf16")
  prefill, decode = layer.moe_config(4 * 256), layer.moe_config(4 * 255)
  assert (prefill.combine_reduce, prefill.partial_dtype) == ("expert", jnp.dtype(jnp.bfloat16))
  assert (decode.combine_reduce, decode.partial_dtype) == ("source", jnp.dtype(jnp.float32))
  one_rank, _ = _experts(mesh_of(1), jnp.bfloat16, "bf16")
  assert one_rank.moe_config(4096).combine_reduce == "source"  # nothing to save on one rank


def test_split_f32_is_exact(rng):
  x = (rng.standard_normal(4096) * 10.0 ** rng.uniform(-30, 30, 4096)).astype(np.float32)
  parts = split_f32(jnp.asarray(x))
  assert parts.dtype == jnp.bfloat16 and parts.shape == (3 * 4096,)
  np.testing.assert_array_equal(np.asarray(join_f32(parts)), x)


def test_bad_routing_shapes_are_rejected(mesh_of):
  layer, _ = _experts(mesh_of(2), jnp.float32, "exact")
  with pytest.raises(ValueError, match="topk_ids"):
    layer(jnp.zeros((4, 128)), jnp.zeros((4, 3), jnp.int32), jnp.zeros((4, 3)))


def test_missing_communicator_under_jit_says_prepare(mesh_of):
  layer, _ = _experts(mesh_of(2), jnp.float32, "exact")
  ids = jnp.zeros((6, 4), jnp.int32)
  with pytest.raises(RuntimeError, match="prepare"):
    jax.jit(layer)(jnp.zeros((6, 128)), ids, jnp.ones((6, 4)))
  layer.pool.prepare(6)
  assert jax.jit(layer)(jnp.zeros((6, 128)), ids, jnp.ones((6, 4))).shape == (6, 128)


@pytest.mark.parametrize("name", ("tiny-qwen3-moe", "tiny-deepseek-v3"))
def test_routing_runs_on_each_device_without_collectives(name):
  """The router's top_k runs per shard (ShardingRules.rowwise): XLA's partitioner would
  all-gather its operand over the batch, one collective per MoE layer."""
  import re

  from jax_moe import models
  if len(jax.devices()) < 8:
    pytest.skip("needs 8 devices")
  model = models.tiny(name, backend="xla", dtype=jnp.float32)
  ids = jnp.zeros((8, 4), jnp.int32)
  hlo = jax.jit(lambda i: models.forward(model, i)).lower(ids).compile().as_text()
  assert not re.findall(r"= \S+ all-gather\(", hlo)
