"""Deterministic synthetic GEM-like samples with a hidden, sequence-driven label model.

Every sample is a pure function of ``(config, index)``: its random draws come from
``numpy.random.default_rng([seed, index])`` in a fixed order, and everything after the
draws is element-wise (or an in-order per-sample sum), so a sample does not depend on
which chunk, shard or worker produced it. The hidden parameters (item and ad
categories, ad quality, feature biases) depend on the seed and cardinalities only.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from gem_data.config import NUM_ACTION_TYPES, SyntheticConfig
from gem_data.schema import dataset_schema

__all__ = [
    "HiddenParameters",
    "hidden_parameters",
    "generate_table",
    "normalized_entropy",
    "reference_normalized_entropy",
    "sample_history_lengths",
]

_TIMESTAMP_ORIGIN = 1_600_000_000  # 2020-09-13, seconds
_TIMESTAMP_SPAN = 100_000_000  # ~3 years of possible history starts
# Entropy word that separates the hidden-parameter stream from the per-sample streams.
_HIDDEN_STREAM = 0x6E6D5F68
# Fixed per-sample scalar uniforms, by position in the first draw.
(
    _U_MIXTURE,
    _U_TAIL,
    _U_AD_SOURCE,
    _U_AD_CATEGORY,
    _U_AD_PICK,
    _U_CLICK,
    _U_CONV,
    _U_TIME,
    _U_USER,
    _U_DEVICE,
    _U_REGION,
    _U_NUM_SEGMENTS,
) = range(12)
_NUM_SCALARS = 12  # followed by max_user_segments uniforms for the segment ids
_PROB_EPS = 1e-7
# Limits of the item-search guide table (buckets per category, entries in all).
_MAX_LOG_ITEM_BUCKETS = 16
_MAX_ITEM_GUIDE_ENTRIES = 1 << 22
# Generation chunks hold at most this many history events (see ``_generate``).
_CHUNK_EVENTS = 1 << 19


@dataclass(frozen=True)
class HiddenParameters:
    """The hidden world of one config: a pure function of its seed and cardinalities."""

    item_category: np.ndarray
    """(num_items,) int64: category of every item."""
    category_item_ids: np.ndarray
    """(num_items,) int64: items grouped by category, most popular first within a category."""
    category_item_offsets: np.ndarray
    """(num_categories + 1,) int64: slice of each category in ``category_item_ids``."""
    item_popularity_keys: np.ndarray
    """(num_items,) float64: ``category + Zipf CDF`` aligned with ``category_item_ids``."""
    ad_category: np.ndarray
    """(num_ads,) int64: category of every ad (every category has at least one ad)."""
    category_ad_ids: np.ndarray
    """(num_ads,) int64: ads grouped by category."""
    category_ad_offsets: np.ndarray
    """(num_categories + 1,) int64: slice of each category in ``category_ad_ids``."""
    ad_quality: np.ndarray
    """(num_ads,) float64: per-ad additive CTR logit term."""
    ad_cvr_quality: np.ndarray
    """(num_ads,) float64: per-ad additive post-click conversion logit term."""
    segment_bias: np.ndarray
    """(num_user_segments,) float64: CTR logit term, averaged over a user's segments."""
    device_bias: np.ndarray
    """(num_device_types,) float64: CTR logit term of the device type."""
    region_bias: np.ndarray
    """(num_regions,) float64: CTR logit term of the region."""
    dense_ctr_weights: np.ndarray
    """(num_dense_features,) float64: CTR logit weights of the dense features."""
    dense_cvr_weights: np.ndarray
    """(num_dense_features,) float64: conversion logit weights of the dense features."""


