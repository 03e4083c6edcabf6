"""Stream a Parquet dataset by row group, per rank, into balanced batches (Base Batch Shuffling)."""

from __future__ import annotations

import concurrent.futures
import math
import os
import re
import threading
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from gem_data._columns import (
    Columns,
    check_bool,
    check_directory,
    check_int,
    check_on_bad_row,
    drop_bad_rows,
    open_parquet,
    table_to_columns,
)
from gem_data.balance import CostModel, attention_cost, bbs_merge, sub_batch_costs
from gem_data.batch import Batch
from gem_data.loader import ResumablePosition, dataset_files
from gem_data.schema import DatasetFormatError, dataset_schema, validate_schema
from gem_data.writer import DATASET_INFO_FILE

__all__ = ["ShardedBatchLoader", "BALANCE_MODES"]

#: ``balance`` values: ``"bbs"`` (Base Batch Shuffling) or ``"none"`` (stream order).
BALANCE_MODES = ("bbs", "none")
# Entropy words separating the row-group order stream from the per-row-group row streams.
_ROW_GROUP_ORDER_STREAM = 0x52474F52
_ROW_ORDER_STREAM = 0x524F5753
_STAGES = ("read", "validate", "shuffle", "assemble", "balance", "collate", "pin")


def _file_signature(path: Path, where: str | None = None) -> tuple[int, ...]:
    """What changes when a file is rewritten: inode, size, modification time."""
    try:
        stat = os.stat(path)
    except OSError as error:
        raise DatasetFormatError(f"{where or path}: shard file is missing ({error})") from error
    return (stat.st_ino, stat.st_size, stat.st_mtime_ns)


def _cost_model_name(cost_model: CostModel) -> str:
    """The name a checkpoint records: a function's qualified name, else the object's repr (a
    ``functools.partial``, a dataclass instance) without memory addresses, which a restarted
    job does not share."""
    name = getattr(cost_model, "__qualname__", None)
    if name:
        return f"{getattr(cost_model, '__module__', '')}.{name}"
    return re.sub(r" at 0x[0-9a-fA-F]+", "", repr(cost_model))


