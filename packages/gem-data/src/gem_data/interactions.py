"""Convert user-item-rating-timestamp logs (MovieLens style) into the GEM dataset schema.

Conversion (documented in the README, "Interaction logs"):

* Read ``user, item, rating, timestamp`` rows with ``pyarrow.csv``: MovieLens ``ratings.csv``
  (header ``userId,movieId,rating,timestamp``), the ``::``-separated ``ratings.dat`` (no
  header), or tab-separated ``u.data``; ``.gz`` / ``.bz2`` files are decompressed.
* User and item ids are remapped densely (``np.unique`` order of the raw ids). Every user's
  interactions are sorted by time (ties keep file order).
* Each interaction with at least ``min_history`` earlier ones of its user is one sample: its
  history is the user's previous interactions, the most recent ``max_seq_len`` kept (oldest
  first), and the interaction itself is the candidate (``ad_id`` = its item).
* Labels: ``click = rating >= click_threshold``, ``conversion = rating >= conversion_threshold``
  (a stronger positive, so a conversion implies a click). History action types use the same
  thresholds: 0 below ``click_threshold``, 1 click, 2 conversion.
* Item category: from ``item_categories`` when given (labels remapped densely, one extra
  "unknown" category for unmapped items), else a hash bucket ``splitmix64(raw id) %
  num_category_buckets`` (blake2b of the text for string ids): stable, but carries no meaning.
* No user features in such logs: ``user_segments = [0]``, ``device_type = region = 0``
  (cardinality 1). Dense features: ``log1p(#earlier interactions of the user)``,
  ``log1p(seconds since the user's previous interaction)``, share of the user's earlier
  interactions that were clicks (0 without history).
* True probabilities are unknown: ``click_prob`` / ``conversion_prob`` are NaN,
  ``label_probs_known`` is False and ``oracle_ne`` is NaN (``null`` in ``dataset.json``).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Hashable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq

from gem_data.config import NUM_ACTION_TYPES
from gem_data.schema import DatasetFormatError, dataset_schema
from gem_data.synthetic import _columns_to_table
from gem_data.writer import (
    DATASET_INFO_FILE,
    FORMAT_VERSION,
    SOURCE_INTERACTIONS,
    DatasetInfo,
    _write_document,
    read_dataset_info,
)

__all__ = [
    "InteractionConfig",
    "INTERACTION_DENSE_FEATURES",
    "read_interactions",
    "write_interaction_dataset",
]

#: Names of the ``dense_features`` of a converted interaction dataset, in column order.
INTERACTION_DENSE_FEATURES = ("log1p_prior_interactions", "log1p_seconds_since_last", "click_share")
_HEADER_NAMES = {
    "user": ("userid", "user_id", "user", "uid"),
    "item": ("movieid", "movie_id", "itemid", "item_id", "item", "iid"),
    "rating": ("rating", "score"),
    "timestamp": ("timestamp", "time", "ts", "unix_timestamp"),
}
_SNIFF_BYTES = 1 << 16


@dataclass(frozen=True)
class InteractionConfig:
    """How interaction logs become samples (see the module docstring)."""

    max_seq_len: int = 50
    """History cap: the most recent ``max_seq_len`` earlier interactions are kept."""
    click_threshold: float = 4.0
    """``click = rating >= click_threshold`` (MovieLens: 4 and 5 stars)."""
    conversion_threshold: float = 5.0
    """``conversion = rating >= conversion_threshold``; must be >= ``click_threshold``."""
    min_history: int = 1
    """Interactions with fewer earlier ones of their user are not samples (0 keeps them all)."""
    num_category_buckets: int = 64
    """Hash buckets of the item-category fallback (used without ``item_categories``)."""
    shuffle_seed: int | None = 0
    """Rows are written in the order of ``default_rng(shuffle_seed).permutation`` so that row
    groups mix users; ``None`` writes them by user, then time."""

    def __post_init__(self) -> None:
        for name, minimum in (("max_seq_len", 1), ("min_history", 0), ("num_category_buckets", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                raise ValueError(
                    f"InteractionConfig.{name} must be an int >= {minimum}, got {value!r}"
                )
        if not self.conversion_threshold >= self.click_threshold:
            raise ValueError(
                f"InteractionConfig.conversion_threshold ({self.conversion_threshold}) must be "
                f">= click_threshold ({self.click_threshold})"
            )
        if self.shuffle_seed is not None and (
            not isinstance(self.shuffle_seed, int) or self.shuffle_seed < 0
        ):
            raise ValueError(
                f"InteractionConfig.shuffle_seed must be None or an int >= 0, got {self.shuffle_seed!r}"
            )


def _first_line(path: Path) -> bytes:
    with pa.input_stream(str(path), compression="detect") as stream:
        head = stream.read(_SNIFF_BYTES)
    for line in head.splitlines():
        if line.strip():
            return line
    raise DatasetFormatError(f"{path}: the interaction file is empty")


def _is_number(text: bytes) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _header_columns(path: Path, names: list[str]) -> list[str]:
    """The file's column names for user, item, rating, timestamp (in that order)."""
    lowered = [name.strip().lower() for name in names]
    chosen = []
    for role, candidates in _HEADER_NAMES.items():
        matches = [names[i] for i, name in enumerate(lowered) if name in candidates]
        if not matches:
            raise DatasetFormatError(
                f"{path}: header {names} has no {role} column (one of {list(candidates)})"
            )
        chosen.append(matches[0])
    return chosen


