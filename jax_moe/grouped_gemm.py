"""One grouped-GEMM entry point: `ragged_dot` on the fastest correct kernel for the platform.

  from jax_moe import grouped_gemm
  y = grouped_gemm.ragged_dot(x, w, group_sizes)   # x [M, K], w [G, K, N], group_sizes [G]

Semantics are `jax.lax.ragged_dot`'s for x [M, K], w [G, K, N], integer group_sizes [G]:
rows [s_g, s_g + group_sizes[g]) of x (s_g the sum of the sizes before g) are multiplied by
w[g]; rows past sum(group_sizes) give zeros; a group of size 0 contributes nothing; rows past
M (sum(group_sizes) > M) are ignored. Negative sizes are invalid (lax.ragged_dot then lets
groups overlap; the tokamax path treats them as 0). Rows of x past the groups never reach
the output, whatever they hold (NaN included: dispatch leaves them unspecified; checked for
lax.ragged_dot on XLA:CPU and for the tokamax wrapper). The result has dtype
`preferred_element_type`, or the promoted input dtype when None.

Implementations (`implementation=`):

  "auto"     tokamax's Mosaic GPU kernel where it applies (below), else "lax".
  "lax"      jax.lax.ragged_dot: every platform and dtype, and the reference.
  "tokamax"  tokamax.ragged_dot(implementation="mosaic") (pip install "jax-moe[gpu]"), with a
             tuned tile config for Hopper when this module has one for the shape; raises
             `ValueError` naming the reason where it does not apply.
  "cutlass"  fp8 weights only (`BlockFp8Weights`): x quantized to e4m3 with one scale per row
             and 128 columns (jax_moe.quantization.quantize_fp8, the dispatch's own format),
             then the fp8 x fp8 grouped GEMM of cuda/cutlass/ (CUTLASS's Hopper kernel with
             blockwise scales, as DeepSeek-V3 runs its experts); a jax_moe build with CUTLASS
             (`build_info()["cutlass_version"]`). `cutlass_ragged_dot_fp8` takes rows that are
             already fp8 (a dispatch's output) without quantizing again.

"auto" takes tokamax when all hold: tokamax imports (it needs jax >= 0.11.1), the default
device is an NVIDIA Hopper GPU (compute capability 9.x), x and w are both bf16 or both f16,
`preferred_element_type` is None, bf16, f16 or f32, `precision` is None/DEFAULT, K % 128 == 0
and N % 64 == 0. `implementation_for(...)` says which one a call would get and why.

The tokamax kernel leaves rows past sum(group_sizes) unwritten (uninitialised memory, not
zeros); this wrapper clamps the cumulative group ends to [0, M] and, unless the caller says
it never reads them (`rows_past_groups="unspecified"`: the MoE layer, whose down projection
reads only h's rows inside the groups and whose combine only the routed rows), zeroes those
rows with one select over the output (it fuses into the consumer where XLA can; standing
alone it cost 0-70 us on an H200 at the issue-20 shapes: "jax_moe auto" against "tokamax
tuned config, tail not zeroed" in benchmarks/bench_grouped_gemm.py). Accuracy against
lax.ragged_dot: both accumulate in f32; bf16 outputs differ by at most one bf16 ulp of the
result (measured relative Frobenius error 1.7e-3), f32 outputs by the f32 summation order
(tested on an H200 in tests/test_grouped_gemm.py).

fp8 weights (`BlockFp8Weights`: DeepSeek-V3's e4m3 codes with one f32 scale per 128x128
block) go through the same `ragged_dot`:

  w8 = grouped_gemm.BlockFp8Weights(codes_gnk, scale_inv)  # the checkpoint's [out, in] layout
  w8 = w8.for_kernel()        # once, at load time: the kernel's scale layout (else per call)
  y = grouped_gemm.ragged_dot(x, w8, group_sizes)          # x [M, K] -> [M, N]

The "cutlass" path's reference is `lax.ragged_dot(dequantize_fp8(*quantize_fp8(x)),
w8.dequantize(f32), group_sizes)` in f32: the kernel differs from it only by f32 summation
order and the bf16 rounding of its output (tests/test_grouped_gemm.py, on an H200). Against
the bf16 path it adds x's own e4m3 rounding (2^-4 relative per element at most).

The weight-only reference is `lax.ragged_dot(x, w8.dequantize(x.dtype), group_sizes)` (the weights
dequantized in f32, then rounded to x's dtype), which is also the "lax" path. The "tokamax"
path is tokamax's sm90 quantized kernel (fp8 codes read from HBM, dequantized in registers,
wgmma, f32 accumulation), used in the one form this jax/ptxas compiles: tokamax converts the
codes to the scales' dtype and multiplies in the wgmma's input dtype, and the ptxas bundled
with jaxlib 0.11.2 converts e4m3 to f16 only (not bf16), so the scales go in as f16 and x is
cast to f16 for the kernel (exact for bf16 values of magnitude 6.1e-5 .. 65504; larger ones
overflow). The f16 scales are the block scales spread over their columns ([G, K/128, N]) and
multiplied by a power of two that puts the largest at [64, 128) (f16 keeps them normal;
undone exactly on the kernel's bf16 output). The kernel accumulates in f32 and writes bf16
(f32 or f16 results are cast from it). Conditions for "auto" to take it: those of
the bf16 path, x bf16 or f16, the K block a multiple of 128 dividing K, N % 64 == 0.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe import native
from jax_moe.quantization import quantize_fp8

IMPLEMENTATIONS = ("auto", "lax", "tokamax", "cutlass")
ROWS_PAST_GROUPS = ("zero", "unspecified")

# The Mosaic GPU kernel's input and output dtypes (tokamax 0.0.17, sm90 non-quantized path).
_TOKAMAX_INPUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_TOKAMAX_OUTPUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16),
                          jnp.dtype(jnp.float32))
_MIN_JAX = (0, 11, 1)


def _version_tuple(version: str) -> tuple[int, ...]:
  parts = []
  for piece in version.split(".")[:3]:
    digits = "".join(ch for ch in piece if ch.isdigit())
    parts.append(int(digits) if digits else 0)
  return tuple(parts)


@functools.cache
def _tokamax():
  """(module, None) when tokamax's ragged_dot imports here, else (None, reason)."""
  if _version_tuple(jax.__version__) < _MIN_JAX:
    return None, f"tokamax needs jax >= 0.11.1, this is jax {jax.__version__}"
  try:
    import tokamax
    from tokamax._src.ops.ragged_dot import pallas_mosaic_gpu
    from qwix import QArray  # tokamax's quantized-array type (a dependency of tokamax)
  except ImportError as e:  # not installed, or a dependency of it missing
    return None, f"tokamax does not import: {type(e).__name__}: {e}"
  return (tokamax, pallas_mosaic_gpu, QArray), None


