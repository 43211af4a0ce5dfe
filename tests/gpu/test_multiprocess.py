"""Ranks in separate processes: the cuda backend with one rank per process (buffers mapped by
CUDA IPC, several ranks a GPU; or every peer forced remote, through the host proxies and the
TransferEngine, including a killed peer), and the CPU backends.

Each job starts N copies of mp_worker.py on a fresh loopback coordinator port; process i is
rank i and uses the CUDA device gpus[i]. Every worker runs each routing scenario of
tests/routing_cases.py twice and checks its own rank against tests/reference.py (dispatch bit
for bit, combine within check_combine's bounds, the two runs bit-identical). The job passes when
every worker exits 0 within the job's time limit; otherwise the workers' errors and the tails of
their stderr are shown. The EP8 job (four processes per GPU) runs only with JAX_MOE_TEST_EP8=1.

`mp_worker.py --platform cpu` runs the same job on CPU devices; the CPU jobs below run on every
machine: the xla backend on one device per process, and the host backend on 2 processes x 4
devices and on 4 x 2 (a worker then checks all its ranks; ranks of one process share memory,
the others are reached through the TransferEngine over shm or tcp;ofi_rxm), including a job
(tcp) whose second process SIGKILLs itself mid-run and whose survivor must raise CommError in
time and exit cleanly.

Processes of the host and proxy jobs stand for hosts of their own (JAX_MOE_HOST_GROUP), so
they meet through the TransferEngine; the jobs with TWO_HOSTS put two processes on each of two
hosts (shared memory within a host), and one host job puts both processes on one host.
"""

import dataclasses
import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from jax_moe import transport
from jax_moe.backends import host_remote
from support.jobs import free_loopback_port, wait_all

WORKER = Path(__file__).with_name("mp_worker.py")
REPO_ROOT = Path(__file__).resolve().parents[2]
STDERR_TAIL_LINES = 25


@dataclasses.dataclass(frozen=True)
class Job:
    name: str
    gpus: tuple  # CUDA device of process i (= rank i)
    options: tuple = ()  # mp_worker.py options
    timeout_s: int = 180
    only_with: str | None = None  # run only when this environment variable is "1"
    worker: Path = WORKER  # the script each process runs (same command-line contract)
    env: tuple = ()  # (name, value) pairs set for the workers
    killed: int | None = None  # the process that SIGKILLs itself (--kill-process)
    # The host process i stands for (JAX_MOE_HOST_GROUP; backends/hosts.py); None: this
    # machine's, one host for all.
    hosts: tuple | None = None

    @property
    def num_processes(self):
        return len(self.gpus)


JOBS = (
    Job("ep2-1perGPU-fp8-source-padding16", (0, 1),
        ("--dispatch", "fp8", "--reduce", "source", "--expert-padding", "16")),
    Job("ep2-1perGPU-bf16-expert-split", (0, 1),
        ("--dispatch", "bf16", "--reduce", "expert", "--split")),
    Job("ep4-2perGPU-fp8-source", (0, 0, 1, 1), ("--dispatch", "fp8", "--reduce", "source")),
    # Several ranks on one GPU (CUDA IPC between processes of one device): the protocol at
    # R > 1 on a one-GPU machine.
    Job("ep2-1GPU-bf16-expert-split", (0, 0),
        ("--dispatch", "bf16", "--reduce", "expert", "--split")),
    Job("ep4-1GPU-fp8-source-padding16", (0, 0, 0, 0),
        ("--dispatch", "fp8", "--reduce", "source", "--expert-padding", "16")),
    Job("ep4-1GPU-fp8prequantized-expert-bf16partials", (0, 0, 0, 0),
        ("--dispatch", "fp8-prequantized", "--reduce", "expert", "--partial-dtype", "bfloat16")),
    Job("ep8-4perGPU-fp8prequantized-expert-bf16partials", (0, 0, 0, 0, 1, 1, 1, 1),
        ("--dispatch", "fp8-prequantized", "--reduce", "expert", "--partial-dtype", "bfloat16"),
        timeout_s=300, only_with="JAX_MOE_TEST_EP8"),
)


