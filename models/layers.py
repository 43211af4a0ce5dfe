"""Building blocks shared by the models, numerically as Hugging Face's Qwen3/Llama do them.

Weights are stored `[in, out]` (x @ w), so a torch `nn.Linear.weight [out, in]` is
transposed on load. Parameters are abstract until the loader fills them (see sharding.py).
Tensor parallelism is Megatron's: a column-parallel Linear (out sharded over tp) needs no
communication, a row-parallel one (in sharded) gives partial sums that `row_parallel` adds
over tp with the model's AllReduce (`pool.tp_sum`).
Dimension letters: B batch, S sequence, T tokens, D hidden, F mlp, V vocab, N heads,
K kv heads, H head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_moe.models.sharding import ShardingRules, param


class RMSNorm(nnx.Module):
  """y = weight * (x / rms(x)) with the normalisation in f32, cast back before the scale (HF)."""

  def __init__(self, dim: int, eps: float, *, rules: ShardingRules, dtype, logical_axis="embed"):
    self.eps = float(eps)
    self.weight = param(rules, (dim,), (logical_axis,), dtype)

  def __call__(self, x):
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return self.weight[...] * x32.astype(x.dtype)


class Embedding(nnx.Module):
  """Token embedding table [V, D]; `attend` is the tied output projection x @ table.T."""

  def __init__(self, vocab: int, dim: int, *, rules: ShardingRules, dtype):
    self.table_vd = param(rules, (vocab, dim), ("vocab", "embed"), dtype)

  def __call__(self, ids):
    return jnp.take(self.table_vd[...], ids, axis=0)

  def attend(self, x_btd):
    return jnp.einsum("...d,vd->...v", x_btd, self.table_vd[...])


class Linear(nnx.Module):
  """y = x @ w (+ b), w [in, out]."""

  def __init__(self, dim_in: int, dim_out: int, *, rules: ShardingRules, dtype,
               logical_axes=("embed", "mlp"), bias: bool = False):
    self.w = param(rules, (dim_in, dim_out), logical_axes, dtype)
    self.b = param(rules, (dim_out,), logical_axes[1:], dtype) if bias else None

  def __call__(self, x):
    y = jnp.einsum("...i,io->...o", x, self.w[...])
    return y + self.b[...] if self.b is not None else y


def row_parallel(linear: Linear, x, pool):
  """linear(x) on one device's rows of w (x the matching columns), inside
  `ShardingRules.per_device`: the partial products summed over tp (`pool.tp_sum`), then the
  bias, once."""
  y = pool.tp_sum(jnp.einsum("...i,io->...o", x, linear.w[...]))
  return y + linear.b[...] if linear.b is not None else y


class DenseMLP(nnx.Module):
  """SwiGLU MLP: down(silu(x @ gate) * (x @ up)); gate and up column-parallel, down
  row-parallel over tp (the hidden units split, where they divide by tp)."""

  def __init__(self, dim: int, hidden: int, *, rules: ShardingRules, pool, dtype):
    self.rules, self.pool = rules, pool  # pool: the model's CommunicatorPool (its AllReduce)
    # Hidden units that do not divide by tp stay whole on every rank: nothing to sum then.
    self.tp_sharded = rules.is_sharded(hidden, "mlp")
    self.w_gate_df = param(rules, (dim, hidden), ("embed", "mlp"), dtype)
    self.w_up_df = param(rules, (dim, hidden), ("embed", "mlp"), dtype)
    self.w_down_fd = param(rules, (hidden, dim), ("mlp", "embed"), dtype)

  def __call__(self, x_bsd):
    """x [B, ..., D] with the batch data-parallel (replicated over tp)."""
    spec = self.rules.spec_for(x_bsd.shape, ("batch",) + (None,) * (x_bsd.ndim - 1))
    return self.rules.per_device(DenseMLP._local, self, x_bsd, in_specs=(spec,),
                                 out_specs=spec)

  def _local(self, x_bsd):
    gate = jnp.einsum("...d,df->...f", x_bsd, self.w_gate_df[...])
    up = jnp.einsum("...d,df->...f", x_bsd, self.w_up_df[...])
    y = jnp.einsum("...f,fd->...d", jax.nn.silu(gate) * up, self.w_down_fd[...])
    return self.pool.tp_sum(y) if self.tp_sharded else y


# ------------------------------------------------------------------------------------ RoPE
def rope_inv_freq(rotary_dim: int, theta: float) -> np.ndarray:
  """[rotary_dim / 2] f32 inverse frequencies theta^(-2i/rotary_dim), as HF's default rope."""
  exponents = np.arange(0, rotary_dim, 2, dtype=np.int64).astype(np.float32) / rotary_dim
  return (1.0 / (np.float32(theta) ** exponents)).astype(np.float32)


def rope_cos_sin(positions_bs, inv_freq_h, dtype, attention_scaling: float = 1.0):
  """cos, sin [B, S, rotary_dim] of positions [B, S]; halves repeated (rotate-half layout)."""
  freqs_bsh = positions_bs.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq_h)[None, None]
  emb = jnp.concatenate([freqs_bsh, freqs_bsh], axis=-1)
  cos = (jnp.cos(emb) * attention_scaling).astype(dtype)
  sin = (jnp.sin(emb) * attention_scaling).astype(dtype)
  return cos, sin


def rotate_half(x):
  x1, x2 = jnp.split(x, 2, axis=-1)
  return jnp.concatenate([-x2, x1], axis=-1)


def apply_rope(x_bsnh, cos_bsh, sin_bsh):
  """Standard (non-interleaved) RoPE on the last dim of x [B, S, N, H] (HF apply_rotary_pos_emb)."""
  cos, sin = cos_bsh[:, :, None, :], sin_bsh[:, :, None, :]
  return x_bsnh * cos + rotate_half(x_bsnh) * sin
