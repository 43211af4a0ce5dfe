"""Result files and the summary table of a benchmark run."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

_STARTED = time.perf_counter()


def progress(message: str) -> None:
  """One line on stderr with the seconds since the benchmark started, flushed at once: a run
  killed by its time limit still shows how far it got and what each part cost."""
  print(f"[{time.perf_counter() - _STARTED:8.1f} s] {message}", file=sys.stderr, flush=True)


def write_json(path: Path, payload: dict) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(payload, indent=1, sort_keys=False) + "\n")


def _fmt(value, spec: str) -> str:
  """`value` formatted by `spec` (which starts with its width), or a right-aligned dash."""
  if value is None:
    return format("-", ">" + spec.split(".")[0])
  return format(value, spec)


def table(results: list[dict]) -> str:
  """One line per method: status, median and p10-p90 in microseconds, MB per rank, GB/s."""
  header = (f"{'method':34} {'status':8} {'median us':>10} {'p10-p90 us':>17} "
            f"{'MB/rank':>8} {'GB/s':>7}")
  lines = [header, "-" * len(header)]
  for r in results:
    t = r.get("time") or {}
    median = t.get("median_us")
    spread = f"{t['p10_us']:.1f}-{t['p90_us']:.1f}" if t else "-"
    mb = r.get("bytes_per_rank")
    gbps = (mb / (median * 1e-6) / 1e9) if (mb and median and median > 0) else None
    lines.append(f"{r['label'][:34]:34} {r['status']:8} {_fmt(median, '10.1f')} {spread:>17} "
                 f"{_fmt(None if mb is None else mb / 1e6, '8.2f')} {_fmt(gbps, '7.1f')}")
    if r["status"] != "ok" and r.get("reason"):
      lines.append(f"  {r['status']}: {r['reason'][:200]}")
  return "\n".join(lines)
