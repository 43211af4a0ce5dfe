"""Processes of the TransferEngine tests (started with multiprocessing spawn).

Each worker opens an engine, sends (address, destination descriptor) to the parent through a
pipe, receives everyone's, adds them as peers and runs one scenario; the parent compares what
the workers report with a numpy reference built from the same plan.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np

SLOT_BYTES = 512  # each destination reserves one slot per source: no two sources overlap
SOURCE_BYTES = 2048


def scatter_plan(seed: int, round_index: int, source: int, world: int):
    """What `source` sends in one round: its source bytes and one (src_off, len, dst_off) per
    destination, inside the slot that destination reserves for it; some slices are empty."""
    rng = np.random.default_rng((seed, round_index, source))
    data = rng.integers(0, 256, SOURCE_BYTES, dtype=np.uint8)
    lengths = rng.integers(0, SLOT_BYTES + 1, world)
    lengths[rng.random(world) < 0.2] = 0
    src_offsets = [int(rng.integers(0, SOURCE_BYTES - n + 1)) for n in lengths]
    dst_offsets = [source * SLOT_BYTES + int(rng.integers(0, SLOT_BYTES - n + 1)) for n in lengths]
    return data, src_offsets, [int(n) for n in lengths], dst_offsets


def expected_destination(seed: int, round_index: int, dest: int, world: int) -> np.ndarray:
    """The reference: plain numpy copies of every source's slice for `dest`."""
    out = np.zeros(world * SLOT_BYTES, np.uint8)
    for source in range(world):
        data, src_offsets, lengths, dst_offsets = scatter_plan(seed, round_index, source, world)
        n = lengths[dest]
        out[dst_offsets[dest]:dst_offsets[dest] + n] = data[src_offsets[dest]:src_offsets[dest] + n]
    return out


def fnv1a(data: bytes) -> int:
    value = 0xcbf29ce484222325
    for byte in data:
        value = ((value ^ byte) * 0x100000001b3) & (2**64 - 1)
    return value


KEYS_AT = 34  # ffi/transport/wire.h: magic 4 | addr 8 | size 8 | owner 4 | engine id 8 | rails 2


def forge_key(descriptor: bytes) -> bytes:
    """The descriptor with every rail's key wrong and a recomputed checksum (ffi/transport/
    wire.h layout: ... | rails u16 | key u64 x rails | checksum 8)."""
    forged = bytearray(descriptor)
    rails = int.from_bytes(forged[KEYS_AT - 2:KEYS_AT], "little")
    for at in range(KEYS_AT, KEYS_AT + 8 * rails, 8):
        key = int.from_bytes(forged[at:at + 8], "little") ^ 0x5A5A
        forged[at:at + 8] = key.to_bytes(8, "little")
    forged[-8:] = fnv1a(bytes(forged[:-8])).to_bytes(8, "little")
    return bytes(forged)


def _connect(rank, world, conn, provider, node, shuffle_seed, timeout_s, domains):
    from jax_moe import transport

    engine = transport.TransferEngine(rank, provider=provider, node=node, timeout_s=timeout_s,
                                      shuffle_seed=shuffle_seed, domains=domains)
    dest = engine.register(np.zeros(world * SLOT_BYTES, np.uint8))
    conn.send((engine.address, dest.descriptor))
    cards = conn.recv()  # [(address, descriptor)] in rank order
    for address, _ in cards:
        engine.add_peer(address)
    group = engine.create_group([(r, descriptor) for r, (_, descriptor) in enumerate(cards)])
    return engine, dest, group


def run_scatter(rank, world, conn, provider, node, shuffle_seed, seed, rounds, timeout_s,
                domains):
    """Rounds of scatter to every rank (self included), wait, snapshot, zero, barrier; sends
    the snapshots and the writes posted on each rail."""
    engine, dest, group = _connect(rank, world, conn, provider, node, shuffle_seed, timeout_s,
                                   domains)
    source = engine.register(np.zeros(SOURCE_BYTES, np.uint8))
    snapshots = []
    for r in range(rounds):
        data, src_offsets, lengths, dst_offsets = scatter_plan(seed, r, rank, world)
        source.array[:] = data
        engine.scatter(group, source, src_offsets, lengths, dst_offsets, tag=2 * r)
        engine.wait(2 * r, {s: 1 for s in range(world)}, what="scatter")
        snapshots.append(dest.array.copy())
        dest.array[:] = 0
        engine.flush()
        engine.barrier(group, tag=2 * r + 1)
    conn.send((snapshots, engine.rail_writes()))
    engine.close()


