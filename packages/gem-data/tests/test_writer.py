"""Writing shards: round trip, split invariance, dataset.json, argument checks."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from gem_data import (
    DatasetFormatError,
    DatasetInfo,
    dataset_schema,
    generate_table,
    normalized_entropy,
    read_dataset_info,
    write_synthetic_dataset,
)


def _read_all(info: DatasetInfo) -> pa.Table:
    schema = dataset_schema(info.num_dense_features)
    return pa.concat_tables([pq.read_table(path).cast(schema) for path in info.files])


def test_round_trip_equals_generated(dataset, config):
    written = _read_all(dataset)
    assert written.equals(generate_table(config, 0, 600))
    assert [path.name for path in dataset.files] == [
        "part-00000.parquet",
        "part-00001.parquet",
        "part-00002.parquet",
    ]
    # Row groups are sized for streaming: several per file at row_group_size=128.
    assert pq.ParquetFile(dataset.files[0]).num_row_groups == 2
    assert max(pq.ParquetFile(p).metadata.row_group(0).num_rows for p in dataset.files) == 128


def test_content_independent_of_shards_workers_and_splits(tmp_path, dataset, config):
    reference = _read_all(dataset)
    pooled = write_synthetic_dataset(
        config, tmp_path / "pooled", num_samples=600, num_shards=4, workers=2, progress=False
    )
    assert _read_all(pooled).equals(reference)
    # The no-sequence predictions are split over the workers per shard: rows are independent.
    assert pooled.no_sequence_ne == dataset.no_sequence_ne
    first = write_synthetic_dataset(
        config, tmp_path / "a", num_samples=250, num_shards=1, workers=1, progress=False
    )
    second = write_synthetic_dataset(
        config,
        tmp_path / "b",
        num_samples=350,
        start_index=250,
        num_shards=2,
        workers=1,
        progress=False,
    )
    assert second.start_index == 250
    assert pa.concat_tables([_read_all(first), _read_all(second)]).equals(reference)


def test_dataset_info(dataset, config):
    info = read_dataset_info(dataset.directory)
    assert info == dataset
    assert info.config == config
    assert info.num_samples == 600
    assert info.max_seq_len == config.max_seq_len
    assert info.num_dense_features == config.num_dense_features
    assert info.sequence_features == {
        "hist_item_ids": config.num_items,
        "hist_category_ids": config.num_categories,
        "hist_action_types": 3,
    }
    assert info.sparse_features == {
        "user_id": config.num_users,
        "user_segments": config.num_user_segments,
        "device_type": config.num_device_types,
        "region": config.num_regions,
        "ad_id": config.num_ads,
        "ad_category_id": config.num_categories,
    }
    document = json.loads((dataset.directory / "dataset.json").read_text())
    assert sum(entry["num_rows"] for entry in document["files"]) == 600


def test_oracle_ne_matches_parquet_columns(dataset):
    table = _read_all(dataset)
    for task, label, prob in (
        ("ctr", "click", "click_prob"),
        ("cvr", "conversion", "conversion_prob"),
    ):
        labels = table.column(label).to_numpy().astype(np.float64)
        probs = table.column(prob).to_numpy().astype(np.float64)
        # Independent recomputation of NE, no package code involved.
        p = np.clip(probs, 1e-7, 1 - 1e-7)
        rate = labels.mean()
        logloss = -np.mean(labels * np.log(p) + (1 - labels) * np.log(1 - p))
        entropy = -(rate * np.log(rate) + (1 - rate) * np.log(1 - rate))
        assert dataset.oracle_ne[task] == pytest.approx(logloss / entropy, rel=1e-9)
        assert dataset.oracle_ne[task] == pytest.approx(normalized_entropy(probs, labels), rel=1e-9)
        assert dataset.label_means[task] == pytest.approx(rate, rel=1e-9)
        assert dataset.oracle_ne[task] < dataset.no_sequence_ne[task] < 1.05


def test_rewrite_removes_stale_shards(tmp_path, config):
    directory = tmp_path / "data"
    write_synthetic_dataset(
        config, directory, num_samples=50, num_shards=3, workers=1, progress=False
    )
    info = write_synthetic_dataset(
        config, directory, num_samples=40, num_shards=1, workers=1, progress=False
    )
    assert sorted(p.name for p in directory.iterdir()) == ["dataset.json", "part-00000.parquet"]
    assert info.num_samples == 40


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_samples": 0}, "num_samples"),
        ({"num_samples": 10, "num_shards": 0}, "num_shards"),
        ({"num_samples": 3, "num_shards": 4}, "num_shards"),
        ({"num_samples": 10, "workers": 0}, "workers"),
        ({"num_samples": 10, "start_index": -1}, "start_index"),
        ({"num_samples": 10, "row_group_size": 0}, "row_group_size"),
    ],
)
def test_bad_arguments(tmp_path, config, kwargs, message):
    with pytest.raises(ValueError, match=message):
        write_synthetic_dataset(config, tmp_path, progress=False, **kwargs)


def test_config_type_checked(tmp_path):
    with pytest.raises(TypeError, match="SyntheticConfig"):
        write_synthetic_dataset({"seed": 0}, tmp_path, num_samples=10)  # type: ignore[arg-type]


def test_read_dataset_info_errors(tmp_path):
    with pytest.raises(DatasetFormatError, match="dataset.json"):
        read_dataset_info(tmp_path)
    (tmp_path / "dataset.json").write_text("{not json")
    with pytest.raises(DatasetFormatError, match="not a readable JSON"):
        read_dataset_info(tmp_path)
    (tmp_path / "dataset.json").write_text(json.dumps({"format_version": 1}))
    with pytest.raises(DatasetFormatError, match="malformed"):
        read_dataset_info(tmp_path)


def test_writing_does_not_import_torch(tmp_path):
    code = (
        "import sys, gem_data\n"
        f"gem_data.write_synthetic_dataset(gem_data.SyntheticConfig(), {str(tmp_path)!r}, "
        "num_samples=20, num_shards=2, workers=2, progress=False)\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_older_description_without_source_reads_as_synthetic(tmp_path, dataset):
    document = json.loads((dataset.directory / "dataset.json").read_text())
    for key in ("source", "label_probs_known", "metadata"):
        document.pop(key, None)
    (tmp_path / "dataset.json").write_text(json.dumps(document))
    info = read_dataset_info(tmp_path)
    assert info.source == "synthetic" and info.label_probs_known
    assert info.config == dataset.config
    assert info.file_num_rows == [200, 200, 200]


def test_unknown_oracle_ne_is_null_in_json_and_nan_in_python(tmp_path, dataset):
    document = json.loads((dataset.directory / "dataset.json").read_text())
    document.update(
        source="interactions",
        label_probs_known=False,
        config=None,
        oracle_ne={"ctr": None, "cvr": None},
    )
    (tmp_path / "dataset.json").write_text(json.dumps(document))
    info = read_dataset_info(tmp_path)
    assert info.config is None and not info.label_probs_known
    assert all(np.isnan(value) for value in info.oracle_ne.values())
    document["source"] = "scraped"
    (tmp_path / "dataset.json").write_text(json.dumps(document))
    with pytest.raises(DatasetFormatError, match="source"):
        read_dataset_info(tmp_path)


def test_synthetic_shards_carry_page_checksums(dataset):
    # The loaders verify them: a flipped byte in a data page is an error, not garbage.
    path = dataset.files[0]
    raw = path.read_bytes()
    column = pq.ParquetFile(path).metadata.row_group(0).column(2)
    middle = column.data_page_offset + column.total_compressed_size // 2
    corrupt = bytearray(raw)
    corrupt[middle] ^= 0xFF
    reader = pq.ParquetFile(pa.BufferReader(bytes(corrupt)), page_checksum_verification=True)
    with pytest.raises(OSError, match="CRC"):
        reader.read_row_group(0)


def test_probabilities_must_be_nan_when_declared_unknown(tmp_path, dataset):
    from gem_data import ParquetBatchLoader

    directory = tmp_path / "copy"
    shutil.copytree(dataset.directory, directory)
    document = json.loads((directory / "dataset.json").read_text())
    document.update(label_probs_known=False)
    (directory / "dataset.json").write_text(json.dumps(document))
    with pytest.raises(DatasetFormatError, match="'click_prob' must be NaN"):
        ParquetBatchLoader(directory, 8)
