"""Recipes: small functions that return a complete ``TrainConfig``."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from gem_model import GemArchitecture

from gem_train.config import DataConfig, OptimConfig, ParallelConfig, PrecisionConfig, TrainConfig

__all__ = ["RECIPES", "get_recipe", "h200", "h200_large", "h200x8", "tiny"]


def tiny() -> TrainConfig:
    """Trains and evaluates GEM v1 (and the no-sequence reference) on 200k synthetic users,
    one epoch, on a 2-core CPU in about two minutes. The dense learning rate is
    cosine-annealed to 0 after its warm-up: on the H200 quality sweep (2000 steps, 5 seeds)
    that gave lower eval NE than a constant rate (ctr 0.828 vs 0.839, cvr 0.794 vs 0.809) and
    2-4x less spread between reruns (``benchmarks/results/h200/fp8_quality*.json``)."""
    return TrainConfig(
        recipe="tiny",
        data=DataConfig(directory="data/tiny", num_train=200_000, num_eval=10_000, max_seq_len=128),
        # GEM v1 (benchmarks/results/cpu/model_ablation.json, 3 seeds): eval NE ctr 0.8591 /
        # cvr 0.8311 against v0's 0.8621 / 0.8384.
        model=GemArchitecture(
            embedding_dim=32,
            num_heads=2,
            num_sequence_layers=1,
            attention_window=32,
            position="rope",
            ffn="swiglu",
            history_cross=True,
            dhen_layers=2,
            dhen_experts=("attention", "mlp", "cross", "dot"),
        ),
        optim=OptimConfig(lr_schedule="cosine"),
        batch_size=256,
        epochs=1,
        checkpoint_every=250,
        output_dir="runs/tiny",
        device="cpu",
    )


def _gem_v1(embedding_dim: int, expert_hidden_dim: int) -> GemArchitecture:
    """GEM v1 at GPU scale: windowed self-attention with RoPE, SwiGLU, the history x feature
    cross and the target attention, four DHEN layers of four experts."""
    return GemArchitecture(
        embedding_dim=embedding_dim,
        num_heads=embedding_dim // 128,
        num_sequence_layers=4,
        self_attention="jagged_flash",
        attention_window=256,
        position="rope",
        ffn="swiglu",
        history_cross=True,
        target_attention=True,
        pma_queries=8,
        dhen_layers=4,
        dhen_experts=("attention", "mlp", "cross", "dot"),
        expert_hidden_dim=expert_hidden_dim,
    )


def h200() -> TrainConfig:
    """GEM v1 on one H200: d_model 512, histories up to 1024 events (GEM-like lengths, half
    the cap filled on average), window 256, about 220M dense parameters (16 feature tokens of
    512 into DHEN), tables of 4M items and 8M users (about 25 GB with their Adagrad state),
    bf16 GEMMs. ``--set data.max_seq_len=4096 --set batch_size=256`` for the long shape."""
    return TrainConfig(
        recipe="h200",
        data=DataConfig(
            directory="data/h200",
            profile="gem",
            num_train=2_000_000,
            num_eval=50_000,
            max_seq_len=1024,
            num_items=4_000_000,
            num_users=8_000_000,
            num_ads=200_000,
            num_shards=64,
            workers=16,
        ),
        model=_gem_v1(512, 2048),
        optim=OptimConfig(lr_schedule="cosine", dense_lr=1e-3, warmup_steps=100),
        precision=PrecisionConfig(mode="bf16"),
        compile=True,
        batch_size=1024,
        eval_batch_size=1024,
        epochs=1,
        log_every=10,
        checkpoint_every=500,
        output_dir="runs/h200",
        device="cuda",
        compare_no_sequence=False,
    )


def h200_large() -> TrainConfig:
    """``h200`` at d_model 1024: GEMMs wide enough that FP8 pays (gem-precision's 1.48x at
    4096^2); FP8 linears with the heads in bf16, batch 512 x 2048, about 480M dense parameters,
    tables of half the rows (the same 25 GB). Its activations do not fit beside them on an
    H200 (out of memory without checkpointing): the regions with the least recompute time per
    GiB are checkpointed until the rest keep 64 GiB ('auto')."""
    config = h200()
    config.recipe = "h200-large"
    config.data = dataclasses.replace(
        config.data,
        directory="data/h200-large",
        max_seq_len=2048,
        num_items=2_000_000,
        num_users=4_000_000,
    )
    config.model = _gem_v1(1024, 2048)
    config.precision = PrecisionConfig(mode="fp8")
    config.batch_size = config.eval_batch_size = 512
    config.activation_checkpointing = "auto"
    config.activation_budget_gib = 64.0
    config.output_dir = "runs/h200-large"
    return config


def h200x8() -> TrainConfig:
    """``h200`` for ``torchrun --nproc-per-node 8``: the same model and per-GPU batch on the 5D
    layout: dense FSDP2 in shards of 4 (2 replicas) with DHEN's experts split over 2 ranks,
    fully sharded 2D tables over 2 replicas."""
    config = h200()
    config.recipe = "h200x8"
    config.output_dir = "runs/h200x8"
    config.parallel = ParallelConfig(
        dense="fsdp",
        shard=4,
        expert_parallel=2,
        sparse="fully_sharded_2d",
        sparse_replicas=2,
    )
    return config


RECIPES: dict[str, Callable[[], TrainConfig]] = {
    "tiny": tiny,
    "h200": h200,
    "h200-large": h200_large,
    "h200x8": h200x8,
}


def get_recipe(name: str) -> TrainConfig:
    """The config of recipe ``name``; unknown names raise ``ValueError`` listing the known ones."""
    try:
        return RECIPES[name]()
    except KeyError:
        raise ValueError(f"unknown recipe {name!r}; known recipes: {sorted(RECIPES)}") from None
