"""The stages of a decoder layer, as named scopes in the compiled program.

Each stage's ops run under `jax.named_scope(stage)`, so every HLO instruction's op_name
metadata carries the stage's name as one of its path components; a profile then charges each
kernel to the innermost stage in its op_name (benchmarks/stage_profile.py), and what carries
none is "other" (norms, residual adds, embedding, LM head, sampling, the loop itself).

A layer runs its stages as a generator (`pre_norm_residual`): a MoE block may yield its
pending dispatch between the halves, so a driver (models.two_batch) runs other work there;
`finish` runs one that yields nothing to its end.
"""

import jax

ATTENTION = "attention"
ROUTER = "router"
DISPATCH = "dispatch"  # the exchange's dispatch, and the fp8 rows' dequantization after it
EXPERTS = "experts"    # the routed experts' grouped GEMMs
COMBINE = "combine"
SHARED_EXPERTS = "shared_experts"
DENSE_MLP = "dense_mlp"
STAGES = (ATTENTION, ROUTER, DISPATCH, EXPERTS, COMBINE, SHARED_EXPERTS, DENSE_MLP)
OTHER = "other"


def pre_norm_residual(x_bsd, attention_norm, attention, mlp_norm, mlp_steps, is_moe: bool):
  """A decoder layer's two pre-norm residual blocks, each stage in its scope:
  x + attention(norm(x)) then + mlp(norm(.)), as a generator: `mlp_steps(h)` is one too (a
  MoE block's yields of its pending exchange pass through to the driver: models.two_batch;
  `without_halves(mlp)` for a block that has none). `attention(h)` returns (out, cache);
  returns (x, cache). Run it to its end with `finish`."""
  h_bsd = attention_norm(x_bsd)
  with jax.named_scope(ATTENTION):
    h_bsd, cache = attention(h_bsd)
  x_bsd = x_bsd + h_bsd
  h_bsd = mlp_norm(x_bsd)
  if is_moe:  # no scope open across a yield: the driver runs other code while it is suspended
    h_bsd = yield from mlp_steps(h_bsd)
  else:
    with jax.named_scope(DENSE_MLP):
      h_bsd = yield from mlp_steps(h_bsd)
  return x_bsd + h_bsd, cache


def without_halves(fn):
  """`fn` as a generator function that never yields: a layer part with no exchange halves."""
  def steps(*args):
    yield from ()
    return fn(*args)
  return steps


def mlp_steps(mlp, is_moe: bool, slot: int | None):
  """A layer's MLP block as pre_norm_residual takes it: with `slot` (a micro-batch of the
  two-batch overlap) a MoE block's `steps` (its dispatch as halves, a yield between), else
  the block's fused call."""
  if is_moe and slot is not None:
    return lambda h: mlp.steps(h, slot)
  return without_halves(mlp)


def finish(steps, value=None):
  """Resumes the generator `steps` with `value` (None: starts it) and returns what it
  returns; it must end there, without yielding again."""
  try:
    steps.send(value)
  except StopIteration as done:
    return done.value
  raise RuntimeError("a layer's steps yielded a pending exchange where none was expected "
                     "(only models.two_batch drives halves in flight)")


def stage_of(op_name: str) -> str:
  """The innermost stage among the path components of an op_name ("jit(decode)/while/body/
  attention/dot_general" -> "attention"), else OTHER."""
  for part in reversed(op_name.split("/")):
    if part in STAGES:
      return part
  return OTHER
