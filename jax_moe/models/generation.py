"""Generation with a KV cache: a jit-compiled prefill and a jit-compiled one-token decode step.

Greedy unless `temperature > 0`; then tokens are drawn from softmax(logits / temperature),
restricted to the smallest set of most likely tokens whose probability reaches `top_p`.
Greedy picks the first index of the largest logit (jnp.argmax), as torch.argmax does.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def forward(model, input_ids_bs, cache=None):
  """model(input_ids, cache=cache), jit-compiled: one compile per model and shape instead of
  op-by-op dispatch. Builds the communicators the call needs first (outside jit)."""
  model.prepare(*input_ids_bs.shape)
  graphdef, state = nnx.split(model)
  return _forward(graphdef, state, jnp.asarray(input_ids_bs, jnp.int32), cache)


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, state, input_ids_bs, cache):
  model = nnx.merge(graphdef, state)
  return model(input_ids_bs) if cache is None else model(input_ids_bs, cache=cache)


def sample(logits_bv, key, temperature: float, top_p: float):
  """Next token [B] int32 from the last-position logits [B, V]."""
  if temperature == 0.0:
    return jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
  logits_bv = logits_bv.astype(jnp.float32) / temperature
  if top_p < 1.0:
    sorted_bv = jnp.sort(logits_bv, axis=-1)[:, ::-1]
    probs_bv = jax.nn.softmax(sorted_bv, axis=-1)
    before_bv = jnp.cumsum(probs_bv, axis=-1) - probs_bv  # mass of the more likely tokens
    kept = jnp.sum(before_bv < top_p, axis=-1)            # >= 1: the top token always stays
    threshold_b = jnp.take_along_axis(sorted_bv, (kept - 1)[:, None], axis=-1)
    logits_bv = jnp.where(logits_bv >= threshold_b, logits_bv, -jnp.inf)
  return jax.random.categorical(key, logits_bv, axis=-1).astype(jnp.int32)


def _check_sampling(temperature, top_p):
  if not temperature >= 0.0:
    raise ValueError(f"generate: temperature must be >= 0, got {temperature}")
  if not 0.0 < top_p <= 1.0:
    raise ValueError(f"generate: top_p must be in (0, 1], got {top_p}")


def _check_key(temperature, key):
  if temperature > 0.0 and key is None:
    raise ValueError("generate: sampling (temperature > 0) needs a PRNG key (key=jax.random.key(0))")


class Generator:
  """Compiled prefill and decode step for one (batch, prompt_len, max_new_tokens) shape."""

  def __init__(self, model, batch: int, prompt_len: int, max_new_tokens: int,
               temperature: float = 0.0, top_p: float = 1.0):
    if min(batch, prompt_len, max_new_tokens) < 1:
      raise ValueError(f"generate: batch ({batch}), prompt length ({prompt_len}) and "
                       f"max_new_tokens ({max_new_tokens}) must be >= 1")
    _check_sampling(temperature, top_p)
    self.model, self.temperature = model, temperature
    self.batch, self.prompt_len, self.max_new_tokens = batch, prompt_len, max_new_tokens
    model.prepare(batch, prompt_len)  # communicators allocate: built here, outside jit
    model.prepare(batch, 1)
    self.graphdef, self.state = nnx.split(model)
    pick = functools.partial(sample, temperature=temperature, top_p=top_p)
    graphdef = self.graphdef

    def prefill(state, ids_bs, key):
      model = nnx.merge(graphdef, state)
      cache = model.init_cache(batch, prompt_len + max_new_tokens)
      logits_bsv, cache = model(ids_bs, cache=cache)
      return pick(logits_bsv[:, -1], key), cache

    def step(state, token_b, cache, key):
      logits_bsv, cache = nnx.merge(graphdef, state)(token_b[:, None], cache=cache)
      return pick(logits_bsv[:, -1], key), cache

    # Donating the cache lets XLA update it in place on GPUs; CPU meshes keep it undonated.
    platform = model.rules.mesh.devices.flat[0].platform
    donate = () if platform == "cpu" else ("cache",)
    self.prefill = jax.jit(prefill)
    self.step = jax.jit(step, donate_argnames=donate)

  def __call__(self, input_ids_bs, key=None):
    """Prompt [B, S] -> tokens [B, S + max_new_tokens] (prompt included); `key` is needed
    when sampling (temperature > 0)."""
    _check_key(self.temperature, key)
    if tuple(jnp.shape(input_ids_bs)) != (self.batch, self.prompt_len):
      raise ValueError(f"Generator: input_ids must have shape ({self.batch}, {self.prompt_len}) "
                       f"(the batch and prompt length it was built for), got "
                       f"{tuple(jnp.shape(input_ids_bs))}")
    key = jax.random.key(0) if key is None else key  # greedy: the key is not used
    keys = jax.random.split(key, self.max_new_tokens)
    token_b, cache = self.prefill(self.state, input_ids_bs, keys[0])
    tokens = [token_b]
    for i in range(1, self.max_new_tokens):
      token_b, cache = self.step(self.state, token_b, cache, keys[i])
      tokens.append(token_b)
    out = jnp.concatenate([jnp.asarray(input_ids_bs, jnp.int32), jnp.stack(tokens, axis=1)],
                          axis=1)
    # Calls run asynchronously: an error they record is visible only once they have finished.
    jax.block_until_ready(out)
    self.model.pool.check()
    return out


def generate(model, input_ids, max_new_tokens: int, *, temperature: float = 0.0,
             top_p: float = 1.0, key=None):
  """Prompt [B, S] int -> [B, S + max_new_tokens] int32; greedy unless temperature > 0."""
  _check_sampling(temperature, top_p)
  _check_key(temperature, key)
  input_ids = np.asarray(input_ids) if not isinstance(input_ids, jax.Array) else input_ids
  if input_ids.ndim != 2 or not jnp.issubdtype(input_ids.dtype, jnp.integer):
    raise ValueError(f"generate: input_ids must be an int array [batch, seq], got "
                     f"{input_ids.dtype} {tuple(input_ids.shape)}")
  B, S = input_ids.shape
  generator = Generator(model, B, S, max_new_tokens, temperature, top_p)
  return generator(jnp.asarray(input_ids, jnp.int32), key)
