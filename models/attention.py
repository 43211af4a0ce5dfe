"""Grouped-query causal attention over an optional KV cache (softmax in f32, as HF eager).

Dimension letters: B batch, S query positions, T key positions, N query heads, K kv heads,
G = N / K query heads per kv head, H head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def gqa_attention(q_bsnh, k_btkh, v_btkh, q_positions_bs, kv_positions_t, scale: float):
  """softmax(q k^T * scale + causal mask) v; query at position p sees keys at positions <= p.

  Scores and softmax in f32, probabilities cast back to the value dtype before the second
  matmul (what transformers' eager attention does).
  """
  B, S, N, H = q_bsnh.shape
  K = k_btkh.shape[2]
  q_bskgh = q_bsnh.reshape(B, S, K, N // K, H)
  scores = jnp.einsum("bskgh,btkh->bkgst", q_bskgh, k_btkh,
                      preferred_element_type=jnp.float32) * scale
  visible_bst = kv_positions_t[None, None, :] <= q_positions_bs[:, :, None]
  scores = jnp.where(visible_bst[:, None, None], scores, -jnp.inf)
  probs = jax.nn.softmax(scores, axis=-1).astype(v_btkh.dtype)
  out = jnp.einsum("bkgst,btkh->bskgh", probs, v_btkh, preferred_element_type=jnp.float32)
  return out.astype(q_bsnh.dtype).reshape(B, S, N, H)


def update_kv(cache_k_btkh, cache_v_btkh, k_bskh, v_bskh, index):
  """Writes the new keys/values at positions [index, index + S) of the cache."""
  start = (0, index, 0, 0)
  return (jax.lax.dynamic_update_slice(cache_k_btkh, k_bskh.astype(cache_k_btkh.dtype), start),
          jax.lax.dynamic_update_slice(cache_v_btkh, v_bskh.astype(cache_v_btkh.dtype), start))