# The same launcher with the xla backend on one CPU device per process: runs everywhere (CI
# too) and checks the jax.distributed wiring and the worker's own checks without a GPU.
CPU_JOBS = (
    Job("cpu-ep2-fp8-source", (0, 0), ("--platform", "cpu", "--dispatch", "fp8",
                                        "--reduce", "source")),
)

def apart(jobs):
    """`jobs` with every process standing for a host of its own where a job names no hosts:
    ranks in other processes are then reached through the TransferEngine, not shared memory."""
    own = lambda job: tuple(f"host{i}" for i in range(job.num_processes))  # noqa: E731
    return tuple(job if job.hosts else dataclasses.replace(job, hosts=own(job)) for job in jobs)


# Two hosts of two processes each: a rank has ranks in its process, near ranks (the other
# process of its host: shared memory) and remote ranks (the other host: the TransferEngine).
TWO_HOSTS = ("a", "a", "b", "b")
HOST_2X4 = ("--platform", "cpu", "--backend", "host", "--devices-per-process", "4")
HOST_4X2 = ("--platform", "cpu", "--backend", "host", "--devices-per-process", "2")
SHM = (("JAX_MOE_HOST_PROVIDER", "shm"),)
TCP = (("JAX_MOE_HOST_PROVIDER", "tcp;ofi_rxm"), ("JAX_MOE_HOST_NODE", "127.0.0.1"))
# Every job runs every routing scenario (skewed, -1 slots, num_tokens < max_tokens, ...).
HOST_JOBS = apart((
    Job("host-2x4-shm-fp8-source-padding16", (0, 0),
        HOST_2X4 + ("--dispatch", "fp8", "--reduce", "source", "--expert-padding", "16"),
        timeout_s=90, env=SHM),
    Job("host-2x4-shm-bf16-expert", (0, 0),
        HOST_2X4 + ("--dispatch", "bf16", "--reduce", "expert"), timeout_s=90, env=SHM),
    Job("host-2x4-tcp-bf16-source-split", (0, 0),
        HOST_2X4 + ("--dispatch", "bf16", "--reduce", "source", "--split"),
        timeout_s=90, env=TCP),
    Job("host-2x4-tcp-fp8prequantized-expert-bf16partials", (0, 0),
        HOST_2X4 + ("--dispatch", "fp8-prequantized", "--reduce", "expert",
                    "--partial-dtype", "bfloat16"), timeout_s=90, env=TCP),
    # Remote ranks in three other processes.
    Job("host-4x2-shm-fp8-source-split", (0, 0, 0, 0),
        HOST_4X2 + ("--dispatch", "fp8", "--reduce", "source", "--split"), timeout_s=90,
        env=SHM),
    # Three rails (NICs) per engine, peers sharded across them (transfer_engine.h); shm
    # endpoints stand in for the NICs.
    Job("host-4x2-shm-3rails-bf16-expert", (0, 0, 0, 0),
        HOST_4X2 + ("--dispatch", "bf16", "--reduce", "expert"), timeout_s=90,
        env=SHM + (("JAX_MOE_HOST_DOMAINS", "shm,shm,shm"),)),
    # World 16: the merge gap of the rows' writes shrinks past world 8 (remote_spans.h).
    Job("host-2x8-shm-fp8-expert", (0, 0),
        ("--platform", "cpu", "--backend", "host", "--devices-per-process", "8",
         "--dispatch", "fp8", "--reduce", "expert"), timeout_s=150, env=SHM),
    # Completions applied late and in random order (the engines' test mode): same results.
    Job("host-2x4-shm-fp8-expert-shuffled", (0, 0),
        HOST_2X4 + ("--dispatch", "fp8", "--reduce", "expert", "--split"), timeout_s=90,
        env=SHM + (("JAX_MOE_HOST_SHUFFLE_SEED", "7"),)),
    # JAX_MOE_TIMEOUT_S=5: the survivor must raise CommError within 5 + 5 s (mp_worker checks).
    # tcp only: libfabric's shm provider (1.17) guards each process's shared queues with a
    # spinlock in shared memory, so a peer SIGKILLed while holding one leaves the survivor
    # spinning inside fi_cq_read / fi_writemsg for ever (seen in about 1 run of 10).
    Job("host-2x4-tcp-peer-killed", (0, 0), HOST_2X4 + ("--kill-process", "1"),
        timeout_s=60, env=TCP + (("JAX_MOE_TIMEOUT_S", "5"),), killed=1),
    # One host: every rank of the other process is near (shared memory, no TransferEngine).
    Job("host-1host-2x4-bf16-source-split", (0, 0),
        HOST_2X4 + ("--dispatch", "bf16", "--reduce", "source", "--split"), timeout_s=90,
        hosts=("a", "a")),
    Job("host-2hosts-4x2-shm-fp8-expert-bf16partials", (0, 0, 0, 0),
        HOST_4X2 + ("--dispatch", "fp8", "--reduce", "expert", "--partial-dtype", "bfloat16"),
        timeout_s=90, env=SHM, hosts=TWO_HOSTS),
    # The killed process is near to process 0 (which waits on its flags in shared memory) and
    # remote to processes 2 and 3 (which wait on its writes).
    Job("host-2hosts-4x2-tcp-near-peer-killed", (0, 0, 0, 0), HOST_4X2 + ("--kill-process", "1"),
        timeout_s=60, env=TCP + (("JAX_MOE_TIMEOUT_S", "5"),), killed=1, hosts=TWO_HOSTS),
))

