"""`jax-moe generate` as users run it: text and id prompts of any lengths, --json, and jobs of
2 processes x 4 CPU devices on a loopback coordinator (tests/cli_worker.py runs the command
in each process).

Tiny Qwen3-MoE and DeepSeek-V3 checkpoints written by transformers (f32, 8 routed experts,
with the embedded tokenizer saved next to them) generate greedily for 9 prompts of 1-9 ids
plus one text prompt (10 sequences: the batch is padded to 16 and sharded over the 8
devices): one process of 8 devices gives transformers' tokens (prompt by prompt, near-ties
excepted as in tests/models/test_generation.py), and 2 processes x 4 give the same tokens as
one process, with the xla backend and with the host backend over shm and tcp;ofi_rxm. A process SIGKILLed mid-decode
leaves its peer exiting 1 within 5 + 5 s naming the dead process (host backend over
tcp;ofi_rxm, JAX_MOE_TIMEOUT_S=5): with the exchange's CommError when the peer died while the
survivor waited in an exchange, else from the peer's stopped heartbeat (the survivor blocked
in one of XLA's own gloo collectives, which have no timeout). The embedded tokenizer round-trips
a text prompt. Every process has a hard time limit and is killed by pid past it.
About 90 s on 2 cores (each job pays two jax starts and compiles).
"""

import json
import os
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]

from gpu.test_multiprocess import SHM, TCP  # noqa: E402
from support.hf_tiny import (deepseek_v3_config, first_near_tie, hf_greedy,  # noqa: E402
                             qwen3_moe_kwargs, save_tiny)
from support.jobs import free_loopback_port, launch  # noqa: E402

from jax_moe.backends import host_remote  # noqa: E402
from jax_moe.models import tokenizer  # noqa: E402

WORKER = REPO / "tests" / "cli_worker.py"
NEW_TOKENS = 6
TEXT = "Hello, world! Why is the sky blue?"
JOB_TIMEOUT_S = 120
needs_fabric = pytest.mark.skipif(not host_remote.available(),
                                  reason="the host backend reaches other processes only in "
                                         "builds with libfabric")


def _env(devices: int, extra=()) -> dict:
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", JAX_MOE_TIMEOUT_S="30",
             XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
             PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH"))
                                        if p))
  env.update(extra)
  return env


def _launch(folder: Path, argvs, env, timeout_s=JOB_TIMEOUT_S, hosts=None):
  """One cli_worker.py per argv at once: ([(exit code or None if killed at the limit, stdout,
  stderr)], the seconds each ran); hosts[i]: the host process i stands for."""
  return launch(WORKER, folder, argvs, env, timeout_s, hosts=hosts)


def _report(results) -> str:
  return "\n".join(f"process {i}: exit {code}\n--- stdout\n{out[-1500:]}\n--- stderr\n{err[-2500:]}"
                   for i, (code, out, err) in enumerate(results))


def _last_json(stdout: str) -> dict:
  return json.loads(stdout.strip().splitlines()[-1])


