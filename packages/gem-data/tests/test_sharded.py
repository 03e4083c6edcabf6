"""ShardedBatchLoader: streaming plan, exact coverage, BBS, resume, workers, and format errors."""

from __future__ import annotations

import functools
import json
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.compute  # noqa: F401  (pa.compute)
import pyarrow.parquet as pq
import pytest
import torch
from gem_data import (
    SEQUENCE_FEATURE_NAMES,
    SPARSE_FEATURE_NAMES,
    AffineCost,
    Batch,
    DatasetFormatError,
    ParquetBatchLoader,
    ShardedBatchLoader,
    linear_cost,
    write_synthetic_dataset,
)
from hypothesis import given, settings
from hypothesis import strategies as st


@pytest.fixture(scope="module")
def big(tmp_path_factory, config):
    """4000 samples, 4 shards, row groups of 250 (16 row groups)."""
    return write_synthetic_dataset(
        config,
        tmp_path_factory.mktemp("big"),
        num_samples=4000,
        num_shards=4,
        workers=1,
        progress=False,
        row_group_size=250,
    )


@pytest.fixture(scope="module")
def rows_by_index(dataset) -> dict[int, dict]:
    table = pa.concat_tables([pq.read_table(path) for path in dataset.files])
    return {row["sample_index"]: row for row in table.to_pylist()}


def _indices(batch: Batch) -> list[int]:
    assert batch.sample_indices is not None
    return batch.sample_indices.tolist()


def _costs(batch: Batch) -> float:
    lengths = batch.sequence_offsets.diff().double()
    return float((lengths * lengths).sum())


def test_batch_contents_match_rows(dataset, rows_by_index):
    loader = ShardedBatchLoader(dataset.directory, 48, seed=3, sub_batch_size=16, pool_batches=3)
    for batch in loader:
        rows = [rows_by_index[i] for i in _indices(batch)]
        lengths = [len(row["hist_item_ids"]) for row in rows]
        assert batch.sequence_offsets.tolist() == np.concatenate([[0], np.cumsum(lengths)]).tolist()
        for name in SEQUENCE_FEATURE_NAMES:
            assert batch.sequence_features[name].lengths().tolist() == lengths
            assert batch.sequence_features[name].values().tolist() == [
                v for row in rows for v in row[name]
            ]
        assert batch.sequence_timestamps.tolist() == [
            v for row in rows for v in row["hist_timestamps"]
        ]
        assert batch.sparse_features.keys() == list(SPARSE_FEATURE_NAMES)
        assert batch.sparse_features["user_segments"].values().tolist() == [
            v for row in rows for v in row["user_segments"]
        ]
        assert batch.sparse_features["ad_id"].values().tolist() == [row["ad_id"] for row in rows]
        np.testing.assert_array_equal(
            batch.dense_features.numpy(),
            np.array([row["dense_features"] for row in rows], np.float32),
        )
        assert batch.labels.tolist() == [[row["click"], row["conversion"]] for row in rows]
        assert batch.label_probs.tolist() == [
            [row["click_prob"], row["conversion_prob"]] for row in rows
        ]
        # Pinned exactly when CUDA is available (pin_memory=None).
        assert batch.dense_features.is_pinned() == torch.cuda.is_available()


