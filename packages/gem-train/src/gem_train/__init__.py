"""gem-train: recipes, the trainer (torchrec DMP, AdamW + fused sparse optimizer), NE/AUC, DCP checkpoints, CLI.

Names are imported lazily: the configs and recipes need no torch, so ``gem-train --help``,
``--print-config`` and misuse errors answer at once; the trainer, checkpoints and parallelism
bring in torch and torchrec on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gem_train.checkpoint import (
        CheckpointError,
        CheckpointMismatchError,
        CheckpointSaveError,
        IncompleteCheckpointError,
        latest_checkpoint,
        load_checkpoint,
        save_checkpoint,
    )
    from gem_train.config import (
        DataConfig,
        OptimConfig,
        ParallelConfig,
        TrainConfig,
        apply_overrides,
    )
    from gem_train.metrics import auc, normalized_entropy
    from gem_train.parallel import DenseParallel, ExpertParallelDHENLayer
    from gem_train.recipes import RECIPES, get_recipe, tiny
    from gem_train.trainer import Trainer, init_distributed, resolve_device

_EXPORTS = {
    "DataConfig": "gem_train.config",
    "OptimConfig": "gem_train.config",
    "ParallelConfig": "gem_train.config",
    "DenseParallel": "gem_train.parallel",
    "ExpertParallelDHENLayer": "gem_train.parallel",
    "TrainConfig": "gem_train.config",
    "apply_overrides": "gem_train.config",
    "RECIPES": "gem_train.recipes",
    "get_recipe": "gem_train.recipes",
    "tiny": "gem_train.recipes",
    "Trainer": "gem_train.trainer",
    "init_distributed": "gem_train.trainer",
    "resolve_device": "gem_train.trainer",
    "normalized_entropy": "gem_train.metrics",
    "auc": "gem_train.metrics",
    "save_checkpoint": "gem_train.checkpoint",
    "load_checkpoint": "gem_train.checkpoint",
    "latest_checkpoint": "gem_train.checkpoint",
    "CheckpointError": "gem_train.checkpoint",
    "CheckpointMismatchError": "gem_train.checkpoint",
    "CheckpointSaveError": "gem_train.checkpoint",
    "IncompleteCheckpointError": "gem_train.checkpoint",
}

__all__ = [
    "DataConfig",
    "OptimConfig",
    "ParallelConfig",
    "DenseParallel",
    "ExpertParallelDHENLayer",
    "TrainConfig",
    "apply_overrides",
    "RECIPES",
    "get_recipe",
    "tiny",
    "Trainer",
    "init_distributed",
    "resolve_device",
    "normalized_entropy",
    "auc",
    "save_checkpoint",
    "load_checkpoint",
    "latest_checkpoint",
    "CheckpointError",
    "CheckpointMismatchError",
    "CheckpointSaveError",
    "IncompleteCheckpointError",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'gem_train' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
