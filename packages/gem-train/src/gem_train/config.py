"""Typed training configuration and command-line style overrides (``section.field=value``)."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field

__all__ = ["DataConfig", "ModelOptions", "OptimConfig", "TrainConfig", "apply_overrides"]


@dataclass
class DataConfig:
    """Where the training data comes from; the synthetic generator fills ``directory`` if empty."""

    directory: str = "data/tiny"
    """Dataset root holding ``train/`` and ``eval/`` Parquet shards (relative paths are relative to the working directory)."""
    seed: int = 0
    """Seed of the synthetic generator; every sample is a pure function of (seed, index)."""
    num_train: int = 200_000
    """Training samples (indices [0, num_train))."""
    num_eval: int = 10_000
    """Held-out samples (indices [num_train, num_train + num_eval))."""
    max_seq_len: int = 128
    """Longest history the generator produces and the model accepts."""
    num_shards: int = 4
    """Parquet files per split."""
    workers: int = 2
    """Processes generating shards in parallel."""


@dataclass
class ModelOptions:
    """Model choices; feature names and cardinalities come from the dataset."""

    embedding_dim: int = 32
    """Width of the embeddings and every token."""
    num_heads: int = 2
    """Attention heads of the sequence tower and the attention expert."""
    num_sequence_layers: int = 1
    """Self-attention layers over the history."""
    self_attention: str = "jagged_flash"
    """'jagged_flash' or 'block'."""
    pma_queries: int = 4
    """Learned PMA queries (pooled history tokens)."""
    sequence_activation: str = "silu"
    """GDPA activation of PMA and cross-attention."""
    dhen_layers: int = 2
    """DHEN interaction layers."""
    dhen_experts: tuple[str, ...] = ("attention", "mlp", "cross")
    """Experts of each DHEN layer."""
    expert_hidden_dim: int = 128
    """Hidden width of the MLP expert and of the heads."""
    dropout: float = 0.0
    """Dropout in DHEN and heads."""


@dataclass
class OptimConfig:
    """Dense AdamW and the sparse (fused, in-backward) embedding optimizer."""

    dense_lr: float = 3e-3
    """AdamW learning rate of all dense parameters."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    warmup_steps: int = 20
    """Linear warm-up of the dense learning rate."""
    sparse_lr: float = 0.05
    """Learning rate of the fused row-wise Adagrad applied to embedding rows during backward."""
    max_grad_norm: float = 1.0
    """Clip the dense gradients' global norm (0 disables)."""


@dataclass
class TrainConfig:
    """One training run: data, model, optimizer, loop and outputs."""

    recipe: str = "custom"
    """Name of the recipe that produced this config (for the logs)."""
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelOptions = field(default_factory=ModelOptions)
    optim: OptimConfig = field(default_factory=OptimConfig)
    seed: int = 0
    """Seed of parameter init and data order."""
    batch_size: int = 256
    """Samples per step per rank."""
    eval_batch_size: int = 1024
    """Samples per evaluation batch per rank."""
    epochs: int = 1
    """Passes over the training data (ignored when max_steps > 0)."""
    max_steps: int = 0
    """Stop after this many steps (0: run `epochs` epochs)."""
    log_every: int = 25
    """Steps between metric lines in metrics.jsonl."""
    checkpoint_every: int = 0
    """Steps between checkpoints (0: only at the end)."""
    output_dir: str = "runs/tiny"
    """Where metrics.jsonl, summary.json and checkpoints/ go."""
    compare_no_sequence: bool = True
    """Also train the same model without the sequence tower, as the reference point."""
    device: str = "auto"
    """'auto' (CUDA when available), 'cpu' or 'cuda'."""


def _convert(value: str, annotation: object, name: str) -> object:
    """Parses ``value`` into the type named by a dataclass field annotation."""
    origin = typing.get_origin(annotation)
    if annotation in (int, "int"):
        return int(value)
    if annotation in (float, "float"):
        return float(value)
    if annotation in (bool, "bool"):
        lowered = value.lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"override {name}: expected a boolean, got {value!r}")
    if annotation in (str, "str"):
        return value
    if origin is tuple or str(annotation).startswith("tuple"):
        return tuple(part for part in value.split(",") if part)
    raise ValueError(f"override {name}: cannot parse a value of type {annotation}")


def apply_overrides(config: TrainConfig, overrides: list[str]) -> TrainConfig:
    """Returns ``config`` with ``section.field=value`` (or ``field=value``) overrides applied."""
    config = dataclasses.replace(
        config,
        data=dataclasses.replace(config.data),
        model=dataclasses.replace(config.model),
        optim=dataclasses.replace(config.optim),
    )
    for override in overrides:
        if "=" not in override:
            raise ValueError(f"override {override!r} must look like section.field=value")
        path, value = override.split("=", 1)
        *sections, name = path.strip().split(".")
        target = config
        for section in sections:
            if not dataclasses.is_dataclass(getattr(target, section, None)):
                raise ValueError(f"override {path!r}: unknown section {section!r}")
            target = getattr(target, section)
        fields = {f.name: f for f in dataclasses.fields(target)}
        if name not in fields or dataclasses.is_dataclass(getattr(target, name)):
            raise ValueError(f"override {path!r}: unknown field {name!r}; known: {sorted(fields)}")
        try:
            setattr(target, name, _convert(value, fields[name].type, path))
        except ValueError as error:
            raise ValueError(f"override {path!r}: {error}") from error
    return config
