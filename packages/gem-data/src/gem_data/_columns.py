"""Validated numpy columns of Parquet rows and their collation into a ``Batch`` (internal)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from gem_data.batch import Batch
from gem_data.schema import (
    SEQUENCE_FEATURE_NAMES,
    SPARSE_FEATURE_NAMES,
    DatasetFormatError,
    dataset_schema,
    validate_schema,
)
from gem_data.writer import DatasetInfo

__all__: list[str] = []  # internal: used by the loaders

# History columns are stacked into one (4, T) array so a batch gathers them in one step.
HISTORY_COLUMNS = (*SEQUENCE_FEATURE_NAMES, "hist_timestamps")
SCALAR_ID_COLUMNS = ("sample_index", "user_id", "device_type", "region", "ad_id", "ad_category_id")
FLOAT_COLUMNS = ("click", "conversion", "click_prob", "conversion_prob")
PROB_COLUMNS = ("click_prob", "conversion_prob")

#: ``on_bad_row`` values of the loaders: ``"error"`` raises ``DatasetFormatError`` naming the
#: file, row group and column; ``"skip"`` leaves bad rows out of the batches and counts them.
BAD_ROW_MODES = ("error", "skip")
#: Descriptions of skipped rows a loader keeps (``skipped_examples``).
MAX_SKIP_EXAMPLES = 20


def check_on_bad_row(value: Any) -> str:
    if not isinstance(value, str) or value not in BAD_ROW_MODES:
        raise ValueError(f"on_bad_row must be one of {BAD_ROW_MODES}, got {value!r}")
    return value


def check_directory(directory: Any) -> Path:
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"directory must be a str or os.PathLike, got {type(directory).__name__}")
    return Path(directory)


def check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} ({value!r})")
    return bool(value)


def check_int(name: str, value: Any, minimum: int) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _list_column(table: pa.Table, name: str, where: str) -> tuple[np.ndarray, np.ndarray]:
    """(lengths int64, values) of a list column, whatever its chunking."""
    column = table.column(name)
    lengths, values = [], []
    for chunk in column.chunks:
        offsets = np.asarray(chunk.offsets, dtype=np.int64)
        flat = chunk.flatten()
        if flat.null_count:
            raise DatasetFormatError(f"{where}: column {name!r} has null list items")
        lengths.append(np.diff(offsets))
        values.append(flat.to_numpy(zero_copy_only=False))
    if not lengths:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    return np.concatenate(lengths), np.concatenate(values)


def _check_ids(values: np.ndarray, cardinality: int | None, name: str, where: str) -> None:
    if values.size == 0:
        return
    low, high = int(values.min()), int(values.max())
    if low < 0 or (cardinality is not None and high >= cardinality):
        raise DatasetFormatError(
            f"{where}: column {name!r} has ids in [{low}, {high}], "
            f"expected [0, {cardinality if cardinality is not None else 'inf'})"
        )


def offsets_of(lengths: np.ndarray) -> np.ndarray:
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return offsets


def gather_jagged(
    offsets: np.ndarray, lengths: np.ndarray, rows: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(lengths, offsets, value positions) of ``rows`` of a jagged column, without a row loop."""
    row_lengths = lengths[rows]
    row_offsets = offsets_of(row_lengths)
    positions = np.repeat(offsets[rows] - row_offsets[:-1], row_lengths) + np.arange(
        row_offsets[-1], dtype=np.int64
    )
    return row_lengths, row_offsets, positions


