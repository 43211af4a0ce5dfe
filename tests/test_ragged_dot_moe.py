"""End to end: dispatch -> jax.lax.ragged_dot with per-expert weights -> combine, vs dense MoE.

Tolerance: each expert output y = bf16(x @ W[e]) comes from an f32 matmul whose order differs
from numpy's, so y may differ from the exactly rounded value by one bf16 ulp plus the f32 error
H * 2**-24 * sum|x * W| (only visible under cancellation). The combine adds its own bound
(checks.check_combine): out within sum_k |w_k| * (that y error) + the combine tolerance,
and with bf16 partials half a bf16 ulp of sum|w * y| per partial.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from support import reference as ref
from support.checks import assert_combine_within
from support.moe_runner import AXIS, Setup, dequantize_rows, describe, make_inputs, runner
from jax_moe.sharding import shard_map
from support.routing_cases import routing


@functools.lru_cache(maxsize=None)
def moe_layer(setup):
    """jit(shard_map(dispatch -> ragged_dot -> combine)) on the runner's communicator."""
    comm, mesh = runner(setup).comm, runner(setup).mesh

    def per_shard(x, topk_ids, topk_weights, num_tokens, expert_weights):
        r = comm.dispatch(x, topk_ids, topk_weights, num_tokens)
        rows = dequantize_rows(r.x, r.scales, setup.block_size)
        y = jax.lax.ragged_dot(rows, expert_weights, r.group_sizes,
                               precision=jax.lax.Precision.HIGHEST,
                               preferred_element_type=jnp.float32)
        return comm.combine(y.astype(jnp.bfloat16), r.handle)

    return jax.jit(shard_map(per_shard, mesh, in_specs=P(AXIS), out_specs=P(AXIS)))


@pytest.mark.parametrize("setup_args", (
    dict(axis_size=2, dispatch="fp8", expert_padding=16),
    dict(axis_size=4, dispatch="bf16", combine_reduce="expert"),
    dict(axis_size=8, dispatch="fp8", combine_reduce="expert", partial_dtype="bfloat16"),
), ids=describe)
def test_grouped_gemm_moe_matches_dense(backend, setup_args, rng):
    setup = Setup(backend, **setup_args)
    g = setup.geometry
    inputs = make_inputs(setup, rng, routing(rng, g, "skewed"))
    w_experts = (rng.standard_normal((g.num_experts, g.hidden, g.hidden)) / np.sqrt(g.hidden))
    w_experts = w_experts.astype(np.float32)

    R, T = g.axis_size, g.max_tokens
    r = inputs.routing
    out = moe_layer(setup)(inputs.x.reshape(R * T, -1), r.topk_ids.reshape(R * T, -1),
                           r.topk_weights.reshape(R * T, -1), r.num_tokens, w_experts)
    out = np.asarray(jax.block_until_ready(out)).reshape(R, T, g.hidden)
    runner(setup).comm.check()

    rows = (ref.dequantize_fp8(inputs.rows, inputs.row_scales) if inputs.row_scales is not None
            else inputs.rows.astype(np.float32))

    def expert_fn(expert, row):
        exact = row.astype(np.float64) @ w_experts[expert].astype(np.float64)
        return exact.astype(np.float32).astype(ref.BF16).astype(np.float32)

    dense, magnitude = ref.dense_moe_reference(g, r, rows, expert_fn)

    # y error per slot, weighted by |w| and summed over the token's valid slots
    valid = ref.valid_slots(g, r)
    y_error = np.zeros((R, T, g.hidden), np.float32)
    for s, t, k in zip(*np.nonzero(valid)):
        expert = r.topk_ids[s, t, k]
        y = expert_fn(expert, rows[s, t])
        matmul_error = g.hidden * ref.F32_EPS * (np.abs(rows[s, t]) @ np.abs(w_experts[expert]))
        y_error[s, t] += abs(r.topk_weights[s, t, k]) * (ref.bf16_ulp(y) + matmul_error)
    extra = y_error
    if setup.combine_reduce == "expert" and setup.partial_dtype == "bfloat16":
        # at most min(K, R) partials, each no larger than sum|w * y| and rounded once
        extra = extra + min(g.experts_per_token, R) * ref.bf16_ulp(magnitude) / 2
    bound = ref.combine_tolerance(out, dense, magnitude, g.experts_per_token + R, extra=extra)
    assert_combine_within(out.astype(ref.BF16), dense, bound, "MoE layer with ragged_dot vs dense")
