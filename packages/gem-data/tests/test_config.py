from __future__ import annotations

import dataclasses

import pytest
from gem_data import SyntheticConfig


def test_round_trip_through_dict():
    config = SyntheticConfig(seed=3, max_seq_len=64, action_probs=(0.5, 0.4, 0.1))
    assert SyntheticConfig.from_dict(config.to_dict()) == config


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        SyntheticConfig().seed = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"seed": -1}, "seed"),
        ({"max_seq_len": 0}, "max_seq_len"),
        ({"num_ads": 4, "num_categories": 8}, "num_ads"),
        ({"action_probs": (0.5, 0.5, 0.5)}, "action_probs"),
        ({"action_weights": (1.0, 2.0)}, "action_weights"),
        ({"empty_history_prob": 0.6, "long_history_prob": 0.6}, "long_history_prob"),
        ({"recency_decay": 0.0}, "recency_decay"),
        ({"max_user_segments": 10, "num_user_segments": 5}, "max_user_segments"),
        ({"ctr_bias": float("nan")}, "ctr_bias must be finite"),
        ({"user_feature_std": float("nan")}, "user_feature_std must be finite"),
        ({"mean_event_gap_seconds": float("inf")}, "mean_event_gap_seconds must be finite"),
        ({"short_history_median": float("inf")}, "short_history_median must be finite"),
        ({"ad_quality_std": -1.0}, "ad_quality_std must be >= 0"),
        ({"action_weights": (1.0, float("inf"), 1.0)}, "action_weights"),
    ],
)
def test_bad_values_name_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        SyntheticConfig(**overrides)


def test_non_int_count_is_a_type_error():
    with pytest.raises(TypeError, match="num_items"):
        SyntheticConfig(num_items=10.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="ctr_bias must be a number"):
        SyntheticConfig(ctr_bias="-3")  # type: ignore[arg-type]


def test_unknown_dict_key():
    with pytest.raises(ValueError, match="bogus"):
        SyntheticConfig.from_dict({"bogus": 1})