class Columns:
    """Validated numpy columns of a set of rows: what a batch is gathered from.

    History columns are stacked into one (4, T) array (items, categories, actions, timestamps)
    so a batch gathers them in one step; list columns keep lengths plus offsets.
    """

    __slots__ = (
        "num_rows",
        "history_lengths",
        "history_offsets",
        "history",
        "segment_lengths",
        "segment_offsets",
        "segments",
        "scalars",
        "dense",
        "labels",
        "label_probs",
        "bad",
        "bad_reasons",
    )

    def __init__(
        self,
        history_lengths: np.ndarray,
        history: np.ndarray,
        segment_lengths: np.ndarray,
        segments: np.ndarray,
        scalars: dict[str, np.ndarray],
        dense: np.ndarray,
        labels: np.ndarray,
        label_probs: np.ndarray,
        bad: np.ndarray | None = None,
        bad_reasons: dict[int, str] | None = None,
    ) -> None:
        self.num_rows = int(len(history_lengths))
        self.history_lengths = history_lengths
        self.history_offsets = offsets_of(history_lengths)
        self.history = history
        self.segment_lengths = segment_lengths
        self.segment_offsets = offsets_of(segment_lengths)
        self.segments = segments
        self.scalars = scalars
        self.dense = dense
        self.labels = labels
        self.label_probs = label_probs
        self.bad = bad
        """``on_bad_row="skip"``: rows to leave out of batches (their values are placeholders),
        or None when every row is good."""
        self.bad_reasons = bad_reasons or {}
        """Row -> why it is bad, for the first bad rows of the table it came from."""

    @staticmethod
    def concat(parts: list[Columns]) -> Columns:
        if len(parts) == 1:
            return parts[0]
        bad = None
        if any(p.bad is not None for p in parts):
            bad = np.concatenate(
                [np.zeros(p.num_rows, dtype=bool) if p.bad is None else p.bad for p in parts]
            )
        reasons, start = {}, 0
        for part in parts:
            reasons.update({start + row: why for row, why in part.bad_reasons.items()})
            start += part.num_rows
        return Columns(
            history_lengths=np.concatenate([p.history_lengths for p in parts]),
            history=np.concatenate([p.history for p in parts], axis=1),
            segment_lengths=np.concatenate([p.segment_lengths for p in parts]),
            segments=np.concatenate([p.segments for p in parts]),
            scalars={
                name: np.concatenate([p.scalars[name] for p in parts]) for name in SCALAR_ID_COLUMNS
            },
            dense=np.concatenate([p.dense for p in parts]),
            labels=np.concatenate([p.labels for p in parts]),
            label_probs=np.concatenate([p.label_probs for p in parts]),
            bad=bad,
            bad_reasons=reasons,
        )

    def slice(self, start: int, stop: int) -> Columns:
        """Rows ``[start, stop)`` (views where possible)."""
        history_lo, history_hi = self.history_offsets[start], self.history_offsets[stop]
        segment_lo, segment_hi = self.segment_offsets[start], self.segment_offsets[stop]
        return Columns(
            history_lengths=self.history_lengths[start:stop],
            history=self.history[:, history_lo:history_hi],
            segment_lengths=self.segment_lengths[start:stop],
            segments=self.segments[segment_lo:segment_hi],
            scalars={name: column[start:stop] for name, column in self.scalars.items()},
            dense=self.dense[start:stop],
            labels=self.labels[start:stop],
            label_probs=self.label_probs[start:stop],
            bad=None if self.bad is None else self.bad[start:stop],
            bad_reasons={
                row - start: why for row, why in self.bad_reasons.items() if start <= row < stop
            },
        )

    def take(self, rows: np.ndarray) -> Columns:
        """The given rows, in that order (vectorized gathers)."""
        _, _, positions = gather_jagged(self.history_offsets, self.history_lengths, rows)
        _, _, segment_positions = gather_jagged(self.segment_offsets, self.segment_lengths, rows)
        return Columns(
            history_lengths=self.history_lengths[rows],
            history=self.history[:, positions],
            segment_lengths=self.segment_lengths[rows],
            segments=self.segments[segment_positions],
            scalars={name: column[rows] for name, column in self.scalars.items()},
            dense=self.dense[rows],
            labels=self.labels[rows],
            label_probs=self.label_probs[rows],
            bad=None if self.bad is None else self.bad[rows],
            bad_reasons=_taken_reasons(self.bad_reasons, rows),
        )

    def good_rows(self, rows: np.ndarray) -> tuple[np.ndarray, list[str]]:
        """``rows`` without the bad ones, and why each left-out row was bad."""
        if self.bad is None:
            return rows, []
        bad = self.bad[rows]
        if not bad.any():
            return rows, []
        reasons = [self.bad_reasons.get(int(row), "bad row") for row in rows[bad]]
        return rows[~bad], reasons

    def collate(self, rows: np.ndarray) -> Batch:
        """The batch of the given rows (vectorized gathers, no per-sample loop)."""
        size = rows.size
        lengths, offsets, positions = gather_jagged(
            self.history_offsets, self.history_lengths, rows
        )
        history = self.history[:, positions]  # (4, T): items, categories, actions, timestamps
        num_sequence_keys = len(SEQUENCE_FEATURE_NAMES)
        sequence_features = KeyedJaggedTensor(
            keys=list(SEQUENCE_FEATURE_NAMES),
            values=torch.from_numpy(np.ascontiguousarray(history[:num_sequence_keys]).reshape(-1)),
            lengths=torch.from_numpy(np.tile(lengths, num_sequence_keys)),
        )

        segment_lengths, _, segment_positions = gather_jagged(
            self.segment_offsets, self.segment_lengths, rows
        )
        scalars = self.scalars
        ones = np.ones(size, dtype=np.int64)
        sparse_values = [scalars["user_id"][rows], self.segments[segment_positions]]
        sparse_values += [scalars[name][rows] for name in SPARSE_FEATURE_NAMES[2:]]
        sparse_lengths = [ones, segment_lengths] + [ones] * (len(SPARSE_FEATURE_NAMES) - 2)
        sparse_features = KeyedJaggedTensor(
            keys=list(SPARSE_FEATURE_NAMES),
            values=torch.from_numpy(np.concatenate(sparse_values)),
            lengths=torch.from_numpy(np.concatenate(sparse_lengths)),
        )
        return Batch(
            sequence_features=sequence_features,
            sequence_offsets=torch.from_numpy(offsets),
            sequence_timestamps=torch.from_numpy(np.ascontiguousarray(history[-1])),
            sparse_features=sparse_features,
            dense_features=torch.from_numpy(self.dense[rows]),
            labels=torch.from_numpy(self.labels[rows]),
            label_probs=torch.from_numpy(self.label_probs[rows]),
            sample_indices=torch.from_numpy(scalars["sample_index"][rows]),
        )


