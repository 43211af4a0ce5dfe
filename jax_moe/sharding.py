"""shard_map for code that calls a Communicator, and the expert-parallel axis of a mesh.

A communicator's axis is one mesh axis name or a tuple of them; ranks run row-major over the
tuple (as `jax.lax.axis_index` numbers them), so rank = i0 * size1 + i1 for ("dp", "tp").
"""

from __future__ import annotations

import math

import jax
import numpy as np


def axis_names(axis) -> tuple[str, ...]:
  """The mesh axis names of a communicator axis (a name or a tuple of names)."""
  return (axis,) if isinstance(axis, str) else tuple(axis)


def axis_size(mesh, axis) -> int:
  """Ranks along `axis`: the product of its mesh axes' sizes."""
  return math.prod(mesh.shape[name] for name in axis_names(axis))


def rank_groups(mesh, axis) -> np.ndarray:
  """[groups, R] devices: each row is one group along `axis`, in rank order."""
  names = axis_names(axis)
  others = [i for i, n in enumerate(mesh.axis_names) if n not in names]
  order = others + [mesh.axis_names.index(n) for n in names]
  devices = np.transpose(mesh.devices, order)
  return devices.reshape(-1, axis_size(mesh, axis))


def shard_map(fn, mesh, in_specs, out_specs):
  """`jax.shard_map` with the replication check off.

  The check cannot see through the cuda backend's FFI custom calls, so programs that use a
  Communicator turn it off; the outputs' specs state the sharding instead.
  """
  return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
