"""Communicator: the public dispatch/combine API, argument checks, backend choice."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe.config import MoEConfig
from jax_moe.errors import CommError

BACKENDS = ("xla", "cuda", "host")


class Dispatched(NamedTuple):
  """Rows received by one rank, in the deterministic layout of docs/semantics.md."""
  x: jax.Array                  # [capacity, hidden] dispatch dtype
  scales: jax.Array | None      # [capacity, hidden // block_size] f32 (fp8 dispatch) or None
  weights: jax.Array            # [capacity] f32 router weight of each row, 0 on padding
  group_sizes: jax.Array        # [L] int32 rows per local expert incl. padding (ragged_dot)
  tokens_per_expert: jax.Array  # [L] int32 real rows per local expert
  handle: Any                   # backend pytree that combine needs; valid for one combine


def _platform(mesh) -> str:
  return mesh.devices.flat[0].platform


def available_backends(platform: str | None = None) -> list[str]:
  """Backends that can run on `platform` (default: JAX's default backend) in this build."""
  from jax_moe import native
  platform = platform or jax.default_backend()
  names = ["xla"]
  if platform == "gpu" and native.has_cuda():
    names.append("cuda")
  if platform == "cpu":
    from jax_moe.backends import host_remote
    from jax_moe.backends.host import has_host
    # Across processes the host backend needs the TransferEngine (a libfabric build).
    if has_host() and (jax.process_count() == 1 or host_remote.available()):
      names.append("host")
  return names


def _resolve_backend(backend: str, platform: str) -> str:
  if backend == "auto":
    return available_backends(platform)[-1]
  if backend not in BACKENDS:
    raise ValueError(f"Communicator: backend must be 'auto' or one of {BACKENDS}, got {backend!r}")
  if backend not in available_backends(platform):
    raise ValueError(f"Communicator: backend {backend!r} is not available on platform "
                     f"{platform!r} in this build (available: {available_backends(platform)})")
  return backend


def _expect(name: str, value, shape: tuple, dtype) -> None:
  if not hasattr(value, "shape") or not hasattr(value, "dtype"):
    raise TypeError(f"{name} must be an array of shape {shape} and dtype "
                    f"{np.dtype(dtype).name}, got {type(value).__name__}")
  if tuple(value.shape) != tuple(shape):
    raise ValueError(f"{name} must have per-shard shape {tuple(shape)}, got {tuple(value.shape)}")
  if np.dtype(value.dtype) != np.dtype(dtype):
    raise TypeError(f"{name} must have dtype {np.dtype(dtype).name}, got {np.dtype(value.dtype).name}")


class Communicator:
  """Expert-parallel dispatch/combine over one mesh axis.

  Build it outside jit (it allocates and connects); call its methods inside
  `jax.shard_map` over `axis`. See DESIGN.md for the API and docs/semantics.md for the
  exact layout.
  """

  def __init__(self, cfg: MoEConfig, mesh: jax.sharding.Mesh, axis: str = "ep",
               backend: str = "auto"):
    if not isinstance(cfg, MoEConfig):
      raise TypeError(f"Communicator: cfg must be a jax_moe.MoEConfig, got {type(cfg).__name__}")
    if axis not in mesh.shape:
      raise ValueError(f"Communicator: axis {axis!r} is not a mesh axis {tuple(mesh.shape)}")
    self.cfg = cfg
    self.mesh = mesh
    self.axis = axis
    self.axis_size = mesh.shape[axis]
    self.num_local_experts = cfg.num_local_experts(self.axis_size)
    self.capacity = cfg.capacity(self.axis_size)
    self.backend_name = _resolve_backend(backend, _platform(mesh))
    if self.backend_name == "cuda":
      from jax_moe.backends.cuda import CudaBackend
      self._backend = CudaBackend(cfg, mesh, axis)
    elif self.backend_name == "host":
      from jax_moe.backends.host import HostBackend
      self._backend = HostBackend(cfg, mesh, axis)
    else:
      from jax_moe.backends.xla import XlaBackend
      self._backend = XlaBackend(cfg, mesh, axis)

  # ------------------------------------------------------------ lifecycle
  def check(self) -> None:
    """Raises CommError for the first run-time error recorded since the last check."""
    err = self._backend.check()
    if err is not None:
      raise CommError(*err)

  def close(self) -> None:
    self._backend.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  # ------------------------------------------------------------ argument checks
  def _check_dispatch_args(self, fn, x, topk_ids, topk_weights, num_tokens):
    cfg = self.cfg
    T, H, K = cfg.max_tokens, cfg.hidden, cfg.experts_per_token
    if isinstance(x, (tuple, list)):
      if not cfg.is_fp8:
        raise TypeError(f"Communicator.{fn}: x is a pre-quantized (q, scales) pair but "
                        f"MoEConfig.dispatch_dtype is {cfg.dispatch_dtype.name}")
      if len(x) != 2:
        raise TypeError(f"Communicator.{fn}: x must be an array or a (q, scales) pair")
      _expect(f"Communicator.{fn}: x[0] (q)", x[0], (T, H), jnp.float8_e4m3fn)
      _expect(f"Communicator.{fn}: x[1] (scales)", x[1], (T, cfg.num_scale_blocks), jnp.float32)
      x = tuple(x)
    else:
      _expect(f"Communicator.{fn}: x", x, (T, H), jnp.bfloat16)
    _expect(f"Communicator.{fn}: topk_ids", topk_ids, (T, K), jnp.int32)
    _expect(f"Communicator.{fn}: topk_weights", topk_weights, (T, K), jnp.float32)
    if num_tokens is None:
      num_tokens = jnp.full((1,), T, jnp.int32)
    else:
      num_tokens = jnp.asarray(num_tokens)
      if num_tokens.size != 1 or np.dtype(num_tokens.dtype) != np.dtype(jnp.int32):
        raise TypeError(f"Communicator.{fn}: num_tokens must be an int32 scalar (shape () or "
                        f"(1,) per shard), got shape {num_tokens.shape} {num_tokens.dtype}")
      num_tokens = num_tokens.reshape(1)
    return x, topk_ids, topk_weights, num_tokens

  def _check_y(self, fn, y):
    _expect(f"Communicator.{fn}: y", y, (self.capacity, self.cfg.hidden), self.cfg.combine_dtype)

  # ------------------------------------------------------------ operations
  def dispatch(self, x, topk_ids, topk_weights, num_tokens=None) -> Dispatched:
    """Sends every routed (token, slot) row to the rank of its expert; see Dispatched."""
    self.check()
    args = self._check_dispatch_args("dispatch", x, topk_ids, topk_weights, num_tokens)
    return self._backend.dispatch(*args)

  def combine(self, y, handle) -> jax.Array:
    """out[t] = sum over routed k of w[t, k] * y[row(t, k)], accumulated in f32."""
    self.check()
    self._check_y("combine", y)
    return self._backend.combine(y, handle)

  def dispatch_send(self, x, topk_ids, topk_weights, num_tokens=None):
    self.check()
    args = self._check_dispatch_args("dispatch_send", x, topk_ids, topk_weights, num_tokens)
    return self._backend.dispatch_send(*args)

  def dispatch_recv(self, pending) -> Dispatched:
    return self._backend.dispatch_recv(pending)

  def combine_send(self, y, handle):
    self.check()
    self._check_y("combine_send", y)
    return self._backend.combine_send(y, handle)

  def combine_recv(self, pending) -> jax.Array:
    return self._backend.combine_recv(pending)
