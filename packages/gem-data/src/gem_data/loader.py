"""Read a Parquet dataset into memory and serve shuffled, rank-sharded, resumable batches."""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
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
from gem_data.writer import DATASET_INFO_FILE, DatasetInfo, read_dataset_info

__all__ = ["ParquetBatchLoader"]

_STATE_FORMAT = "gem_data.ParquetBatchLoader"
_STATE_VERSION = 1
# History columns are stacked into one (4, T) array so a batch gathers them in one step.
_HISTORY_COLUMNS = (*SEQUENCE_FEATURE_NAMES, "hist_timestamps")
_SCALAR_ID_COLUMNS = ("sample_index", "user_id", "device_type", "region", "ad_id", "ad_category_id")
_FLOAT_COLUMNS = ("click", "conversion", "click_prob", "conversion_prob")


def _check_int(name: str, value: Any, minimum: int) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _list_column(table: pa.Table, name: str, path: Path) -> tuple[np.ndarray, np.ndarray]:
    """(lengths int64, values) of a list column, whatever its chunking."""
    column = table.column(name)
    lengths, values = [], []
    for chunk in column.chunks:
        offsets = np.asarray(chunk.offsets, dtype=np.int64)
        flat = chunk.flatten()
        if flat.null_count:
            raise DatasetFormatError(f"{path}: column {name!r} has null list items")
        lengths.append(np.diff(offsets))
        values.append(flat.to_numpy(zero_copy_only=False))
    if not lengths:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    return np.concatenate(lengths), np.concatenate(values)


def _check_ids(values: np.ndarray, cardinality: int | None, name: str, path: Path) -> None:
    if values.size == 0:
        return
    low, high = int(values.min()), int(values.max())
    if low < 0 or (cardinality is not None and high >= cardinality):
        raise DatasetFormatError(
            f"{path}: column {name!r} has ids in [{low}, {high}], "
            f"expected [0, {cardinality if cardinality is not None else 'inf'})"
        )


def _read_file(path: Path, num_dense: int | None, info: DatasetInfo | None) -> dict[str, Any]:
    """Validated numpy arrays of one shard."""
    try:
        parquet_file = pq.ParquetFile(path)
        schema = parquet_file.schema_arrow
    except FileNotFoundError as error:
        raise DatasetFormatError(f"{path}: shard file is missing") from error
    except (pa.ArrowException, OSError) as error:
        raise DatasetFormatError(f"{path}: not a readable Parquet file ({error})") from error
    num_dense = validate_schema(schema, path, num_dense_features=num_dense)
    names = dataset_schema(num_dense).names
    try:
        table = parquet_file.read(columns=names)
    except (pa.ArrowException, OSError) as error:
        raise DatasetFormatError(f"{path}: cannot read the Parquet data ({error})") from error
    for name in names:
        if table.column(name).null_count:
            raise DatasetFormatError(f"{path}: column {name!r} has null values")

    cardinalities: dict[str, int | None] = {}
    if info is not None:
        cardinalities.update(info.sequence_features)
        cardinalities.update(info.sparse_features)
    arrays: dict[str, Any] = {"num_rows": table.num_rows, "path": path}

    lengths, values = _list_column(table, "hist_item_ids", path)
    history = [values]
    for name in _HISTORY_COLUMNS[1:]:
        other_lengths, other_values = _list_column(table, name, path)
        if not np.array_equal(other_lengths, lengths):
            raise DatasetFormatError(
                f"{path}: column {name!r} has list lengths different from 'hist_item_ids'"
            )
        history.append(other_values)
    if info is not None and lengths.size and int(lengths.max()) > info.max_seq_len:
        raise DatasetFormatError(
            f"{path}: column 'hist_item_ids' has a history of {int(lengths.max())} events, "
            f"more than max_seq_len={info.max_seq_len}"
        )
    for name, column in zip(SEQUENCE_FEATURE_NAMES, history, strict=False):
        _check_ids(column, cardinalities.get(name), name, path)
    arrays["history_lengths"] = lengths
    arrays["history"] = np.stack(history) if lengths.size else np.zeros((4, 0), dtype=np.int64)

    segment_lengths, segments = _list_column(table, "user_segments", path)
    _check_ids(segments, cardinalities.get("user_segments"), "user_segments", path)
    arrays["segment_lengths"] = segment_lengths
    arrays["segments"] = segments.astype(np.int64, copy=False)

    for name in _SCALAR_ID_COLUMNS:
        column = table.column(name).to_numpy()
        if name != "sample_index":
            _check_ids(column, cardinalities.get(name), name, path)
        arrays[name] = column
    dense = table.column("dense_features").combine_chunks().flatten().to_numpy()
    arrays["dense_features"] = dense.reshape(table.num_rows, num_dense)
    if not np.isfinite(arrays["dense_features"]).all():
        raise DatasetFormatError(f"{path}: column 'dense_features' has NaN or infinite values")
    for name in _FLOAT_COLUMNS:
        column = table.column(name).to_numpy()
        if not ((column >= 0.0) & (column <= 1.0)).all():  # also rejects NaN
            raise DatasetFormatError(f"{path}: column {name!r} has values outside [0, 1]")
        arrays[name] = column
    arrays["num_dense"] = num_dense
    return arrays


