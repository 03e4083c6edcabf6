"""Fuzzed loader construction and fuzzed bad rows (issue 27).

Loader arguments: a valid ``ParquetBatchLoader`` / ``ShardedBatchLoader`` call with up to two
faults (sizes that are zero, negative, non-int, bool or huge; ranks outside the world; flags
that are not bools; directories that are not paths, missing, files or empty; unknown balance
modes, cost models that are not callable, worker counts, pinned memory without CUDA, unknown
``on_bad_row``). Every call either works, and then an epoch of every rank is checked (batch
count and sizes, no sample twice, together all samples), or raises a ``ValueError`` /
``TypeError`` (``DatasetFormatError`` is a ``ValueError``) naming an argument it broke.

Bad rows: a few random cells of a small dataset get a bad value (NaN / Inf dense features,
ids outside the cardinalities of dataset.json, negative ids, labels outside [0, 1], NaN
labels). ``on_bad_row="error"`` must raise ``DatasetFormatError`` naming a corrupted file and
its row group; ``"skip"`` must yield exactly the good rows and count the bad ones.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from data_faults import BATCH, ROW_GROUP, ROWS, _set_cell, _shard, make_dataset
from fuzz_tally import Fault, Tally, fuzz_settings
from gem_data import DatasetFormatError, ParquetBatchLoader, ShardedBatchLoader, read_dataset_info
from hypothesis import given
from hypothesis import strategies as st


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    return make_dataset(tmp_path_factory.mktemp("fuzz") / "dataset")


# ---------------------------------------------------------------------------------------------
# Loader arguments.

HUGE = [2**40, 2**63, 2**100]


@st.composite
def loader_calls(draw, sharded: bool):
    world = draw(st.integers(1, 3))
    kwargs = {
        "batch_size": draw(st.sampled_from([1, 3, 8, 16, 40, 200, *HUGE])),
        "shuffle": draw(st.booleans()),
        "seed": draw(st.sampled_from([0, 1, 12345, 2**64, 2**100])),
        "rank": draw(st.integers(0, world - 1)),
        "world_size": world,
        "drop_last": draw(st.booleans()),
        "on_bad_row": draw(st.sampled_from(["error", "skip"])),
    }
    if sharded:
        kwargs["balance"] = draw(st.sampled_from(["bbs", "none"]))
        if draw(st.booleans()):
            kwargs["pool_batches"] = draw(st.sampled_from([1, 2, 5, 2**40]))
        kwargs["num_workers"] = draw(st.integers(0, 2))
        if draw(st.booleans()):
            kwargs["prefetch_row_groups"] = draw(st.sampled_from([1, 3, 2**40]))
        kwargs["pin_memory"] = draw(st.sampled_from([None, False]))
        if draw(st.booleans()) and isinstance(kwargs["batch_size"], int):
            size = kwargs["batch_size"]
            kwargs["sub_batch_size"] = draw(
                st.sampled_from([d for d in (1, 2, 4, 8) if size % d == 0] or [1])
            )
    faults: list[Fault] = []
    table = SHARDED_FAULTS if sharded else COMMON_FAULTS
    for fault in draw(st.lists(st.sampled_from(table), max_size=2, unique=True)):
        fault(draw, kwargs, faults)
    return kwargs, faults


def _bad_int(draw, kwargs, faults, name, low):
    value = draw(st.sampled_from([low - 1, -(2**70), 2.5, True, "8", None, np.int64(4)]))
    kwargs[name] = value
    # numpy ints are ints: np.int64(4) is a valid size.
    ok = isinstance(value, np.integer) and value >= low
    faults.append(Fault(f"{name}_{value!r}", "either" if ok else "reject", [name]))


def fault_batch_size(draw, kwargs, faults):
    _bad_int(draw, kwargs, faults, "batch_size", 1)
    if kwargs.get("sub_batch_size") is not None:
        faults.append(Fault("sub_batch_size_with_bad_batch", "either", ["sub_batch_size"]))


def fault_seed(draw, kwargs, faults):
    value = draw(st.sampled_from([-1, 1.5, None, "0"]))
    kwargs["seed"] = value
    faults.append(Fault(f"seed_{value!r}", "reject", ["seed"]))


def fault_rank(draw, kwargs, faults):
    how = draw(st.sampled_from(["rank_equal", "rank_above", "rank_negative", "world_zero"]))
    if how == "rank_equal":
        kwargs["rank"] = kwargs["world_size"]
    elif how == "rank_above":
        kwargs["rank"] = kwargs["world_size"] + 2**40
    elif how == "rank_negative":
        kwargs["rank"] = -1
    else:
        kwargs["world_size"] = 0
    faults.append(Fault(how, "reject", ["rank", "world_size"]))


def fault_flag(draw, kwargs, faults):
    name = draw(st.sampled_from(["shuffle", "drop_last"]))
    kwargs[name] = draw(st.sampled_from(["no", 1, None, "False"]))
    faults.append(Fault(f"{name}_not_bool", "reject", [name]))


def fault_directory(draw, kwargs, faults):
    how = draw(st.sampled_from(["int", "none", "missing", "file", "empty"]))
    kwargs["directory_fault"] = how
    faults.append(Fault(f"directory_{how}", "reject", ["directory"]))


def fault_on_bad_row(draw, kwargs, faults):
    kwargs["on_bad_row"] = draw(st.sampled_from(["drop", None, True, "SKIP", ""]))
    faults.append(Fault("on_bad_row", "reject", ["on_bad_row"]))


def fault_sharded_option(draw, kwargs, faults):
    name, value = draw(
        st.sampled_from(
            [
                ("balance", "BBS"),
                ("balance", None),
                ("pool_batches", 0),
                ("pool_batches", 1.0),
                ("num_workers", -1),
                ("num_workers", 1.5),
                ("prefetch_row_groups", 0),
                ("sub_batch_size", 0),
                ("sub_batch_size", 3),
                ("sub_batch_size", "8"),
                ("cost_model", 5),
                ("cost_model", "attention"),
                ("pin_memory", True),
                ("pin_memory", "yes"),
            ]
        )
    )
    kwargs[name] = value
    kind = "reject"
    size = kwargs.get("batch_size")
    if (name, value) == ("sub_batch_size", 3):
        # Valid when it divides the batch, or without BBS.
        valid_size = isinstance(size, int) and not isinstance(size, bool) and size >= 1
        if kwargs.get("balance") == "none" or (valid_size and size % 3 == 0):
            kind = "either"
    names = [name, "batch_size"] if name == "sub_batch_size" else [name]
    faults.append(Fault(f"{name}_{value!r}", kind, names))


COMMON_FAULTS = [fault_batch_size, fault_seed, fault_rank, fault_flag, fault_directory,
                 fault_on_bad_row]  # fmt: skip
SHARDED_FAULTS = [*COMMON_FAULTS, fault_sharded_option]


def _directory(pristine: Path, kwargs: dict, scratch: Path):
    how = kwargs.pop("directory_fault", None)
    if how is None:
        return pristine
    if how == "int":
        return 123
    if how == "none":
        return None
    if how == "missing":
        return scratch / "missing"
    if how == "file":
        return _shard(pristine, 0)
    empty = scratch / "empty"
    empty.mkdir(exist_ok=True)
    return empty


def _check_epochs(cls, directory, kwargs: dict, loader) -> str | None:
    """Every rank's epoch: batch count and sizes, no sample twice, all samples together."""
    world = kwargs["world_size"]
    seen: list[int] = []
    for rank in range(world):
        current = loader if rank == kwargs["rank"] else cls(directory, **(kwargs | {"rank": rank}))
        batches = list(current)
        if len(batches) != len(current):
            return f"rank {rank}: {len(batches)} batches, len() says {len(current)}"
        sizes = [b.batch_size for b in batches]
        if any(s > current.batch_size or s < 1 for s in sizes):
            return f"rank {rank}: batch sizes {sizes}"
        if current.drop_last and any(s != current.batch_size for s in sizes):
            return f"rank {rank}: drop_last batch sizes {sizes}"
        indices = [int(i) for b in batches for i in b.sample_indices]
        if len(indices) != current.num_samples:
            return f"rank {rank}: {len(indices)} samples, num_samples says {current.num_samples}"
        if any(not bool(np.isfinite(b.dense_features.numpy()).all()) for b in batches):
            return f"rank {rank}: non-finite dense features"
        seen += indices
    if len(seen) != len(set(seen)):
        return "a sample was yielded twice in one epoch"
    if not kwargs["drop_last"] and sorted(seen) != list(range(ROWS)):
        return f"{len(seen)} samples over all ranks, want all {ROWS}"
    return None


