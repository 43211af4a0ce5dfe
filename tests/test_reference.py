"""The numpy reference against a routing worked out by hand from docs/semantics.md.

R=2 ranks, E=4 experts (rank 0 owns 0-1, rank 1 owns 2-3), K=2, T=3, expert_padding=2.
  rank 0 (num_tokens 3): t0 -> [1, 2] w [0.5, 0.25]; t1 -> [2, -1] w [1, 0]; t2 -> [0, 1] w [0.125, 0.75]
  rank 1 (num_tokens 2): t0 -> [3, 2] w [2, 4];      t1 -> [1, 1] w [0.5, 0.5]; t2 not sent
Segments in (source rank, token, slot) order:
  rank 0: expert 0 = [(0,2,0)] + 1 pad; expert 1 = [(0,0,0), (0,2,1), (1,1,0), (1,1,1)]
  rank 1: expert 2 = [(0,0,1), (0,1,0), (1,0,1)] + 1 pad; expert 3 = [(1,0,0)] + 1 pad
capacity = 2 * 3 * min(2, 2) + 2 * (2 - 1) = 14.
"""

import numpy as np
import pytest

from support import reference as ref

GEOMETRY = ref.Geometry(num_experts=4, axis_size=2, max_tokens=3, experts_per_token=2, hidden=8,
                        expert_padding=2)
ROUTING = ref.Routing(
    topk_ids=np.array([[[1, 2], [2, -1], [0, 1]], [[3, 2], [1, 1], [0, 0]]], np.int32),
    topk_weights=np.array([[[0.5, 0.25], [1, 0], [0.125, 0.75]], [[2, 4], [0.5, 0.5], [9, 9]]],
                          np.float32),
    num_tokens=np.array([3, 2], np.int32),
)
# Token (s, t) carries the row filled with 10 * s + t + 1.
X = (10 * np.arange(2)[:, None, None] + np.arange(3)[None, :, None] + 1
     + np.zeros((2, 3, 8))).astype(ref.BF16)
# Expert output row `row` on rank d is filled with 10 * d + row + 1.
Y = (10 * np.arange(2)[:, None, None] + np.arange(14)[None, :, None] + 1
     + np.zeros((2, 14, 8))).astype(ref.BF16)


def test_capacity_formula():
    assert GEOMETRY.capacity == 14
    assert ref.Geometry(16, 8, 16, 4, 256, 16).capacity == 8 * 16 * 2 + 2 * 15
    assert ref.Geometry(16, 8, 16, 4, 256, max_recv_tokens=40).capacity == 40


def test_dispatch_layout_by_hand():
    expected = ref.dispatch_reference(GEOMETRY, ROUTING, X)
    rank0, rank1 = expected.ranks
    np.testing.assert_array_equal(rank0.tokens_per_expert, [1, 4])
    np.testing.assert_array_equal(rank0.group_sizes, [2, 4])
    np.testing.assert_array_equal(rank1.tokens_per_expert, [3, 1])
    np.testing.assert_array_equal(rank1.group_sizes, [4, 2])
    # first element of each row names its source token; 0 marks padding and the tail
    np.testing.assert_array_equal(rank0.x[:, 0].astype(np.float32), [3, 0, 1, 3, 12, 12] + [0] * 8)
    np.testing.assert_array_equal(rank0.weights, [0.125, 0, 0.5, 0.75, 0.5, 0.5] + [0] * 8)
    np.testing.assert_array_equal(rank1.x[:, 0].astype(np.float32), [1, 2, 11, 0, 11, 0] + [0] * 8)
    np.testing.assert_array_equal(rank1.weights, [0.25, 1, 4, 0, 2, 0] + [0] * 8)
    assert not rank0.overflow and not rank1.overflow
    np.testing.assert_array_equal(expected.row_of,
                                  [[[2, 0], [1, -1], [0, 3]], [[4, 2], [4, 5], [-1, -1]]])


