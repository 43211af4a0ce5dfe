"""Misuse a real program makes by accident is refused while tracing, or recovered from, on
every backend; it never runs silently wrong, never hangs, never poisons the process.

Covers: a handle (or pending half) from another communicator, a call under jit outside
shard_map, a communicator under another mesh than its own (renamed axis, 2-D mesh, a subset),
a closed communicator, a failed host program followed by valid programs, communicators
dropped without close(), and the lowest-rank rule when several ranks record errors.
"""

import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import jax_moe as jm
from jax_moe.sharding import shard_map
from support.meshes import make_mesh
from support.moe_runner import local_expert_of_rows

AXIS = "ep"
R, T, H, E, K = 4, 8, 128, 8, 2


def config(**overrides):
  fields = dict(num_experts=E, experts_per_token=K, hidden=H, max_tokens=T,
                dispatch_dtype=jnp.bfloat16)
  fields.update(overrides)
  return jm.MoEConfig(**fields)


def any_mesh():
  """The tests that mean the same at any size run on up to R devices (one GPU runs them too)."""
  return make_mesh(min(R, len(jax.devices())))


def inputs(rng, rows=R * T):
  x = jnp.asarray(rng.standard_normal((rows, H)), jnp.bfloat16)
  ids = jnp.asarray(rng.integers(0, E, (rows, K)), jnp.int32)
  w = jnp.asarray(rng.random((rows, K)), jnp.float32)
  return x, ids, w


def moe_program(comm, mesh=None, axis=AXIS, scaled=False):
  """jit(shard_map(dispatch -> expert -> combine)) over `mesh` (default: comm's own); the
  expert is the identity, or with `scaled` row * (global expert + 1)."""
  def body(x, ids, w):
    r = comm.dispatch(x, ids, w)
    y = r.x.astype(jnp.float32)
    if scaled:
      L = comm.num_local_experts
      local = local_expert_of_rows(r.group_sizes, comm.capacity)
      y = y * (jax.lax.axis_index(AXIS) * L + local + 1).astype(jnp.float32)[:, None]
    return comm.combine(y.astype(jnp.bfloat16), r.handle)
  mesh = comm.mesh if mesh is None else mesh
  return jax.jit(shard_map(body, mesh, in_specs=P(axis), out_specs=P(axis)))


def dense(x, ids, w, scaled=False):
  """out[t] = sum_k w[t, k] * x[t] (* (ids[t, k] + 1) with `scaled`) in f32, bf16 at the end."""
  x = np.asarray(x, np.float32)
  factor = np.asarray(w) * (np.asarray(ids) + 1 if scaled else 1)
  return (x * factor.sum(-1, keepdims=True)).astype(jnp.bfloat16)


def assert_works(comm, rng):
  """A fresh program of `comm` gives the dense result and records no error."""
  args = inputs(rng, comm.axis_size * T)
  np.testing.assert_array_equal(np.asarray(moe_program(comm)(*args)), dense(*args))
  comm.check()


def test_a_handle_of_another_communicator_is_refused_while_tracing(backend, rng):
  mesh = any_mesh()
  a = jm.Communicator(config(), mesh, AXIS, backend=backend)
  b = jm.Communicator(config(max_tokens=2 * T), mesh, AXIS, backend=backend)

  def body(x, ids, w):
    r = b.dispatch(x, ids, w)
    y = jnp.zeros((a.capacity, H), jnp.bfloat16)
    return a.combine(y, r.handle)

  program = jax.jit(shard_map(body, mesh, in_specs=P(AXIS), out_specs=P(AXIS)))
  with pytest.raises(ValueError, match=r"handle comes from Communicator #\d+"):
    program(*inputs(rng, mesh.size * 2 * T))
  assert_works(a, rng)  # nothing ran, so it still works
  a.close()
  b.close()


def test_halves_must_come_in_order_from_the_same_communicator(backend, rng):
  mesh = any_mesh()
  comm = jm.Communicator(config(), mesh, AXIS, backend=backend)

  def body(x, ids, w):
    r = comm.dispatch(x, ids, w)
    return comm.combine_recv(r.handle)  # a dispatch handle where a combine_send pending goes

  program = jax.jit(shard_map(body, mesh, in_specs=P(AXIS), out_specs=P(AXIS)))
  with pytest.raises(TypeError, match="result of dispatch, expected the result of combine_send"):
    program(*inputs(rng, mesh.size * T))
  comm.close()


def test_a_call_outside_shard_map_is_refused_while_tracing(backend, rng):
  comm = jm.Communicator(config(), any_mesh(), AXIS, backend=backend)
  x, ids, w = inputs(rng, T)
  with pytest.raises(ValueError, match=r"inside jax.shard_map .*outside jax.shard_map"):
    jax.jit(lambda x, ids, w: comm.dispatch(x, ids, w).x)(x, ids, w)
  comm.close()


