"""Bad training data at run time, made on purpose (issue 27): each case corrupts a small
synthetic dataset and reports what the loader did.

``run_case(name, directory)`` writes a fresh dataset under ``directory``, applies the fault and
returns metrics: error cases ``named_error`` (1 when the loader raised ``DatasetFormatError``
naming the file, and the row group where there is one, else 0) and ``detail`` (the message);
skip cases (``*_skip``, ``on_bad_row="skip"``) ``skipped`` (1 when the loader yielded every
good row, none of the bad ones, only finite dense features, and counted exactly the bad rows
in ``skipped_rows``) and ``skipped_rows``. ``tests/test_bad_data.py`` asserts every case;
``benchmarks/bench_fuzz.py`` records them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from gem_data import (
    DatasetFormatError,
    ParquetBatchLoader,
    ShardedBatchLoader,
    SyntheticConfig,
    read_dataset_info,
    write_synthetic_dataset,
)

__all__ = ["CASES", "run_case"]

ROWS, SHARDS, ROW_GROUP = 96, 3, 16  # 32 rows per shard, 2 row groups each
BATCH = 8


def make_dataset(directory: Path) -> Path:
    write_synthetic_dataset(
        SyntheticConfig(seed=11), directory, num_samples=ROWS, num_shards=SHARDS, workers=1,
        progress=False, row_group_size=ROW_GROUP,
    )  # fmt: skip
    return directory


def _shard(directory: Path, number: int) -> Path:
    return Path(directory) / read_dataset_info(directory).files[number]


def _rewrite(path: Path, table: pa.Table) -> None:
    """Write ``table`` over ``path`` as the generator does (row groups, page checksums)."""
    temporary = path.with_suffix(".tmp")
    pq.write_table(table, temporary, row_group_size=ROW_GROUP, write_page_checksum=True)
    temporary.replace(path)


def _set_cell(path: Path, row: int, column: str, value, *, whole: bool = False) -> int:
    """Replace one value of ``column`` at ``row`` (list columns: their first entry, or the
    whole list with ``whole``); returns the row's sample index."""
    table = pq.read_table(path)
    values = table.column(column).to_pylist()
    if isinstance(values[row], list) and not whole:
        values[row] = [value, *values[row][1:]] if values[row] else [value]
        if column.startswith("hist_"):  # keep the history columns the same length
            for other in ("hist_item_ids", "hist_category_ids", "hist_action_types",
                          "hist_timestamps"):  # fmt: skip
                if other != column:
                    cells = table.column(other).to_pylist()
                    if len(cells[row]) != len(values[row]):
                        cells[row] = [0] * len(values[row])
                        position = table.schema.get_field_index(other)
                        table = table.set_column(
                            position, table.schema.field(other),
                            pa.array(cells, type=table.schema.field(other).type),
                        )  # fmt: skip
    else:
        values[row] = value
    position = table.schema.get_field_index(column)
    field = table.schema.field(column)
    table = table.set_column(position, field, pa.array(values, type=field.type))
    _rewrite(path, table)
    return int(table.column("sample_index")[row].as_py())


def _bad_rows(directory: Path, fault: str) -> list[int]:
    """Corrupt rows of shard 1 (row 20: row group 1) and of shard 2 (row 3); returns their
    sample indices."""
    info = read_dataset_info(directory)
    bad = []
    for shard, row in ((1, 20), (2, 3)):
        path = _shard(directory, shard)
        if fault == "nan_dense":
            dense = pq.read_table(path).column("dense_features").to_pylist()[row]
            bad.append(_set_cell(path, row, "dense_features", [math.nan, *dense[1:]], whole=True))
        elif fault == "inf_dense":
            dense = pq.read_table(path).column("dense_features").to_pylist()[row]
            bad.append(_set_cell(path, row, "dense_features", [*dense[:-1], -math.inf], whole=True))
        elif fault == "ad_id":
            bad.append(_set_cell(path, row, "ad_id", info.sparse_features["ad_id"]))
        elif fault == "item_id":
            item = info.sequence_features["hist_item_ids"] + 5
            bad.append(_set_cell(path, row, "hist_item_ids", item))
        else:
            raise AssertionError(fault)
    return bad


def _named(error: BaseException, path: Path, row_group: int | None) -> bool:
    message = str(error)
    if not isinstance(error, DatasetFormatError) or str(path) not in message:
        return False
    return row_group is None or f"(row group {row_group})" in message


def _iterate(loader) -> list:
    return [batch for batch in loader]


def _expect_named(make_and_read: Callable[[], object], path: Path, row_group: int | None) -> dict:
    try:
        make_and_read()
    except Exception as error:  # noqa: BLE001 - classified below
        return {"named_error": int(_named(error, path, row_group)), "detail": repr(error)[:300]}
    return {"named_error": 0, "detail": "no error: the bad data was read"}