def _taken_reasons(reasons: dict[int, str], rows: np.ndarray) -> dict[int, str]:
    if not reasons:
        return {}
    return {new: reasons[int(old)] for new, old in enumerate(rows) if int(old) in reasons}


def open_parquet(path: Path) -> pq.ParquetFile:
    """The file's reader (footer parsed; page checksums verified where they were written)."""
    try:
        return pq.ParquetFile(path, page_checksum_verification=True)
    except FileNotFoundError as error:
        raise DatasetFormatError(f"{path}: shard file is missing") from error
    except (pa.ArrowException, OSError) as error:
        raise DatasetFormatError(f"{path}: not a readable Parquet file ({error})") from error


def _numpy(array: pa.Array | pa.ChunkedArray, fill: Any) -> np.ndarray:
    return pc.fill_null(array, fill).to_numpy(zero_copy_only=False)


def find_bad_rows(
    table: pa.Table, num_dense: int, info: DatasetInfo | None
) -> tuple[np.ndarray, dict[int, str]]:
    """Rows of ``table`` that :func:`table_to_columns` would reject, and why (the first reason
    of the first rows): nulls, null list items, history columns of different lengths or over
    ``max_seq_len``, ids outside the cardinalities, NaN / Inf dense features, labels and
    probabilities outside [0, 1] (probabilities must be NaN when unknown)."""
    rows = table.num_rows
    bad = np.zeros(rows, dtype=bool)
    reasons: dict[int, str] = {}

    def mark(flags: np.ndarray, reason: str) -> None:
        new = np.flatnonzero(flags & ~bad)
        for row in new[: max(0, MAX_SKIP_EXAMPLES - len(reasons))]:
            reasons[int(row)] = reason
        bad[new] = True

    cardinalities: dict[str, int | None] = {}
    if info is not None:
        cardinalities.update(info.sequence_features)
        cardinalities.update(info.sparse_features)
    for name in table.column_names:
        column = table.column(name)
        if column.null_count:
            mark(np.asarray(column.is_null()), f"column {name!r} is null")
    lengths = {}
    for name in (*HISTORY_COLUMNS, "user_segments"):
        column = table.column(name).combine_chunks()
        lengths[name] = _numpy(pc.list_value_length(column), 0).astype(np.int64)
        flat = column.flatten()
        parents = np.asarray(pc.list_parent_indices(column), dtype=np.int64)
        if flat.null_count:
            hits = np.bincount(parents[np.asarray(flat.is_null())], minlength=rows) > 0
            mark(hits, f"column {name!r} has null list items")
        if name in cardinalities or name in SEQUENCE_FEATURE_NAMES or name == "user_segments":
            values = _numpy(flat, 0)
            limit = cardinalities.get(name)
            outside = values < 0 if limit is None else (values < 0) | (values >= limit)
            hits = np.bincount(parents[outside], minlength=rows) > 0
            mark(hits, f"column {name!r} has an id outside [0, {limit if limit else 'inf'})")
    for name in HISTORY_COLUMNS[1:]:
        mark(lengths[name] != lengths["hist_item_ids"], f"column {name!r} has another length")
    if info is not None:
        mark(
            lengths["hist_item_ids"] > info.max_seq_len,
            f"column 'hist_item_ids' is longer than max_seq_len={info.max_seq_len}",
        )
    for name in SCALAR_ID_COLUMNS[1:]:
        values = _numpy(table.column(name), 0)
        limit = cardinalities.get(name)
        outside = values < 0 if limit is None else (values < 0) | (values >= limit)
        mark(outside, f"column {name!r} has an id outside [0, {limit if limit else 'inf'})")
    dense = table.column("dense_features").combine_chunks()
    values = dense.values.slice(dense.offset * num_dense, rows * num_dense)
    dense_values = _numpy(values, np.nan).reshape(rows, num_dense)
    mark(~np.isfinite(dense_values).all(axis=1), "column 'dense_features' has NaN or Inf")
    probs_known = info is None or info.label_probs_known
    for name in FLOAT_COLUMNS:
        values = _numpy(table.column(name), np.nan)
        if name in PROB_COLUMNS and not probs_known:
            mark(~np.isnan(values), f"column {name!r} must be NaN (probabilities unknown)")
        else:
            mark(~((values >= 0.0) & (values <= 1.0)), f"column {name!r} is outside [0, 1]")
    return bad, reasons