def tokamax_status() -> tuple[bool, str]:
  """(True, version) when tokamax's Mosaic GPU ragged_dot can be used, else (False, why)."""
  mods, reason = _tokamax()
  if mods is None:
    return False, reason
  return True, f"tokamax {mods[0].__version__}"


def _default_device():
  return jax.devices()[0]


def _is_hopper(device) -> bool:
  if device.platform != "gpu":
    return False
  capability = getattr(device, "compute_capability", None)
  try:
    return capability is not None and 9.0 <= float(capability) < 10.0
  except (TypeError, ValueError):
    return False


def _is_default_precision(precision) -> bool:
  if precision is None:
    return True
  if isinstance(precision, (tuple, list)):
    return all(_is_default_precision(p) for p in precision)
  if isinstance(precision, str):
    return precision.upper() in ("DEFAULT", "FASTEST")
  return precision == jax.lax.Precision.DEFAULT


def _check_arguments(lhs, rhs, group_sizes, preferred_element_type, implementation,
                     rows_past_groups):
  """Shapes and dtypes, with errors that name the argument (before any tracing). rhs: an
  array [G, K, N] or a BlockFp8Weights (checked when it was made; its logical shape here)."""
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"ragged_dot: implementation must be one of {IMPLEMENTATIONS}, "
                     f"got {implementation!r}")
  if rows_past_groups not in ROWS_PAST_GROUPS:
    raise ValueError(f"ragged_dot: rows_past_groups must be one of {ROWS_PAST_GROUPS}, "
                     f"got {rows_past_groups!r}")
  fp8 = isinstance(rhs, BlockFp8Weights)
  arrays = [("lhs", lhs, 2), ("group_sizes", group_sizes, 1)] + ([] if fp8 else [("rhs", rhs, 3)])
  for name, value, rank in arrays:
    shape = getattr(value, "shape", None)
    if shape is None or getattr(value, "dtype", None) is None:
      raise TypeError(f"ragged_dot: {name} must be an array, got {type(value).__name__}")
    if len(shape) != rank:
      raise ValueError(f"ragged_dot: {name} must have rank {rank}, got shape {tuple(shape)}")
  (_, k), (g, k_rhs, _) = lhs.shape, rhs.shape
  if k != k_rhs:
    raise ValueError(f"ragged_dot: lhs {tuple(lhs.shape)} and rhs {tuple(rhs.shape)} must "
                     f"share the contraction size K (lhs.shape[1] == rhs.shape[1])")
  if group_sizes.shape[0] != g:
    raise ValueError(f"ragged_dot: group_sizes {tuple(group_sizes.shape)} must have one entry "
                     f"per group of rhs {tuple(rhs.shape)} (G = {g})")
  if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
    raise TypeError(f"ragged_dot: group_sizes must have an integer dtype, got "
                    f"{group_sizes.dtype}")
  for name, value in [("lhs", lhs)] + ([] if fp8 else [("rhs", rhs)]):
    if not jnp.issubdtype(value.dtype, jnp.inexact):
      raise TypeError(f"ragged_dot: {name} must have a floating dtype, got {value.dtype}")
  if preferred_element_type is not None:
    try:
      jnp.dtype(preferred_element_type)
    except TypeError as e:
      raise TypeError(f"ragged_dot: preferred_element_type {preferred_element_type!r} is not "
                      f"a dtype") from e


