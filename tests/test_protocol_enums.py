"""The enums Python mirrors from the native protocol header (cuda/layout.cuh) agree with it:
error codes, stages and the AllReduce's algorithm ids, read from the built module."""

import pytest

from jax_moe import all_reduce, native
from jax_moe.errors import ErrorCode, Stage

pytestmark = pytest.mark.skipif(native.load() is None, reason="needs jax_moe._native")


def test_error_codes_stages_and_algorithms_match_the_native_header():
  enums = native.load().protocol_enums()
  assert enums["ErrorCode"] == {c.name: int(c) for c in ErrorCode if c != ErrorCode.OK}
  assert enums["Stage"] == {s.name: int(s) for s in Stage if s != Stage.NONE}
  assert enums["AllReduceAlgorithm"] == all_reduce._KERNEL_IDS