def _value_fault(fault: str) -> Callable[[Path], dict]:
    def run(directory: Path) -> dict:
        _bad_rows(directory, fault)
        path = _shard(directory, 1)  # shard 1's row 20 is in row group 1; shards go in order
        return _expect_named(
            lambda: _iterate(ShardedBatchLoader(directory, BATCH, shuffle=False)), path, 1
        )

    return run


def _skip_fault(fault: str, loader: str = "sharded") -> Callable[[Path], dict]:
    def run(directory: Path) -> dict:
        bad = set(_bad_rows(directory, fault))
        if loader == "sharded":
            reader = ShardedBatchLoader(directory, BATCH, on_bad_row="skip", seed=3)
        else:
            reader = ParquetBatchLoader(directory, BATCH, on_bad_row="skip", seed=3)
        batches = _iterate(reader)
        seen = [int(i) for b in batches for i in b.sample_indices]
        finite = all(bool(np.isfinite(b.dense_features.numpy()).all()) for b in batches)
        good = (
            sorted(seen) == sorted(set(range(ROWS)) - bad)
            and finite
            and reader.skipped_rows == len(bad)
            and len(batches) == len(reader)
            and len(reader.skipped_examples) == len(bad)
        )
        return {
            "skipped": int(good),
            "skipped_rows": reader.skipped_rows,
            "detail": "; ".join(reader.skipped_examples)[:300],
        }

    return run


def _empty_shard(directory: Path) -> dict:
    """A shard rewritten with no rows (schema kept) before the run: dataset.json disagrees."""
    path = _shard(directory, 1)
    _rewrite(path, pq.read_table(path).slice(0, 0))
    return _expect_named(lambda: ShardedBatchLoader(directory, BATCH), path, None)


def _zero_byte_shard(directory: Path) -> dict:
    path = _shard(directory, 2)
    path.write_bytes(b"")
    return _expect_named(lambda: ShardedBatchLoader(directory, BATCH), path, None)


def _midrun(change: Callable[[Path], None], *, next_epoch: bool = False) -> Callable[[Path], dict]:
    """The loader opens the dataset and yields a batch (or, ``next_epoch``, a whole epoch, so
    that every shard has an open reader); then shard 2 is changed on disk; the rest of the
    run must stop with an error naming it and its row group."""

    def run(directory: Path) -> dict:
        # Pools of one batch: the first batch reads only shard 0's first row group.
        loader = ShardedBatchLoader(directory, BATCH, shuffle=False, pool_batches=1)
        path = _shard(directory, 2)

        def read():
            if next_epoch:
                list(loader)
            iterator = iter(loader)
            next(iterator)
            change(path)
            list(iterator)

        return _expect_named(read, path, 0)

    return run


def _narrower_dense(path: Path) -> None:
    table = pq.read_table(path)
    dense = [row[:4] for row in table.column("dense_features").to_pylist()]
    field = pa.field("dense_features", pa.list_(pa.float32(), 4), nullable=False)
    position = table.schema.get_field_index("dense_features")
    _rewrite(path, table.set_column(position, field, pa.array(dense, type=field.type)))


def _string_ids(path: Path) -> None:
    table = pq.read_table(path)
    position = table.schema.get_field_index("ad_id")
    ids = pa.array([str(v) for v in table.column("ad_id").to_pylist()], type=pa.string())
    _rewrite(path, table.set_column(position, pa.field("ad_id", pa.string()), ids))


def _emptied(path: Path) -> None:
    _rewrite(path, pq.read_table(path).slice(0, 0))


def _fewer_row_groups(path: Path) -> None:
    table = pq.read_table(path)
    temporary = path.with_suffix(".tmp")
    pq.write_table(table, temporary, row_group_size=ROW_GROUP * 4, write_page_checksum=True)
    temporary.replace(path)


CASES: dict[str, Callable[[Path], dict]] = {
    "nan_dense": _value_fault("nan_dense"),
    "inf_dense": _value_fault("inf_dense"),
    "id_out_of_range": _value_fault("ad_id"),
    "history_id_out_of_range": _value_fault("item_id"),
    "empty_shard": _empty_shard,
    "zero_byte_shard": _zero_byte_shard,
    "schema_change_midrun": _midrun(_narrower_dense),
    "column_type_change_midrun": _midrun(_string_ids),
    "shard_emptied_midrun": _midrun(_emptied),
    "row_groups_change_midrun": _midrun(_fewer_row_groups),
    "schema_change_next_epoch": _midrun(_narrower_dense, next_epoch=True),
    "nan_dense_skip": _skip_fault("nan_dense"),
    "inf_dense_skip": _skip_fault("inf_dense"),
    "id_out_of_range_skip": _skip_fault("ad_id"),
    "history_id_out_of_range_skip": _skip_fault("item_id"),
    "nan_dense_skip_in_memory": _skip_fault("nan_dense", loader="memory"),
}


def run_case(name: str, directory: Path) -> dict:
    """Make a dataset in ``directory`` (which must not exist yet), apply case ``name``."""
    return CASES[name](make_dataset(Path(directory)))
