"""Joining a multi-process (multi-host) job: `jax.distributed` for the command line.

    from jax_moe import distributed
    distributed.initialize("10.0.0.1:1234", num_processes=2, process_id=0)  # before any jax use
    mesh = distributed.global_mesh()          # every process's devices on one axis "ep"
    if distributed.is_primary(): print(...)   # process 0 prints

`initialize()` with no arguments starts `jax.distributed` only where its own detection
would find a job: JAX_COORDINATOR_ADDRESS set, or a cluster environment jax knows (SLURM with
srun, Open MPI's mpirun, ...); elsewhere it does nothing and the process runs alone.
See docs/multi-node.md.
"""

from __future__ import annotations

import inspect
import os
import sys

# How long a process waits for the others to join, and for a dead peer to be noticed by the
# coordinator (seconds); the jax defaults (300, 100) leave a failed launch hanging for minutes.
INIT_TIMEOUT_S = 300
HEARTBEAT_TIMEOUT_S = 100


def detected_environment() -> str | None:
  """What `jax.distributed.initialize()` would detect a job from, or None (run alone)."""
  if os.environ.get("JAX_COORDINATOR_ADDRESS"):
    return "JAX_COORDINATOR_ADDRESS"
  from jax._src import clusters

  for env in clusters.ClusterEnv._cluster_types:
    if not getattr(env, "opt_in_only_method", False) and env.is_env_present():
      return env.__name__
  return None


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, local_device_ids=None,
               init_timeout_s: int = INIT_TIMEOUT_S,
               heartbeat_timeout_s: int = HEARTBEAT_TIMEOUT_S) -> bool:
  """Starts jax.distributed; returns whether this process is part of a multi-process job.

  With coordinator, num_processes and process_id all None, only an environment
  `detected_environment()` names starts it. A coordinator given without the others leaves
  them to jax's detection (a SLURM or MPI job), which fails with jax's error elsewhere.
  Must run before anything touches a jax device.
  """
  import jax

  explicit = (coordinator, num_processes, process_id) != (None, None, None)
  if not explicit and detected_environment() is None:
    return False
  if num_processes == 1 and coordinator is None:
    return False
  options = dict(coordinator_address=coordinator, num_processes=num_processes,
                 process_id=process_id, local_device_ids=local_device_ids,
                 initialization_timeout=init_timeout_s,
                 heartbeat_timeout_seconds=heartbeat_timeout_s)
  accepted = inspect.signature(jax.distributed.initialize).parameters
  jax.distributed.initialize(**{k: v for k, v in options.items() if k in accepted})
  return jax.process_count() > 1


def _client():
  from jax_moe.backends.ranks import distributed_client

  return distributed_client("jax_moe.distributed")


def is_initialized() -> bool:
  try:
    _client()
  except ValueError:
    return False
  return True


def barrier(name: str, timeout_s: int = 120) -> None:
  """Waits for every process at the coordinator (no device collective); alone, returns."""
  if is_initialized():
    _client().wait_at_barrier(f"jax_moe/{name}", timeout_s * 1000)


def is_primary() -> bool:
  import jax

  return jax.process_index() == 0


def global_mesh(axis: str = "ep", devices=None):
  """Every device of every process (jax.devices()) on one axis, in process order."""
  import jax
  import numpy as np

  devices = list(devices) if devices is not None else jax.devices()
  devices = sorted(devices, key=lambda d: (d.process_index, d.id))
  return jax.sharding.Mesh(np.array(devices), (axis,))


def processes_summary() -> str:
  """One line: this process among the others, and the devices of each process."""
  import jax

  counts = {}
  for device in jax.devices():
    counts[device.process_index] = counts.get(device.process_index, 0) + 1
  per = ", ".join(f"{p}: {n}" for p, n in sorted(counts.items()))
  return (f"process {jax.process_index()} of {jax.process_count()} "
          f"(devices per process {{{per}}}, {len(jax.devices())} in all, "
          f"{jax.local_device_count()} here)")


def agree(ok: bool, message: str, what: str, timeout_s: int = 120) -> list[tuple[int, str]]:
  """Every process's (process, message) where `ok` was False, the same list in every process.

  Goes through the coordinator's key-value store (no device collective), so a process that
  failed before building anything still reports to the others instead of leaving them
  waiting in a collective. Alone, returns this process's failure or nothing.
  """
  import jax

  if not is_initialized() or jax.process_count() == 1:
    return [] if ok else [(0, message)]
  client = _client()
  me, count = jax.process_index(), jax.process_count()
  client.key_value_set(f"jax_moe/{what}/{me}", "" if ok else (message or "failed"))
  failures = []
  for p in range(count):
    value = client.blocking_key_value_get(f"jax_moe/{what}/{p}", timeout_s * 1000)
    if value:
      failures.append((p, value))
  return failures


def exit_now(code: int) -> None:
  """Ends the process at once: jax.distributed's shutdown (also run at exit) waits for every
  peer at a barrier, for ever with one that died; flush what was printed first."""
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code)


class Liveness:
  """Heartbeats of the job's processes through the key-value store, from a thread.

  `beat()` publishes this process's counter; `stale(after_s)` lists the processes whose
  counter has not moved for `after_s` seconds. A process blocked in a device computation
  keeps beating (the thread runs while it waits); one that died stops. jax.distributed has
  its own heartbeat, but only ends the job after --heartbeat-timeout (100 s by default) and
  without saying where the job stood.
  """

  def __init__(self, name: str = "generate"):
    import jax

    self.client, self.name = _client(), name
    self.me, self.count = jax.process_index(), jax.process_count()
    self._beats = 0
    self._seen = {}  # process -> (last value, time it changed)

  def beat(self) -> None:
    self._beats += 1
    self.client.key_value_set(f"jax_moe/alive/{self.name}/{self.me}", str(self._beats),
                              allow_overwrite=True)

  def stale(self, after_s: float) -> list[int]:
    import time

    now, dead = time.monotonic(), []
    for p in range(self.count):
      if p == self.me:
        continue
      try:
        value = self.client.key_value_try_get(f"jax_moe/alive/{self.name}/{p}")
      except Exception:  # noqa: BLE001 - not published yet
        value = None
      last, since = self._seen.get(p, (None, now))
      if value != last:
        self._seen[p] = (value, now)
      elif now - since > after_s:
        dead.append(p)
    return dead
