"""MoEConfig: the static description of one expert-parallel MoE exchange."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

_DISPATCH_DTYPES = (jnp.float8_e4m3fn, jnp.bfloat16)
_PARTIAL_DTYPES = (jnp.float32, jnp.bfloat16)
_REDUCE_MODES = ("source", "expert")


def _dtype_name(dtype) -> str:
  return np.dtype(dtype).name


@dataclasses.dataclass(frozen=True)
class MoEConfig:
  """Shapes and dtypes of dispatch/combine; every field is static (known at trace time).

  Per rank and call, `max_tokens` tokens of `hidden` features each pick
  `experts_per_token` of `num_experts` experts. See docs/semantics.md.
  """

  num_experts: int
  experts_per_token: int
  hidden: int
  max_tokens: int
  dispatch_dtype: object = jnp.float8_e4m3fn
  block_size: int = 128
  combine_dtype: object = jnp.bfloat16
  combine_reduce: str = "source"
  partial_dtype: object = jnp.float32
  expert_padding: int = 1
  max_recv_tokens: int | None = None
  # cuda backend over NVLink: blocks (one per SM) each dispatch/combine runs on, and the token
  # chunks its protocol cuts every call into; None uses every SM of the smallest device of the
  # mesh. Set it lower to leave SMs to work that overlaps the exchange (DeepEP's
  # Buffer.set_num_sms). The other backends ignore it.
  num_sms: int | None = None

  def __post_init__(self):
    for name in ("num_experts", "experts_per_token", "hidden", "max_tokens", "block_size",
                 "expert_padding"):
      value = getattr(self, name)
      if not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"MoEConfig.{name} must be a positive int, got {value!r}")
    if self.experts_per_token > self.num_experts:
      raise ValueError(
          f"MoEConfig.experts_per_token ({self.experts_per_token}) must be <= num_experts "
          f"({self.num_experts})")
    # Normalise dtypes to numpy dtypes so configs compare and hash by value.
    for name, allowed in (("dispatch_dtype", _DISPATCH_DTYPES),
                          ("partial_dtype", _PARTIAL_DTYPES)):
      dtype = np.dtype(getattr(self, name))
      if dtype not in [np.dtype(a) for a in allowed]:
        raise ValueError(f"MoEConfig.{name} must be one of "
                         f"{[_dtype_name(a) for a in allowed]}, got {dtype.name}")
      object.__setattr__(self, name, dtype)
    combine = np.dtype(self.combine_dtype)
    if combine != np.dtype(jnp.bfloat16):
      raise ValueError(f"MoEConfig.combine_dtype must be bfloat16, got {combine.name}")
    object.__setattr__(self, "combine_dtype", combine)
    if self.combine_reduce not in _REDUCE_MODES:
      raise ValueError(f"MoEConfig.combine_reduce must be one of {_REDUCE_MODES}, "
                       f"got {self.combine_reduce!r}")
    if self.is_fp8 and self.hidden % self.block_size:
      raise ValueError(f"MoEConfig.hidden ({self.hidden}) must be a multiple of block_size "
                       f"({self.block_size}) for fp8 dispatch")
    for name, dtype in (("dispatch_dtype", self.dispatch_dtype),
                        ("combine_dtype", self.combine_dtype)):
      row_bytes = self.hidden * dtype.itemsize
      if row_bytes % 16:
        raise ValueError(f"MoEConfig.hidden ({self.hidden}) gives {row_bytes}-byte rows in "
                         f"{name} {dtype.name}; rows must be a multiple of 16 bytes")
    if self.num_sms is not None and (
        not isinstance(self.num_sms, (int, np.integer)) or not 1 <= self.num_sms <= 4096):
      raise ValueError(f"MoEConfig.num_sms must be None or an int in [1, 4096], "
                       f"got {self.num_sms!r}")
    if self.max_recv_tokens is not None and (
        not isinstance(self.max_recv_tokens, (int, np.integer)) or self.max_recv_tokens < 1):
      raise ValueError(f"MoEConfig.max_recv_tokens must be None or a positive int, "
                       f"got {self.max_recv_tokens!r}")

  @property
  def is_fp8(self) -> bool:
    return self.dispatch_dtype == np.dtype(jnp.float8_e4m3fn)

  @property
  def num_scale_blocks(self) -> int:
    return self.hidden // self.block_size

  def num_local_experts(self, axis_size: int) -> int:
    if self.num_experts % axis_size:
      raise ValueError(f"MoEConfig.num_experts ({self.num_experts}) must be divisible by the "
                       f"size of the expert-parallel axis ({axis_size})")
    return self.num_experts // axis_size

  def capacity(self, axis_size: int) -> int:
    """Rows of the dispatched buffer on each rank (docs/semantics.md)."""
    local = self.num_local_experts(axis_size)
    default = (axis_size * self.max_tokens * min(self.experts_per_token, local) +
               local * (self.expert_padding - 1))
    if self.max_recv_tokens is None:
      return default
    if self.max_recv_tokens > default:
      raise ValueError(f"MoEConfig.max_recv_tokens ({self.max_recv_tokens}) must be <= the "
                       f"worst-case receive count {default} for axis size {axis_size}")
    return self.max_recv_tokens