def read_interactions(path: str | os.PathLike[str]) -> pa.Table:
    """Read an interaction log into a table ``user, item, rating (float64), timestamp (int64)``.

    Formats (detected from the first line): ``::``-separated without header (MovieLens
    ``ratings.dat``), tab-separated, or comma-separated; a header is recognised when the first
    field is not a number, and must name the columns (``userId``/``user_id``/``user``,
    ``movieId``/``itemId``/``item``, ``rating``, ``timestamp``); without a header the order is
    user, item, rating, timestamp. User and item ids stay as read (int64 or string).

    Raises:
        DatasetFormatError: naming the file, for a missing file, a malformed line, missing or
        null values, a non-numeric rating or timestamp.
    """
    path = Path(path)
    if not path.is_file():
        raise DatasetFormatError(f"{path}: interaction file is missing")
    try:
        line = _first_line(path)
    except (pa.ArrowException, OSError) as error:
        raise DatasetFormatError(f"{path}: cannot read the interaction file ({error})") from error

    parse = pa_csv.ParseOptions()
    if b"::" in line:
        fields = line.split(b"::")
        if len(fields) < 4:
            raise DatasetFormatError(f"{path}: expected user::item::rating::timestamp lines")
        # pyarrow.csv splits on one character: "a::b" is "a", "", "b".
        parse = pa_csv.ParseOptions(delimiter=":")
        column_names = [f"f{i}" for i in range(2 * len(fields) - 1)]
        columns = column_names[0:8:2]
        has_header = False
    else:
        delimiter = b"\t" if b"\t" in line else b","
        parse = pa_csv.ParseOptions(delimiter=delimiter.decode())
        fields = [field.strip() for field in line.split(delimiter)]
        if len(fields) < 4:
            raise DatasetFormatError(
                f"{path}: expected at least 4 columns (user, item, rating, timestamp), "
                f"got {len(fields)} in the first line"
            )
        has_header = not _is_number(fields[0])
        if has_header:
            column_names = [field.decode(errors="replace") for field in fields]
            columns = _header_columns(path, column_names)
        else:
            column_names = [f"f{i}" for i in range(len(fields))]
            columns = column_names[:4]
    read = pa_csv.ReadOptions(column_names=column_names, skip_rows=1 if has_header else 0)
    convert = pa_csv.ConvertOptions(
        include_columns=columns,
        column_types={columns[2]: pa.float64(), columns[3]: pa.int64()},
    )
    try:
        table = pa_csv.read_csv(
            str(path), read_options=read, parse_options=parse, convert_options=convert
        )
    except (pa.ArrowException, OSError) as error:
        raise DatasetFormatError(f"{path}: malformed interaction file ({error})") from error
    table = table.select(columns).rename_columns(["user", "item", "rating", "timestamp"])
    return _checked_interactions(table, str(path))


