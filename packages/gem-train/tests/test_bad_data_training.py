"""Bad training data stops a run with a named error, never a NaN loss (issue 27)."""

from __future__ import annotations

import dataclasses
import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from gem_data import DatasetFormatError
from gem_train import DataConfig, Trainer
from gem_train.cli import prepare_data
from gem_train.config import TrainConfig, apply_overrides


def _nan_dense_in_first_row(path) -> None:
    table = pq.read_table(path)
    dense = table.column("dense_features").to_pylist()
    dense[0] = [math.nan, *dense[0][1:]]
    field = table.schema.field("dense_features")
    column = pa.array(dense, type=field.type)
    table = table.set_column(table.schema.get_field_index("dense_features"), field, column)
    metadata = pq.ParquetFile(path).metadata
    row_group = metadata.row_group(0).num_rows
    pq.write_table(table, path, row_group_size=row_group, write_page_checksum=True)


def test_nan_features_stop_training_with_a_named_error(small_config, tmp_path):
    train_data, _ = prepare_data(small_config.data, progress=False)
    for name in train_data.files:
        _nan_dense_in_first_row(name)  # DatasetInfo.files are paths
    trainer = Trainer(
        dataclasses.replace(small_config, max_steps=2), train_data, output_dir=tmp_path / "run"
    )
    with pytest.raises(DatasetFormatError, match=r"part-\d+\.parquet \(row group \d+\).*dense"):
        trainer.fit(progress=False)
    assert trainer.step == 0  # no step ran on the bad batch


def test_on_bad_row_option():
    assert DataConfig().on_bad_row == "error"
    config = apply_overrides(TrainConfig(), ["data.on_bad_row=skip"])
    assert config.data.on_bad_row == "skip"
    with pytest.raises(ValueError, match=r"override 'data.on_bad_row'.*'error' or 'skip'"):
        apply_overrides(TrainConfig(), ["data.on_bad_row=drop"])
