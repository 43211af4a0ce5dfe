"""The cuda backend's path to peers outside the NVLink domain: one host proxy per device.

When a communicator's ranks are not all reachable through CUDA peer access or IPC (the
mesh spans hosts), or when JAX_MOE_FORCE_REMOTE=1 asks for it (to test this path on one
host), every rank of the communicator exchanges through its host proxy (ffi/cuda/host_proxy.h):
each half rings a doorbell the proxy thread polls (its waits and bookkeeping), runs a kernel
that moves the rows in host memory mapped into the device (cuda/proxy_rows.cuh), and rings
again (flags and posted writes). The proxy runs the host backend's protocol on a host rank
state with the same (comm id, device ordinal): ranks of one process, and of other processes
of the same host (backends/hosts.py), share host memory; ranks on other hosts are written
through the TransferEngine (libfabric; JAX_MOE_HOST_PROVIDER and JAX_MOE_HOST_NODE choose the
provider, backends/host_remote.py). So one communicator has both kinds of peers. The rows
between ranks of one host go through their host buffers, or, with
JAX_MOE_PROXY_NEAR_ROWS=device, through device buffers those ranks map (NVLink, or the same
GPU; CUDA IPC between processes), while routes and flags stay in host memory. The rows to
and from ranks on other hosts go through host staging copies and the host buffer, or, with
JAX_MOE_PROXY_HMEM (settings.py), from device staging copies into the receiver's device
buffer, moved by the TransferEngines (libfabric FI_HMEM).
"""

from __future__ import annotations

import functools

import jax

from jax_moe import settings, transport
from jax_moe.backends import host_remote, hosts
from jax_moe.backends.cuda_ranks import cuda_module, exchange_ipc_handles
from jax_moe.backends.ranks import RankStates


def spans_hosts(groups, owner: str) -> bool:
  """True when the devices of `groups` belong to processes of more than one host
  (backends/hosts.py)."""
  processes = {d.process_index for d in groups.flat}
  return len(set(hosts.host_of(processes, owner).values())) > 1


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

    near_rows_device = settings.proxy_near_rows() == "device"
    hmem = settings.proxy_rows_device_from_remote(transport.registers_cuda_memory)

    def create(comm_id: int, ordinal: int, rank: int, shared: bool, remote: bool) -> None:
      module.cuda_create_rank(comm_id=comm_id, ordinal=ordinal, proxy=True,
                              stream_wait=settings.proxy_wait() == "stream",
                              near_rows_device=near_rows_device,
                              remote_rows_device=hmem and remote, **sizes(rank))
      try:
        module.host_create_rank(comm_id=comm_id, ordinal=ordinal, shared=shared, **sizes(rank))
      except BaseException:
        module.cuda_destroy_rank(comm_id, ordinal)
        raise

    try:
      # One thread: the proxy's CPU phases keep no row loops (the GPU moves the rows). Device
      # rows are asked for only in groups with remote ranks, whose ranks create() made with
      # remote_rows_device.
      device_rows = functools.partial(module.cuda_device_rows, self.comm_id) if hmem else None
      near = host_remote.connect_host_ranks(self, groups, lambda d: d.local_hardware_id, create,
                                            owner, 1, device_rows=device_rows)
      if near_rows_device:
        self._map_near_rows(groups, near, owner)
      for ordinal in self.ordinals:
        module.cuda_start_proxy(self.comm_id, ordinal)
    except BaseException:
      self.close()
      raise

  def _map_near_rows(self, groups, near, owner: str) -> None:
    """Maps into every local rank the device buffers of the ranks of its host: the other
    local ranks' (peer access) and the near ranks' (CUDA IPC); ranks on other hosts stay
    unmapped (their rows come through the host buffers)."""
    me = jax.process_index()
    for index, (group, near_g) in enumerate(zip(groups, near)):
      local = [d.local_hardware_id if d.process_index == me else -1 for d in group]
      if all(o < 0 for o in local):
        continue
      handles = exchange_ipc_handles(self._native, self.comm_id, index, local, near_g, owner)
      for ordinal in local:
        if ordinal >= 0:
          self._native.cuda_connect_rank(self.comm_id, ordinal, local, handles)

  def _take_error(self, comm_id: int, ordinal: int):
    """The stream's record first (a proxy that never answered), then the exchange's."""
    error = self._native.cuda_take_error(comm_id, ordinal)
    return error if error is not None else self._native.host_take_error(comm_id, ordinal)

  def _destroy(self, comm_id: int, ordinal: int) -> None:
    # The proxy thread serves with the host rank state, and the host rank state's
    # TransferEngine may write the device rows until it is closed: stop, close, free.
    self._native.cuda_stop_proxy(comm_id, ordinal)
    self._native.host_destroy_rank(comm_id, ordinal)
    self._native.cuda_destroy_rank(comm_id, ordinal)

  def proxy_samples(self) -> dict:
    """{device ordinal: [(op name, doorbell seen -> first remote write ns or -1, serve ns,
    previous answer -> this doorbell ns or -1)]} of the requests served since the last call
    (benchmarks/bench_host_remote.py --platform cuda)."""
    return {o: self._native.cuda_proxy_samples(self.comm_id, o) for o in self.ordinals}