def _job(folder, args, processes, env_extra=(), kill=None, apart=False):
  """`generate args` on `processes` processes of 8 / processes devices each; `apart`: each
  stands for a host of its own (host-backend ranks of other processes are then reached
  through the TransferEngine, not shared memory)."""
  port = free_loopback_port()
  argvs = []
  for i in range(processes):
    argv = ["generate", *args]
    if processes > 1:
      argv += ["--coordinator", f"127.0.0.1:{port}", "--num-processes", str(processes),
               "--process-id", str(i), "--init-timeout", "60"]
    if kill is not None and kill[0] == i:
      argv = ["--kill-at-step", str(kill[1]), "--", *argv]
    argvs.append(argv)
  hosts = [f"host{i}" for i in range(processes)] if apart else None
  return _launch(folder, argvs, _env(8 // processes, env_extra), hosts=hosts)


def _save_checkpoint(config, folder):
  """(path, transformers model, prompt id lists): vocabulary 512 so the embedded tokenizer
  (saved in the directory as tokenizer.json) fits; EOS is ignored in the runs."""
  hf_model, path = save_tiny(config, folder)
  tokenizer.embedded(512).save(path)
  rng = np.random.default_rng(15)
  prompts = [rng.integers(0, 512, n).tolist() for n in (1, 9, 4, 2, 7, 3, 5, 8, 6)]
  return path, hf_model, prompts


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  """The tiny Qwen3-MoE (norm_topk_prob) checkpoint: _save_checkpoint's triple."""
  from transformers import Qwen3MoeConfig

  return _save_checkpoint(Qwen3MoeConfig(**qwen3_moe_kwargs(vocab_size=512,
                                                            norm_topk_prob=True)),
                          tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(scope="module", params=["qwen3", "deepseek_v3"])
def model_checkpoint(request, checkpoint, tmp_path_factory):
  """Each model family's tiny checkpoint (DeepSeek-V3: MLA with YaRN, grouped routing, a
  shared expert and a dense first layer; 8 routed experts, one per device)."""
  if request.param == "qwen3":
    return checkpoint
  return _save_checkpoint(deepseek_v3_config(vocab_size=512),
                          tmp_path_factory.mktemp("deepseek_v3"))


def _args(checkpoint, backend):
  path, _, prompts = checkpoint
  args = ["--model", path, "--dtype", "f32", "--backend", backend, "--ignore-eos", "--json",
          "--max-new-tokens", str(NEW_TOKENS), "--prompt", TEXT]
  for p in prompts:
    args += ["--prompt-ids", ",".join(map(str, p))]
  return args


@pytest.fixture(scope="module")
def one_process(model_checkpoint, tmp_path_factory):
  """The JSON of one process on 8 devices (xla backend)."""
  results, _ = _job(tmp_path_factory.mktemp("one"), _args(model_checkpoint, "xla"), 1)
  assert results[0][0] == 0, _report(results)
  return _last_json(results[0][1])


def test_one_process_gives_transformers_tokens(model_checkpoint, one_process):
  _, hf_model, prompts = model_checkpoint
  got = one_process
  text_ids = tokenizer.embedded(512).encode(TEXT)
  assert got["prompt_tokens"] == [text_ids] + prompts
  assert got["mesh"] == {"ep": 8} and got["processes"] == 1 and got["backend"] == "xla"
  assert got["prefill_ms"] > 0 and got["decode_tokens_per_s"] > 0
  compared = total = 0
  for prompt, tokens in zip(got["prompt_tokens"], got["tokens"]):
    ref_tokens, ref_logits = hf_greedy(hf_model, np.array([prompt]), NEW_TOKENS)
    steps = int(first_near_tie(ref_logits, 1e-4 * np.abs(ref_logits).max())[0])
    assert tokens[:steps] == ref_tokens[0, len(prompt):len(prompt) + steps].tolist(), prompt
    assert len(tokens) == NEW_TOKENS
    compared, total = compared + steps, total + NEW_TOKENS
  assert compared >= 0.75 * total


@pytest.mark.parametrize("exchange,env", [
    ("xla", ()),
    pytest.param("host", (), id="host-one-host"),  # shared memory between the processes
    pytest.param("host", SHM, marks=needs_fabric, id="host-shm"),
    pytest.param("host", TCP, marks=needs_fabric, id="host-tcp"),
])
def test_two_processes_give_one_process_tokens(model_checkpoint, one_process, tmp_path,
                                               exchange, env):
  results, _ = _job(tmp_path, _args(model_checkpoint, exchange), 2, env, apart=bool(env))
  assert [code for code, _, _ in results] == [0, 0], _report(results)
  got = _last_json(results[0][1])
  assert got["tokens"] == one_process["tokens"]
  assert got["text"] == one_process["text"]
  assert got["mesh"] == {"ep": 8} and got["processes"] == 2 and got["backend"] == exchange
  assert "processes: process 0 of 2 (devices per process {0: 4, 1: 4}" in results[0][1]
  # Only process 0 prints. XLA's gloo writes its own lines to stdout too, split anywhere by
  # other writes (CI at 31d76ac saw the second half of a "[Gloo] Rank 6 is connected to 7 peer
  # ranks..." line alone, CI at 4cc9bab a lone "7"), so no filter of process 1's lines is
  # safe. Instead: none of the ways our lines start (`generate`'s `_say`) is in its output.
  ours = ("model: ", "processes: ", "layout: ", "prefill: ", "decode: ", '{"')
  assert all(start in results[0][1] for start in ours), results[0][1]
  assert not [start for start in ours if start in results[1][1]], results[1][1][-3000:]


@needs_fabric
def test_killed_process_ends_its_peer_naming_it(checkpoint, tmp_path):
  timeout_s = 5
  args = _args(checkpoint, "host")
  results, ended = _job(tmp_path, args, 2, TCP + (("JAX_MOE_TIMEOUT_S", str(timeout_s)),),
                        kill=(1, 2), apart=True)
  codes = [code for code, _, _ in results]
  assert codes == [1, -9], _report(results)
  assert ended[0] - ended[1] <= timeout_s + 5, (ended, _report(results))
  stderr = results[0][2]
  # Where the peer died decides which: an exchange waiting for it times out (CommError), or
  # an XLA collective with it (gloo, no timeout) blocks and its heartbeat is what stops.
  comm_error = "CommError: TIMEOUT" in stderr and "(process 1) did not answer" in stderr
  heartbeat = "process 1 (ranks [4, 5, 6, 7]) stopped answering: no heartbeat" in stderr
  assert comm_error or heartbeat, stderr[-3000:]


def test_checkpoint_missing_on_one_process_is_an_error_on_every_process(checkpoint, tmp_path):
  port = free_loopback_port()
  missing = str(tmp_path / "not-here")
  argvs = [["generate", "--model", model, "--coordinator", f"127.0.0.1:{port}",
            "--num-processes", "2", "--process-id", str(i), "--init-timeout", "60"]
           for i, model in enumerate((checkpoint[0], missing))]
  results, _ = _launch(tmp_path / "job", argvs, _env(4))
  assert [code for code, _, _ in results] == [2, 2], _report(results)
  for _, _, stderr in results:
    assert f"process 1: {missing}: no config.json" in stderr, stderr[-2000:]


def test_text_round_trip_with_the_embedded_tokenizer(tmp_path):
  text = "Hello, world! ünïcode 日本"
  results, _ = _launch(tmp_path, [["generate", "--model", "tiny-qwen3-moe", "--prompt", text,
                                   "--prompt", text, "--chat", "--max-new-tokens", "4",
                                   "--json"]], _env(8))
  assert results[0][0] == 0, _report(results)
  stdout = results[0][1]
  got = _last_json(stdout)
  tok = tokenizer.embedded()
  assert got["prompt_tokens"][0] == tok.encode(tok.apply_chat_template(text).strip("\n") + "\n")
  assert tok.decode(tok.encode(text)) == text
  assert got["text"] == [tok.decode(ids) for ids in got["tokens"]]
  assert got["tokens"][0] == got["tokens"][1]  # the same prompt twice
  assert f"text 1: {got['text'][1]}" in stdout  # sequence 0 streams; the others at the end