@settings(max_examples=25, deadline=None)
@given(
    world_size=st.integers(1, 5),
    batch_per_sub=st.integers(1, 4),
    sub_batch_size=st.integers(1, 40),
    pool_batches=st.integers(1, 4),
    shuffle=st.booleans(),
    drop_last=st.booleans(),
    balance=st.sampled_from(["bbs", "none"]),
    epoch=st.integers(0, 2),
)
def test_ranks_cover_every_sample_once(
    dataset,
    world_size,
    batch_per_sub,
    sub_batch_size,
    pool_batches,
    shuffle,
    drop_last,
    balance,
    epoch,
):
    batch_size = batch_per_sub * sub_batch_size
    seen: list[int] = []
    lengths = set()
    for rank in range(world_size):
        loader = ShardedBatchLoader(
            dataset.directory,
            batch_size,
            shuffle=shuffle,
            seed=11,
            rank=rank,
            world_size=world_size,
            drop_last=drop_last,
            sub_batch_size=sub_batch_size,
            pool_batches=pool_batches,
            balance=balance,
        )
        loader.load_state_dict({**loader.state_dict(), "epoch": epoch})
        batches = list(loader)
        assert (
            len(batches)
            == len(loader)
            == len(
                ParquetBatchLoader(
                    dataset.directory,
                    batch_size,
                    rank=rank,
                    world_size=world_size,
                    drop_last=drop_last,
                )
            )
        )
        lengths.add(len(batches))
        assert all(b.batch_size == batch_size for b in batches[:-1])
        if drop_last:
            assert all(b.batch_size == batch_size for b in batches)
        seen += [i for b in batches for i in _indices(b)]
        assert loader.epoch == epoch + 1
    if drop_last:
        assert len(lengths) == 1
        assert len(seen) == len(set(seen)) == world_size * lengths.pop() * batch_size
    else:
        assert sorted(seen) == list(range(600))


def test_rank_reads_only_its_slice(big):
    world_size = 4
    touched = []
    for rank in range(world_size):
        loader = ShardedBatchLoader(big.directory, 128, rank=rank, world_size=world_size)
        segments = loader.rank_segments(0)
        assert sum(hi - lo for _, lo, hi in segments) == loader.num_samples == 1000
        touched.append({group for group, _, _ in segments})
    # 16 row groups of 250 over 4 ranks of 1000 samples: 4 or 5 row groups each.
    assert all(len(groups) <= 5 for groups in touched)
    assert set().union(*touched) == set(range(16))


def test_deterministic_and_independent_of_workers(big):
    def epochs(**kwargs) -> list[list[int]]:
        loader = ShardedBatchLoader(big.directory, 256, seed=5, pool_batches=4, **kwargs)
        return [[i for b in loader for i in _indices(b)] for _ in range(2)]

    reference = epochs()
    assert epochs(num_workers=2) == reference
    assert epochs(num_workers=3, prefetch_row_groups=1) == reference
    assert reference[0] != reference[1]
    assert sorted(reference[0]) == sorted(reference[1]) == list(range(4000))
    assert epochs(shuffle=False, balance="none") == [list(range(4000))] * 2


def test_bbs_balances_each_pool_and_keeps_its_samples(big):
    kwargs = {"seed": 2, "pool_batches": 8, "sub_batch_size": 25}
    balanced = list(ShardedBatchLoader(big.directory, 250, balance="bbs", **kwargs))
    plain = list(ShardedBatchLoader(big.directory, 250, balance="none", **kwargs))
    assert len(balanced) == len(plain) == 16
    spread = {"bbs": [], "none": []}
    for pool in range(2):
        window = slice(8 * pool, 8 * (pool + 1))
        # BBS only regroups the pool's sub-batches: same samples per pool ...
        assert sorted(i for b in balanced[window] for i in _indices(b)) == sorted(
            i for b in plain[window] for i in _indices(b)
        )
        # ... and every batch is made of whole sub-batches of the stream.
        stream = [i for b in plain[window] for i in _indices(b)]
        sub_batches = {tuple(stream[k : k + 25]) for k in range(0, len(stream), 25)}
        for batch in balanced[window]:
            ids = _indices(batch)
            assert {tuple(ids[k : k + 25]) for k in range(0, 250, 25)} <= sub_batches
        for name, batches in (("bbs", balanced), ("none", plain)):
            costs = np.array([_costs(b) for b in batches[window]])
            spread[name].append(costs.max() / costs.mean())
    assert np.mean(spread["bbs"]) - 1 < 0.5 * (np.mean(spread["none"]) - 1)


