"""The `cuda` backend: dispatch/combine as XLA FFI custom calls over NVLink.

Each rank owns one buffer (ffi/protocol/nvlink_layout.h), allocated when the Communicator is built
and mapped by every peer (jax_moe/backends/cuda_ranks.py; generic rank state in ranks.py).
Where the mesh spans hosts (or JAX_MOE_FORCE_REMOTE=1), the same calls go through host proxies
instead (jax_moe/backends/cuda_proxy.py). Each op is one kernel: source ranks write routes and token
rows straight into their destinations' buffers and raise a flag per token chunk; sequence
numbers live in device memory and every wait has a timeout (JAX_MOE_TIMEOUT_S, default 10 s).
The protocol's chunk count (MoEConfig.num_sms, or the smallest SM count of the mesh's
devices) is the same on every rank.

Everything above the FFI call is backends/native_backend.py's, shared with the host backend.
"""

from __future__ import annotations

import jax
import numpy as np

from jax_moe import native, settings
from jax_moe.backends import cuda_proxy
from jax_moe.backends.cuda_ranks import CudaRanks
from jax_moe.backends.native_backend import NativeBackend
from jax_moe.config import MoEConfig
from jax_moe.sharding import rank_groups


# SMs of an H100/H200, for a device whose description does not say (every rank must agree on
# the protocol's chunk count, so it comes from the mesh, not from each rank's own device).
_DEFAULT_SMS = 132


def _sm_count(device) -> int:
  return int(getattr(device, "core_count", 0) or _DEFAULT_SMS)


class CudaBackend(NativeBackend):
  name = "cuda"

  def __init__(self, cfg: MoEConfig, mesh, axis: str):
    self._chunks = cfg.num_sms or min(_sm_count(d) for d in mesh.devices.flat)
    self._stage_clocks = settings.stage_clocks()
    super().__init__(cfg, mesh, axis)

  def _make_ranks(self, mesh, axis: str):
    owner = "Communicator(backend='cuda')"
    groups = rank_groups(mesh, axis)
    if cuda_proxy.use_proxy(groups, owner):
      return cuda_proxy.ProxyRanks(groups, self._rank_sizes, owner)
    return CudaRanks(mesh, axis, self._create_rank, owner)

  def _create_rank(self, comm_id: int, ordinal: int, rank: int) -> None:
    native.load().cuda_create_rank(comm_id=comm_id, ordinal=ordinal, chunks=self._chunks,
                                   stage_clocks=self._stage_clocks, **self._rank_sizes(rank))

  def stage_clocks(self) -> dict:
    """{device ordinal: {kernel: {mark: [ns per block]}}} of the latest launches
    (ffi/protocol/stage_clock.h); empty unless built with JAX_MOE_STAGE_CLOCKS=1 over NVLink."""
    module = native.load()
    clocks = {o: module.cuda_stage_clocks(self.comm_id, o) for o in self._ranks.ordinals}
    return {o: c for o, c in clocks.items() if c is not None}

  def _call(self, target: str, result_types, *args):
    return jax.ffi.ffi_call(target, result_types, has_side_effect=True)(
        *args, comm_id=np.int64(self.comm_id))
