"""Cost models, BBS merging, global rebalance and the balance simulation, checked independently."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from gem_data import (
    AffineCost,
    SyntheticConfig,
    attention_cost,
    bbs_merge,
    generate_table,
    global_rebalance,
    linear_cost,
    max_over_mean,
    sample_history_lengths,
    simulate_balance,
    sub_batch_costs,
)
from hypothesis import given, settings
from hypothesis import strategies as st


def test_cost_models():
    lengths = np.array([0, 1, 5, 128])
    assert linear_cost(lengths).tolist() == [0.0, 1.0, 5.0, 128.0]
    assert attention_cost(lengths).tolist() == [0.0, 1.0, 25.0, 16384.0]
    affine = AffineCost(per_sample=3.0, per_token=2.0, per_token_pair=0.5)
    assert affine(lengths).tolist() == [3.0 + 2 * n + 0.5 * n * n for n in (0, 1, 5, 128)]
    with pytest.raises(ValueError, match="per_token"):
        AffineCost(per_token=-1.0)


def test_sub_batch_costs_sums_runs():
    lengths = np.arange(10)
    expected = [sum(n * n for n in range(lo, min(lo + 4, 10))) for lo in range(0, 10, 4)]
    assert sub_batch_costs(lengths, 4, attention_cost).tolist() == expected
    assert sub_batch_costs(lengths, 3, linear_cost).tolist() == [3, 12, 21, 9]
    with pytest.raises(ValueError, match="cost_model"):
        sub_batch_costs(lengths, 4, lambda x: x[:2])
    with pytest.raises(ValueError, match="sub_batch_size"):
        sub_batch_costs(lengths, 0)


def _snake_reference(costs: list[float], per_batch: int) -> list[list[int]]:
    """Plain-Python snake deal: sorted heaviest first, rounds alternate direction."""
    num_batches = len(costs) // per_batch
    ranked = sorted(range(len(costs)), key=lambda i: (-costs[i], i))
    batches: list[list[int]] = [[] for _ in range(num_batches)]
    for round_number in range(per_batch):
        chunk = ranked[round_number * num_batches : (round_number + 1) * num_batches]
        targets = range(num_batches) if round_number % 2 == 0 else reversed(range(num_batches))
        for batch, index in zip(targets, chunk, strict=True):
            batches[batch].append(index)
    return batches


@settings(max_examples=30, deadline=None)
@given(
    costs=st.lists(st.integers(0, 10_000), min_size=1, max_size=64),
    per_batch=st.integers(1, 8),
)
def test_bbs_merge_is_a_snake_deal(costs, per_batch):
    costs = costs[: len(costs) - len(costs) % per_batch] or [1] * per_batch
    merged = bbs_merge(np.array(costs, dtype=float), per_batch)
    assert merged.tolist() == _snake_reference([float(c) for c in costs], per_batch)
    assert sorted(merged.ravel().tolist()) == list(range(len(costs)))
    loads = np.array(costs, dtype=float)[merged].sum(axis=1)
    assert loads.max() - loads.min() <= max(costs) - min(costs)


def test_bbs_merge_beats_stream_order_on_skewed_costs():
    rng = np.random.default_rng(0)
    spreads = {"bbs": [], "stream": []}
    for _ in range(50):
        costs = rng.lognormal(0.0, 0.3, 64)  # like sums of 128 jagged costs
        spreads["bbs"].append(max_over_mean(costs[bbs_merge(costs, 8)].sum(axis=1)))
        spreads["stream"].append(max_over_mean(costs.reshape(8, 8).sum(axis=1)))
    assert np.mean(spreads["bbs"]) - 1 < 0.4 * (np.mean(spreads["stream"]) - 1)


def test_bbs_merge_rejects_bad_pools():
    with pytest.raises(ValueError, match="multiple"):
        bbs_merge(np.ones(10), 4)
    with pytest.raises(ValueError, match="1-D"):
        bbs_merge(np.ones((2, 4)), 4)


def _brute_force_optimum(costs: list[float], num_ranks: int) -> float:
    per_rank = len(costs) // num_ranks
    best = np.inf
    for order in itertools.permutations(range(len(costs))):
        loads = [
            sum(costs[i] for i in order[r * per_rank : (r + 1) * per_rank])
            for r in range(num_ranks)
        ]
        best = min(best, max(loads))
    return best


@settings(max_examples=25, deadline=None)
@given(
    costs=st.lists(st.integers(1, 1000), min_size=6, max_size=6),
    num_ranks=st.sampled_from([2, 3]),
)
def test_global_rebalance_against_brute_force(costs, num_ranks):
    values = np.array(costs, dtype=float)
    assignment = global_rebalance(values, num_ranks)
    assert assignment.shape == (num_ranks, 6 // num_ranks)
    assert sorted(assignment.ravel().tolist()) == list(range(6))
    peak = values[assignment].sum(axis=1).max()
    optimum = _brute_force_optimum([float(c) for c in costs], num_ranks)
    lpt_only = values[global_rebalance(values, num_ranks, max_swaps=0)].sum(axis=1).max()
    assert optimum <= peak <= lpt_only
    assert peak <= 4 / 3 * optimum + 1e-9


def test_global_rebalance_is_near_the_mean_with_many_sub_batches():
    rng = np.random.default_rng(1)
    costs = rng.gamma(2.0, size=64 * 8)
    assignment = global_rebalance(costs, 64)
    assert max_over_mean(costs[assignment].sum(axis=1)) < 1.01
    with pytest.raises(ValueError, match="num_ranks"):
        global_rebalance(costs[:10], 3)


def test_sample_history_lengths_matches_the_generator():
    config = SyntheticConfig(seed=3, max_seq_len=64)
    generated = np.array(
        [len(x) for x in generate_table(config, 0, 3000).column("hist_item_ids").to_pylist()]
    )
    sampled = sample_history_lengths(config, 200_000, 0)
    assert sampled.min() >= 0 and sampled.max() <= 64
    grid = np.arange(65)
    cdf = lambda x: np.searchsorted(np.sort(x), grid, side="right") / len(x)  # noqa: E731
    assert np.abs(cdf(generated) - cdf(sampled)).max() < 0.045  # two-sample KS, alpha ~ 1e-4


def test_simulation_orders_the_strategies():
    config = SyntheticConfig()
    result = simulate_balance(
        lambda n, rng: sample_history_lengths(config, n, rng),
        num_ranks=8,
        num_pools=1,
        batch_size=512,
        sub_batch_size=64,
        pool_batches=16,
    )
    summary = result.summary()
    assert len(result.none) == len(result.bbs) == len(result.global_) == 16
    assert 1.0 <= summary["global"] < summary["bbs"] < summary["none"]
    assert summary["bbs_gap_removed"] > 0.5


def test_simulation_of_equal_lengths_is_balanced():
    result = simulate_balance(
        lambda n, rng: np.full(n, 7), num_ranks=4, num_pools=1, batch_size=8, sub_batch_size=2
    )
    for values in (result.none, result.bbs, result.global_):
        np.testing.assert_allclose(values, 1.0)
    with pytest.raises(ValueError, match="multiple"):
        simulate_balance(lambda n, rng: np.ones(n), num_ranks=2, batch_size=10, sub_batch_size=3)