def _checked_interactions(table: pa.Table, where: str) -> pa.Table:
    """``table`` (columns user, item, rating, timestamp) with int64 or text ids, float64
    ratings and int64 timestamps, or a :class:`DatasetFormatError` naming ``where`` and the
    column: missing values, ids of another type, non-numeric or non-finite ratings, timestamps
    that are not integers."""
    for name in ("user", "item", "rating", "timestamp"):
        if table.column(name).null_count:
            raise DatasetFormatError(f"{where}: column {name!r} has missing values")
    for name in ("user", "item"):
        column_type = table.schema.field(name).type
        if pa.types.is_integer(column_type):
            table = _set(table, name, table.column(name).cast(pa.int64()))
        elif not (pa.types.is_string(column_type) or pa.types.is_large_string(column_type)):
            raise DatasetFormatError(
                f"{where}: {name} ids must be integers or text, got {column_type}"
            )
    rating_type = table.schema.field("rating").type
    if not (pa.types.is_integer(rating_type) or pa.types.is_floating(rating_type)):
        raise DatasetFormatError(f"{where}: column 'rating' must be numeric, got {rating_type}")
    table = _set(table, "rating", table.column("rating").cast(pa.float64()))
    if table.num_rows and not pc.all(pc.is_finite(table.column("rating"))).as_py():
        raise DatasetFormatError(f"{where}: column 'rating' has NaN or infinite values")
    timestamp_type = table.schema.field("timestamp").type
    if not pa.types.is_integer(timestamp_type):
        raise DatasetFormatError(
            f"{where}: column 'timestamp' must hold integers (seconds), got {timestamp_type}"
        )
    return _set(table, "timestamp", table.column("timestamp").cast(pa.int64()))


def _set(table: pa.Table, name: str, column) -> pa.Table:
    return table.set_column(table.schema.get_field_index(name), name, column)


def _splitmix64(values: np.ndarray) -> np.ndarray:
    z = values.astype(np.uint64)
    with np.errstate(over="ignore"):
        z = z + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _hash_buckets(raw_ids: np.ndarray, buckets: int) -> np.ndarray:
    """Stable hash bucket of each raw id (independent of the other ids in the file)."""
    if raw_ids.dtype.kind in "iu":
        return (_splitmix64(raw_ids.astype(np.int64).view(np.uint64)) % np.uint64(buckets)).astype(
            np.int64
        )
    digests = [
        int.from_bytes(hashlib.blake2b(str(raw).encode(), digest_size=8).digest(), "little")
        for raw in raw_ids
    ]
    return (np.asarray(digests, dtype=np.uint64) % np.uint64(buckets)).astype(np.int64)


def _item_categories(
    raw_items: np.ndarray,
    config: InteractionConfig,
    item_categories: Mapping[Any, Hashable] | None,
) -> tuple[np.ndarray, int, str]:
    """(category of every dense item, number of categories, how they were made)."""
    if item_categories is None:
        return (
            _hash_buckets(raw_items, config.num_category_buckets),
            config.num_category_buckets,
            (f"hash bucket: splitmix64(raw item id) % {config.num_category_buckets}"),
        )
    items = raw_items.tolist()
    found = [raw for raw in items if raw in item_categories]
    if items and item_categories and not found:
        # Most often ids of another type (text keys for integer ids, as csv reads them).
        raise ValueError(
            f"item_categories maps none of the {len(items)} items: its keys (such as "
            f"{next(iter(item_categories))!r}) must be the item ids as the source holds them "
            f"(such as {items[0]!r})"
        )
    labels = sorted(
        {item_categories[raw] for raw in found}, key=lambda label: (type(label).__name__, label)
    )
    label_ids = {label: number for number, label in enumerate(labels)}
    unknown = len(labels)
    categories = np.asarray(
        [label_ids.get(item_categories.get(raw), unknown) for raw in items],
        dtype=np.int64,
    )
    return categories, len(labels) + 1, f"mapping ({len(labels)} labels + 1 unknown)"


def _offsets(lengths: np.ndarray) -> np.ndarray:
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return offsets


