"""TransferEngine (ffi/transport/) between processes on loopback, over shm and tcp;ofi_rxm.

Workers (tests/transport_worker.py) run in spawned processes; their results are compared with
a numpy reference built from the same random plan. Every wait is bounded: workers use short
engine timeouts and the parent gives up on a silent worker after PIPE_TIMEOUT_S.
"""

import multiprocessing as mp
import os
import signal
import time
import types

import jax.numpy as jnp
import numpy as np
import pytest

import transport_worker as worker
import jax_moe as jm
from jax_moe import transport
from support.threads import native_started_since, still_running, threads

pytestmark = pytest.mark.skipif(
    not transport.available(),
    reason="jax_moe._native was built without libfabric (pkg-config found no libfabric)")

PROVIDERS = {"shm": None, "tcp;ofi_rxm": "127.0.0.1"}  # provider -> source node
PIPE_TIMEOUT_S = 40.0


class Job:
    """`world` spawned workers running one scenario; the parent relays the address cards."""

    def __init__(self, scenario, world, provider, shuffle_seed=0, seed=0, rounds=1, timeout_s=5.0,
                 domains=None):
        """`domains`: each rank's list of domain names (rails), or None for one rail each."""
        ctx = mp.get_context("spawn")
        self.pipes, self.procs = [], []
        for rank in range(world):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=worker.main, daemon=True,
                args=(scenario, rank, world, child, provider, PROVIDERS[provider], shuffle_seed,
                      seed, rounds, timeout_s, domains[rank] if domains else ()))
            proc.start()
            self.pipes.append(parent)
            self.procs.append(proc)
        self.cards = [self.recv(rank) for rank in range(world)]
        for pipe in self.pipes:
            pipe.send(self.cards)

    def recv(self, rank):
        if not self.pipes[rank].poll(PIPE_TIMEOUT_S):
            pytest.fail(f"worker {rank} sent nothing within {PIPE_TIMEOUT_S} s")
        message = self.pipes[rank].recv()
        if isinstance(message, tuple) and message and message[0] == "worker error":
            pytest.fail(message[1])
        return message

    def close(self, killed=()):
        """Joins every worker; all must exit 0 but the ranks in `killed` (SIGKILL)."""
        for proc in self.procs:
            proc.join(timeout=10)
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        expected = [-signal.SIGKILL if rank in killed else 0 for rank in range(len(self.procs))]
        assert [proc.exitcode for proc in self.procs] == expected


def run_job(scenario, world, provider, **kwargs):
    job = Job(scenario, world, provider, **kwargs)
    try:
        results = [job.recv(rank) for rank in range(world)]
    finally:
        job.close()
    return results


def check_scatter(results, seed, world, rounds):
    """Every rank's snapshots against the numpy reference; returns each rank's rail_writes."""
    for rank, (snapshots, _) in enumerate(results):
        assert len(snapshots) == rounds
        for r, got in enumerate(snapshots):
            expected = worker.expected_destination(seed, r, rank, world)
            np.testing.assert_array_equal(got, expected, err_msg=f"rank {rank}, round {r}")
    return [rail_writes for _, rail_writes in results]


@pytest.mark.parametrize("provider,world", [("shm", 2), ("shm", 4), ("tcp;ofi_rxm", 2),
                                            ("tcp;ofi_rxm", 4)])
def test_scatter_matches_numpy(provider, world):
    seed = int.from_bytes(os.urandom(4), "little")
    results = run_job("scatter", world, provider, seed=seed, rounds=4)
    check_scatter(results, seed, world, rounds=4)


@pytest.mark.parametrize("provider", list(PROVIDERS))
def test_shuffled_completions_give_the_same_result(provider):
    seed = int.from_bytes(os.urandom(4), "little")
    plain = run_job("scatter", 3, provider, seed=seed, rounds=3)
    shuffled = run_job("scatter", 3, provider, seed=seed, rounds=3, shuffle_seed=seed | 1)
    check_scatter(shuffled, seed, 3, rounds=3)
    for (a, _), (b, _) in zip(plain, shuffled):
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)


def loopback_domain(provider):
    """The domain a provider opens on loopback here ("shm"; "lo" for tcp on 127.0.0.1)."""
    with engine(provider=provider) as probe:
        return probe.facts["domains"][0]


