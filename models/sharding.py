"""Logical-axis sharding rules for the models: one dataclass maps logical names to mesh axes.

Every parameter and activation names its dimensions with logical axes (`"experts"`,
`"embed"`, ...). `ShardingRules` turns those names into a `PartitionSpec` of the mesh, so the
parallel plan lives in one place. The mesh has a data-parallel axis (`axis`, "ep" on the
default 1-D mesh) and optionally a tensor-parallel one (`tp_axis`, e.g. a ("dp", "tp") mesh):

  batch, tokens      -> axis             attention data-parallel: each group its own sequences;
                                         MoE tokens data-parallel over the same groups
  experts            -> (axis, tp_axis)  each device holds num_experts / (dp * tp) experts
  heads, kv_heads,   -> tp_axis          attention heads and the dense MLP's hidden units split
  mlp                                    over a tensor-parallel group (Megatron: column-parallel
                                         in, row-parallel out, partial sums reduced over tp)
  anything else      -> replicated       embed, vocab, head_dim, expert_mlp, latents, ...

Without a tp axis the plan is the expert-parallel one: batch, tokens and experts over `axis`.
A dimension is only sharded when its size divides by the mesh axes' size (decode with batch 1
on 8 devices keeps the batch replicated); `spec_for` applies that rule. Layers that need
whole heads on a rank check the head counts themselves (the flat [D, heads * head_dim]
weights divide by tp more often than the heads do).

Parameters are created abstract (`param`): an `nnx.Param` holding a `jax.ShapeDtypeStruct`
with its `NamedSharding`, and the logical axes as metadata (`logical_axes`). The loader
(`jax_moe.models.loader`) or the random initializer then places each value directly with that
sharding, so no device ever holds a full host copy of a sharded weight. A block-fp8
parameter (`fp8_param`) holds a `grouped_gemm.BlockFp8Weights` of two such abstract arrays.
Layers with their own collectives (tensor-parallel attention and MLP) run per device through
`ShardingRules.per_device`, which hands them their parameters' shards as those axes lay out.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_moe.grouped_gemm import BlockFp8Weights

DEFAULT_AXIS = "ep"
TP_MESH_AXES = ("dp", "tp")  # the axis names a 2-D mesh is read as when none are given
# logical axes that follow the data-parallel axis, and the tensor-parallel one; experts follow
# both; everything else is replicated
_DP_LOGICAL_AXES = ("batch", "tokens")
_TP_LOGICAL_AXES = ("heads", "kv_heads", "mlp")


def default_mesh(devices: Sequence[jax.Device] | None = None, axis: str = DEFAULT_AXIS) -> Mesh:
  """All local devices (or `devices`) on one expert-parallel axis."""
  devices = list(devices) if devices is not None else jax.local_devices()
  return Mesh(np.array(devices), (axis,))


@dataclasses.dataclass(frozen=True)
class ShardingRules:
  """Logical axis -> mesh axis (or tuple of mesh axes) for one mesh.

  `axis` is the data-parallel axis, `tp_axis` the tensor-parallel one (None: no tensor
  parallelism); the two must cover the mesh's axes. `rules` lists (logical name, mesh axis,
  tuple of them, or None); a logical name not listed is replicated. The default is the plan
  of the module docstring.
  """

  mesh: Mesh
  axis: str = DEFAULT_AXIS
  tp_axis: str | None = None
  rules: tuple[tuple[str, str | tuple[str, ...] | None], ...] | None = None

  def __post_init__(self):
    named = (self.axis,) if self.tp_axis is None else (self.axis, self.tp_axis)
    for arg, name in zip(("axis", "tp_axis"), named):
      if name not in self.mesh.shape:
        raise ValueError(f"ShardingRules: {arg} {name!r} is not an axis of the mesh "
                         f"{dict(self.mesh.shape)}")
    if self.axis == self.tp_axis:
      raise ValueError(f"ShardingRules: axis and tp_axis must differ, both are {self.axis!r}")
    # An axis no rule names would replicate everything over it, experts included: a
    # communicator over part of the devices with tokens duplicated on the rest.
    if set(self.mesh.axis_names) != set(named):
      raise ValueError(f"ShardingRules: axis={self.axis!r} and tp_axis={self.tp_axis!r} must "
                       f"name every axis of the mesh {dict(self.mesh.shape)}")
    if self.rules is None:
      rules = [(name, self.axis) for name in _DP_LOGICAL_AXES]
      rules.append(("experts", self.expert_axis))
      if self.tp_axis is not None:
        rules += [(name, self.tp_axis) for name in _TP_LOGICAL_AXES]
      object.__setattr__(self, "rules", tuple(rules))
    for name, mesh_axis in self.rules:
      missing = [a for a in _names(mesh_axis) if a not in self.mesh.shape]
      if missing:
        raise ValueError(f"ShardingRules: rule {name!r} -> {mesh_axis!r} names no mesh axis "
                         f"{dict(self.mesh.shape)}")

  @classmethod
  def of_mesh(cls, mesh: Mesh, axis: str | None = None,
              tp_axis: str | None = None) -> "ShardingRules":
    """Rules for `mesh`, its axes read from their names where not given: a 1-D mesh is
    data-parallel (expert-parallel) over its one axis, a ("dp", "tp") mesh is tp groups
    inside dp."""
    if axis is None:
      names = tuple(mesh.axis_names)
      if len(names) == 1:
        axis = names[0]
      elif tp_axis is None and names == TP_MESH_AXES:
        axis, tp_axis = TP_MESH_AXES
      else:
        rest = [n for n in names if n != tp_axis]
        if len(rest) != 1:
          raise ValueError(f"mesh axes {names}: name the data-parallel `axis` and the "
                           f"tensor-parallel `tp_axis` (or use a {TP_MESH_AXES} mesh)")
        axis = rest[0]
    return cls(mesh, axis, tp_axis)

  @property
  def axis_size(self) -> int:
    """Devices on the data-parallel axis: the batch and the MoE tokens split that many ways
    (on a 1-D mesh, R: the expert-parallel ranks)."""
    return self.mesh.shape[self.axis]

  @property
  def tp_size(self) -> int:
    """Devices of one tensor-parallel group (1 without a tp axis)."""
    return 1 if self.tp_axis is None else self.mesh.shape[self.tp_axis]

  @property
  def expert_axis(self) -> str | tuple[str, str]:
    """The experts' mesh axes, the Communicator's `axis`: ranks row-major over (dp, tp)."""
    return self.axis if self.tp_axis is None else (self.axis, self.tp_axis)

  @property
  def expert_size(self) -> int:
    """Devices the experts are sharded over (dp * tp)."""
    return self.axis_size * self.tp_size

  def mesh_axis(self, logical: str | None) -> str | tuple[str, ...] | None:
    return dict(self.rules).get(logical) if logical is not None else None

  def is_sharded(self, size: int, logical: str) -> bool:
    """Whether a dimension of `size` with logical name `logical` is split over devices."""
    return self.spec_for((size,), (logical,))[0] is not None

  def spec_for(self, shape: Sequence[int], logical_axes: Sequence[str | None]) -> P:
    """PartitionSpec for `shape`: a dim is sharded only where its size divides by the axis."""
    if len(shape) != len(logical_axes):
      raise ValueError(f"ShardingRules.spec_for: {len(logical_axes)} logical axes "
                       f"{tuple(logical_axes)} for a {len(shape)}-d shape {tuple(shape)}")
    axes = []
    for size, name in zip(shape, logical_axes):
      mesh_axis = self.mesh_axis(name)
      devices = math.prod(self.mesh.shape[a] for a in _names(mesh_axis))
      axes.append(mesh_axis if mesh_axis is not None and size % devices == 0 else None)
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

  def per_device(self, fn, module: nnx.Module, *args, in_specs, out_specs):
    """fn(module, *args) on each device's shards, inside shard_map over the whole mesh:
    the module's parameters arrive as their logical axes shard them, `args` and the outputs
    as `in_specs` / `out_specs` say (PartitionSpecs, e.g. from `spec_for`). For layers that
    place their own collectives: tensor-parallel attention and MLP sum their partial
    outputs over tp where XLA's partitioner would pick its own all-reduce."""
    from jax_moe.sharding import shard_map
    graphdef, state = nnx.split(module)
    state_specs = jax.tree.map(
        lambda v: v.replace(self.spec_for(v.get_value().shape, v.logical_axes)), state,
        is_leaf=lambda v: isinstance(v, nnx.Variable))
    body = lambda state, *local: fn(nnx.merge(graphdef, state), *local)
    return shard_map(body, self.mesh, in_specs=(state_specs, *in_specs),
                     out_specs=out_specs)(state, *args)


def _names(mesh_axis) -> tuple[str, ...]:
  """The mesh axes of one rule's target: none, one name, or a tuple of names."""
  if mesh_axis is None:
    return ()
  return (mesh_axis,) if isinstance(mesh_axis, str) else tuple(mesh_axis)


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
