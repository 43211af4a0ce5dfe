"""The writes the host backend posts between two processes for one dispatch + combine.

The host backend (ffi/host/remote_spans.cc) sends a remote rank one RMA write per run of
consecutive tokens or slots it fills there, plus fixed writes for routes and acknowledgements.
This module derives the same list from the routing alone, per direction (process a -> b), so
a raw TransferEngine loop can move exactly those bytes in exactly those writes:

  dispatch routes  src -> dst  1 write: token count (16 B) and T*K route entries (8 B each)
  dispatch rows    src -> dst  one write per merged run of src's tokens with a slot on dst,
                               token_bytes each (fp8 codes + f32 scales padded to 16 B, or bf16)
  dispatch ack     dst -> src  1 empty write
  combine          dst -> src  source mode: one write per run of src's (t, k) slots on dst,
                               2*H B each; expert mode: one per merged run of src's tokens
                               with a slot on dst, H * partial bytes each
  combine ack      src -> dst  1 empty write
A merged run joins runs at most merge_gap_bytes(ranks) // row bytes rows apart (the rows
between go along). An empty run list still costs one (empty) write: the receiver counts writes, not bytes.
"""

from __future__ import annotations

import dataclasses

import numpy as np

ROUTE_HEADER_BYTES = 16   # ffi/protocol/host_layout.h kRouteHeaderBytes
ROUTE_ENTRY_BYTES = 8     # RouteEntry {id, weight}
MERGE_GAP_BYTES = 64 << 10  # ffi/host/remote_spans.h kMergeGapBytes


def merge_gap_bytes(ranks: int) -> int:
  """Bytes a merged run may carry between two runs (remote_spans.h merge_gap_bytes)."""
  return MERGE_GAP_BYTES if ranks <= 8 else MERGE_GAP_BYTES * 8 // ranks


def _align16(n: int) -> int:
  return (n + 15) // 16 * 16


def token_bytes(hidden: int, fp8: bool, block_size: int) -> int:
  """Bytes of one token in the dispatch region (ffi/protocol/dims.h token_bytes)."""
  return _align16(hidden + 4 * (hidden // block_size)) if fp8 else 2 * hidden


def _run_bounds(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """(starts, ends) of the maximal runs of True in a 1-d boolean array, in order."""
  padded = np.concatenate([[False], mask.astype(bool), [False]])
  edges = np.flatnonzero(padded[1:] != padded[:-1])
  return edges[0::2], edges[1::2]


def runs(mask: np.ndarray) -> np.ndarray:
  """Lengths of the maximal runs of True in a 1-d boolean array, in order."""
  starts, ends = _run_bounds(mask)
  return ends - starts


def merged_runs(mask: np.ndarray, gap: int) -> list[int]:
  """Lengths of the runs of True, runs at most `gap` False entries apart joined (the False
  entries between them counted), in order."""
  merged: list[list[int]] = []  # [start, end) of each merged run
  for start, end in zip(*(b.tolist() for b in _run_bounds(mask))):
    if merged and start - merged[-1][1] <= gap:
      merged[-1][1] = end
    else:
      merged.append([start, end])
  return [end - start for start, end in merged]


def _as_writes(run_lengths, unit: int) -> list[int]:
  """One write of `length * unit` bytes per run; one empty write when there is none."""
  return [int(n) * unit for n in run_lengths] or [0]


@dataclasses.dataclass(frozen=True)
class PhaseWrites:
  """Byte counts of the writes one process posts to the other in one phase, in posting order."""
  routes: list[int]   # dispatch routes (empty list in the combine phase)
  payload: list[int]  # rows (dispatch) or combine rows / partials
  acks: int           # empty acknowledgement writes this process posts after receiving

  @property
  def writes(self) -> int:
    return len(self.routes) + len(self.payload) + self.acks

  @property
  def bytes(self) -> int:
    return sum(self.routes) + sum(self.payload)


@dataclasses.dataclass(frozen=True)
class Direction:
  """What process `source` sends process `dest` in one dispatch + combine."""
  source: int
  dest: int
  dispatch: PhaseWrites
  combine: PhaseWrites

  @property
  def writes(self) -> int:
    return self.dispatch.writes + self.combine.writes

  @property
  def bytes(self) -> int:
    return self.dispatch.bytes + self.combine.bytes

  def record(self) -> dict:
    return {"source_process": self.source, "dest_process": self.dest,
            "dispatch_route_bytes": sum(self.dispatch.routes),
            "dispatch_row_bytes": sum(self.dispatch.payload),
            "dispatch_writes": self.dispatch.writes, "combine_bytes": self.combine.bytes,
            "combine_writes": self.combine.writes, "bytes": self.bytes, "writes": self.writes}


def directions(topk_ids: np.ndarray, ranks: int, ranks_per_process: int, experts: int,
               hidden: int, fp8: bool, block_size: int, reduce: str,
               partial_bytes: int) -> list[Direction]:
  """The writes between every ordered pair of processes for global routing `topk_ids`
  ([ranks * T, K], every rank sending all T tokens; rank r lives in process r //
  ranks_per_process)."""
  if reduce not in ("source", "expert"):
    raise ValueError(f"reduce must be 'source' or 'expert', got {reduce!r}")
  T = topk_ids.shape[0] // ranks
  K = topk_ids.shape[1]
  local = experts // ranks
  ids = topk_ids.reshape(ranks, T, K)
  dest = np.where(ids >= 0, ids // local, -1)  # [src, T, K] rank holding each slot
  row_bytes = token_bytes(hidden, fp8, block_size)
  combine_unit = 2 * hidden if reduce == "source" else hidden * partial_bytes
  # Source mode never merges: other ranks write the rows between a rank's runs.
  gap_bytes = merge_gap_bytes(ranks)
  combine_gap = 0 if reduce == "source" else gap_bytes // combine_unit
  processes = ranks // ranks_per_process
  process_of = lambda r: r // ranks_per_process  # noqa: E731

  result = []
  for a in range(processes):
    for b in range(processes):
      if a == b:
        continue
      routes, rows, combine = [], [], []
      dispatch_acks = combine_acks = 0
      # Token source rank s and expert rank e, in different processes.
      for s in range(ranks):
        for e in range(ranks):
          sent = dest[s] == e  # [T, K] slots of s's tokens held by e
          if process_of(s) == a and process_of(e) == b:
            routes += [ROUTE_HEADER_BYTES + ROUTE_ENTRY_BYTES * T * K]
            rows += _as_writes(merged_runs(sent.any(axis=1), gap_bytes // row_bytes), row_bytes)
            combine_acks += 1  # s acknowledges e's combine
          elif process_of(e) == a and process_of(s) == b:
            dispatch_acks += 1  # e acknowledges s's dispatch
            held = sent.reshape(-1) if reduce == "source" else sent.any(axis=1)
            combine += _as_writes(merged_runs(held, combine_gap), combine_unit)
      result.append(Direction(a, b, PhaseWrites(routes, rows, dispatch_acks),
                              PhaseWrites([], combine, combine_acks)))
  return result
