"""Generation: greedy tokens with the KV cache equal transformers' greedy generate; sampling.

Ties: both sides pick the first index of the largest logit, but logits agree only within the
parity tolerance, so where transformers' top-2 gap is below it either token is right and the
sequences may part. Each row is compared up to its first such step; the test asserts that
this still covers most tokens, so it cannot pass vacuously.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from transformers import Qwen3MoeConfig

from support.hf_tiny import first_near_tie, hf_greedy, qwen3_moe_kwargs, random_ids, save_tiny
from jax_moe import models
from jax_moe.models.generation import PromptGenerator, sample

NEW_TOKENS = 8


def test_greedy_matches_transformers(tmp_path, rng, ep_mesh, backend):
  hf_model, path = save_tiny(Qwen3MoeConfig(**qwen3_moe_kwargs(norm_topk_prob=True)), tmp_path)
  ids = random_ids(rng, batch=3, seq=5, vocab=96)
  ref_tokens, ref_logits = hf_greedy(hf_model, ids, NEW_TOKENS)
  model = models.from_pretrained(path, mesh=ep_mesh, backend=backend, dtype=jnp.float32,
                                 progress=False)
  tokens = np.asarray(models.generate(model, ids, NEW_TOKENS))
  assert tokens.shape == ref_tokens.shape
  np.testing.assert_array_equal(tokens[:, :5], ids)
  compared = first_near_tie(ref_logits, 1e-4 * np.abs(ref_logits).max())
  for row, steps in enumerate(compared):
    np.testing.assert_array_equal(tokens[row, 5:5 + steps], ref_tokens[row, 5:5 + steps])
  assert compared.sum() >= 0.75 * compared.size * NEW_TOKENS


def test_sampling_is_reproducible_and_in_vocab(ep_mesh):
  model = models.tiny("tiny-qwen3-moe", mesh=ep_mesh)
  generator = models.Generator(model, batch=8, prompt_len=3, max_new_tokens=3, temperature=1.0,
                               top_p=0.9)
  ids = jnp.zeros((8, 3), jnp.int32)
  a, b, c = (np.asarray(generator(ids, jax.random.key(seed))) for seed in (7, 7, 8))
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(a, c)
  assert a.shape == (8, 6) and a.min() >= 0 and a.max() < model.vocab_size


def test_generator_refuses_a_prompt_of_another_shape(ep_mesh):
  generator = models.Generator(models.tiny("tiny-qwen3-moe", mesh=ep_mesh), batch=8,
                               prompt_len=3, max_new_tokens=2)
  with pytest.raises(ValueError, match=r"input_ids must have shape \(8, 3\).*got \(8, 4\)"):
    generator(jnp.zeros((8, 4), jnp.int32))


@pytest.mark.parametrize("name", ("tiny-qwen3-moe", "tiny-deepseek-v3"))
def test_logits_to_keep_gives_the_last_positions(ep_mesh, rng, name):
  """logits_to_keep=n is the full forward's last n positions, with and without a cache (the
  prefill's call), and n past the sequence keeps all of it."""
  model = models.tiny(name, mesh=ep_mesh, dtype=jnp.float32)
  ids = jnp.asarray(rng.integers(0, model.vocab_size, (8, 5)), jnp.int32)
  full = np.asarray(models.forward(model, ids))
  close = dict(rtol=1e-5, atol=1e-5 * np.abs(full).max())
  for keep in (2, 9):
    np.testing.assert_allclose(np.asarray(models.forward(model, ids, logits_to_keep=keep)),
                               full[:, -keep:], **close)
  cached, cache = models.forward(model, ids, model.init_cache(8, 8), logits_to_keep=1)
  assert cached.shape == (8, 1, model.vocab_size) and int(cache.index) == 5
  np.testing.assert_allclose(np.asarray(cached), full[:, -1:], **close)
  with pytest.raises(ValueError, match=r"logits_to_keep must be an int >= 0.*got -1"):
    models.forward(model, ids, logits_to_keep=-1)


