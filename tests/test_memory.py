"""jax_moe.memory.per_rank_bytes against the sizes the layouts' comments state."""

import os

import jax.numpy as jnp
import pytest

import jax_moe as jm
from jax_moe import memory, native
from jax_moe.backends.native_backend import moe_dims

pytestmark = pytest.mark.skipif(native.load() is None, reason="needs jax_moe._native")


def test_buffers_hold_every_region_and_grow_with_what_they_carry():
  R, T, H, K, E = 8, 128, 7168, 8, 256
  cfg = jm.MoEConfig(E, K, H, T, combine_reduce="expert", partial_dtype=jnp.bfloat16)
  got = memory.per_rank_bytes(cfg, R)
  token = H + 4 * (H // 128)  # fp8 codes + f32 scales (ffi/protocol/dims.h token_bytes)
  # Two parities of: tokens [R][T], partials [R][T][H] bf16, routes [R][T][K] (codes, weights).
  per_parity = R * T * token + R * T * H * 2 + 2 * 4 * R * T * K
  assert 2 * per_parity <= got["nvlink_buffer"] <= 2 * per_parity + 2**20
  assert per_parity <= got["host_buffer"] <= per_parity + 2**20
  # One staging copy per rank in another process, of which only this rank's route block, its
  # rows [T] and its partials [T][H] are memory (ffi/host/staging_extents.h), in whole pages.
  page = os.sysconf("SC_PAGE_SIZE")
  copy = memory.per_rank_bytes(cfg, R, remote_ranks=3)["host_buffer"] - got["host_buffer"]
  written = T * token + T * H * 2 + 16 + T * K * 8
  assert copy % 3 == 0 and written <= copy // 3 <= written + 3 * 2 * page
  source_cfg = jm.MoEConfig(E, K, H, T)
  source_copy = (memory.per_rank_bytes(source_cfg, R, remote_ranks=1)["host_buffer"]
                 - memory.per_rank_bytes(source_cfg, R)["host_buffer"])
  # Source mode: every row of comb [T][K][H] may be this rank's to write.
  assert T * K * H * 2 + T * token <= source_copy <= T * K * H * 2 + T * token + 6 * page
  capacity = cfg.capacity(R)
  assert got["dispatch_output"] >= capacity * (H + 4 * (H // 128) + 4)
  source = memory.per_rank_bytes(jm.MoEConfig(E, K, H, T), R)  # rows [T][K][H] bf16, one parity
  assert source["nvlink_buffer"] - got["nvlink_buffer"] == pytest.approx(
      2 * (T * K * H * 2 - R * T * H * 2), abs=2**16)


def test_a_small_staging_copy_is_the_pages_its_ranges_touch():
  """ffi/host/staging_extents.h: the route block, rows and partials of one sender, each
  rounded out to whole pages, merged where they share one; never more than the buffer."""
  page = os.sysconf("SC_PAGE_SIZE")
  module = native.load()
  for R, T in ((2, 4), (4, 64), (8, 1024)):
    cfg = jm.MoEConfig(16, 2, 128, T, combine_reduce="expert")
    dims = moe_dims(cfg, R)
    buffer = module.buffer_bytes(dims, 132)["host"]
    staging = module.host_staging_bytes(dims)
    written = T * (128 + 4) + T * 128 * 4  # rows (fp8 codes + one scale) and f32 partials
    assert staging % page == 0 and page <= staging <= -(-buffer // page) * page
    route_block = 16 + 8 * T * 2  # token count, then {id, weight} per slot
    assert written + route_block <= staging <= written + route_block + 3 * 2 * page


def test_a_device_staging_copy_is_the_rows_and_terms_it_sends():
  """ffi/host/staging_extents.h (JAX_MOE_PROXY_HMEM): a cuda proxy rank's device staging copy
  of a remote rank holds exactly its token rows and its combine terms for that rank, in the
  buffer layout's order and after the route blocks (the routes stay in the host copy)."""
  module = native.load()
  for R, T, rank, reduce in ((2, 4, 1, "expert"), (4, 64, 2, "source"), (8, 1024, 7, "expert"),
                             (16, 4096, 0, "expert")):
    cfg = jm.MoEConfig(256, 8, 7168, T, combine_reduce=reduce, partial_dtype=jnp.bfloat16)
    dims = moe_dims(cfg, R)
    dims.rank = rank
    (rows_at, rows), (terms_at, terms) = module.host_device_staging_ranges(dims)
    token = 7168 + 4 * 56  # fp8 codes + f32 scales
    assert rows == T * token
    assert terms == (T * 7168 * 2 if reduce == "expert" else T * 8 * 7168 * 2)
    routes_end = 4 * 8 * R + R * (-(-(16 + 8 * T * 8) // 256) * 256)  # flags, then routes
    assert rows_at >= routes_end and rows_at + rows <= terms_at
    assert terms_at + terms <= module.buffer_bytes(dims, 132)["host"]


def test_proxy_device_rows_are_the_buffer_and_what_a_rank_sends_each_remote_rank():
  R, T = 8, 128
  cfg = jm.MoEConfig(256, 8, 7168, T, combine_reduce="expert", partial_dtype=jnp.bfloat16)
  off = memory.per_rank_bytes(cfg, R, remote_ranks=4)
  near = memory.per_rank_bytes(cfg, R, remote_ranks=4, proxy_device_rows="near")
  hmem = memory.per_rank_bytes(cfg, R, remote_ranks=4, proxy_device_rows="hmem")
  assert off["proxy_device_rows"] == 0
  buffer = native.load().buffer_bytes(moe_dims(cfg, R), 132)["host"]
  assert near["proxy_device_rows"] == buffer
  sent = T * (7168 + 4 * 56) + T * 7168 * 2  # token rows (fp8 codes + scales), bf16 partials
  assert hmem["proxy_device_rows"] == buffer + 4 * sent
  # The host staging copies keep only the route blocks, whole pages (16 + 8 * T * K bytes).
  page = os.sysconf("SC_PAGE_SIZE")
  routes = -(-(16 + 8 * T * 8) // page) * page
  assert hmem["host_buffer"] == buffer + 4 * routes < off["host_buffer"]
  with pytest.raises(ValueError, match="proxy_device_rows must be 'off', 'near' or 'hmem'"):
    memory.per_rank_bytes(cfg, R, proxy_device_rows="device")