# The cuda backend with every peer forced remote (JAX_MOE_FORCE_REMOTE=1): each process's GPU
# exchanges through its host proxy, whose host exchange reaches the other processes through
# the TransferEngine (shm or tcp;ofi_rxm); the rows move in host memory mapped into the GPU.
FORCE_REMOTE = (("JAX_MOE_FORCE_REMOTE", "1"),)
NEAR_ROWS_DEVICE = (("JAX_MOE_PROXY_NEAR_ROWS", "device"),)
# Needs an RDMA provider (settings.HMEM_PROVIDERS) and a libfabric built with CUDA: the jobs
# take their provider from JAX_MOE_TEST_HMEM_PROVIDER (see the test).
HMEM = (("JAX_MOE_PROXY_HMEM", "on"),)
PROXY_JOBS = apart((
    Job("ep2-1perGPU-forced-remote-shm-fp8-source-padding16", (0, 1),
        ("--dispatch", "fp8", "--reduce", "source", "--expert-padding", "16"),
        timeout_s=120, env=SHM + FORCE_REMOTE),
    Job("ep2-1perGPU-forced-remote-tcp-bf16-expert-split", (0, 1),
        ("--dispatch", "bf16", "--reduce", "expert", "--split"), timeout_s=120,
        env=TCP + FORCE_REMOTE),
    Job("ep4-2perGPU-forced-remote-shm-fp8prequantized-expert-bf16partials", (0, 0, 1, 1),
        ("--dispatch", "fp8-prequantized", "--reduce", "expert", "--partial-dtype", "bfloat16"),
        timeout_s=150, env=SHM + FORCE_REMOTE),
    Job("ep2-1perGPU-forced-remote-tcp-peer-killed", (0, 1), ("--kill-process", "1"),
        timeout_s=60, env=TCP + FORCE_REMOTE + (("JAX_MOE_TIMEOUT_S", "5"),), killed=1),
    # The proxy path at 2 and 4 processes on one GPU (its kernels write into each process's
    # mapped host memory; the engines move it between processes).
    Job("ep2-1GPU-forced-remote-shm-fp8-source-padding16", (0, 0),
        ("--dispatch", "fp8", "--reduce", "source", "--expert-padding", "16"),
        timeout_s=120, env=SHM + FORCE_REMOTE),
    Job("ep2-1GPU-forced-remote-tcp-bf16-expert-split", (0, 0),
        ("--dispatch", "bf16", "--reduce", "expert", "--split"), timeout_s=120,
        env=TCP + FORCE_REMOTE),
    Job("ep4-1GPU-forced-remote-shm-fp8prequantized-expert-bf16partials", (0, 0, 0, 0),
        ("--dispatch", "fp8-prequantized", "--reduce", "expert", "--partial-dtype", "bfloat16"),
        timeout_s=150, env=SHM + FORCE_REMOTE),
    Job("ep2-1GPU-forced-remote-tcp-peer-killed", (0, 0), ("--kill-process", "1"),
        timeout_s=60, env=TCP + FORCE_REMOTE + (("JAX_MOE_TIMEOUT_S", "5"),), killed=1),
    # Completions applied late and in random order (the engines' test mode): same results.
    Job("ep2-1GPU-forced-remote-shm-shuffled-fp8-expert-split", (0, 0),
        ("--dispatch", "fp8", "--reduce", "expert", "--split"), timeout_s=120,
        env=SHM + FORCE_REMOTE + (("JAX_MOE_HOST_SHUFFLE_SEED", "11"),)),
    # Two rails (NICs) per proxy engine, peers sharded across them.
    Job("ep4-1GPU-forced-remote-shm-2rails-bf16-source", (0, 0, 0, 0),
        ("--dispatch", "bf16", "--reduce", "source"), timeout_s=150,
        env=SHM + FORCE_REMOTE + (("JAX_MOE_HOST_DOMAINS", "shm,shm"),)),
    # Two hosts (not forced: the mesh spans host groups): one communicator whose proxies share
    # host memory with the other process of their host and write to the other host.
    Job("ep4-1GPU-2hosts-shm-fp8-expert-bf16partials", (0, 0, 0, 0),
        ("--dispatch", "fp8", "--reduce", "expert", "--partial-dtype", "bfloat16"),
        timeout_s=150, env=SHM, hosts=TWO_HOSTS),
    Job("ep4-1GPU-2hosts-tcp-near-peer-killed", (0, 0, 0, 0), ("--kill-process", "1"),
        timeout_s=60, env=TCP + (("JAX_MOE_TIMEOUT_S", "5"),), killed=1, hosts=TWO_HOSTS),
    # The rows between the processes of a host in device memory (CUDA IPC), not host memory:
    # two hosts (mixed), and one host (every peer's rows on the GPU; forced through proxies).
    Job("ep4-1GPU-2hosts-shm-nearrows-device-fp8-source-padding16", (0, 0, 0, 0),
        ("--dispatch", "fp8", "--reduce", "source", "--expert-padding", "16"), timeout_s=150,
        env=SHM + NEAR_ROWS_DEVICE, hosts=TWO_HOSTS),
    Job("ep2-1GPU-1host-nearrows-device-bf16-expert-split", (0, 0),
        ("--dispatch", "bf16", "--reduce", "expert", "--split"), timeout_s=120,
        env=FORCE_REMOTE + NEAR_ROWS_DEVICE, hosts=("a", "a")),
    # The rows from other hosts written by the NICs into each rank's device buffer (FI_HMEM),
    # routes and flags through host memory: alone, and with near device rows.
    Job("ep2-1GPU-forced-remote-rdma-hmem-fp8-expert-bf16partials", (0, 0),
        ("--dispatch", "fp8", "--reduce", "expert", "--partial-dtype", "bfloat16"),
        timeout_s=120, env=FORCE_REMOTE + HMEM),
    Job("ep4-1GPU-2hosts-rdma-hmem-nearrows-device-bf16-source-split", (0, 0, 0, 0),
        ("--dispatch", "bf16", "--reduce", "source", "--split"), timeout_s=150,
        env=NEAR_ROWS_DEVICE + HMEM, hosts=TWO_HOSTS),
))


