"""Read a Parquet dataset into memory and serve shuffled, rank-sharded, resumable batches."""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from gem_data._columns import (
    Columns,
    check_bool,
    check_directory,
    check_int,
    check_on_bad_row,
    drop_bad_rows,
    read_file,
)
from gem_data.batch import Batch
from gem_data.schema import DatasetFormatError
from gem_data.writer import DATASET_INFO_FILE, DatasetInfo, read_dataset_info

__all__ = ["ParquetBatchLoader"]

_check_int = check_int


def dataset_files(directory: Path) -> tuple[DatasetInfo | None, list[Path], int | None]:
    """``dataset.json`` (or None), the shard paths and the declared dense width of a dataset."""
    if not directory.is_dir():
        raise DatasetFormatError(f"{directory}: dataset directory does not exist")
    if (directory / DATASET_INFO_FILE).exists():
        info = read_dataset_info(directory)
        files, num_dense = list(info.files), info.num_dense_features
    else:
        info, files, num_dense = None, sorted(directory.glob("*.parquet")), None
    if not files:
        raise DatasetFormatError(f"{directory}: no Parquet files in the dataset")
    return info, files, num_dense


class ResumablePosition:
    """``state_dict`` / ``load_state_dict`` shared by the loaders.

    The state is the position (epoch, batches already yielded in it) plus the loader's
    ``_identity()``: everything that fixes the sample order, which must match on load. It
    may come from another rank of the same run, since the position is shared.
    """

    _STATE_FORMAT: str
    _STATE_VERSION: int
    rank: int
    _epoch: int
    _batches_yielded: int
    _iteration_token: int

    def _identity(self) -> dict[str, Any]:
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """Position of this loader plus the setup that fixes its sample order."""
        return {
            "format": self._STATE_FORMAT,
            "version": self._STATE_VERSION,
            "epoch": self._epoch,
            "batches_yielded": self._batches_yielded,
            "rank": self.rank,
            **self._identity(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state``: the next batch is the one that would have followed it."""
        epoch, batches = check_state(
            state, self._STATE_FORMAT, self._STATE_VERSION, self._identity()
        )
        if batches > len(self):
            raise ValueError(
                f"state['batches_yielded'] = {batches} exceeds the {len(self)} batches per epoch"
            )
        self._iteration_token += 1  # running iterators stop: the position has moved
        self._epoch = epoch
        self._batches_yielded = batches


class ParquetBatchLoader(ResumablePosition):
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

    ``on_bad_row``: ``"error"`` (default) raises ``DatasetFormatError`` (file and column) for a
    shard with a bad value; ``"skip"`` leaves bad rows out of their batches (smaller batches,
    the same plan) and counts them in ``skipped_rows``, as :class:`gem_data.ShardedBatchLoader`.

    For datasets larger than memory, or to balance jagged batches across ranks, use
    :class:`gem_data.ShardedBatchLoader` (streams row groups, Base Batch Shuffling).
    """

    _STATE_FORMAT = "gem_data.ParquetBatchLoader"
    _STATE_VERSION = 1

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
        on_bad_row: str = "error",
    ) -> None:
        self.directory = check_directory(directory)
        self.batch_size = _check_int("batch_size", batch_size, 1)
        self.seed = _check_int("seed", seed, 0)
        self.world_size = _check_int("world_size", world_size, 1)
        self.rank = _check_int("rank", rank, 0)
        if self.rank >= self.world_size:
            raise ValueError(f"rank must be < world_size ({self.world_size}), got {self.rank}")
        self.shuffle = check_bool("shuffle", shuffle)
        self.drop_last = check_bool("drop_last", drop_last)
        self.on_bad_row = check_on_bad_row(on_bad_row)
        self.skipped_rows = 0
        """Bad rows left out of the batches collated so far (``on_bad_row="skip"``)."""
        self.skipped_examples: list[str] = []
        """Where and why, for the first skipped rows."""
        self.dataset_info, files, num_dense = dataset_files(self.directory)
        self.files = list(files)
        self._load(num_dense)
        self._epoch = 0
        self._batches_yielded = 0
        self._iteration_token = 0

    def _load(self, num_dense: int | None) -> None:
        parts = []
        for path in self.files:
            part, num_dense = read_file(Path(path), num_dense, self.dataset_info, self.on_bad_row)
            parts.append(part)
        total = sum(part.num_rows for part in parts)
        if self.dataset_info is not None and total != self.dataset_info.num_samples:
            raise DatasetFormatError(
                f"{self.directory}: shards hold {total} rows, {DATASET_INFO_FILE} says "
                f"{self.dataset_info.num_samples}"
            )
        self.num_dense_features = int(num_dense)
        self.total_samples = total
        self._data = Columns.concat(parts)

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
        kept, dropped = drop_bad_rows(self._data, rows, self.skipped_examples)
        self.skipped_rows += dropped
        return self._data.collate(kept)

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


def check_state(
    state: Any, state_format: str, version: int, identity: dict[str, Any]
) -> tuple[int, int]:
    """``(epoch, batches_yielded)`` of a loader state, after checking it matches ``identity``."""
    if not isinstance(state, dict):
        raise TypeError(f"state must be a dict from state_dict(), got {type(state).__name__}")
    if state.get("format") != state_format or state.get("version") != version:
        raise ValueError(
            f"state is not a {state_format} state of version {version}: "
            f"format={state.get('format')!r}, version={state.get('version')!r}"
        )
    for key, expected in identity.items():
        if key not in state:
            raise ValueError(f"state is missing {key!r}")
        if state[key] != expected:
            raise ValueError(
                f"state[{key!r}] = {state[key]!r} does not match this loader ({expected!r})"
            )
    epoch = _check_int("state['epoch']", state.get("epoch"), 0)
    batches = _check_int("state['batches_yielded']", state.get("batches_yielded"), 0)
    return epoch, batches