def _placeholder(num_dense: int) -> Columns:
    """One row that stands in for a bad row (empty history, zeros): never part of a batch."""
    zero = np.zeros(1, dtype=np.int64)
    return Columns(
        history_lengths=zero,
        history=np.zeros((4, 0), dtype=np.int64),
        segment_lengths=zero,
        segments=np.zeros(0, dtype=np.int64),
        scalars=dict.fromkeys(SCALAR_ID_COLUMNS, zero),
        dense=np.zeros((1, num_dense), dtype=np.float32),
        labels=np.zeros((1, 2), dtype=np.float32),
        label_probs=np.zeros((1, 2), dtype=np.float32),
    )


def table_to_columns(
    table: pa.Table,
    where: str,
    num_dense: int,
    info: DatasetInfo | None,
    on_bad_row: str = "error",
) -> Columns:
    """Validate the values of ``table`` (a whole shard or one row group) and convert them.

    ``where`` names the file (and row group) in error messages. ``on_bad_row="skip"``: rows
    that would fail the checks are kept as placeholders marked in ``Columns.bad`` (with
    ``bad_reasons``) instead, so that the row positions, which the loaders' epoch plans are
    made of, do not move; the loaders leave them out of the batches.
    """
    if on_bad_row == "skip" and table.num_rows:
        bad, reasons = find_bad_rows(table, num_dense, info)
        if bad.any():
            good = table_to_columns(table.filter(pa.array(~bad)), where, num_dense, info)
            index = np.full(table.num_rows, good.num_rows, dtype=np.int64)
            index[~bad] = np.arange(good.num_rows)
            full = Columns.concat([good, _placeholder(num_dense)]).take(index)
            full.bad = bad
            full.bad_reasons = {row: f"{where} row {row}: {why}" for row, why in reasons.items()}
            return full
    return _strict_table_to_columns(table, where, num_dense, info)


