"""Fixtures of the model tests: the expert-parallel mesh and f32 matmuls at full precision."""

import jax
import numpy as np
import pytest


@pytest.fixture
def ep_mesh():
  """All devices of the default platform, at most 8, on one axis "ep" (8 CPU devices here,
  the GPUs on a GPU machine)."""
  devices = jax.devices()[:8]
  return jax.sharding.Mesh(np.array(devices), ("ep",))


@pytest.fixture(autouse=True)
def _highest_matmul_precision():
  """f32 parity with torch needs true f32 dots: XLA:GPU would otherwise use TF32."""
  with jax.default_matmul_precision("highest"):
    yield
