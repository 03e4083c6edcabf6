"""GPU-scale lengths (``SyntheticConfig.gpu_scale``), the chunked generation path, exactness of
the fast searches, and a pin on the default data (the tiny recipe's dataset must not move)."""

from __future__ import annotations

import hashlib

import gem_data.synthetic as synthetic
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from gem_data import (
    ParquetBatchLoader,
    SyntheticConfig,
    generate_table,
    reference_normalized_entropy,
    sample_history_lengths,
    write_synthetic_dataset,
)


def _lengths(table: pa.Table) -> np.ndarray:
    return np.diff(table.column("hist_item_ids").combine_chunks().offsets.to_numpy())


@pytest.fixture(scope="module")
def gpu_config() -> SyntheticConfig:
    return SyntheticConfig.gpu_scale(1024, seed=3)


@pytest.fixture(scope="module")
def gpu_table(gpu_config) -> pa.Table:
    return generate_table(gpu_config, 0, 4000)


def test_gpu_scale_lengths_fill_half_the_cap(gpu_table, gpu_config):
    lengths = _lengths(gpu_table)
    cap = gpu_config.max_seq_len
    assert lengths.max() == cap and (lengths <= cap).all()
    assert 0.45 < lengths.mean() / cap < 0.55
    assert 0.02 < (lengths == cap).mean() < 0.07  # a few % exactly at the cap
    assert 0.002 < (lengths == 0).mean() < 0.03  # a few empty
    assert 0.05 < (lengths < 0.1 * cap).mean() < 0.2  # and a real spread of light users


@pytest.mark.parametrize("max_seq_len", [1024, 2048, 4096])
def test_gpu_scale_length_distribution_scales_with_the_cap(max_seq_len):
    config = SyntheticConfig.gpu_scale(max_seq_len)
    lengths = sample_history_lengths(config, 50_000, 0)
    assert lengths.max() == max_seq_len
    assert 0.48 < lengths.mean() / max_seq_len < 0.52
    assert 0.03 < (lengths == max_seq_len).mean() < 0.055
    assert 0.007 < (lengths == 0).mean() < 0.013


def test_gpu_scale_4096_stays_within_the_cap():
    lengths = _lengths(generate_table(SyntheticConfig.gpu_scale(4096), 0, 400))
    assert (lengths <= 4096).all() and (lengths == 4096).any()
    assert 0.4 < lengths.mean() / 4096 < 0.6


def test_gpu_scale_keeps_other_defaults_and_takes_overrides():
    config = SyntheticConfig.gpu_scale(2048, seed=5, num_items=50_000, long_history_prob=0.2)
    default = SyntheticConfig()
    assert (config.max_seq_len, config.seed, config.num_items) == (2048, 5, 50_000)
    assert config.long_history_prob == 0.2
    assert config.short_history_median == 512.0
    assert config.num_categories == default.num_categories
    assert config.recency_decay == default.recency_decay
    assert SyntheticConfig.from_dict(config.to_dict()) == config


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "message"),
    [
        ((0,), {}, ValueError, "max_seq_len"),
        ((-4,), {}, ValueError, "max_seq_len"),
        ((1024.0,), {}, TypeError, "max_seq_len"),
        ((True,), {}, TypeError, "max_seq_len"),
        ((1024,), {"bogus": 1}, TypeError, "bogus"),
        ((1024,), {"long_history_prob": 1.5}, ValueError, "long_history_prob"),
        ((1024,), {"empty_history_prob": 0.7}, ValueError, "long_history_prob"),
        ((1024,), {"short_history_median": 0.5}, ValueError, "short_history_median"),
        ((1024,), {"short_history_sigma": -1.0}, ValueError, "short_history_sigma"),
        ((1024,), {"long_history_min_fraction": 2.0}, ValueError, "long_history_min_fraction"),
    ],
)
def test_gpu_scale_bad_arguments_name_the_argument(args, kwargs, error, message):
    with pytest.raises(error, match=message):
        SyntheticConfig.gpu_scale(*args, **kwargs)


def test_gpu_scale_samples_are_pure_functions_of_seed_and_index(gpu_config, gpu_table, monkeypatch):
    # Smaller internal chunks (16 samples at this cap), so chunk edges fall elsewhere.
    monkeypatch.setattr(synthetic, "_CHUNK_EVENTS", 1 << 14)
    pieces = [generate_table(gpu_config, lo, hi - lo) for lo, hi in ((0, 1), (1, 37), (37, 500))]
    assert pa.concat_tables(pieces).equals(gpu_table.slice(0, 500))
    assert generate_table(gpu_config, 321, 1).equals(gpu_table.slice(321, 1).combine_chunks())
    assert generate_table(gpu_config, 0, 500).equals(gpu_table.slice(0, 500))
    other = generate_table(SyntheticConfig.gpu_scale(1024, seed=4), 0, 50)
    assert not other.column("hist_item_ids").equals(gpu_table.column("hist_item_ids").slice(0, 50))