@pytest.mark.parametrize("provider", list(PROVIDERS))
def test_peers_are_sharded_across_rails(provider):
    """Ranks with 2, 1 and 3 rails (endpoints on one loopback domain, standing in for NICs):
    every byte lands as with one rail, and rank r posts to peer p on its rail (r + p) % rails,
    into the peer's rail (r + p) % its rails (the keys of that rail)."""
    world, rounds, rails = 3, 3, [2, 1, 3]
    domain = loopback_domain(provider)
    seed = int.from_bytes(os.urandom(4), "little")
    results = run_job("scatter", world, provider, seed=seed, rounds=rounds,
                      domains=[[domain] * n for n in rails])
    rail_writes = check_scatter(results, seed, world, rounds)
    for rank, writes in enumerate(rail_writes):
        expected = [0] * rails[rank]
        for peer in range(world):  # a round is one scatter write and one barrier write
            expected[(rank + peer) % rails[rank]] += 2 * rounds
        assert writes == expected, f"rank {rank}"


@pytest.mark.parametrize("provider", list(PROVIDERS))
def test_counters_complete_at_the_expected_count(provider):
    world = 3
    results = run_job("counters", world, provider, shuffle_seed=99)
    for rank, (left, received) in enumerate(results):
        assert left == [0] * world, f"rank {rank}: unconsumed immediates {left}"
        # Every source s wrote bytes [8*rank, +8) of its arange into this rank's slot s.
        expected = np.concatenate([np.arange(8 * rank, 8 * rank + 8, dtype=np.uint8)] * world)
        np.testing.assert_array_equal(received, expected, err_msg=f"rank {rank}")


@pytest.mark.parametrize("scenario", ["stall", "killed"])
@pytest.mark.parametrize("provider", list(PROVIDERS))
def test_missing_peer_times_out_naming_it(provider, scenario):
    # The last rank either stays alive but never sends ("stall") or is SIGKILLed ("killed");
    # every survivor's barrier must fail within the timeout (+5 s), naming it.
    world, timeout_s = 3, 1.0
    missing = world - 1
    job = Job(scenario, world, provider, timeout_s=timeout_s)
    try:
        reports = [job.recv(rank) for rank in range(missing)]
        if scenario == "stall":
            job.pipes[missing].send("release")
    finally:
        job.close(killed=(missing,) if scenario == "killed" else ())
    for rank, (message, elapsed) in enumerate(reports):
        assert message.startswith(f"TransportError: rank {rank}, barrier:"), message
        assert f"rank {missing} sent 0 of 1" in message, message
        assert elapsed < timeout_s + 5, f"rank {rank} took {elapsed:.1f} s"


def test_shm_without_cross_memory_attach(monkeypatch):
    # Where ptrace is restricted, process_vm_readv fails and shm must work without CMA.
    monkeypatch.setenv("FI_SHM_DISABLE_CMA", "1")
    seed = int.from_bytes(os.urandom(4), "little")
    results = run_job("scatter", 2, "shm", seed=seed, rounds=2)
    check_scatter(results, seed, 2, rounds=2)


@pytest.mark.parametrize("provider", list(PROVIDERS))
def test_wrong_key_is_a_clear_error(provider):
    job = Job("bad_key", 2, provider, timeout_s=3.0)
    try:
        job.pipes[0].send(job.cards[1][1])
        message, elapsed = job.recv(0)
        job.pipes[1].send("release")
        receiver_report, receiver_sum = job.recv(1)
    finally:
        job.close()
    assert "TransportError" in message and "rank 1 sent 0 of 1" in message, message
    assert elapsed < 3.0 + 5, f"took {elapsed:.1f} s"
    assert receiver_sum == 0, "a write with a wrong key changed the receiver's memory"
    assert receiver_report == "no error", receiver_report


# ---- one process ------------------------------------------------------------------------------


def engine(rank=0, provider="shm", **kwargs):
    return transport.TransferEngine(rank, provider=provider, node=PROVIDERS[provider],
                                    timeout_s=2.0, **kwargs)


