"""support.threads, which the close() checks rely on: jax_moe's threads are found by name."""

import ctypes
import threading

from support.threads import native_started_since, native_thread_names, still_running, threads

_libc = ctypes.CDLL(None)
_libc.pthread_self.restype = ctypes.c_ulong
_libc.pthread_setname_np.argtypes = [ctypes.c_ulong, ctypes.c_char_p]


def start_thread(name=None):
    """A thread that waits on the returned event, named `name` by the system if given."""
    stop, named = threading.Event(), threading.Event()

    def body():
        if name:
            _libc.pthread_setname_np(_libc.pthread_self(), name.encode())
        named.set()
        stop.wait()

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    named.wait(5.0)
    return thread, stop


def test_the_native_layer_names_its_threads():
    assert native_thread_names() == {"jaxmoe-fabric", "jaxmoe-proxy"}


def test_a_native_thread_is_seen_until_it_is_joined():
    before = threads()
    ours, stop_ours = start_thread("jaxmoe-fabric")
    other, stop_other = start_thread()  # not jax_moe's: gRPC's or XLA's, say
    try:
        started = native_started_since(before)
        assert set(started) == {ours.native_id}
        assert still_running(started, wait_s=0.1) == started  # it still waits on its event
    finally:
        stop_ours.set()
        ours.join()
    try:
        assert still_running(started, wait_s=1.0) == {}  # the other thread still runs
        assert other.native_id in threads()
    finally:
        stop_other.set()
        other.join()
