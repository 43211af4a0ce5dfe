"""Processes a test starts: a job of one script per argument list, with the free loopback port
and the bounded wait of benchmarks/processes.py (re-exported here for the tests)."""

import subprocess
import sys
import time
from pathlib import Path

from benchmarks.processes import free_loopback_port, wait_all

__all__ = ["free_loopback_port", "launch", "wait_all"]


def launch(script: Path, folder: Path, argvs, env, timeout_s: float, cwd=None, hosts=None):
    """Runs `python script *argv` for every argv at once (cwd: `folder` unless given), each
    with its stdout and stderr in `folder`; returns [(exit code, or None if killed at the
    limit, stdout, stderr)] and the seconds each ran (None if killed). hosts[i]: the host
    process i stands for (JAX_MOE_HOST_GROUP; None: the machine's)."""
    folder.mkdir(parents=True, exist_ok=True)
    processes, files = [], []
    started = time.monotonic()
    for i, argv in enumerate(argvs):
        out, err = open(folder / f"stdout{i}.txt", "w"), open(folder / f"stderr{i}.txt", "w")
        files += [out, err]
        own = env if hosts is None else dict(env, JAX_MOE_HOST_GROUP=hosts[i])
        processes.append(subprocess.Popen([sys.executable, str(script), *argv],
                                          cwd=cwd or folder, env=own, stdout=out, stderr=err,
                                          stdin=subprocess.DEVNULL))
    ended = {}
    deadline = started + timeout_s
    while len(ended) < len(processes) and time.monotonic() < deadline:
        for i, p in enumerate(processes):
            if i not in ended and p.poll() is not None:
                ended[i] = time.monotonic() - started
        time.sleep(0.05)
    codes = wait_all(processes, 0.1)
    for f in files:
        f.close()
    results = [(code, (folder / f"stdout{i}.txt").read_text(errors="replace"),
                (folder / f"stderr{i}.txt").read_text(errors="replace"))
               for i, code in enumerate(codes)]
    return results, [ended.get(i) for i in range(len(processes))]
