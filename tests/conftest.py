"""Shared pytest setup: eight host devices, the `gpu` marker, meshes, backends, RNG, and
compiled programs released after each test module."""

import gc
import os
import zlib

# JAX reads XLA_FLAGS once, when its CPU client starts: set it before anything imports jax.
_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count=8"
if _DEVICE_COUNT_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _DEVICE_COUNT_FLAG).strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from support.meshes import make_mesh  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped where none is present")


def _cuda_device_present():
    try:
        return len(jax.devices("cuda")) > 0
    except RuntimeError:
        return False


def pytest_collection_modifyitems(config, items):
    # The marker itself: item.keywords also holds folder names, so tests/gpu/ would match.
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if gpu_items and not _cuda_device_present():
        skip = pytest.mark.skip(reason="no CUDA device present")
        for item in gpu_items:
            item.add_marker(skip)


def usable_backends():
    """Backends whose parity tests run here; a new backend joins every test by appearing."""
    import jax_moe as jm

    return list(jm.available_backends())


def pytest_generate_tests(metafunc):
    if "backend" in metafunc.fixturenames:
        metafunc.parametrize("backend", usable_backends())


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drops every compiled program after a test module. XLA:CPU maps each executable's code
    in several memory mappings, and jax keeps an executable as long as its jitted function's
    cache holds it: one pytest process running the whole suite reached the kernel's limit of
    65530 mappings (vm.max_map_count; tests/models/test_two_batch_overlap.py alone leaves
    ~19000), the next compile failed, its C++ exception's unwinding took a signal inside
    libgcc's unwinder, and the handler (libinfinipath's, loaded with libfabric's psm
    provider) called backtrace(), which waits forever on the lock the unwinder held: CI hung
    at the same test twice (gdb at b01e48c). Programs a later module
    needs are compiled again (seconds). A module that still leaves more than half the limit
    mapped fails here rather than hanging a later one."""
    yield
    jax.clear_caches()
    gc.collect()
    if os.path.exists("/proc/self/maps"):
        with open("/proc/self/maps") as maps:
            mapped = sum(1 for _ in maps)
        if mapped > _MAX_MAPPINGS_AFTER_MODULE:
            pytest.fail(f"{mapped} memory mappings remain after this module's compiled programs "
                        f"were released (more than {_MAX_MAPPINGS_AFTER_MODULE}; the kernel "
                        "allows 65530): something keeps executables alive")


_MAX_MAPPINGS_AFTER_MODULE = 32000


@pytest.fixture
def mesh_of():
    return make_mesh


@pytest.fixture
def rng(request):
    """Random but reproducible: seeded from the test's node id, fresh for every test."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))