@pytest.mark.parametrize(
    ("cls", "examples"),
    [(ParquetBatchLoader, 60), (ShardedBatchLoader, 80)],
    ids=["memory", "sharded"],
)
def test_fuzz_loader_arguments(pristine, tmp_path, cls, examples):
    tally = Tally(cls.__name__)
    sharded = cls is ShardedBatchLoader

    @fuzz_settings(examples)
    @given(case=loader_calls(sharded))
    def run(case):
        kwargs, faults = case
        kwargs = dict(kwargs)
        broken = "directory_fault" in kwargs
        directory = _directory(pristine, kwargs, tmp_path)
        # Dataset errors name the directory (or file) by its path.
        also = (str(directory),) if broken and isinstance(directory, Path) else ()
        state = {}

        def call():
            state["loader"] = cls(directory, **kwargs)
            return state["loader"]

        tally.check(
            call,
            faults,
            lambda loader: _check_epochs(cls, directory, kwargs, loader),
            describe=f"{cls.__name__}({directory!r}, {kwargs})",
            also_names=also,
        )

    run()
    tally.finish()


# ---------------------------------------------------------------------------------------------
# Bad rows.

BAD_VALUES = {
    "nan_dense": ("dense_features", "dense", math.nan),
    "inf_dense": ("dense_features", "dense", math.inf),
    "ad_id_too_big": ("ad_id", "cardinality", 0),
    "user_id_negative": ("user_id", "value", -1),
    "device_too_big": ("device_type", "cardinality", 3),
    "item_too_big": ("hist_item_ids", "cardinality", 0),
    "segment_negative": ("user_segments", "value", -5),
    "click_two": ("click", "value", 2.0),
    "click_nan": ("click", "value", math.nan),
    "prob_negative": ("click_prob", "value", -0.5),
}