@pytest.mark.parametrize("other", ("renamed axis", "2-D mesh", "subset"))
def test_a_communicator_under_another_mesh_is_refused_while_tracing(backend, rng, other):
  own = make_mesh(R)  # skips where fewer than R devices exist
  devices = list(own.devices.flat)
  comm = jm.Communicator(config(), own, AXIS, backend=backend)
  if other == "renamed axis":
    mesh, axis = Mesh(np.array(devices), ("experts",)), "experts"
  elif other == "2-D mesh":
    mesh, axis = Mesh(np.array(devices).reshape(2, 2), ("dp", AXIS)), ("dp", AXIS)
  else:
    mesh, axis = Mesh(np.array(devices[:2]), (AXIS,)), AXIS
  rows = R * T if other != "subset" else 2 * T
  with pytest.raises(ValueError, match="call it inside jax.shard_map over the communicator's mesh"):
    moe_program(comm, mesh, axis)(*inputs(rng, rows))
  comm.close()


def test_the_same_devices_in_another_order_are_refused_or_followed(backend, rng):
  """The xla backend follows axis_index (correct on any order); the native backends refuse
  while lowering."""
  own = make_mesh(R)  # skips where fewer than R devices exist
  devices = list(own.devices.flat)
  comm = jm.Communicator(config(), own, AXIS, backend=backend)
  reversed_mesh = Mesh(np.array(devices[::-1]), (AXIS,))
  args = inputs(rng)
  if backend != "xla":
    with pytest.raises(ValueError, match="orders them"):
      moe_program(comm, reversed_mesh)(*args)
  else:
    got = np.asarray(moe_program(comm, reversed_mesh, scaled=True)(*args), np.float32)
    want = dense(*args, scaled=True).astype(np.float32)
    np.testing.assert_allclose(got, want, rtol=2.0**-7, atol=0)
  comm.close()


def test_a_closed_communicator_refuses_new_programs_and_others_keep_working(backend, rng):
  mesh = any_mesh()
  a = jm.Communicator(config(), mesh, AXIS, backend=backend)
  b = jm.Communicator(config(), mesh, AXIS, backend=backend)
  a.close()
  assert a.closed
  with pytest.raises(ValueError, match="is closed"):
    moe_program(a)(*inputs(rng, mesh.size * T))
  assert_works(b, rng)
  a.close()  # twice is fine
  b.close()


def test_communicators_dropped_without_close_free_their_native_state(backend, rng):
  mesh = any_mesh()
  freed = []
  for _ in range(3):
    comm = jm.Communicator(config(), mesh, AXIS, backend=backend)
    finalizer = comm._finalizer
    assert_works(comm, rng)
    del comm
    gc.collect()
    freed.append(not finalizer.alive)
  # jit's caches may hold the last program (and through it the communicator) for a while.
  assert sum(freed) >= 2, f"finalizers run: {freed}"


@pytest.mark.skipif("host" not in jm.available_backends("cpu"),
                    reason="needs the host backend (native module)")
def test_a_failed_host_program_does_not_break_later_ones(rng):
  """A host custom call that fails at run time fails its program; the failure must not
  carry into the next programs (through the ordered-effect token every host call threads)."""
  mesh = make_mesh(R)
  a = jm.Communicator(config(), mesh, AXIS, backend="host")
  b = jm.Communicator(config(max_tokens=2 * T), mesh, AXIS, backend="host")

  def wrong(x, ids, w):
    # Below the Communicator's checks: b's handle in a's native combine fails at run time.
    r = b.dispatch(x, ids, w)
    return a._backend.combine(jnp.zeros((a.capacity, H), jnp.bfloat16), r.handle.inner)

  program = jax.jit(shard_map(wrong, mesh, in_specs=P(AXIS), out_specs=P(AXIS)))
  with pytest.raises(Exception, match="jax_moe"):
    jax.block_until_ready(program(*inputs(rng, R * 2 * T)))
  for comm in (a, jm.Communicator(config(), mesh, AXIS, backend="host")):
    assert_works(comm, rng)
    comm.close()
  b.close()


def test_errors_of_several_ranks_report_the_lowest_rank(backend, rng):
  comm = jm.Communicator(config(), make_mesh(R), AXIS, backend=backend)
  x, ids, w = inputs(rng)
  bad = np.asarray(ids).copy().reshape(R, T, K)
  bad[1, 0, 0] = E + 1  # ranks 1 and 3 send an invalid id
  bad[3, 2, 1] = E + 3
  for _ in range(3):
    jax.block_until_ready(moe_program(comm)(x, jnp.asarray(bad.reshape(R * T, K)), w))
    with pytest.raises(jm.CommError) as info:
      comm.check()
    assert (info.value.code, info.value.rank, info.value.detail) == (
        jm.ErrorCode.INVALID_EXPERT_ID, 1, E + 1)
  comm.close()
