"""Connecting the host rank states of a communicator (ffi/host/): ranks of one process share
memory; so do ranks in other processes of the same host (backends/hosts.py), whose buffers are
POSIX shared memory that each maps ("near" ranks); ranks on other hosts ("remote") are reached
through the TransferEngine (ffi/host_fabric/). Used by the host backend and by the cuda
backend's host proxies (backends/cuda_proxy.py).

A local rank with near ranks publishes the name of its shared buffer in the jax.distributed
key-value store and maps theirs; once every near rank says it mapped its peers, the names are
removed (nothing is left in /dev/shm if a process dies later). Each local rank of a group with
remote ranks opens a TransferEngine (its rank = its index on the axis), registers its buffer
and a staging copy per remote rank, and publishes its address card and buffer descriptor (and,
for a cuda proxy rank whose remote rows land in device memory, JAX_MOE_PROXY_HMEM, the
descriptor of its device rows); then it reads the cards of the remote ranks and connects to
them. Keys name the communicator by its comm id, a per-process counter: every process must
build its host communicators in the same order.

Provider and source address come from the environment: JAX_MOE_HOST_PROVIDER (default "shm";
"tcp;ofi_rxm" on any network) and JAX_MOE_HOST_NODE (default none; "127.0.0.1" keeps tcp on
loopback). With shm, a peer process killed while it holds a lock of libfabric's shared
queues (a spinlock in shared memory) can leave its peers stuck inside libfabric; tcp reports
the dead peer, and every wait then ends in CommError. JAX_MOE_HOST_SHUFFLE_SEED (default 0,
off) turns on the engines' test mode that applies completions late and in random order
(results must not change).
"""

from __future__ import annotations

import jax

from jax_moe import native, settings
from jax_moe.backends import hosts
from jax_moe.backends.ranks import KV_TIMEOUT_MS, distributed_client


def available() -> bool:
  """True when the native module can reach ranks in other processes (libfabric build)."""
  module = native.load()
  return module is not None and hasattr(module, "host_open_remote")


def connect_host_ranks(states, groups, ordinal_of, create, owner: str, threads: int,
                       device_rows=None) -> list[list[int]]:
  """Creates and connects the host rank states of this process's devices in `groups`; returns
  the near ranks of each group (in other processes of this host).

  groups[g] lists the devices of group g in rank order; ordinal_of(device) is the key of a
  local device's state; create(comm_id, ordinal, rank, shared, remote) makes one (`shared`:
  its buffer in shared memory, for near ranks; `remote`: its group has ranks on other hosts);
  each runs its row loops on `threads` threads. device_rows(ordinal, remote_ranks), when
  given, is a cuda proxy rank's device memory for the rows to and from its remote ranks
  (JAX_MOE_PROXY_HMEM): (device buffer, device staging copies) as the binding
  cuda_device_rows returns it, or None. Created ordinals are appended to
  states.ordinals, so states.close() frees them if a later step fails.
  """
  me = jax.process_index()
  host = hosts.host_of({d.process_index for d in groups.flat}, owner)
  # local[g][p]: key of rank p of group g in this process, -1 in another process.
  local = [[ordinal_of(d) if d.process_index == me else -1 for d in group] for group in groups]
  # near[g]: the ranks of group g in other processes of this host.
  near = [[p for p, d in enumerate(group)
           if d.process_index != me and host[d.process_index] == host[me]] for group in groups]
  remote = [[p for p, o in enumerate(ordinals) if o < 0 and p not in near_g]
            for ordinals, near_g in zip(local, near)]
  if any(remote) and not available():
    raise ValueError(f"{owner}: the mesh spans hosts, which needs jax_moe._native built with "
                     f"libfabric (build_info: {native.build_info()}); use backend='xla'")
  module = native.load()
  for ordinals, near_g, remote_g in zip(local, near, remote):
    for rank, ordinal in enumerate(ordinals):
      if ordinal >= 0:
        create(states.comm_id, ordinal, rank, bool(near_g), bool(remote_g))
        states.ordinals.append(ordinal)
        module.host_set_threads(states.comm_id, ordinal, threads)
  for index, (ordinals, near_g, remote_g) in enumerate(zip(local, near, remote)):
    if all(o < 0 for o in ordinals):
      continue
    if near_g:
      map_near(states.comm_id, index, ordinals, near_g, owner)
    if remote_g:
      connect_remote(states.comm_id, index, ordinals, remote_g, owner, device_rows)
    for ordinal in ordinals:
      if ordinal >= 0:
        module.host_connect_rank(states.comm_id, ordinal, ordinals)
  return near


def map_near(comm_id: int, group_index: int, local: list[int], near: list[int],
             owner: str) -> None:
  """Maps the shared buffers of the near ranks of one group into its local ranks, then
  removes the names of the local ranks' buffers once every near rank mapped them.

  local[p] is the device ordinal of rank p when it is in this process, else -1.
  """
  module = native.load()
  client = distributed_client(owner)
  key = lambda what, p: f"jax_moe/host/{comm_id}/{group_index}/{p}/{what}"  # noqa: E731
  mine = [(p, ordinal) for p, ordinal in enumerate(local) if ordinal >= 0]
  for p, ordinal in mine:
    client.key_value_set(key("shared", p), module.host_shared_name(comm_id, ordinal))
  for p in near:
    name = client.blocking_key_value_get(key("shared", p), KV_TIMEOUT_MS)
    for _, ordinal in mine:
      module.host_map_near(comm_id, ordinal, p, name)
  for p, _ in mine:
    client.key_value_set(key("mapped", p), "1")
  for p in near:  # p mapped every buffer of this process
    client.blocking_key_value_get(key("mapped", p), KV_TIMEOUT_MS)
  for _, ordinal in mine:
    module.host_unlink_shared(comm_id, ordinal)


def connect_remote(comm_id: int, group_index: int, local: list[int], remote: list[int],
                   owner: str, device_rows=None) -> None:
  """Connects the local ranks of one group to its remote ranks (on other hosts).

  local[p] is the device ordinal of rank p when it is in this process, else -1;
  device_rows as connect_host_ranks takes it.
  """
  module = native.load()
  client = distributed_client(owner)
  key = lambda what, p: f"jax_moe/host/{comm_id}/{group_index}/{p}/{what}"  # noqa: E731
  for p, ordinal in enumerate(local):
    if ordinal < 0:
      continue
    rows = device_rows(ordinal, remote) if device_rows is not None else None
    buffer, staging = rows if rows is not None else (0, [])
    card, descriptor, rows_descriptor = module.host_open_remote(
        comm_id, ordinal, remote, settings.host_provider(), settings.host_node(),
        settings.host_domains(ordinal), settings.host_shuffle_seed(), device_rows=buffer,
        device_staging=staging, cuda_device=ordinal if rows is not None else -1)
    client.key_value_set(key("card", p), card.hex())
    client.key_value_set(key("buffer", p), descriptor.hex())
    client.key_value_set(key("device_rows", p), rows_descriptor.hex())
  read = lambda what, p: bytes.fromhex(  # noqa: E731
      client.blocking_key_value_get(key(what, p), KV_TIMEOUT_MS))
  for p in remote:
    card, descriptor, rows_descriptor = (read(what, p) for what in ("card", "buffer",
                                                                    "device_rows"))
    for ordinal in local:
      if ordinal >= 0:
        module.host_connect_remote(comm_id, ordinal, p, card, descriptor, rows_descriptor)
