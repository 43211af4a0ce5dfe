"""The bytes of one host dispatch + combine moved by a bare TransferEngine between two processes.

Two modes, both with the exchange's data dependency (a process sends its combine only after
the peer's dispatch arrived):
  same_writes: the host backend's protocol without its computation or copies: per phase the
               writes of remote_traffic (routes, then rows, each posted and flushed; combine
               rows or partials), a wait for the peer's as many writes, then the empty
               acknowledgements, which the next call's sender waits for first.
  one_write:   per phase one write carrying all of that phase's bytes, then a wait for the
               peer's one; no acknowledgements. The floor for those bytes.
Per-iteration time is (t(n_long) - t(n_short)) / (n_long - n_short), like the jitted loops.
"""

from __future__ import annotations

import time

import numpy as np

from benchmarks.remote_traffic import Direction

MODES = ("same_writes", "one_write")
ROUTES, ROWS, DISPATCH_ACK, COMBINE, COMBINE_ACK, ONE_DISPATCH, ONE_COMBINE = range(1, 8)
CHECK_SEED = 7  # source bytes of rank r: default_rng((CHECK_SEED, r))


def source_bytes(rank: int, size: int) -> np.ndarray:
  return np.random.default_rng((CHECK_SEED, rank)).integers(0, 256, size, np.uint8)


def region_bytes(directions: list[Direction]) -> int:
  """Room for the largest phase any process sends (writes are laid out back to back)."""
  most = max(max(d.dispatch.bytes, d.combine.bytes) for d in directions)
  return max(most, 1)


class RawExchange:
  """One process's side: an engine with a peer, registered source and destination regions."""

  def __init__(self, engine, peer: int, peer_descriptor: bytes, source, mine: Direction,
               theirs: Direction):
    self.engine, self.peer, self.source = engine, peer, source
    self.mine, self.theirs = mine, theirs
    self._descriptor = peer_descriptor
    self._groups = {}

  def _group(self, members: int):
    """A group naming the peer `members` times: one scatter call posts that many writes (as
    the host backend's C++ loop does), so Python's per-call cost stays out of the timing."""
    if members not in self._groups:
      self._groups[members] = self.engine.create_group([(self.peer, self._descriptor)] * members)
    return self._groups[members]

  def _post(self, lengths: list[int], tag: int) -> None:
    if not lengths:
      return
    offsets = np.concatenate([[0], np.cumsum(lengths[:-1])]).astype(np.int64).tolist()
    self.engine.scatter(self._group(len(lengths)), self.source, offsets, lengths, offsets, tag)

  def _wait(self, tag: int, count: int, what: str) -> None:
    if count:
      self.engine.wait(tag, {self.peer: count}, what=what)

  def _same_writes(self, first: bool) -> None:
    mine, theirs = self.mine, self.theirs
    # dispatch: the peer acknowledged the previous call's rows before they are overwritten
    if not first:
      self._wait(DISPATCH_ACK, theirs.dispatch.acks, "dispatch ack")
    self._post(mine.dispatch.routes, ROUTES)
    self.engine.flush()
    self._post(mine.dispatch.payload, ROWS)
    self.engine.flush()
    self._wait(ROUTES, len(theirs.dispatch.routes), "routes")
    self._wait(ROWS, len(theirs.dispatch.payload), "rows")
    self._post([0] * mine.dispatch.acks, DISPATCH_ACK)
    self.engine.flush()
    # combine
    if not first:
      self._wait(COMBINE_ACK, theirs.combine.acks, "combine ack")
    self._post(mine.combine.payload, COMBINE)
    self.engine.flush()
    self._wait(COMBINE, len(theirs.combine.payload), "combine")
    self._post([0] * mine.combine.acks, COMBINE_ACK)
    self.engine.flush()

  def _one_write(self) -> None:
    self._post([self.mine.dispatch.bytes], ONE_DISPATCH)
    self.engine.flush()
    self._wait(ONE_DISPATCH, 1, "dispatch")
    self._post([self.mine.combine.bytes], ONE_COMBINE)
    self.engine.flush()
    self._wait(ONE_COMBINE, 1, "combine")

  def run(self, mode: str, n: int) -> float:
    """Seconds for `n` exchanges in `mode`, acknowledgements of the last one included."""
    if mode not in MODES:
      raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    start = time.perf_counter()
    for i in range(n):
      if mode == "one_write":
        self._one_write()
      else:
        self._same_writes(first=i == 0)
    if mode == "same_writes" and n:
      self._wait(DISPATCH_ACK, self.theirs.dispatch.acks, "last dispatch ack")
      self._wait(COMBINE_ACK, self.theirs.combine.acks, "last combine ack")
    return time.perf_counter() - start

  def writes(self, mode: str) -> int:
    """Writes this process posts per exchange in `mode`."""
    return self.mine.writes if mode == "same_writes" else 2
