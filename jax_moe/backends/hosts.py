"""Which processes of a mesh share a host (settings.host_group: JAX_MOE_HOST_GROUP, default the
host name). Ranks in processes of one host share memory (host backend, cuda proxies) and reach
each other over NVLink (cuda); the others are reached through the TransferEngine.
"""

from __future__ import annotations

import itertools

import jax

from jax_moe import settings
from jax_moe.backends.ranks import KV_TIMEOUT_MS, distributed_client

_exchanges = itertools.count(1)  # the same sequence in every process, like comm ids


def host_of(processes, owner: str) -> dict[int, str]:
  """{process index: host group} of `processes` (which holds this one).

  Each process publishes its group in the jax.distributed key-value store; a mesh of this
  process alone asks nothing (every process of the mesh must call this, in the same order).
  """
  me = jax.process_index()
  own = settings.host_group()
  if set(processes) == {me}:
    return {me: own}
  client = distributed_client(owner)
  exchange = next(_exchanges)
  key = lambda process: f"jax_moe/hosts/{exchange}/{process}"  # noqa: E731
  client.key_value_set(key(me), own)
  return {p: own if p == me else client.blocking_key_value_get(key(p), KV_TIMEOUT_MS)
          for p in processes}
