"""gem-data: GEM-like data on Parquet (synthetic or converted logs) and balanced jagged batches.

Names are imported lazily: generating, converting or describing a dataset and the balance
tools need only numpy and pyarrow, while ``Batch``, the loaders and ``DevicePrefetcher`` bring
in torch and torchrec on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gem_data.balance import (
        AffineCost,
        BalanceSimulation,
        CostModel,
        attention_cost,
        bbs_merge,
        global_rebalance,
        linear_cost,
        max_over_mean,
        simulate_balance,
        sub_batch_costs,
    )
    from gem_data.batch import Batch
    from gem_data.config import NUM_ACTION_TYPES, SyntheticConfig
    from gem_data.device import DevicePrefetcher
    from gem_data.interactions import (
        INTERACTION_DENSE_FEATURES,
        InteractionConfig,
        read_interactions,
        write_interaction_dataset,
    )
    from gem_data.loader import ParquetBatchLoader
    from gem_data.schema import (
        LABEL_NAMES,
        SEQUENCE_FEATURE_NAMES,
        SPARSE_FEATURE_NAMES,
        DatasetFormatError,
        dataset_schema,
        validate_schema,
    )
    from gem_data.sharded import BALANCE_MODES, ShardedBatchLoader
    from gem_data.synthetic import (
        HiddenParameters,
        generate_table,
        hidden_parameters,
        normalized_entropy,
        reference_normalized_entropy,
        sample_history_lengths,
    )
    from gem_data.writer import (
        SOURCE_INTERACTIONS,
        SOURCE_SYNTHETIC,
        DatasetInfo,
        read_dataset_info,
        write_synthetic_dataset,
    )

_EXPORTS = {
    "AffineCost": "gem_data.balance",
    "BalanceSimulation": "gem_data.balance",
    "CostModel": "gem_data.balance",
    "attention_cost": "gem_data.balance",
    "bbs_merge": "gem_data.balance",
    "global_rebalance": "gem_data.balance",
    "linear_cost": "gem_data.balance",
    "max_over_mean": "gem_data.balance",
    "simulate_balance": "gem_data.balance",
    "sub_batch_costs": "gem_data.balance",
    "DevicePrefetcher": "gem_data.device",
    "INTERACTION_DENSE_FEATURES": "gem_data.interactions",
    "InteractionConfig": "gem_data.interactions",
    "read_interactions": "gem_data.interactions",
    "write_interaction_dataset": "gem_data.interactions",
    "BALANCE_MODES": "gem_data.sharded",
    "ShardedBatchLoader": "gem_data.sharded",
    "sample_history_lengths": "gem_data.synthetic",
    "SOURCE_INTERACTIONS": "gem_data.writer",
    "SOURCE_SYNTHETIC": "gem_data.writer",
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
    "ShardedBatchLoader",
    "BALANCE_MODES",
    "DevicePrefetcher",
    "CostModel",
    "AffineCost",
    "linear_cost",
    "attention_cost",
    "sub_batch_costs",
    "bbs_merge",
    "global_rebalance",
    "max_over_mean",
    "BalanceSimulation",
    "simulate_balance",
    "sample_history_lengths",
    "InteractionConfig",
    "INTERACTION_DENSE_FEATURES",
    "read_interactions",
    "write_interaction_dataset",
    "SOURCE_SYNTHETIC",
    "SOURCE_INTERACTIONS",
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
