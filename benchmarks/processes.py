"""Processes a benchmark or a test starts: a free loopback port for their coordinator, and a
bounded wait that kills (by pid) whatever outlives it."""

from __future__ import annotations

import socket
import subprocess
import time


def free_loopback_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def wait_all(processes, timeout_s: float) -> list[int | None]:
  """Exit codes; processes still running at the deadline are killed and get None."""
  deadline = time.monotonic() + timeout_s
  codes = []
  for p in processes:
    try:
      codes.append(p.wait(timeout=max(deadline - time.monotonic(), 0.1)))
    except subprocess.TimeoutExpired:
      codes.append(None)
  for p, code in zip(processes, codes):
    if code is None:
      p.kill()
      p.wait()
  return codes
