"""Processes a benchmark or a test starts: a free loopback port for their coordinator, a
bounded wait that kills (by pid) whatever outlives it, and a private CUDA MPS daemon for
processes that share one GPU."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

MPS_CONTROL = "nvidia-cuda-mps-control"


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


@contextlib.contextmanager
def private_mps(folder: Path, timeout_s: float = 20.0):
  """A CUDA MPS control daemon of this run only: its pipe and log folders under `folder`, so
  only processes given the returned environment (CUDA_MPS_PIPE_DIRECTORY and
  CUDA_MPS_LOG_DIRECTORY) become its clients, and their kernels run side by side on the GPU
  instead of in time slices of one process each. It changes no setting of the GPU (compute
  mode and MIG stay as they are); on exit it is told to quit and waited for, bounded."""
  control = shutil.which(MPS_CONTROL)
  if control is None:
    raise RuntimeError(f"--mps: {MPS_CONTROL} is not on PATH")
  env = {"CUDA_MPS_PIPE_DIRECTORY": str(folder / "mps_pipe"),
         "CUDA_MPS_LOG_DIRECTORY": str(folder / "mps_log")}
  for path in env.values():
    Path(path).mkdir(parents=True, exist_ok=True)
  full_env = dict(os.environ, **env)
  try:
    started = subprocess.run([control, "-d"], env=full_env, capture_output=True, text=True,
                             timeout=timeout_s)
  except subprocess.TimeoutExpired as e:
    raise RuntimeError(f"--mps: {MPS_CONTROL} -d did not return in {timeout_s} s") from e
  if started.returncode != 0:
    raise RuntimeError(f"--mps: {MPS_CONTROL} -d exited {started.returncode}: "
                       f"{(started.stderr or started.stdout).strip()[:300]}")
  try:
    yield env
  finally:
    try:
      subprocess.run([control], input="quit\n", env=full_env, capture_output=True, text=True,
                     timeout=timeout_s)
    except subprocess.TimeoutExpired:
      print(f"warning: the MPS daemon of {env['CUDA_MPS_PIPE_DIRECTORY']} did not quit in "
            f"{timeout_s} s", file=sys.stderr)
