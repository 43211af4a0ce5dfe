"""The rank states of one CUDA communicator on this process's devices.

A communicator (a MoE `Communicator` with the cuda backend, or an `AllReduce`) has one rank
state per device of its mesh axis: a buffer allocated by the native layer outside XLA's pool,
counters and an error record (ffi/cuda/state.h). Ranks on this process's devices map each
other's buffers through peer access; ranks in other processes exchange CUDA IPC handles
through the jax.distributed key-value store. Every process must build its communicators in
the same order: the comm id that names a communicator's keys is a per-process counter.
"""

from __future__ import annotations

from typing import Callable

import jax
import numpy as np

from jax_moe import native
from jax_moe.backends.ranks import KV_TIMEOUT_MS, RankStates, distributed_client
from jax_moe.sharding import rank_groups


def cuda_module(owner: str):
  """The native module with its targets registered; raises unless it was built with CUDA."""
  module = native.load()
  if module is None or not native.has_cuda():
    raise ValueError(f"{owner}: jax_moe._native was not built with CUDA "
                     f"({native.build_info()['native_error'] or 'CUDA off in this build'})")
  native.register_targets()
  return module


class CudaRanks(RankStates):
  """Creates, connects, checks and frees the local rank states of one communicator.

  `create(comm_id, ordinal, rank)` allocates the state of one rank on local device `ordinal`
  (a binding of the native module); `owner` names the Python class in error messages.
  """

  def __init__(self, mesh, axis: str, create: Callable[[int, int, int], None], owner: str):
    module = cuda_module(owner)
    super().__init__(module.cuda_take_error, module.cuda_destroy_rank)
    self._native = module
    self._owner = owner
    try:
      self._connect(rank_groups(mesh, axis), create)
    except BaseException:
      self.close()
      raise

  def _connect(self, groups: np.ndarray, create) -> None:
    me = jax.process_index()
    for group in groups:
      for rank, device in enumerate(group):
        if device.process_index != me:
          continue
        create(self.comm_id, device.local_hardware_id, rank)
        self.ordinals.append(device.local_hardware_id)
    for index, group in enumerate(groups):
      local = [d.local_hardware_id if d.process_index == me else -1 for d in group]
      if all(o < 0 for o in local):
        continue
      others = [rank for rank, ordinal in enumerate(local) if ordinal < 0]
      handles = exchange_ipc_handles(self._native, self.comm_id, index, local, others,
                                     self._owner)
      for ordinal in local:
        if ordinal >= 0:
          self._native.cuda_connect_rank(self.comm_id, ordinal, local, handles)


def exchange_ipc_handles(module, comm_id: int, index: int, local: list[int], wanted: list[int],
                         owner: str) -> list[bytes]:
  """CUDA IPC handles of the buffers of ranks `wanted` (in other processes) of group `index`;
  b"" for the others. local[p] is the device ordinal of rank p in this process, else -1;
  this process publishes its ranks' handles when anyone may want them."""
  if not wanted:
    return [b""] * len(local)
  client = distributed_client(owner)
  key = lambda rank: f"jax_moe/cuda/{comm_id}/{index}/{rank}"  # noqa: E731
  for rank, ordinal in enumerate(local):
    if ordinal >= 0:
      client.key_value_set(key(rank), module.cuda_ipc_handle(comm_id, ordinal).hex())
  return [bytes.fromhex(client.blocking_key_value_get(key(rank), KV_TIMEOUT_MS))
          if rank in wanted else b"" for rank in range(len(local))]
