"""Which threads an object started and whether closing it ended them (Linux /proc).

Threads are told apart by id, not counted: JAX and XLA start threads of their own at any
time (a CI run once saw one appear while a communicator closed), and those are not the
object's. A thread that was joined may take a moment to leave /proc, hence the short wait."""

import os
import time
from pathlib import Path


def threads():
    """This process's threads: {thread id: name}. One that exits while it is read is left out."""
    found = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            found[int(tid)] = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
        except OSError:
            pass
    return found


def started_since(before):
    """{id: name} of the threads that run now and did not in `before` (a threads() result)."""
    return {tid: name for tid, name in threads().items() if tid not in before}


def still_running(started, wait_s=5.0):
    """{id: name} of the threads in `started` that still run after up to wait_s seconds."""
    deadline = time.monotonic() + wait_s
    while True:
        left = {tid: name for tid, name in threads().items() if tid in started}
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)
