"""Communicator: the public dispatch/combine API, argument checks, backend choice."""

from __future__ import annotations

import dataclasses
import itertools
import weakref

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe import mesh_guard
from jax_moe.config import MoEConfig
from jax_moe.errors import CommError
from jax_moe.sharding import axis_names, axis_size
from jax_moe.types import Dispatched, Handle, Owner

BACKENDS = ("xla", "cuda", "host")


_serials = itertools.count(1)


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


def _gather_by_sum(backend_name: str) -> bool:
  """Whether a DP group's outputs are gathered through the AllReduce kernels
  (Communicator._make_group_sum): on the cuda backend."""
  return backend_name == "cuda"


def _close_all(backend, group_sum) -> None:
  backend.close()
  if group_sum is not None:
    group_sum.close()


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
  """Expert-parallel dispatch/combine over one mesh axis, or several (a tuple: ranks run
  row-major over them, experts are sharded over all of them).

  Build it outside jit (it allocates and connects); call its methods inside `jax.shard_map` over
  the mesh. See docs/architecture.md for the layers and docs/semantics.md for the exact layout.
  With `replicated_over`, one of the axes along which the tokens are replicated (a data-parallel
  group: attention tensor-parallel over that axis), each rank of a group sends only its share of
  the group's `max_tokens` tokens and combine gives every rank of the group all of the group's
  outputs (docs/semantics.md, DP groups). With `replicated_over` naming every axis of the
  communicator, every rank holds every token: dispatch selects the local experts' slots without
  communication and combine sums the ranks' partials, so every rank gets every output (the
  replicated-input mode; combine_reduce "expert"; JAX only).
  """

  def __init__(self, cfg: MoEConfig, mesh: jax.sharding.Mesh, axis="ep",
               backend: str = "auto", replicated_over=None):
    if not isinstance(cfg, MoEConfig):
      raise TypeError(f"Communicator: cfg must be a jax_moe.MoEConfig, got {type(cfg).__name__}")
    names = axis_names(axis)
    missing = [n for n in names if n not in mesh.shape]
    if not names or missing or len(set(names)) != len(names):
      raise ValueError(f"Communicator: axis {axis!r} must name distinct mesh axes of "
                       f"{tuple(mesh.shape)}")
    self.cfg = cfg
    self.mesh = mesh
    self.axis = axis
    self.axis_size = axis_size(mesh, axis)
    self.replicated_over = replicated_over
    self.group_size = 1
    # Tokens replicated over every axis of the group: no exchange at dispatch (replicated.py).
    self.replicated_input = (replicated_over is not None and
                             set(axis_names(replicated_over)) == set(names))
    if self.replicated_input and cfg.combine_reduce != "expert":
      raise ValueError("Communicator: with the tokens replicated over the whole group "
                       f"(replicated_over={replicated_over!r}) combine sums each rank's "
                       "partials: MoEConfig.combine_reduce must be 'expert'")
    # What the exchange itself moves: each rank's share of its group's tokens.
    self.exchange_cfg = cfg
    if replicated_over is not None and not self.replicated_input:
      if replicated_over not in names:
        raise ValueError(f"Communicator: replicated_over ({replicated_over!r}) must be one of "
                         f"the communicator's axes {names} (a DP group), or all of them "
                         f"(replicated input)")
      self.group_size = mesh.shape[replicated_over]
      if cfg.max_tokens % self.group_size:
        raise ValueError(f"Communicator: MoEConfig.max_tokens ({cfg.max_tokens}) must be a "
                         f"multiple of the size of replicated_over axis {replicated_over!r} "
                         f"({self.group_size}): each rank of a group sends an equal share")
      self.exchange_cfg = dataclasses.replace(cfg, max_tokens=cfg.max_tokens // self.group_size)
    self.num_local_experts = cfg.num_local_experts(self.axis_size)
    self.backend_name = _resolve_backend(backend, _platform(mesh))
    if self.replicated_input:  # JAX only, whatever the backend: nothing crosses at dispatch
      from jax_moe.backends.replicated import ReplicatedBackend
      self._backend = ReplicatedBackend(cfg, mesh, axis)
    elif self.backend_name == "cuda":
      from jax_moe.backends.cuda import CudaBackend
      self._backend = CudaBackend(self.exchange_cfg, mesh, axis)
    elif self.backend_name == "host":
      from jax_moe.backends.host import HostBackend
      self._backend = HostBackend(self.exchange_cfg, mesh, axis)
    else:
      from jax_moe.backends.xla import XlaBackend
      self._backend = XlaBackend(self.exchange_cfg, mesh, axis)
    self.capacity = self._backend.capacity
    self._group_sum = self._make_group_sum()
    serial = next(_serials)
    self._owner = Owner(serial, f"Communicator #{serial} ({self.backend_name}, axis {axis!r} "
                                 f"of mesh {dict(mesh.shape)})")
    self._closed = False
    # Native state is freed when the communicator is collected without close() too.
    self._finalizer = weakref.finalize(self, _close_all, self._backend, self._group_sum)

  # ------------------------------------------------------------ lifecycle
  def check(self) -> None:
    """Raises CommError for the first run-time error recorded since the last check."""
    err = self._backend.check()
    if err is not None:
      raise CommError(*err)

  def stage_clocks(self) -> dict:
    """Per-block stage timestamps of the latest dispatch/combine kernels, {device ordinal:
    {kernel: {mark: [globaltimer ns per block]}}}: cuda backend over NVLink, built with
    JAX_MOE_STAGE_CLOCKS=1 (benchmarks/profile_kernels.py --stages); {} otherwise."""
    clocks = getattr(self._backend, "stage_clocks", None)
    return clocks() if clocks is not None else {}

  def close(self) -> None:
    """Frees the native state. Programs traced with this communicator must not run again;
    tracing new ones is refused."""
    self._closed = True
    self._finalizer()

  @property
  def closed(self) -> bool:
    return self._closed

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  # ------------------------------------------------------------ argument checks
  def _check_context(self, fn: str) -> None:
    """Refuses, while tracing, a call outside `jax.shard_map` over this communicator's mesh
    (no shard_map, another axis name, another mesh shape) and a call after close()."""
    if self._closed:
      raise ValueError(f"Communicator.{fn}: {self._owner.description} is closed")
    want = dict(self.mesh.shape)
    context = jax.sharding.get_abstract_mesh()
    have = dict(context.shape) if context is not None and not context.empty else {}
    manual = set(getattr(context, "manual_axes", have)) if have else set()
    if have != want or not set(axis_names(self.axis)) <= manual:
      where = (f"a context with mesh axes {have}" if have else
               "no shard_map (outside jax.shard_map)")
      raise ValueError(
          f"Communicator.{fn}: call it inside jax.shard_map over the communicator's mesh "
          f"{want} (axis {self.axis!r} manual), as it was built; got {where}. Build one "
          f"Communicator per mesh.")

  def _unwrap(self, fn: str, arg_name: str, value, kind: str):
    """The backend's part of a Handle made by this communicator's `kind` call."""
    if not isinstance(value, Handle):
      raise TypeError(f"Communicator.{fn}: {arg_name} must be what this communicator's "
                      f"{kind} returned, got {type(value).__name__}")
    if value.owner != self._owner:
      raise ValueError(f"Communicator.{fn}: {arg_name} comes from {value.owner.description}, "
                       f"not from this one ({self._owner.description}); a handle is valid "
                       f"only with the communicator whose dispatch made it")
    if value.kind != kind:
      raise TypeError(f"Communicator.{fn}: {arg_name} is the result of {value.kind}, "
                      f"expected the result of {kind}")
    return value.inner

  def _guarded(self, x):
    """`x` unchanged; for the native backends, which fix each device's rank when they are
    built, the program is refused while lowering if its mesh orders the devices otherwise
    (the xla backend follows axis_index and is right on any order)."""
    if self._backend.name in ("xla", "replicated"):
      return x
    return mesh_guard.guard(x, self.mesh, self._owner.description)

  def _share(self, x, topk_ids, topk_weights, num_tokens):
    """This rank's share of its group's tokens (DP groups): rows [j * Ts, (j + 1) * Ts) for
    rank j of the replicated axis, Ts = max_tokens / group size. A bad group num_tokens goes
    through as it is, so the exchange records BAD_NUM_TOKENS with the value given."""
    if self.group_size == 1:
      return x, topk_ids, topk_weights, num_tokens
    share = self.exchange_cfg.max_tokens
    start = jax.lax.axis_index(self.replicated_over) * share
    take = lambda a: jax.lax.dynamic_slice_in_dim(a, start, share, axis=0)  # noqa: E731
    x = tuple(take(a) for a in x) if isinstance(x, tuple) else take(x)
    valid = (num_tokens >= 0) & (num_tokens <= self.cfg.max_tokens)
    num_tokens = jnp.where(valid, jnp.clip(num_tokens - start, 0, share), num_tokens)
    return x, take(topk_ids), take(topk_weights), num_tokens.astype(jnp.int32)

  def _make_group_sum(self):
    """The AllReduce that gathers a DP group's outputs on GPUs (cuda backend) when they fit
    its kernels, else None. Gathered as a sum of zero-padded shares through the AllReduce
    kernels (CUDA IPC) instead of XLA's all_gather, which goes through NCCL: NCCL refuses two
    ranks of one GPU (processes sharing a GPU), and it is one more library collective in a
    decode step. The sum is exact (x + 0 = x; a -0.0 comes out +0.0); twice the bytes of a
    gather, so only messages up to the AllReduce's default size (decode) take it."""
    if self.group_size == 1 or not _gather_by_sum(self.backend_name):
      return None
    from jax_moe.all_reduce import DEFAULT_MAX_BYTES, AllReduce
    message = self.cfg.max_tokens * self.cfg.hidden * jnp.dtype(jnp.bfloat16).itemsize
    if message > DEFAULT_MAX_BYTES:
      return None
    algorithm = "auto" if _platform(self.mesh) == "gpu" else "psum"
    return AllReduce(self.mesh, self.replicated_over, max_bytes=message, algorithm=algorithm)

  def _gathered(self, out):
    """Every output of the group on every rank of it (DP groups); `out` as is otherwise."""
    if self.group_size == 1:
      return out
    if self._group_sum is None:
      return jax.lax.all_gather(out, self.replicated_over, axis=0, tiled=True)
    share = out.shape[0]
    start = jax.lax.axis_index(self.replicated_over) * share
    padded = jnp.zeros((self.group_size * share,) + out.shape[1:], out.dtype)
    return self._group_sum(jax.lax.dynamic_update_slice_in_dim(padded, out, start, axis=0))

  def _tag(self, kind: str, inner) -> Handle:
    return Handle(self._owner, kind, inner)

  def _tagged(self, r: Dispatched) -> Dispatched:
    return r._replace(handle=self._tag("dispatch", r.handle))

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
    self._check_context("dispatch")
    x, ids, w, n = self._share(*self._check_dispatch_args("dispatch", x, topk_ids,
                                                          topk_weights, num_tokens))
    return self._tagged(self._backend.dispatch(x, self._guarded(ids), w, n))

  def combine(self, y, handle) -> jax.Array:
    """out[t] = sum over routed k of w[t, k] * y[row(t, k)], accumulated in f32."""
    self.check()
    self._check_context("combine")
    inner = self._unwrap("combine", "handle", handle, "dispatch")
    self._check_y("combine", y)
    return self._gathered(self._backend.combine(self._guarded(y), inner))

  def dispatch_send(self, x, topk_ids, topk_weights, num_tokens=None):
    self.check()
    self._check_context("dispatch_send")
    x, ids, w, n = self._share(*self._check_dispatch_args("dispatch_send", x, topk_ids,
                                                          topk_weights, num_tokens))
    return self._tag("dispatch_send", self._backend.dispatch_send(x, self._guarded(ids), w, n))

  def dispatch_recv(self, pending) -> Dispatched:
    self._check_context("dispatch_recv")
    inner = self._unwrap("dispatch_recv", "pending", pending, "dispatch_send")
    return self._tagged(self._backend.dispatch_recv(inner))

  def combine_send(self, y, handle):
    self.check()
    self._check_context("combine_send")
    inner = self._unwrap("combine_send", "handle", handle, "dispatch")
    self._check_y("combine_send", y)
    return self._tag("combine_send", self._backend.combine_send(self._guarded(y), inner))

  def combine_recv(self, pending) -> jax.Array:
    self._check_context("combine_recv")
    return self._gathered(self._backend.combine_recv(
        self._unwrap("combine_recv", "pending", pending, "combine_send")))
