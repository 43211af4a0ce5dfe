"""Loads Hugging Face safetensors checkpoints into abstract models, or fills them randomly.

`CheckpointReader` memory-maps every shard (model.safetensors or the shards named by
model.safetensors.index.json) and reads only the slice asked for, so each device's part of a
sharded weight is read from disk without a full host copy (`jax.make_array_from_callback`);
an fp8 weight with block scales is dequantized per slice (f32; only the blocks the slice
touches).
bf16 and fp8 tensors are viewed with ml_dtypes; fp8 weights that come with a
`weight_scale_inv` are dequantized by `fp8_weights.dequantize_block_fp8` (DeepSeek), except
into a block-fp8 parameter (`grouped_gemm.BlockFp8Weights`, the routed experts of a model
built with expert_weights="fp8"): that one gets each device's slice of the codes and scales
as stored, or, from a checkpoint without them, the weights quantized on device.

Why not `safetensors.safe_open`: its numpy reader cannot return F8_E4M3 tensors (safetensors
0.8: "module 'numpy' has no attribute 'float8_e4m3fn'"), which DeepSeek checkpoints are made
of, and its flax reader puts every slice on the default device first. The format is an 8-byte
length, a JSON header and raw little-endian data, so a memory map reads it directly.
"""

from __future__ import annotations

import functools
import json
import os
import struct
import zlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_moe.grouped_gemm import BlockFp8Weights
from jax_moe.models.checkpoint import GATE_UP_PAIR, CheckpointError
from jax_moe.models import fp8_weights

_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_,
}


def load_config(path: str) -> dict:
  config_path = os.path.join(path, "config.json")
  if not os.path.isfile(config_path):
    raise CheckpointError(f"{path}: no config.json (expected a Hugging Face model directory)")
  with open(config_path) as f:
    return json.load(f)


def _shard_files(path: str) -> list[str]:
  index_path = os.path.join(path, "model.safetensors.index.json")
  if os.path.isfile(index_path):
    with open(index_path) as f:
      weight_map = json.load(f)["weight_map"]
    return sorted({os.path.join(path, name) for name in weight_map.values()})
  single = os.path.join(path, "model.safetensors")
  if os.path.isfile(single):
    return [single]
  raise CheckpointError(f"{path}: neither model.safetensors nor model.safetensors.index.json")


