"""Generation with a KV cache: a jit-compiled prefill, then decode steps run on the device in
a `lax.fori_loop` (all of them in one call for `Generator`, `steps_per_call` a call for
`PromptGenerator`), so a token costs no Python dispatch: at 2f32ecd one call per token took
1.93 ms a step on one H200 where the device step takes about 0.21 ms (issue 16).

Greedy unless `temperature > 0`; then tokens are drawn from softmax(logits / temperature),
restricted to the smallest set of most likely tokens whose probability reaches `top_p`.
Greedy picks the first index of the largest logit (jnp.argmax), as torch.argmax does.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P


def forward(model, input_ids_bs, cache=None, logits_to_keep: int = 0):
  """model(input_ids, cache=cache, logits_to_keep=...), jit-compiled: one compile per model
  and shape instead of op-by-op dispatch. Builds the communicators the call needs first
  (outside jit)."""
  model.prepare(*input_ids_bs.shape)
  graphdef, state = nnx.split(model)
  return _forward(graphdef, state, jnp.asarray(input_ids_bs, jnp.int32), cache, logits_to_keep)


@functools.partial(jax.jit, static_argnums=(0, 4))
def _forward(graphdef, state, input_ids_bs, cache, logits_to_keep):
  model = nnx.merge(graphdef, state)
  return model(input_ids_bs, cache=cache, logits_to_keep=logits_to_keep)


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


def decode_steps(model, token_b, cache, tokens_bn, feed, pick_at):
  """Decode steps in a fori_loop on the device, one per column of tokens_bn [B, n]: step i
  feeds feed(token_b, cache) (the last token, or what replaces it) and samples
  pick_at(i, last-position logits [B, V], cache). Returns (tokens_bn filled, the last token,
  the cache)."""
  def step(i, carry):
    token_b, cache, tokens_bn = carry
    logits_bsv, cache = model(feed(token_b, cache)[:, None], cache=cache)
    token_b = pick_at(i, logits_bsv[:, -1], cache)
    return token_b, cache, tokens_bn.at[:, i].set(token_b)

  token_b, cache, tokens_bn = jax.lax.fori_loop(0, tokens_bn.shape[1], step,
                                                (token_b, cache, tokens_bn))
  return tokens_bn, token_b, cache


def _check_sampling(temperature, top_p):
  if not temperature >= 0.0:
    raise ValueError(f"generate: temperature must be >= 0, got {temperature}")
  if not 0.0 < top_p <= 1.0:
    raise ValueError(f"generate: top_p must be in (0, 1], got {top_p}")


def _check_key(temperature, key):
  if temperature > 0.0 and key is None:
    raise ValueError("generate: sampling (temperature > 0) needs a PRNG key (key=jax.random.key(0))")


class Generator:
  """Compiled prefill and decode loop (every step in one call) for one (batch, prompt_len,
  max_new_tokens) shape."""

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
      logits_bsv, cache = model(ids_bs, cache=cache, logits_to_keep=1)
      return pick(logits_bsv[:, -1], key), cache

    def decode(state, token_b, cache, keys):
      """The other max_new_tokens - 1 tokens [B, N - 1], step i sampled with keys[i]."""
      return decode_steps(nnx.merge(graphdef, state), token_b, cache,
                          jnp.zeros((batch, max_new_tokens - 1), jnp.int32),
                          feed=lambda token_b, cache: token_b,
                          pick_at=lambda i, logits_bv, cache: pick(logits_bv, keys[i]))[0]

    # Donating the cache lets XLA update it in place on GPUs; CPU meshes keep it undonated.
    platform = model.rules.mesh.devices.flat[0].platform
    donate = () if platform == "cpu" else ("cache",)
    self.prefill = jax.jit(prefill)
    self.decode = jax.jit(decode, donate_argnames=donate)

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
    parts = [jnp.asarray(input_ids_bs, jnp.int32), token_b[:, None]]
    if self.max_new_tokens > 1:
      parts.append(self.decode(self.state, token_b, cache, keys[1:]))
    out = jnp.concatenate(parts, axis=1)
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


# ------------------------------------------------------------------- prompts of any lengths
@dataclasses.dataclass
class Completion:
  """What `PromptGenerator.run` produced: per sequence, the generated ids (an end-of-sequence
  id included when one stopped it), and the timings."""
  tokens: list[list[int]]
  prefill_s: float
  decode_s: float
  decode_steps: int      # decode steps whose tokens were read (prompt tokens past the shortest
                         # prompt included; a last call's steps past the end not counted)
  stopped: list[bool]    # the sequence ended with an end-of-sequence id


# Decode steps one PromptGenerator call runs on the device (tokens stream in groups of this).
STEPS_PER_CALL = 8
_runs = itertools.count()  # the same sequence in every process: they run the same program


class _TokenReader:
  """Each call's tokens ([B] or [B, n]) on the host, in every process, without a device
  collective.

  Alone (or with the tokens replicated) the array is read directly. Across processes each
  process publishes the rows it holds in jax.distributed's key-value store and reads the
  others' (a few hundred bytes a step), so a dead process makes its peers wait at most
  `timeout_s` here, never in an XLA collective with no timeout.
  """

  def __init__(self, batch: int):
    self.batch = batch
    self.run = next(_runs)
    self.multi = jax.process_count() > 1
    if self.multi:
      from jax_moe import settings
      from jax_moe.backends.ranks import distributed_client

      self.client = distributed_client("generate")
      self.timeout_ms = int(max(60.0, 3 * settings.timeout_s()) * 1000)

  def _key(self, step: int, process: int) -> str:
    return f"jax_moe/generate/{self.run}/{step}/{process}"

  def __call__(self, array, step: int) -> np.ndarray:
    """The whole `array` ([B] or [B, n], sharded over its first axis or replicated)."""
    if not self.multi or array.is_fully_replicated or array.is_fully_addressable:
      data = array.addressable_data(0) if array.is_fully_replicated else array
      return np.asarray(data)
    row_shape = array.shape[1:]
    out = np.full((self.batch, *row_shape), -1, np.int64)
    mine = {}
    for shard in array.addressable_shards:
      start = shard.index[0].start or 0
      mine[start] = np.asarray(shard.data)
    me = jax.process_index()
    self.client.key_value_set(self._key(step, me), ";".join(
        f"{start}:{','.join(map(str, rows.reshape(-1).tolist()))}"
        for start, rows in sorted(mine.items())))
    for process in range(jax.process_count()):
      key = self._key(step, process)
      try:
        text = self.client.blocking_key_value_get(key, self.timeout_ms)
      except Exception as e:  # noqa: BLE001 - jax raises its own status errors
        raise RuntimeError(f"generate: process {process} did not publish its tokens of step "
                           f"{step} within {self.timeout_ms / 1000:.0f} s (died or stuck?): "
                           f"{e}") from e
      for part in text.split(";"):
        start, values = part.split(":")
        rows = np.array([int(v) for v in values.split(",")], np.int64).reshape(-1, *row_shape)
        out[int(start):int(start) + len(rows)] = rows
    if step >= 2:  # every process has read step - 1, so step - 2 is no longer needed
      self.client.key_value_delete(self._key(step - 2, me))
    return out


def _global(host: np.ndarray, sharding):
  """A global array of `host` (the same in every process) with `sharding`."""
  return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


class PromptGenerator:
  """Generation for a list of prompts of any lengths and any count, on any mesh.

  The prompts sit left-aligned in a [B, longest] array. Prefill runs on the first `shortest`
  tokens of every prompt (all real tokens); each decode step then feeds, per sequence, its
  next prompt token while it has one and its last generated token after that (the llama
  reference's scheme), so no sequence ever attends to padding and nothing needs masking.
  A batch that does not split evenly over the expert axis is padded with copies of the
  first prompt when it has more sequences than the axis (batch-sharded attention), else left
  replicated; padding sequences are dropped from the results.

  Works unchanged across `jax.distributed` processes: inputs are global arrays built in every
  process from the same host values, and each step's tokens reach every process (through the
  key-value store, `_TokenReader`), so every process sees every token and takes the same stop
  decisions (every process must call `run` with the same arguments).

  Each decode call runs `steps_per_call` steps on the device (a fori_loop) and returns their
  tokens [B, steps_per_call]; one call is in flight while the previous one's tokens are read,
  streamed and checked for end-of-sequence. A sequence that stops mid-call has the rest of
  that call's tokens dropped, and the last call may run up to steps_per_call - 1 steps past
  the end (the cache has room for them); their tokens are dropped too.
  """

  def __init__(self, model, prompts, max_new_tokens: int, temperature: float = 0.0,
               top_p: float = 1.0, steps_per_call: int = STEPS_PER_CALL):
    prompts = [[int(t) for t in p] for p in prompts]
    if not prompts or min(len(p) for p in prompts) < 1 or max_new_tokens < 1:
      raise ValueError(f"generate: needs at least one prompt, every prompt at least one token "
                       f"and max_new_tokens >= 1; got {len(prompts)} prompt(s) of lengths "
                       f"{[len(p) for p in prompts]}, max_new_tokens {max_new_tokens}")
    bad = [t for p in prompts for t in p if not 0 <= t < model.vocab_size]
    if bad:
      raise ValueError(f"generate: prompt ids must be in [0, {model.vocab_size}), got {bad[:5]}")
    _check_sampling(temperature, top_p)
    if not (isinstance(steps_per_call, (int, np.integer)) and steps_per_call >= 1):
      raise ValueError(f"generate: steps_per_call must be an int >= 1, got {steps_per_call!r}")
    self.model, self.max_new_tokens, self.temperature = model, max_new_tokens, temperature
    self.steps_per_call = n_call = int(steps_per_call)
    self.num_sequences = len(prompts)
    R = model.rules.axis_size
    batch = len(prompts)
    if batch > R and batch % R:
      prompts = prompts + [prompts[0]] * (R - batch % R)
    self.batch = len(prompts)
    self.lengths = np.array([len(p) for p in prompts], np.int32)
    self.shortest, self.longest = int(self.lengths.min()), int(self.lengths.max())
    self.total_len = self.longest + max_new_tokens
    # Decode steps: every position after the shortest prompt but the last feeds one token.
    self.calls = -(-(self.total_len - self.shortest - 1) // n_call)
    cache_len = max(self.total_len, self.shortest + self.calls * n_call)
    limit = getattr(model.cfg, "max_position_embeddings", None)
    if limit is not None and self.total_len > limit:
      raise ValueError(f"generate: the longest prompt ({self.longest} tokens) plus "
                       f"max_new_tokens ({max_new_tokens}) exceeds the model's "
                       f"max_position_embeddings ({limit})")
    ids = np.zeros((self.batch, self.longest), np.int32)
    for i, p in enumerate(prompts):
      ids[i, :len(p)] = p
    mesh = model.rules.mesh
    model.prepare(self.batch, self.shortest)  # communicators allocate: built outside jit
    model.prepare(self.batch, 1)
    rows = model.rules.sharding(ids.shape, ("batch", None))
    self._ids = _global(ids, rows)
    self._prefill_ids = _global(np.ascontiguousarray(ids[:, :self.shortest]), rows)
    self._lengths = _global(self.lengths, model.rules.sharding(self.lengths.shape, ("batch",)))
    self.graphdef, self.state = nnx.split(model)
    graphdef, batch_ = self.graphdef, self.batch
    pick = functools.partial(sample, temperature=temperature, top_p=top_p)
    calls_bn = model.rules.sharding((batch_, n_call), ("batch", None))

    def prefill(state, ids_bs, seed):
      model = nnx.merge(graphdef, state)
      cache = model.init_cache(batch_, cache_len)
      logits_bsv, cache = model(ids_bs, cache=cache, logits_to_keep=1)
      token_b = pick(logits_bsv[:, -1], jax.random.fold_in(jax.random.key(seed), cache.index))
      return token_b, cache

    def steps(state, token_b, cache, ids_bs, lengths_b, seed):
      """n_call decode steps: (their tokens [B, n_call], the last token, the cache)."""
      def feed(token_b, cache):  # the next prompt token while a sequence has one
        position = cache.index  # of the token fed now
        prompt_b = jax.lax.dynamic_index_in_dim(
            ids_bs, jnp.minimum(position, ids_bs.shape[1] - 1), axis=1, keepdims=False)
        return jnp.where(position < lengths_b, prompt_b, token_b)

      def pick_at(i, logits_bv, cache):  # a position's key: the same whatever the call size
        return pick(logits_bv, jax.random.fold_in(jax.random.key(seed), cache.index))

      tokens_bn = jax.lax.with_sharding_constraint(jnp.zeros((batch_, n_call), jnp.int32),
                                                   calls_bn)
      tokens_bn, token_b, cache = decode_steps(nnx.merge(graphdef, state), token_b, cache,
                                               tokens_bn, feed, pick_at)
      return jax.lax.with_sharding_constraint(tokens_bn, calls_bn), token_b, cache

    platform = mesh.devices.flat[0].platform
    self._read = _TokenReader(self.batch)
    self._prefill = jax.jit(prefill)
    self._step = jax.jit(steps, donate_argnames=() if platform == "cpu" else ("cache",))
    self._seed_sharding = NamedSharding(mesh, P())

  def _seed(self, seed: int):
    return _global(np.array(seed, np.uint32), self._seed_sharding)

  def warmup(self) -> None:
    """Compiles (and runs once) the prefill and the decode step, so `run` times no compile."""
    seed = self._seed(0)
    token_b, cache = self._prefill(self.state, self._prefill_ids, seed)
    tokens_bn, _, _ = self._step(self.state, token_b, cache, self._ids, self._lengths, seed)
    self._read(tokens_bn, 0)
    self.model.pool.check()

  def run(self, seed: int = 0, eos_ids=(), on_token=None, ignore_eos: bool = False,
          check_every: int = 1) -> Completion:
    """Generates up to max_new_tokens per sequence; a sequence stops after an id of `eos_ids`
    (unless ignore_eos) and the run ends once every sequence stopped.

    on_token(sequence, token_id) is called for each generated token as it arrives (in
    order per sequence). Communicator errors are checked every `check_every` steps and at
    the end (jm.CommError).
    """
    seed_array, eos = self._seed(seed), set(int(e) for e in eos_ids) if not ignore_eos else set()
    n = self.num_sequences
    generated = [[] for _ in range(n)]
    stopped = [False] * n
    started = time.perf_counter()
    self._read = _TokenReader(self.batch)
    token_b, cache = self._prefill(self.state, self._prefill_ids, seed_array)
    tokens_bn = token_b  # the tokens read next: the prefill's [B], then a call's [B, n_call]
    position = self.shortest  # of the first token of tokens_bn
    # One call in flight: the next is launched before this one's tokens are read.
    prefill_s = None
    decode_start, decode_steps = None, 0
    for k in range(self.calls + 1):
      pending = None
      if k < self.calls and not all(stopped):
        pending = self._step(self.state, token_b, cache, self._ids, self._lengths, seed_array)
      tokens = self._read(tokens_bn, k).reshape(self.batch, -1)
      if prefill_s is None:
        prefill_s = time.perf_counter() - started
        decode_start = time.perf_counter()
      if k % check_every == 0:
        self.model.pool.check()
      for j in range(tokens.shape[1]):
        for i in range(n):
          if (stopped[i] or position + j < self.lengths[i]
              or len(generated[i]) >= self.max_new_tokens):
            continue
          token = int(tokens[i, j])
          generated[i].append(token)
          if on_token is not None:
            on_token(i, token)
          if token in eos:
            stopped[i] = True
      if k:  # the steps whose tokens were needed (a last call's overrun not counted)
        decode_steps += min(tokens.shape[1], self.total_len - position)
      position += tokens.shape[1]
      finished = all(s or len(g) >= self.max_new_tokens for s, g in zip(stopped, generated))
      if pending is None or finished:
        if pending is not None:
          jax.block_until_ready(pending[0])
        break
      tokens_bn, token_b, cache = pending
    decode_s = time.perf_counter() - decode_start
    self.model.pool.check()
    return Completion(generated, prefill_s, decode_s, decode_steps, stopped)