def write_interaction_dataset(
    source: str | os.PathLike[str] | pa.Table,
    directory: str | os.PathLike[str],
    *,
    config: InteractionConfig | None = None,
    item_categories: Mapping[Any, Hashable] | None = None,
    eval_directory: str | os.PathLike[str] | None = None,
    num_shards: int = 1,
    row_group_size: int = 4096,
) -> DatasetInfo:
    """Convert an interaction log into a dataset directory readable by the loaders.

    Args:
        source: a file for :func:`read_interactions`, or a table with its four columns.
        directory: where the Parquet shards and ``dataset.json`` go.
        config: the conversion settings (default :class:`InteractionConfig`).
        item_categories: raw item id -> category label; ``None`` uses hash buckets.
        eval_directory: when given, each user's last sample goes there instead (leave-last-out
            split; both splits share ids and cardinalities).
        num_shards: Parquet files per split (contiguous ranges of the written row order).
        row_group_size: rows per row group (the unit of streaming).

    Returns:
        ``DatasetInfo`` of ``directory`` (``read_dataset_info(eval_directory)`` for the other).
    """
    config = InteractionConfig() if config is None else config
    if not isinstance(config, InteractionConfig):
        raise TypeError(f"config must be an InteractionConfig, got {type(config).__name__}")
    for name, value in (("num_shards", num_shards), ("row_group_size", row_group_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if eval_directory is not None and Path(eval_directory).resolve() == Path(directory).resolve():
        raise ValueError(f"eval_directory must differ from directory, both are {directory}")
    origin = "table" if isinstance(source, pa.Table) else str(source)
    table = source if isinstance(source, pa.Table) else read_interactions(source)
    missing = {"user", "item", "rating", "timestamp"} - set(table.column_names)
    if missing:
        raise ValueError(f"source table lacks the columns {sorted(missing)}")
    if isinstance(source, pa.Table):
        table = _checked_interactions(table, "source table")

    raw_users = table.column("user").to_numpy(zero_copy_only=False)
    raw_items = table.column("item").to_numpy(zero_copy_only=False)
    rating = table.column("rating").to_numpy(zero_copy_only=False).astype(np.float64)
    timestamp = table.column("timestamp").to_numpy(zero_copy_only=False).astype(np.int64)
    user_ids, user = np.unique(raw_users, return_inverse=True)
    item_ids, item = np.unique(raw_items, return_inverse=True)
    user, item = user.reshape(-1).astype(np.int64), item.reshape(-1).astype(np.int64)
    item_category, num_categories, category_source = _item_categories(
        item_ids, config, item_categories
    )

    order = np.lexsort((np.arange(len(user)), timestamp, user))  # user, time, file order
    user, item, rating, timestamp = user[order], item[order], rating[order], timestamp[order]
    count = len(user)
    user_start = _offsets(np.bincount(user, minlength=len(user_ids)))
    earlier = np.arange(count) - user_start[user]  # interactions of the user before this one
    action = (rating >= config.click_threshold).astype(np.int64) + (
        rating >= config.conversion_threshold
    ).astype(np.int64)
    clicks_before = np.cumsum(action >= 1) - (action >= 1)  # running count, this one excluded
    clicks_before = clicks_before - clicks_before[user_start[user]]
    previous_time = np.concatenate([[0], timestamp[:-1]])
    gap = np.where(earlier > 0, np.maximum(timestamp - previous_time, 0), 0)

    candidates = np.flatnonzero(earlier >= config.min_history)
    history_start = np.maximum(user_start[user[candidates]], candidates - config.max_seq_len)
    is_last = candidates == user_start[user[candidates] + 1] - 1

    shared = {
        "user": user,
        "item": item,
        "category": item_category[item],
        "action": action,
        "timestamp": timestamp,
        "dense": np.stack(
            [
                np.log1p(earlier),
                np.log1p(gap),
                np.where(earlier > 0, clicks_before / np.maximum(earlier, 1), 0.0),
            ],
            axis=1,
        ).astype(np.float32),
    }
    splits = {"all": np.ones(len(candidates), dtype=bool)}
    if eval_directory is not None:
        splits = {"train": ~is_last, "eval": is_last}
    sequence_features = {
        "hist_item_ids": len(item_ids),
        "hist_category_ids": num_categories,
        "hist_action_types": NUM_ACTION_TYPES,
    }
    sparse_features = {
        "user_id": len(user_ids),
        "user_segments": 1,
        "device_type": 1,
        "region": 1,
        "ad_id": len(item_ids),
        "ad_category_id": num_categories,
    }
    metadata = {
        "input": origin,
        "conversion": asdict(config),
        "num_users": len(user_ids),
        "num_items": len(item_ids),
        "num_interactions": count,
        "category_source": category_source,
        "dense_features": list(INTERACTION_DENSE_FEATURES),
    }
    targets = {"all": directory, "train": directory, "eval": eval_directory}
    infos = {}
    for split, selected in splits.items():
        samples = np.flatnonzero(selected)  # canonical sample ids (user, time order)
        if config.shuffle_seed is not None:
            samples = np.random.default_rng(config.shuffle_seed).permutation(samples)
        infos[split] = _write_split(
            Path(targets[split]),  # type: ignore[arg-type]
            samples,
            candidates,
            history_start,
            shared,
            rating,
            config,
            num_shards,
            row_group_size,
            {
                "sequence_features": sequence_features,
                "sparse_features": sparse_features,
                "max_seq_len": config.max_seq_len,
                "metadata": {**metadata, "split": split},
            },
        )
    return infos["all" if eval_directory is None else "train"]


def _write_split(
    directory: Path,
    samples: np.ndarray,
    candidates: np.ndarray,
    history_start: np.ndarray,
    shared: dict[str, np.ndarray],
    rating: np.ndarray,
    config: InteractionConfig,
    num_shards: int,
    row_group_size: int,
    description: dict[str, Any],
) -> DatasetInfo:
    if len(samples) < num_shards:
        raise ValueError(
            f"{directory}: {len(samples)} samples cannot fill num_shards={num_shards} shards "
            f"(min_history={config.min_history} leaves too few interactions)"
        )
    directory.mkdir(parents=True, exist_ok=True)
    (directory / DATASET_INFO_FILE).unlink(missing_ok=True)
    num_dense = len(INTERACTION_DENSE_FEATURES)
    schema = dataset_schema(num_dense)
    edges = [len(samples) * shard // num_shards for shard in range(num_shards + 1)]
    names = [f"part-{shard:05d}.parquet" for shard in range(num_shards)]
    clicks = conversions = 0.0
    for shard, name in enumerate(names):
        temporary = directory / f"{name}.tmp-{os.getpid()}"
        try:
            with pq.ParquetWriter(
                temporary, schema, compression="zstd", write_page_checksum=True
            ) as writer:
                for lo in range(edges[shard], edges[shard + 1], row_group_size):
                    chunk = samples[lo : min(lo + row_group_size, edges[shard + 1])]
                    columns = _sample_columns(
                        chunk, candidates, history_start, shared, rating, config
                    )
                    clicks += float(columns["click"].sum())
                    conversions += float(columns["conversion"].sum())
                    writer.write_table(
                        _columns_to_table(columns, num_dense), row_group_size=len(chunk)
                    )
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise
        os.replace(temporary, directory / name)
    for stale in directory.glob("part-*.parquet"):
        if stale.name not in names:
            stale.unlink()
    document = {
        "format_version": FORMAT_VERSION,
        "num_samples": int(len(samples)),
        "start_index": 0,
        "files": [
            {"name": name, "start_index": edges[shard], "num_rows": edges[shard + 1] - edges[shard]}
            for shard, name in enumerate(names)
        ],
        "sequence_features": description["sequence_features"],
        "sparse_features": description["sparse_features"],
        "num_dense_features": num_dense,
        "max_seq_len": description["max_seq_len"],
        "labels": ["click", "conversion"],
        "oracle_ne": {"ctr": float("nan"), "cvr": float("nan")},
        "label_means": {"ctr": clicks / len(samples), "cvr": conversions / len(samples)},
        "config": None,
        "source": SOURCE_INTERACTIONS,
        "label_probs_known": False,
        "metadata": description["metadata"],
    }
    _write_document(directory, document)
    return read_dataset_info(directory)


def _sample_columns(
    chunk: np.ndarray,
    candidates: np.ndarray,
    history_start: np.ndarray,
    shared: dict[str, np.ndarray],
    rating: np.ndarray,
    config: InteractionConfig,
) -> dict[str, Any]:
    """Columns of the samples ``chunk`` (canonical ids) in the layout of ``_columns_to_table``."""
    size = len(chunk)
    candidate = candidates[chunk]
    start = history_start[chunk]
    lengths = candidate - start
    offsets = _offsets(lengths)
    positions = np.repeat(start - offsets[:-1], lengths) + np.arange(offsets[-1], dtype=np.int64)
    candidate_rating = rating[candidate]
    return {
        "sample_index": chunk.astype(np.int64),
        "user_id": shared["user"][candidate],
        "hist_item_ids": (offsets, shared["item"][positions]),
        "hist_category_ids": (offsets, shared["category"][positions]),
        "hist_action_types": (offsets, shared["action"][positions]),
        "hist_timestamps": (offsets, shared["timestamp"][positions]),
        "user_segments": (np.arange(size + 1, dtype=np.int64), np.zeros(size, dtype=np.int64)),
        "device_type": np.zeros(size, dtype=np.int64),
        "region": np.zeros(size, dtype=np.int64),
        "ad_id": shared["item"][candidate],
        "ad_category_id": shared["category"][candidate],
        "dense_features": shared["dense"][candidate],
        "click": (candidate_rating >= config.click_threshold).astype(np.float32),
        "conversion": (candidate_rating >= config.conversion_threshold).astype(np.float32),
        "click_prob": np.full(size, np.nan, dtype=np.float32),
        "conversion_prob": np.full(size, np.nan, dtype=np.float32),
    }