def cuda_device_count():
    try:
        return len(jax.devices("cuda"))
    except RuntimeError:
        return 0


def start_worker(job, process_id, port, folder):
    # JAX_MOE_TEST_WORKER_PREFIX runs each worker under a debugger (gpu_run.sh's gdbjob:
    # "cuda-gdb -batch -ex run -ex bt --args" prints the stack of a crash).
    prefix = shlex.split(os.environ.get("JAX_MOE_TEST_WORKER_PREFIX", ""))
    command = [*prefix, sys.executable, str(job.worker), "--process-id", str(process_id),
               "--num-processes", str(job.num_processes), "--port", str(port),
               "--gpu", str(job.gpus[process_id]),
               "--out", str(folder / f"result{process_id}.json"), *job.options]
    # Inherited: PATH, PYTHONPATH, XLA_FLAGS, NCCL_NVLS_ENABLE and the other NVLS switches.
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", JAX_MOE_TIMEOUT_S="20",
               PYTHONUNBUFFERED="1")
    env.update(job.env)
    if job.hosts:
        env["JAX_MOE_HOST_GROUP"] = job.hosts[process_id]
    with open(folder / f"stdout{process_id}.txt", "w") as out, \
            open(folder / f"stderr{process_id}.txt", "w") as err:
        return subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=out, stderr=err,
                                stdin=subprocess.DEVNULL)