@pytest.mark.parametrize("provider", list(PROVIDERS))
def test_close_leaves_no_threads_or_registrations(provider):
    before = threads()
    e = engine(provider=provider)
    started = native_started_since(before)
    assert started  # the progress thread
    regions = [e.register(np.zeros(n, np.uint8)) for n in (1, 100, 4096)]
    assert e.open_regions() == 1 + len(regions)  # plus the signal region
    e.deregister(regions[0])
    assert e.open_regions() == len(regions)
    e.close()
    assert e.open_regions() == 0
    assert not still_running(started)
    e.close()  # idempotent
    with pytest.raises(transport.TransportError, match="closed"):
        e.register(np.zeros(8, np.uint8))


def test_self_scatter_and_barrier_in_one_engine():
    with engine() as e:
        e.add_peer(e.address)
        dest = e.register(np.zeros(64, np.uint8))
        src = e.register(np.arange(64, dtype=np.uint8))
        group = e.create_group([(0, dest.descriptor)])
        e.scatter(group, src, [10], [20], [30], tag=4)
        e.wait(4, {0: 1})
        e.flush()
        expected = np.zeros(64, np.uint8)
        expected[30:50] = np.arange(10, 30)
        np.testing.assert_array_equal(dest.array, expected)
        e.barrier(group, tag=5)
        assert e.arrived(4, 0) == 0 and e.arrived(5, 0) == 0


@pytest.mark.parametrize("provider", list(PROVIDERS))
def test_many_writes_in_flight_all_complete(provider):
    """One scatter of 20000 one-byte writes (more than a transmit queue or a completion queue
    holds): posting waits for completions and none is lost, so every byte lands and every
    write is counted."""
    n = 20000
    with engine(provider=provider) as e:
        e.add_peer(e.address)
        dest = e.register(np.zeros(2 * n, np.uint8))
        src = e.register((np.arange(2 * n) % 251).astype(np.uint8))
        group = e.create_group([(0, dest.descriptor)] * n)
        offsets = list(range(0, 2 * n, 2))
        e.scatter(group, src, offsets, [1] * n, offsets, tag=6)
        e.wait(6, {0: n})
        e.flush()
        expected = np.zeros(2 * n, np.uint8)
        expected[0::2] = src.array[0::2]
        np.testing.assert_array_equal(dest.array, expected)


def test_bad_addresses_and_descriptors_are_clear_errors():
    with engine() as e:
        dest = e.register(np.zeros(64, np.uint8))
        with pytest.raises(transport.TransportError, match="is not an engine address"):
            e.add_peer(b"garbage")
        with pytest.raises(transport.TransportError, match="is not an engine address"):
            e.add_peer(dest.descriptor)
        with pytest.raises(transport.TransportError, match="truncated"):
            e.add_peer(e.address[:-3])
        with pytest.raises(transport.TransportError, match="trailing"):
            e.add_peer(e.address + b"x")
        with pytest.raises(transport.TransportError, match="never added with add_peer"):
            e.create_group([(7, dest.descriptor)])
        e.add_peer(e.address)
        with pytest.raises(transport.TransportError, match="is not a region descriptor"):
            e.create_group([(0, e.address)])
        with engine(rank=1, provider="tcp;ofi_rxm") as other:
            with pytest.raises(transport.TransportError, match="provider 'tcp;ofi_rxm'.*uses 'shm'"):
                e.add_peer(other.address)


def test_altered_misattributed_or_stale_descriptors_are_rejected():
    with engine() as e, engine(rank=1) as peer:
        e.add_peer(peer.address)
        descriptor = peer.register(np.zeros(64, np.uint8)).descriptor
        corrupted = bytearray(descriptor)
        corrupted[36] ^= 1  # one bit of the key (wire.h: keys from byte 34)
        with pytest.raises(transport.TransportError, match="fails its checksum"):
            e.create_group([(1, bytes(corrupted))])
        e.add_peer(e.address)
        with pytest.raises(transport.TransportError, match="member 0 .rank 0. belongs to rank 1"):
            e.create_group([(0, descriptor)])
        with engine(rank=1) as restarted:
            e.add_peer(restarted.address)
            with pytest.raises(transport.TransportError, match="is stale"):
                e.create_group([(1, descriptor)])


