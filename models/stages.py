"""The stages of a decoder layer, as named scopes in the compiled program.

Each stage's ops run under `jax.named_scope(stage)`, so every HLO instruction's op_name
metadata carries the stage's name as one of its path components; a profile then charges each
kernel to the innermost stage in its op_name (benchmarks/stage_profile.py), and what carries
none is "other" (norms, residual adds, embedding, LM head, sampling, the loop itself).
"""

import contextlib

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


def mlp_scope(is_moe: bool):
  """The scope of a layer's MLP: none for a MoE layer (its router, exchange and experts have
  their own), DENSE_MLP for a dense one."""
  return contextlib.nullcontext() if is_moe else jax.named_scope(DENSE_MLP)


def pre_norm_residual(x_bsd, attention_norm, attention, mlp_norm, mlp, is_moe: bool):
  """A decoder layer's two pre-norm residual blocks, each stage in its scope:
  x + attention(norm(x)) then + mlp(norm(.)). `attention(h)` returns (out, cache); returns
  (x, cache)."""
  h_bsd = attention_norm(x_bsd)
  with jax.named_scope(ATTENTION):
    h_bsd, cache = attention(h_bsd)
  x_bsd = x_bsd + h_bsd
  h_bsd = mlp_norm(x_bsd)
  with mlp_scope(is_moe):
    h_bsd = mlp(h_bsd)
  return x_bsd + h_bsd, cache


def stage_of(op_name: str) -> str:
  """The innermost stage among the path components of an op_name ("jit(decode)/while/body/
  attention/dot_general" -> "attention"), else OTHER."""
  for part in reversed(op_name.split("/")):
    if part in STAGES:
      return part
  return OTHER
