"""Random inputs for the parity tests: token activations and named routing scenarios.

Rows at or past num_tokens carry valid-looking ids on purpose: a backend must ignore them.
"""

import ml_dtypes
import numpy as np

from support.reference import BF16, Routing

SCENARIOS = (
    "random",  # K distinct experts per token, every token sent
    "skewed",  # one hot expert in every token's top-k, the rest distinct
    "one_expert",  # every token goes to one expert only, other slots -1
    "silent_ranks",  # some ranks send nothing (num_tokens 0), rank 0 among them
    "unused_slots",  # about a third of the slots are -1
    "partial_tokens",  # num_tokens anywhere in [0, max_tokens] per rank
    "duplicates",  # the same expert twice in one token: two rows
)


def activations(rng, geometry):
    """[R, T, H] bf16 with magnitudes spread over a few binades per token."""
    g = geometry
    x = rng.standard_normal((g.axis_size, g.max_tokens, g.hidden)).astype(np.float32)
    x *= np.exp2(rng.integers(-4, 5, size=(g.axis_size, g.max_tokens, 1))).astype(np.float32)
    return x.astype(BF16)


def random_fp8_rows(rng, geometry, block_size):
    """Arbitrary pre-quantized (codes, scales): any finite e4m3fn code, any positive scale."""
    g = geometry
    codes = rng.integers(0, 256, size=(g.axis_size, g.max_tokens, g.hidden), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x42  # 0x7f and 0xff are NaN in e4m3fn
    scales = rng.uniform(1e-3, 4.0, size=(g.axis_size, g.max_tokens, g.hidden // block_size))
    return codes.view(ml_dtypes.float8_e4m3fn), scales.astype(np.float32)


def _distinct_experts(rng, geometry, count):
    """[R, T, count] distinct expert ids per token."""
    g = geometry
    keys = rng.random((g.axis_size, g.max_tokens, g.num_experts))
    return np.argsort(keys, axis=-1)[..., :count].astype(np.int32)


def routing(rng, geometry, scenario):
    g = geometry
    R, T, K, E = g.axis_size, g.max_tokens, g.experts_per_token, g.num_experts
    ids = _distinct_experts(rng, g, K)
    num_tokens = np.full(R, T, dtype=np.int32)
    if scenario == "random":
        pass
    elif scenario == "skewed":
        hot = int(rng.integers(E))
        others = _distinct_experts(rng, g, E)
        others = np.stack([row[row != hot][: K - 1] for row in others.reshape(-1, E)])
        ids = np.concatenate([np.full((R * T, 1), hot), others], axis=1).reshape(R, T, K)
        # the hot expert sits at a random slot of each token
        ids = np.take_along_axis(ids, np.argsort(rng.random((R, T, K)), axis=-1), axis=-1)
    elif scenario == "one_expert":
        ids = np.full((R, T, K), -1, dtype=np.int32)
        ids[..., int(rng.integers(K))] = int(rng.integers(E))
    elif scenario == "silent_ranks":
        num_tokens[0::2] = 0
    elif scenario == "unused_slots":
        ids[rng.random((R, T, K)) < 0.35] = -1
    elif scenario == "partial_tokens":
        num_tokens = rng.integers(0, T + 1, size=R).astype(np.int32)
        num_tokens[-1] = T - 1  # at least one rank with a short but non-empty batch
    elif scenario == "duplicates":
        ids[..., 1] = ids[..., 0]
        ids[..., 2:] = -1
    else:
        raise ValueError(f"unknown scenario {scenario!r}")
    weights = rng.uniform(0.0, 1.0, size=(R, T, K)).astype(np.float32)
    return Routing(ids.astype(np.int32), weights, num_tokens)


def random_expert_outputs(rng, geometry):
    """[R, capacity, H] bf16 for every row, padding and tail included: combine must ignore those."""
    g = geometry
    y = rng.standard_normal((g.axis_size, g.capacity, g.hidden)).astype(np.float32)
    return y.astype(BF16)

