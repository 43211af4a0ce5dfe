"""The `host` backend: dispatch/combine as XLA FFI custom calls on CPU devices.

The same FFI targets and arguments as the `cuda` backend, so everything above the FFI call
is backends/native_backend.py's, except that every call is ordered (backends/ordered_ffi.py).
Its protocol and buffer layout (ffi/protocol/host_layout.h: sequence flags with
acknowledgements) are also what the cuda backend's host proxies run; the NVLink kernels have
their own (ffi/protocol/nvlink_layout.h). XLA runs each CPU device's program on its own
thread; ranks of one process share memory and write straight into each other's buffers,
signalling with sequence flags; every wait has a timeout (JAX_MOE_TIMEOUT_S, default 10 s).

Ranks in other processes (a mesh over jax.distributed) of the same host (backends/hosts.py)
share memory too: their buffers are POSIX shared memory each maps. Ranks on other hosts are
reached through one TransferEngine per rank (ffi/host_fabric/, bootstrapped by
backends/host_remote.py): a rank writes into a staging copy of the remote buffer and posts the
written spans as RMA writes whose immediates the receiver counts. That needs a build with
libfabric.
"""

from __future__ import annotations

import functools

import numpy as np

from jax_moe import native, settings
from jax_moe.backends import host_remote
from jax_moe.backends.native_backend import NativeBackend
from jax_moe.backends.ranks import RankStates
from jax_moe.sharding import rank_groups


@functools.cache
def _ordered_ffi():
  """backends/ordered_ffi.py, or None where this jax lacks the internals it uses."""
  try:
    from jax_moe.backends import ordered_ffi
  except (ImportError, AttributeError):
    return None
  return ordered_ffi


def has_host() -> bool:
  """True when the native module (which always carries the host handlers) is loaded and this
  jax can order FFI calls (backends/ordered_ffi.py uses JAX internals)."""
  module = native.load()
  return module is not None and hasattr(module, "host_create_rank") and _ordered_ffi() is not None


class HostRanks(RankStates):
  """The rank states of one host communicator on this process's CPU devices.

  The handlers' DeviceOrdinal of a CPU device is its id (process 1's first device is 2048,
  not 0), so rank states are keyed by device id.
  """

  def __init__(self, mesh, axis: str, create):
    owner = "Communicator(backend='host')"
    if not has_host():
      raise ValueError(f"{owner}: needs jax_moe._native (build_info: {native.build_info()}) "
                       "and a jax whose internals backends/ordered_ffi.py knows")
    native.register_targets()
    module = native.load()
    super().__init__(module.host_take_error, module.host_destroy_rank)
    try:
      # One XLA thread per CPU device runs each rank already: one row-loop thread by default.
      threads = settings.host_threads()
      host_remote.connect_host_ranks(self, rank_groups(mesh, axis), lambda d: d.id, create,
                                     owner, threads)
    except BaseException:
      self.close()
      raise


class HostBackend(NativeBackend):
  name = "host"

  def _make_ranks(self, mesh, axis: str):
    ranks = HostRanks(mesh, axis, self._create_rank)  # checks that _ordered_ffi() exists
    _ordered_ffi().drop_failed_token()
    return ranks

  def check(self):
    _ordered_ffi().drop_failed_token()
    return super().check()

  def _create_rank(self, comm_id: int, ordinal: int, rank: int, shared: bool,
                   remote: bool) -> None:
    del remote  # the CPU exchange writes the rows for ranks on other hosts the same way
    native.load().host_create_rank(comm_id=comm_id, ordinal=ordinal, shared=shared,
                                   **self._rank_sizes(rank))

  def _call(self, target: str, result_types, *args):
    _ordered_ffi().drop_failed_token()
    return _ordered_ffi().ordered_ffi_call(target, result_types, *args,
                                           comm_id=np.int64(self.comm_id))