def _group_by_category(category: np.ndarray, order: np.ndarray, num_categories: int):
    """Ids grouped by category (keeping ``order`` within a group) and the group offsets."""
    grouped = order[np.argsort(category[order], kind="stable")]
    counts = np.bincount(category, minlength=num_categories)
    offsets = np.zeros(num_categories + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    return grouped.astype(np.int64), offsets


@functools.lru_cache(maxsize=8)
def hidden_parameters(config: SyntheticConfig) -> HiddenParameters:
    """The hidden parameters of ``config`` (cached per process; a pure function of the seed)."""
    rng = np.random.default_rng([config.seed, _HIDDEN_STREAM])
    num_categories = config.num_categories

    # Items: balanced categories, random popularity order inside each category.
    item_category = rng.permutation(np.arange(config.num_items) % num_categories).astype(np.int64)
    category_item_ids, category_item_offsets = _group_by_category(
        item_category, rng.permutation(config.num_items), num_categories
    )
    keys = np.empty(config.num_items, dtype=np.float64)
    for category in range(num_categories):
        lo, hi = category_item_offsets[category], category_item_offsets[category + 1]
        weights = np.arange(1, hi - lo + 1, dtype=np.float64) ** -config.item_zipf_exponent
        cdf = np.cumsum(weights) / weights.sum()
        cdf[-1] = 1.0
        keys[lo:hi] = category + cdf

    ad_category = rng.permutation(np.arange(config.num_ads) % num_categories).astype(np.int64)
    category_ad_ids, category_ad_offsets = _group_by_category(
        ad_category, np.arange(config.num_ads), num_categories
    )
    return HiddenParameters(
        item_category=item_category,
        category_item_ids=category_item_ids,
        category_item_offsets=category_item_offsets,
        item_popularity_keys=keys,
        ad_category=ad_category,
        category_ad_ids=category_ad_ids,
        category_ad_offsets=category_ad_offsets,
        ad_quality=rng.normal(0.0, config.ad_quality_std, config.num_ads),
        ad_cvr_quality=rng.normal(0.0, config.ad_cvr_quality_std, config.num_ads),
        segment_bias=rng.normal(0.0, config.user_feature_std, config.num_user_segments),
        device_bias=rng.normal(0.0, config.user_feature_std, config.num_device_types),
        region_bias=rng.normal(0.0, config.user_feature_std, config.num_regions),
        dense_ctr_weights=rng.normal(0.0, config.dense_weight_std, config.num_dense_features),
        dense_cvr_weights=rng.normal(0.0, config.dense_weight_std, config.num_dense_features),
    )


@functools.lru_cache(maxsize=8)
def _item_search_guide(config: SyntheticConfig) -> tuple[np.ndarray, int]:
    """Guide table that turns the item search into a lookup plus a short scan.

    Category ``c``'s keys are split at ``c + b / buckets`` (exact floats: ``buckets`` is a
    power of two); entry ``c * (buckets + 1) + b`` is the number of keys ``<=`` that edge, so
    a query in bucket ``b`` lies between entries ``b`` and ``b + 1``. With about two buckets
    per item a bucket holds half a key on average (Zipf tails hold a few), so the scan is
    short and the result is exactly ``searchsorted(keys, query, side="right")``.
    """
    keys = hidden_parameters(config).item_popularity_keys
    num_categories = config.num_categories
    items_per_category = -(-config.num_items // num_categories)
    # Bounded so the table stays small (it is read at random once per event).
    log_buckets = min(
        (2 * items_per_category - 1).bit_length(),
        _MAX_LOG_ITEM_BUCKETS,
        max(0, (_MAX_ITEM_GUIDE_ENTRIES // num_categories).bit_length() - 1),
    )
    buckets = 1 << log_buckets
    edges = np.arange(num_categories)[:, None] + np.arange(buckets + 1) / buckets
    guide = np.searchsorted(keys, edges.reshape(-1), side="right")
    return guide.astype(np.int32 if len(keys) < 2**31 else np.int64), buckets


def _search_item_keys(
    config: SyntheticConfig, category: np.ndarray, uniforms: np.ndarray
) -> np.ndarray:
    """``searchsorted(item_popularity_keys, category + uniforms, side="right")``, faster.

    A plain binary search over all items costs ~15 dependent cache misses per event; the guide
    table narrows each query to a handful of keys first.
    """
    keys = hidden_parameters(config).item_popularity_keys
    guide, buckets = _item_search_guide(config)
    query = category + uniforms
    # query - category is exact (Sterbenz; query itself for category 0) and in [0, 1]; a query
    # rounded up to category + 1 is still inside the last bucket's closed upper edge.
    bucket = np.minimum(((query - category) * buckets).astype(np.int64), buckets - 1)
    entry = category * (buckets + 1) + bucket
    return _advance(keys, guide[entry], guide[entry + 1], query)


@functools.lru_cache(maxsize=8)
def _recency_weights(config: SyntheticConfig) -> np.ndarray:
    """``recency_decay ** k`` for ``k < max_seq_len``, one table instead of a power per event.

    Computed by the same vectorised ``**`` as per event, so the values are identical.
    """
    return config.recency_decay ** np.arange(config.max_seq_len, dtype=np.float64)


def _history_length(config: SyntheticConfig, u_mixture: float, u_tail: float, z: float) -> int:
    cap = config.max_seq_len
    if u_mixture < config.empty_history_prob:
        return 0
    if u_mixture < config.empty_history_prob + config.long_history_prob:
        low = max(1, math.ceil(config.long_history_min_fraction * cap))
        return min(cap, low + int(u_tail * (cap - low + 1)))
    length = round(config.short_history_median * math.exp(config.short_history_sigma * z))
    return min(cap, max(1, length))


def sample_history_lengths(
    config: SyntheticConfig, num_samples: int, rng: np.random.Generator | int | None = None
) -> np.ndarray:
    """``num_samples`` i.i.d. history lengths from the generator's length distribution.

    The same mixture as the samples (empty, uniform tail near the cap, log-normal bulk) drawn
    vectorized from one generator: for simulations at scale (balance studies), not the lengths
    of particular samples.
    """
    if not isinstance(num_samples, (int, np.integer)) or num_samples < 0:
        raise ValueError(f"num_samples must be an int >= 0, got {num_samples!r}")
    rng = np.random.default_rng(rng)
    cap = config.max_seq_len
    u_mixture, u_tail = rng.random(num_samples), rng.random(num_samples)
    z = rng.standard_normal(num_samples)
    bulk = np.rint(config.short_history_median * np.exp(config.short_history_sigma * z))
    lengths = np.clip(bulk, 1, cap).astype(np.int64)
    low = max(1, math.ceil(config.long_history_min_fraction * cap))
    tail = np.minimum(cap, low + (u_tail * (cap - low + 1)).astype(np.int64))
    in_tail = u_mixture < config.empty_history_prob + config.long_history_prob
    lengths[in_tail] = tail[in_tail]
    lengths[u_mixture < config.empty_history_prob] = 0
    return lengths


def _draw(config: SyntheticConfig, start_index: int, num_samples: int) -> dict[str, np.ndarray]:
    """All random draws of the samples, one generator per sample, in a fixed order."""
    num_dense = config.num_dense_features
    num_scalars = _NUM_SCALARS + config.max_user_segments
    alpha = config.preference_concentration
    num_gammas = 2 * config.num_categories

    scalars = np.empty((num_samples, num_scalars))
    normals = np.empty((num_samples, 1 + num_dense))
    gammas = np.empty((num_samples, num_gammas))
    lengths = np.empty(num_samples, dtype=np.int64)
    history_uniforms: list[np.ndarray] = []
    for row in range(num_samples):
        # default_rng([seed, index]) spelt out: the same generator without its argument checks.
        rng = np.random.Generator(
            np.random.PCG64(np.random.SeedSequence([config.seed, start_index + row]))
        )
        u = rng.random(num_scalars)
        z = rng.standard_normal(1 + num_dense)
        scalars[row] = u
        normals[row] = z
        gammas[row] = rng.standard_gamma(alpha, num_gammas)
        length = _history_length(config, float(u[_U_MIXTURE]), float(u[_U_TAIL]), float(z[0]))
        lengths[row] = length
        if length:
            # Rows: interest source, category, item popularity, action, time gap.
            history_uniforms.append(rng.random(5 * length).reshape(5, length))
    return {
        "scalars": scalars,
        "normals": normals,
        "gammas": gammas,
        "lengths": lengths,
        "history_uniforms": (
            np.concatenate(history_uniforms, axis=1) if history_uniforms else np.empty((5, 0))
        ),
    }


def _row_cdf(weights: np.ndarray) -> np.ndarray:
    """Row-wise CDF (cumsum divided by the row's last cumsum: no order-dependent reduction)."""
    cumulative = np.cumsum(weights, axis=1)
    total = cumulative[:, -1:]
    degenerate = total[:, 0] <= 0.0  # every gamma draw underflowed: fall back to uniform
    if degenerate.any():
        cumulative[degenerate] = np.arange(1, weights.shape[1] + 1, dtype=np.float64)
        total = cumulative[:, -1:]
    return cumulative / total


def _pick(cdf_rows: np.ndarray, uniforms: np.ndarray) -> np.ndarray:
    """Inverse-CDF pick, one per row: the number of CDF entries <= u, clipped."""
    return np.minimum((cdf_rows <= uniforms[:, None]).sum(axis=1), cdf_rows.shape[1] - 1)


def _pick_from_rows(cdf_rows: np.ndarray, rows: np.ndarray, uniforms: np.ndarray) -> np.ndarray:
    """``_pick(cdf_rows[rows], uniforms)`` without materialising one CDF row per pick.

    Every row gets a guide over ``buckets`` equal slices of [0, 1]: entry ``g`` counts the
    row's CDF values ``<= g / buckets``. A pick in slice ``g`` starts from that count and scans
    the values inside the slice (half a value on average, as there are two slices per value),
    so the result is exactly the number of values ``<= u``. ``buckets`` is a power of two:
    scaling by it is exact, so the slice of ``u`` and the guide counts have no rounding.
    """
    num_rows, width = cdf_rows.shape
    buckets = 1 << (2 * width - 1).bit_length()
    # cdf <= g / buckets  <=>  ceil(cdf * buckets) <= g
    first_slice = np.ceil(cdf_rows * buckets).astype(np.int64)
    row_entry = np.arange(num_rows)[:, None] * (buckets + 1)
    counts = np.bincount((row_entry + first_slice).reshape(-1), minlength=num_rows * (buckets + 1))
    guide = np.cumsum(counts.reshape(num_rows, buckets + 1), axis=1)
    guide += np.arange(0, num_rows * width, width)[:, None]  # positions in the flat CDF array
    entry = rows * (buckets + 1) + (uniforms * buckets).astype(np.int64)
    guide = guide.reshape(-1)
    position = _advance(cdf_rows.reshape(-1), guide[entry], guide[entry + 1], uniforms)
    return np.minimum(position - rows * width, width - 1)


def _advance(
    keys: np.ndarray, position: np.ndarray, end: np.ndarray, queries: np.ndarray
) -> np.ndarray:
    """Moves each ``position`` past the keys ``<= query``, up to ``end`` (keys sorted there)."""
    active = np.flatnonzero(position < end)
    while active.size:
        active = active[keys[position[active]] <= queries[active]]
        position[active] += 1
        active = active[position[active] < end[active]]
    return position


def _uniform_int(uniforms: np.ndarray, high: int | np.ndarray) -> np.ndarray:
    """Integers uniform in ``[0, high)`` from uniforms in ``[0, 1)``."""
    return np.minimum(np.floor(uniforms * high).astype(np.int64), np.asarray(high) - 1)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _segment_sum(values: np.ndarray, segment_ids: np.ndarray, num_segments: int) -> np.ndarray:
    # bincount adds in input order, so each segment's sum does not depend on its neighbours.
    return np.bincount(segment_ids, weights=values, minlength=num_segments)


def _generate_chunk(
    config: SyntheticConfig, start_index: int, num_samples: int
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Columns of samples ``[start_index, start_index + num_samples)`` and hidden diagnostics.

    Returns ``(columns, hidden)``; list columns are given as ``(offsets, values)`` pairs.
    ``hidden`` has ``interest`` and the CTR / CVR logits without the interest term.
    """
    hidden = hidden_parameters(config)
    draws = _draw(config, start_index, num_samples)
    num_categories = config.num_categories
    scalars, normals = draws["scalars"], draws["normals"]
    lengths = draws["lengths"]
    u_source, u_category, u_item, u_action, u_gap = draws["history_uniforms"]

    offsets = np.zeros(num_samples + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    num_events = int(offsets[-1])
    event_sample = np.repeat(np.arange(num_samples), lengths)
    event_position = np.arange(num_events) - offsets[:-1][event_sample]  # 0 = oldest
    # Per-sample values are spread to the events with repeat (a copy) rather than a gather.
    event_length = np.repeat(lengths, lengths)

    # Interests: long-term and recent category distributions per user.
    # Stored as rows 2i (long-term) and 2i + 1 (recent) of one array for the history picks.
    interest_cdf = np.empty((num_samples, 2, num_categories))
    interest_cdf[:, 0] = _row_cdf(draws["gammas"][:, :num_categories])
    interest_cdf[:, 1] = _row_cdf(draws["gammas"][:, num_categories:])
    recent_cdf = interest_cdf[:, 1]

    # History categories drift from the long-term to the recent interest.
    relative_position = (event_position + 1) / event_length
    from_recent = u_source < relative_position**config.interest_drift_power
    hist_category = _pick_from_rows(
        interest_cdf.reshape(2 * num_samples, num_categories),
        2 * event_sample + from_recent,
        u_category,
    )

    # Items: Zipf popularity inside the category (keys are category + CDF, so one search).
    position = _search_item_keys(config, hist_category, u_item)
    position = np.clip(
        position,
        hidden.category_item_offsets[hist_category],
        hidden.category_item_offsets[hist_category + 1] - 1,
    )
    hist_item = hidden.category_item_ids[position]

    # Inverse CDF of the action: the number of CDF entries <= u, clipped to the last action
    # (so the last entry, ~1, needs no compare), one vectorised compare per entry.
    hist_action = np.zeros(num_events, dtype=np.int64)
    for edge in np.cumsum(config.action_probs)[: NUM_ACTION_TYPES - 1]:
        hist_action += edge <= u_action

    # Strictly increasing integer timestamps (exact int64 arithmetic).
    gaps = 1 + np.floor(-config.mean_event_gap_seconds * np.log1p(-u_gap)).astype(np.int64)
    cumulative_gaps = np.cumsum(gaps)
    gap_before_sample = np.zeros(num_samples, dtype=np.int64)
    after_events = offsets[:-1] > 0
    gap_before_sample[after_events] = cumulative_gaps[offsets[:-1][after_events] - 1]
    history_start = _TIMESTAMP_ORIGIN + np.floor(scalars[:, _U_TIME] * _TIMESTAMP_SPAN).astype(
        np.int64
    )
    hist_timestamp = np.repeat(history_start - gap_before_sample, lengths) + cumulative_gaps

    # User features: 1..max distinct segments (drawn with replacement, duplicates removed).
    max_segments = config.max_user_segments
    segment_count = 1 + _uniform_int(scalars[:, _U_NUM_SEGMENTS], max_segments)
    segment_draws = np.floor(scalars[:, _NUM_SCALARS:] * config.num_user_segments).astype(np.int64)
    sentinel = config.num_user_segments
    segment_draws[np.arange(max_segments)[None, :] >= segment_count[:, None]] = sentinel
    segment_draws.sort(axis=1)
    keep = segment_draws != sentinel
    keep[:, 1:] &= segment_draws[:, 1:] != segment_draws[:, :-1]
    segment_lengths = keep.sum(axis=1)
    segment_offsets = np.zeros(num_samples + 1, dtype=np.int64)
    np.cumsum(segment_lengths, out=segment_offsets[1:])
    user_segments = segment_draws[keep]
    user_id = _uniform_int(scalars[:, _U_USER], config.num_users)
    device_type = _uniform_int(scalars[:, _U_DEVICE], config.num_device_types)
    region = _uniform_int(scalars[:, _U_REGION], config.num_regions)

    # Candidate ad: category from the recent interest or uniform; ad uniform within category.
    from_interest = scalars[:, _U_AD_SOURCE] < config.ad_interest_prob
    ad_category = np.where(
        from_interest,
        _pick(recent_cdf, scalars[:, _U_AD_CATEGORY]),
        _uniform_int(scalars[:, _U_AD_CATEGORY], num_categories),
    )
    ads_in_category = np.diff(hidden.category_ad_offsets)[ad_category]
    ad_pick = _uniform_int(scalars[:, _U_AD_PICK], ads_in_category)
    ad_id = hidden.category_ad_ids[hidden.category_ad_offsets[ad_category] + ad_pick]

    dense = normals[:, 1:].astype(np.float32)
    dense64 = dense.astype(np.float64)

    # Hidden label model. Interest: recency- and action-weighted share of history events whose
    # category equals the ad's category.
    events_after = event_length - 1 - event_position
    event_weight = (
        np.asarray(config.action_weights)[hist_action] * _recency_weights(config)[events_after]
    )
    matches = hist_category == np.repeat(ad_category, lengths)
    weight_total = _segment_sum(event_weight, event_sample, num_samples)
    weight_matched = _segment_sum(event_weight * matches, event_sample, num_samples)
    interest = np.where(weight_total > 0, weight_matched / np.maximum(weight_total, 1e-300), 0.0)

    segment_sample = np.repeat(np.arange(num_samples), segment_lengths)
    segment_term = _segment_sum(
        hidden.segment_bias[user_segments], segment_sample, num_samples
    ) / np.maximum(segment_lengths, 1)
    user_term = segment_term + hidden.device_bias[device_type] + hidden.region_bias[region]
    dense_ctr = np.zeros(num_samples)
    dense_cvr = np.zeros(num_samples)
    for column in range(config.num_dense_features):  # explicit sum: independent of batch shape
        dense_ctr += dense64[:, column] * hidden.dense_ctr_weights[column]
        dense_cvr += dense64[:, column] * hidden.dense_cvr_weights[column]

    ctr_base = config.ctr_bias + hidden.ad_quality[ad_id] + user_term + dense_ctr
    cvr_base = config.cvr_bias + hidden.ad_cvr_quality[ad_id] + dense_cvr
    click_prob = _sigmoid(ctr_base + config.ctr_interest_weight * interest)
    conversion_given_click = _sigmoid(cvr_base + config.cvr_interest_weight * interest)
    click = scalars[:, _U_CLICK] < click_prob
    conversion = click & (scalars[:, _U_CONV] < conversion_given_click)

    columns = {
        "sample_index": np.arange(start_index, start_index + num_samples, dtype=np.int64),
        "user_id": user_id,
        "hist_item_ids": (offsets, hist_item),
        "hist_category_ids": (offsets, hist_category.astype(np.int64)),
        "hist_action_types": (offsets, hist_action),
        "hist_timestamps": (offsets, hist_timestamp),
        "user_segments": (segment_offsets, user_segments),
        "device_type": device_type,
        "region": region,
        "ad_id": ad_id,
        "ad_category_id": ad_category.astype(np.int64),
        "dense_features": dense,
        "click": click.astype(np.float32),
        "conversion": conversion.astype(np.float32),
        "click_prob": click_prob.astype(np.float32),
        "conversion_prob": (click_prob * conversion_given_click).astype(np.float32),
    }
    return columns, {"interest": interest, "ctr_base": ctr_base, "cvr_base": cvr_base}


def _columns_to_table(columns: dict[str, object], num_dense_features: int) -> pa.Table:
    schema = dataset_schema(num_dense_features)
    arrays = []
    for field in schema:
        column = columns[field.name]
        if pa.types.is_fixed_size_list(field.type):
            flat = pa.array(np.ascontiguousarray(column).reshape(-1), type=pa.float32())
            arrays.append(pa.FixedSizeListArray.from_arrays(flat, num_dense_features))
        elif pa.types.is_list(field.type):
            offsets, values = column
            if int(offsets[-1]) >= 2**31:
                raise ValueError(f"too many values in {field.name!r} for one chunk: {offsets[-1]}")
            arrays.append(
                pa.ListArray.from_arrays(
                    pa.array(offsets.astype(np.int32)), pa.array(values, type=pa.int64())
                )
            )
        else:
            arrays.append(pa.array(column, type=field.type))
    return pa.Table.from_arrays(arrays, schema=schema)


def _check_range(start_index: int, num_samples: int) -> None:
    for name, value in (("start_index", start_index), ("num_samples", num_samples)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")


#: Labels, true probabilities and hidden terms that ``_generate`` returns besides the table.
_SAMPLE_ARRAYS = ("click", "conversion", "click_prob", "conversion_prob")


def _generate(
    config: SyntheticConfig, start_index: int, num_samples: int
) -> tuple[pa.Table, dict[str, np.ndarray]]:
    """Samples ``[start_index, start_index + num_samples)`` as a table, plus flat arrays.

    Generated in chunks of at most ``_CHUNK_EVENTS // max_seq_len`` samples: per-event
    temporaries then stay small (cache-resident, no page faults on fresh allocations) and the
    memory does not grow with ``num_samples`` (at ``max_seq_len`` 4096 one chunk of 4096
    samples would hold ~8M events and several GB of temporaries). Samples do not depend on the
    chunking. The arrays are ``_SAMPLE_ARRAYS`` and ``_generate_chunk``'s hidden terms.
    """
    step = max(1, _CHUNK_EVENTS // config.max_seq_len)
    bounds = [
        (lo, min(step, start_index + num_samples - lo))
        for lo in range(start_index, start_index + num_samples, step)
    ] or [(start_index, 0)]
    tables, parts = [], []
    for lo, count in bounds:
        columns, hidden = _generate_chunk(config, lo, count)
        tables.append(_columns_to_table(columns, config.num_dense_features))
        parts.append({**{name: columns[name] for name in _SAMPLE_ARRAYS}, **hidden})
    # Not combined: a copy of every event, and Parquet writes the same pages either way.
    table = pa.concat_tables(tables)
    arrays = {key: np.concatenate([part[key] for part in parts]) for key in parts[0]}
    return table, arrays


def generate_table(config: SyntheticConfig, start_index: int, num_samples: int) -> pa.Table:
    """Samples ``[start_index, start_index + num_samples)`` as a table with the dataset schema."""
    _check_range(start_index, num_samples)
    return _generate(config, int(start_index), int(num_samples))[0]


def _logloss_sum(probs: np.ndarray, labels: np.ndarray) -> float:
    p = np.clip(np.asarray(probs, dtype=np.float64), _PROB_EPS, 1.0 - _PROB_EPS)
    y = np.asarray(labels, dtype=np.float64)
    return float(-(y * np.log(p) + (1.0 - y) * np.log1p(-p)).sum())


def _binary_entropy(rate: float) -> float:
    rate = min(max(rate, _PROB_EPS), 1.0 - _PROB_EPS)
    return float(-(rate * np.log(rate) + (1.0 - rate) * np.log1p(-rate)))


def normalized_entropy(probs: np.ndarray, labels: np.ndarray) -> float:
    """NE = mean log loss of ``probs`` on ``labels`` / entropy of the mean label (lower is better).

    Probabilities are clipped to ``[1e-7, 1 - 1e-7]``; 1.0 is the NE of predicting the base rate.
    """
    probs = np.asarray(probs)
    labels = np.asarray(labels)
    if probs.shape != labels.shape or probs.ndim != 1 or probs.size == 0:
        raise ValueError(
            f"probs and labels must be equal-length non-empty 1-D arrays, "
            f"got shapes {probs.shape} and {labels.shape}"
        )
    rate = float(labels.astype(np.float64).mean())
    return _logloss_sum(probs, labels) / probs.size / _binary_entropy(rate)


def _interest_quantiles(interest: np.ndarray) -> np.ndarray:
    """The marginal distribution of the interest match, as 256 quantiles of a sample of it."""
    return np.quantile(interest, (np.arange(256) + 0.5) / 256)


def _no_sequence_probs(
    ctr_base: np.ndarray, cvr_base: np.ndarray, quantiles: np.ndarray, config: SyntheticConfig
) -> tuple[np.ndarray, np.ndarray]:
    """Bayes-optimal predictions that do not see the history.

    The interest match is independent of every non-sequence feature (categories are exchangeable
    and the ad is uniform within its category), so the best prediction without the history
    averages the true probability over the marginal distribution of the interest
    (``_interest_quantiles``). Rows are independent: the predictions for a slice of the inputs
    are that slice of the predictions, so the work can be split.
    """
    click = np.empty(len(ctr_base))
    conversion = np.empty_like(click)
    for lo in range(0, len(click), 4096):
        ctr = _sigmoid(ctr_base[lo : lo + 4096, None] + config.ctr_interest_weight * quantiles)
        cvr = _sigmoid(cvr_base[lo : lo + 4096, None] + config.cvr_interest_weight * quantiles)
        click[lo : lo + 4096] = ctr.mean(axis=1)
        conversion[lo : lo + 4096] = (ctr * cvr).mean(axis=1)
    return click, conversion


def reference_normalized_entropy(
    config: SyntheticConfig, num_samples: int = 20_000, start_index: int = 0
) -> dict[str, dict[str, float]]:
    """Oracle NE and the best NE reachable without the history, on a fresh sample.

    Returns ``{"oracle": {"ctr", "cvr"}, "no_sequence": {"ctr", "cvr"}}``. ``oracle`` uses the
    true probabilities; ``no_sequence`` uses the Bayes-optimal prediction from every feature but
    the history (hidden parameters known exactly), so a learned model without a sequence tower
    cannot do better than it; the gap between the two is the value of the sequence.
    """
    _check_range(start_index, num_samples)
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    _, arrays = _generate(config, int(start_index), int(num_samples))
    no_seq_click, no_seq_conversion = _no_sequence_probs(
        arrays["ctr_base"], arrays["cvr_base"], _interest_quantiles(arrays["interest"]), config
    )
    return {
        "oracle": {
            "ctr": normalized_entropy(arrays["click_prob"], arrays["click"]),
            "cvr": normalized_entropy(arrays["conversion_prob"], arrays["conversion"]),
        },
        "no_sequence": {
            "ctr": normalized_entropy(no_seq_click, arrays["click"]),
            "cvr": normalized_entropy(no_seq_conversion, arrays["conversion"]),
        },
    }
