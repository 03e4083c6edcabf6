"""gem-train: recipes, the trainer (torchrec DMP, AdamW + fused sparse optimizer), NE/AUC, DCP checkpoints, CLI."""

from gem_train.checkpoint import (
    CheckpointError,
    CheckpointMismatchError,
    CheckpointSaveError,
    IncompleteCheckpointError,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from gem_train.config import DataConfig, OptimConfig, ParallelConfig, TrainConfig, apply_overrides
from gem_train.metrics import auc, normalized_entropy
from gem_train.parallel import DenseParallel, ExpertParallelDHENLayer
from gem_train.recipes import RECIPES, get_recipe, tiny
from gem_train.trainer import Trainer, init_distributed, resolve_device

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
