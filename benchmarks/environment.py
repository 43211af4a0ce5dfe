"""Where a benchmark runs: the mesh and provenance for results."""

from __future__ import annotations

import functools
import os
import re
import subprocess
from pathlib import Path

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec

REPO_ROOT = Path(__file__).resolve().parents[1]
AXIS = "ep"


def ep_mesh(ep: int | None) -> Mesh:
  """The first `ep` devices of the default platform (all when None) on one axis "ep"."""
  devices = jax.devices()
  if ep is None:
    ep = len(devices)
  if not 1 <= ep <= len(devices):
    raise ValueError(f"--ep must be in [1, {len(devices)}] (devices of platform "
                     f"{devices[0].platform!r}), got {ep}")
  return Mesh(np.array(devices[:ep]), (AXIS,))


SHARDED = PartitionSpec(AXIS)
REPLICATED = PartitionSpec()


def device_slug(mesh: Mesh) -> str:
  """A file-name-safe device description, e.g. 'nvidia-h200-x2' or 'cpu-x8'."""
  kind = mesh.devices.flat[0].device_kind.lower()
  return f"{re.sub(r'[^a-z0-9]+', '-', kind).strip('-')}-x{mesh.devices.size}"


def _git(*args: str) -> str | None:
  try:
    done = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=10, check=True)
  except (OSError, subprocess.SubprocessError):
    return None
  return done.stdout.strip()


@functools.cache
def provenance(mesh: Mesh, git_commit: str | None = None) -> dict:
  """What a result file needs to be reproduced: code version, software, hardware.

  `git_commit` names the code of a copied working tree (the GPU machine's copy); given, it
  wins over whatever .git the copy may carry, and git_dirty is then unknown (None).
  """
  device = mesh.devices.flat[0]
  status = None if git_commit else _git("status", "--porcelain", "--untracked-files=no")
  info = {
      "git_commit": git_commit or _git("rev-parse", "HEAD") or "unknown (not a git checkout)",
      "git_dirty": None if status is None else bool(status),
      "jax_version": jax.__version__,
      "jaxlib_version": _jaxlib_version(),
      "platform": device.platform,
      "device_kind": device.device_kind,
      "device_count": int(mesh.devices.size),
      "devices_visible": jax.device_count(),
      # XLA's options change what the compiler picks (e.g. cuBLAS or Triton for a GEMM)
      "xla_flags": os.environ.get("XLA_FLAGS", ""),
  }
  try:
    import jax_moe
    info["jax_moe_build_info"] = jax_moe.build_info()
  except ImportError as e:
    info["jax_moe_build_info"] = {"import_error": str(e)}
  return info


def _jaxlib_version() -> str | None:
  try:
    import jaxlib
  except ImportError:
    return None
  return getattr(jaxlib, "__version__", None)
