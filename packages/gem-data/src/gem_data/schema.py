"""The on-disk Parquet schema of a GEM dataset, defined once, and its validation."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

__all__ = [
    "DatasetFormatError",
    "SEQUENCE_FEATURE_NAMES",
    "SPARSE_FEATURE_NAMES",
    "LABEL_NAMES",
    "dataset_schema",
    "validate_schema",
]

#: Jagged history columns, all with the same per-row length; order of the sequence KJT keys.
SEQUENCE_FEATURE_NAMES: tuple[str, ...] = (
    "hist_item_ids",
    "hist_category_ids",
    "hist_action_types",
)
#: Non-sequence sparse id features; order of the sparse KJT keys.
SPARSE_FEATURE_NAMES: tuple[str, ...] = (
    "user_id",
    "user_segments",
    "device_type",
    "region",
    "ad_id",
    "ad_category_id",
)
#: Task names, in the column order of ``Batch.labels``.
LABEL_NAMES: tuple[str, ...] = ("click", "conversion")


class DatasetFormatError(ValueError):
    """A dataset file is missing, unreadable, or does not match :func:`dataset_schema`."""


def dataset_schema(num_dense_features: int) -> pa.Schema:
    """The one schema of every shard: one row per sample (see the README's schema table).

    Only ``dense_features`` depends on the dataset (its fixed list width).
    """
    if not isinstance(num_dense_features, int) or num_dense_features < 1:
        raise ValueError(f"num_dense_features must be an int >= 1, got {num_dense_features!r}")
    ids = pa.list_(pa.int64())
    return pa.schema(
        [
            pa.field("sample_index", pa.int64(), nullable=False),
            pa.field("user_id", pa.int64(), nullable=False),
            pa.field("hist_item_ids", ids, nullable=False),
            pa.field("hist_category_ids", ids, nullable=False),
            pa.field("hist_action_types", ids, nullable=False),
            pa.field("hist_timestamps", ids, nullable=False),
            pa.field("user_segments", ids, nullable=False),
            pa.field("device_type", pa.int64(), nullable=False),
            pa.field("region", pa.int64(), nullable=False),
            pa.field("ad_id", pa.int64(), nullable=False),
            pa.field("ad_category_id", pa.int64(), nullable=False),
            pa.field(
                "dense_features",
                pa.list_(pa.float32(), num_dense_features),
                nullable=False,
            ),
            pa.field("click", pa.float32(), nullable=False),
            pa.field("conversion", pa.float32(), nullable=False),
            pa.field("click_prob", pa.float32(), nullable=False),
            pa.field("conversion_prob", pa.float32(), nullable=False),
        ]
    )


def _type_matches(actual: pa.DataType, expected: pa.DataType) -> bool:
    if actual.equals(expected):
        return True
    # Parquet may name the list item field differently ("item" vs "element"): compare the shape.
    if pa.types.is_fixed_size_list(expected):
        return (
            pa.types.is_fixed_size_list(actual)
            and actual.list_size == expected.list_size
            and actual.value_type.equals(expected.value_type)
        )
    if pa.types.is_list(expected):
        return pa.types.is_list(actual) and actual.value_type.equals(expected.value_type)
    return False


def validate_schema(
    actual: pa.Schema,
    path: str | Path,
    *,
    num_dense_features: int | None = None,
    columns: tuple[str, ...] | None = None,
) -> int:
    """Check ``actual`` against :func:`dataset_schema`; returns the dense width found.

    Args:
        actual: the schema read from ``path``.
        path: the file, named in error messages.
        num_dense_features: expected width of ``dense_features``; ``None`` accepts any width.
        columns: the columns to check (default: all of them).

    Raises:
        DatasetFormatError: naming the file and the first missing or mistyped column.
    """
    dense_field = actual.field("dense_features") if "dense_features" in actual.names else None
    if num_dense_features is None:
        if dense_field is not None and pa.types.is_fixed_size_list(dense_field.type):
            num_dense_features = dense_field.type.list_size
        else:
            num_dense_features = 1  # only used to build the expected schema; width checked below
    expected = dataset_schema(num_dense_features)
    for name in columns if columns is not None else tuple(expected.names):
        expected_type = expected.field(name).type
        if name not in actual.names:
            raise DatasetFormatError(
                f"{path}: missing column {name!r} (expected type {expected_type})"
            )
        actual_type = actual.field(name).type
        if not _type_matches(actual_type, expected_type):
            raise DatasetFormatError(
                f"{path}: column {name!r} has type {actual_type}, expected {expected_type}"
            )
    return num_dense_features
