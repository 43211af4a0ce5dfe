"""The public types of dispatch/combine, and what a backend provides.

Communicator (communicator.py) builds a backend and calls it; backends build Dispatched. Both
import this module, neither imports the other's module for a type.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Protocol

import jax


@dataclasses.dataclass(frozen=True)
class Owner:
  """Which communicator made a handle: static data of the handle's pytree."""
  serial: int
  description: str


@jax.tree_util.register_pytree_node_class
class Handle:
  """A backend's handle (or pending half) tagged with the communicator that made it.

  The tag is static pytree data, so a handle used with another communicator is refused while
  tracing, before anything runs.
  """

  def __init__(self, owner: Owner, kind: str, inner):
    self.owner, self.kind, self.inner = owner, kind, inner

  def tree_flatten(self):
    return (self.inner,), (self.owner, self.kind)

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(aux[0], aux[1], children[0])

  def __repr__(self):
    return f"Handle({self.kind} of {self.owner.description})"


class Dispatched(NamedTuple):
  """Rows received by one rank, in the deterministic layout of docs/semantics.md."""
  x: jax.Array                  # [capacity, hidden] dispatch dtype
  scales: jax.Array | None      # [capacity, hidden // block_size] f32 (fp8 dispatch) or None
  weights: jax.Array            # [capacity] f32 router weight of each row, 0 on padding
  group_sizes: jax.Array        # [L] int32 rows per local expert incl. padding (ragged_dot)
  tokens_per_expert: jax.Array  # [L] int32 real rows per local expert
  handle: Any                   # Handle that combine needs; valid for one combine


class Backend(Protocol):
  """One backend of a Communicator (backends/xla.py, backends/cuda.py, backends/host.py).

  Its methods run inside `jax.shard_map` on per-shard arrays the Communicator has checked;
  handles and pending halves are backend pytrees (Communicator tags them, see Handle).
  """
  name: str
  capacity: int

  def dispatch(self, x, topk_ids, topk_weights, num_tokens) -> Dispatched: ...
  def dispatch_send(self, x, topk_ids, topk_weights, num_tokens) -> Any: ...
  def dispatch_recv(self, pending) -> Dispatched: ...
  def combine(self, y, handle) -> jax.Array: ...
  def combine_send(self, y, handle) -> Any: ...
  def combine_recv(self, pending) -> jax.Array: ...
  def check(self) -> tuple[int, int, int, int] | None: ...
  def close(self) -> None: ...
