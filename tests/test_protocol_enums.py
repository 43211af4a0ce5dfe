"""The enums Python mirrors from the native protocol header (ffi/protocol/dims.h) agree with it:
error codes, stages and the AllReduce's algorithm ids, read from the built module; MoeDims is
set by name from a MoEConfig and checked by the bindings that take it."""

import jax.numpy as jnp
import pytest

import jax_moe as jm
from jax_moe import all_reduce, native
from jax_moe.backends.native_backend import moe_dims
from jax_moe.errors import ErrorCode, Stage

pytestmark = pytest.mark.skipif(native.load() is None, reason="needs jax_moe._native")


def test_error_codes_stages_and_algorithms_match_the_native_header():
  enums = native.load().protocol_enums()
  assert enums["ErrorCode"] == {c.name: int(c) for c in ErrorCode if c != ErrorCode.OK}
  assert enums["Stage"] == {s.name: int(s) for s in Stage if s != Stage.NONE}
  assert enums["AllReduceAlgorithm"] == all_reduce._KERNEL_IDS


def test_moe_dims_come_from_the_config_by_name_and_bad_ones_are_refused():
  cfg = jm.MoEConfig(num_experts=16, experts_per_token=4, hidden=256, max_tokens=8,
                     dispatch_dtype=jnp.float8_e4m3fn, combine_reduce="expert",
                     partial_dtype=jnp.bfloat16, expert_padding=4)
  d = moe_dims(cfg, 4, rank=3)
  assert (d.world, d.rank, d.num_experts, d.local_experts, d.topk) == (4, 3, 16, 4, 4)
  assert (d.fp8, d.reduce_expert, d.partial_bf16) == (1, 1, 1)
  assert d.capacity == cfg.capacity(4) and d.block_size == cfg.block_size
  module = native.load()
  assert module.buffer_bytes(d, 8)["host"] > 0
  d.local_experts = 3
  with pytest.raises(ValueError, match=r"MoeDims: local_experts \(3\) x world \(4\)"):
    module.buffer_bytes(d, 8)
  d.local_experts, d.rank = 4, 4
  with pytest.raises(ValueError, match=r"rank must be in \[0, world = 4\), got 4"):
    module.host_create_rank(comm_id=999_999, ordinal=0, dims=d, timeout_s=1.0)
  with pytest.raises(AttributeError):
    d.experts_per_token = 4  # only the struct's own names
