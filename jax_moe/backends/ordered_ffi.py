"""FFI calls that XLA runs in program order, for the host backend.

XLA:CPU runs the thunks of one program concurrently, ordered only by the buffers they share:
two host custom calls without a data dependency (the second dispatch_send of a program and
the first dispatch_recv, say) may start in either order on each device, and a dispatch_send
that waits for the acknowledgement of a dispatch_recv not yet run on its own device blocks
for ever (optimization_barrier adds no buffer dependency). `ordered_ffi_call` gives the call
an ordered effect, as `io_callback(ordered=True)` does: JAX threads one token through every
such call in program order (and across jitted calls), so each device runs them in the order
the program wrote them. The FFI handler takes the token as its first argument and returns it
as its first result.

A program that fails leaves an errored token behind, and JAX would hand it to every later
ordered program, failing them all; `drop_failed_token` forgets such a token (the host backend
calls it whenever a communicator is built, checked or traced), so one failed call does not take
the process down.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax._src import core, dispatch, effects
from jax._src.interpreters import mlir


class HostOrderEffect(effects.Effect):
  __str__ = lambda _: "jax_moe host order"  # noqa: E731


_EFFECT = HostOrderEffect()
effects.lowerable_effects.add_type(HostOrderEffect)
effects.control_flow_allowed_effects.add_type(HostOrderEffect)
effects.ordered_effects.add_type(HostOrderEffect)
effects.shardable_ordered_effects.add_type(HostOrderEffect)

_ordered_ffi_call_p = core.Primitive("jax_moe_ordered_ffi_call")
_ordered_ffi_call_p.multiple_results = True
_ordered_ffi_call_p.def_impl(functools.partial(dispatch.apply_primitive, _ordered_ffi_call_p))


def _abstract_eval(*avals, target, result_avals, attrs):
  del avals, target, attrs
  return result_avals, {_EFFECT}


_ordered_ffi_call_p.def_effectful_abstract_eval(_abstract_eval)


def _lowering(ctx, *args, target, result_avals, attrs):
  del result_avals
  token = ctx.tokens_in.get(_EFFECT)
  with_token = dataclasses.replace(ctx, avals_in=[core.abstract_token, *ctx.avals_in],
                                   avals_out=[core.abstract_token, *ctx.avals_out])
  op = jax.ffi.build_ffi_lowering_function(target, has_side_effect=True)(
      with_token, token, *args, **dict(attrs))
  token, *results = op.results
  ctx.set_tokens_out(ctx.tokens_in.update_tokens(mlir.TokenSet({_EFFECT: token})))
  return results


mlir.register_lowering(_ordered_ffi_call_p, _lowering, platform="cpu")


def ordered_ffi_call(target: str, result_types, *args, **attrs):
  """Like `jax.ffi.ffi_call(target, result_types, has_side_effect=True)(*args, **attrs)`,
  run in program order with every other ordered call (CPU only)."""
  single = not isinstance(result_types, (tuple, list))
  types = (result_types,) if single else tuple(result_types)
  result_avals = tuple(core.ShapedArray(t.shape, t.dtype) for t in types)
  results = _ordered_ffi_call_p.bind(*args, target=target, result_avals=result_avals,
                                     attrs=tuple(sorted(attrs.items())))
  return results[0] if single else tuple(results)


def drop_failed_token() -> bool:
  """Forgets this effect's token when the program that produced it failed. Returns whether it
  did. A token still being computed is left alone (its program may yet succeed)."""
  tokens = getattr(getattr(dispatch, "runtime_tokens", None), "current_tokens", {})
  token = tokens.get(_EFFECT)
  if token is None or not token._buf.is_ready():
    return False
  try:
    token.block_until_ready()
  except Exception:  # the failure was already raised to whoever ran that program
    tokens.pop(_EFFECT, None)
    return True
  return False
