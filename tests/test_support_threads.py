"""support.threads, which the close() checks rely on, tells threads apart by id."""

import threading

from support.threads import started_since, still_running, threads


def test_a_started_thread_is_seen_until_it_is_joined():
    before = threads()
    stop = threading.Event()
    worker = threading.Thread(target=stop.wait, daemon=True)
    worker.start()
    try:
        started = started_since(before)
        assert worker.native_id in started
        assert still_running(started, wait_s=0.1) == started  # it still waits on the event
    finally:
        stop.set()
        worker.join()
    assert still_running(started, wait_s=1.0) == {}


def test_a_thread_started_by_someone_else_is_not_counted_as_left():
    started = started_since(threads())  # none of ours
    stop = threading.Event()
    other = threading.Thread(target=stop.wait, daemon=True)
    other.start()
    try:
        assert still_running(started, wait_s=0.1) == {}
        assert other.native_id in threads()
    finally:
        stop.set()
        other.join()
