"""The generator: determinism, distributions, and the hidden label model (checked independently)."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pytest
import torch
from gem_data import (
    SyntheticConfig,
    dataset_schema,
    generate_table,
    hidden_parameters,
    normalized_entropy,
    reference_normalized_entropy,
)


@pytest.fixture(scope="module")
def table(config) -> pa.Table:
    return generate_table(config, 0, 3000)


@pytest.fixture(scope="module")
def rows(table) -> list[dict]:
    return table.to_pylist()


def test_schema(table, config):
    assert table.schema.equals(dataset_schema(config.num_dense_features))
    assert table.column("sample_index").to_pylist() == list(range(3000))


def test_sample_is_pure_function_of_seed_and_index(config, table):
    pieces = [generate_table(config, lo, hi - lo) for lo, hi in ((0, 1), (1, 700), (700, 3000))]
    assert pa.concat_tables(pieces).equals(table)
    single = generate_table(config, 1234, 1)
    assert single.to_pylist() == table.slice(1234, 1).to_pylist()


def test_different_seed_differs(config, table):
    other = generate_table(SyntheticConfig(seed=config.seed + 1), 0, 3000)
    assert other.column("user_id").to_pylist() != table.column("user_id").to_pylist()
    assert other.column("hist_item_ids").to_pylist() != table.column("hist_item_ids").to_pylist()


def test_hidden_parameters_depend_on_seed_only(config):
    again = hidden_parameters(SyntheticConfig(seed=config.seed, num_users=5))
    first = hidden_parameters(config)
    np.testing.assert_array_equal(again.ad_quality, first.ad_quality)
    np.testing.assert_array_equal(again.item_category, first.item_category)
    assert np.bincount(first.ad_category, minlength=config.num_categories).min() >= 1


def test_history_length_is_heavy_tailed(rows, config):
    lengths = np.array([len(row["hist_item_ids"]) for row in rows])
    cap = config.max_seq_len
    assert lengths.max() == cap  # the tail reaches the cap ...
    assert (lengths <= cap).all()  # ... and never passes it
    assert (lengths == 0).any()
    assert (lengths == 0).mean() < 0.03
    assert np.median(lengths) <= 16
    assert (lengths <= cap // 4).mean() > 0.7
    near_cap = (lengths >= 0.75 * cap).mean()
    assert 0.05 < near_cap < 0.2
    assert lengths.mean() > 1.5 * np.median(lengths)  # mean pulled up by the tail


def test_values_are_consistent_and_in_range(rows, config):
    hidden = hidden_parameters(config)
    for row in rows:
        length = len(row["hist_item_ids"])
        assert (
            len(row["hist_category_ids"])
            == len(row["hist_action_types"])
            == len(row["hist_timestamps"])
            == length
        )
        assert all(0 <= item < config.num_items for item in row["hist_item_ids"])
        assert [hidden.item_category[item] for item in row["hist_item_ids"]] == row[
            "hist_category_ids"
        ]
        assert set(row["hist_action_types"]) <= {0, 1, 2}
        timestamps = row["hist_timestamps"]
        assert all(b > a for a, b in zip(timestamps, timestamps[1:], strict=False))
        segments = row["user_segments"]
        assert 1 <= len(segments) <= config.max_user_segments
        assert segments == sorted(set(segments))
        assert all(0 <= s < config.num_user_segments for s in segments)
        assert 0 <= row["user_id"] < config.num_users
        assert 0 <= row["device_type"] < config.num_device_types
        assert 0 <= row["region"] < config.num_regions
        assert hidden.ad_category[row["ad_id"]] == row["ad_category_id"]
        assert row["conversion"] <= row["click"]
        assert row["click"] in (0.0, 1.0)
        assert 0.0 < row["conversion_prob"] < row["click_prob"] < 1.0


def test_item_popularity_is_skewed(table):
    items = table.column("hist_item_ids").combine_chunks().flatten().to_numpy()
    counts = np.sort(np.bincount(items))[::-1]
    # Zipf inside each category: the top 1% of items get far more than 1% of the events.
    top = counts[: max(1, len(counts) // 100)].sum() / counts.sum()
    assert top > 0.1


def _expected_probs(row: dict, config: SyntheticConfig) -> tuple[float, float]:
    """The hidden label model written out per sample, independently of the vectorized code."""
    hidden = hidden_parameters(config)
    categories = row["hist_category_ids"]
    length = len(categories)
    weighted, total = 0.0, 0.0
    for position, (category, action) in enumerate(
        zip(categories, row["hist_action_types"], strict=True)
    ):
        weight = config.action_weights[action] * config.recency_decay ** (length - 1 - position)
        total += weight
        weighted += weight * (category == row["ad_category_id"])
    interest = weighted / total if total > 0 else 0.0
    segments = row["user_segments"]
    user = sum(hidden.segment_bias[s] for s in segments) / len(segments)
    user += hidden.device_bias[row["device_type"]] + hidden.region_bias[row["region"]]
    dense = np.asarray(row["dense_features"], dtype=np.float32).astype(np.float64)
    ctr_logit = (
        config.ctr_bias
        + config.ctr_interest_weight * interest
        + hidden.ad_quality[row["ad_id"]]
        + user
        + float(dense @ hidden.dense_ctr_weights)
    )
    cvr_logit = (
        config.cvr_bias
        + config.cvr_interest_weight * interest
        + hidden.ad_cvr_quality[row["ad_id"]]
        + float(dense @ hidden.dense_cvr_weights)
    )
    click = 1.0 / (1.0 + math.exp(-ctr_logit))
    return click, click / (1.0 + math.exp(-cvr_logit))


def test_probabilities_follow_the_hidden_model(rows, config):
    for row in rows[:400]:
        click, conversion = _expected_probs(row, config)
        assert row["click_prob"] == pytest.approx(click, rel=1e-5)
        assert row["conversion_prob"] == pytest.approx(conversion, rel=1e-5)


def test_labels_match_probabilities(table):
    click = table.column("click").to_numpy()
    click_prob = table.column("click_prob").to_numpy()
    conversion = table.column("conversion").to_numpy()
    conversion_prob = table.column("conversion_prob").to_numpy()
    n = len(click)
    for labels, probs in ((click, click_prob), (conversion, conversion_prob)):
        std = math.sqrt((probs * (1 - probs)).sum()) / n
        assert abs(labels.mean() - probs.mean()) < 4 * std


def _recency_top_category(row: dict, decay: float) -> int | None:
    scores: dict[int, float] = {}
    categories = row["hist_category_ids"]
    for position, category in enumerate(categories):
        scores[category] = scores.get(category, 0.0) + decay ** (len(categories) - 1 - position)
    return max(scores, key=scores.get) if scores else None


def test_click_prob_is_higher_when_ad_matches_recent_interest(rows, config):
    matched, unmatched = [], []
    for row in rows:
        top = _recency_top_category(row, config.recency_decay)
        (matched if top == row["ad_category_id"] else unmatched).append(row["click_prob"])
    assert len(matched) > 100 and len(unmatched) > 100
    assert np.mean(matched) > 2.5 * np.mean(unmatched)


def _one_hot(values: np.ndarray, size: int) -> np.ndarray:
    return np.eye(size)[values]


def _fit_logistic_ne(train_x, train_y, test_x, test_y) -> float:
    x = torch.tensor(train_x, dtype=torch.float64)
    y = torch.tensor(train_y, dtype=torch.float64)
    weights = torch.zeros(x.shape[1] + 1, dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.LBFGS([weights], max_iter=100)

    def closure():
        optimizer.zero_grad()
        logits = x @ weights[:-1] + weights[-1]
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, y)
        loss = loss + 1e-3 * (weights[:-1] ** 2).sum()
        loss.backward()
        return loss

    optimizer.step(closure)
    with torch.no_grad():
        logits = torch.tensor(test_x, dtype=torch.float64) @ weights[:-1] + weights[-1]
    return normalized_entropy(torch.sigmoid(logits).numpy(), test_y)


def test_sequence_signal_beats_no_sequence_baseline(table, rows, config):
    """Held-out NE: oracle < logistic with a history feature << logistic without history."""
    no_sequence = np.hstack(
        [
            _one_hot(table.column("ad_category_id").to_numpy(), config.num_categories),
            _one_hot(table.column("device_type").to_numpy(), config.num_device_types),
            _one_hot(table.column("region").to_numpy(), config.num_regions),
            np.stack(table.column("dense_features").to_numpy(zero_copy_only=False)),
        ]
    )
    match = []
    for row in rows:
        categories = row["hist_category_ids"]
        weights = [
            config.recency_decay ** (len(categories) - 1 - j) for j in range(len(categories))
        ]
        hits = [w for w, c in zip(weights, categories, strict=True) if c == row["ad_category_id"]]
        match.append(sum(hits) / sum(weights) if weights else 0.0)
    with_sequence = np.hstack([no_sequence, np.array(match)[:, None]])
    click = table.column("click").to_numpy()
    train, test = slice(0, 2000), slice(2000, 3000)
    baseline = _fit_logistic_ne(no_sequence[train], click[train], no_sequence[test], click[test])
    sequence = _fit_logistic_ne(
        with_sequence[train], click[train], with_sequence[test], click[test]
    )
    oracle = normalized_entropy(table.column("click_prob").to_numpy()[test], click[test])
    assert baseline > 0.95
    assert sequence < baseline - 0.06
    assert oracle < baseline - 0.08


def test_reference_ne_has_a_large_sequence_gap(config):
    reference = reference_normalized_entropy(config, num_samples=4000)
    for task in ("ctr", "cvr"):
        assert reference["oracle"][task] < reference["no_sequence"][task] - 0.05
        assert reference["no_sequence"][task] < 1.0


def test_normalized_entropy_matches_formula():
    rng = np.random.default_rng(0)
    probs = rng.uniform(0.01, 0.9, 500)
    labels = (rng.uniform(size=500) < probs).astype(np.float32)
    rate = labels.astype(np.float64).mean()
    expected = -np.mean(labels * np.log(probs) + (1 - labels) * np.log(1 - probs)) / -(
        rate * np.log(rate) + (1 - rate) * np.log(1 - rate)
    )
    assert normalized_entropy(probs, labels) == pytest.approx(expected, rel=1e-12)
    assert normalized_entropy(np.full(500, rate), labels) == pytest.approx(1.0, rel=1e-6)
    with pytest.raises(ValueError, match="probs and labels"):
        normalized_entropy(probs, labels[:10])


def test_bad_range_arguments(config):
    with pytest.raises(ValueError, match="start_index"):
        generate_table(config, -1, 5)
    with pytest.raises(ValueError, match="num_samples"):
        generate_table(config, 0, -5)
