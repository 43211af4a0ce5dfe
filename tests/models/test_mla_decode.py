"""The MLA decode-attention kernel (jax_moe.models.mla_decode) against its einsum reference.

On CPU the Pallas kernel runs interpreted (implementation="pallas"); the `gpu` cases run the
Triton kernel at DeepSeek-V3's shape. Rows of the cache past num_keys are poisoned with NaN
for the kernel (the reference reads the clean cache): a kernel that read them would give NaN.
Both are compared with an f64 numpy computation, and with each other to the value dtype's
rounding (the kernel rounds unnormalized probabilities, the einsums normalized ones).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_moe.models import mla
from jax_moe.models import mla_decode
from jax_moe.models.moe import CommunicatorPool
from jax_moe.models.sharding import ShardingRules
from tests.support.hf_tiny import deepseek_v3_config
from tests.support.meshes import make_mesh


def _inputs(seed, B, H, C, R, S, dtype):
  keys = jax.random.split(jax.random.key(seed), 4)
  draw = lambda key, shape: jax.random.normal(key, shape, jnp.float32).astype(dtype)
  return (draw(keys[0], (B, H, C)), draw(keys[1], (B, H, R)), draw(keys[2], (B, S, C)),
          draw(keys[3], (B, S, R)))


def _exact(q_latent, q_rope, keys_latent, keys_rope, num_keys, scale):
  f64 = lambda a: np.asarray(a, np.float64)
  scores = (np.einsum("bhc,bsc->bhs", f64(q_latent), f64(keys_latent)[:, :num_keys])
            + np.einsum("bhr,bsr->bhs", f64(q_rope), f64(keys_rope)[:, :num_keys])) * scale
  probs = np.exp(scores - scores.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  return np.einsum("bhs,bsc->bhc", probs, f64(keys_latent)[:, :num_keys])


def _poisoned(keys, num_keys):
  return keys.at[:, num_keys:].set(jnp.nan)


def _check(kernel_out, reference_out, exact, dtype):
  got = np.asarray(kernel_out, np.float64)
  ref = np.asarray(reference_out, np.float64)
  assert kernel_out.dtype == dtype and np.all(np.isfinite(got))
  eps = float(jnp.finfo(dtype).eps)
  scale = np.abs(exact).max()
  # Each output is a convex sum of key values rounded to `dtype` twice at most (the
  # probabilities and the result): a few of its eps of the largest value.
  assert np.abs(got - exact).max() <= 4 * eps * scale
  assert np.abs(ref - exact).max() <= 4 * eps * scale
  assert np.abs(got - ref).max() <= 4 * eps * scale


# B, H, C, R, S, num_keys: heads under, at and past a block (16, 32), keys under, at and past
# a 64-key block, one key, S not a multiple of the block.
CPU_CASES = {
    "few_heads_partial_block": (2, 4, 32, 16, 20, 7),
    "one_key": (2, 16, 32, 16, 64, 1),
    "heads_past_block_keys_past_block": (2, 40, 64, 16, 130, 129),
    "odd_everything": (1, 33, 32, 16, 65, 65),
}


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("case", sorted(CPU_CASES))
def test_kernel_matches_reference(case, dtype):
  B, H, C, R, S, n = CPU_CASES[case]
  q_latent, q_rope, keys_latent, keys_rope = _inputs(hash(case) % 1000, B, H, C, R, S, dtype)
  scale = 0.7 / np.sqrt(C + R)
  reference = mla_decode.reference(q_latent, q_rope, keys_latent, keys_rope, n, scale)
  kernel = mla_decode.decode_attention(q_latent, q_rope, _poisoned(keys_latent, n),
                                       _poisoned(keys_rope, n), n, scale, implementation="pallas")
  _check(kernel, reference, _exact(q_latent, q_rope, keys_latent, keys_rope, n, scale), dtype)


@pytest.mark.parametrize("splits,num_keys", [(3, 100), (3, 20), (4, 1)])
def test_key_splits_merge_to_the_one_split_result(splits, num_keys):
  """Flash decoding: the cache rows in `splits` ranges of 16-key steps, merged after the
  kernel; ranges past num_keys (the last two at 20 keys, all but the first at 1) count
  nothing."""
  B, H, C, R, S = 2, 20, 32, 16, 100
  q_latent, q_rope, keys_latent, keys_rope = _inputs(splits, B, H, C, R, S, jnp.bfloat16)
  config = mla_decode.KernelConfig(block_heads=16, block_keys=16, key_splits=splits)
  kernel = mla_decode.decode_attention(q_latent, q_rope, _poisoned(keys_latent, num_keys),
                                       _poisoned(keys_rope, num_keys), num_keys, 0.2,
                                       implementation="pallas", config=config)
  _check(kernel, mla_decode.reference(q_latent, q_rope, keys_latent, keys_rope, num_keys, 0.2),
         _exact(q_latent, q_rope, keys_latent, keys_rope, num_keys, 0.2), jnp.bfloat16)


def test_automatic_splits_fill_the_gpu_at_long_caches():
  config = mla_decode.KernelConfig(block_heads=16)
  assert mla_decode.key_splits_for(128, 128, 65, config) == 1     # DeepSeek-V3 decode, batch 128
  assert mla_decode.key_splits_for(32, 128, 4096, config) == 3    # 256 programs -> 768
  assert mla_decode.key_splits_for(1, 128, 4096, config) == 16    # capped by 4 steps a split
  assert mla_decode.key_splits_for(1, 128, 100, config) == 1
  assert mla_decode.key_splits_for(128, 128, 65, mla_decode.KernelConfig()) == 1


def test_traced_num_keys_selects_the_visible_rows():
  """num_keys as a traced value (the cache length inside a decode loop): one compiled kernel
  for every length."""
  B, H, C, R, S = 2, 16, 32, 16, 96
  q_latent, q_rope, keys_latent, keys_rope = _inputs(7, B, H, C, R, S, jnp.bfloat16)
  run = jax.jit(lambda n: mla_decode.decode_attention(q_latent, q_rope, keys_latent, keys_rope,
                                                      n, 0.2, implementation="pallas"))
  for n in (1, 64, 65, 96):
    _check(run(jnp.int32(n)), mla_decode.reference(q_latent, q_rope, keys_latent, keys_rope, n, 0.2),
           _exact(q_latent, q_rope, keys_latent, keys_rope, n, 0.2), jnp.bfloat16)
  # A length past the cache (a loop decoding past it) sees the S rows, as the einsums do.
  np.testing.assert_array_equal(run(jnp.int32(S + 40)), run(jnp.int32(S)))
  np.testing.assert_array_equal(
      mla_decode.reference(q_latent, q_rope, keys_latent, keys_rope, jnp.int32(S + 40), 0.2),
      mla_decode.reference(q_latent, q_rope, keys_latent, keys_rope, S, 0.2))


def test_auto_takes_the_einsums_off_gpu_and_for_f32():
  bf16 = _inputs(0, 1, 16, 32, 16, 8, jnp.bfloat16)
  f32 = _inputs(0, 1, 16, 32, 16, 8, jnp.float32)
  cpu = jax.devices("cpu")[0]
  assert mla_decode.implementation_for(*bf16, device=cpu) == "xla"
  assert mla_decode.implementation_for(*f32, device=cpu) == "xla"
  assert mla_decode.implementation_for(*bf16, implementation="xla") == "xla"
  assert mla_decode.kernel_blocker(*bf16) is None
  assert "bf16, f16" in mla_decode.kernel_blocker(*f32)


@pytest.mark.parametrize("shapes,match", [
    (dict(C=24), "kv_lora_rank=24: the kernel needs a power of two >= 16"),
    (dict(R=8), "qk_rope_head_dim=8: the kernel needs a power of two >= 16"),
])
def test_pallas_refuses_shapes_it_cannot_tile(shapes, match):
  dims = dict(B=1, H=4, C=32, R=16, S=8) | shapes
  args = _inputs(0, dims["B"], dims["H"], dims["C"], dims["R"], dims["S"], jnp.bfloat16)
  with pytest.raises(ValueError, match=match):
    mla_decode.decode_attention(*args, 3, 0.1, implementation="pallas")
  # auto falls back to the einsums for them
  out = mla_decode.decode_attention(*args, 3, 0.1)
  np.testing.assert_array_equal(out, mla_decode.reference(*args, 3, 0.1))


def test_bad_input_is_refused():
  q_latent, q_rope, keys_latent, keys_rope = _inputs(0, 2, 4, 32, 16, 8, jnp.bfloat16)
  with pytest.raises(ValueError, match=r"keys_rope_bsr must be \(2, 8, 16\)"):
    mla_decode.decode_attention(q_latent, q_rope, keys_latent, keys_rope[:, :, :8], 3, 0.1)
  with pytest.raises(ValueError, match=r"q_rope_bhr must be \(2, 4, 16\)"):
    mla_decode.decode_attention(q_latent, q_rope[:1], keys_latent, keys_rope, 3, 0.1)
  with pytest.raises(ValueError, match=r"num_keys must be in \[1, S=8\], got 9"):
    mla_decode.decode_attention(q_latent, q_rope, keys_latent, keys_rope, 9, 0.1)
  with pytest.raises(ValueError, match="implementation must be one of"):
    mla_decode.decode_attention(q_latent, q_rope, keys_latent, keys_rope, 3, 0.1,
                                implementation="triton")


def test_bad_setting_is_refused(monkeypatch):
  from jax_moe import settings
  monkeypatch.setenv("JAX_MOE_MLA_DECODE", "cudnn")
  with pytest.raises(ValueError, match="JAX_MOE_MLA_DECODE must be 'auto', 'pallas' or 'xla'"):
    settings.mla_decode()


def test_cached_bf16_steps_with_the_kernel_equal_the_einsums(monkeypatch):
  """A bf16 MLA layer's decode steps through the cache: the kernel (JAX_MOE_MLA_DECODE=pallas,
  interpreted here) against the einsums (xla), every step, after a 3-token prefill."""
  config = deepseek_v3_config(qk_rope_head_dim=16)
  rules = ShardingRules(make_mesh(1))
  abstract = mla.MultiHeadLatentAttention(mla.MLAConfig.from_hf(config.to_dict()), rules=rules,
                                          pool=CommunicatorPool(rules), dtype=jnp.bfloat16)
  graphdef, state = nnx.split(abstract)
  leaves, tree = jax.tree.flatten(state)
  draws = [(0.3 * jax.random.normal(key, leaf.shape)).astype(leaf.dtype)
           for key, leaf in zip(jax.random.split(jax.random.key(5), len(leaves)), leaves)]
  attention = nnx.merge(graphdef, jax.tree.unflatten(tree, draws))
  b, t, prefill = 2, 6, 3
  x = jax.random.normal(jax.random.key(3), (b, t, config.hidden_size)).astype(jnp.bfloat16)
  positions = jnp.tile(jnp.arange(t), (b, 1))

  def steps(setting):
    monkeypatch.setenv("JAX_MOE_MLA_DECODE", setting)
    cache = mla.init_mla_cache(attention.cfg, b, t + 2, jnp.bfloat16)
    call = jax.jit(lambda *args: attention(*args))  # one trace for all one-token steps
    outs = []
    for start, stop in [(0, prefill)] + [(s, s + 1) for s in range(prefill, t)]:
      y, cache = call(x[:, start:stop], positions[:, start:stop], cache, jnp.int32(start))
      outs.append(np.asarray(y[:, -1], np.float32))
    return np.stack(outs), cache

  (kernel, kernel_cache), (einsums, einsum_cache) = steps("pallas"), steps("xla")
  np.testing.assert_array_equal(kernel[0], einsums[0])  # the prefill does not use it
  scale = np.abs(einsums).max()
  assert np.abs(kernel - einsums).max() <= 0.03 * scale
  for a, b_ in zip(kernel_cache, einsum_cache):
    np.testing.assert_array_equal(a, b_)


# DeepSeek-V3's attention at decode: 128 heads, C = 512, R = 64; the benchmark's 65-row cache,
# a long one, and a batch of 1.
GPU_CASES = {
    "dsv3_b8_s65": (8, 128, 512, 64, 65, 65),
    "dsv3_b4_s1000_partial": (4, 128, 512, 64, 1000, 777),   # 3 key splits
    "dsv3_b1_s4096_partial": (1, 128, 512, 64, 4096, 3000),  # 16 key splits
    "dsv3_b1_s64_one_key": (1, 128, 512, 64, 64, 1),
    "heads_16_of_32_block": (3, 16, 512, 64, 200, 130),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(GPU_CASES))
def test_gpu_kernel_matches_reference(case):
  B, H, C, R, S, n = GPU_CASES[case]
  q_latent, q_rope, keys_latent, keys_rope = _inputs(len(case), B, H, C, R, S, jnp.bfloat16)
  scale = 0.1352
  auto = mla_decode.implementation_for(q_latent, q_rope, keys_latent, keys_rope)
  assert auto == ("pallas" if S <= mla_decode.AUTO_MAX_KEYS else "xla")
  reference = jax.jit(mla_decode.reference, static_argnums=(4, 5))(
      q_latent, q_rope, keys_latent, keys_rope, n, scale)
  kernel = mla_decode.decode_attention(q_latent, q_rope, _poisoned(keys_latent, n),
                                       _poisoned(keys_rope, n), n, scale, implementation="pallas")
  _check(kernel, reference, _exact(q_latent, q_rope, keys_latent, keys_rope, n, scale),
         jnp.bfloat16)


def test_bench_mla_decode_quick_runs_on_cpu(tmp_path):
  """benchmarks/bench_mla_decode.py --quick end to end on one host device (seconds): both
  methods pass the check against the f32 formula and are timed."""
  repo = Path(__file__).resolve().parents[2]
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
  done = subprocess.run([sys.executable, str(repo / "benchmarks" / "bench_mla_decode.py"),
                         "--quick", "--out", str(tmp_path)],
                        cwd=repo, env=env, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  payload = json.loads((tmp_path / "mla_decode_cpu-x1.json").read_text())
  assert [(r["method"], r["status"]) for r in payload["results"]] == [("xla", "ok"),
                                                                      ("pallas", "ok")]
  assert all(r["error"] < 2e-2 for r in payload["results"])
