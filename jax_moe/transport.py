"""TransferEngine: RMA writes with 32-bit immediates between processes over libfabric.

A thin wrapper of ``jax_moe._native.TransferEngine`` (ffi/transport/). One engine owns an
RDM endpoint per rail (NIC; `domains`) and a progress thread. Peers exchange ``engine.address`` and
``region.descriptor`` as bytes by any channel, then:

  group = engine.create_group([(peer_rank, peer_region_descriptor), ...])
  engine.scatter(group, my_region, src_offsets, lengths, dst_offsets, tag)  # one write each
  engine.wait(tag, {peer_rank: 1, ...})  # immediates counted per (tag, source), any order
  engine.barrier(group, tag)

Providers: "shm" (same host), "tcp;ofi_rxm" (give node="127.0.0.1" on loopback),
"verbs;ofi_rxm", "efa". Every wait is bounded (timeout_s, default JAX_MOE_TIMEOUT_S or 10 s)
and raises TransportError naming the rank, the stage and the peers that are missing.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np

from jax_moe import native
from jax_moe.settings import MAX_TIMEOUT_S
from jax_moe.settings import timeout_s as default_timeout_s


def available() -> bool:
  """True when the native module is built with libfabric (the TransferEngine exists)."""
  module = native.load()
  return module is not None and hasattr(module, "TransferEngine")


def _native():
  if not available():
    raise RuntimeError("jax_moe.transport needs the native module built with libfabric "
                       f"(build_info: {native.build_info()})")
  return native.load()


# The native exception class when built; a stand-in otherwise so `except` clauses still work.
TransportError = native.load().TransportError if available() else RuntimeError


class MemoryRegion(NamedTuple):
  """A registered array: `descriptor` is what peers need to write into it."""
  id: int
  array: object       # numpy array or jax.Array, kept so the memory outlives the registration
  descriptor: bytes


class PeerGroup(NamedTuple):
  id: int
  ranks: tuple[int, ...]


class TransferEngine:
  """One libfabric RDM endpoint with registered memory, peers, peer groups and counters.

  Args:
    rank: this engine's rank (< 4096); the source field of the immediates it sends.
    provider: libfabric provider name; None takes FI_PROVIDER, else libfabric's first choice.
    node: source address for socket providers ("127.0.0.1" keeps tcp on loopback).
    timeout_s: default bound of every wait; None reads JAX_MOE_TIMEOUT_S (default 10).
    shuffle_seed: nonzero turns on the test mode that permutes posting order and applies
      completions late and in random order; results must not change.
    cuda_memory: ask the provider for FI_HMEM (CUDA buffers); builds with CUDA only.
    domains: the NICs to use, one endpoint (rail) each, as libfabric domain names (`fi_info -p
      efa` lists them; a name may repeat); peers are sharded across them, peer p on rail
      (rank + p) % rails. None or empty: one rail on the provider's first domain.
  """

  def __init__(self, rank: int, provider: str | None = None, node: str | None = None,
               timeout_s: float | None = None, shuffle_seed: int = 0, cuda_memory: bool = False,
               domains: Sequence[str] | None = None):
    module = _native()
    if not 0 <= rank < module.transport_max_ranks:
      raise ValueError(f"rank must be in [0, {module.transport_max_ranks}), got {rank}")
    domains = list(domains or ())
    if len(domains) > module.transport_max_rails or not all(
        isinstance(d, str) and d for d in domains):
      raise ValueError(f"domains must be at most {module.transport_max_rails} non-empty domain "
                       f"names, got {domains!r}")
    if provider is None:
      provider = os.environ.get("FI_PROVIDER", "")
    self.rank = rank
    self.timeout_s = default_timeout_s() if timeout_s is None else _checked_timeout(timeout_s)
    self._engine = module.TransferEngine(rank, provider, node or "", self.timeout_s,
                                         int(shuffle_seed), bool(cuda_memory), domains)
    self.address: bytes = self._engine.address()
    self.facts: dict = self._engine.facts()
    self._regions: dict[int, MemoryRegion] = {}

  def add_peer(self, address: bytes) -> None:
    """Makes the engine whose `address` this is reachable (self included)."""
    self._engine.add_peer(bytes(address))

  def register(self, array: np.ndarray) -> MemoryRegion:
    """Registers a C-contiguous, writeable numpy array for local reads and remote writes."""
    if not isinstance(array, np.ndarray):
      raise TypeError(f"register: array must be a numpy array, got {type(array).__name__}")
    if not array.flags.c_contiguous or not array.flags.writeable or array.nbytes == 0:
      raise ValueError("register: array must be C-contiguous, writeable and non-empty")
    region_id = self._engine.register_memory(array.ctypes.data, array.nbytes)
    region = MemoryRegion(region_id, array, self._engine.region_descriptor(region_id))
    self._regions[region_id] = region
    return region

  def register_device(self, array) -> MemoryRegion:
    """Registers the buffer of a jax.Array on one CUDA device (FI_HMEM: an engine made with
    cuda_memory=True) for local reads and remote writes. Remote writes change the buffer
    behind JAX's back: only for arrays the caller owns and reads after the writes landed."""
    devices = getattr(array, "devices", lambda: set())()
    if len(devices) != 1 or next(iter(devices)).platform != "gpu" or array.nbytes == 0:
      raise ValueError("register_device: array must be a non-empty jax.Array on one GPU")
    (device,) = devices
    region_id = self._engine.register_memory(array.unsafe_buffer_pointer(), array.nbytes,
                                             device.local_hardware_id)
    region = MemoryRegion(region_id, array, self._engine.region_descriptor(region_id))
    self._regions[region_id] = region
    return region

  def deregister(self, region: MemoryRegion) -> None:
    self._engine.deregister_memory(region.id)
    del self._regions[region.id]

  def create_group(self, members: Sequence[tuple[int, bytes]]) -> PeerGroup:
    """A peer group: (rank, descriptor of that rank's destination region) per member."""
    members = [(int(rank), bytes(descriptor)) for rank, descriptor in members]
    group_id = self._engine.create_group(members)
    return PeerGroup(group_id, tuple(rank for rank, _ in members))

  def scatter(self, group: PeerGroup, source: MemoryRegion, src_offsets: Sequence[int],
              lengths: Sequence[int], dst_offsets: Sequence[int], tag: int,
              timeout_s: float | None = None) -> None:
    """One write per member i: `lengths[i]` bytes from `source` at `src_offsets[i]` to the
    member's region at `dst_offsets[i]`, each with immediate (tag, self.rank). Every member
    gets its immediate, also for an empty slice. Returns once posted (see flush); posting
    gives up after `timeout_s` (default: the engine's) of a full transmit queue, for all the
    writes together."""
    self._engine.scatter(group.id, source.id, [int(v) for v in src_offsets],
                         [int(v) for v in lengths], [int(v) for v in dst_offsets], int(tag),
                         self._bound(timeout_s))

  def barrier(self, group: PeerGroup, tag: int, timeout_s: float | None = None) -> None:
    """Sends (tag, self.rank) to every member and waits for (tag, member) from each."""
    self._engine.barrier(group.id, int(tag), self._bound(timeout_s))

  def wait(self, tag: int, counts: Mapping[int, int], timeout_s: float | None = None,
           what: str = "wait") -> None:
    """Blocks until `counts[source]` immediates (tag, source) arrived from every source, then
    consumes them. `what` names the stage in the timeout message."""
    pairs = [(int(source), int(count)) for source, count in counts.items()]
    self._engine.wait(int(tag), pairs, self._bound(timeout_s), what)

  def flush(self, timeout_s: float | None = None) -> None:
    """Blocks until every write posted so far completed locally (sources may be reused)."""
    self._engine.flush(self._bound(timeout_s))

  def arrived(self, tag: int, source: int) -> int:
    """Immediates (tag, source) that arrived and were not consumed by wait/barrier."""
    return self._engine.arrived(int(tag), int(source))

  def open_regions(self) -> int:
    """Registrations held, the engine's internal signal region included; 0 once closed."""
    return self._engine.open_regions()

  def rail_writes(self) -> list[int]:
    """Writes posted on each rail so far (barrier and empty-slice writes included)."""
    return list(self._engine.rail_writes())

  def close(self) -> None:
    """Joins the progress thread and closes regions, endpoint and fabric. Idempotent."""
    self._engine.close()
    self._regions.clear()

  def __enter__(self) -> TransferEngine:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def _bound(self, timeout_s: float | None) -> float:
    return self.timeout_s if timeout_s is None else _checked_timeout(timeout_s)


def _checked_timeout(timeout_s) -> float:
  value = float(timeout_s)
  if not 0 < value <= MAX_TIMEOUT_S:  # also refuses nan and inf
    raise ValueError(f"timeout_s must be a number of seconds in (0, {MAX_TIMEOUT_S}], "
                     f"got {timeout_s}")
  return value


@functools.cache
def registers_cuda_memory(provider: str, node: str = "") -> bool:
  """Whether this libfabric registers CUDA memory with `provider`: it grants FI_HMEM and a
  registration of a small buffer on the first local GPU succeeds. Granting is not enough:
  distribution packages of libfabric are built without CUDA (Debian's 1.17: shm grants
  FI_HMEM, then refuses every CUDA registration). False without a GPU or libfabric."""
  import jax  # only here: the engine itself works without JAX

  gpus = [d for d in jax.local_devices() if d.platform == "gpu"]
  if not available() or not gpus:
    return False
  try:
    with TransferEngine(0, provider=provider, node=node or None, cuda_memory=True) as engine:
      if not engine.facts["cuda_memory"]:
        return False
      probe = jax.device_put(np.zeros(4096, np.uint8), gpus[0])
      engine.deregister(engine.register_device(probe))
  except TransportError:
    return False
  return True