class CheckpointReader:
  """Lazy access to the tensors of one checkpoint directory (all its safetensors shards)."""

  def __init__(self, path: str, config: dict | None = None):
    self.path = path
    self.config = config if config is not None else load_config(path)
    self._entries = {}  # name -> (memmap of the file's data section, dtype, shape, offsets)
    for file in _shard_files(path):
      if not os.path.isfile(file):
        raise CheckpointError(f"{path}: shard {os.path.basename(file)} named by the index is missing")
      with open(file, "rb") as f:
        header_len = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(header_len))
      data = np.memmap(file, dtype=np.uint8, mode="r", offset=8 + header_len)
      for name, entry in header.items():
        if name == "__metadata__":
          continue
        if entry["dtype"] not in _DTYPES:
          raise CheckpointError(f"{file}: tensor {name} has unsupported dtype {entry['dtype']}")
        self._entries[name] = (data, np.dtype(_DTYPES[entry["dtype"]]), tuple(entry["shape"]),
                               tuple(entry["data_offsets"]))

  def has(self, name: str) -> bool:
    return name in self._entries

  @property
  def fp8_block(self) -> tuple[int, int]:
    """The (out, in) block of the checkpoint's fp8 scales."""
    return fp8_weights.block_size_from_config(self.config) or fp8_weights.DEFAULT_BLOCK

  def shape(self, name: str) -> tuple[int, ...]:
    if name not in self._entries:
      raise CheckpointError(f"{self.path}: checkpoint has no tensor {name!r}")
    return self._entries[name][2]

  def _array(self, name: str) -> np.ndarray:
    data, dtype, shape, (begin, end) = self._entries[name]
    return data[begin:end].view(dtype).reshape(shape)

  def read(self, name: str, index=None) -> np.ndarray:
    """The slice `index` (a tuple of slices, default all) of tensor `name`, as a numpy copy."""
    index = tuple(index) if index is not None else (slice(None),) * len(self.shape(name))
    scale_name = name + fp8_weights.SCALE_SUFFIX
    if self.has(scale_name):
      return self._dequantized_slice(name, scale_name, index, self.fp8_block)
    return self.read_stored(name, index)

  def read_stored(self, name: str, index=None) -> np.ndarray:
    """The slice `index` of tensor `name` as stored (fp8 codes stay codes), a numpy copy."""
    index = tuple(index) if index is not None else (slice(None),) * len(self.shape(name))
    return np.array(self._array(name)[index])

  def _dequantized_slice(self, name: str, scale_name: str, index, block) -> np.ndarray:
    """The slice `index` of a block-fp8 weight [out, in], dequantized from the codes and scales
    of the blocks it touches only (a device's slice, not the whole tensor)."""
    codes = self._array(name)
    if codes.ndim != 2:  # dequantize_block_fp8 reports the shape
      full = fp8_weights.dequantize_block_fp8(codes, self._array(scale_name), block)
      return np.ascontiguousarray(full[index])
    bounds = [s.indices(n) for s, n in zip(index, codes.shape)]
    if any(step != 1 for _, _, step in bounds):
      full = fp8_weights.dequantize_block_fp8(codes, self._array(scale_name), block)
      return np.ascontiguousarray(full[index])
    # whole blocks around the slice, then the slice inside them
    (r0, r1, _), (c0, c1, _) = bounds
    (bo, bi), rows, cols = block, codes.shape[0], codes.shape[1]
    R0, C0 = r0 // bo, c0 // bi
    R1, C1 = max(-(-r1 // bo), R0), max(-(-c1 // bi), C0)
    part = fp8_weights.dequantize_block_fp8(
        codes[R0 * bo:min(R1 * bo, rows), C0 * bi:min(C1 * bi, cols)],
        self._array(scale_name)[R0:R1, C0:C1], block)
    return np.ascontiguousarray(part[r0 - R0 * bo:r1 - R0 * bo, c0 - C0 * bi:c1 - C0 * bi])


def _flat_params(model):
  return nnx.to_flat_state(nnx.state(model, nnx.Param))


def _progress(items, desc: str, show: bool):
  if not show:
    return items
  from tqdm import tqdm
  return tqdm(items, desc=desc, unit="tensor", leave=False)


def _place(abstract: jax.ShapeDtypeStruct, read_slice):
  """A global array with the parameter's sharding whose shards come from read_slice(index).

  Devices holding the same slice (replicated parameters) ask for it one after another: the
  last slice read is reused, so it is read from disk once. Host memory peaks at one copy of
  the parameter (the slices of all local devices), never one full copy per device.
  """
  last = {}

  def callback(index):
    key = tuple((s.start, s.stop) for s in index)
    if key not in last:
      last.clear()
      last[key] = np.asarray(read_slice(index)).astype(abstract.dtype)
    return last[key]

  return jax.make_array_from_callback(abstract.shape, abstract.sharding, callback)


def _path_name(path) -> str:
  return ".".join(str(p) for p in path)


def check_checkpoint(model, reader: CheckpointReader) -> dict:
  """Checks the map covers every parameter and every tensor exists with the right shape."""
  sources = model.checkpoint_map()
  params = dict(_flat_params(model))
  unmapped = sorted(_path_name(p) for p in params if p not in sources)
  if unmapped:
    raise CheckpointError(f"{type(model).__name__}.checkpoint_map() misses parameters {unmapped}")
  for path, variable in params.items():
    source = sources[path]
    missing = [name for name in source.names(reader) if not reader.has(name)]
    if missing:
      alternative = f" (or fused tensor {source.fused!r})" if getattr(source, "fused", None) else ""
      raise CheckpointError(f"{reader.path}: missing tensor {missing[0]!r}{alternative} for "
                            f"parameter {_path_name(path)} ({len(missing)} missing in all)")
    expected = tuple(variable.get_value().shape)
    got = tuple(source.shape(reader))
    if got != expected:
      raise CheckpointError(f"{reader.path}: tensor {source.names(reader)[0]!r} gives shape {got} "
                            f"for parameter {_path_name(path)}, the config expects {expected}")
  return sources


def load_weights(model, reader: CheckpointReader, progress: bool = True):
  """Fills the abstract parameters of `model` from the checkpoint, each with its sharding."""
  sources = check_checkpoint(model, reader)
  graphdef, state = nnx.split(model)
  flat = nnx.to_flat_state(state)
  for path, variable in _progress(list(flat), f"loading {os.path.basename(reader.path)}", progress):
    if not isinstance(variable, nnx.Param):
      continue
    source, abstract = sources[path], variable.get_value()
    if isinstance(abstract, BlockFp8Weights):
      variable.set_value(_place_fp8(abstract, source, reader, _path_name(path)))
    else:
      variable.set_value(_place(abstract, lambda index, s=source: s.read(reader, index)))
  return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _place_fp8(abstract: BlockFp8Weights, source, reader: CheckpointReader, name: str):
  """A block-fp8 parameter: the checkpoint's codes and scales, each device's slice read as
  stored; or, from a checkpoint without them, its weights (f32) quantized on device."""
  if not source.stored_fp8(reader):
    return _quantized(_place(_dense_abstract(abstract), lambda index: source.read(reader, index)),
                      abstract)
  if reader.fp8_block != abstract.block:
    raise CheckpointError(f"{reader.path}: fp8 block {reader.fp8_block} for parameter {name}, "
                          f"the model was built for {abstract.block}")
  scales_shape = source.scales_shape(reader)
  if scales_shape != abstract.scales.shape:
    raise CheckpointError(f"{reader.path}: scales of parameter {name} have shape {scales_shape}, "
                          f"its codes and block {abstract.block} need {abstract.scales.shape}")
  return BlockFp8Weights(_place(abstract.codes, lambda index: source.read_codes(reader, index)),
                         _place(abstract.scales, lambda index: source.read_scales(reader, index)),
                         abstract.block)


def random_weights(model, seed: int = 0):
  """Fills the abstract parameters with random values (normal * init_scale, norms = 1).

  Each parameter is drawn on device with its own key (fold_in of a hash of its path), with
  its sharding as the output sharding, so large synthetic models never pass through the host.
  Keys follow paths, not positions, so a model whose experts are block-fp8 draws the values
  its bf16 twin draws (then quantizes them): the routed experts' gate and up pair
  (`w_gate_up_ed2f`, bf16) is drawn as the two parameters the fp8 model holds apart.
  """
  graphdef, state = nnx.split(model)
  flat = nnx.to_flat_state(state)
  key = jax.random.key(seed)
  for path, variable in flat:
    if not isinstance(variable, nnx.Param):
      continue
    abstract = variable.get_value()
    scale = model.init_scale(path, abstract.shape)
    if isinstance(abstract, BlockFp8Weights):  # the f32 draw, quantized
      variable.set_value(_quantized(
          _random_array(_path_key(key, path), _dense_abstract(abstract), scale), abstract))
    elif path[-1] in _DRAWN_APART:
      variable.set_value(_random_pair(key, path, abstract, scale))
    else:
      variable.set_value(_random_array(_path_key(key, path), abstract, scale))
  return nnx.merge(graphdef, nnx.from_flat_state(flat))


# [E, D, 2, F] parameters drawn as their two [E, D, F] halves, under the names the block-fp8
# model gives them
_DRAWN_APART = {GATE_UP_PAIR: ("w_gate_edf", "w_up_edf")}


def _path_key(key, path: tuple):
  return jax.random.fold_in(key, np.uint32(zlib.crc32("/".join(map(str, path)).encode())))


def _random_pair(key, path: tuple, abstract: jax.ShapeDtypeStruct, scale: float | None):
  E, D, _, F = abstract.shape
  spec = tuple(abstract.sharding.spec) + (None,) * 4
  half = jax.ShapeDtypeStruct((E, D, F), abstract.dtype, sharding=NamedSharding(
      abstract.sharding.mesh, P(spec[0], spec[1], spec[3])))
  halves = [_random_array(_path_key(key, (*path[:-1], name)), half, scale)
            for name in _DRAWN_APART[path[-1]]]
  return _stack_fn(abstract.sharding)(*halves)


@functools.lru_cache(maxsize=None)
def _stack_fn(sharding):
  return jax.jit(lambda a, b: jnp.stack([a, b], axis=2), out_shardings=sharding)


def _random_array(key, abstract: jax.ShapeDtypeStruct, scale: float | None):
  return _random_fn(abstract.shape, abstract.dtype, abstract.sharding, scale)(key)


def _dense_abstract(abstract: BlockFp8Weights) -> jax.ShapeDtypeStruct:
  """The f32 [G, K, N] weight that `abstract` quantizes, sharded as its codes [G, N, K]."""
  spec = tuple(abstract.codes.sharding.spec) + (None,) * 3
  sharding = NamedSharding(abstract.codes.sharding.mesh, P(spec[0], spec[2], spec[1]))
  return jax.ShapeDtypeStruct(abstract.shape, jnp.float32, sharding=sharding)


def _quantized(w_gkn: jax.Array, abstract: BlockFp8Weights) -> BlockFp8Weights:
  codes, scales = _quantize_fn(abstract.block, abstract.codes.sharding,
                               abstract.scales.sharding)(w_gkn)
  return BlockFp8Weights(codes, scales, abstract.block)


@functools.lru_cache(maxsize=None)
def _quantize_fn(block, codes_sharding, scales_sharding):
  """BlockFp8Weights.quantize on device, compiled once per (block, shardings)."""
  def quantize(w_gkn):
    w8 = BlockFp8Weights.quantize(w_gkn, block)
    return w8.codes, w8.scales
  return jax.jit(quantize, out_shardings=(codes_sharding, scales_sharding))


@functools.lru_cache(maxsize=None)
def _random_fn(shape, dtype, sharding, scale):
  """One compiled draw per (shape, dtype, sharding, scale): layers share them."""
  def draw(key):
    if scale is None:
      return jax.numpy.ones(shape, dtype)
    return (jax.random.normal(key, shape, jax.numpy.float32) * scale).astype(dtype)
  return jax.jit(draw, out_shardings=sharding)