def _hopper_kernel_blocker(status, device, precision, preferred_element_type) -> str | None:
  """What keeps a Hopper kernel off this call apart from its operands: the kernel's library
  (`status()`: (available, reason)), the device, the precision and the output dtype."""
  available, reason = status()
  if not available:
    return reason
  if not _is_hopper(device):
    return (f"the default device is {device.device_kind} ({device.platform}), not a Hopper "
            "GPU (compute capability 9.x)")
  if (preferred_element_type is not None
      and jnp.dtype(preferred_element_type) not in _TOKAMAX_OUTPUT_DTYPES):
    return f"preferred_element_type {jnp.dtype(preferred_element_type)} is not bf16/f16/f32"
  if not _is_default_precision(precision):
    return f"precision {precision!r} is not DEFAULT"
  return None


def _tokamax_blocker(lhs, rhs, precision, preferred_element_type, device) -> str | None:
  """Why the tokamax kernel (rhs an array) or its sm90 quantized kernel (rhs a
  BlockFp8Weights) does not apply to this call (None when it does)."""
  blocker = _hopper_kernel_blocker(tokamax_status, device, precision, preferred_element_type)
  if blocker is not None:
    return blocker
  fp8 = isinstance(rhs, BlockFp8Weights)
  if fp8 and jnp.dtype(lhs.dtype) not in _TOKAMAX_INPUT_DTYPES:
    return f"lhs {lhs.dtype} is not bf16 or f16 (the kernel takes x as f16)"
  if not fp8 and (lhs.dtype != rhs.dtype or jnp.dtype(lhs.dtype) not in _TOKAMAX_INPUT_DTYPES):
    return f"lhs {lhs.dtype} and rhs {rhs.dtype} are not both bf16 or both f16"
  k, n = rhs.shape[1], rhs.shape[2]
  if fp8 and (rhs.block[1] % 128 or k % rhs.block[1]):
    return f"the K block {rhs.block[1]} is not a multiple of 128 dividing K={k} (kernel K steps)"
  if not fp8 and k % 128:
    return f"K={k} is not a multiple of 128 (kernel tiles)"
  if n % 64:
    return f"N={n} is not a multiple of 64 (kernel tiles)"
  if fp8 and n % 128:  # tokamax's sm90 quantized kernel walks N in pairs of 64-column tiles
    return f"N={n} is not a multiple of 128 (the quantized kernel's pairs of 64-column tiles)"
  return None


def implementation_for(lhs, rhs, group_sizes=None, *, precision=None,
                       preferred_element_type=None, implementation: str = "auto",
                       device=None) -> tuple[str, str]:
  """(implementation, reason): what `ragged_dot` runs for these arguments (arrays or
  jax.ShapeDtypeStruct; rhs also a BlockFp8Weights) on `device` (the default device when
  None)."""
  device = device or _default_device()
  if implementation == "lax":
    return "lax", "requested"
  if implementation == "cutlass":
    blocker = _cutlass_blocker(lhs, rhs, precision, preferred_element_type, device)
    if blocker is not None:
      raise ValueError(f"ragged_dot: implementation='cutlass' does not apply: {blocker}")
    return "cutlass", "requested"
  blocker = _tokamax_blocker(lhs, rhs, precision, preferred_element_type, device)
  if implementation == "tokamax":
    if blocker is not None:
      raise ValueError(f"ragged_dot: implementation='tokamax' does not apply: {blocker}")
    return "tokamax", "requested"
  if blocker is None:
    kernel = "sm90 quantized kernel" if isinstance(rhs, BlockFp8Weights) else "Mosaic GPU kernel"
    return "tokamax", f"{tokamax_status()[1]} {kernel} on {device.device_kind}"
  return "lax", blocker