def test_top_p_keeps_the_nucleus():
  logits = jnp.log(jnp.array([[0.5, 0.05, 0.3, 0.15]], jnp.float32))
  keys = jax.random.split(jax.random.key(0), 2000)
  draw = jax.vmap(lambda k, p: sample(logits, k, 1.0, p)[0], in_axes=(0, None))
  # 0.5 + 0.3 reach 0.75: the nucleus is {0, 2}, drawn about 5:3
  picked = np.asarray(draw(keys, 0.75))
  assert set(np.unique(picked)) == {0, 2}
  assert 0.55 < np.mean(picked == 0) < 0.70
  assert set(np.unique(np.asarray(draw(keys, 0.4)))) == {0}        # top token alone
  assert set(np.unique(np.asarray(draw(keys, 1.0)))) == {0, 1, 2, 3}
  np.testing.assert_array_equal(sample(logits, keys[0], 0.0, 1.0), [0])  # greedy


@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature=1.0), "needs a PRNG key"),
    (dict(temperature=-1.0), "temperature must be >= 0"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
])
def test_bad_sampling_arguments(kwargs, match):
  with pytest.raises(ValueError, match=match):
    models.generate(None, np.zeros((1, 2), np.int32), 2, **kwargs)


def test_bad_prompt(mesh_of):
  model = models.tiny("tiny-qwen3-moe", mesh=mesh_of(2))
  with pytest.raises(ValueError, match=r"input_ids must be an int array \[batch, seq\]"):
    models.generate(model, np.zeros(4, np.int32), 2)
  with pytest.raises(ValueError, match="max_new_tokens"):
    models.generate(model, np.zeros((1, 4), np.int32), 0)


# ------------------------------------------------------- PromptGenerator's on-device loop
def _prompt_run(model, prompts, max_new, steps_per_call, **kwargs):
  run_kwargs = {k: kwargs.pop(k) for k in ("eos_ids", "seed") if k in kwargs}
  generator = PromptGenerator(model, prompts, max_new, steps_per_call=steps_per_call, **kwargs)
  return generator.run(**run_kwargs)


@pytest.fixture(scope="module")
def f32_tiny():
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("ep",))
  return models.tiny("tiny-qwen3-moe", mesh=mesh, dtype=jnp.float32)


@pytest.mark.parametrize("sampling", (dict(), dict(temperature=1.0, top_p=0.9, seed=3)))
def test_calls_of_several_steps_give_the_one_step_tokens(f32_tiny, sampling):
  """Prompts of three lengths: 1, 3 and 8 steps a call (8 > the steps needed: one call runs
  past the end) give the same tokens, sampled ones included (a position's key is fixed)."""
  prompts = [[5, 9], [1, 2, 3, 4, 5], [7, 7, 7]]
  runs = [_prompt_run(f32_tiny, prompts, 6, n, **dict(sampling)) for n in (1, 3, 8)]
  assert [len(t) for t in runs[0].tokens] == [6, 6, 6]
  for run in runs[1:]:
    assert run.tokens == runs[0].tokens
    assert run.decode_steps == runs[0].decode_steps == 5 + 3  # up to the longest prompt's end


def test_greedy_prompts_of_one_length_give_generate_tokens(f32_tiny):
  ids = np.array([[3, 1, 4], [1, 5, 9]], np.int32)
  want = np.asarray(models.generate(f32_tiny, ids, 5))[:, 3:]
  got = _prompt_run(f32_tiny, ids.tolist(), 5, 4).tokens
  np.testing.assert_array_equal(np.array(got), want)


def test_a_sequence_stops_at_eos_in_the_middle_of_a_call(f32_tiny):
  prompts = [[5, 9], [1, 2, 3, 4, 5]]
  free = _prompt_run(f32_tiny, prompts, 8, 1).tokens
  eos = free[0][2]
  cut = free[0].index(eos) + 1
  got = _prompt_run(f32_tiny, prompts, 8, 4, eos_ids=(eos,))
  assert got.tokens[0] == free[0][:cut] and got.stopped[0]
  other = free[1][:free[1].index(eos) + 1] if eos in free[1] else free[1]
  assert got.tokens[1] == other


def test_bad_steps_per_call(f32_tiny):
  for bad in (0, 2.5):
    with pytest.raises(ValueError, match="steps_per_call must be an int >= 1"):
      PromptGenerator(f32_tiny, [[1, 2]], 3, steps_per_call=bad)
