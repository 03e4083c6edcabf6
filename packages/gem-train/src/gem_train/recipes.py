"""Recipes: small functions that return a complete ``TrainConfig``."""

from __future__ import annotations

from collections.abc import Callable

from gem_model import GemArchitecture

from gem_train.config import DataConfig, TrainConfig

__all__ = ["RECIPES", "get_recipe", "tiny"]


def tiny() -> TrainConfig:
    """Trains and evaluates GEM v0 (and the no-sequence reference) on 200k synthetic users,
    one epoch, on a 2-core CPU in about two minutes."""
    return TrainConfig(
        recipe="tiny",
        data=DataConfig(directory="data/tiny", num_train=200_000, num_eval=10_000, max_seq_len=128),
        model=GemArchitecture(embedding_dim=32, num_heads=2, num_sequence_layers=1, dhen_layers=2),
        batch_size=256,
        epochs=1,
        checkpoint_every=250,
        output_dir="runs/tiny",
        device="cpu",
    )


RECIPES: dict[str, Callable[[], TrainConfig]] = {"tiny": tiny}


def get_recipe(name: str) -> TrainConfig:
    """The config of recipe ``name``; unknown names raise ``ValueError`` listing the known ones."""
    try:
        return RECIPES[name]()
    except KeyError:
        raise ValueError(f"unknown recipe {name!r}; known recipes: {sorted(RECIPES)}") from None