@st.composite
def corruptions(draw):
    cells = draw(
        st.lists(
            st.tuples(st.integers(0, 2), st.integers(0, 31), st.sampled_from(sorted(BAD_VALUES))),
            min_size=1,
            max_size=3,
            unique_by=lambda cell: cell[:2],
        )
    )
    return cells, draw(st.sampled_from(["error", "skip"])), draw(st.booleans())


def _corrupt(directory: Path, cells) -> tuple[set[int], set[str]]:
    """Write the bad values; returns the bad sample indices and, for each bad cell, its file
    and ``<file> (row group <g>)``."""
    info = read_dataset_info(directory)
    cardinalities = {**info.sequence_features, **info.sparse_features}
    bad, places = set(), set()
    for shard, row, what in cells:
        column, how, value = BAD_VALUES[what]
        path = _shard(directory, shard)
        if how == "dense":
            dense = pq.read_table(path).column("dense_features").to_pylist()[row]
            value, whole = [value, *dense[1:]], True
        elif how == "cardinality":
            value, whole = cardinalities[column] + value, False
        else:
            whole = False
        bad.add(_set_cell(path, row, column, value, whole=whole))
        places.add((str(path), f"{path} (row group {row // ROW_GROUP})"))
    return bad, places


def test_fuzz_bad_rows(pristine, tmp_path):
    tally = Tally("bad_rows")
    counter = iter(range(10**9))

    @fuzz_settings(30)
    @given(case=corruptions())
    def run(case):
        cells, mode, sharded = case
        directory = tmp_path / f"d{next(counter)}"
        shutil.copytree(pristine, directory)
        bad, places = _corrupt(directory, cells)
        cls = ShardedBatchLoader if sharded else ParquetBatchLoader
        # The error names a bad file (ShardedBatchLoader: and its row group).
        names = [group if sharded else path for path, group in places]

        def call():
            loader = cls(directory, BATCH, on_bad_row=mode, seed=1)
            return loader, list(loader)

        def oracle(result) -> str | None:
            loader, batches = result
            if mode == "error":
                return "the bad rows were read without an error"
            seen = sorted(int(i) for b in batches for i in b.sample_indices)
            if seen != sorted(set(range(ROWS)) - bad):
                return f"yielded {len(seen)} samples, want the {ROWS - len(bad)} good ones"
            if loader.skipped_rows != len(bad):
                return f"skipped_rows={loader.skipped_rows}, {len(bad)} rows are bad"
            return None

        faults = [Fault("bad_rows", "accept" if mode == "skip" else "reject", names)]

        def dataset_error_only():
            try:
                return call()
            except DatasetFormatError:
                raise
            except ValueError as error:  # any other ValueError is not the dataset's error
                raise RuntimeError(f"not a DatasetFormatError: {error!r}") from error

        tally.check(dataset_error_only, faults, oracle, describe=f"{cls.__name__} {mode} {cells}")
        shutil.rmtree(directory)

    run()
    tally.finish()
