"""`jax-moe generate` and benchmarks/bench_decode.py end to end on small sizes (no timing
asserted: the output must name the layout and the numbers, and the JSON must be complete)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _run(args, tmp_path):
  env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=8")
  return subprocess.run([sys.executable, *args], cwd=tmp_path, env=env, capture_output=True,
                        text=True, timeout=600)


@pytest.mark.parametrize("model", ["tiny-qwen3-moe", "tiny-deepseek-v3"])
def test_generate_command_on_embedded_models(tmp_path, model):
  done = _run(["-m", "jax_moe.cli", "generate", "--model", model, "--prompt-len", "4",
               "--max-new-tokens", "3"], tmp_path)
  assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
  out = done.stdout
  assert "layout: mesh {'ep': 8} on 8 cpu device(s)" in out
  assert "experts sharded over 'ep' (8 way)" in out
  assert "prefill: " in out and "decode: " in out and "tokens/s" in out
  sequence = json.loads(out.split("sequence 0: ")[1].splitlines()[0])
  assert len(sequence) == 4 + 3


def test_generate_command_reports_a_bad_checkpoint(tmp_path):
  done = _run(["-m", "jax_moe.cli", "generate", "--model", str(tmp_path)], tmp_path)
  assert done.returncode == 2
  assert "jax-moe generate: error:" in done.stderr and "no config.json" in done.stderr


def test_bench_decode_checks_backends_and_writes_results(tmp_path):
  done = _run([str(REPO / "benchmarks" / "bench_decode.py"), "--models", "tiny-qwen3-moe",
               "--batch", "8", "--prompt-len", "4", "--steps", "2", "--short-steps", "1",
               "--reps", "1", "--out", str(tmp_path)], tmp_path)
  assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
  payload = json.loads((tmp_path / "decode_cpu-x8.json").read_text())
  assert (tmp_path / "decode_cpu-x8.png").stat().st_size > 0
  assert payload["parity"]["tiny-qwen3-moe"]["ok"]
  results = payload["results"]  # one per available backend: xla, and host when built
  assert "xla" in {result["backend"] for result in results}
  for result in results:
    assert result["status"] == "ok", result
    assert result["time"]["median_us"] > 0 and result["decode_tokens_per_s"] > 0
