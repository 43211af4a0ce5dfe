"""AllReduce with one rank per process (buffers mapped through CUDA IPC): 2 processes x 1 GPU.

Each job starts N copies of all_reduce_worker.py through test_multiprocess.run_job; every worker
checks its own rank (see all_reduce_worker.py). The CPU job (psum fallback, one CPU device per
process) runs on every machine and checks the worker itself.
"""

from pathlib import Path

import pytest

from test_multiprocess import Job, cuda_device_count, run_job

WORKER = Path(__file__).with_name("all_reduce_worker.py")

GPU_JOBS = (Job("all-reduce-2proc-1perGPU", (0, 1), worker=WORKER, timeout_s=300),)
CPU_JOBS = (Job("all-reduce-cpu-2proc", (0, 0), ("--platform", "cpu"), worker=WORKER,
                timeout_s=300),)


@pytest.mark.gpu
@pytest.mark.parametrize("job", GPU_JOBS, ids=lambda job: job.name)
def test_all_reduce_ranks_in_separate_processes(job, tmp_path):
    needed, present = max(job.gpus) + 1, cuda_device_count()
    if present < needed:
        pytest.skip(f"needs {needed} CUDA devices, {present} present")
    run_job(job, tmp_path)


@pytest.mark.parametrize("job", CPU_JOBS, ids=lambda job: job.name)
def test_all_reduce_psum_fallback_in_separate_cpu_processes(job, tmp_path):
    run_job(job, tmp_path)
