"""The cuda backend's path to peers outside the NVLink domain: one host proxy per device.

When a communicator's ranks are not all reachable through CUDA peer access or IPC (the
mesh spans hosts), or when JAX_MOE_FORCE_REMOTE=1 asks for it (to test this path on one
host), every rank of the communicator exchanges through its host proxy (ffi/cuda/host_proxy.h):
each half rings a doorbell the proxy thread polls (its waits and bookkeeping), runs a kernel
that moves the rows in host memory mapped into the device (cuda/proxy_rows.cuh), and rings
again (flags and posted writes). The proxy runs the host backend's protocol on a host rank
state with the same (comm id, device ordinal): ranks of one process share host
memory, ranks in other processes are written through the TransferEngine (libfabric;
JAX_MOE_HOST_PROVIDER and JAX_MOE_HOST_NODE choose the provider, backends/host_remote.py).
A communicator uses one path for all its peers: NVLink for some peers and the proxy for the
others (several GPUs per node across nodes) is not built yet.
"""

from __future__ import annotations

import itertools
import socket

import jax

from jax_moe import settings
from jax_moe.backends import host_remote
from jax_moe.backends.cuda_ranks import cuda_module
from jax_moe.backends.ranks import KV_TIMEOUT_MS, RankStates, distributed_client

_host_checks = itertools.count(1)  # the same sequence in every process, like comm ids


def spans_hosts(groups, owner: str) -> bool:
  """True when the devices of `groups` belong to processes on more than one host.

  Processes publish their host name in the jax.distributed key-value store; only meshes that
  span processes ask (every process of the mesh must build the communicator).
  """
  processes = sorted({d.process_index for d in groups.flat})
  if processes == [jax.process_index()]:
    return False
  client = distributed_client(owner)
  check = next(_host_checks)
  key = lambda process: f"jax_moe/cuda/hosts/{check}/{process}"  # noqa: E731
  client.key_value_set(key(jax.process_index()), socket.gethostname())
  names = {client.blocking_key_value_get(key(p), KV_TIMEOUT_MS) for p in processes}
  return len(names) > 1


def use_proxy(groups, owner: str) -> bool:
  """Whether a cuda communicator over `groups` exchanges through host proxies."""
  return settings.force_remote() or spans_hosts(groups, owner)


class ProxyRanks(RankStates):
  """The rank states of a cuda communicator that exchanges through host proxies.

  Per local device: a cuda rank state with the mapped staging, doorbell and proxy thread,
  and a host rank state (same comm id and device ordinal) that the proxy runs the exchange
  on. `sizes(rank)` gives one rank's dims and timeout as the *_create_rank bindings take them.
  """

  def __init__(self, groups, sizes, owner: str):
    module = cuda_module(owner)
    super().__init__(self._take_error, self._destroy)
    self._native = module

    def create(comm_id: int, ordinal: int, rank: int) -> None:
      module.cuda_create_rank(comm_id=comm_id, ordinal=ordinal, proxy=True,
                              stream_wait=settings.proxy_wait() == "stream", **sizes(rank))
      try:
        module.host_create_rank(comm_id=comm_id, ordinal=ordinal, **sizes(rank))
      except BaseException:
        module.cuda_destroy_rank(comm_id, ordinal)
        raise

    try:
      # One thread: the proxy's CPU phases keep no row loops (the GPU moves the rows).
      host_remote.connect_host_ranks(self, groups, lambda d: d.local_hardware_id, create, owner,
                                     1)
      for ordinal in self.ordinals:
        module.cuda_start_proxy(self.comm_id, ordinal)
    except BaseException:
      self.close()
      raise

  def _take_error(self, comm_id: int, ordinal: int):
    """The stream's record first (a proxy that never answered), then the exchange's."""
    error = self._native.cuda_take_error(comm_id, ordinal)
    return error if error is not None else self._native.host_take_error(comm_id, ordinal)

  def _destroy(self, comm_id: int, ordinal: int) -> None:
    self._native.cuda_destroy_rank(comm_id, ordinal)  # stops the proxy thread first
    self._native.host_destroy_rank(comm_id, ordinal)

  def proxy_samples(self) -> dict:
    """{device ordinal: [(op name, doorbell seen -> first remote write ns or -1, serve ns,
    previous answer -> this doorbell ns or -1)]} of the requests served since the last call
    (benchmarks/bench_host_remote.py --platform cuda)."""
    return {o: self._native.cuda_proxy_samples(self.comm_id, o) for o in self.ordinals}