def test_cost_model_is_pluggable(big):
    def order(cost_model) -> list[int]:
        loader = ShardedBatchLoader(big.directory, 256, pool_batches=8, cost_model=cost_model)
        return [i for b in loader for i in _indices(b)]

    assert order(AffineCost(per_token_pair=2.0)) == order(AffineCost())  # same ranking
    assert order(linear_cost) != order(AffineCost())
    with pytest.raises(TypeError, match="cost_model"):
        ShardedBatchLoader(big.directory, 256, cost_model="L2")  # type: ignore[arg-type]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_continues_exactly(big, num_workers):
    def make() -> ShardedBatchLoader:
        return ShardedBatchLoader(
            big.directory,
            200,
            seed=4,
            rank=1,
            world_size=2,
            sub_batch_size=40,
            pool_batches=3,
            num_workers=num_workers,
        )

    reference_loader = make()
    reference = [_indices(b) for _ in range(2) for b in reference_loader]
    per_epoch = len(reference_loader)
    assert per_epoch == 10
    # Start, mid-pool, pool boundary, last batch, epoch end, next epoch mid-pool.
    for stop in (0, 1, 3, 4, per_epoch - 1, per_epoch, per_epoch + 5):
        loader = make()
        produced = []
        iterator = iter(loader)
        for _ in range(stop):
            try:
                produced.append(_indices(next(iterator)))
            except StopIteration:
                iterator = iter(loader)
                produced.append(_indices(next(iterator)))
        resumed = make()
        resumed.load_state_dict(loader.state_dict())
        following = []
        while len(produced) + len(following) < len(reference):
            following += [_indices(b) for b in resumed]
        assert produced + following[: len(reference) - len(produced)] == reference


def test_state_dict_mismatch_is_rejected(big):
    loader = ShardedBatchLoader(big.directory, 256)
    state = loader.state_dict()
    assert json.loads(json.dumps(state)) == state  # checkpoint-friendly
    for other in (
        ShardedBatchLoader(big.directory, 256, balance="none"),
        ShardedBatchLoader(big.directory, 256, pool_batches=4),
        ShardedBatchLoader(big.directory, 256, cost_model=linear_cost),
        ShardedBatchLoader(big.directory, 256, sub_batch_size=64),
    ):
        with pytest.raises(ValueError, match="does not match"):
            other.load_state_dict(state)
    with pytest.raises(ValueError, match="format"):
        loader.load_state_dict(ParquetBatchLoader(big.directory, 256).state_dict())


def test_stage_profile_is_recorded(big):
    loader = ShardedBatchLoader(big.directory, 512, num_workers=1)
    assert sum(1 for _ in loader) == len(loader)
    for stage in ("read", "validate", "shuffle", "balance", "collate"):
        assert loader.stage_seconds[stage] > 0


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"batch_size": 0}, ValueError, "batch_size"),
        ({"batch_size": 100, "sub_batch_size": 30}, ValueError, "multiple of sub_batch_size"),
        ({"batch_size": 64, "balance": "global"}, ValueError, "balance"),
        ({"batch_size": 64, "pool_batches": 0}, ValueError, "pool_batches"),
        ({"batch_size": 64, "num_workers": -1}, ValueError, "num_workers"),
        ({"batch_size": 64, "rank": 3, "world_size": 3}, ValueError, "rank"),
        ({"batch_size": 2.0}, TypeError, "batch_size"),
        pytest.param(
            {"batch_size": 64, "pin_memory": True},
            ValueError,
            "pin_memory",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA present"),
        ),
    ],
)
def test_bad_arguments(dataset, kwargs, error, message):
    with pytest.raises(error, match=message):
        ShardedBatchLoader(dataset.directory, **kwargs)


@pytest.fixture
def broken_copy(tmp_path, dataset):
    directory = tmp_path / "copy"
    shutil.copytree(dataset.directory, directory)
    return directory


def test_schema_is_checked_on_open(broken_copy):
    path = broken_copy / "part-00001.parquet"
    pq.write_table(pq.read_table(path).drop_columns(["click"]), path)
    with pytest.raises(DatasetFormatError, match=r"part-00001\.parquet.*missing column 'click'"):
        ShardedBatchLoader(broken_copy, 8)


def test_unreadable_file_is_rejected_on_open(broken_copy):
    (broken_copy / "part-00002.parquet").write_bytes(b"PAR1 garbage" * 50)
    with pytest.raises(DatasetFormatError, match=r"part-00002\.parquet.*not a readable Parquet"):
        ShardedBatchLoader(broken_copy, 8)