# ------------------------------------------------------------------------ tuned configs
# Tile configs for tokamax's sm90 kernel, chosen by benchmarks/bench_grouped_gemm.py's sweeps on
# one H200 (benchmarks/results/grouped-gemm-54403af/); tokamax's own autotuning cache has H100
# entries only, so without these an H200 gets tokamax's heuristic (64x64x128 tiles, two stages,
# not persistent). Keys: "decode" when the mean group holds fewer than 256 rows, else
# "prefill" (measured at 4, 64 and 1024 rows per group; the boundary between is a guess).
# Each value is the keyword arguments of tokamax's pallas_mosaic_gpu.Config.
SM90_CONFIGS: dict[str, dict[str, Any]] = {
    # 128x128 output tiles, 64-wide K steps, 4 stages, one CTA per SM walking N-minor strips of
    # 8: 1544 us at 32768 x 32 x 7168 -> 2048 and 634 us at 32768 x 16 x 4096 -> 1536, against
    # 3105 and 1262 us for the heuristic
    "prefill": dict(block_m=128, block_n=128, block_k=64, num_stages=4, split_k=1,
                    persistent=True, grid_minor_dim=1, grid_tile_width=8),
    # 64x128 tiles, 128-wide K steps, 4 stages: 1703 us at 1024 x 256 x 7168 -> 2048 against
    # 1849 us for the heuristic; 59 us against 57 us at 1024 x 16 x 4096 -> 1536
    "decode": dict(block_m=64, block_n=128, block_k=128, num_stages=4, split_k=1,
                   persistent=False, grid_minor_dim=0, grid_tile_width=1),
}
DECODE_ROWS_PER_GROUP = 256


def _shape_class(m: int, g: int) -> str:
  return "decode" if m < DECODE_ROWS_PER_GROUP * max(g, 1) else "prefill"


def tuned_config(m: int, k: int, n: int, g: int, device=None) -> dict[str, Any] | None:
  """The tile config this module uses for an [m, k] x [g, k, n] call (None: tokamax's own)."""
  device = device or _default_device()
  if not _is_hopper(device):
    return None
  return SM90_CONFIGS.get(_shape_class(m, g))


def tokamax_op(config: dict[str, Any] | None = None):
  """tokamax's Mosaic GPU ragged-dot op, with the given tile config (None: tokamax picks, from
  its autotuning cache or its heuristics)."""
  mods, reason = _tokamax()
  if mods is None:
    raise ValueError(f"ragged_dot: tokamax is not available: {reason}")
  pmg = mods[1]
  if config is None:
    return pmg.PallasMosaicGpuRaggedDot()
  config = dict(config)
  if "grid_minor_dim" in config:
    config["grid_minor_dim"] = pmg.common.MatmulDimension(config["grid_minor_dim"])
  return pmg.PallasMosaicGpuRaggedDot(config=pmg.Config(**config))


def zero_rows_past(out, total):
  """out [M, N] with rows >= total set to zero (one select; XLA fuses it into a consumer)."""
  rows = jax.lax.broadcasted_iota(jnp.int32, (out.shape[0], 1), 0)
  return jnp.where(rows < total, out, jnp.zeros((), out.dtype))


def clamp_group_sizes(group_sizes, m: int):
  """Sizes whose cumulative ends lie in [0, m] (negative sizes as 0): the rows each group
  really covers, and the row count they cover in total."""
  sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
  ends = jnp.minimum(jnp.cumsum(sizes), m)
  starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
  return ends - starts, ends[-1] if ends.shape[0] else jnp.int32(0)


# The Mosaic GPU kernels copy x in (8, 64)-element TMA tiles and refuse an M above 8 that is
# not a multiple of 8 (seen at M = 12 on an H200: "dimension 0 must have size smaller or a
# multiple of its tiling 8"): such an x gets zero rows appended, past every group, and the
# result is cut back to M rows.
KERNEL_ROW_TILE = 8


def _pad_rows(lhs):
  m = lhs.shape[0]
  if m <= KERNEL_ROW_TILE or m % KERNEL_ROW_TILE == 0:
    return lhs
  return jnp.pad(lhs, ((0, -m % KERNEL_ROW_TILE), (0, 0)))


def tokamax_ragged_dot(lhs, rhs, group_sizes, *, preferred_element_type=None,
                       config: dict[str, Any] | None | str = "tuned", zero_tail: bool = True):
  """The tokamax path of `ragged_dot` without its checks. `config`: "tuned" (this module's
  table, else tokamax's choice), None (tokamax's choice) or Config keyword arguments.
  `zero_tail=False` leaves rows past sum(group_sizes) as the kernel left them (garbage)."""
  m, g = lhs.shape[0], rhs.shape[0]
  if isinstance(config, str):
    config = tuned_config(m, lhs.shape[1], rhs.shape[2], g)
  sizes, total = clamp_group_sizes(group_sizes, m)
  out_dtype = (jnp.dtype(preferred_element_type) if preferred_element_type is not None
               else jnp.result_type(lhs, rhs))
  mods, _ = _tokamax()
  out = mods[0].ragged_dot(_pad_rows(lhs), rhs, sizes, preferred_element_type=out_dtype,
                           implementation=[tokamax_op(config)])[:m]
  if zero_tail:
    out = zero_rows_past(out, total)
  return out


