"""One process of an N-process AllReduce job; tests/gpu/test_all_reduce_multiprocess.py starts N.

Every process drives one device (one rank of the "ep" axis, ranks in process order) and joins
the others through jax.distributed; with the cuda platform the ranks map each other's buffers
through CUDA IPC handles exchanged in the distributed key-value store. Each process draws the
same global inputs from one seed and checks the ranks it holds: the kernels bit for bit
against tests/all_reduce_checks.all_reduce_reference and within its psum bound against
jax.lax.psum, for every dtype, sizes from one element to 64 MiB and every algorithm, then a
fori_loop of calls whose inputs change per rank and step.

  python tests/gpu/all_reduce_worker.py --process-id I --num-processes N --port P --gpu G --out r.json

writes {"ok": bool, "errors": [...], ...} to --out and exits 0 only when ok. --platform cpu runs
the same job where AllReduce falls back to psum (no GPU needed; checks this script itself).
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # all_reduce_checks, checks

from worker_env import configure_environment  # noqa: E402  (imports no jax)

ELEMENTS = (1, 7, 9, 4097, 65_537, 1_048_579)
MAX_BYTES = 64 << 20


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--process-id", type=int, required=True)
    parser.add_argument("--num-processes", type=int, required=True)
    parser.add_argument("--port", type=int, required=True, help="coordinator port on 127.0.0.1")
    parser.add_argument("--gpu", type=int, default=0, help="CUDA device this process uses")
    parser.add_argument("--out", type=Path, required=True, help="result JSON")
    parser.add_argument("--platform", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--seed", type=int, default=20261130)
    return parser.parse_args(argv)


if __name__ == "__main__":
    ARGS = parse_args()
    configure_environment(ARGS)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_moe as jm  # noqa: E402
from support.all_reduce_checks import (DTYPES, all_reduce_reference, assert_all_reduce_exact,  # noqa: E402
                               assert_close_to_psum, random_inputs)
from jax_moe.sharding import shard_map  # noqa: E402
from mp_worker import Barrier, run_worker  # noqa: E402

AXIS = "ep"


def log(text):
    print(f"[all_reduce_worker {jax.process_index()}] {text}", file=sys.stderr, flush=True)


class Job:
    """Programs over the global mesh; returns this process's rank of each result."""

    def __init__(self, mesh):
        self.mesh = mesh
        self.sharding = NamedSharding(mesh, P(AXIS))
        self.rank = [i for i, d in enumerate(mesh.devices.flat)
                     if d.process_index == jax.process_index()][0]

    def run(self, fn, x_r):
        program = jax.jit(shard_map(lambda x: fn(x[0])[None], self.mesh, in_specs=P(AXIS),
                                    out_specs=P(AXIS)))
        x = jax.make_array_from_callback(x_r.shape, self.sharding, lambda index: x_r[index])
        out = program(x)
        return np.asarray(out.addressable_shards[0].data)[0]


def chain(ar, x, steps):
    """steps calls in a fori_loop; the next input is y * 0.5 + (rank + step), exact in f32."""
    def body(step, v):
        rank = jax.lax.axis_index(AXIS).astype(jnp.float32)
        return ar(v) * np.float32(0.5) + (rank + step.astype(jnp.float32))
    return ar(jax.lax.fori_loop(0, steps, body, x))


def chain_reference(x_r, steps):
    for step in range(steps):
        y = all_reduce_reference(x_r)
        x_r = np.stack([y * np.float32(0.5) + np.float32(r + step) for r in range(len(x_r))])
    return all_reduce_reference(x_r)


def run_job(args):
    mesh = Mesh(np.array(jax.devices()), (AXIS,))
    job, R = Job(mesh), mesh.devices.size
    algorithms = ("one_shot", "two_shot", "auto") if args.platform == "cuda" else ("auto",)
    reducers = {a: jm.AllReduce(mesh, AXIS, max_bytes=MAX_BYTES, algorithm=a) for a in algorithms}
    log(f"rank {job.rank} of {R} on {mesh.devices.flat[job.rank]}, algorithms {algorithms}")
    rng = np.random.default_rng(args.seed)  # the same draws in every process
    errors = []

    def expect(check, *check_args):
        try:
            check(*check_args)
        except AssertionError as e:
            errors.append(str(e))

    for dtype in DTYPES:
        for n in ELEMENTS + (MAX_BYTES // dtype.itemsize,):
            x_r = random_inputs(rng, R, (n,), dtype)
            psum = job.run(lambda x: jax.lax.psum(x, AXIS), x_r)
            for name, ar in reducers.items():
                got = job.run(ar, x_r)
                what = f"{dtype.name} n={n} {name} rank {job.rank}"
                if ar.uses_kernels:
                    expect(assert_all_reduce_exact, got, x_r, what)
                expect(assert_close_to_psum, got, psum, x_r, what + " vs psum")
        log(f"{dtype.name}: {len(errors)} errors so far")
    x_r = random_inputs(rng, R, (300_001,), np.dtype(np.float32))
    want = chain_reference(x_r, 10)
    for name, ar in reducers.items():
        got = job.run(lambda x: chain(ar, x, 10), x_r)
        if not np.array_equal(got, want):
            errors.append(f"fori_loop {name} rank {job.rank}: "
                          f"{int((got != want).sum())} of {got.size} elements differ")
    for ar in reducers.values():
        ar.check()
    Barrier()("finished")  # no peer still writes into this process's buffers
    for ar in reducers.values():
        ar.close()
    return errors


if __name__ == "__main__":
    sys.exit(run_worker(ARGS, run_job))
