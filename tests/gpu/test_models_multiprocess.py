"""`jax-moe generate` with the cuda backend across processes that share one GPU (issues 15
and 19): the embedded tiny models in f32 (the exact MoE wire) give one process's greedy
tokens on 2 processes over CUDA IPC, on 2 processes with every peer forced through the host
proxies (libfabric shm), and with the heads tensor-parallel over the 2 processes (--tp 2:
the attention output summed by the AllReduce custom call). Each run's decode tokens/s is
printed (pytest -s) for the issue notes. Marked gpu; tests/cli_worker.py runs the command in
each process, every process has a hard time limit and is killed by pid past it.
"""

import json
import os
import time
from pathlib import Path

import pytest

from gpu.test_multiprocess import SHM, cuda_device_count
from jax_moe.backends import host_remote
from support.jobs import free_loopback_port, launch

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "cli_worker.py"
PROMPTS = ("5,9,3", "1,2,3,4,5,6,7", "11", "8,8,8,8")  # four sequences of four lengths
JOB_TIMEOUT_S = 240


def _run(folder: Path, argvs, extra_env=(), hosts=None):
  """One `jax-moe <argv>` process per argv on GPU 0; [(exit code, stdout, stderr)]. hosts[i]:
  the host process i stands for."""
  env = dict(os.environ, CUDA_VISIBLE_DEVICES="0", XLA_PYTHON_CLIENT_PREALLOCATE="false",
             PYTHONUNBUFFERED="1", JAX_MOE_TIMEOUT_S="30")
  env.update(extra_env)
  return launch(WORKER, folder, argvs, env, JOB_TIMEOUT_S, cwd=REPO, hosts=hosts)[0]


def _generate(folder, model, processes, extra_args=(), extra_env=(), hosts=None):
  """The JSON of process 0, after every process exited 0."""
  args = ["generate", "--model", model, "--dtype", "f32", "--backend", "cuda", "--json",
          "--ignore-eos", "--max-new-tokens", "8", *extra_args]
  for p in PROMPTS:
    args += ["--prompt-ids", p]
  port = free_loopback_port()
  argvs = [args if processes == 1 else
           args + ["--coordinator", f"127.0.0.1:{port}", "--num-processes", str(processes),
                   "--process-id", str(i), "--init-timeout", "90"] for i in range(processes)]
  started = time.monotonic()
  results = _run(folder, argvs, extra_env, hosts)
  report = "\n".join(f"process {i}: exit {code}\n{out[-1500:]}\n{err[-3000:]}"
                     for i, (code, out, err) in enumerate(results))
  assert [code for code, _, _ in results] == [0] * processes, report
  done = json.loads(results[0][1].strip().splitlines()[-1])
  print(f"\n{folder.name}: {done['decode_tokens_per_s']:.1f} tokens/s decode, "
        f"prefill {done['prefill_ms']:.1f} ms, mesh {done['mesh']}, "
        f"{time.monotonic() - started:.0f} s in all")
  return done


@pytest.fixture(scope="module", params=["tiny-qwen3-moe", "tiny-deepseek-v3"])
def one_process(request, tmp_path_factory):
  if cuda_device_count() < 1:
    pytest.skip("needs a CUDA device")
  model = request.param
  return model, _generate(tmp_path_factory.mktemp(f"{model}-1proc"), model, 1)


@pytest.mark.gpu
def test_two_processes_over_cuda_ipc_give_one_process_tokens(one_process, tmp_path):
  model, want = one_process
  got = _generate(tmp_path / f"{model}-2proc-ipc", model, 2)
  assert got["processes"] == 2 and got["devices"] == 2
  assert got["tokens"] == want["tokens"]


@pytest.mark.gpu
def test_two_processes_through_the_host_proxies_give_one_process_tokens(one_process, tmp_path):
  if not host_remote.available():
    pytest.skip("the host proxies reach other processes only in builds with libfabric")
  model, want = one_process
  # Two processes standing for two hosts: the mesh spans hosts, so the cuda backend goes
  # through its proxies, which reach each other through the TransferEngine.
  got = _generate(tmp_path / f"{model}-2proc-proxy", model, 2, extra_env=SHM,
                  hosts=("host0", "host1"))
  assert got["tokens"] == want["tokens"]


@pytest.mark.gpu
def test_heads_tensor_parallel_over_two_processes_give_one_process_tokens(one_process,
                                                                          tmp_path):
  model, want = one_process
  got = _generate(tmp_path / f"{model}-2proc-tp2", model, 2, extra_args=("--tp", "2"))
  assert got["mesh"] == {"dp": 1, "tp": 2}
  assert got["tokens"] == want["tokens"]