def test_row_count_is_checked_on_open(broken_copy):
    path = broken_copy / "part-00000.parquet"
    pq.write_table(pq.read_table(path).slice(0, 150), path)
    with pytest.raises(DatasetFormatError, match=r"part-00000\.parquet.*150 rows.*200"):
        ShardedBatchLoader(broken_copy, 8)


def test_corrupt_page_fails_loudly_naming_file_and_row_group(broken_copy):
    path = broken_copy / "part-00001.parquet"
    column = pq.ParquetFile(path).metadata.row_group(1).column(2)  # hist_item_ids values
    data = bytearray(path.read_bytes())
    middle = column.data_page_offset + column.total_compressed_size // 2
    data[middle : middle + 8] = bytes(b ^ 0xFF for b in data[middle : middle + 8])
    path.write_bytes(bytes(data))
    loader = ShardedBatchLoader(broken_copy, 50, shuffle=False)  # footers are intact
    with pytest.raises(DatasetFormatError, match=r"part-00001\.parquet \(row group 1\)"):
        for _ in loader:
            pass


def test_bad_values_are_rejected_when_read(broken_copy, dataset):
    path = broken_copy / "part-00000.parquet"
    table = pq.read_table(path)
    index = table.schema.get_field_index("region")
    bad = np.full(table.num_rows, dataset.sparse_features["region"], dtype=np.int64)
    pq.write_table(table.set_column(index, "region", pa.array(bad)), path, row_group_size=128)
    loader = ShardedBatchLoader(broken_copy, 600, shuffle=False)
    with pytest.raises(DatasetFormatError, match=r"part-00000\.parquet \(row group 0\).*'region'"):
        next(iter(loader))


def test_batch_size_larger_than_a_rank_share(dataset):
    loader = ShardedBatchLoader(dataset.directory, 1024, rank=1, world_size=2)
    batches = list(loader)
    assert len(batches) == len(loader) == 1
    assert batches[0].batch_size == 300
    assert torch.equal(batches[0].sample_indices.sort().values, batches[0].sample_indices.unique())


def test_planned_batch_costs_are_the_costs_of_the_yielded_batches(dataset):
    groups = []
    for path in dataset.files:
        file = pq.ParquetFile(path)
        for g in range(file.num_row_groups):
            if file.metadata.row_group(g).num_rows:
                lists = file.read_row_group(g, columns=["hist_item_ids"]).column(0)
                groups.append(pa.compute.list_value_length(lists).to_numpy())
    for balance in ("bbs", "none"):
        for rank in range(2):
            loader = ShardedBatchLoader(dataset.directory, 64, seed=3, sub_batch_size=16,
                                        rank=rank, world_size=2, balance=balance)  # fmt: skip
            planned = loader.planned_batch_costs(groups)
            yielded = [loader.cost_model(b.sequence_offsets.diff().numpy()).sum() for b in loader]
            np.testing.assert_allclose(planned, yielded)
            with pytest.raises(ValueError, match="group_lengths"):
                loader.planned_batch_costs(groups[:-1])


def _power_cost():
    def cost(lengths, power):
        return np.asarray(lengths, dtype=np.float64) ** power

    return cost


def test_state_dict_of_a_partial_cost_model_resumes_in_another_process(big):
    """A restarted job rebuilds its cost model at another address: two copies of one function
    stand in for the two processes (the state used to hold repr(), with the address)."""
    saved = ShardedBatchLoader(
        big.directory, 256, cost_model=functools.partial(_power_cost(), power=2)
    )
    restarted = ShardedBatchLoader(
        big.directory, 256, cost_model=functools.partial(_power_cost(), power=2)
    )
    restarted.load_state_dict(saved.state_dict())
    other = ShardedBatchLoader(
        big.directory, 256, cost_model=functools.partial(_power_cost(), power=3)
    )
    with pytest.raises(ValueError, match="does not match"):
        other.load_state_dict(saved.state_dict())