def _offsets(lengths: np.ndarray) -> np.ndarray:
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return offsets


def _gather_jagged(
    offsets: np.ndarray, lengths: np.ndarray, rows: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(lengths, offsets, value positions) of ``rows`` of a jagged column, without a row loop."""
    row_lengths = lengths[rows]
    row_offsets = _offsets(row_lengths)
    positions = np.repeat(offsets[rows] - row_offsets[:-1], row_lengths) + np.arange(
        row_offsets[-1], dtype=np.int64
    )
    return row_lengths, row_offsets, positions


class ParquetBatchLoader:
    """Batches of a Parquet dataset for one rank, one epoch per ``iter()``.

    The needed columns of every shard are read into memory once (and validated). Epoch ``e``
    orders the samples by a permutation that is a pure function of ``(seed, e)`` (identity
    without shuffle); rank ``r`` of ``world_size`` takes every ``world_size``-th sample of it,
    starting at ``r``, so ranks never share a sample and together cover all of them. With
    ``drop_last=True`` the permutation is first cut to a multiple of ``world_size`` and partial
    batches are dropped, so every rank yields the same number of batches; with
    ``drop_last=False`` every sample is yielded once per epoch and ranks' batch counts may
    differ by one.

    Each ``iter()`` continues the current epoch where the last one stopped (a fresh loader or
    a finished epoch starts the next epoch at batch 0). :meth:`state_dict` records the position;
    :meth:`load_state_dict` makes the next batch the one that would have come next.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        drop_last: bool = False,
    ) -> None:
        self.batch_size = _check_int("batch_size", batch_size, 1)
        self.seed = _check_int("seed", seed, 0)
        self.world_size = _check_int("world_size", world_size, 1)
        self.rank = _check_int("rank", rank, 0)
        if self.rank >= self.world_size:
            raise ValueError(f"rank must be < world_size ({self.world_size}), got {self.rank}")
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise DatasetFormatError(f"{self.directory}: dataset directory does not exist")

        self.dataset_info: DatasetInfo | None = None
        if (self.directory / DATASET_INFO_FILE).exists():
            self.dataset_info = read_dataset_info(self.directory)
            files = self.dataset_info.files
            num_dense: int | None = self.dataset_info.num_dense_features
        else:
            files = sorted(self.directory.glob("*.parquet"))
            num_dense = None
        if not files:
            raise DatasetFormatError(f"{self.directory}: no Parquet files in the dataset")
        self.files = list(files)
        self._load(num_dense)
        self._epoch = 0
        self._batches_yielded = 0
        self._iteration_token = 0

    def _load(self, num_dense: int | None) -> None:
        parts = []
        for path in self.files:
            part = _read_file(Path(path), num_dense, self.dataset_info)
            num_dense = part["num_dense"]
            parts.append(part)
        total = sum(part["num_rows"] for part in parts)
        if self.dataset_info is not None and total != self.dataset_info.num_samples:
            raise DatasetFormatError(
                f"{self.directory}: shards hold {total} rows, {DATASET_INFO_FILE} says "
                f"{self.dataset_info.num_samples}"
            )
        self.num_dense_features = int(num_dense)
        self.total_samples = total
        self._history_lengths = np.concatenate([p["history_lengths"] for p in parts])
        self._history_offsets = _offsets(self._history_lengths)
        self._history = np.concatenate([p["history"] for p in parts], axis=1)
        self._segment_lengths = np.concatenate([p["segment_lengths"] for p in parts])
        self._segment_offsets = _offsets(self._segment_lengths)
        self._segments = np.concatenate([p["segments"] for p in parts])
        self._columns = {
            name: np.concatenate([p[name] for p in parts])
            for name in (*_SCALAR_ID_COLUMNS, *_FLOAT_COLUMNS, "dense_features")
        }
        self._labels = np.stack([self._columns["click"], self._columns["conversion"]], axis=1)
        self._label_probs = np.stack(
            [self._columns["click_prob"], self._columns["conversion_prob"]], axis=1
        )

    # ----------------------------------------------------------------- epoch plan
    @property
    def epoch(self) -> int:
        """The epoch the next batch belongs to (0-based)."""
        return self._epoch

    @property
    def num_samples(self) -> int:
        """Samples this rank yields per epoch."""
        if self.drop_last:
            return len(self) * self.batch_size
        return len(range(self.rank, self.total_samples, self.world_size))

    def __len__(self) -> int:
        """Batches per epoch on this rank."""
        if self.drop_last:
            return (self.total_samples // self.world_size) // self.batch_size
        share = len(range(self.rank, self.total_samples, self.world_size))
        return math.ceil(share / self.batch_size)

    def epoch_indices(self, epoch: int) -> np.ndarray:
        """Row positions (0-based, in file order) this rank visits in ``epoch``, in order."""
        epoch = _check_int("epoch", epoch, 0)
        if self.shuffle:
            order = np.random.default_rng([self.seed, epoch]).permutation(self.total_samples)
        else:
            order = np.arange(self.total_samples)
        if self.drop_last:
            order = order[: (self.total_samples // self.world_size) * self.world_size]
        share = order[self.rank :: self.world_size]
        if self.drop_last:
            share = share[: len(self) * self.batch_size]
        return share

    # ------------------------------------------------------------------ iteration
    def __iter__(self) -> Iterator[Batch]:
        self._iteration_token += 1
        num_batches = len(self)
        if self._batches_yielded > 0 and self._batches_yielded >= num_batches:
            self._epoch += 1
            self._batches_yielded = 0
        return self._iterate(self._iteration_token, self._epoch, self._batches_yielded)

    def _iterate(self, token: int, epoch: int, first_batch: int) -> Iterator[Batch]:
        indices = self.epoch_indices(epoch)
        for batch_number in range(first_batch, len(self)):
            rows = indices[batch_number * self.batch_size : (batch_number + 1) * self.batch_size]
            batch = self.collate(rows)
            if token != self._iteration_token:  # a newer iter() or load_state_dict took over
                return
            self._batches_yielded = batch_number + 1
            yield batch
        if token == self._iteration_token:
            self._epoch = epoch + 1
            self._batches_yielded = 0

    def collate(self, rows: np.ndarray) -> Batch:
        """The batch of the given row positions (vectorized gathers, no per-sample loop)."""
        rows = np.asarray(rows, dtype=np.int64)
        if rows.ndim != 1 or rows.size == 0:
            raise ValueError(f"rows must be a non-empty 1-D array, got shape {rows.shape}")
        if rows.min() < 0 or rows.max() >= self.total_samples:
            raise ValueError(f"rows must be in [0, {self.total_samples}), got {rows}")
        size = rows.size
        lengths, offsets, positions = _gather_jagged(
            self._history_offsets, self._history_lengths, rows
        )
        history = self._history[:, positions]  # (4, T): items, categories, actions, timestamps
        num_sequence_keys = len(SEQUENCE_FEATURE_NAMES)
        sequence_features = KeyedJaggedTensor(
            keys=list(SEQUENCE_FEATURE_NAMES),
            values=torch.from_numpy(np.ascontiguousarray(history[:num_sequence_keys]).reshape(-1)),
            lengths=torch.from_numpy(np.tile(lengths, num_sequence_keys)),
        )

        segment_lengths, _, segment_positions = _gather_jagged(
            self._segment_offsets, self._segment_lengths, rows
        )
        columns = self._columns
        ones = np.ones(size, dtype=np.int64)
        sparse_values = [columns["user_id"][rows], self._segments[segment_positions]]
        sparse_values += [columns[name][rows] for name in SPARSE_FEATURE_NAMES[2:]]
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
            dense_features=torch.from_numpy(columns["dense_features"][rows]),
            labels=torch.from_numpy(self._labels[rows]),
            label_probs=torch.from_numpy(self._label_probs[rows]),
            sample_indices=torch.from_numpy(columns["sample_index"][rows]),
        )

    # ---------------------------------------------------------------------- resume
    def _identity(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "shuffle": self.shuffle,
            "batch_size": self.batch_size,
            "world_size": self.world_size,
            "drop_last": self.drop_last,
            "total_samples": self.total_samples,
        }

    def state_dict(self) -> dict[str, Any]:
        """Position of this loader: epoch and batches already yielded in it, plus its setup."""
        return {
            "format": _STATE_FORMAT,
            "version": _STATE_VERSION,
            "epoch": self._epoch,
            "batches_yielded": self._batches_yielded,
            "rank": self.rank,
            **self._identity(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state``: the next batch is the one that would have followed it.

        The state may come from another rank of the same run (the position is shared), but
        seed, shuffle, batch size, world size, drop_last and the dataset size must match.
        """
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict from state_dict(), got {type(state).__name__}")
        if state.get("format") != _STATE_FORMAT or state.get("version") != _STATE_VERSION:
            raise ValueError(
                f"state is not a {_STATE_FORMAT} state of version {_STATE_VERSION}: "
                f"format={state.get('format')!r}, version={state.get('version')!r}"
            )
        for key, expected in self._identity().items():
            if key not in state:
                raise ValueError(f"state is missing {key!r}")
            if state[key] != expected:
                raise ValueError(
                    f"state[{key!r}] = {state[key]!r} does not match this loader ({expected!r})"
                )
        epoch = _check_int("state['epoch']", state.get("epoch"), 0)
        batches = _check_int("state['batches_yielded']", state.get("batches_yielded"), 0)
        if batches > len(self):
            raise ValueError(
                f"state['batches_yielded'] = {batches} exceeds the {len(self)} batches per epoch"
            )
        self._iteration_token += 1  # running iterators stop: the position has moved
        self._epoch = epoch
        self._batches_yielded = batches
