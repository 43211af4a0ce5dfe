"""Shared pytest setup: eight host devices, the `gpu` marker, meshes, backends, RNG."""

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


@pytest.fixture
def mesh_of():
    return make_mesh


@pytest.fixture
def rng(request):
    """Random but reproducible: seeded from the test's node id, fresh for every test."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))