class ShardedBatchLoader(ResumablePosition):
    """Batches for one rank, streamed row group by row group and balanced by BBS.

    **Plan of epoch e** (a pure function of ``seed``, ``e`` and the row-group layout, identical
    on every rank): the row groups of all shards are permuted (``shuffle``), the rows inside each
    row group are permuted, and the concatenation is the epoch's *global stream*. Rank ``r`` takes
    the contiguous slice ``[r * N // W + min(r, N % W), ...)`` of ``N // W`` (+1 for the first
    ``N % W`` ranks) samples, so ranks never share a sample and together cover all of them, and
    a rank reads only the row groups its slice touches (at most two are shared with a
    neighbour). With ``drop_last=True`` every rank takes ``N // W`` samples, cut to full batches:
    every rank yields ``len(loader)`` batches of ``batch_size``.

    **Sub-batches and BBS**: the rank's stream is cut into sub-batches of ``sub_batch_size``
    samples (default ``gcd(batch_size, 128)``: 128 for batches of 1024) and pools of ``pool_batches * batch_size`` samples. ``balance="bbs"``: each pool's
    sub-batches are sorted by ``cost_model`` cost and dealt to the pool's batches heaviest with
    lightest (:func:`gem_data.bbs_merge`); ``"none"``: batches are consecutive. Samples of the
    pool left over by full batches (the stream's end) form one last partial batch, in stream
    order (dropped with ``drop_last``).

    **Workers**: ``num_workers`` threads read and validate row groups ahead, each a different
    row group (Parquet decoding releases the GIL); results are consumed in plan order, so the
    batches do not depend on ``num_workers``.

    **Resume**: :meth:`state_dict` holds the epoch and the batches yielded in it. Every full
    pool yields exactly ``pool_batches`` batches, so resuming computes the pool, skips the row
    groups before it without reading them, re-reads that pool and skips the batches already
    yielded: the next batch is exactly the one that would have come next.

    **Validation**: on open, every shard's footer is read and its schema checked (missing
    column, wrong type, unreadable file) and its row count compared with ``dataset.json``;
    each row group's values are checked when it is read (``DatasetFormatError`` naming file and
    row group, never a silent partial read). Page checksums written by the generator are
    verified. A shard that changes on disk during the run (another schema, other row groups,
    emptied) is detected when it is next read: ``DatasetFormatError`` naming it and the row
    group.

    **Bad rows** (``on_bad_row``): ``"error"`` (default) raises the ``DatasetFormatError`` above
    for a row group with a bad value (NaN / Inf dense features, ids outside the cardinalities
    of ``dataset.json``, nulls, labels outside [0, 1], ...); ``"skip"`` leaves the bad rows out of
    their batches (which come out smaller; the epoch plan, the batch count and resuming are
    unchanged) and counts them in ``skipped_rows`` (``skipped_examples``: why, for the first
    ones). A batch whose rows are all bad still raises. Problems of a whole file (unreadable,
    wrong schema, row counts) always raise.
    """

    _STATE_FORMAT = "gem_data.ShardedBatchLoader"
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
        sub_batch_size: int | None = None,
        balance: str = "bbs",
        pool_batches: int = 32,
        cost_model: CostModel = attention_cost,
        num_workers: int = 0,
        prefetch_row_groups: int | None = None,
        pin_memory: bool | None = None,
        on_bad_row: str = "error",
    ) -> None:
        self.directory = check_directory(directory)
        self.batch_size = check_int("batch_size", batch_size, 1)
        self.seed = check_int("seed", seed, 0)
        self.world_size = check_int("world_size", world_size, 1)
        self.rank = check_int("rank", rank, 0)
        if self.rank >= self.world_size:
            raise ValueError(f"rank must be < world_size ({self.world_size}), got {self.rank}")
        self.sub_batch_size = check_int(
            "sub_batch_size",
            math.gcd(self.batch_size, 128) if sub_batch_size is None else sub_batch_size,
            1,
        )
        self.pool_batches = check_int("pool_batches", pool_batches, 1)
        self.num_workers = check_int("num_workers", num_workers, 0)
        self.prefetch_row_groups = check_int(
            "prefetch_row_groups",
            2 * max(1, self.num_workers) if prefetch_row_groups is None else prefetch_row_groups,
            1,
        )
        if not isinstance(balance, str) or balance not in BALANCE_MODES:
            raise ValueError(f"balance must be one of {BALANCE_MODES}, got {balance!r}")
        if balance == "bbs" and self.batch_size % self.sub_batch_size:
            raise ValueError(
                f"batch_size ({self.batch_size}) must be a multiple of sub_batch_size "
                f"({self.sub_batch_size}) for balance='bbs'"
            )
        if not callable(cost_model):
            raise TypeError(f"cost_model must be callable (lengths -> costs), got {cost_model!r}")
        self.balance = balance
        self.cost_model = cost_model
        self.shuffle = check_bool("shuffle", shuffle)
        self.drop_last = check_bool("drop_last", drop_last)
        if pin_memory is None:
            self.pin_memory = torch.cuda.is_available()
        else:
            self.pin_memory = check_bool("pin_memory", pin_memory)
        if self.pin_memory and not torch.cuda.is_available():
            raise ValueError("pin_memory=True needs CUDA (pinned memory is for device copies)")
        self.on_bad_row = check_on_bad_row(on_bad_row)
        self.skipped_rows = 0
        """Bad rows left out of the batches yielded so far (``on_bad_row="skip"``)."""
        self.skipped_examples: list[str] = []
        """Where and why, for the first skipped rows."""
        self.dataset_info, files, num_dense = dataset_files(self.directory)
        self.files = [Path(path) for path in files]
        self._open(num_dense)
        self._epoch = 0
        self._batches_yielded = 0
        self._iteration_token = 0
        self._local = threading.local()
        self._stage_lock = threading.Lock()
        self.stage_seconds: dict[str, float] = dict.fromkeys(_STAGES, 0.0)
        """Seconds spent per stage since construction (``read`` and ``validate`` summed over
        worker threads): a cheap profile of the pipeline."""

    def _open(self, num_dense: int | None) -> None:
        """Read every footer: schema, row counts, row-group layout."""
        expected_rows = self.dataset_info.file_num_rows if self.dataset_info else []
        file_of, index_in_file, rows = [], [], []
        self._file_layouts: list[list[int]] = []
        self._file_signatures: list[tuple[int, ...]] = []
        for number, path in enumerate(self.files):
            signature = _file_signature(path)
            parquet_file = open_parquet(path)
            num_dense = validate_schema(
                parquet_file.schema_arrow, path, num_dense_features=num_dense
            )
            metadata = parquet_file.metadata
            self._file_signatures.append(signature)
            self._file_layouts.append(
                [metadata.row_group(g).num_rows for g in range(metadata.num_row_groups)]
            )
            if expected_rows and metadata.num_rows != expected_rows[number]:
                raise DatasetFormatError(
                    f"{path}: holds {metadata.num_rows} rows, {DATASET_INFO_FILE} says "
                    f"{expected_rows[number]}"
                )
            for group in range(metadata.num_row_groups):
                group_rows = metadata.row_group(group).num_rows
                if group_rows:
                    file_of.append(number)
                    index_in_file.append(group)
                    rows.append(group_rows)
        self.num_dense_features = int(num_dense)
        self._columns = list(dataset_schema(self.num_dense_features).names)
        self._group_file = np.asarray(file_of, dtype=np.int64)
        self._group_index = np.asarray(index_in_file, dtype=np.int64)
        self.row_group_rows = np.asarray(rows, dtype=np.int64)
        """Rows of every (non-empty) row group, in file order: the units of reading."""
        self.total_samples = int(self.row_group_rows.sum())
        if self.dataset_info is not None and self.total_samples != self.dataset_info.num_samples:
            raise DatasetFormatError(
                f"{self.directory}: shards hold {self.total_samples} rows, {DATASET_INFO_FILE} "
                f"says {self.dataset_info.num_samples}"
            )

    # ----------------------------------------------------------------- epoch plan
    @property
    def epoch(self) -> int:
        """The epoch the next batch belongs to (0-based)."""
        return self._epoch

    def _rank_range(self) -> tuple[int, int]:
        """This rank's slice ``[start, stop)`` of the epoch's global stream."""
        base, extra = divmod(self.total_samples, self.world_size)
        if self.drop_last:
            start = self.rank * base
            return start, start + (base // self.batch_size) * self.batch_size
        start = self.rank * base + min(self.rank, extra)
        return start, start + base + (1 if self.rank < extra else 0)

    @property
    def num_samples(self) -> int:
        """Samples this rank yields per epoch."""
        start, stop = self._rank_range()
        return stop - start

    def __len__(self) -> int:
        """Batches per epoch on this rank (the same formula as :class:`ParquetBatchLoader`)."""
        return math.ceil(self.num_samples / self.batch_size)

    def row_group_order(self, epoch: int) -> np.ndarray:
        """Row-group numbers (indices into ``row_group_rows``) in the order of ``epoch``'s stream."""
        epoch = check_int("epoch", epoch, 0)
        count = len(self.row_group_rows)
        if not self.shuffle:
            return np.arange(count)
        rng = np.random.default_rng([self.seed, epoch, _ROW_GROUP_ORDER_STREAM])
        return rng.permutation(count)

    def _row_order(self, epoch: int, group: int) -> np.ndarray | None:
        if not self.shuffle:
            return None
        rng = np.random.default_rng([self.seed, epoch, int(group), _ROW_ORDER_STREAM])
        return rng.permutation(int(self.row_group_rows[group]))

    def planned_batch_costs(self, group_lengths: list[np.ndarray], epoch: int = 0) -> np.ndarray:
        """The cost (``cost_model``) of every batch this rank yields in ``epoch``, in order,
        planned from the history lengths alone: ``group_lengths[g]`` holds row group ``g``'s
        lengths in file order (``row_group_rows`` entries). The batches are the ones iteration
        assembles (the same stream, pools and Base Batch Shuffling), without decoding them."""
        epoch = check_int("epoch", epoch, 0)
        if [len(group) for group in group_lengths] != self.row_group_rows.tolist():
            raise ValueError(
                "group_lengths must hold one length per row of each row group "
                f"({self.row_group_rows.tolist()} rows), got {[len(g) for g in group_lengths]}"
            )
        pieces = []
        for group, lo, hi in self.rank_segments(epoch):
            order = self._row_order(epoch, group)
            lengths = np.asarray(group_lengths[group], dtype=np.int64)
            pieces.append((lengths if order is None else lengths[order])[lo:hi])
        stream = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
        pool_size = self.pool_batches * self.batch_size
        costs = []
        for start in range(0, stream.size, pool_size):
            pool = stream[start : start + pool_size]
            for rows in self._batch_rows(pool):
                costs.append(float(self.cost_model(pool[rows]).sum()))
        return np.asarray(costs, dtype=np.float64)

    def rank_segments(self, epoch: int, start: int = 0) -> list[tuple[int, int, int]]:
        """``(row group, lo, hi)`` pieces of this rank's stream in ``epoch`` from position ``start``.

        ``lo:hi`` index the row group's rows in their shuffled order; the pieces concatenated
        are the rank's stream from ``start`` on.
        """
        order = self.row_group_order(epoch)
        sizes = self.row_group_rows[order]
        ends = np.cumsum(sizes)
        first, stop = self._rank_range()
        first += start
        segments = []
        for position in range(int(np.searchsorted(ends, first, side="right")), len(order)):
            begin = int(ends[position] - sizes[position])
            if begin >= stop:
                break
            lo, hi = max(first, begin) - begin, min(stop, int(ends[position])) - begin
            if hi > lo:
                segments.append((int(order[position]), lo, hi))
        return segments

    # ------------------------------------------------------------------- reading
    def _add_time(self, stage: str, started: float) -> float:
        now = time.perf_counter()
        with self._stage_lock:
            self.stage_seconds[stage] += now - started
        return now

    def _parquet_file(self, number: int, where: str) -> pq.ParquetFile:
        """This thread's reader of file ``number`` (ParquetFile is not shared across threads),
        opened again when the file changed on disk, after checking that its schema and
        row-group layout are still the ones the epoch plan was made from."""
        cache = getattr(self._local, "files", None)
        if cache is None:
            cache = self._local.files = {}
        path = self.files[number]
        signature = _file_signature(path, where)
        cached = cache.get(number)
        if cached is None or cached[1] != signature:
            reader = open_parquet(path)
            if signature != self._file_signatures[number]:
                self._check_unchanged(number, reader, where)
            cache[number] = cached = (reader, signature)
        return cached[0]

    def _check_unchanged(self, number: int, reader: pq.ParquetFile, where: str) -> None:
        """The schema and row groups of a file rewritten since :meth:`_open` are the same."""
        validate_schema(reader.schema_arrow, where, num_dense_features=self.num_dense_features)
        metadata = reader.metadata
        layout = [metadata.row_group(g).num_rows for g in range(metadata.num_row_groups)]
        if layout != self._file_layouts[number]:
            raise DatasetFormatError(
                f"{where}: the file changed since the loader opened it: row groups of "
                f"{layout} rows, the epoch plan was made from {self._file_layouts[number]}"
            )

    def _read_segment(self, epoch: int, group: int, lo: int, hi: int) -> Columns:
        """Rows ``lo:hi`` (in shuffled order) of one row group, validated."""
        started = time.perf_counter()
        path = self.files[self._group_file[group]]
        index = int(self._group_index[group])
        where = f"{path} (row group {index})"
        reader = self._parquet_file(int(self._group_file[group]), where)
        try:
            table = reader.read_row_group(index, columns=self._columns)
        except (pa.ArrowException, OSError, IndexError) as error:
            raise DatasetFormatError(f"{where}: cannot read the Parquet data ({error})") from error
        # The reader checked the footer; this checks what was decoded.
        validate_schema(table.schema, where, num_dense_features=self.num_dense_features)
        if table.num_rows != self.row_group_rows[group]:
            raise DatasetFormatError(
                f"{where}: read {table.num_rows} rows, the footer says {self.row_group_rows[group]}"
            )
        started = self._add_time("read", started)
        columns = table_to_columns(
            table, where, self.num_dense_features, self.dataset_info, self.on_bad_row
        )
        started = self._add_time("validate", started)
        order = self._row_order(epoch, group)
        if order is not None:
            columns = columns.take(order[lo:hi])
        elif lo or hi < columns.num_rows:
            columns = columns.slice(lo, hi)
        self._add_time("shuffle", started)
        return columns

    def _segment_columns(
        self, epoch: int, segments: list[tuple[int, int, int]]
    ) -> Iterator[Columns]:
        """The segments' columns in order, read ahead by the worker threads."""
        if self.num_workers == 0:
            for segment in segments:
                yield self._read_segment(epoch, *segment)
            return
        pool = concurrent.futures.ThreadPoolExecutor(
            self.num_workers, thread_name_prefix="gem-data-reader"
        )
        pending: deque[concurrent.futures.Future[Columns]] = deque()
        upcoming = iter(segments)
        try:
            for segment in upcoming:
                pending.append(pool.submit(self._read_segment, epoch, *segment))
                if len(pending) >= self.prefetch_row_groups:
                    break
            while pending:
                columns = pending.popleft().result()
                segment = next(upcoming, None)
                if segment is not None:
                    pending.append(pool.submit(self._read_segment, epoch, *segment))
                yield columns
        finally:
            for future in pending:
                future.cancel()
            pool.shutdown(wait=True, cancel_futures=True)

    def _pools(self, epoch: int, first_pool: int) -> Iterator[Columns]:
        """The rank's stream of ``epoch`` in pools of ``pool_batches * batch_size`` samples."""
        pool_size = self.pool_batches * self.batch_size
        segments = self.rank_segments(epoch, first_pool * pool_size)
        buffered: list[Columns] = []
        count = 0
        for columns in self._segment_columns(epoch, segments):
            buffered.append(columns)
            count += columns.num_rows
            while count >= pool_size:
                started = time.perf_counter()
                merged = Columns.concat(buffered)
                rest = merged.slice(pool_size, merged.num_rows)
                buffered, count = ([rest] if rest.num_rows else []), rest.num_rows
                pool = merged.slice(0, pool_size)
                self._add_time("assemble", started)
                yield pool
        if count:
            yield Columns.concat(buffered)

    def _pool_batch_rows(self, pool: Columns) -> list[np.ndarray]:
        """Row indices into ``pool`` of each of its batches, in yield order."""
        started = time.perf_counter()
        batches = self._batch_rows(pool.history_lengths)
        self._add_time("balance", started)
        return batches

    def _batch_rows(self, history_lengths: np.ndarray) -> list[np.ndarray]:
        """Row indices of each batch of a pool whose histories have ``history_lengths``."""
        size, num_rows = self.batch_size, len(history_lengths)
        num_full = num_rows // size
        if self.balance == "bbs" and num_full:
            sub = self.sub_batch_size
            costs = sub_batch_costs(history_lengths[: num_full * size], sub, self.cost_model)
            merged = bbs_merge(costs, size // sub)
            offsets = np.arange(sub, dtype=np.int64)
            batches = [(row[:, None] * sub + offsets).reshape(-1) for row in merged]
        else:
            batches = [np.arange(j * size, (j + 1) * size) for j in range(num_full)]
        if num_rows > num_full * size and not self.drop_last:
            batches.append(np.arange(num_full * size, num_rows))
        return batches

    def collate(self, pool: Columns, rows: np.ndarray) -> Batch:
        """One batch of ``pool`` rows (bad rows left out and counted), pinned when
        ``pin_memory``."""
        started = time.perf_counter()
        rows = self._without_bad_rows(pool, rows)
        batch = pool.collate(rows)
        started = self._add_time("collate", started)
        if self.pin_memory:
            batch = batch.pin_memory()
            self._add_time("pin", started)
        return batch

    def _without_bad_rows(self, pool: Columns, rows: np.ndarray) -> np.ndarray:
        kept, dropped = drop_bad_rows(pool, rows, self.skipped_examples)
        self.skipped_rows += dropped
        return kept

    # ------------------------------------------------------------------ iteration
    def __iter__(self) -> Iterator[Batch]:
        self._iteration_token += 1
        if self._batches_yielded > 0 and self._batches_yielded >= len(self):
            self._epoch += 1
            self._batches_yielded = 0
        return self._iterate(self._iteration_token, self._epoch, self._batches_yielded)

    def _iterate(self, token: int, epoch: int, first_batch: int) -> Iterator[Batch]:
        num_batches = len(self)
        batch_number = first_batch
        first_pool, skip = divmod(first_batch, self.pool_batches)
        if batch_number < num_batches:
            for pool in self._pools(epoch, first_pool):
                for rows in self._pool_batch_rows(pool)[skip:]:
                    if batch_number >= num_batches:
                        break
                    batch = self.collate(pool, rows)
                    if token != self._iteration_token:  # a newer iter() or load_state_dict
                        return
                    batch_number += 1
                    self._batches_yielded = batch_number
                    yield batch
                skip = 0
                if batch_number >= num_batches:
                    break
        if token == self._iteration_token:
            self._epoch = epoch + 1
            self._batches_yielded = 0

    # ---------------------------------------------------------------------- resume
    def _identity(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "shuffle": self.shuffle,
            "batch_size": self.batch_size,
            "world_size": self.world_size,
            "drop_last": self.drop_last,
            "total_samples": self.total_samples,
            "num_row_groups": len(self.row_group_rows),
            "sub_batch_size": self.sub_batch_size,
            "balance": self.balance,
            "pool_batches": self.pool_batches,
            "cost_model": _cost_model_name(self.cost_model),
        }