def test_scatter_arguments_are_checked():
    with engine() as e:
        e.add_peer(e.address)
        dest = e.register(np.zeros(64, np.uint8))
        src = e.register(np.zeros(32, np.uint8))
        group = e.create_group([(0, dest.descriptor)])
        with pytest.raises(transport.TransportError, match="2 slices for a group of 1"):
            e.scatter(group, src, [0, 0], [1, 1], [0, 0], tag=1)
        with pytest.raises(transport.TransportError, match="slice 0 reads .* past the source"):
            e.scatter(group, src, [16], [17], [0], tag=1)
        with pytest.raises(transport.TransportError, match="past rank 0's destination region of 64"):
            e.scatter(group, src, [0], [16], [50], tag=1)
        with pytest.raises(transport.TransportError, match="tag 1048576 exceeds"):
            e.scatter(group, src, [0], [1], [0], tag=1 << 20)
        with pytest.raises(transport.TransportError, match="no peer group 3"):
            e.barrier(transport.PeerGroup(3, (0,)), tag=1)
        with pytest.raises(ValueError, match="rank must be in"):
            engine(rank=4096)
        with pytest.raises(ValueError, match="C-contiguous"):
            e.register(np.zeros((8, 8), np.uint8)[:, ::2])
        for not_on_one_gpu in (np.zeros(8, np.uint8), jnp.zeros(8, jnp.uint8)):
            with pytest.raises(ValueError, match="a non-empty jax.Array on one GPU"):
                e.register_device(not_on_one_gpu)
        if not jm.build_info()["cuda"]:
            with pytest.raises(transport.TransportError, match="cuda_memory needs a build with CUDA"):
                engine(cuda_memory=True)
        with pytest.raises(transport.TransportError, match="no provider-x"):
            transport.TransferEngine(0, provider="no provider-x", timeout_s=1.0)
        unknown = r"no domain 'no-nic-x' \(domains\[1\]\).*offers 'shm'"
        with pytest.raises(transport.TransportError, match=unknown):
            engine(domains=["shm", "no-nic-x"])
        with pytest.raises(ValueError, match="at most 16 non-empty domain names"):
            engine(domains=["shm"] * 17)
        with pytest.raises(ValueError, match="non-empty domain names"):
            engine(domains=["shm", ""])


@pytest.mark.skipif(not jm.build_info()["cuda"], reason="CUDA registrations need a CUDA build")
def test_cuda_registration_names_a_libfabric_built_without_cuda():
    # Debian's libfabric (CI's and the GPU machines') is built without CUDA: shm grants FI_HMEM,
    # then refuses every CUDA registration before it looks at the pointer, so a host buffer
    # posing as a GPU array reaches that refusal here.
    with engine(cuda_memory=True) as e:
        assert e.facts["cuda_memory"]
        buffer = np.zeros(64, np.uint8)
        gpu = types.SimpleNamespace(platform="gpu", local_hardware_id=0)
        posing = types.SimpleNamespace(devices=lambda: [gpu], nbytes=buffer.nbytes,
                                       unsafe_buffer_pointer=lambda: buffer.ctypes.data)
        expected = (r"cannot register CUDA memory with provider shm \(fi_mr_regattr: .*built "
                    r"without CUDA support\).*JAX_MOE_PROXY_HMEM=off")
        regions = e.open_regions()
        with pytest.raises(transport.TransportError, match=expected):
            e.register_device(posing)
        assert e.open_regions() == regions
    assert transport.registers_cuda_memory("shm") is False  # no GPU here, and no CUDA support


