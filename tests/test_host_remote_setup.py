"""Setup of the host backend's remote ranks (ffi/host_fabric/ bindings) used in a wrong order
or with wrong arguments: clear errors, nothing left half-connected. The path itself runs
between processes in gpu/test_multiprocess.py (the host jobs)."""

import itertools

import jax.numpy as jnp
import pytest

import jax_moe as jm
from jax_moe import native
from jax_moe.backends import host_remote
from jax_moe.backends.native_backend import moe_dims

pytestmark = pytest.mark.skipif(not host_remote.available(),
                                reason="jax_moe._native is not built with libfabric")

_comm_ids = itertools.count(1_000_000)  # far from the Communicators' own counter


def create_rank0(module):
    """Rank 0 of a 2-rank host communicator on CPU device 0; returns its comm id."""
    comm_id = next(_comm_ids)
    cfg = jm.MoEConfig(num_experts=4, experts_per_token=2, hidden=128, max_tokens=4,
                       dispatch_dtype=jnp.bfloat16)  # capacity 16
    module.host_create_rank(comm_id=comm_id, ordinal=0, dims=moe_dims(cfg, 2, rank=0),
                            timeout_s=2.0)
    return comm_id


@pytest.fixture
def rank0():
    module = native.load()
    comm_id = create_rank0(module)
    yield module, comm_id
    module.host_destroy_rank(comm_id, 0)


def test_remote_ranks_must_be_other_ranks(rank0):
    module, comm_id = rank0
    for bad in ([0], [2], [1, 1]):
        with pytest.raises(module.TransportError, match=r"is not another rank in \[0, 2\)"):
            module.host_open_remote(comm_id, 0, bad, "shm", "", [], 0)
    module.host_open_remote(comm_id, 0, [1], "shm", "", [], 0)  # nothing was left behind


def test_unknown_provider_is_named(rank0):
    module, comm_id = rank0
    with pytest.raises(module.TransportError, match="no-such-provider"):
        module.host_open_remote(comm_id, 0, [1], "no-such-provider", "", [], 0)


def test_connect_order_is_enforced(rank0):
    module, comm_id = rank0
    # -1 marks a remote or near rank, and rank 1 is neither before host_open_remote.
    with pytest.raises(ValueError, match="rank 1 has ordinal -1, but it is neither a remote nor a near rank"):
        module.host_connect_rank(comm_id, 0, [0, -1])
    card, descriptor, rows = module.host_open_remote(comm_id, 0, [1], "shm", "", [], 0)
    assert rows == b""  # no device rows asked for
    with pytest.raises(ValueError, match="already has its peers"):
        module.host_open_remote(comm_id, 0, [1], "shm", "", [], 0)
    with pytest.raises(ValueError, match="remote ranks not connected yet"):
        module.host_connect_rank(comm_id, 0, [0, -1])
    with pytest.raises(module.TransportError, match="rank 0 is not a remote rank"):
        module.host_connect_remote(comm_id, 0, 0, card, descriptor, rows)
    with pytest.raises(module.TransportError):  # a descriptor is not an address card
        module.host_connect_remote(comm_id, 0, 1, descriptor, descriptor, rows)
    # A peer whose rows land in device memory (JAX_MOE_PROXY_HMEM) needs this rank to send
    # them there with an engine that has FI_HMEM: both ends must agree.
    with pytest.raises(module.TransportError, match="same JAX_MOE_PROXY_HMEM"):
        module.host_connect_remote(comm_id, 0, 1, card, descriptor, b"device rows of rank 1")


def test_remote_setup_needs_a_rank_state_with_remote_peers(rank0):
    module, comm_id = rank0
    with pytest.raises(ValueError, match="no rank state"):
        module.host_open_remote(next(_comm_ids), 0, [1], "shm", "", [], 0)
    with pytest.raises(ValueError, match="no remote peers opened"):
        module.host_connect_remote(comm_id, 0, 1, b"", b"", b"")
