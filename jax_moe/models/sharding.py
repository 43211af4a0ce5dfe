"""Logical-axis sharding rules for the models: one dataclass maps logical names to mesh axes.

Every parameter and activation names its dimensions with logical axes (`"experts"`,
`"embed"`, ...). `ShardingRules` turns those names into a `PartitionSpec` of the mesh, so the
parallel plan lives in one place:

  batch, tokens -> the expert axis   attention data-parallel: each device its own sequences;
                                     MoE tokens data-parallel over the same devices
  experts       -> the expert axis   each device holds num_experts / R experts
  anything else -> replicated        embed, vocab, mlp, heads, kv_heads, head_dim, ...

A dimension is only sharded when its size divides by the mesh axis size (decode with batch 1
on 8 devices keeps the batch replicated); `spec_for` applies that rule.

Parameters are created abstract (`param`): an `nnx.Param` holding a `jax.ShapeDtypeStruct`
with its `NamedSharding`, and the logical axes as metadata (`logical_axes`). The loader
(`jax_moe.models.loader`) or the random initializer then places each value directly with that
sharding, so no device ever holds a full host copy of a sharded weight. A block-fp8
parameter (`fp8_param`) holds a `grouped_gemm.BlockFp8Weights` of two such abstract arrays.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_moe.grouped_gemm import BlockFp8Weights

DEFAULT_AXIS = "ep"
# logical axes that follow the expert-parallel mesh axis; everything else is replicated
_SHARDED_LOGICAL_AXES = ("batch", "tokens", "experts")


def default_mesh(devices: Sequence[jax.Device] | None = None, axis: str = DEFAULT_AXIS) -> Mesh:
  """All local devices (or `devices`) on one expert-parallel axis."""
  devices = list(devices) if devices is not None else jax.local_devices()
  return Mesh(np.array(devices), (axis,))


@dataclasses.dataclass(frozen=True)
class ShardingRules:
  """Logical axis -> mesh axis for one mesh.

  `rules` lists (logical name, mesh axis or None); a logical name not listed is replicated.
  The default shards batch, tokens and experts over `axis` (the expert-parallel axis).
  """

  mesh: Mesh
  axis: str = DEFAULT_AXIS
  rules: tuple[tuple[str, str | None], ...] | None = None

  def __post_init__(self):
    if self.axis not in self.mesh.shape:
      raise ValueError(f"ShardingRules: axis {self.axis!r} is not an axis of the mesh "
                       f"{dict(self.mesh.shape)}")
    if self.rules is None:
      object.__setattr__(self, "rules", tuple((name, self.axis) for name in _SHARDED_LOGICAL_AXES))
    for name, mesh_axis in self.rules:
      if mesh_axis is not None and mesh_axis not in self.mesh.shape:
        raise ValueError(f"ShardingRules: rule {name!r} -> {mesh_axis!r} names no mesh axis "
                         f"{dict(self.mesh.shape)}")

  @property
  def axis_size(self) -> int:
    """R: devices on the expert-parallel axis."""
    return self.mesh.shape[self.axis]

  def mesh_axis(self, logical: str | None) -> str | None:
    return dict(self.rules).get(logical) if logical is not None else None

  def spec_for(self, shape: Sequence[int], logical_axes: Sequence[str | None]) -> P:
    """PartitionSpec for `shape`: a dim is sharded only where its size divides by the axis."""
    if len(shape) != len(logical_axes):
      raise ValueError(f"ShardingRules.spec_for: {len(logical_axes)} logical axes "
                       f"{tuple(logical_axes)} for a {len(shape)}-d shape {tuple(shape)}")
    axes = []
    for size, name in zip(shape, logical_axes):
      mesh_axis = self.mesh_axis(name)
      axes.append(mesh_axis if mesh_axis is not None and size % self.mesh.shape[mesh_axis] == 0
                  else None)
    return P(*axes)

  def sharding(self, shape: Sequence[int], logical_axes: Sequence[str | None]) -> NamedSharding:
    return NamedSharding(self.mesh, self.spec_for(shape, logical_axes))

  def rowwise(self, fn, *arrays):
    """fn(*arrays) run on each device's rows (leading dims sharded over the axis, outputs
    too) when the rows divide by the axis size, else on the whole arrays. For row-wise work
    such as routing: XLA's partitioner all-gathers top_k's operand over the batch otherwise,
    a collective per MoE layer (across processes, one that a dead peer blocks for ever)."""
    from jax_moe.sharding import shard_map
    if any(a.shape[0] % self.axis_size for a in arrays):
      return fn(*arrays)
    spec = P(self.axis)
    return shard_map(fn, self.mesh, in_specs=(spec,) * len(arrays), out_specs=spec)(*arrays)

  def constrain(self, x: jax.Array, *logical_axes: str | None) -> jax.Array:
    """with_sharding_constraint by logical axes (inside jit; a no-op on one device)."""
    return jax.lax.with_sharding_constraint(x, self.sharding(x.shape, logical_axes))


def param(rules: ShardingRules, shape: Sequence[int], logical_axes: Sequence[str | None],
          dtype) -> nnx.Param:
  """An abstract parameter: ShapeDtypeStruct with its NamedSharding; filled by the loader.

  Metadata `logical_axes` keeps the dimension names (for printing the layout and for tools).
  """
  shape = tuple(int(s) for s in shape)
  sharding = rules.sharding(shape, logical_axes)
  return nnx.Param(jax.ShapeDtypeStruct(shape, dtype, sharding=sharding),
                   logical_axes=tuple(logical_axes))


def fp8_param(rules: ShardingRules, shape_gkn: Sequence[int], logical_axes: Sequence[str | None],
              block: tuple[int, int]) -> nnx.Param:
  """An abstract block-fp8 parameter of logical shape [G, K, N] (what `param` would hold):
  a BlockFp8Weights of codes [G, N, K] and scales [G, ceil(N/bn), ceil(K/bk)], both sharded
  over G's axis as `param` would shard it. The codes' other dims follow their logical axes
  (K, N); each scale block spans many codes, so the scales keep their other dims whole."""
  g, k, n = (int(s) for s in shape_gkn)
  axis_g, axis_k, axis_n = logical_axes
  codes_gnk = jax.ShapeDtypeStruct((g, n, k), jnp.float8_e4m3fn,
                                   sharding=rules.sharding((g, n, k), (axis_g, axis_n, axis_k)))
  scales_shape = (g, -(-n // block[0]), -(-k // block[1]))
  scales = jax.ShapeDtypeStruct(scales_shape, jnp.float32,
                                sharding=rules.sharding(scales_shape, (axis_g, None, None)))
  return nnx.Param(BlockFp8Weights(codes_gnk, scales, block), logical_axes=tuple(logical_axes))