def worker_errors(folder, process_id):
    result = folder / f"result{process_id}.json"
    return json.loads(result.read_text())["errors"] if result.exists() else None


def worker_summary(process_id, gpu, code, errors):
    """One line: how the worker ended and the first line of its first error."""
    state = "killed at the job's time limit" if code is None else f"exit code {code}"
    if errors is None:
        return f"worker {process_id} (gpu {gpu}): {state}, no result file"
    first = errors[0].splitlines()[0][:300] if errors else "no errors"
    return f"worker {process_id} (gpu {gpu}): {state}, {len(errors)} errors; {first}"


def worker_details(folder, process_id, errors):
    lines = [f"worker {process_id}:"]
    lines += [f"  error: {e}" for e in (errors or [])[:5]]
    stderr = (folder / f"stderr{process_id}.txt").read_text(errors="replace").splitlines()
    lines.append(f"  stderr, last {STDERR_TAIL_LINES} lines:")
    return lines + [f"    {line}" for line in stderr[-STDERR_TAIL_LINES:]]


def run_job(job, folder):
    port = free_loopback_port()
    processes = [start_worker(job, i, port, folder) for i in range(job.num_processes)]
    codes = wait_all(processes, job.timeout_s)
    expected = [-signal.SIGKILL if i == job.killed else 0 for i in range(job.num_processes)]
    if codes == expected:
        return
    errors = [worker_errors(folder, i) for i in range(job.num_processes)]
    report = [f"{job.name}: exit codes {codes} (must be {expected}), logs in {folder}"]
    report += [worker_summary(i, job.gpus[i], code, errors[i]) for i, code in enumerate(codes)]
    for i in range(job.num_processes):
        report += worker_details(folder, i, errors[i])
    pytest.fail("\n".join(report))


@pytest.mark.gpu
@pytest.mark.parametrize("job", JOBS, ids=lambda job: job.name)
def test_ranks_in_separate_processes_match_reference(job, tmp_path):
    if job.only_with and os.environ.get(job.only_with) != "1":
        pytest.skip(f"runs only with {job.only_with}=1")
    needed, present = max(job.gpus) + 1, cuda_device_count()
    if present < needed:
        pytest.skip(f"needs {needed} CUDA devices, {present} present")
    run_job(job, tmp_path)


@pytest.mark.gpu
@pytest.mark.parametrize("job", PROXY_JOBS, ids=lambda job: job.name)
def test_cuda_ranks_through_host_proxies_match_reference(job, tmp_path):
    if not host_remote.available():
        pytest.skip("the host proxies reach other processes only in builds with libfabric")
    needed, present = max(job.gpus) + 1, cuda_device_count()
    if present < needed:
        pytest.skip(f"needs {needed} CUDA devices, {present} present")
    if dict(job.env).get("JAX_MOE_PROXY_HMEM") == "on":
        # FI_HMEM runs only where a NIC writes device memory (efa, verbs: settings.py says why
        # shm and tcp are refused), with a libfabric built with CUDA (Debian's is not).
        provider = os.environ.get("JAX_MOE_TEST_HMEM_PROVIDER", "")
        if not provider:
            pytest.skip("set JAX_MOE_TEST_HMEM_PROVIDER to an RDMA provider (efa, verbs) for "
                        "the FI_HMEM jobs")
        if not transport.registers_cuda_memory(provider):
            pytest.skip(f"this libfabric cannot register CUDA memory with {provider}")
        job = dataclasses.replace(job, env=job.env + (("JAX_MOE_HOST_PROVIDER", provider),))
    run_job(job, tmp_path)


@pytest.mark.parametrize("job", CPU_JOBS, ids=lambda job: job.name)
def test_xla_ranks_in_separate_cpu_processes_match_reference(job, tmp_path):
    run_job(job, tmp_path)


@pytest.mark.parametrize("job", HOST_JOBS, ids=lambda job: job.name)
def test_host_ranks_across_cpu_processes_match_reference(job, tmp_path):
    if not host_remote.available():
        pytest.skip("the host backend reaches other processes only in builds with libfabric")
    run_job(job, tmp_path)
