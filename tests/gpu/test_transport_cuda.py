"""The TransferEngine with device memory (FI_HMEM): writes from and into CUDA buffers.

Runs where this libfabric registers CUDA memory with the provider (JAX_MOE_TEST_HMEM_PROVIDER,
default shm): Debian's libfabric does not; benchmarks/build_libfabric_cuda.sh builds one that
does (gpu_run.sh's hmemcuda step puts it first on LD_LIBRARY_PATH). No stream waits for these
rows, so shm may move them with its blocking CUDA copies (settings.HMEM_PROVIDERS says why the
cuda proxies refuse shm for this). Each write's destination is poisoned before it, and the
source of a device write is checked unchanged.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_moe import transport
from jax_moe.backends import host_remote

pytestmark = pytest.mark.gpu

PROVIDER = os.environ.get("JAX_MOE_TEST_HMEM_PROVIDER", "shm")
NODE = "127.0.0.1" if PROVIDER.startswith("tcp") else ""
POISON = 0xA5


def device_array(values):
    return jax.device_put(jnp.asarray(values, jnp.uint8), jax.devices("gpu")[0])


@pytest.mark.parametrize("src_on_gpu, dst_on_gpu", [(True, True), (True, False), (False, True)])
def test_writes_between_device_and_host_memory(src_on_gpu, dst_on_gpu):
    if not host_remote.available() or not transport.registers_cuda_memory(PROVIDER, NODE):
        pytest.skip(f"this libfabric cannot register CUDA memory with {PROVIDER}")
    rng = np.random.default_rng()
    size = 3 * 65536 + 17  # past shm's inject and bounce-buffer sizes, not a multiple of 16
    values = rng.integers(0, 256, size, dtype=np.uint8)
    make = lambda on_gpu, data: device_array(data) if on_gpu else data.copy()
    with transport.TransferEngine(0, provider=PROVIDER, node=NODE, timeout_s=10.0,
                                  cuda_memory=True) as e, \
            transport.TransferEngine(1, provider=PROVIDER, node=NODE, timeout_s=10.0,
                                     cuda_memory=True) as peer:
        for engine in (e, peer):
            engine.add_peer(e.address)
            engine.add_peer(peer.address)
        source = make(src_on_gpu, values)
        dest = make(dst_on_gpu, np.full(size + 64, POISON, np.uint8))
        register = lambda engine, a: (engine.register_device(a) if isinstance(a, jax.Array)
                                      else engine.register(a))
        src_region, dst_region = register(e, source), register(peer, dest)
        group = e.create_group([(1, dst_region.descriptor)])
        e.scatter(group, src_region, [0], [size], [32], tag=6)
        peer.wait(6, {0: 1})
        e.flush()
        landed = np.asarray(dest)  # after the write: a jax.Array's host copy is made now
        np.testing.assert_array_equal(landed[32:32 + size], values)
        assert (landed[:32] == POISON).all() and (landed[32 + size:] == POISON).all()
        np.testing.assert_array_equal(np.asarray(source), values)
