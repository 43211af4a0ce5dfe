"""Absorbed MLA attention of one decode step as one kernel (Pallas, Triton on GPU).

In the absorbed form (mla.py) every head of a step's query attends to the same keys: the
cache's latents c [S, C] and rotary keys k_r [S, R], the latents also being the values.
That is multi-query attention with a (C + R)-wide key and a C-wide value:

  scores_hs = (q_latent_h . c_s + q_rope_h . k_r_s) * scale   (f32),   s < num_keys
  out_h = sum_s softmax(scores_h)_s c_s

Written as einsums (`reference`, what mla.py ran before) XLA runs four GEMMs and a softmax
per layer and writes the [B, H, S] scores and the probabilities to memory in between: ~40 us
a layer at DeepSeek-V3's shape with batch 128 and a 65-row cache (H = 128, C = 512;
results/decode-realistic-71a65b9/). The kernel reads q once, the visible keys once per block
of heads (from L2 after the first), and writes out_bhc once (flash decoding: a running max
and sum over blocks of keys). It wins only on short caches (AUTO_MAX_KEYS).

Roundings: scores and their softmax are f32 in both; the einsums round the normalized
probabilities to the value dtype before the weighted sum, the kernel the unnormalized ones
(exp(s - running max)) and divides the f32 sum at the end, so the two agree to the value
dtype's rounding, not bit for bit. `auto` takes the kernel only for bf16 and f16 (f32 models
keep the einsums, whose products are full f32 where the parity tests need them).

Names: B batch, H heads, S key positions, C kv_lora_rank, R qk_rope_head_dim.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jax_moe import settings

IMPLEMENTATIONS = settings.MLA_DECODE_CHOICES
KERNEL_DTYPES = (jnp.bfloat16, jnp.float16)
MIN_DOT = 16  # Triton's smallest dot operand side
# Caches up to this many rows take the kernel under "auto". Measured on one H200
# (results/mla-decode-6ddf004/): at 65 rows the kernel replaced ~40 us of einsum kernels a
# layer with 21 us; at 4096 rows it is slower than XLA's einsums (241 against 202 us at batch
# 32, 990 against 690 at batch 128: its small dots read the keys once per head block and run
# far below the read bandwidth). Between the two nothing was measured.
AUTO_MAX_KEYS = 256


def reference(q_latent_bhc, q_rope_bhr, keys_latent_bsc, keys_rope_bsr, num_keys, scale):
  """The einsum form (f32 scores, probabilities in the keys' dtype), rows >= num_keys unseen."""
  f32 = dict(preferred_element_type=jnp.float32)
  scores_bhs = (jnp.einsum("bhr,bsr->bhs", q_rope_bhr, keys_rope_bsr, **f32)
                + jnp.einsum("bhc,bsc->bhs", q_latent_bhc, keys_latent_bsc, **f32))
  visible_s = jnp.arange(keys_latent_bsc.shape[1]) < num_keys
  scores_bhs = jnp.where(visible_s, scores_bhs * scale, -jnp.inf)
  probs_bhs = jax.nn.softmax(scores_bhs, axis=-1)
  return jnp.einsum("bhs,bsc->bhc", probs_bhs.astype(keys_latent_bsc.dtype), keys_latent_bsc)


def _is_power_of_two(n: int) -> bool:
  return n >= 1 and n & (n - 1) == 0


def kernel_blocker(q_latent_bhc, q_rope_bhr, keys_latent_bsc, keys_rope_bsr) -> str | None:
  """Why the kernel does not apply to these shapes and dtypes (None when it does)."""
  C, R = q_latent_bhc.shape[-1], q_rope_bhr.shape[-1]
  dtypes = {jnp.dtype(a.dtype) for a in (q_latent_bhc, q_rope_bhr, keys_latent_bsc, keys_rope_bsr)}
  if len(dtypes) != 1 or next(iter(dtypes)) not in map(jnp.dtype, KERNEL_DTYPES):
    return f"dtypes {sorted(map(str, dtypes))}: the kernel takes one of bf16, f16"
  for name, n in (("kv_lora_rank", C), ("qk_rope_head_dim", R)):
    if not (_is_power_of_two(n) and n >= MIN_DOT):
      return f"{name}={n}: the kernel needs a power of two >= {MIN_DOT}"
  return None


def implementation_for(q_latent_bhc, q_rope_bhr, keys_latent_bsc, keys_rope_bsr,
                       implementation: str = "auto", device=None) -> str:
  """"pallas" or "xla": what `decode_attention` runs (auto: the kernel on a CUDA GPU where
  kernel_blocker allows it and the cache holds at most AUTO_MAX_KEYS rows)."""
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"mla_decode: implementation must be one of {IMPLEMENTATIONS}, "
                     f"got {implementation!r}")
  blocker = kernel_blocker(q_latent_bhc, q_rope_bhr, keys_latent_bsc, keys_rope_bsr)
  if implementation == "pallas" and blocker is not None:
    raise ValueError(f"mla_decode: implementation='pallas' does not apply: {blocker}")
  if implementation != "auto":
    return implementation
  device = device or jax.devices()[0]
  on_cuda = device.platform == "gpu" and "cuda" in device.client.platform_version.lower()
  short = keys_latent_bsc.shape[1] <= AUTO_MAX_KEYS
  return "pallas" if on_cuda and blocker is None and short else "xla"


