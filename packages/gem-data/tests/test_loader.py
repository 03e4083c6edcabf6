"""ParquetBatchLoader: batch contents, sharding, shuffling, resume, and format errors."""

from __future__ import annotations

import shutil
from itertools import islice

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from gem_data import (
    SEQUENCE_FEATURE_NAMES,
    SPARSE_FEATURE_NAMES,
    Batch,
    DatasetFormatError,
    ParquetBatchLoader,
)
from hypothesis import given, settings
from hypothesis import strategies as st


@pytest.fixture(scope="module")
def rows_by_index(dataset) -> dict[int, dict]:
    table = pa.concat_tables([pq.read_table(path) for path in dataset.files])
    return {row["sample_index"]: row for row in table.to_pylist()}


def _indices(batch: Batch) -> list[int]:
    assert batch.sample_indices is not None
    return batch.sample_indices.tolist()


def test_batch_contents_match_rows(dataset, rows_by_index):
    loader = ParquetBatchLoader(dataset.directory, 37, shuffle=True, seed=3)
    batch = next(iter(loader))
    assert batch.batch_size == 37
    rows = [rows_by_index[i] for i in _indices(batch)]
    lengths = [len(row["hist_item_ids"]) for row in rows]

    assert batch.sequence_offsets.dtype == torch.int64
    assert batch.sequence_offsets.tolist() == np.concatenate([[0], np.cumsum(lengths)]).tolist()
    sequence = batch.sequence_features
    assert sequence.keys() == list(SEQUENCE_FEATURE_NAMES)
    for name in SEQUENCE_FEATURE_NAMES:
        jagged = sequence[name]
        assert jagged.lengths().tolist() == lengths
        assert jagged.values().dtype == torch.int64
        assert jagged.values().tolist() == [v for row in rows for v in row[name]]
    assert batch.sequence_timestamps.tolist() == [v for row in rows for v in row["hist_timestamps"]]

    sparse = batch.sparse_features
    assert sparse.keys() == list(SPARSE_FEATURE_NAMES)
    segments = sparse["user_segments"]
    assert segments.lengths().tolist() == [len(row["user_segments"]) for row in rows]
    assert segments.values().tolist() == [v for row in rows for v in row["user_segments"]]
    for name in ("user_id", "device_type", "region", "ad_id", "ad_category_id"):
        assert sparse[name].lengths().tolist() == [1] * 37
        assert sparse[name].values().tolist() == [row[name] for row in rows]

    assert batch.dense_features.dtype == torch.float32
    assert batch.dense_features.shape == (37, dataset.num_dense_features)
    np.testing.assert_array_equal(
        batch.dense_features.numpy(), np.array([row["dense_features"] for row in rows], np.float32)
    )
    assert batch.labels.dtype == torch.float32
    assert batch.labels.tolist() == [[row["click"], row["conversion"]] for row in rows]
    assert batch.label_probs.tolist() == [
        [row["click_prob"], row["conversion_prob"]] for row in rows
    ]


def test_batch_to_device_copies_everything(dataset):
    batch = next(iter(ParquetBatchLoader(dataset.directory, 8)))
    moved = batch.to("cpu")
    assert moved.batch_size == 8
    assert torch.equal(moved.sequence_features.values(), batch.sequence_features.values())
    assert torch.equal(moved.sparse_features.lengths(), batch.sparse_features.lengths())
    assert torch.equal(moved.labels, batch.labels)
    if torch.cuda.is_available():
        pinned = batch.pin_memory()
        assert pinned.dense_features.is_pinned()
        assert pinned.to("cuda", non_blocking=True).labels.is_cuda


