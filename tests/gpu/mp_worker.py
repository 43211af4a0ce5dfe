"""One process of an N-process expert-parallel job; tests/gpu/test_multiprocess.py starts N of them.

Every process drives one device, or --devices-per-process CPU devices (ranks of the "ep"
axis, in process order), and joins the others through jax.distributed. With the cuda
backend, ranks in other processes map each other's buffers through CUDA IPC handles
exchanged in the distributed key-value store; several processes may share one GPU. Each
process builds the same global problem from one seed, runs the parity program of
tests/moe_runner.py (dispatch + combine twice) on global arrays, and checks the ranks it
holds against tests/reference.py: dispatched rows, scales, weights and counts bit for bit,
combine within the bounds of checks.check_combine, and a second run bit-identical to the
first.

  python tests/gpu/mp_worker.py --process-id I --num-processes N --port P --gpu G --out r.json

writes {"ok": bool, "errors": [...], ...} to --out and exits 0 only when ok.
--platform cpu runs the same job on CPU devices (no GPU needed): --backend xla (default;
checks this script itself) or host (ranks of one process share memory, so do ranks of
processes of one host, JAX_MOE_HOST_GROUP; ranks on other hosts are reached through the
TransferEngine), --devices-per-process of them each.
--kill-process I: process I SIGKILLs itself as soon as its first run is launched; the
others must see that run end in CommError within JAX_MOE_TIMEOUT_S + 5 s.
"""

import argparse
import inspect
import json
import os
import signal
import sys
import time
import traceback
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # reference, checks, moe_runner

from support.routing_cases import SCENARIOS, routing  # noqa: E402  (numpy only: jax is not imported yet)
from worker_env import configure_environment, devices_per_process  # noqa: E402  (no jax either)

INIT_TIMEOUT_S = 60
BARRIER_TIMEOUT_MS = 90_000  # longer than a kernel's timeout, so a stuck rank shows as TIMEOUT


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--process-id", type=int, required=True)
    parser.add_argument("--num-processes", type=int, required=True,
                        help="processes in the job = ranks of the ep axis")
    parser.add_argument("--port", type=int, required=True, help="coordinator port on 127.0.0.1")
    parser.add_argument("--gpu", type=int, default=None,
                        help="CUDA device index this process uses (required with --platform cuda)")
    parser.add_argument("--out", type=Path, required=True, help="result JSON")
    parser.add_argument("--platform", choices=("cuda", "cpu"), default="cuda",
                        help="cuda: the cuda backend on one GPU; cpu: CPU devices")
    parser.add_argument("--backend", choices=("cuda", "xla", "host"), default=None,
                        help="default: cuda with --platform cuda, xla with --platform cpu")
    parser.add_argument("--devices-per-process", type=int, default=1,
                        help="CPU devices (ranks) of each process (--platform cpu only)")
    parser.add_argument("--kill-process", type=int, default=-1,
                        help="this process SIGKILLs itself once its first run is launched")
    parser.add_argument("--dispatch", choices=("bf16", "fp8", "fp8-prequantized"), default="fp8")
    parser.add_argument("--reduce", choices=("source", "expert"), default="source")
    parser.add_argument("--partial-dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--expert-padding", type=int, default=1)
    parser.add_argument("--split", action="store_true",
                        help="dispatch_send/recv and combine_send/recv instead of the fused calls")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS),
                        help=f"comma-separated routing scenarios of tests/routing_cases.py "
                             f"(default: all of {','.join(SCENARIOS)})")
    parser.add_argument("--seed", type=int, default=20261130)
    args = parser.parse_args(argv)
    if not 0 <= args.process_id < args.num_processes:
        parser.error(f"--process-id must be in [0, {args.num_processes}), got {args.process_id}")
    if args.platform == "cuda" and (args.gpu is None or args.gpu < 0):
        parser.error(f"--gpu must be a CUDA device index >= 0 with --platform cuda, got {args.gpu}")
    if args.backend is None:
        args.backend = "cuda" if args.platform == "cuda" else "xla"
    if (args.backend == "cuda") != (args.platform == "cuda"):
        parser.error(f"--backend {args.backend} does not run on --platform {args.platform}")
    if args.devices_per_process < 1 or (args.platform == "cuda" and args.devices_per_process != 1):
        parser.error("--devices-per-process must be 1 with --platform cuda and >= 1 on cpu, got "
                     f"{args.devices_per_process}")
    args.scenarios = [s for s in args.scenarios.split(",") if s]
    unknown = [s for s in args.scenarios if s not in SCENARIOS]
    if unknown or not args.scenarios:
        parser.error(f"--scenarios must name some of {SCENARIOS}, got {unknown or 'none'}")
    return args