@pytest.mark.parametrize("reduce", ("source", "expert"))
def test_combine_by_hand(reduce):
    expected = ref.dispatch_reference(GEOMETRY, ROUTING, X)
    out = ref.combine_reference(GEOMETRY, ROUTING, expected, Y, reduce).out
    # rank 0: t0 = 0.5*3 + 0.25*11, t1 = 1*12, t2 = 0.125*1 + 0.75*4
    # rank 1: t0 = 2*15 + 4*13, t1 = 0.5*5 + 0.5*6, t2 not sent
    want = np.array([[4.25, 12, 3.125], [82, 5.5, 0]], np.float32)
    np.testing.assert_array_equal(out.astype(np.float32), np.broadcast_to(want[..., None], out.shape))


def test_expert_reduce_rounds_each_partial_once():
    # One token on rank 0 with expert 0 (rank 0) and experts 2, 3 (rank 1), all weights 1.
    g = ref.Geometry(4, 2, 1, 3, 8)
    routing = ref.Routing(np.array([[[0, 2, 3]], [[-1, -1, -1]]], np.int32),
                          np.ones((2, 1, 3), np.float32), np.array([1, 0], np.int32))
    expected = ref.dispatch_reference(g, routing, np.zeros((2, 1, 8), ref.BF16))
    y = np.zeros((2, g.capacity, 8), np.float32)
    y[0, 0], y[1, 0], y[1, 1] = 0.8984375, 256.0, 1.0
    y = y.astype(ref.BF16)
    source = ref.combine_reference(g, routing, expected, y, "source")
    f32 = ref.combine_reference(g, routing, expected, y, "expert", np.float32)
    bf16 = ref.combine_reference(g, routing, expected, y, "expert", ref.BF16)
    # f32: 0.8984375 + 257 = 257.9 -> 258; bf16 partials: 257 ties to even 256, 256.9 -> 256
    assert source.out[0, 0, 0].astype(np.float32) == 258.0
    assert f32.out[0, 0, 0].astype(np.float32) == 258.0
    assert bf16.out[0, 0, 0].astype(np.float32) == 256.0
    assert bf16.partial_rounding[0, 0, 0] == np.float32(2.0 + 2.0**-8)
    assert f32.partial_rounding[0, 0, 0] == 0.0


def test_capacity_overflow_drops_rows_past_capacity_only():
    small = ref.Geometry(4, 2, 3, 2, 8, expert_padding=2, max_recv_tokens=5)
    expected = ref.dispatch_reference(small, ROUTING, X)
    rank0, rank1 = expected.ranks
    assert rank0.overflow and rank0.rows_needed == 6
    assert rank1.overflow and rank1.rows_needed == 6  # only its padding row falls off
    np.testing.assert_array_equal(rank0.group_sizes, [2, 4])
    np.testing.assert_array_equal(rank0.x[:, 0].astype(np.float32), [3, 0, 1, 3, 12])
    assert expected.row_of[1, 1, 1] == -1 and expected.row_of[1, 1, 0] == 4


def test_invalid_ids_are_listed_and_unrouted():
    routing = ref.Routing(np.array([[[4, -2], [1, -1], [7, 7]]] * 2, np.int32),
                          np.ones((2, 3, 2), np.float32), np.array([2, 3], np.int32))
    assert ref.invalid_ids(GEOMETRY, routing) == [(0, 0, 0, 4), (0, 0, 1, -2), (1, 0, 0, 4),
                                                  (1, 0, 1, -2), (1, 2, 0, 7), (1, 2, 1, 7)]
    expected = ref.dispatch_reference(GEOMETRY, routing, X)
    assert expected.ranks[0].tokens_per_expert.tolist() == [0, 2]
    assert expected.ranks[1].tokens_per_expert.tolist() == [0, 0]


def test_bf16_ulp():
    np.testing.assert_array_equal(ref.bf16_ulp(np.array([1.0, 1.99, 2.0, 0.0, -3.0], np.float32)),
                                  np.array([2**-7, 2**-7, 2**-6, 2.0**-133, 2**-6], np.float32))
