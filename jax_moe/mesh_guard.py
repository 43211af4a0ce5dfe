"""A check of the program's devices against a communicator's, made when the program is lowered.

Tracing inside `jax.shard_map` sees only the mesh's axis names and sizes; the device order
appears when the program is lowered (the shard_map's concrete mesh). The native backends
(`host`, `cuda`) give each device the rank it had when the communicator was built, so a mesh
with the same devices in another order would silently mix the ranks up. `guard(x, ...)`
returns `x` unchanged (it lowers to no operation) and refuses such a program while lowering.
"""

from __future__ import annotations

import jax
from jax._src import core
from jax._src.interpreters import mlir

_guard_p = core.Primitive("jax_moe_mesh_guard")
_guard_p.def_impl(lambda x, **_: x)
_guard_p.def_abstract_eval(lambda x, **_: x)


def _lowering(ctx, x, *, axis_names, device_ids, owner):
  mesh = getattr(ctx.module_context.axis_context, "mesh", None)
  devices = getattr(mesh, "devices", None)
  if devices is not None and tuple(mesh.axis_names) == axis_names:
    have = tuple(int(d.id) for d in devices.flat)
    if have != device_ids:
      raise ValueError(f"{owner} was built on devices {list(device_ids)} (mesh axes "
                       f"{axis_names}), but this program's mesh orders them {list(have)}; "
                       f"build a Communicator on the mesh the program uses")
  return [x]


mlir.register_lowering(_guard_p, _lowering)


def guard(x: jax.Array, mesh: jax.sharding.Mesh, owner: str) -> jax.Array:
  """`x`, with the program refused at lowering unless its mesh has `mesh`'s device order."""
  return _guard_p.bind(x, axis_names=tuple(mesh.axis_names),
                       device_ids=tuple(int(d.id) for d in mesh.devices.flat), owner=owner)
