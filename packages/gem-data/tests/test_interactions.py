"""Interaction logs (MovieLens style) -> GEM schema, checked against a plain-Python conversion."""

from __future__ import annotations

import json
import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from gem_data import (
    INTERACTION_DENSE_FEATURES,
    DatasetFormatError,
    InteractionConfig,
    ParquetBatchLoader,
    ShardedBatchLoader,
    dataset_schema,
    read_dataset_info,
    read_interactions,
    write_interaction_dataset,
)

MASK64 = (1 << 64) - 1


def _splitmix64(value: int) -> int:
    z = (value + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


@pytest.fixture(scope="module")
def interactions() -> list[tuple[int, int, float, int]]:
    """Rows (user, item, rating, timestamp) in file order, with same-second ties."""
    rng = np.random.default_rng(0)
    rows = []
    for user in (42, 7, 1000, 3, 18):
        count = int(rng.integers(1, 25))
        times = np.sort(rng.integers(900_000_000, 900_100_000, count))
        times[count // 2 :: 4] = times[count // 2 - 1]  # ties keep the file order
        for time in times:
            item = int(rng.choice([10, 20, 30, 40, 55, 60, 77, 1234]))
            rows.append((user, item, float(rng.integers(1, 11)) / 2, int(time)))
    order = rng.permutation(len(rows))
    # Shuffle users together but keep each user's tied rows in file order.
    rows = [rows[i] for i in sorted(order, key=lambda i: (order.tolist().index(i) % 3, i))]
    return rows


@pytest.fixture(scope="module")
def ratings_csv(tmp_path_factory, interactions):
    path = tmp_path_factory.mktemp("logs") / "ratings.csv"
    lines = [f"{u},{i},{r},{t}" for u, i, r, t in interactions]
    path.write_text("userId,movieId,rating,timestamp\n" + "\n".join(lines) + "\n")
    return path


def _expected_samples(rows, config: InteractionConfig) -> list[dict]:
    """Independent plain-Python conversion (canonical order: user id, time, file order)."""

    def action(rating: float) -> int:
        return int(rating >= config.click_threshold) + int(rating >= config.conversion_threshold)

    def category(raw: int) -> int:
        return _splitmix64(raw) % config.num_category_buckets

    users = sorted({u for u, _, _, _ in rows})
    items = sorted({i for _, i, _, _ in rows})
    by_user: dict[int, list] = {u: [] for u in users}
    for position, (u, i, r, t) in enumerate(rows):
        by_user[u].append((t, position, i, r))
    samples = []
    for user in users:
        events = sorted(by_user[user])
        for k in range(config.min_history, len(events)):
            history = events[max(0, k - config.max_seq_len) : k]
            time, _, item, rating = events[k]
            earlier = events[:k]
            clicks = sum(r >= config.click_threshold for _, _, _, r in earlier)
            samples.append(
                {
                    "user_id": users.index(user),
                    "hist_item_ids": [items.index(e[2]) for e in history],
                    "hist_category_ids": [category(e[2]) for e in history],
                    "hist_action_types": [action(e[3]) for e in history],
                    "hist_timestamps": [e[0] for e in history],
                    "ad_id": items.index(item),
                    "ad_category_id": category(item),
                    "click": float(rating >= config.click_threshold),
                    "conversion": float(rating >= config.conversion_threshold),
                    "dense_features": [
                        math.log1p(k),
                        math.log1p(time - earlier[-1][0]) if k else 0.0,
                        clicks / k if k else 0.0,
                    ],
                    "last": k == len(events) - 1,
                }
            )
    return samples


def _written_rows(info) -> list[dict]:
    schema = dataset_schema(info.num_dense_features)
    table = pa.concat_tables([pq.read_table(path).cast(schema) for path in info.files])
    return sorted(table.to_pylist(), key=lambda row: row["sample_index"])


def _compare(written: list[dict], expected: list[dict]) -> None:
    assert len(written) == len(expected)
    for row, want in zip(written, expected, strict=True):
        for key, value in want.items():
            if key == "dense_features":
                np.testing.assert_allclose(row[key], value, rtol=1e-6, atol=1e-6)
            elif key != "last":
                assert row[key] == value, key
        assert row["user_segments"] == [0] and row["device_type"] == row["region"] == 0
        assert math.isnan(row["click_prob"]) and math.isnan(row["conversion_prob"])


def test_conversion_matches_reference(tmp_path, ratings_csv, interactions):
    config = InteractionConfig(max_seq_len=4, min_history=1, num_category_buckets=8)
    info = write_interaction_dataset(
        ratings_csv, tmp_path / "out", config=config, num_shards=2, row_group_size=7
    )
    expected = _expected_samples(interactions, config)
    written = _written_rows(info)
    assert [row["sample_index"] for row in written] == list(range(len(expected)))
    _compare(written, expected)
    # Rows are shuffled on disk so that row groups mix users.
    on_disk = pq.read_table(info.files[0]).column("sample_index").to_pylist()
    assert on_disk != sorted(on_disk)
    assert pq.ParquetFile(info.files[0]).metadata.row_group(0).num_rows == 7

    assert info.source == "interactions" and info.config is None
    assert not info.label_probs_known
    assert all(math.isnan(value) for value in info.oracle_ne.values())
    assert info.num_samples == len(expected)
    assert info.num_dense_features == len(INTERACTION_DENSE_FEATURES)
    assert info.max_seq_len == 4
    assert info.sequence_features["hist_item_ids"] == info.sparse_features["ad_id"] == 8
    assert info.sparse_features["user_id"] == 5
    assert info.label_means["ctr"] == pytest.approx(np.mean([s["click"] for s in expected]))
    document = json.loads((tmp_path / "out" / "dataset.json").read_text())  # strict JSON
    assert document["oracle_ne"] == {"ctr": None, "cvr": None}
    assert document["metadata"]["conversion"]["max_seq_len"] == 4


def test_three_file_formats_read_the_same(tmp_path, interactions):
    dat = tmp_path / "ratings.dat"
    dat.write_text("".join(f"{u}::{i}::{r}::{t}\n" for u, i, r, t in interactions))
    tsv = tmp_path / "u.data"
    tsv.write_text("".join(f"{u}\t{i}\t{r}\t{t}\n" for u, i, r, t in interactions))
    csv = tmp_path / "ratings.csv"
    csv.write_text(
        "timestamp,rating,movieId,userId\n"
        + "".join(f"{t},{r},{i},{u}\n" for u, i, r, t in interactions)
    )
    expected = pa.table(
        {
            "user": pa.array([u for u, _, _, _ in interactions], pa.int64()),
            "item": pa.array([i for _, i, _, _ in interactions], pa.int64()),
            "rating": pa.array([r for _, _, r, _ in interactions], pa.float64()),
            "timestamp": pa.array([t for _, _, _, t in interactions], pa.int64()),
        }
    )
    for path in (dat, tsv, csv):
        assert read_interactions(path).equals(expected), path.name


def test_leave_last_out_split_and_loaders(tmp_path, ratings_csv, interactions):
    config = InteractionConfig(max_seq_len=6)
    train = write_interaction_dataset(
        ratings_csv, tmp_path / "train", config=config, eval_directory=tmp_path / "eval"
    )
    evaluation = read_dataset_info(tmp_path / "eval")
    expected = _expected_samples(interactions, config)
    last = [s for s in expected if s["last"]]
    assert evaluation.num_samples == len(last) == len({s["user_id"] for s in last})
    assert train.num_samples == len(expected) - len(last)
    assert evaluation.sparse_features == train.sparse_features
    _compare(_written_rows(evaluation), last)

    loader = ParquetBatchLoader(train.directory, 16, shuffle=False)
    seen = [i for batch in loader for i in batch.sample_indices.tolist()]
    assert len(seen) == train.num_samples
    batch = next(iter(ShardedBatchLoader(train.directory, 8, sub_batch_size=4)))
    assert batch.batch_size == 8 and batch.label_probs.isnan().all()
    assert int(batch.sequence_offsets.diff().max()) <= 6


def test_item_category_mapping(tmp_path, ratings_csv):
    genres = {10: "Drama", 20: "Comedy", 30: "Drama", 40: "Action"}
    info = write_interaction_dataset(
        ratings_csv, tmp_path / "out", item_categories=genres, config=InteractionConfig()
    )
    assert info.sequence_features["hist_category_ids"] == 4  # 3 labels + unknown
    label_ids = {"Action": 0, "Comedy": 1, "Drama": 2}
    items = [10, 20, 30, 40, 55, 60, 77, 1234]  # dense ids follow the sorted raw ids
    for row in _written_rows(info):
        raw = items[row["ad_id"]]
        assert row["ad_category_id"] == label_ids.get(genres.get(raw), 3)


def test_string_ids_and_min_history_zero(tmp_path):
    path = tmp_path / "log.csv"
    path.write_text("user,item,rating,timestamp\nann,x,5,3\nbob,y,1,1\nann,y,3,2\n")
    info = write_interaction_dataset(
        path, tmp_path / "out", config=InteractionConfig(min_history=0, shuffle_seed=None)
    )
    rows = _written_rows(info)
    assert [(r["user_id"], r["hist_item_ids"], r["ad_id"], r["click"]) for r in rows] == [
        (0, [], 1, 0.0),  # ann's first interaction (y at t=2) has no history
        (0, [1], 0, 1.0),
        (1, [], 1, 0.0),
    ]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("userId,movieId,rating,timestamp\n1,2,3\n", "malformed"),
        ("userId,movieId,stars,timestamp\n1,2,3,4\n", "rating column"),
        ("userId,movieId,rating,timestamp\n1,2,good,4\n", "malformed"),
        ("userId,movieId,rating,timestamp\n1,2,,4\n", "missing values"),
        ("1::2::3\n", "user::item::rating::timestamp"),
        ("", "empty"),
    ],
)
def test_malformed_files_name_the_file(tmp_path, content, message):
    path = tmp_path / "bad.csv"
    path.write_text(content)
    with pytest.raises(DatasetFormatError, match=rf"bad\.csv.*{message}"):
        read_interactions(path)


