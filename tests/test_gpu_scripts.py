"""The GPU machine's scripts name things in this tree that must exist: CPU checks, so that a
script does not go stale unnoticed until a GPU call (of which a session has few)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def collected(test_file: str) -> set[str]:
    """The pytest node ids of `test_file`, as a collection on this machine lists them."""
    result = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                             "-p", "no:cacheprovider", test_file],
                            cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return {line for line in result.stdout.splitlines() if "::" in line}


def test_every_memcheck_step_names_tests_that_exist():
    listed = subprocess.run(
        ["bash", "benchmarks/gpu_memcheck.sh", "--list", "ep1", "race1", "dequant", "ep2"],
        cwd=REPO, capture_output=True, text=True, timeout=60, check=True)
    nodes = listed.stdout.split()
    assert len(nodes) == 10, listed.stdout
    files = {node.split("::")[0] for node in nodes}
    known = set().union(*(collected(f) for f in files))
    # a node is one case, or a test function that names every case of itself
    missing = [node for node in nodes
               if node not in known and not any(k.startswith(node + "[") for k in known)]
    assert not missing, f"gpu_memcheck.sh names tests that do not exist: {missing}"


def test_memcheck_refuses_an_unknown_step():
    result = subprocess.run(["bash", "benchmarks/gpu_memcheck.sh", "--list", "ep3"], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "unknown step ep3" in result.stderr


PATCHES = sorted((REPO / "benchmarks" / "ab").rglob("*.patch"))  # AB_PATCHES folders too


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git apply")
@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.parent.name + "/" + p.stem)
def test_the_waiting_variants_apply_to_this_tree(patch):
    # gpu_ab.sh applies each to a copy of the checkout; one that no longer applies would fail
    # the GPU call that measures it.
    result = subprocess.run(["git", "apply", "--check", str(patch)], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"{patch.name} no longer applies: {result.stderr}"