@settings(max_examples=20, deadline=None)
@given(
    world_size=st.integers(1, 5),
    batch_size=st.integers(1, 130),
    shuffle=st.booleans(),
    epoch=st.integers(0, 3),
)
def test_ranks_cover_every_sample_once(dataset, world_size, batch_size, shuffle, epoch):
    seen: list[int] = []
    for rank in range(world_size):
        loader = ParquetBatchLoader(
            dataset.directory,
            batch_size,
            shuffle=shuffle,
            seed=11,
            rank=rank,
            world_size=world_size,
        )
        loader.load_state_dict({**loader.state_dict(), "epoch": epoch})
        batches = list(loader)
        assert len(batches) == len(loader)
        assert all(b.batch_size == batch_size for b in batches[:-1])
        seen += [i for b in batches for i in _indices(b)]
        assert loader.epoch == epoch + 1
    assert sorted(seen) == list(range(600))


@pytest.mark.parametrize(("world_size", "batch_size"), [(1, 64), (4, 16), (7, 10)])
def test_drop_last_gives_equal_full_batches_without_repeats(dataset, world_size, batch_size):
    seen: list[int] = []
    counts = set()
    for rank in range(world_size):
        loader = ParquetBatchLoader(
            dataset.directory, batch_size, rank=rank, world_size=world_size, drop_last=True
        )
        batches = list(loader)
        counts.add(len(batches))
        assert all(b.batch_size == batch_size for b in batches)
        seen += [i for b in batches for i in _indices(b)]
    assert counts == {(600 // world_size) // batch_size}
    assert len(seen) == len(set(seen))


def test_shuffle_is_deterministic_and_changes_per_epoch(dataset):
    def two_epochs(seed: int, shuffle: bool = True) -> list[list[int]]:
        loader = ParquetBatchLoader(dataset.directory, 50, shuffle=shuffle, seed=seed)
        return [[i for b in loader for i in _indices(b)] for _ in range(2)]

    first, again = two_epochs(5), two_epochs(5)
    assert first == again
    assert first[0] != first[1]
    assert sorted(first[0]) == sorted(first[1]) == list(range(600))
    assert two_epochs(6)[0] != first[0]
    assert two_epochs(5, shuffle=False) == [list(range(600))] * 2


def test_resume_from_state_dict_continues_exactly(dataset):
    reference_loader = ParquetBatchLoader(dataset.directory, 64, seed=2, rank=1, world_size=2)
    reference = [_indices(b) for _ in range(3) for b in reference_loader]
    per_epoch = len(reference_loader)
    # Resume after every kind of position: start, mid-epoch, just after an epoch's last batch.
    for stop in (0, 1, per_epoch - 1, per_epoch, per_epoch + 2):
        loader = ParquetBatchLoader(dataset.directory, 64, seed=2, rank=1, world_size=2)
        produced = []
        iterator = iter(loader)
        for _ in range(stop):
            try:
                produced.append(_indices(next(iterator)))
            except StopIteration:
                iterator = iter(loader)
                produced.append(_indices(next(iterator)))
        state = loader.state_dict()
        resumed = ParquetBatchLoader(dataset.directory, 64, seed=2, rank=1, world_size=2)
        resumed.load_state_dict(state)
        following = []
        while len(produced) + len(following) < len(reference):
            following += [_indices(b) for b in resumed]
        assert produced + following[: len(reference) - len(produced)] == reference


def test_reiterating_mid_epoch_continues_the_epoch(dataset):
    loader = ParquetBatchLoader(dataset.directory, 100, seed=1)
    full = [_indices(b) for b in ParquetBatchLoader(dataset.directory, 100, seed=1)]
    head = [_indices(b) for b in islice(loader, 2)]
    tail = [_indices(b) for b in loader]
    assert head + tail == full
    assert loader.epoch == 1


def test_state_dict_mismatch_is_rejected(dataset):
    loader = ParquetBatchLoader(dataset.directory, 32, seed=1)
    state = loader.state_dict()
    other = ParquetBatchLoader(dataset.directory, 16, seed=1)
    with pytest.raises(ValueError, match="batch_size"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        loader.load_state_dict({**state, "seed": 2})
    with pytest.raises(ValueError, match="batches_yielded"):
        loader.load_state_dict({**state, "batches_yielded": 10_000})
    with pytest.raises(ValueError, match="format"):
        loader.load_state_dict({"epoch": 0})
    with pytest.raises(TypeError, match="state"):
        loader.load_state_dict([1, 2])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"batch_size": 0}, ValueError, "batch_size"),
        ({"batch_size": -3}, ValueError, "batch_size"),
        ({"batch_size": 2.5}, TypeError, "batch_size"),
        ({"batch_size": 4, "rank": 2, "world_size": 2}, ValueError, "rank"),
        ({"batch_size": 4, "rank": -1}, ValueError, "rank"),
        ({"batch_size": 4, "world_size": 0}, ValueError, "world_size"),
        ({"batch_size": 4, "seed": -1}, ValueError, "seed"),
    ],
)
def test_bad_arguments(dataset, kwargs, error, message):
    with pytest.raises(error, match=message):
        ParquetBatchLoader(dataset.directory, **kwargs)


