"""Configuration of the synthetic GEM-like dataset."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

__all__ = ["SyntheticConfig", "NUM_ACTION_TYPES"]

#: Action types in a history: 0 = impression, 1 = click, 2 = conversion.
NUM_ACTION_TYPES = 3


_INT_FIELDS = (
    "seed",
    "max_seq_len",
    "num_items",
    "num_categories",
    "num_ads",
    "num_users",
    "num_user_segments",
    "max_user_segments",
    "num_device_types",
    "num_regions",
    "num_dense_features",
)


@dataclass(frozen=True)
class SyntheticConfig:
    """Every knob of the synthetic generator; defaults suit a tiny CPU run.

    A sample is a pure function of ``(seed, index)`` and these fields; the hidden
    parameters (item -> category map, ad -> category map, ad quality, feature
    biases) are a pure function of ``seed`` and the cardinalities.
    """

    seed: int = 0
    """Seed of the whole dataset: hidden parameters and every sample derive from it."""
    max_seq_len: int = 128
    """Cap on the history length (the longest history has exactly this many events)."""

    num_items: int = 20_000
    """Cardinality of ``hist_item_ids``."""
    num_categories: int = 32
    """Cardinality of ``hist_category_ids`` and ``ad_category_id``."""
    num_ads: int = 2_000
    """Cardinality of ``ad_id``; must be at least ``num_categories`` (every category has an ad)."""
    num_users: int = 1_000_000
    """Cardinality of ``user_id``; large, so ids rarely repeat and cannot memorise preferences."""
    num_user_segments: int = 64
    """Cardinality of the multi-hot ``user_segments`` feature."""
    max_user_segments: int = 4
    """Each user has 1..max_user_segments distinct segments."""
    num_device_types: int = 4
    """Cardinality of ``device_type``."""
    num_regions: int = 50
    """Cardinality of ``region``."""
    num_dense_features: int = 8
    """Width of ``dense_features`` (float32, standard normal)."""

    # History length: a log-normal bulk of short histories plus a uniform tail near the cap.
    empty_history_prob: float = 0.01
    """Probability that a user has no history at all."""
    long_history_prob: float = 0.1
    """Probability that the length is uniform in ``[long_history_min_fraction * cap, cap]``."""
    long_history_min_fraction: float = 0.75
    """Lower end of the long tail as a fraction of ``max_seq_len``."""
    short_history_median: float = 8.0
    """Median of the log-normal bulk of short histories."""
    short_history_sigma: float = 0.9
    """Log-space standard deviation of the short-history bulk."""

    # User interests and history content.
    preference_concentration: float = 0.1
    """Dirichlet concentration per category of a user's interests (small = few categories)."""
    interest_drift_power: float = 2.0
    """History event at relative position r (0 old .. 1 new) comes from the recent interest
    with probability ``r ** interest_drift_power``, else from the long-term interest."""
    item_zipf_exponent: float = 1.1
    """Zipf exponent of item popularity within a category."""
    action_probs: tuple[float, float, float] = (0.7, 0.25, 0.05)
    """Probabilities of impression / click / conversion events in the history."""
    mean_event_gap_seconds: float = 3600.0
    """Mean gap between consecutive history timestamps."""

    # Candidate ad.
    ad_interest_prob: float = 0.5
    """Probability that the ad category is drawn from the user's recent interest (else uniform)."""

    # Hidden label model (see README: "How the labels are made").
    recency_decay: float = 0.8
    """Weight of a history event is ``recency_decay ** (events after it)``."""
    action_weights: tuple[float, float, float] = (1.0, 2.0, 4.0)
    """Interest weight of impression / click / conversion events."""
    ctr_bias: float = -3.2
    """Intercept of the CTR logit."""
    ctr_interest_weight: float = 4.5
    """Weight of the recency-weighted interest match in the CTR logit (the sequence signal)."""
    ad_quality_std: float = 0.5
    """Standard deviation of the per-ad CTR quality term."""
    user_feature_std: float = 0.25
    """Standard deviation of per-segment / device / region bias terms (weak signal)."""
    dense_weight_std: float = 0.12
    """Standard deviation of each dense feature weight (weak signal)."""
    cvr_bias: float = -1.5
    """Intercept of the post-click conversion logit."""
    cvr_interest_weight: float = 2.0
    """Weight of the interest match in the post-click conversion logit."""
    ad_cvr_quality_std: float = 0.5
    """Standard deviation of the per-ad conversion quality term."""

    def __post_init__(self) -> None:
        def _require(condition: bool, message: str) -> None:
            if not condition:
                raise ValueError(f"SyntheticConfig: {message}")

        for name in _INT_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"SyntheticConfig: {name} must be an int, got {value!r}")
        _require(self.seed >= 0, f"seed must be >= 0, got {self.seed}")
        _require(self.max_seq_len >= 1, f"max_seq_len must be >= 1, got {self.max_seq_len}")
        for name in (
            "num_items",
            "num_categories",
            "num_users",
            "num_user_segments",
            "max_user_segments",
            "num_device_types",
            "num_regions",
            "num_dense_features",
        ):
            _require(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        _require(
            self.num_items >= self.num_categories,
            f"num_items ({self.num_items}) must be >= num_categories ({self.num_categories})",
        )
        _require(
            self.num_ads >= self.num_categories,
            f"num_ads ({self.num_ads}) must be >= num_categories ({self.num_categories})",
        )
        _require(
            self.max_user_segments <= self.num_user_segments,
            "max_user_segments must be <= num_user_segments",
        )
        for name, kind in self.__dataclass_fields__.items():
            value = getattr(self, name)
            if kind.type in ("float", float):
                if not isinstance(value, (int, float)) or isinstance(value, bool):
                    raise TypeError(f"SyntheticConfig: {name} must be a number, got {value!r}")
                _require(math.isfinite(value), f"{name} must be finite, got {value}")
        for name in (
            "ad_quality_std", "user_feature_std", "dense_weight_std", "ad_cvr_quality_std",
        ):  # fmt: skip
            _require(getattr(self, name) >= 0.0, f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("empty_history_prob", "long_history_prob", "ad_interest_prob"):
            value = getattr(self, name)
            _require(0.0 <= value <= 1.0, f"{name} must be in [0, 1], got {value}")
        _require(
            self.empty_history_prob + self.long_history_prob <= 1.0,
            "empty_history_prob + long_history_prob must be <= 1",
        )
        _require(
            0.0 <= self.long_history_min_fraction <= 1.0,
            "long_history_min_fraction must be in [0, 1]",
        )
        _require(self.short_history_median >= 1.0, "short_history_median must be >= 1")
        _require(self.short_history_sigma >= 0.0, "short_history_sigma must be >= 0")
        _require(self.preference_concentration > 0.0, "preference_concentration must be > 0")
        _require(self.interest_drift_power >= 0.0, "interest_drift_power must be >= 0")
        _require(self.item_zipf_exponent >= 0.0, "item_zipf_exponent must be >= 0")
        _require(0.0 < self.recency_decay <= 1.0, "recency_decay must be in (0, 1]")
        _require(self.mean_event_gap_seconds >= 0.0, "mean_event_gap_seconds must be >= 0")
        for name in ("action_probs", "action_weights"):
            value = tuple(getattr(self, name))
            _require(
                len(value) == NUM_ACTION_TYPES and all(0 <= v < math.inf for v in value),
                f"{name} must be {NUM_ACTION_TYPES} finite non-negative numbers, got {value}",
            )
            object.__setattr__(self, name, tuple(float(v) for v in value))
        _require(
            abs(sum(self.action_probs) - 1.0) < 1e-6,
            f"action_probs must sum to 1, got {self.action_probs}",
        )
        _require(sum(self.action_weights) > 0, "action_weights must not all be zero")

    @classmethod
    def gpu_scale(cls, max_seq_len: int, **overrides: Any) -> SyntheticConfig:
        """A config with GEM-like history lengths for ``max_seq_len`` in the thousands.

        The length fields scale with the cap (every other field keeps its default):
        1% empty histories, 35% heavy users uniform in ``[0.6, 1] * max_seq_len``, the rest a
        log-normal bulk with median ``max_seq_len / 4`` and sigma 0.9, clipped to the cap.
        Lengths are then heavy-tailed, fill half the cap on average (mean ~0.50, median
        ~0.48 of ``max_seq_len``; a tenth of the histories are shorter than a tenth of it) and
        ~4% are exactly at the cap (users whose activity outgrew the window). ``overrides``
        replace any field, these included, e.g.
        ``SyntheticConfig.gpu_scale(4096, seed=1, num_items=1_000_000)``.
        """
        if not isinstance(max_seq_len, int) or isinstance(max_seq_len, bool):
            raise TypeError(
                f"SyntheticConfig.gpu_scale: max_seq_len must be an int, got {max_seq_len!r}"
            )
        if max_seq_len < 1:
            raise ValueError(
                f"SyntheticConfig.gpu_scale: max_seq_len must be >= 1, got {max_seq_len}"
            )
        names = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise TypeError(f"SyntheticConfig.gpu_scale: unknown fields {unknown}")
        lengths = {
            "empty_history_prob": 0.01,
            "long_history_prob": 0.35,
            "long_history_min_fraction": 0.6,
            "short_history_median": max(1.0, 0.25 * max_seq_len),
            "short_history_sigma": 0.9,
        }
        return cls(max_seq_len=max_seq_len, **{**lengths, **overrides})

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly dict of every field (tuples become lists)."""
        return {
            key: list(value) if isinstance(value, tuple) else value
            for key, value in dataclasses.asdict(self).items()
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SyntheticConfig:
        """Inverse of :meth:`to_dict`; unknown keys raise ``ValueError``."""
        names = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"SyntheticConfig.from_dict: unknown fields {unknown}")
        values = {
            key: tuple(value) if isinstance(value, list) else value for key, value in data.items()
        }
        return cls(**values)