def test_bad_arguments(tmp_path, ratings_csv):
    with pytest.raises(DatasetFormatError, match="missing"):
        read_interactions(tmp_path / "nope.csv")
    with pytest.raises(ValueError, match="conversion_threshold"):
        InteractionConfig(click_threshold=4.0, conversion_threshold=3.0)
    with pytest.raises(ValueError, match="max_seq_len"):
        InteractionConfig(max_seq_len=0)
    with pytest.raises(ValueError, match="eval_directory"):
        write_interaction_dataset(ratings_csv, tmp_path, eval_directory=tmp_path)
    with pytest.raises(TypeError, match="InteractionConfig"):
        write_interaction_dataset(ratings_csv, tmp_path, config={"max_seq_len": 3})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("column", "values", "message"),
    [
        ("rating", [float("nan"), 4.0], "'rating' has NaN"),
        ("rating", ["good", "bad"], "'rating' must be numeric"),
        ("timestamp", [1, None], "'timestamp' has missing values"),
        ("timestamp", [1.5, 2.0], "'timestamp' must hold integers"),
        ("user", [0, None], "'user' has missing values"),
        ("item", [1.0, 2.0], "item ids must be integers or text"),
    ],
)
def test_a_source_table_gets_the_file_checks(tmp_path, column, values, message):
    """A pyarrow table passed as the source is checked as a read file is (it used to be
    converted as it was: NaN ratings became all-zero labels, a null user an extra user)."""
    columns = {"user": [0, 1], "item": [10, 11], "rating": [5.0, 4.0], "timestamp": [1, 2]}
    columns[column] = values
    with pytest.raises(DatasetFormatError, match=f"source table: .*{message}"):
        write_interaction_dataset(pa.table(columns), tmp_path / "out")


def test_item_categories_that_map_no_item_are_refused(tmp_path):
    """Text keys for integer item ids (as csv reads a movies file) used to leave every item
    'unknown' in silence."""
    table = pa.table({"user": [0, 1], "item": [10, 11], "rating": [5.0, 4.0], "timestamp": [1, 2]})
    with pytest.raises(ValueError, match=r"item_categories maps none of the 2 items.*'10'.*10"):
        write_interaction_dataset(
            table, tmp_path / "out", item_categories={"10": "Drama", "11": "War"}
        )
