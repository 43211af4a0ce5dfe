"""The threads jax_moe's native layer started, and whether closing their owner ended them.

jax_moe names its threads (ffi/thread_names.h, `build_info()["thread_names"]`), and these
helpers look only at those: gRPC (under jax.distributed) and XLA start and reap threads of
their own at any time, so counting the process's threads could not say whether close() ended
ours (a CI run once saw 39 threads before a communicator, 44 with it, 40 after its close(),
one of them not jax_moe's). A joined thread may take a moment to leave /proc, hence the wait.
"""

import os
import time
from pathlib import Path

import jax_moe as jm


def native_thread_names():
    """The names jax_moe's native threads take (the values of build_info()["thread_names"])."""
    return set(jm.build_info()["thread_names"].values())


def threads():
    """This process's threads: {thread id: name}. One that exits while it is read is left out."""
    found = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            found[int(tid)] = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
        except OSError:
            pass
    return found


def native_started_since(before):
    """{id: name} of jax_moe's threads that run now and did not in `before` (threads())."""
    names = native_thread_names()
    return {tid: name for tid, name in threads().items() if tid not in before and name in names}


def still_running(started, wait_s=5.0):
    """{id: name} of the threads in `started` that still run after up to wait_s seconds."""
    deadline = time.monotonic() + wait_s
    while True:
        left = {tid: name for tid, name in threads().items() if tid in started}
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)
