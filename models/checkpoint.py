"""How a model declares where each parameter comes from in a Hugging Face checkpoint.

A model's `checkpoint_map()` returns {parameter path: source}; a parameter path is the
tuple nnx uses (`("layers", 0, "attn", "q", "w")`). The generic loader asks each source for
the checkpoint tensors it needs, checks the shape it yields against the parameter, and calls
`read(reader, index)` for each device's slice only (`index` is a tuple of slices of the
*parameter*; sources translate it to the checkpoint's orientation). `reader` is a
`loader.CheckpointReader`: `reader.has(name)`, `reader.shape(name)`,
`reader.read(name, index)` -> numpy f32/bf16/... slice (fp8 block-scaled weights come back
dequantized), `reader.read_stored(name, index)` -> the slice as stored (fp8 codes as codes).

Sources:
  Tensor(name, transpose=False)   one tensor; transpose=True for torch nn.Linear weights
                                  ([out, in] in the checkpoint, [in, out] as a parameter);
                                  `linear(prefix)` is Tensor(prefix + ".weight", transpose=True).
  HeadRows(name, heads, first_row, num_rows)
                                  per-head [in, num_rows] blocks of one nn.Linear weight whose
                                  [heads * rows_per_head, in] rows go head by head (MLA's
                                  kv_b_proj: each head's N key rows, then its V value rows), as a
                                  head-major parameter [heads, in, num_rows].
  StackedExperts(per_expert, num_experts, fused=..., fused_part=..., fused_parts=...)
                                  [E, in, out] from per-expert Linear weights
                                  `per_expert.format(e=e)` ([out, in] each), or from one fused
                                  [E, out_total, in] tensor (transformers >= 5 in-memory
                                  layout, e.g. `experts.gate_up_proj` [E, 2F, D]) whose
                                  `fused_part`-th of `fused_parts` chunks along dim 1 is taken.
                                  A block-fp8 parameter (`grouped_gemm.BlockFp8Weights`) reads
                                  per-expert codes and scales as stored (`stored_fp8`,
                                  `read_codes`, `read_scales`); the loader quantizes `read`'s
                                  values when the checkpoint has none.
  ExpertPair(first, second)       two StackedExperts side by side, [E, in, 2, out] (the routed
                                  experts' gate and up as one parameter).
  TensorPair(first, second)       two [in, out] Tensors side by side, [in, 2, out] (a shared
                                  expert's gate and up).
  SharedSlots(routed, shared, experts_per_shard)
                                  the routed experts [E, ...] with the shared expert [...] in
                                  front of each shard's L experts: [E + E / L, ...]
                                  (RoutedExperts with `shared_expert`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jax_moe.models.fp8_weights import SCALE_SUFFIX

# The name of the routed experts' [E, D, 2, F] gate-and-up parameter (models.moe.RoutedExperts),
# which the loader's random init and the models' init scales single out too.
GATE_UP_PAIR = "w_gate_up_ed2f"


class CheckpointError(ValueError):
  """A checkpoint that does not fit the model: missing tensor, wrong shape, unknown type."""


def _bounds(index_slice: slice, size: int) -> tuple[int, int]:
  start, stop, step = index_slice.indices(size)
  if step != 1:
    raise ValueError(f"checkpoint reads take contiguous slices, got step {step}")
  return start, stop


@dataclasses.dataclass(frozen=True)
class Tensor:
  name: str
  transpose: bool = False

  def names(self, reader) -> list[str]:
    return [self.name]

  def shape(self, reader) -> tuple[int, ...]:
    shape = tuple(reader.shape(self.name))
    return shape[::-1] if self.transpose else shape

  def read(self, reader, index) -> np.ndarray:
    if self.transpose:
      return reader.read(self.name, tuple(index)[::-1]).T
    return reader.read(self.name, tuple(index))


def linear(prefix: str) -> Tensor:
  """The weight of a torch nn.Linear named `prefix`, as an [in, out] parameter."""
  return Tensor(prefix + ".weight", transpose=True)


@dataclasses.dataclass(frozen=True)
class HeadRows:
  name: str        # e.g. "model.layers.0.self_attn.kv_b_proj.weight"
  heads: int
  first_row: int   # within a head's rows
  num_rows: int

  def names(self, reader) -> list[str]:
    return [self.name]

  def _rows_per_head(self, reader) -> int:
    rows = reader.shape(self.name)[0]
    if rows % self.heads or self.first_row + self.num_rows > rows // self.heads:
      raise CheckpointError(f"{self.name}: {rows} rows do not hold {self.heads} heads with rows "
                            f"[{self.first_row}, {self.first_row + self.num_rows}) each")
    return rows // self.heads

  def shape(self, reader) -> tuple[int, ...]:
    self._rows_per_head(reader)
    return (self.heads, reader.shape(self.name)[1], self.num_rows)

  def read(self, reader, index) -> np.ndarray:
    per_head = self._rows_per_head(reader)
    h0, h1 = _bounds(index[0], self.heads)
    r0, r1 = _bounds(index[2], self.num_rows)
    # the whole rows of heads [h0, h1) are one contiguous block of the checkpoint tensor
    w_hri = reader.read(self.name, (slice(h0 * per_head, h1 * per_head), index[1]))
    w_hri = w_hri.reshape(h1 - h0, per_head, -1)[:, self.first_row + r0:self.first_row + r1]
    return np.swapaxes(w_hri, 1, 2)


@dataclasses.dataclass(frozen=True)
class StackedExperts:
  per_expert: str          # e.g. "model.layers.0.mlp.experts.{e}.gate_proj.weight"
  num_experts: int
  fused: str | None = None  # e.g. "model.layers.0.mlp.experts.gate_up_proj"
  fused_part: int = 0
  fused_parts: int = 1

  def _layout(self, reader) -> str:
    if reader.has(self.per_expert.format(e=0)):
      return "per_expert"
    if self.fused is not None and reader.has(self.fused):
      return "fused"
    return "missing"

  def names(self, reader) -> list[str]:
    if self._layout(reader) == "fused":
      return [self.fused]
    return [self.per_expert.format(e=e) for e in range(self.num_experts)]

  def shape(self, reader) -> tuple[int, ...]:
    if self._layout(reader) == "fused":
      E, out_total, dim_in = reader.shape(self.fused)
      if out_total % self.fused_parts:
        raise CheckpointError(f"{self.fused}: dim 1 ({out_total}) does not split into "
                              f"{self.fused_parts} equal parts")
      return (E, dim_in, out_total // self.fused_parts)
    shapes = {tuple(reader.shape(name)) for name in self.names(reader)}
    if len(shapes) != 1:
      raise CheckpointError(f"{self.per_expert}: experts have different shapes {sorted(shapes)}")
    dim_out, dim_in = shapes.pop()
    return (self.num_experts, dim_in, dim_out)

  def read(self, reader, index) -> np.ndarray:
    E, dim_in, dim_out = self.shape(reader)
    e0, e1 = _bounds(index[0], E)
    i0, i1 = _bounds(index[1], dim_in)
    o0, o1 = _bounds(index[2], dim_out)
    if self._layout(reader) == "fused":
      base = self.fused_part * dim_out
      w_eoi = reader.read(self.fused, (slice(e0, e1), slice(base + o0, base + o1), slice(i0, i1)))
      return np.swapaxes(w_eoi, 1, 2)
    return np.stack([reader.read(self.per_expert.format(e=e), (slice(o0, o1), slice(i0, i1))).T
                     for e in range(e0, e1)])

  # block-fp8 weights as the checkpoint stores them: per expert, codes [out, in] + scales
  def stored_fp8(self, reader) -> bool:
    return (self._layout(reader) == "per_expert"
            and reader.has(self.per_expert.format(e=0) + SCALE_SUFFIX))

  def read_codes(self, reader, index) -> np.ndarray:
    """The slice `index` of the codes [E, out, in] (e4m3), in the stored orientation."""
    return self._read_stacked(reader, "", index)

  def read_scales(self, reader, index) -> np.ndarray:
    """The slice `index` of the scales [E, ceil(out/bo), ceil(in/bi)] (f32)."""
    return self._read_stacked(reader, SCALE_SUFFIX, index)

  def scales_shape(self, reader) -> tuple[int, ...]:
    shapes = {tuple(reader.shape(self.per_expert.format(e=e) + SCALE_SUFFIX))
              for e in range(self.num_experts)}
    if len(shapes) != 1:
      raise CheckpointError(f"{self.per_expert}{SCALE_SUFFIX}: experts have different shapes "
                            f"{sorted(shapes)}")
    return (self.num_experts, *shapes.pop())

  def _read_stacked(self, reader, suffix: str, index) -> np.ndarray:
    e0, e1 = _bounds(index[0], self.num_experts)
    return np.stack([reader.read_stored(self.per_expert.format(e=e) + suffix, tuple(index[1:]))
                     for e in range(e0, e1)])


@dataclasses.dataclass(frozen=True)
class ExpertPair:
  """Two [E, in, out] sources side by side as one [E, in, 2, out] parameter (the routed
  experts' gate and up, read by one GEMM)."""
  first: StackedExperts
  second: StackedExperts

  def names(self, reader) -> list[str]:
    return list(dict.fromkeys(self.first.names(reader) + self.second.names(reader)))

  def shape(self, reader) -> tuple[int, ...]:
    shapes = {self.first.shape(reader), self.second.shape(reader)}
    if len(shapes) != 1:
      raise CheckpointError(f"{self.first.per_expert} and {self.second.per_expert}: shapes "
                            f"{sorted(shapes)} differ; they must match to sit side by side")
    E, dim_in, dim_out = shapes.pop()
    return (E, dim_in, 2, dim_out)

  def read(self, reader, index) -> np.ndarray:
    p0, p1 = _bounds(index[2], 2)
    parts = (self.first, self.second)[p0:p1]
    return np.stack([part.read(reader, (index[0], index[1], index[3])) for part in parts], axis=2)


@dataclasses.dataclass(frozen=True)
class TensorPair:
  """Two [in, out] sources side by side as one [in, 2, out] parameter (a shared expert's gate
  and up, in the routed experts' layout)."""
  first: Tensor
  second: Tensor

  def names(self, reader) -> list[str]:
    return [*self.first.names(reader), *self.second.names(reader)]

  def shape(self, reader) -> tuple[int, ...]:
    shapes = {self.first.shape(reader), self.second.shape(reader)}
    if len(shapes) != 1:
      raise CheckpointError(f"{self.first.name} and {self.second.name}: shapes "
                            f"{sorted(shapes)} differ; they must match to sit side by side")
    dim_in, dim_out = shapes.pop()
    return (dim_in, 2, dim_out)

  def read(self, reader, index) -> np.ndarray:
    p0, p1 = _bounds(index[1], 2)
    parts = (self.first, self.second)[p0:p1]
    return np.stack([part.read(reader, (index[0], index[2])) for part in parts], axis=1)


@dataclasses.dataclass(frozen=True)
class SharedSlots:
  """The routed experts [E, ...] with one shared expert [...] in front of each shard's L
  experts, as one [E + R, ...] parameter (R = E / L shards): slot s * (L + 1) is the shared
  expert, slot s * (L + 1) + 1 + i is routed expert s * L + i (RoutedExperts'
  `shared_expert`: the shared expert runs in the routed experts' grouped GEMM)."""
  routed: StackedExperts | ExpertPair
  shared: Tensor | TensorPair
  experts_per_shard: int

  def names(self, reader) -> list[str]:
    return list(dict.fromkeys(self.routed.names(reader) + self.shared.names(reader)))

  def shape(self, reader) -> tuple[int, ...]:
    E, *rest = self.routed.shape(reader)
    L = self.experts_per_shard
    if E % L:
      raise CheckpointError(f"{E} routed experts do not split into shards of {L}")
    shared = tuple(self.shared.shape(reader))
    if shared != tuple(rest):
      raise CheckpointError(f"shared expert {shared} and routed experts {tuple(rest)}: "
                            f"fuse_shared_experts needs one shape for both")
    return (E + E // L, *rest)

  def read(self, reader, index) -> np.ndarray:
    return self._gather(index, self.shape(reader)[0], lambda i: self.shared.read(reader, i),
                        lambda i: self.routed.read(reader, i))

  # block-fp8 experts (gate, up and down apart, each a Tensor shared expert): the shared
  # expert's Linear weight and its scales as stored, [out, in] like each routed expert's
  def stored_fp8(self, reader) -> bool:
    return (self.routed.stored_fp8(reader)
            and reader.has(self.shared.name + SCALE_SUFFIX))

  def read_codes(self, reader, index) -> np.ndarray:
    return self._gather(index, self.shape(reader)[0],
                        lambda i: reader.read_stored(self.shared.name, i),
                        lambda i: self.routed.read_codes(reader, i))

  def read_scales(self, reader, index) -> np.ndarray:
    return self._gather(index, self.scales_shape(reader)[0],
                        lambda i: reader.read_stored(self.shared.name + SCALE_SUFFIX, i),
                        lambda i: self.routed.read_scales(reader, i))

  def scales_shape(self, reader) -> tuple[int, ...]:
    E, *rest = self.routed.scales_shape(reader)
    shared = tuple(reader.shape(self.shared.name + SCALE_SUFFIX))
    if shared != tuple(rest):
      raise CheckpointError(f"{self.shared.name}{SCALE_SUFFIX} {shared} and the routed "
                            f"experts' scales {tuple(rest)}: fuse_shared_experts needs one shape")
    return (E + E // self.experts_per_shard, *rest)

  def _gather(self, index, slots: int, shared_part, routed_part) -> np.ndarray:
    """The slots index[0] selects of a [slots, ...] array, each run read with the rest of
    `index`: shared_part(rest) -> one slot, routed_part((experts, *rest)) -> a run of them."""
    j0, j1 = _bounds(index[0], slots)
    per_shard = self.experts_per_shard + 1
    parts, j = [], j0
    while j < j1:  # one shared slot or one shard's run of routed slots per pass
      shard, slot = divmod(j, per_shard)
      if slot == 0:
        parts.append(shared_part(tuple(index[1:]))[None])
        j += 1
        continue
      stop = min(j1, (shard + 1) * per_shard)
      first = shard * self.experts_per_shard + slot - 1
      parts.append(routed_part((slice(first, first + stop - j), *index[1:])))
      j = stop
    return np.concatenate(parts)


def dense_mlp_sources(path: tuple, prefix: str) -> dict:
  """The SwiGLU MLP under `path` from `{prefix}.{gate,up,down}_proj.weight`."""
  return {(*path, param_name): linear(f"{prefix}.{proj}")
          for param_name, proj in (("w_gate_df", "gate_proj"), ("w_up_df", "up_proj"),
                                   ("w_down_fd", "down_proj"))}


def routed_expert_sources(path: tuple, prefix: str, num_experts: int,
                          gate_up_paired: bool, shared: tuple[str, int] | None = None) -> dict:
  """Per-expert keys (`experts.{e}.gate_proj.weight`, what checkpoints hold) or the fused
  [E, 2F, D] / [E, D, F] tensors that transformers >= 5 writes with save_original_format=False.
  `gate_up_paired`: gate and up as one [E, D, 2, F] parameter `GATE_UP_PAIR` (RoutedExperts
  in the model dtype), else as `w_gate_edf` and `w_up_edf` (block-fp8 weights).
  `shared`: (the shared expert's prefix, experts per shard): the shared expert in front of each
  shard's routed experts in every parameter (SharedSlots)."""
  stacked = lambda proj, fused, part, count: StackedExperts(
      f"{prefix}.{{e}}.{proj}.weight", num_experts, fused=f"{prefix}.{fused}", fused_part=part,
      fused_parts=count)
  gate, up = stacked("gate_proj", "gate_up_proj", 0, 2), stacked("up_proj", "gate_up_proj", 1, 2)
  down = stacked("down_proj", "down_proj", 0, 1)
  if shared is not None:
    shared_prefix, per_shard = shared
    one = lambda proj: linear(f"{shared_prefix}.{proj}")  # noqa: E731
    slots = lambda routed, own: SharedSlots(routed, own, per_shard)  # noqa: E731
    gate_up = ({GATE_UP_PAIR: slots(ExpertPair(gate, up),
                                    TensorPair(one("gate_proj"), one("up_proj")))}
               if gate_up_paired else
               {"w_gate_edf": slots(gate, one("gate_proj")), "w_up_edf": slots(up, one("up_proj"))})
    return {**{(*path, name): source for name, source in gate_up.items()},
            (*path, "w_down_efd"): slots(down, one("down_proj"))}
  sources = ({(*path, GATE_UP_PAIR): ExpertPair(gate, up)} if gate_up_paired
             else {(*path, "w_gate_edf"): gate, (*path, "w_up_edf"): up})
  sources[(*path, "w_down_efd")] = down
  return sources