def run_counters(rank, world, conn, provider, node, shuffle_seed, seed, rounds, timeout_s,
                domains):
    """Every rank sends `rank + 1` scatters of one tag to every rank; each waits for exactly
    those counts, and reports what is left unconsumed (must be nothing)."""
    engine, dest, group = _connect(rank, world, conn, provider, node, shuffle_seed, timeout_s,
                                   domains)
    source = engine.register(np.arange(world * 8, dtype=np.uint8))
    tag = 5
    for _ in range(rank + 1):
        engine.scatter(group, source, [8 * d for d in range(world)], [8] * world,
                       [8 * rank] * world, tag)
    engine.wait(tag, {s: s + 1 for s in range(world)}, what="counters")
    left = [engine.arrived(tag, s) for s in range(world)]
    engine.flush()
    engine.barrier(group, tag=6)
    conn.send((left, dest.array[:world * 8].copy()))
    engine.close()


def run_stall(rank, world, conn, provider, node, shuffle_seed, seed, rounds, timeout_s,
                domains):
    """Rank world-1 never sends; the others must time out naming it, within the bound."""
    engine, _, group = _connect(rank, world, conn, provider, node, shuffle_seed, timeout_s,
                                   domains)
    if rank == world - 1:
        conn.recv()  # released by the parent once the others reported
        engine.close()
        return
    _report_barrier(engine, group, conn)


def run_killed(rank, world, conn, provider, node, shuffle_seed, seed, rounds, timeout_s,
                domains):
    """Rank world-1 is killed (SIGKILL) after one good round; the others, in their next
    barrier, must time out naming it and close cleanly."""
    engine, _, group = _connect(rank, world, conn, provider, node, shuffle_seed, timeout_s,
                                   domains)
    engine.barrier(group, tag=1)
    if rank == world - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    _report_barrier(engine, group, conn, tag=2)


def _report_barrier(engine, group, conn, tag=1):
    """Sends the parent (message, seconds) of one barrier, then closes the engine."""
    start = time.monotonic()
    try:
        engine.barrier(group, tag=tag)
        conn.send(("no error", time.monotonic() - start))
    except Exception as e:  # noqa: BLE001 - the message goes back to the parent to check
        conn.send((f"{type(e).__name__}: {e}", time.monotonic() - start))
    engine.close()


def run_bad_key(rank, world, conn, provider, node, shuffle_seed, seed, rounds, timeout_s,
                domains):
    """Rank 0 writes to rank 1 with a wrong key (checksum forged, so create_group accepts it);
    the provider drops the write, and rank 0's wait must fail naming rank 1, not hang."""
    engine, dest, _ = _connect(rank, world, conn, provider, node, shuffle_seed, timeout_s,
                                   domains)
    if rank == 1:
        conn.recv()  # stays alive until rank 0 reported
        try:  # the receiver may have seen the rejected write as an error completion
            engine.flush()
            conn.send(("no error", dest.array.sum()))
        except Exception as e:  # noqa: BLE001
            conn.send((f"{type(e).__name__}: {e}", dest.array.sum()))
        engine.close()
        return
    group = engine.create_group([(1, forge_key(conn.recv()))])  # rank 1's descriptor
    source = engine.register(np.ones(64, np.uint8))
    start = time.monotonic()
    try:
        engine.scatter(group, source, [0], [64], [0], tag=3)
        engine.flush()
        engine.wait(3, {1: 1}, timeout_s=0.5, what="bad key probe")  # rank 1 never sends
        conn.send(("no error", time.monotonic() - start))
    except Exception as e:  # noqa: BLE001
        conn.send((f"{type(e).__name__}: {e}", time.monotonic() - start))
    engine.close()


SCENARIOS = {"scatter": run_scatter, "counters": run_counters, "stall": run_stall,
             "killed": run_killed, "bad_key": run_bad_key}


def main(scenario, rank, world, conn, provider, node, shuffle_seed, seed, rounds, timeout_s,
         domains=()):
    try:
        SCENARIOS[scenario](rank, world, conn, provider, node, shuffle_seed, seed, rounds,
                            timeout_s, domains)
    except Exception as e:  # noqa: BLE001 - reported to the parent, which fails the test
        conn.send(("worker error", f"rank {rank}: {type(e).__name__}: {e}"))
        raise
