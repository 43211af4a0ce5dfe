"""Setup of near ranks (other processes of one host: buffers in POSIX shared memory, mapped by
each; ffi/host/state.h) used in a wrong order or with wrong arguments: clear errors, and no
name left in /dev/shm. Two rank states of one process stand for the two processes here; the
exchange itself runs between processes in gpu/test_multiprocess.py (the jobs with hosts)."""

import itertools
import os

import jax.numpy as jnp
import pytest

import jax_moe as jm
from jax_moe import native
from jax_moe.backends.native_backend import moe_dims

_comm_ids = itertools.count(2_000_000)  # far from the Communicators' own counter
CFG = jm.MoEConfig(num_experts=4, experts_per_token=2, hidden=128, max_tokens=4,
                   dispatch_dtype=jnp.bfloat16)


def shm_path(name):
    return "/dev/shm/" + name.lstrip("/")


@pytest.fixture
def pair():
    """Ranks 0 and 1 of a 2-rank communicator (ordinals 0 and 1), both with shared buffers."""
    module = native.load()
    comm_id = next(_comm_ids)
    for rank in (0, 1):
        module.host_create_rank(comm_id=comm_id, ordinal=rank, dims=moe_dims(CFG, 2, rank=rank),
                                timeout_s=2.0, shared=True)
    yield module, comm_id
    for rank in (0, 1):
        module.host_destroy_rank(comm_id, rank)


def test_near_ranks_map_each_other_and_leave_no_name(pair):
    module, comm_id = pair
    names = [module.host_shared_name(comm_id, rank) for rank in (0, 1)]
    assert len(set(names)) == 2 and all(os.path.exists(shm_path(n)) for n in names)
    module.host_map_near(comm_id, 0, 1, names[1])
    module.host_map_near(comm_id, 1, 0, names[0])
    for rank in (0, 1):
        module.host_unlink_shared(comm_id, rank)
    assert not any(os.path.exists(shm_path(n)) for n in names)
    module.host_connect_rank(comm_id, 0, [0, -1])  # -1: rank 1 is near, not remote
    module.host_connect_rank(comm_id, 1, [-1, 1])
    with pytest.raises(ValueError, match="is not shared"):
        module.host_shared_name(comm_id, 0)  # its name was removed


def test_bad_near_setup_is_refused(pair):
    module, comm_id = pair
    name = module.host_shared_name(comm_id, 1)
    for bad in (0, 2, -1):
        with pytest.raises(ValueError, match="must be another rank in \\[0, 2\\)"):
            module.host_map_near(comm_id, 0, bad, name)
    with pytest.raises(RuntimeError, match="shm_open of shared memory '/jax_moe.none'"):
        module.host_map_near(comm_id, 0, 1, "/jax_moe.none")
    module.host_map_near(comm_id, 0, 1, name)
    with pytest.raises(ValueError, match="mapped once"):
        module.host_map_near(comm_id, 0, 1, name)
    with pytest.raises(ValueError, match="rank 1 has ordinal 1, but it is a near rank"):
        module.host_connect_rank(comm_id, 0, [0, 1])


def test_a_buffer_of_other_dims_is_refused():
    module = native.load()
    comm_id = next(_comm_ids)
    other = jm.MoEConfig(num_experts=4, experts_per_token=2, hidden=256, max_tokens=4,
                         dispatch_dtype=jnp.bfloat16)
    module.host_create_rank(comm_id=comm_id, ordinal=0, dims=moe_dims(CFG, 2, rank=0),
                            timeout_s=2.0, shared=True)
    module.host_create_rank(comm_id=comm_id, ordinal=1, dims=moe_dims(other, 2, rank=1),
                            timeout_s=2.0, shared=True)
    try:
        with pytest.raises(RuntimeError, match="MoEConfig or world differ"):
            module.host_map_near(comm_id, 0, 1, module.host_shared_name(comm_id, 1))
    finally:
        names = [module.host_shared_name(comm_id, rank) for rank in (0, 1)]
        for rank in (0, 1):
            module.host_destroy_rank(comm_id, rank)
    assert not any(os.path.exists(shm_path(n)) for n in names)  # removed with the states


def test_a_private_buffer_has_no_name():
    module = native.load()
    comm_id = next(_comm_ids)
    module.host_create_rank(comm_id=comm_id, ordinal=0, dims=moe_dims(CFG, 2, rank=0),
                            timeout_s=2.0)
    try:
        with pytest.raises(ValueError, match="is not shared"):
            module.host_shared_name(comm_id, 0)
    finally:
        module.host_destroy_rank(comm_id, 0)