def ragged_dot(lhs, rhs, group_sizes, *, precision=None, preferred_element_type=None,
               implementation: str = "auto", rows_past_groups: str = "zero"):
  """`jax.lax.ragged_dot(lhs, rhs, group_sizes)` on the fastest kernel that applies.

  lhs [M, K], rhs [G, K, N] (an array, or a BlockFp8Weights of that logical shape),
  group_sizes [G] integer -> [M, N] (module docstring: semantics, the implementations and
  when "auto" takes which). Works inside jit, shard_map and vmap-free
  code; the choice is made at trace time from shapes, dtypes and the default device.
  rows_past_groups: "zero" (lax.ragged_dot's zeros) or "unspecified" (whatever the kernel
  left there, for a caller that never reads those rows: saves a pass over the output).
  """
  if isinstance(rhs, BlockFp8Weights):
    return _ragged_dot_fp8(lhs, rhs, group_sizes, precision=precision,
                           preferred_element_type=preferred_element_type,
                           implementation=implementation, rows_past_groups=rows_past_groups)
  _check_arguments(lhs, rhs, group_sizes, preferred_element_type, implementation,
                   rows_past_groups)
  chosen, _ = implementation_for(lhs, rhs, group_sizes, precision=precision,
                                 preferred_element_type=preferred_element_type,
                                 implementation=implementation)
  if chosen == "lax":
    return jax.lax.ragged_dot(lhs, rhs, group_sizes, precision=precision,
                              preferred_element_type=preferred_element_type)
  return tokamax_ragged_dot(lhs, rhs, group_sizes, preferred_element_type=preferred_element_type,
                            zero_tail=rows_past_groups == "zero")


# ------------------------------------------------------------------------- fp8 weights
FP8_MAX = 448.0  # largest finite float8_e4m3fn
_KERNEL_SCALE_TOP = 7  # the largest kernel scale lies in [2^6, 2^7): codes * scale < 57344


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=("codes", "scales", "kernel_scales", "kernel_unit"),
                   meta_fields=("block",))
