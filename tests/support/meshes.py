"""Device meshes for the tests: one axis "ep" over the first n devices."""

import jax
import numpy as np
import pytest


def make_mesh(n):
    """1-D mesh named "ep" over the first n devices; skips the test where fewer exist."""
    devices = jax.devices()
    if len(devices) < n:
        pytest.skip(f"needs {n} devices, {len(devices)} present")
    return jax.sharding.Mesh(np.array(devices[:n]), ("ep",))