@pytest.fixture
def broken_copy(tmp_path, dataset):
    directory = tmp_path / "copy"
    shutil.copytree(dataset.directory, directory)
    return directory


def test_missing_column(broken_copy):
    path = broken_copy / "part-00001.parquet"
    pq.write_table(pq.read_table(path).drop_columns(["ad_id"]), path)
    with pytest.raises(DatasetFormatError, match=r"part-00001\.parquet.*missing column 'ad_id'"):
        ParquetBatchLoader(broken_copy, 8)


def test_wrong_column_type(broken_copy):
    path = broken_copy / "part-00002.parquet"
    table = pq.read_table(path)
    index = table.schema.get_field_index("region")
    table = table.set_column(index, "region", table.column("region").cast(pa.string()))
    pq.write_table(table, path)
    with pytest.raises(DatasetFormatError, match=r"part-00002\.parquet.*'region'.*string"):
        ParquetBatchLoader(broken_copy, 8)


def test_wrong_list_type(broken_copy):
    path = broken_copy / "part-00000.parquet"
    table = pq.read_table(path)
    index = table.schema.get_field_index("hist_item_ids")
    column = table.column("hist_item_ids").cast(pa.list_(pa.int32()))
    pq.write_table(table.set_column(index, "hist_item_ids", column), path)
    with pytest.raises(DatasetFormatError, match=r"'hist_item_ids'.*int32"):
        ParquetBatchLoader(broken_copy, 8)


def test_corrupt_file(broken_copy):
    (broken_copy / "part-00001.parquet").write_bytes(b"this is not parquet" * 100)
    with pytest.raises(DatasetFormatError, match=r"part-00001\.parquet.*not a readable Parquet"):
        ParquetBatchLoader(broken_copy, 8)


def test_missing_file(broken_copy):
    (broken_copy / "part-00002.parquet").unlink()
    with pytest.raises(DatasetFormatError, match=r"part-00002\.parquet.*missing"):
        ParquetBatchLoader(broken_copy, 8)


def test_out_of_range_ids(broken_copy, dataset):
    path = broken_copy / "part-00000.parquet"
    table = pq.read_table(path)
    index = table.schema.get_field_index("ad_id")
    bad = pa.array(np.full(table.num_rows, dataset.sparse_features["ad_id"]), pa.int64())
    pq.write_table(table.set_column(index, "ad_id", bad), path)
    with pytest.raises(DatasetFormatError, match=r"'ad_id'.*ids"):
        ParquetBatchLoader(broken_copy, 8)


def test_reads_without_dataset_json(broken_copy):
    (broken_copy / "dataset.json").unlink()
    loader = ParquetBatchLoader(broken_copy, 100, shuffle=False)
    assert loader.dataset_info is None
    assert [i for b in loader for i in _indices(b)] == list(range(600))
