"""gem-data: deterministic synthetic GEM-like data on Parquet, and jagged training batches.

Names are imported lazily: generating or describing a dataset needs only numpy and pyarrow,
while ``Batch`` and ``ParquetBatchLoader`` bring in torch and torchrec on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gem_data.batch import Batch
    from gem_data.config import NUM_ACTION_TYPES, SyntheticConfig
    from gem_data.loader import ParquetBatchLoader
    from gem_data.schema import (
        LABEL_NAMES,
        SEQUENCE_FEATURE_NAMES,
        SPARSE_FEATURE_NAMES,
        DatasetFormatError,
        dataset_schema,
        validate_schema,
    )
    from gem_data.synthetic import (
        HiddenParameters,
        generate_table,
        hidden_parameters,
        normalized_entropy,
        reference_normalized_entropy,
    )
    from gem_data.writer import DatasetInfo, read_dataset_info, write_synthetic_dataset

_EXPORTS = {
    "Batch": "gem_data.batch",
    "NUM_ACTION_TYPES": "gem_data.config",
    "SyntheticConfig": "gem_data.config",
    "ParquetBatchLoader": "gem_data.loader",
    "LABEL_NAMES": "gem_data.schema",
    "SEQUENCE_FEATURE_NAMES": "gem_data.schema",
    "SPARSE_FEATURE_NAMES": "gem_data.schema",
    "DatasetFormatError": "gem_data.schema",
    "dataset_schema": "gem_data.schema",
    "validate_schema": "gem_data.schema",
    "HiddenParameters": "gem_data.synthetic",
    "generate_table": "gem_data.synthetic",
    "hidden_parameters": "gem_data.synthetic",
    "normalized_entropy": "gem_data.synthetic",
    "reference_normalized_entropy": "gem_data.synthetic",
    "DatasetInfo": "gem_data.writer",
    "read_dataset_info": "gem_data.writer",
    "write_synthetic_dataset": "gem_data.writer",
}

__all__ = [
    "SyntheticConfig",
    "NUM_ACTION_TYPES",
    "DatasetInfo",
    "write_synthetic_dataset",
    "read_dataset_info",
    "generate_table",
    "hidden_parameters",
    "HiddenParameters",
    "normalized_entropy",
    "reference_normalized_entropy",
    "dataset_schema",
    "validate_schema",
    "DatasetFormatError",
    "SEQUENCE_FEATURE_NAMES",
    "SPARSE_FEATURE_NAMES",
    "LABEL_NAMES",
    "Batch",
    "ParquetBatchLoader",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'gem_data' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