def test_rails_in_one_engine():
    """Two rails of one engine to itself: the self peer is on rail (0 + 0) % 2 = 0, a rank-1
    engine with three rails is reached on rail 1 and writes back on its rail 1; descriptors and
    cards carry every rail's key and name, and a card's rails must match its descriptors."""
    with engine(domains=["shm", "shm"]) as e, engine(rank=1, domains=["shm"] * 3) as peer:
        assert e.facts["domains"] == ["shm", "shm"] and len(peer.facts["domains"]) == 3
        e.add_peer(e.address)
        e.add_peer(peer.address)
        peer.add_peer(e.address)
        dest = e.register(np.zeros(64, np.uint8))
        peer_dest = peer.register(np.zeros(64, np.uint8))
        src = e.register(np.arange(64, dtype=np.uint8))
        to_self = e.create_group([(0, dest.descriptor)])
        to_peer = e.create_group([(1, peer_dest.descriptor)])
        e.scatter(to_self, src, [0], [8], [0], tag=4)
        e.scatter(to_peer, src, [8], [8], [8], tag=4)
        e.wait(4, {0: 1})
        peer.wait(4, {0: 1})
        e.flush()
        np.testing.assert_array_equal(dest.array[:8], np.arange(8))
        np.testing.assert_array_equal(peer_dest.array[8:16], np.arange(8, 16))
        assert e.rail_writes() == [1, 1]
        back = peer.create_group([(0, dest.descriptor)])
        peer.scatter(back, peer.register(np.full(8, 7, np.uint8)), [0], [8], [16], tag=5)
        e.wait(5, {1: 1})
        peer.flush()
        assert peer.rail_writes() == [0, 1, 0]
        np.testing.assert_array_equal(dest.array[16:24], np.full(8, 7))
        with engine(rank=1) as one_rail:  # same rank, other engine: its descriptors are stale
            with pytest.raises(transport.TransportError, match="is stale"):
                e.create_group([(1, one_rail.register(np.zeros(8, np.uint8)).descriptor)])


def _closed_tcp_peer(e):
    """(group, source region) of `e` towards a tcp;ofi_rxm peer (rank 1) closed before `e`
    ever reached it: no write to it is ever accepted."""
    gone = engine(rank=1, provider="tcp;ofi_rxm")
    descriptor = gone.register(np.zeros(64, np.uint8)).descriptor
    address = gone.address
    gone.close()
    e.add_peer(address)
    return e.create_group([(1, descriptor)]), e.register(np.ones(64, np.uint8))


def test_posting_gives_up_at_the_callers_timeout_not_the_engines():
    """A closed peer's transmit queue stays full: scatter and barrier give up after their own
    timeout_s, for all their writes together, though the engine's own bound is 30 s."""
    e = transport.TransferEngine(0, provider="tcp;ofi_rxm", node=PROVIDERS["tcp;ofi_rxm"],
                                 timeout_s=30.0)
    try:
        group, src = _closed_tcp_peer(e)
        for post in (lambda: e.scatter(group, src, [0], [64], [0], tag=3, timeout_s=0.5),
                     lambda: e.barrier(group, tag=4, timeout_s=0.5)):
            start = time.monotonic()
            with pytest.raises(transport.TransportError, match=r"rank 1 .*stayed full for 0.5 s"):
                post()
            assert time.monotonic() - start < 0.5 + 3
    finally:
        e.close()


def test_closed_peer_is_an_error_not_a_hang():
    with engine(provider="tcp;ofi_rxm") as e:
        group, src = _closed_tcp_peer(e)
        start = time.monotonic()
        # tcp;ofi_rxm cannot connect, so the write is never accepted; any provider must
        # end in a TransportError that names the peer.
        with pytest.raises(transport.TransportError, match="rank 1"):
            e.scatter(group, src, [0], [64], [0], tag=2)
            e.flush(timeout_s=1.0)
            e.wait(2, {1: 1}, timeout_s=1.0)
        assert time.monotonic() - start < 1.0 + 5


def test_host_domains_setting(monkeypatch):
    """JAX_MOE_HOST_DOMAINS: the rails of the host backend's and the cuda proxies' engines."""
    from jax_moe import settings

    for text, domains in (("", []), ("shm", ["shm"]), (" shm, lo ", ["shm", "lo"])):
        monkeypatch.setenv("JAX_MOE_HOST_DOMAINS", text)
        assert settings.host_domains() == domains and settings.host_domains(5) == domains
    monkeypatch.setenv("JAX_MOE_HOST_DOMAINS", "a,b;c;d,e")  # one group per local device
    assert [settings.host_domains(i) for i in range(4)] == [["a", "b"], ["c"], ["d", "e"],
                                                           ["a", "b"]]
    for bad in ("shm,,lo", ",", "shm,", "a;", ";b"):
        monkeypatch.setenv("JAX_MOE_HOST_DOMAINS", bad)
        with pytest.raises(ValueError, match="JAX_MOE_HOST_DOMAINS must be comma-separated"):
            settings.host_domains()
