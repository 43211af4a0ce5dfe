"""Communicators over two mesh axes: experts sharded over both (ranks row-major), and DP groups
(`replicated_over`: tokens replicated over one axis, each rank sending its share, every rank
of a group getting all of the group's outputs), against a dense MoE on every backend.

The expert is row * (global expert + 1), so a row that reaches the wrong expert, is lost or
is counted twice shows up; sums are compared within bf16 rounding.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import jax_moe as jm
from jax_moe.sharding import shard_map
from support.moe_runner import dequantize_rows, local_expert_of_rows

H, E, K = 128, 16, 4


def mesh_2d(dp, tp):
  devices = jax.devices()
  if len(devices) < dp * tp:
    pytest.skip(f"needs {dp * tp} devices")
  return Mesh(np.array(devices[:dp * tp]).reshape(dp, tp), ("dp", "tp"))


def routing(rng, tokens, case):
  ids = np.stack([rng.permutation(E)[:K] for _ in range(tokens)]).astype(np.int32)
  if case == "skewed":
    ids[:, 0] = 3
  elif case == "unused_slots":
    ids[rng.random(ids.shape) < 0.3] = -1
  w = rng.random(ids.shape).astype(np.float32)
  return ids, w


def dense(x, ids, w, live):
  """out[t] = sum over valid slots of w * (id + 1) * x[t] for live tokens, f32."""
  factor = (w * (ids + 1) * (ids >= 0)).sum(-1, keepdims=True) * live[:, None]
  return np.asarray(x, np.float32) * factor


def program(comm, in_axes, out_axes, split=False):
  """dispatch -> row * (global expert + 1) -> combine, per shard."""
  L = comm.num_local_experts

  def body(x, ids, w, n):
    r = (comm.dispatch_recv(comm.dispatch_send(x, ids, w, n.reshape(()))) if split
         else comm.dispatch(x, ids, w, n.reshape(())))
    local = local_expert_of_rows(r.group_sizes, comm.capacity)
    rank = jax.lax.axis_index(comm.axis)
    rows = dequantize_rows(r.x, r.scales, comm.cfg.block_size)
    y = rows * (rank * L + local + 1).astype(jnp.float32)[:, None]
    y = y.astype(jnp.bfloat16)
    return (comm.combine_recv(comm.combine_send(y, r.handle)) if split
            else comm.combine(y, r.handle))

  specs = (P(in_axes),) * 4
  return jax.jit(shard_map(body, comm.mesh, in_specs=specs, out_specs=P(out_axes)))


def assert_close(got, want, what):
  got = np.asarray(got, np.float32)
  bound = 2.0**-7 * np.abs(want) + 1e-6
  bad = ~(np.abs(got - want) <= bound)
  assert not bad.any(), f"{what}: {int(bad.sum())} elements off, first at {np.argwhere(bad)[0]}"


@pytest.mark.parametrize("case", ("random", "skewed", "unused_slots"))
@pytest.mark.parametrize("dp,tp", ((4, 2), (2, 4)))
def test_experts_over_two_axes_match_a_one_axis_moe(backend, rng, dp, tp, case):
  mesh = mesh_2d(dp, tp)
  T = 8
  cfg = jm.MoEConfig(E, K, H, T, dispatch_dtype=jnp.bfloat16)
  comm = jm.Communicator(cfg, mesh, ("dp", "tp"), backend=backend)
  R = dp * tp
  x = rng.standard_normal((R * T, H)).astype(jnp.bfloat16)
  ids, w = routing(rng, R * T, case)
  n = rng.integers(T // 2, T + 1, R).astype(np.int32)
  live = (np.arange(T)[None, :] < n[:, None]).reshape(-1)
  out = program(comm, ("dp", "tp"), ("dp", "tp"))(x, ids, w, n)
  comm.check()
  assert_close(out, dense(x, ids, w, live), f"EP over (dp, tp) = ({dp}, {tp})")
  comm.close()


@pytest.mark.parametrize("split", (False, True))
@pytest.mark.parametrize("dispatch", ("bf16", "fp8"))
@pytest.mark.parametrize("dp,tp", ((4, 2), (2, 4), (1, 8)))
def test_dp_groups_send_shares_and_every_rank_gets_the_group_outputs(backend, rng, dp, tp,
                                                                     dispatch, split):
  mesh = mesh_2d(dp, tp)
  T = 16  # tokens of one group, replicated over tp
  cfg = jm.MoEConfig(E, K, H, T, dispatch_dtype=jnp.float8_e4m3fn if dispatch == "fp8"
                     else jnp.bfloat16)
  comm = jm.Communicator(cfg, mesh, ("dp", "tp"), backend=backend, replicated_over="tp")
  assert comm.exchange_cfg.max_tokens == T // tp
  x = rng.standard_normal((dp * T, H)).astype(jnp.bfloat16)
  ids, w = routing(rng, dp * T, "unused_slots")
  n = rng.integers(1, T + 1, dp).astype(np.int32)  # a group's count may end inside any share
  live = (np.arange(T)[None, :] < n[:, None]).reshape(-1)
  x_seen = x
  if dispatch == "fp8":
    x_seen = np.asarray(jm.dequantize_fp8(*jm.quantize_fp8(jnp.asarray(x)), jnp.float32))
  # Inputs sharded over dp only (replicated over tp); outputs from every (dp, tp) rank.
  out = program(comm, "dp", ("dp", "tp"), split)(x, ids, w, n)
  comm.check()
  want = dense(x_seen, ids, w, live).reshape(dp, 1, T, H)
  got = np.asarray(out, np.float32).reshape(dp, tp, T, H)
  for j in range(tp):
    assert_close(got[:, j], want[:, 0], f"DP groups ({dp}, {tp}), tp rank {j}")
  comm.close()


@pytest.mark.parametrize("split", (False, True))
def test_group_outputs_gathered_as_a_sum_equal_the_all_gather(backend, rng, monkeypatch, split):
  """The cuda backend gathers a group's outputs through the AllReduce kernels as a sum of
  zero-padded shares (Communicator._make_group_sum); forced here on CPU (AllReduce's psum),
  it gives the all_gather's outputs exactly."""
  from jax_moe import communicator

  mesh, T = mesh_2d(2, 4), 16
  cfg = jm.MoEConfig(E, K, H, T, dispatch_dtype=jnp.bfloat16)
  x = rng.standard_normal((2 * T, H)).astype(jnp.bfloat16)
  ids, w = routing(rng, 2 * T, "unused_slots")
  n = np.array([T, 5], np.int32)
  outs = {}
  for by_sum in (False, True):
    monkeypatch.setattr(communicator, "_gather_by_sum", lambda name, by_sum=by_sum: by_sum)
    comm = jm.Communicator(cfg, mesh, ("dp", "tp"), backend=backend, replicated_over="tp")
    assert (comm._group_sum is not None) == by_sum
    outs[by_sum] = np.asarray(program(comm, "dp", ("dp", "tp"), split)(x, ids, w, n),
                              np.float32)
    comm.check()
    comm.close()
  np.testing.assert_array_equal(outs[True], outs[False])  # == also takes -0.0 for +0.0
  assert np.abs(outs[True]).max() > 0


def test_a_bad_group_num_tokens_is_recorded_with_its_value(backend, rng):
  mesh = mesh_2d(4, 2)
  T = 8
  comm = jm.Communicator(jm.MoEConfig(E, K, H, T, dispatch_dtype=jnp.bfloat16), mesh,
                         ("dp", "tp"), backend=backend, replicated_over="tp")
  x = rng.standard_normal((4 * T, H)).astype(jnp.bfloat16)
  ids, w = routing(rng, 4 * T, "random")
  n = np.array([T, T + 3, T, T], np.int32)
  jax.block_until_ready(program(comm, "dp", ("dp", "tp"))(x, ids, w, n))
  with pytest.raises(jm.CommError) as info:
    comm.check()
  assert (info.value.code, info.value.detail) == (jm.ErrorCode.BAD_NUM_TOKENS, T + 3)
  assert info.value.rank in (2, 3)  # the ranks of dp group 1
  comm.close()


def test_bad_two_axis_setups_are_refused():
  mesh = mesh_2d(4, 2)
  cfg = jm.MoEConfig(E, K, H, 8, dispatch_dtype=jnp.bfloat16)
  with pytest.raises(ValueError, match="must name distinct mesh axes"):
    jm.Communicator(cfg, mesh, ("dp", "dp"), backend="xla")
  with pytest.raises(ValueError, match="must name distinct mesh axes"):
    jm.Communicator(cfg, mesh, ("dp", "ep"), backend="xla")
  with pytest.raises(ValueError, match="replicated_over .* must be one of"):
    jm.Communicator(cfg, mesh, "dp", backend="xla", replicated_over="tp")
  with pytest.raises(ValueError, match="must be a multiple of the size of replicated_over"):
    jm.Communicator(jm.MoEConfig(E, K, H, 7, dispatch_dtype=jnp.bfloat16), mesh, ("dp", "tp"),
                    backend="xla", replicated_over="tp")


@pytest.mark.parametrize("partial", ("float32", "bfloat16"))
@pytest.mark.parametrize("dispatch", ("bf16", "fp8"))
@pytest.mark.parametrize("axes", ("ep", ("dp", "tp")))
def test_replicated_input_selects_locally_and_every_rank_gets_every_output(backend, rng, axes,
                                                                           dispatch, partial):
  if axes == "ep":
    devices = jax.devices()[:8]
    mesh = Mesh(np.array(devices), ("ep",))
  else:
    mesh = mesh_2d(4, 2)
  T = 12
  cfg = jm.MoEConfig(E, K, H, T, dispatch_dtype=jnp.float8_e4m3fn if dispatch == "fp8"
                     else jnp.bfloat16, combine_reduce="expert", partial_dtype=jnp.dtype(partial))
  comm = jm.Communicator(cfg, mesh, axes, backend=backend, replicated_over=axes)
  assert comm.capacity == T * min(K, E // 8)  # one source: this rank's own slots
  x = rng.standard_normal((T, H)).astype(jnp.bfloat16)
  ids, w = routing(rng, T, "unused_slots")
  n = np.array([T - 3], np.int32)
  live = np.arange(T) < n[0]
  x_seen = x
  if dispatch == "fp8":
    x_seen = np.asarray(jm.dequantize_fp8(*jm.quantize_fp8(jnp.asarray(x)), jnp.float32))
  # Inputs replicated on every rank (spec P()), outputs from every rank.
  out = program(comm, None, axes)(x, ids, w, n)
  comm.check()
  want = dense(x_seen, ids, w, live)
  got = np.asarray(out, np.float32).reshape(8, T, H)
  tolerance = 2.0**-7 * (1 + (partial == "bfloat16"))
  for r in range(8):
    bad = ~(np.abs(got[r] - want) <= tolerance * np.abs(want) + 1e-6)
    assert not bad.any(), f"rank {r}: {int(bad.sum())} elements off"
  np.testing.assert_array_equal(got, np.broadcast_to(got[0], got.shape))  # one sum, all ranks
  comm.close()


def test_replicated_input_needs_expert_combine_and_records_invalid_ids(rng):
  mesh = Mesh(np.array(jax.devices()[:8]), ("ep",))
  with pytest.raises(ValueError, match="combine_reduce must be 'expert'"):
    jm.Communicator(jm.MoEConfig(E, K, H, 8, dispatch_dtype=jnp.bfloat16), mesh, "ep",
                    backend="xla", replicated_over="ep")
  cfg = jm.MoEConfig(E, K, H, 8, dispatch_dtype=jnp.bfloat16, combine_reduce="expert")
  comm = jm.Communicator(cfg, mesh, "ep", backend="xla", replicated_over="ep")
  x = rng.standard_normal((8, H)).astype(jnp.bfloat16)
  ids, w = routing(rng, 8, "random")
  ids[2, 1] = E + 5
  jax.block_until_ready(program(comm, None, "ep")(x, ids, w, np.array([8], np.int32)))
  with pytest.raises(jm.CommError) as info:
    comm.check()
  assert (info.value.code, info.value.rank, info.value.detail) == (
      jm.ErrorCode.INVALID_EXPERT_ID, 0, E + 5)
  comm.close()
