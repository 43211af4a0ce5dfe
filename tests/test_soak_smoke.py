"""benchmarks/soak.py: a short run compares two backends with no mismatch, and its check finds
a difference when there is one."""

import numpy as np

import jax_moe as jm
from benchmarks import soak


def test_a_short_soak_of_two_backends_matches(tmp_path):
  pair = "host,xla" if "host" in jm.available_backends("cpu") else "xla,xla"
  summary_path = tmp_path / "soak.json"
  code = soak.main(["--backends", pair, "--ep", "4", "--tokens", "8", "--hidden", "128",
                    "--experts", "8", "--topk", "2", "--iterations", "12", "--report-every",
                    "6", "--json", str(summary_path)])
  assert code == 0, summary_path.read_text()


def test_the_soak_check_sees_a_changed_output():
  R, T, H, L = 2, 4, 16, 2
  rng = np.random.default_rng(0)
  x = rng.standard_normal((R * T, H)).astype(np.float32)
  w = rng.random((R * T, 2)).astype(np.float32)
  ids = np.zeros((R * T, 2), np.int32)
  rows = rng.integers(0, 255, (R * 8, H)).astype(np.uint8)
  out = x.astype(np.float32)
  a = [rows, np.ones((R * 8, 1), np.float32), np.ones(R * 8, np.float32),
       np.full(R * L, 4, np.int32), np.full(R * L, 4, np.int32), out]
  assert soak.compare(a, list(a), R, x, w, ids) is None
  changed = list(a)
  changed[0] = rows.copy()
  changed[0][1, 3] ^= 1
  assert "x rows in use differ" in soak.compare(a, changed, R, x, w, ids)
  changed = list(a)
  changed[5] = out + 1.0
  assert "combined outputs differ" in soak.compare(a, changed, R, x, w, ids)