@dataclasses.dataclass(frozen=True)
class KernelConfig:
  """How the kernel tiles the work: a program takes `block_heads` heads of one batch row and
  one of `key_splits` equal ranges of the cache rows (flash decoding: with more than one, the
  ranges' partial sums are merged after the kernel), `block_keys` keys a loop step. The
  default measured fastest in the DeepSeek-V3-shaped decode step (batch 128, 65 cache rows,
  one H200): 21.4 us a layer at b7bb05c (24.8 at 23131f0, which adds the key ranges' outputs),
  against 28.3 with 16 heads a program (benchmarks/results/mla-decode-6ddf004/)."""
  block_heads: int = 32
  block_keys: int = 64
  num_warps: int = 4
  num_stages: int = 2
  key_splits: int | None = None  # None: key_splits_for


def key_splits_for(batch: int, heads: int, keys: int, config: KernelConfig) -> int:
  """Enough programs for every SM a few times over (an H200 has 132), each split still
  covering >= 4 loop steps of keys: with the default tiling one split at DeepSeek-V3's decode
  with batch 128 and a short cache (512 programs), 5 at batch 32 over 4096 keys."""
  programs = batch * pl.cdiv(heads, config.block_heads)
  by_programs = pl.cdiv(4 * 132, programs)
  by_keys = max(1, keys // (4 * config.block_keys))
  return max(1, min(by_programs, by_keys))


def _kernel(num_keys_ref, q_latent_ref, q_rope_ref, keys_latent_ref, keys_rope_ref, out_ref,
            max_ref, sum_ref, *, scale: float, heads: int, keys: int, split_keys: int,
            config: KernelConfig):
  # One program: batch row b = program_id(0), heads [i * block_heads, ...) with i =
  # program_id(1), cache rows [j * split_keys, (j + 1) * split_keys) with j = program_id(2).
  # Refs: q [block_heads, C | R] (rows past `heads` are outside the array and masked), keys
  # [S_pad, C | R] of row b (rows past num_keys <= S are masked, never read), out [block_heads,
  # C] (the split's sum normalized by its own softmax sum: in the keys' dtype with one split,
  # f32 with more), max and sum [block_heads] (the split's running max and softmax sum, for
  # the merge).
  block_heads, block_keys = config.block_heads, config.block_keys
  first_head = pl.program_id(1) * block_heads
  head_ok = (first_head + jnp.arange(block_heads) < heads)[:, None]
  q_latent = plgpu.load(q_latent_ref, mask=head_ok, other=0.0)
  q_rope = plgpu.load(q_rope_ref, mask=head_ok, other=0.0)
  # A traced num_keys past S (a decode loop run past the cache, whose writes
  # dynamic_update_slice clamps) sees all S rows, as the einsums do; never a row past S.
  first_key = pl.program_id(2) * split_keys
  end_key = jnp.minimum(jnp.minimum(num_keys_ref[()], keys), first_key + split_keys)

  def step(j, carry):
    out, running_max, running_sum = carry
    start = first_key + j * block_keys
    key_ok = (start + jnp.arange(block_keys) < end_key)[:, None]
    rows = pl.ds(start, block_keys)
    keys_latent = plgpu.load(keys_latent_ref.at[rows, :], mask=key_ok, other=0.0)
    keys_rope = plgpu.load(keys_rope_ref.at[rows, :], mask=key_ok, other=0.0)
    scores = (plgpu.dot(q_latent, keys_latent, trans_b=True)
              + plgpu.dot(q_rope, keys_rope, trans_b=True)) * scale
    scores = jnp.where(key_ok[:, 0][None, :], scores, -jnp.inf)
    new_max = jnp.maximum(running_max, scores.max(axis=-1))
    correction = jnp.exp(running_max - new_max)
    weights = jnp.exp(scores - new_max[:, None])
    running_sum = running_sum * correction + weights.sum(axis=-1)
    out = out * correction[:, None] + plgpu.dot(weights.astype(keys_latent.dtype), keys_latent)
    return out, new_max, running_sum

  # A split's first step holds its first key, so its max is finite from there on and that
  # step's correction exp(-inf - finite) is 0. A split past num_keys runs no step: max -inf,
  # sum 0, out 0, which the merge weighs by exp(-inf) = 0 (split 0 always holds key 0).
  init = (jnp.zeros(out_ref.shape, jnp.float32),
          jnp.full((block_heads,), -jnp.inf, jnp.float32),
          jnp.zeros((block_heads,), jnp.float32))
  steps = pl.cdiv(jnp.maximum(end_key - first_key, 0), block_keys)
  out, running_max, running_sum = jax.lax.fori_loop(0, steps, step, init)
  out = out / jnp.maximum(running_sum, jnp.finfo(jnp.float32).tiny)[:, None]
  plgpu.store(out_ref, out.astype(out_ref.dtype), mask=head_ok)
  plgpu.store(max_ref, running_max, mask=head_ok[:, 0])
  plgpu.store(sum_ref, running_sum, mask=head_ok[:, 0])


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "config"))
def _pallas(q_latent_bhc, q_rope_bhr, keys_latent_bsc, keys_rope_bsr, num_keys, scale: float,
            interpret: bool, config: KernelConfig):
  B, H, C = q_latent_bhc.shape
  S, R = keys_latent_bsc.shape[1], keys_rope_bsr.shape[2]
  splits = config.key_splits or key_splits_for(B, H, S, config)
  split_keys = pl.cdiv(pl.cdiv(S, splits), config.block_keys) * config.block_keys
  splits = pl.cdiv(S, split_keys)
  kernel = functools.partial(_kernel, scale=scale, heads=H, keys=S, split_keys=split_keys,
                             config=config)
  bh = config.block_heads
  q_spec = lambda width: pl.BlockSpec((None, bh, width), lambda b, i, j: (b, i, 0))
  keys_spec = lambda width: pl.BlockSpec((None, splits * split_keys, width),
                                         lambda b, i, j: (b, 0, 0))
  partial_dtype = keys_latent_bsc.dtype if splits == 1 else jnp.float32
  out_bjhc, max_bjh, sum_bjh = pl.pallas_call(
      kernel,
      grid=(B, pl.cdiv(H, bh), splits),
      in_specs=[pl.BlockSpec((), lambda b, i, j: ()), q_spec(C), q_spec(R), keys_spec(C),
                keys_spec(R)],
      out_specs=[pl.BlockSpec((None, None, bh, C), lambda b, i, j: (b, j, i, 0)),
                 pl.BlockSpec((None, None, bh), lambda b, i, j: (b, j, i)),
                 pl.BlockSpec((None, None, bh), lambda b, i, j: (b, j, i))],
      out_shape=[jax.ShapeDtypeStruct((B, splits, H, C), partial_dtype),
                 jax.ShapeDtypeStruct((B, splits, H), jnp.float32),
                 jax.ShapeDtypeStruct((B, splits, H), jnp.float32)],
      compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                           num_stages=config.num_stages),
      interpret=interpret,
      name="mla_decode_attention",
  )(jnp.asarray(num_keys, jnp.int32), q_latent_bhc, q_rope_bhr, keys_latent_bsc, keys_rope_bsr)
  if splits == 1:
    return out_bjhc[:, 0]
  # Merge the splits: each one's normalized sum weighed by its share of the softmax sum.
  weight_bjh = sum_bjh * jnp.exp(max_bjh - jnp.max(max_bjh, axis=1, keepdims=True))
  weight_bjh = weight_bjh / jnp.sum(weight_bjh, axis=1, keepdims=True)
  return jnp.einsum("bjhc,bjh->bhc", out_bjhc, weight_bjh).astype(keys_latent_bsc.dtype)


