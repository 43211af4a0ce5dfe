"""AllReduce: a sum over one mesh axis for small and medium messages, inside `jax.shard_map`.

```python
ar = jm.AllReduce(mesh, axis="tp", max_bytes=8 << 20, algorithm="auto")  # outside jit
y = ar(x)   # inside shard_map over "tp": equals jax.lax.psum(x, "tp")
```

On GPUs with the native CUDA module, messages up to `max_bytes` go through the FFI custom
call `jax_moe_all_reduce` (ffi/cuda/all_reduce_ffi.cc): one-shot (every rank pushes its input to
every peer, then each sums all of them) or two-shot (rank s sums segment s, then pushes it to
every peer), through buffers allocated here and mapped by every peer. Every rank sums an
element's R values in rank order in f32 and rounds once, so all ranks hold bit-identical
results, and one-shot and two-shot agree bit for bit. Larger messages, other platforms and
builds without CUDA use `jax.lax.psum`.

NVLS (multimem.ld_reduce / multimem.st on a multicast object, cuda/all_reduce_nvls.cu and
ffi/cuda/multicast.cc) runs only with algorithm="nvls", for meshes whose ranks are all in this
process, where `nvls_refusal` allows it; it is refused, before any multicast call, wherever
multicast is switched off or unsupported, and `auto` never picks it. It has not run yet.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe import native
from jax_moe.errors import CommError

ALGORITHMS = ("auto", "one_shot", "two_shot", "nvls", "psum")
# AllReduceAlgorithm of ffi/protocol/dims.h (tests/test_protocol_enums.py checks they agree)
_KERNEL_IDS = {"one_shot": 0, "two_shot": 1, "nvls": 2}
DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
DEFAULT_MAX_BYTES = 8 << 20
MAX_MAX_BYTES = 1 << 30  # each rank's buffer holds 2 * R * max_bytes

# `auto`: one-shot up to this many bytes, two-shot above (up to max_bytes). Measured on
# 2 x H200, bf16 (benchmarks/results/allreduce-d789129/): two-shot is faster from 4 MiB in
# chained calls (27.7 vs 30.0 us) and from 8 MiB in a fori_loop; one-shot below. psum was not
# faster than the better kernel at any size from 4 KiB to 64 MiB in chained calls.
AUTO_ONE_SHOT_MAX_BYTES = 2 << 20

# Switches of NCCL, NVSHMEM and PyTorch symmetric memory that forbid NVLink multicast, with the
# value that forbids it; the native gate (ffi/cuda/multicast.cc) checks the same list.
NVLS_SWITCHES = (("NCCL_NVLS_ENABLE", "0"), ("NVSHMEM_DISABLE_NVLS", "1"),
                 ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"))


def nvls_refusal(devices=(), environ=None) -> str | None:
  """Why NVLS must not be used on `devices`, or None when it may.

  Checked in order, before any multicast API is touched: the NVLS_SWITCHES in `environ`
  (default os.environ), a platform other than CUDA or a build without CUDA, then each
  device's CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED and the native gate's own env check.
  """
  environ = os.environ if environ is None else environ
  for name, value in NVLS_SWITCHES:
    if environ.get(name) == value:
      return f"{name}={value} is set"
  devices = list(devices)
  if not devices:
    return "no devices given"
  if any(d.platform != "gpu" for d in devices):
    return f"platform {devices[0].platform!r} has no NVLink multicast"
  if not native.has_cuda():
    return "jax_moe._native was not built with CUDA"
  for device in devices:
    reason = native.load().cuda_nvls_refusal(device.local_hardware_id)
    if reason:
      return reason
  return None


class AllReduce:
  """`ar(x)` inside `jax.shard_map` over `axis` equals `jax.lax.psum(x, axis)`.

  Build it outside jit (it allocates and connects on GPUs). `max_bytes` bounds the messages
  that take the native kernels (larger ones use psum); each rank's buffer holds
  2 * axis_size * max_bytes. `algorithm`: "auto" (one-shot up to AUTO_ONE_SHOT_MAX_BYTES,
  then two-shot),
  "one_shot", "two_shot", "nvls" (refused unless multicast is allowed, see nvls_refusal), or
  "psum". x may be float32, bfloat16 or float16 of any shape.
  """

  def __init__(self, mesh: jax.sharding.Mesh, axis: str, max_bytes: int = DEFAULT_MAX_BYTES,
               algorithm: str = "auto"):
    if not isinstance(mesh, jax.sharding.Mesh):
      raise TypeError(f"AllReduce: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if not isinstance(axis, str) or axis not in mesh.shape:
      raise ValueError(f"AllReduce: axis must name a mesh axis {tuple(mesh.shape)}, got {axis!r}")
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, (int, np.integer)) or \
        not 0 < max_bytes <= MAX_MAX_BYTES:
      raise ValueError(f"AllReduce: max_bytes must be an int in [1, {MAX_MAX_BYTES}], "
                       f"got {max_bytes!r}")
    if algorithm not in ALGORITHMS:
      raise ValueError(f"AllReduce: algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    self.mesh, self.axis, self.axis_size = mesh, axis, mesh.shape[axis]
    self.max_bytes = int(max_bytes)
    self.algorithm = algorithm
    platform = mesh.devices.flat[0].platform
    native_ok = platform == "gpu" and native.has_cuda()
    if algorithm in _KERNEL_IDS and not native_ok:
      raise ValueError(f"AllReduce: algorithm {algorithm!r} needs GPUs and jax_moe._native built "
                       f"with CUDA; platform {platform!r}, native CUDA: {native.has_cuda()}")
    if algorithm == "nvls":
      self._check_nvls_allowed(mesh)
    self._ranks = None
    if native_ok and algorithm != "psum":
      from jax_moe.backends.cuda_ranks import CudaRanks
      from jax_moe.settings import timeout_s
      wait_s = timeout_s()

      def create(comm_id, ordinal, rank):
        native.load().cuda_create_all_reduce_rank(comm_id, ordinal, rank, self.axis_size,
                                                  self.max_bytes, wait_s)

      self._ranks = CudaRanks(mesh, axis, create, "AllReduce")
    if algorithm == "nvls":
      self._setup_nvls(mesh, axis)

  def _check_nvls_allowed(self, mesh) -> None:
    """Raises unless the gate allows multicast on every device and all of them are local."""
    reason = nvls_refusal(mesh.devices.flat)
    if reason:
      raise ValueError(f"AllReduce: algorithm 'nvls' refused: {reason}")
    if any(d.process_index != jax.process_index() for d in mesh.devices.flat):
      raise ValueError("AllReduce: algorithm 'nvls' needs every rank of the mesh in this process "
                       "(sharing a multicast object across processes is not built)")

  def _setup_nvls(self, mesh, axis: str) -> None:
    """One multicast object per group (ffi/cuda/multicast.cc; gated again there). Not yet run."""
    from jax_moe.sharding import rank_groups
    try:
      for group in rank_groups(mesh, axis):
        native.load().cuda_setup_nvls(self._ranks.comm_id, [d.local_hardware_id for d in group])
    except BaseException:
      self.close()
      raise

  @property
  def uses_kernels(self) -> bool:
    """False where every call is a psum (CPU, no CUDA build, algorithm='psum', closed)."""
    return self._ranks is not None and bool(self._ranks.ordinals)

  def algorithm_for(self, nbytes: int) -> str:
    """What a message of `nbytes` bytes per rank runs: 'one_shot', 'two_shot', 'nvls' or
    'psum'."""
    if not self.uses_kernels or nbytes == 0 or nbytes > self.max_bytes:
      return "psum"
    if self.algorithm == "auto":
      return "one_shot" if nbytes <= AUTO_ONE_SHOT_MAX_BYTES else "two_shot"
    return self.algorithm

  def __call__(self, x: jax.Array) -> jax.Array:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
      raise TypeError(f"AllReduce: x must be an array, got {type(x).__name__}")
    if np.dtype(x.dtype) not in DTYPES:
      raise TypeError(f"AllReduce: x must have dtype float32, bfloat16 or float16, got "
                      f"{np.dtype(x.dtype).name}")
    # psum names an unbound axis itself; the custom call would run on any array, so check.
    try:
      axis_size = jax.lax.axis_size(self.axis)
    except NameError:
      axis_size = None
    if axis_size != self.axis_size:
      raise ValueError(f"AllReduce: call it inside jax.shard_map over axis {self.axis!r} of "
                       f"size {self.axis_size} (the mesh it was built with); that axis is "
                       f"{'not bound here' if axis_size is None else f'of size {axis_size}'}")
    self.check()
    algorithm = self.algorithm_for(int(x.size) * np.dtype(x.dtype).itemsize)
    if algorithm == "psum":
      return jax.lax.psum(x, self.axis)
    return jax.ffi.ffi_call("jax_moe_all_reduce", jax.ShapeDtypeStruct(x.shape, x.dtype),
                            has_side_effect=True)(
        x, comm_id=np.int64(self._ranks.comm_id), algorithm=np.int32(_KERNEL_IDS[algorithm]))

  # ------------------------------------------------------------ lifecycle
  def check(self) -> None:
    """Raises CommError for the first run-time error (a timeout) recorded since the last check."""
    err = self._ranks.check() if self._ranks is not None else None
    if err is not None:
      raise CommError(*err)

  def close(self) -> None:
    if self._ranks is not None:
      if self.algorithm == "nvls":
        native.load().cuda_teardown_nvls(self._ranks.comm_id)
      self._ranks.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()