def test_chunked_generation_matches_one_chunk(monkeypatch):
    config = SyntheticConfig(seed=11)
    whole = generate_table(config, 5, 700)
    reference = reference_normalized_entropy(config, 700, start_index=5)
    monkeypatch.setattr(synthetic, "_CHUNK_EVENTS", 1000)  # 7 samples per chunk
    assert generate_table(config, 5, 700).equals(whole)
    assert reference_normalized_entropy(config, 700, start_index=5) == reference
    assert generate_table(config, 5, 0).num_rows == 0


def test_gpu_scale_writer_matches_generate_table(tmp_path):
    config = SyntheticConfig.gpu_scale(512, seed=2)
    info = write_synthetic_dataset(
        config,
        tmp_path,
        num_samples=300,
        num_shards=3,
        workers=2,
        progress=False,
        row_group_size=64,
    )
    written = pa.concat_tables([pq.read_table(path) for path in info.files])
    assert written.equals(generate_table(config, 0, 300))
    assert info.max_seq_len == 512
    batch = next(iter(ParquetBatchLoader(tmp_path, 64, shuffle=False)))
    assert batch.batch_size == 64


def test_item_search_is_exact():
    config = SyntheticConfig(seed=5, num_items=3000, num_categories=7)
    keys = synthetic.hidden_parameters(config).item_popularity_keys
    rng = np.random.default_rng(0)
    category = rng.integers(0, 7, 50_000)
    uniforms = rng.random(50_000)
    # Adversarial queries: exactly on keys, on guide edges, just below 1.
    picked = rng.integers(0, len(keys), 5000)
    category[:5000] = np.floor(keys[picked]).astype(np.int64) % 7
    uniforms[:5000] = keys[picked] - np.floor(keys[picked])
    uniforms[5000:6000] = np.floor(uniforms[5000:6000] * 1024) / 1024
    uniforms[6000:6100] = np.nextafter(1.0, 0.0)
    expected = np.searchsorted(keys, category + uniforms, side="right")
    np.testing.assert_array_equal(synthetic._search_item_keys(config, category, uniforms), expected)


@pytest.mark.parametrize("width", [1, 2, 5, 32, 100])
def test_row_pick_is_exact(width):
    rng = np.random.default_rng(width)
    gammas = rng.standard_gamma(0.1, (200, width))
    gammas[:5] = 0.0  # degenerate rows fall back to uniform
    gammas[5:10, 1:] = 1e-320  # near-ties
    cdf = synthetic._row_cdf(gammas)
    cdf[10] = np.round(cdf[10] * 8) / 8  # values on the guide's slice edges
    rows = rng.integers(0, 200, 40_000)
    uniforms = rng.random(40_000)
    uniforms[:2000] = cdf[rows[:2000], rng.integers(0, width, 2000)] % 1.0  # ties
    uniforms[2000:3000] = np.floor(uniforms[2000:3000] * 64) / 64
    np.testing.assert_array_equal(
        synthetic._pick_from_rows(cdf, rows, uniforms), synthetic._pick(cdf[rows], uniforms)
    )


def _digest(table: pa.Table) -> str:
    digest = hashlib.sha256()
    for name in table.column_names:
        column = table.column(name).combine_chunks()
        digest.update(name.encode())
        if pa.types.is_list(column.type):
            digest.update((column.offsets.to_numpy() - column.offsets[0].as_py()).tobytes())
            column = column.flatten()
        elif pa.types.is_fixed_size_list(column.type):
            column = column.flatten()
        digest.update(column.to_numpy().tobytes())
    return digest.hexdigest()


def test_default_data_is_pinned():
    """The tiny recipe's data, digests taken before the GPU-scale work: it must not move."""
    assert (
        _digest(generate_table(SyntheticConfig(), 0, 2000))
        == "f29227d70c98c06395f1c13c6f7385e9d27467c09c50b2f906881732876b3aef"
    )
    assert (
        _digest(generate_table(SyntheticConfig(seed=7), 10**9, 300))
        == "8a7a2cf0c15fd603ddffd533c4ca528adb41d437eb749adbbc6f7e3d520581f1"
    )