def decode_attention(q_latent_bhc, q_rope_bhr, keys_latent_bsc, keys_rope_bsr, num_keys,
                     scale: float, implementation: str = "auto",
                     config: KernelConfig = KernelConfig()):
  """out [B, H, C] in the keys' dtype: each head of each batch row attends to key rows
  [0, num_keys) (a scalar in [1, S], traced or not) of its row of the cache.

  q_latent [B, H, C], q_rope [B, H, R], keys_latent [B, S, C], keys_rope [B, S, R].
  implementation: "auto" (the kernel where `implementation_for` picks it), "pallas" (the
  kernel; interpreted off GPUs, for tests) or "xla" (`reference`); config: the kernel's
  tiling (KernelConfig; benchmarks/bench_mla_decode.py --configs times others)."""
  B, H, C = q_latent_bhc.shape
  S = keys_latent_bsc.shape[1]
  R = q_rope_bhr.shape[-1]
  for name, array, shape in (("q_rope_bhr", q_rope_bhr, (B, H, R)),
                             ("keys_latent_bsc", keys_latent_bsc, (B, S, C)),
                             ("keys_rope_bsr", keys_rope_bsr, (B, S, R))):
    if array.shape != shape:
      raise ValueError(f"mla_decode: {name} must be {shape} (from q_latent_bhc {(B, H, C)}, "
                       f"keys_latent_bsc's S={S} and q_rope_bhr's R={R}), got {array.shape}")
  if isinstance(num_keys, int) and not 1 <= num_keys <= S:
    raise ValueError(f"mla_decode: num_keys must be in [1, S={S}], got {num_keys}")
  args = (q_latent_bhc, q_rope_bhr, keys_latent_bsc, keys_rope_bsr)
  if implementation_for(*args, implementation=implementation) == "xla":
    return reference(*args, num_keys, scale)
  interpret = jax.devices()[0].platform != "gpu"
  return _pallas(*args, num_keys, scale=float(scale), interpret=interpret, config=config)