@dataclasses.dataclass(frozen=True)
class BlockFp8Weights:
  """Grouped weights w [G, K, N] as e4m3 codes with one f32 scale per block (DeepSeek-V3).

  codes   [G, N, K] float8_e4m3fn: each group's weight as the checkpoint stores a linear
          layer's, [out, in] (also the layout tokamax's kernel reads).
  scales  [G, ceil(N/bn), ceil(K/bk)] float32: the checkpoint's `weight_scale_inv`; the
          weight is codes * the scale of its block (partial last blocks allowed).
  block   (bn, bk), the block's (out, in) size: (128, 128) in DeepSeek-V3.
  kernel_scales, kernel_unit: the kernel's operands, set by `for_kernel()` (None until
          then, and the tokamax path then builds them in every call): scales spread over
          their columns, [G, ceil(K/bk), N] f16, times 1/kernel_unit (a power of two, f32).

  A pytree (the arrays are leaves, `block` static): passes through jit and shard_map.
  """
  codes: Any
  scales: Any
  block: tuple[int, int] = (128, 128)
  kernel_scales: Any = None
  kernel_unit: Any = None

  def __post_init__(self):
    block = tuple(int(b) for b in self.block)
    object.__setattr__(self, "block", block)
    codes, scales = self.codes, self.scales
    if not hasattr(codes, "shape") or not hasattr(scales, "shape"):
      return  # a pytree placeholder (jax builds these while flattening), not weights
    if len(block) != 2 or min(block) < 1:
      raise ValueError(f"BlockFp8Weights: block must be two positive ints, got {self.block}")
    if len(codes.shape) != 3:
      raise ValueError(f"BlockFp8Weights: codes must be [G, N, K], got shape {codes.shape}")
    if jnp.dtype(codes.dtype) != jnp.dtype(jnp.float8_e4m3fn):
      raise TypeError(f"BlockFp8Weights: codes must be float8_e4m3fn, got {codes.dtype}")
    g, n, k = codes.shape
    want = (g, -(-n // block[0]), -(-k // block[1]))
    if tuple(scales.shape) != want:
      raise ValueError(f"BlockFp8Weights: scales must have shape {want} for codes "
                       f"{tuple(codes.shape)} and block {block}, got {tuple(scales.shape)}")

  # array-like: the logical rhs [G, K, N]
  @property
  def shape(self) -> tuple[int, int, int]:
    g, n, k = self.codes.shape
    return (g, k, n)

  @property
  def nbytes(self) -> int:
    """Bytes in HBM: codes, block scales and (when set) the kernel scales."""
    return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize
               for a in (self.codes, self.scales, self.kernel_scales) if a is not None)

  @classmethod
  def quantize(cls, w, block: tuple[int, int] = (128, 128)) -> "BlockFp8Weights":
    """Block-fp8 of w [G, K, N] as DeepSeek's quantizer makes it: per (bn out, bk in) block,
    scale = amax / 448 (1 for an all-zero block), codes = w / scale rounded to e4m3."""
    bn, bk = block
    w = jnp.swapaxes(jnp.asarray(w, jnp.float32), 1, 2)  # [G, N, K]
    g, n, k = w.shape
    nb, kb = -(-n // bn), -(-k // bk)
    padded = jnp.pad(w, ((0, 0), (0, nb * bn - n), (0, kb * bk - k)))
    blocks = padded.reshape(g, nb, bn, kb, bk)
    scales = jnp.max(jnp.abs(blocks), axis=(2, 4)) / FP8_MAX
    scales = jnp.where(scales > 0, scales, 1.0)
    spread = _spread(scales, block, n, k)
    codes = (w / spread).astype(jnp.float8_e4m3fn)
    return cls(codes, scales, tuple(block))

  def dequantize(self, dtype=jnp.bfloat16):
    """w [G, K, N] in `dtype`: codes * scale formed in f32, then rounded to `dtype`."""
    g, n, k = self.codes.shape
    w = self.codes.astype(jnp.float32) * _spread(self.scales.astype(jnp.float32), self.block,
                                                 n, k)
    return jnp.swapaxes(w.astype(dtype), 1, 2)

  def for_kernel(self) -> "BlockFp8Weights":
    """The same weights with the tokamax kernel's scale operands set (do it once, at load
    time; costs 2 bytes per bk codes of HBM, 1/64 of the codes at bk = 128)."""
    scales, unit = kernel_scales(self.scales, self.block, self.codes.shape[1])
    return dataclasses.replace(self, kernel_scales=scales, kernel_unit=unit)


def _spread(scales, block, n: int, k: int):
  """[G, nb, kb] block scales -> [G, n, k], each block's scale over its elements."""
  bn, bk = block
  return jnp.repeat(jnp.repeat(scales, bn, axis=1), bk, axis=2)[:, :n, :k]


def kernel_scales(scales, block, n: int):
  """(kernel_scales [G, kb, n] f16, unit f32): the block scales [G, nb, kb] over their
  columns, times 2^p with p such that the largest lies in [64, 128) -- so f16 holds them as
  normal numbers and codes * scale (|codes| <= 448) stays finite in f16 -- and unit = 2^-p,
  by which the kernel's f32 accumulator is multiplied back (exactly)."""
  scales = jnp.asarray(scales, jnp.float32)
  _, exponent = jnp.frexp(jnp.max(jnp.abs(scales)))  # max = m * 2^e, m in [0.5, 1)
  shift = _KERNEL_SCALE_TOP - exponent
  spread = jnp.repeat(jnp.swapaxes(scales, 1, 2), block[0], axis=2)[:, :, :n]
  return (jnp.ldexp(spread, shift).astype(jnp.float16),
          jnp.ldexp(jnp.float32(1.0), -shift))


# Tile configs for tokamax's sm90 quantized kernel ("decode"/"prefill" as SM90_CONFIGS).
# block_n is one 128-byte swizzle row of the kernel's output (64 for its bf16 output: an f32
# output would need 32-row wgmma tiles, below Hopper's 64); block_k must divide the K block.
# Measured on one H200 (benchmarks/results/grouped-gemm-5bbca85/): "decode-small" (mean group
# under FP8_SMALL_ROWS_PER_GROUP rows): 16-row tiles, 8 stages, 946 us at 1024 x 256 x 7168 ->
# 2048 (0.55x the bf16 path's 1708 us) against 1209 us for the "decode" config and 1065 us for
# 32-row tiles; "decode": 54 us at 1024 x 16 x 4096 -> 1536 (0.91x bf16's 59 us; 32-row tiles
# 65 us); "prefill": not measured (the decode config, a guess).
SM90_FP8_CONFIGS: dict[str, dict[str, Any]] = {
    "decode-small": dict(block_m=16, block_k=128, num_stages=8, split_k=1, persistent=True,
                         grid_minor_dim=0, grid_tile_width=1),
    "decode": dict(block_m=64, block_k=128, num_stages=4, split_k=1, persistent=True,
                   grid_minor_dim=0, grid_tile_width=1),
    "prefill": dict(block_m=64, block_k=128, num_stages=4, split_k=1, persistent=True,
                    grid_minor_dim=0, grid_tile_width=1),
}
FP8_SMALL_ROWS_PER_GROUP = 16  # measured at 4 and 64 rows per group; the boundary is a guess


def tuned_fp8_config(m: int, g: int, kernel_out=jnp.bfloat16, device=None
                     ) -> dict[str, Any] | None:
  device = device or _default_device()
  if not _is_hopper(device):
    return None
  small = m < FP8_SMALL_ROWS_PER_GROUP * max(g, 1)
  config = dict(SM90_FP8_CONFIGS["decode-small" if small else _shape_class(m, g)])
  config["block_n"] = 128 // jnp.dtype(kernel_out).itemsize
  return config


def tokamax_ragged_dot_fp8(lhs, rhs: BlockFp8Weights, group_sizes, *,
                           preferred_element_type=None,
                           config: dict[str, Any] | None | str = "tuned",
                           zero_tail: bool = True, scale_dtype=jnp.float16,
                           lhs_dtype=jnp.float16, kernel_out=jnp.bfloat16):
  """The tokamax fp8 path of `ragged_dot` without its checks. `config`: "tuned" (this
  module's table), None (tokamax's heuristic) or Config keyword arguments. `scale_dtype` and
  `lhs_dtype` are the kernel's operand dtypes: f16/f16 is the form that compiles with this
  ptxas; others are for the benchmark's record of what does not (they skip the power-of-two
  unit: the scales are passed as they are, cast). The kernel writes `kernel_out` (bf16: its
  f32 accumulator times 2^p rounded once to bf16, exact after the unit), then the result is
  cast to preferred_element_type (f32 results carry that bf16 rounding, 2^-9 relative, far
  below the fp8 weights' own error of about 2.6%)."""
  m, g = lhs.shape[0], rhs.shape[0]
  n = rhs.shape[2]
  out_dtype = (jnp.dtype(preferred_element_type) if preferred_element_type is not None
               else jnp.dtype(lhs.dtype))
  kernel_out = jnp.dtype(kernel_out)
  if isinstance(config, str):
    config = tuned_fp8_config(m, g, kernel_out)
  if jnp.dtype(scale_dtype) == jnp.float16:
    scales, unit = ((rhs.kernel_scales, rhs.kernel_unit) if rhs.kernel_scales is not None
                    else kernel_scales(rhs.scales, rhs.block, n))
  else:
    scales = jnp.repeat(jnp.swapaxes(rhs.scales, 1, 2), rhs.block[0], axis=2)[:, :, :n]
    scales, unit = scales.astype(scale_dtype), None
  mods, reason = _tokamax()
  if mods is None:
    raise ValueError(f"ragged_dot: tokamax is not available: {reason}")
  tokamax, _, qarray = mods
  # the kernel reads codes as [G, N, K] and takes them as the transpose of a [G, K, N] array:
  # the two transposes cancel in XLA
  weights = qarray(qvalue=jnp.swapaxes(rhs.codes, 1, 2), scale=scales,
                   qtype=jnp.float8_e4m3fn)
  sizes, total = clamp_group_sizes(group_sizes, m)
  out = tokamax.ragged_dot(_pad_rows(lhs.astype(lhs_dtype)), weights, sizes,
                           preferred_element_type=kernel_out,
                           implementation=[tokamax_op(config)])[:m]
  if unit is not None:
    out = out.astype(jnp.float32) * unit
  if zero_tail:
    out = zero_rows_past(out, total)
  return out.astype(out_dtype)


def _ragged_dot_fp8(lhs, rhs, group_sizes, *, precision, preferred_element_type,
                    implementation, rows_past_groups):
  _check_arguments(lhs, rhs, group_sizes, preferred_element_type, implementation,
                   rows_past_groups)
  chosen, _ = implementation_for(lhs, rhs, group_sizes, precision=precision,
                                 preferred_element_type=preferred_element_type,
                                 implementation=implementation)
  if chosen == "lax":
    return jax.lax.ragged_dot(lhs, rhs.dequantize(lhs.dtype), group_sizes, precision=precision,
                              preferred_element_type=preferred_element_type)
  if chosen == "cutlass":
    codes, scales = quantize_fp8(lhs, CUTLASS_BLOCK)
    out = cutlass_ragged_dot_fp8(codes, scales, rhs, group_sizes,
                                 zero_tail=rows_past_groups == "zero")
    return out.astype(preferred_element_type or lhs.dtype)
  return tokamax_ragged_dot_fp8(lhs, rhs, group_sizes,
                                preferred_element_type=preferred_element_type,
                                zero_tail=rows_past_groups == "zero")


# ------------------------------------------------------------ CUTLASS fp8 x fp8 (w8a8)
CUTLASS_TARGET = "jax_moe_grouped_gemm_fp8"  # ffi/cutlass/grouped_gemm_ffi.cc
CUTLASS_BLOCK = 128  # kGroupedGemmFp8Block: x's scale per 128 columns, w's per 128 x 128
# The tile config per shape class ("decode"/"prefill" as SM90_CONFIGS): the faster of the two at
# every shape measured on one H200 (benchmarks/results/grouped-gemm-cutlass-351a3c1/: pingpong
# 905 / 156 / 57 us against 1165 / 182 / 63 at the three decode shapes, cooperative 637 against
# 730 us at the Qwen3 prefill share)
CUTLASS_CONFIGS = {"decode": "pingpong_64x128", "prefill": "cooperative_128x128"}


def cutlass_status() -> tuple[bool, str]:
  """(True, "CUTLASS x.y.z") when this build has the CUTLASS fp8 grouped GEMM, else (False,
  why)."""
  version = native.build_info().get("cutlass_version")
  if not version:
    return False, ("this jax_moe build has no CUTLASS kernels (with nvcc present, run bash "
                   "cuda/cutlass/fetch_headers.sh and reinstall)")
  return True, f"CUTLASS {version}"


def _cutlass_blocker(lhs, rhs, precision, preferred_element_type, device) -> str | None:
  """Why the CUTLASS fp8 x fp8 kernel does not apply to this call (None when it does)."""
  if not isinstance(rhs, BlockFp8Weights):
    return "rhs is not a BlockFp8Weights (the CUTLASS kernel multiplies fp8 by fp8)"
  blocker = _hopper_kernel_blocker(cutlass_status, device, precision, preferred_element_type)
  if blocker is not None:
    return blocker
  if rhs.block != (CUTLASS_BLOCK, CUTLASS_BLOCK):
    return f"the weight block is {rhs.block}, not (128, 128)"
  k, n = rhs.shape[1], rhs.shape[2]
  if k % CUTLASS_BLOCK or n % CUTLASS_BLOCK:
    return f"K={k} and N={n} are not both multiples of 128"
  return None


def cutlass_configs() -> list[str]:
  """The CUTLASS fp8 kernel's tile configs (GroupedGemmFp8Config in cuda/cutlass/grouped_gemm.cuh,
  in index order); [] without CUTLASS."""
  module = native.load()
  return list(module.cutlass_grouped_gemm_fp8_configs()) if cutlass_status()[0] else []


def cutlass_config(m: int, g: int) -> str:
  """The tile config this module uses for [m, K] rows over g groups."""
  return CUTLASS_CONFIGS[_shape_class(m, g)]


def cutlass_ragged_dot_fp8(x_codes, x_scales, rhs: BlockFp8Weights, group_sizes, *,
                           zero_tail: bool = True, config: str | None = None, device=None):
  """y [M, N] bf16 = the fp8 rows x_codes [M, K] (float8_e4m3fn) with scales x_scales
  [M, K/128] f32 (a dispatch's fp8 output, or quantize_fp8(x, 128)) times the block-fp8 weights
  rhs, group by group (`ragged_dot` semantics). `zero_tail=False` leaves rows past
  sum(group_sizes) as they were (unspecified). `config`: a name of cutlass_configs() (None:
  cutlass_config's choice). `device`: whose SM count sizes the kernel's workspace (the
  default device; every device of a mesh is assumed alike)."""
  m, k = x_codes.shape
  g, n, k_w = rhs.codes.shape
  if jnp.dtype(x_codes.dtype) != jnp.dtype(jnp.float8_e4m3fn):
    raise TypeError(f"cutlass_ragged_dot_fp8: x_codes must be float8_e4m3fn, got "
                    f"{x_codes.dtype}")
  if k != k_w or k % CUTLASS_BLOCK or n % CUTLASS_BLOCK:
    raise ValueError(f"cutlass_ragged_dot_fp8: x_codes {tuple(x_codes.shape)} and weights "
                     f"[G, N, K] = {tuple(rhs.codes.shape)} must share K, and K and N must "
                     f"be multiples of {CUTLASS_BLOCK}")
  if tuple(x_scales.shape) != (m, k // CUTLASS_BLOCK):
    raise ValueError(f"cutlass_ragged_dot_fp8: x_scales must be [M, K/128] = "
                     f"{(m, k // CUTLASS_BLOCK)}, got {tuple(x_scales.shape)}")
  if tuple(group_sizes.shape) != (g,):
    raise ValueError(f"cutlass_ragged_dot_fp8: group_sizes must be [G] = ({g},), got "
                     f"{tuple(group_sizes.shape)}")
  names = cutlass_configs()
  if not names:
    raise ValueError(f"cutlass_ragged_dot_fp8: {cutlass_status()[1]}")
  config = cutlass_config(m, g) if config is None else config
  if config not in names:
    raise ValueError(f"cutlass_ragged_dot_fp8: config must be one of {names}, got {config!r}")
  native.register_targets()
  device = device or _default_device()
  index = names.index(config)
  workspace = native.load().cutlass_grouped_gemm_fp8_workspace_bytes(
      index, g, m, n, k, getattr(device, "local_hardware_id", None) or 0)
  y, _ = jax.ffi.ffi_call(CUTLASS_TARGET, (jax.ShapeDtypeStruct((m, n), jnp.bfloat16),
                                           jax.ShapeDtypeStruct((workspace,), jnp.uint8)))(
      x_codes, x_scales.astype(jnp.float32), rhs.codes, rhs.scales.astype(jnp.float32),
      group_sizes.astype(jnp.int32), config=np.int32(index))
  if zero_tail:
    y = zero_rows_past(y, clamp_group_sizes(group_sizes, m)[1])
  return y


def reference_ragged_dot(lhs, rhs, group_sizes) -> np.ndarray:
  """numpy f64 reference with the module's semantics (for tests): zeros past the groups."""
  lhs, rhs = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
  out = np.zeros((lhs.shape[0], rhs.shape[2]))
  start = 0
  for g, size in enumerate(np.asarray(group_sizes)):
    end = min(start + max(int(size), 0), lhs.shape[0])
    out[start:end] = lhs[start:end] @ rhs[g]
    start = end
  return out