if __name__ == "__main__":
    ARGS = parse_args()
    configure_environment(ARGS)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax._src import distributed  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_moe as jm  # noqa: E402
from support import reference as ref  # noqa: E402
from support.checks import (_scaled_y, assert_bitwise_equal, assert_combine_within,  # noqa: E402
                    assert_dispatch_matches, combine_bound)
from support.moe_runner import (AXIS, DISPATCH_FIELDS, RunResult, Runner, Setup,  # noqa: E402
                        make_inputs)
from support.threads import native_started_since, still_running, threads  # noqa: E402
from jax_moe import settings  # noqa: E402
from jax_moe.backends import cuda_proxy  # noqa: E402
from jax_moe.sharding import shard_map  # noqa: E402


class Barrier:
    """Waits for every process at the coordinator (no device collective: ranks may share a GPU)."""

    def __init__(self):
        self._client = distributed.global_state.client
        self._count = 0

    def __call__(self, what):
        self._count += 1
        self._client.wait_at_barrier(f"jax_moe_mp_{self._count}_{what}", BARRIER_TIMEOUT_MS)


class ProcessRunner(Runner):
    """moe_runner.Runner's program over a mesh spanning processes; returns this process's ranks."""

    def __init__(self, setup, mesh, barrier, kill_me=False):
        # Runner.__init__ builds its mesh from the first devices; this one is given.
        self.setup = setup
        self.geometry = setup.geometry
        self.mesh = mesh
        self.comm = jm.Communicator(setup.config(), mesh, axis=AXIS, backend=setup.backend)
        self._program = jax.jit(shard_map(self._per_shard, mesh, in_specs=P(AXIS),
                                          out_specs=P(AXIS)))
        self._compiled = False
        self._barrier = barrier
        self._kill_me = kill_me
        me = jax.process_index()
        self.ranks = [r for r, d in enumerate(mesh.devices.flat) if d.process_index == me]

    def _global(self, host):
        """Global array of `host` ([R * n, ...], the same in every process) sharded over ranks."""
        sharding = NamedSharding(self.mesh, P(AXIS))
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    def _local(self, array):
        """[len(self.ranks), ...] this process's blocks of a global array sharded over ranks."""
        if array is None:
            return None
        rows = array.shape[0] // self.geometry.axis_size
        blocks = {(shard.index[0].start or 0) // rows: np.asarray(shard.data)
                  for shard in array.addressable_shards}
        return np.stack([blocks[r] for r in self.ranks])

    def run_local(self, inputs, what):
        g = self.geometry
        R, T = g.axis_size, g.max_tokens
        scales = inputs.scales
        if scales is None:  # the program always takes scales; only pre-quantized runs read them
            scales = np.zeros((R, T, g.hidden // self.setup.block_size), np.float32)
        flat = lambda a: a.reshape(R * a.shape[1], *a.shape[2:])  # noqa: E731
        args = [self._global(a) for a in (flat(inputs.x), flat(scales),
                                          flat(inputs.routing.topk_ids),
                                          flat(inputs.routing.topk_weights),
                                          inputs.routing.num_tokens, flat(inputs.y_given))]
        if not self._compiled:
            # Compiling takes each process a different time; a rank's kernels must not wait
            # for a peer that is still compiling, so compile first and meet before running.
            # The jitted program is called, not the compiled object: it reuses the executable,
            # while the compiled object's second call (jax 0.10.2) fails with the host
            # backend's ordered effects ("Execution supplied 5 arguments but compiled program
            # expected 6": the effect token is left out).
            self._program.lower(*args).compile()
            self._compiled = True
        self._barrier(what)
        outputs = self._program(*args)
        if self._kill_me:
            os.kill(os.getpid(), signal.SIGKILL)  # mid-run: the launch is asynchronous
        first, second, out_given, out_scaled = jax.block_until_ready(outputs)
        local = lambda d: {k: self._local(v) for k, v in d.items()}  # noqa: E731
        return RunResult(local(first), local(second), self._local(out_given),
                         self._local(out_scaled))


def failures(what, check, *args):
    """[f"{what}: message"] when the assertion `check(*args)` fails, else []."""
    try:
        check(*args)
    except AssertionError as e:
        return [f"{what}: {e}"]
    return []


def check_local_ranks(setup, inputs, result, ranks):
    """Errors of the ranks this process holds, against the reference of the whole job.

    The same checks as test_cuda_backend (assert_dispatch_matches, check_combine), restricted
    to `ranks`: the other ranks' outputs live in other processes.
    """
    g = setup.geometry
    expected = ref.dispatch_reference(g, inputs.routing, inputs.rows, inputs.row_scales)
    errors = []
    for i, rank in enumerate(ranks):
        for name, fields in (("first dispatch", result.first), ("second dispatch", result.second)):
            mine = {k: None if v is None else v[i:i + 1] for k, v in fields.items()}
            errors += failures(f"rank {rank}, {name} (checked as rank 0)",
                               assert_dispatch_matches, mine,
                               types.SimpleNamespace(ranks=[expected.ranks[rank]]))

    summands = g.experts_per_token + g.axis_size
    bf16_partials = setup.combine_reduce == "expert" and setup.partial_dtype == "bfloat16"
    partial = ref.BF16 if bf16_partials else np.float32
    given = ref.combine_reference(g, inputs.routing, expected, inputs.y_given,
                                  setup.combine_reduce, partial)
    given = ref.CombineReference(given.out[ranks], given.term_magnitude[ranks],
                                 given.partial_rounding[ranks])
    errors += failures(f"ranks {ranks}", assert_combine_within, result.out_given, given.out,
                       combine_bound(result.out_given, given, summands),
                       "combine(random y) vs spec formula")

    rows = (ref.dequantize_fp8(inputs.rows, inputs.row_scales) if inputs.row_scales is not None
            else inputs.rows.astype(np.float32))
    dense, magnitude = ref.dense_moe_reference(g, inputs.routing, rows, ref.scaled_by_expert)
    scaled = ref.combine_reference(g, inputs.routing, expected, _scaled_y(setup, expected),
                                   setup.combine_reduce, partial)
    bound = ref.combine_tolerance(result.out_scaled, dense[ranks], magnitude[ranks], summands,
                                  extra=scaled.partial_rounding[ranks] / 2)
    errors += failures(f"ranks {ranks}", assert_combine_within, result.out_scaled, dense[ranks],
                       bound, "combine(expert_fn(y)) vs dense MoE")
    return errors


def check_identical(runs, ranks):
    """Errors where the second run's outputs differ in any bit from the first's."""
    a, b = runs
    pairs = [(f"{run} {k}", getattr(a, run)[k], getattr(b, run)[k])
             for run in ("first", "second") for k in DISPATCH_FIELDS]
    pairs += [("out_given", a.out_given, b.out_given), ("out_scaled", a.out_scaled, b.out_scaled)]
    return [e for what, x, y in pairs if x is not None
            for e in failures(f"ranks {ranks}, run 2 vs run 1", assert_bitwise_equal, y, x, what)]


def log(message):
    print(f"[process {jax.process_index()}] {message}", file=sys.stderr, flush=True)


def run_job(args):
    """Every scenario twice; returns the errors. A run that raises ends the job."""
    ranks = args.num_processes * args.devices_per_process
    setup = Setup(args.backend, ranks, dispatch=args.dispatch, expert_padding=args.expert_padding,
                  combine_reduce=args.reduce, partial_dtype=args.partial_dtype, split=args.split)
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    if len(devices) != ranks:
        return [f"expected {args.devices_per_process} devices per process, got {devices}"]
    mesh = jax.sharding.Mesh(np.array(devices), (AXIS,))
    barrier = Barrier()
    runner = ProcessRunner(setup, mesh, barrier, kill_me=args.kill_process == args.process_id)
    if args.kill_process >= 0:
        dead = [r for r, d in enumerate(mesh.devices.flat) if d.process_index == args.kill_process]
        return expect_comm_error(runner, setup, np.random.default_rng(args.seed), dead)
    log(f"ranks {runner.ranks} on {runner.mesh.devices.flat[runner.ranks[0]]}, {setup}")
    rng = np.random.default_rng(args.seed)  # the same draws in every process
    errors = []
    for scenario in args.scenarios:
        started = time.monotonic()
        inputs = make_inputs(setup, rng, routing(rng, setup.geometry, scenario))
        runs = []
        for attempt in (1, 2):
            runs.append(runner.run_local(inputs, f"{scenario}_{attempt}"))
            runner.comm.check()
        found = check_local_ranks(setup, inputs, runs[0], runner.ranks)
        found += check_identical(runs, runner.ranks)
        errors += [f"{scenario}: {e}" for e in found]
        log(f"{scenario}: {'ok' if not found else f'{len(found)} errors'} "
            f"({time.monotonic() - started:.1f} s)")
    barrier("finished")  # no peer still writes into this process's buffers
    runner.comm.close()
    spans_hosts = cuda_proxy.spans_hosts(mesh.devices, "mp_worker")
    if setup.backend == "host" or (setup.backend == "cuda" and
                                   (settings.force_remote() or spans_hosts)):
        errors += close_leaves_no_threads(setup, mesh, spans_hosts)
    return errors


def close_leaves_no_threads(setup, mesh, spans_hosts):
    """A host communicator over processes of several hosts starts threads (one TransferEngine
    progress thread per local rank); a cuda one through host proxies a proxy thread per GPU
    too; over processes of one host, a host communicator starts none (shared memory).
    close() must end every one it started (support.threads: found by name, not counted)."""
    before = threads()
    comm = jm.Communicator(setup.config(), mesh, axis=AXIS, backend=setup.backend)
    started = native_started_since(before)
    comm.close()
    left = still_running(started)
    starts = spans_hosts or setup.backend == "cuda"
    if bool(started) != starts or left:
        return [f"threads: a {setup.backend} communicator started {sorted(started.values())} "
                f"(must be {'some' if starts else 'none'}); {sorted(left.values())} still run "
                f"after close() (must be none)"]
    return []


def expect_comm_error(runner, setup, rng, dead_ranks):
    """The run a peer dies in must end in a TIMEOUT CommError naming a rank of the dead
    process within the timeout + 5 s; returns errors."""
    inputs = make_inputs(setup, rng, routing(rng, setup.geometry, SCENARIOS[0]))
    started = time.monotonic()
    try:
        runner.run_local(inputs, "killed")
        runner.comm.check()
    except jm.CommError as e:
        seconds = time.monotonic() - started
        log(f"CommError after {seconds:.1f} s: {e}")
        runner.comm.close()
        limit = float(os.environ["JAX_MOE_TIMEOUT_S"]) + 5
        errors = [] if seconds <= limit else [f"CommError after {seconds:.1f} s > {limit} s"]
        if e.code != jm.ErrorCode.TIMEOUT or e.detail not in dead_ranks:
            errors.append(f"{e}: expected TIMEOUT naming one of the dead ranks {dead_ranks}")
        return errors
    return ["the run with a killed peer ended without CommError"]


def initialize_distributed(args):
    """jax.distributed over loopback with this process's device(s).

    The coordinator listens on loopback only, and the timeouts are short (a dead peer ends the
    job in seconds, not minutes), where the installed jax takes those options.
    """
    address = f"127.0.0.1:{args.port}"
    options = dict(coordinator_bind_address=address, initialization_timeout=INIT_TIMEOUT_S,
                   heartbeat_timeout_seconds=30, shutdown_timeout_seconds=30)
    accepted = inspect.signature(jax.distributed.initialize).parameters
    jax.distributed.initialize(coordinator_address=address, num_processes=args.num_processes,
                               process_id=args.process_id,
                               local_device_ids=list(range(devices_per_process(args))),
                               **{k: v for k, v in options.items() if k in accepted})


def run_worker(args, job):
    """Joins the job, runs `job(args)` (a list of error texts) and writes the result file."""
    started = time.monotonic()
    errors = []
    try:
        initialize_distributed(args)
        errors = job(args)
    except Exception as e:  # noqa: BLE001 - reported in the result file; the peers time out
        errors.append(f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    result = {"ok": not errors, "errors": errors, "process_id": args.process_id,
              "num_processes": args.num_processes, "seconds": round(time.monotonic() - started, 1)}
    args.out.write_text(json.dumps(result, indent=1))
    for error in errors:
        print(error, file=sys.stderr)
    print(f"[process {args.process_id}] {'ok' if not errors else 'FAILED'}", file=sys.stderr,
          flush=True)
    if getattr(args, "kill_process", -1) >= 0 and not errors:  # all_reduce_worker has no kills
        # jax.distributed's shutdown (also run at exit) would wait for the dead peer.
        sys.stderr.flush()
        os._exit(0)
    if not errors:
        jax.distributed.shutdown()
    return 0 if not errors else 1


if __name__ == "__main__":
    sys.exit(run_worker(ARGS, run_job))
