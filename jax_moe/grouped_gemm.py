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

"auto" takes tokamax when all hold: tokamax imports (it needs jax >= 0.11.1), the default
device is an NVIDIA Hopper GPU (compute capability 9.x), x and w are both bf16 or both f16,
`preferred_element_type` is None, bf16, f16 or f32, `precision` is None/DEFAULT, K % 128 == 0
and N % 64 == 0. `implementation_for(...)` says which one a call would get and why.

The tokamax kernel leaves rows past sum(group_sizes) unwritten (uninitialised memory, not
zeros); this wrapper clamps the cumulative group ends to [0, M] and zeroes those rows with
one select over the output (it fuses into the consumer where XLA can; standing alone it cost
0-70 us on an H200 at the issue-20 shapes: "jax_moe auto" against "tokamax tuned config, tail
not zeroed" in benchmarks/bench_grouped_gemm.py). Accuracy against lax.ragged_dot: both
accumulate in f32; bf16 outputs differ by at most one bf16 ulp of the result (measured
relative Frobenius error 1.7e-3), f32 outputs by the f32 summation order (tested on an H200
in tests/test_grouped_gemm.py). fp8 weights are not supported here: tokamax 0.0.17's sm90
quantized kernel did not compile for e4m3 weights with bf16 scales on the H200 (no
f8E4M3FN -> bf16 conversion in that ptxas).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

IMPLEMENTATIONS = ("auto", "lax", "tokamax")

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
  except ImportError as e:  # not installed, or a dependency of it missing
    return None, f"tokamax does not import: {type(e).__name__}: {e}"
  return (tokamax, pallas_mosaic_gpu), None


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


def _check_arguments(lhs, rhs, group_sizes, preferred_element_type, implementation):
  """Shapes and dtypes, with errors that name the argument (before any tracing)."""
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"ragged_dot: implementation must be one of {IMPLEMENTATIONS}, "
                     f"got {implementation!r}")
  for name, value, rank in (("lhs", lhs, 2), ("rhs", rhs, 3), ("group_sizes", group_sizes, 1)):
    shape = getattr(value, "shape", None)
    if shape is None or getattr(value, "dtype", None) is None:
      raise TypeError(f"ragged_dot: {name} must be an array, got {type(value).__name__}")
    if len(shape) != rank:
      raise ValueError(f"ragged_dot: {name} must have rank {rank}, got shape {tuple(shape)}")
  (m, k), (g, k_rhs, n) = lhs.shape, rhs.shape
  if k != k_rhs:
    raise ValueError(f"ragged_dot: lhs {tuple(lhs.shape)} and rhs {tuple(rhs.shape)} must "
                     f"share the contraction size K (lhs.shape[1] == rhs.shape[1])")
  if group_sizes.shape[0] != g:
    raise ValueError(f"ragged_dot: group_sizes {tuple(group_sizes.shape)} must have one entry "
                     f"per group of rhs {tuple(rhs.shape)} (G = {g})")
  if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
    raise TypeError(f"ragged_dot: group_sizes must have an integer dtype, got "
                    f"{group_sizes.dtype}")
  for name, value in (("lhs", lhs), ("rhs", rhs)):
    if not jnp.issubdtype(value.dtype, jnp.inexact):
      raise TypeError(f"ragged_dot: {name} must have a floating dtype, got {value.dtype}")
  if preferred_element_type is not None:
    try:
      jnp.dtype(preferred_element_type)
    except TypeError as e:
      raise TypeError(f"ragged_dot: preferred_element_type {preferred_element_type!r} is not "
                      f"a dtype") from e


def _tokamax_blocker(lhs, rhs, precision, preferred_element_type, device) -> str | None:
  """Why the tokamax kernel does not apply to this call (None when it does)."""
  available, reason = tokamax_status()
  if not available:
    return reason
  if not _is_hopper(device):
    return (f"the default device is {device.device_kind} ({device.platform}), not a Hopper "
            "GPU (compute capability 9.x)")
  if lhs.dtype != rhs.dtype or jnp.dtype(lhs.dtype) not in _TOKAMAX_INPUT_DTYPES:
    return f"lhs {lhs.dtype} and rhs {rhs.dtype} are not both bf16 or both f16"
  if (preferred_element_type is not None
      and jnp.dtype(preferred_element_type) not in _TOKAMAX_OUTPUT_DTYPES):
    return f"preferred_element_type {jnp.dtype(preferred_element_type)} is not bf16/f16/f32"
  if not _is_default_precision(precision):
    return f"precision {precision!r} is not DEFAULT"
  k, n = rhs.shape[1], rhs.shape[2]
  if k % 128 or n % 64:
    return f"K={k} is not a multiple of 128 or N={n} not a multiple of 64 (kernel tiles)"
  return None


def implementation_for(lhs, rhs, group_sizes=None, *, precision=None,
                       preferred_element_type=None, implementation: str = "auto",
                       device=None) -> tuple[str, str]:
  """(implementation, reason): what `ragged_dot` runs for these arguments (arrays or
  jax.ShapeDtypeStruct) on `device` (the default device when None)."""
  device = device or _default_device()
  if implementation == "lax":
    return "lax", "requested"
  blocker = _tokamax_blocker(lhs, rhs, precision, preferred_element_type, device)
  if implementation == "tokamax":
    if blocker is not None:
      raise ValueError(f"ragged_dot: implementation='tokamax' does not apply: {blocker}")
    return "tokamax", "requested"
  if blocker is None:
    return "tokamax", f"{tokamax_status()[1]} Mosaic GPU kernel on {device.device_kind}"
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


def clamp_group_sizes(group_sizes, m: int):
  """Sizes whose cumulative ends lie in [0, m] (negative sizes as 0): the rows each group
  really covers, and the row count they cover in total."""
  sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
  ends = jnp.minimum(jnp.cumsum(sizes), m)
  starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
  return ends - starts, ends[-1] if ends.shape[0] else jnp.int32(0)


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
  out = mods[0].ragged_dot(lhs, rhs, sizes, preferred_element_type=out_dtype,
                           implementation=[tokamax_op(config)])
  if zero_tail:
    rows = jax.lax.broadcasted_iota(jnp.int32, (m, 1), 0)
    out = jnp.where(rows < total, out, jnp.zeros((), out.dtype))
  return out


def ragged_dot(lhs, rhs, group_sizes, *, precision=None, preferred_element_type=None,
               implementation: str = "auto"):
  """`jax.lax.ragged_dot(lhs, rhs, group_sizes)` on the fastest kernel that applies.

  lhs [M, K], rhs [G, K, N], group_sizes [G] integer -> [M, N] (module docstring: semantics,
  the implementations and when "auto" takes which). Works inside jit, shard_map and vmap-free
  code; the choice is made at trace time from shapes, dtypes and the default device.
  """
  _check_arguments(lhs, rhs, group_sizes, preferred_element_type, implementation)
  chosen, _ = implementation_for(lhs, rhs, group_sizes, precision=precision,
                                 preferred_element_type=preferred_element_type,
                                 implementation=implementation)
  if chosen == "lax":
    return jax.lax.ragged_dot(lhs, rhs, group_sizes, precision=precision,
                              preferred_element_type=preferred_element_type)
  return tokamax_ragged_dot(lhs, rhs, group_sizes, preferred_element_type=preferred_element_type)


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