def _strict_table_to_columns(
    table: pa.Table, where: str, num_dense: int, info: DatasetInfo | None
) -> Columns:
    for name in table.column_names:
        if table.column(name).null_count:
            raise DatasetFormatError(f"{where}: column {name!r} has null values")
    cardinalities: dict[str, int | None] = {}
    if info is not None:
        cardinalities.update(info.sequence_features)
        cardinalities.update(info.sparse_features)

    lengths, values = _list_column(table, "hist_item_ids", where)
    history = [values]
    for name in HISTORY_COLUMNS[1:]:
        other_lengths, other_values = _list_column(table, name, where)
        if not np.array_equal(other_lengths, lengths):
            raise DatasetFormatError(
                f"{where}: column {name!r} has list lengths different from 'hist_item_ids'"
            )
        history.append(other_values)
    if info is not None and lengths.size and int(lengths.max()) > info.max_seq_len:
        raise DatasetFormatError(
            f"{where}: column 'hist_item_ids' has a history of {int(lengths.max())} events, "
            f"more than max_seq_len={info.max_seq_len}"
        )
    for name, column in zip(SEQUENCE_FEATURE_NAMES, history, strict=False):
        _check_ids(column, cardinalities.get(name), name, where)

    segment_lengths, segments = _list_column(table, "user_segments", where)
    _check_ids(segments, cardinalities.get("user_segments"), "user_segments", where)

    scalars = {}
    for name in SCALAR_ID_COLUMNS:
        column = table.column(name).to_numpy()
        if name != "sample_index":
            _check_ids(column, cardinalities.get(name), name, where)
        scalars[name] = column
    dense = table.column("dense_features").combine_chunks().flatten().to_numpy()
    dense = dense.reshape(table.num_rows, num_dense)
    if not np.isfinite(dense).all():
        raise DatasetFormatError(f"{where}: column 'dense_features' has NaN or infinite values")
    floats = {}
    probs_known = info is None or info.label_probs_known
    for name in FLOAT_COLUMNS:
        column = table.column(name).to_numpy()
        if name in PROB_COLUMNS and not probs_known:
            if not np.isnan(column).all():
                raise DatasetFormatError(
                    f"{where}: column {name!r} must be NaN in every row "
                    "(dataset.json says the true probabilities are unknown)"
                )
        elif not ((column >= 0.0) & (column <= 1.0)).all():  # also rejects NaN
            raise DatasetFormatError(f"{where}: column {name!r} has values outside [0, 1]")
        floats[name] = column
    return Columns(
        history_lengths=lengths,
        history=np.stack(history) if lengths.size else np.zeros((4, 0), dtype=np.int64),
        segment_lengths=segment_lengths,
        segments=segments.astype(np.int64, copy=False),
        scalars=scalars,
        dense=dense,
        labels=np.stack([floats["click"], floats["conversion"]], axis=1),
        label_probs=np.stack([floats["click_prob"], floats["conversion_prob"]], axis=1),
    )


def read_file(
    path: Path, num_dense: int | None, info: DatasetInfo | None, on_bad_row: str = "error"
) -> tuple[Columns, int]:
    """Validated columns of one whole shard and its dense width."""
    parquet_file = open_parquet(path)
    num_dense = validate_schema(parquet_file.schema_arrow, path, num_dense_features=num_dense)
    names = dataset_schema(num_dense).names
    try:
        table = parquet_file.read(columns=names)
    except (pa.ArrowException, OSError) as error:
        raise DatasetFormatError(f"{path}: cannot read the Parquet data ({error})") from error
    return table_to_columns(table, str(path), num_dense, info, on_bad_row), num_dense


def drop_bad_rows(
    columns: Columns, rows: np.ndarray, examples: list[str]
) -> tuple[np.ndarray, int]:
    """``rows`` of ``columns`` without the bad ones (``on_bad_row="skip"``) and how many were
    dropped; the first reasons are appended to ``examples`` (up to ``MAX_SKIP_EXAMPLES`` in
    all). A batch whose rows are all bad is an error: there is nothing to train on."""
    kept, reasons = columns.good_rows(rows)
    if reasons and kept.size == 0:
        raise DatasetFormatError(
            f"every row of a batch of {rows.size} is bad (on_bad_row='skip' cannot make a "
            f"batch of it); first: {reasons[0]}"
        )
    examples.extend(reasons[: max(0, MAX_SKIP_EXAMPLES - len(examples))])
    return kept, len(reasons)
