"""benchmarks/bench_host_remote.py: its write accounting on routings worked out by hand, and the
script end to end on tiny sizes (two processes over shm; skipped without libfabric). No timing
is asserted."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]

from benchmarks import raw_exchange, remote_traffic  # noqa: E402
from jax_moe.backends import host_remote  # noqa: E402

SCRIPT = REPO / "benchmarks" / "bench_host_remote.py"
H = 256  # hidden; 4 experts over 2 ranks: rank 0 holds experts 0-1, rank 1 experts 2-3
# [rank 0's 4 tokens, then rank 1's], K = 2; -1 is an unrouted slot
IDS = np.array([[0, 2], [1, 0], [3, 2], [2, -1],     # rank 0: tokens 0, 2, 3 reach rank 1
                [0, 1], [2, 3], [1, 2], [-1, 0]],    # rank 1: slots on rank 0 at j = 0,1,4,7
               np.int32)


ROUTES = 16 + 8 * 4 * 2  # one route block: header + T * K entries {id, weight}
WIDE = 40 * 1024  # a bf16 row of 80 KiB: farther apart than MERGE_GAP_BYTES, runs never merge


def directions(reduce, fp8=False, partial_bytes=4, ids=IDS, ranks=2, per_process=1, hidden=H):
    return remote_traffic.directions(ids, ranks, per_process, experts=4, hidden=hidden, fp8=fp8,
                                     block_size=128, reduce=reduce, partial_bytes=partial_bytes)


def test_runs_are_maximal_runs_of_true():
    runs = remote_traffic.runs
    assert runs(np.array([1, 1, 0, 1, 0, 0, 1, 1, 1], bool)).tolist() == [2, 1, 3]
    assert runs(np.zeros(5, bool)).tolist() == []
    assert runs(np.ones(3, bool)).tolist() == [3]


def test_merged_runs_join_runs_at_most_gap_apart():
    merged = remote_traffic.merged_runs
    mask = np.array([1, 1, 0, 1, 0, 0, 1, 1, 1], bool)
    assert merged(mask, 0) == [2, 1, 3]
    assert merged(mask, 1) == [4, 3]     # the gap of one joins, the gap of two does not
    assert merged(mask, 2) == [9]
    assert merged(np.array([0, 0, 1, 0, 0], bool), 5) == [1]  # no leading or trailing gap
    assert merged(np.zeros(4, bool), 3) == []


@pytest.mark.parametrize("fp8, row", [(False, 2 * H), (True, H + 4 * 2 + 8)])  # fp8: 16-aligned
def test_dispatch_writes_one_route_block_and_the_merged_runs_of_tokens(fp8, row):
    to_1, to_0 = directions("source", fp8=fp8)
    assert (to_1.source, to_1.dest, to_0.source, to_0.dest) == (0, 1, 1, 0)
    assert to_1.dispatch.routes == [ROUTES]
    assert to_1.dispatch.payload == [4 * row]             # tokens 0 | 2, 3, token 1 along
    assert to_0.dispatch.payload == [4 * row]             # tokens 0 | 2, 3 (1 stays home)
    assert to_1.dispatch.acks == to_1.combine.acks == 1


def test_the_merge_gap_shrinks_past_world_8():
    assert remote_traffic.merge_gap_bytes(2) == remote_traffic.merge_gap_bytes(8) == 64 << 10
    assert remote_traffic.merge_gap_bytes(64) == 8 << 10
    # Rank 0's tokens 0 and 11 reach rank 1 (expert 1 of 16), the 10 between stay home: a gap
    # of 40 KiB of bf16 rows, inside 64 KiB but not inside world 16's 32 KiB.
    def rows_to_1(ranks):
        ids = np.zeros((ranks * 12, 1), np.int32)
        ids[[0, 11], 0] = 1
        to = remote_traffic.directions(ids, ranks, 1, experts=ranks, hidden=2048, fp8=False,
                                       block_size=128, reduce="expert", partial_bytes=2)
        return next(d for d in to if (d.source, d.dest) == (0, 1)).dispatch.payload

    assert rows_to_1(8) == [12 * 4096]
    assert rows_to_1(16) == [4096, 4096]


def test_rows_farther_apart_than_the_merge_gap_go_in_a_write_per_run():
    to_1, to_0 = directions("expert", hidden=WIDE, partial_bytes=4)
    assert to_1.dispatch.payload == [2 * WIDE, 2 * 2 * WIDE]  # tokens 0 | 2, 3
    assert to_0.combine.payload == [4 * WIDE, 2 * 4 * WIDE]   # rank 0's tokens 0 | 2, 3


def test_combine_writes_follow_slots_in_source_mode_and_tokens_in_expert_mode():
    to_1, to_0 = directions("source")
    # Rank 0 returns rank 1's slots j = 0,1 | 4 | 7 as bf16 rows.
    assert to_1.combine.payload == [2 * 2 * H, 2 * H, 2 * H]
    # Rank 1 returns rank 0's slots j = 1 | 4, 5, 6.
    assert to_0.combine.payload == [2 * H, 3 * 2 * H]
    # Expert mode merges (each rank writes its own partials): tokens 0 | 2, 3 with 1 along.
    to_1, to_0 = directions("expert", partial_bytes=2)
    assert to_1.combine.payload == [4 * 2 * H]
    assert to_0.combine.payload == [4 * 2 * H]
    assert to_0.bytes == ROUTES + 4 * 2 * H + 4 * 2 * H
    assert to_0.writes == 1 + 1 + 1 + 1 + 1  # routes, rows, ack, partials, ack


def test_a_rank_pair_with_nothing_to_send_still_costs_one_empty_write():
    ids = np.array([[0, 1]] * 2 + [[2, 3]] * 2, np.int32)  # every slot stays home
    to_1, _ = directions("source", ids=ids, ranks=2)
    assert to_1.dispatch.payload == [0] and to_1.combine.payload == [0]
    assert to_1.bytes == 16 + 8 * 2 * 2


def test_ranks_of_one_process_exchange_nothing_across_the_boundary():
    # 4 ranks, 2 per process, experts 0..3 (one each); rank r's tokens all go to expert r ^ 1,
    # which lives in the same process: only routes and empty writes cross.
    ids = np.repeat(np.array([1, 0, 3, 2], np.int32), 2)[:, None]
    to_1, to_0 = directions("source", ids=ids, ranks=4, per_process=2)
    assert to_1.dispatch.routes == [16 + 8 * 2] * 4    # 2 sources x 2 remote ranks
    assert to_1.dispatch.payload == [0] * 4 and to_1.combine.payload == [0] * 4
    assert to_1.dispatch.acks == to_1.combine.acks == 4


def test_raw_exchange_refuses_an_unknown_mode():
    with pytest.raises(ValueError, match="mode must be one of"):
        raw_exchange.RawExchange(None, 1, b"", None, *directions("source")).run("fast", 1)


@pytest.mark.skipif(not host_remote.available(), reason="needs the native module with libfabric")
def test_bench_host_remote_runs_checks_and_writes_results(tmp_path):
    args = ["--hidden", "256", "--experts", "16", "--topk", "4", "--phases", "tiny=8",
            "--dispatch-dtypes", "fp8", "--iters", "3", "--short-iters", "1", "--reps", "1",
            "--steps-per-iteration", "2", "--out", str(tmp_path)]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # conftest's 8 devices
    done = subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (result,) = tmp_path.glob("host_remote_*.json")
    assert result.with_suffix(".png").stat().st_size > 0
    payload = json.loads(result.read_text())
    assert payload["failures"] == []
    rows = payload["rows"]
    assert [(r["provider"], r["dispatch_dtype"], r["reduce"]) for r in rows] == [
        ("shm", "fp8", "source"), ("shm", "fp8", "expert")]
    for row in rows:
        assert row["correct"]
        assert row["target_ratio"] == 2.0 and isinstance(row["meets_target"], bool)  # cpu
        assert row["bytes_0to1"] > 0 and row["writes_0to1"] >= 1 + 1 + 1 + 1 + 1
        for value in (*row["backend_us"].values(), *row["raw_us"].values(), row["xla_us"]):
            assert value is not None
    for process in payload["per_process"]["shm"]:
        for record in process:
            assert record["jax_moe"]["fused"]["correctness"]["passed"]
            assert record["jax_moe"]["fused"]["time"]["steps_per_iteration"] == 2
    assert "fused/same" in done.stdout


def _fake_mps_control(folder: Path, exit_code: int = 0) -> Path:
    """A stand-in nvidia-cuda-mps-control on PATH: it logs its argument, stdin and MPS folders."""
    bin_dir = folder / "bin"
    bin_dir.mkdir()
    script = bin_dir / "nvidia-cuda-mps-control"
    script.write_text("#!/bin/sh\n"
                      f'echo "args=$* pipe=$CUDA_MPS_PIPE_DIRECTORY" >> "{folder}/calls"\n'
                      f'[ -z "$1" ] && cat >> "{folder}/calls"\n'
                      f"exit {exit_code}\n")
    script.chmod(0o755)
    return bin_dir


def test_private_mps_starts_a_daemon_of_its_own_folder_and_quits_it(tmp_path, monkeypatch):
    from benchmarks.processes import private_mps

    monkeypatch.setenv("PATH", f"{_fake_mps_control(tmp_path)}:{os.environ['PATH']}")
    with private_mps(tmp_path / "run") as env:
        assert env["CUDA_MPS_PIPE_DIRECTORY"] == str(tmp_path / "run" / "mps_pipe")
        assert Path(env["CUDA_MPS_LOG_DIRECTORY"]).is_dir()
        assert (tmp_path / "calls").read_text().splitlines() == [
            f"args=-d pipe={tmp_path / 'run' / 'mps_pipe'}"]
    assert (tmp_path / "calls").read_text().splitlines()[1:] == [
        f"args= pipe={tmp_path / 'run' / 'mps_pipe'}", "quit"]


def test_private_mps_reports_a_daemon_that_does_not_start(tmp_path, monkeypatch):
    from benchmarks.processes import private_mps

    monkeypatch.setenv("PATH", f"{_fake_mps_control(tmp_path, exit_code=3)}:/usr/bin:/bin")
    with pytest.raises(RuntimeError, match="--mps: nvidia-cuda-mps-control -d exited 3"):
        with private_mps(tmp_path / "run"):
            pass
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    with pytest.raises(RuntimeError, match="not on PATH"):
        with private_mps(tmp_path / "run"):
            pass


def test_mps_needs_the_cuda_platform_on_one_gpu_without_nvlink(capsys):
    from benchmarks import bench_host_remote

    one_gpu = ["--mps", "--platform", "cuda", "--gpus", "1"]
    for argv in (["--mps", "--no-nvlink"], ["--mps", "--platform", "cuda", "--gpus", "2",
                                            "--no-nvlink"], one_gpu):
        with pytest.raises(SystemExit):
            bench_host_remote.parse_args(argv)
        assert "--mps needs --platform cuda --gpus 1 --no-nvlink" in capsys.readouterr().err
    assert bench_host_remote.parse_args([*one_gpu, "--no-nvlink"]).mps


def test_proxy_summary_and_phases_name_each_request_and_the_gpu_part_before_it():
    """The proxies' samples (op name from the native module, first post, serve and the gap
    since the previous answer, ns) become per-request medians, and the printed phases say
    the GPU's part before each request and the proxy's own."""
    from benchmarks import bench_host_remote, host_remote_worker

    samples = {0: [("dispatch_send.begin", -1, 2_000, -1),
                   ("dispatch_send.end", 6_000, 14_000, 900_000),
                   ("dispatch_send.begin", -1, 4_000, 3_000_000),
                   ("dispatch_send.end", 8_000, 16_000, 1_100_000)]}
    summary = host_remote_worker.proxy_summary(samples)
    assert summary["dispatch_send.begin"] == {
        "requests": 2, "first_post_us": None, "first_post_p90_us": None, "serve_us": 3.0,
        "since_answer_us": 3000.0}
    end = summary["dispatch_send.end"]
    assert end["first_post_us"] == 7.0 and end["serve_us"] == 15.0
    assert end["since_answer_us"] == 1000.0
    row = {"provider": "shm", "phase": "decode", "proxy": [summary, None]}
    assert bench_host_remote.proxy_phases([row]) == (
        "shm decode process 0, us GPU before + proxy: dispatch_send.begin 3000+3, "
        "dispatch_send.end 1000+15")


def test_first_post_is_read_from_the_request_that_posts_alone_or_joined():
    """A split dispatch posts in "dispatch_send.end", a fused one in the request joined with
    the receive half's opening (ffi/cuda/host_proxy.cc); the slower process counts."""
    from benchmarks import bench_host_remote

    alone = {"dispatch_send.end": {"first_post_us": 2.0}}
    joined = {"dispatch_send.end+recv.begin": {"first_post_us": 3.5}}
    assert bench_host_remote._first_post_us({"proxy": [alone, joined]}) == 3.5
    assert bench_host_remote._first_post_us({"proxy": [alone, {}]}) is None
