"""Typed training configuration and command-line style overrides (``section.field=value``)."""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field

from gem_model import GemArchitecture

__all__ = [
    "FSDP_ALL_GATHER_COLLECTIVES",
    "FSDP_ALL_GATHER_MODES",
    "LR_SCHEDULES",
    "PARALLEL_DENSE_MODES",
    "PARALLEL_SPARSE_MODES",
    "SAVED_ACTIVATION_MODES",
    "SPARSE_PLANS",
    "DATA_PROFILES",
    "DataConfig",
    "OptimConfig",
    "ParallelConfig",
    "PrecisionConfig",
    "TrainConfig",
    "apply_overrides",
]


DATA_PROFILES = ("tiny", "gem")
"""Values of ``DataConfig.profile``."""

BAD_ROW_MODES = ("error", "skip")
"""Values of ``DataConfig.on_bad_row`` (``gem_data``'s loaders take the same)."""


def _check_int(section: str, target: object, name: str, low: int) -> None:
    value = getattr(target, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{section}{name} must be an int >= {low}, got {value!r}")


def _check_float(section: str, target: object, name: str, low: float = 0.0) -> None:
    value = getattr(target, name)
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < low
    ):
        raise ValueError(f"{section}{name} must be a finite number >= {low}, got {value!r}")


def _check_str(section: str, target: object, name: str, choices: tuple[str, ...] | None) -> None:
    value = getattr(target, name)
    if not isinstance(value, str) or (choices is None and not value.strip()):
        raise ValueError(f"{section}{name} must be a non-empty str, got {value!r}")
    if choices is not None and value not in choices:
        listed = ", ".join(repr(c) for c in choices[:-1]) + f" or {choices[-1]!r}"
        raise ValueError(f"{section}{name} must be {listed}, got {value!r}")


def _check_bool(section: str, target: object, name: str) -> None:
    value = getattr(target, name)
    if not isinstance(value, bool):
        raise ValueError(f"{section}{name} must be a bool, got {value!r}")


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
    profile: str = "tiny"
    """History lengths of the generator: 'tiny' (short histories, median 8, a tenth near the
    cap: ``gem_data.SyntheticConfig``'s defaults) or 'gem' (GEM-like at GPU scale: heavy-tailed,
    half the cap filled on average, a few percent at the cap: ``SyntheticConfig.gpu_scale``)."""
    num_items: int = 20_000
    """Rows of the history item table (and ids the generator draws)."""
    num_users: int = 1_000_000
    """Rows of the user-id table."""
    num_ads: int = 2_000
    """Rows of the ad-id table."""
    on_bad_row: str = "error"
    """What the training loader does with a row whose values are bad (NaN / Inf dense
    features, ids outside the dataset's tables, labels outside [0, 1], ...): 'error' stops with
    ``gem_data.DatasetFormatError`` naming the file, row group and column; 'skip' leaves the row
    out of its batch and counts it (``ShardedBatchLoader(on_bad_row=...)``, ``skipped_rows``)."""

    def __post_init__(self) -> None:
        if self.profile not in DATA_PROFILES:
            raise ValueError(f"data.profile must be one of {DATA_PROFILES}, got {self.profile!r}")
        _check_str("data.", self, "on_bad_row", BAD_ROW_MODES)
        _check_str("data.", self, "directory", None)
        _check_int("data.", self, "seed", 0)
        for name in (
            "num_train",
            "num_eval",
            "max_seq_len",
            "num_shards",
            "workers",
            "num_items",
            "num_users",
            "num_ads",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"data.{name} must be an int >= 1, got {value!r}")


@dataclass
class OptimConfig:
    """Dense AdamW and the sparse (fused, in-backward) embedding optimizer."""

    dense_lr: float = 3e-3
    """AdamW learning rate of all dense parameters."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    warmup_steps: int = 20
    """Linear warm-up of the dense learning rate."""
    lr_schedule: str = "constant"
    """Dense learning rate after the warm-up: 'constant', or 'linear' / 'cosine' decay to
    ``min_lr_ratio * dense_lr`` at the last training step. Annealing settles the weights at the
    end of a run, so reruns and precision variants reach much closer eval NE than at a constant
    rate. The sparse row-wise Adagrad keeps ``sparse_lr`` (its steps shrink on their own)."""
    min_lr_ratio: float = 0.0
    """Final dense learning rate as a fraction of ``dense_lr`` ('linear' / 'cosine' only)."""
    sparse_lr: float = 0.05
    """Learning rate of the fused row-wise Adagrad applied to embedding rows during backward."""
    max_grad_norm: float = 1.0
    """Clip the dense gradients' global norm (0 disables)."""

    def __post_init__(self) -> None:
        for name in ("dense_lr", "weight_decay", "sparse_lr", "max_grad_norm"):
            _check_float("optim.", self, name)
        _check_int("optim.", self, "warmup_steps", 0)
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(
                f"optim.lr_schedule must be one of {LR_SCHEDULES}, got {self.lr_schedule!r}"
            )
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}")

    def dense_lr_at(self, step: int, total_steps: int) -> float:
        """Dense learning rate of optimizer step ``step`` (0-based) of ``total_steps``: linear
        warm-up over ``warmup_steps``, then ``lr_schedule`` down to ``min_lr_ratio`` at the
        last step. A pure function of the step (and of the run's length), so a run resumed with
        the same ``max_steps`` / ``epochs`` continues the same curve."""
        warmup = max(1, self.warmup_steps)
        if step + 1 < warmup or self.lr_schedule == "constant":
            return self.dense_lr * min(1.0, (step + 1) / warmup)
        span = max(1, total_steps - warmup)  # decay from the last warm-up step to the last step
        progress = min(1.0, (step + 1 - warmup) / span)
        if self.lr_schedule == "linear":
            decay = 1.0 - progress
        else:
            decay = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.dense_lr * (self.min_lr_ratio + (1.0 - self.min_lr_ratio) * decay)


LR_SCHEDULES = ("constant", "linear", "cosine")
"""Values of ``OptimConfig.lr_schedule``."""

SAVED_ACTIVATION_MODES = ("none", "mx")
"""Values of ``PrecisionConfig.saved_activations``."""


@dataclass
class PrecisionConfig:
    """GEMM precision of the dense ``nn.Linear`` layers (gem-precision) and of the selected
    attention layers' kernels; embeddings are unchanged."""

    mode: str = "fp32"
    """'fp32' (unchanged), 'bf16' (on CUDA: bf16 autocast, float32 master weights; on the CPU:
    GEMM operands rounded to bf16, float32 accumulation, the rest float32) or
    'fp8' (gem-precision ``Fp8Linear``: 1x128 / 128x128 power-of-two block-scaled E4M3)."""
    min_features: int = 128
    """Layers with min(in_features, out_features) below this keep their precision."""
    exclude: tuple[str, ...] = ()
    """Glob patterns of layer names that keep their precision (e.g. the task heads)."""
    bf16_layers: tuple[str, ...] = ("heads.*",)
    """FP8 only: glob patterns of layers that run bf16 GEMMs instead of FP8. Default: the task
    heads' hidden layers (the last layers; their 1-wide outputs stay float32 anyway). With every
    linear in FP8 the GEM model lost 0.12% CTR / 0.25% CVR eval NE against bf16 on the H200,
    with the heads in bf16 +0.06% / +0.05% (10 and 20 runs over 5 seeds against 25 of bf16,
    benchmarks/results/h200/fp8_quality.json). ``()`` puts every eligible layer in FP8."""
    wgrad_in_bf16: bool = False
    """FP8 only: weight-gradient GEMM on bf16 operands."""
    wgrad_x_tiles: bool = True
    """FP8 only: the weight-gradient GEMM's activation operand x^T scaled per 128x128 tile (runs
    at 1088 vs 870 TFLOP/s on an H200); False scales it per 1x128 block along the tokens."""
    stochastic_rounding_grads: bool = False
    """FP8 only: round output gradients to FP8 stochastically."""
    hadamard: bool = False
    """FP8 only: random Hadamard transform along K of both operands of every GEMM."""
    tensorwise: bool = False
    """FP8 only: one scale per tensor instead of 1x128 / 128x128 tiles."""
    fp8_attention: tuple[str, ...] = ()
    """Glob patterns of the model's attention modules whose kernels run in FP8
    (``gem_kernels`` ``precision="fp8"``: E4M3 Q, K, V with power-of-two block scales, fp32
    accumulation): ``sequence_layers.<i>`` (JFA), ``history_cross``, ``pma``,
    ``cross_attention`` (GDPA), e.g. ``sequence_layers.*`` or ``*``. Independent of ``mode``;
    each pattern must match at least one ``gem_model.AttentionPrecision`` module ('block'
    self-attention has no FP8 mode). Not yet measured on a GPU (speed or NE)."""
    saved_activations: str = "none"
    """'none' (autograd keeps activations as they are) or 'mx': the training forward runs
    under ``gem_precision.mx_saved_activations``, so activations saved for backward (>= 1024
    elements, last dim a multiple of 32) are stored as MXFP8 (1 + 1/32 bytes per element)
    and expanded in backward. The torchrec embedding lookups are excluded. Works with any
    ``mode``."""

    def __post_init__(self) -> None:
        if self.mode not in ("fp32", "bf16", "fp8"):
            raise ValueError(f"precision.mode must be 'fp32', 'bf16' or 'fp8', got {self.mode!r}")
        _check_int("precision.", self, "min_features", 1)
        if self.saved_activations not in SAVED_ACTIVATION_MODES:
            raise ValueError(
                f"precision.saved_activations must be one of {SAVED_ACTIVATION_MODES}, "
                f"got {self.saved_activations!r}"
            )


PARALLEL_DENSE_MODES = ("ddp", "fsdp")
"""Values of ``ParallelConfig.dense``."""

FSDP_ALL_GATHER_MODES = ("bf16", "mx")
"""Values of ``ParallelConfig.fsdp_all_gather``."""

FSDP_ALL_GATHER_COLLECTIVES = ("auto", "nccl")
"""Values of ``ParallelConfig.fsdp_all_gather_collective``."""

PARALLEL_SPARSE_MODES = ("1d", "2d", "fully_sharded_2d")
"""Values of ``ParallelConfig.sparse``."""

SPARSE_PLANS = ("auto", "row_wise")
"""Values of ``ParallelConfig.sparse_plan``."""


@dataclass
class ParallelConfig:
    """How the dense part is parallelised, and how torchrec shards the embedding tables
    (``sparse``: 1D, 2D or fully sharded 2D).

    Sizes that depend on the world (``shard`` dividing it, ``expert_parallel`` fitting a host)
    are checked when the trainer starts, by ``gem_parallel.build_gem_mesh``.
    """

    dense: str = "ddp"
    """'ddp': every rank holds all dense weights, gradients all-reduced (torchrec's default);
    'fsdp': FSDP2 ``fully_shard`` over the (replicate, shard) dense mesh (HSDP when
    ``shard`` < world size)."""
    shard: int = 0
    """FSDP shard group size: contiguous ranks that split the dense weights (0: all ranks).
    The replicate size is world // shard. Only with dense='fsdp'."""
    expert_parallel: int = 1
    """Expert-parallel group size for the DHEN experts (1: off). Each rank of a group keeps
    only its share of every layer's experts (gem_parallel.ExpertParallel); must divide
    ``shard`` (FSDP) or the world (DDP), fit inside one host, and not exceed the experts per
    layer."""
    gpus_per_host: int = 0
    """Ranks per host for the topology (0: torchrun's LOCAL_WORLD_SIZE, else one host)."""
    reshard_after_forward: bool = False
    """FSDP: free the gathered weights after forward and gather them again in backward. Off by
    default: a recommendation model's dense stack is small next to its activations, and
    keeping the gathered weights until backward (gradients and optimizer state stay sharded)
    saves one all-gather per block, i.e. 94.8 -> 86.7 ms per 2-GPU step on H200s
    (benchmarks/results/h200x2/train.json). Turn on when dense weights do not fit."""
    fsdp_all_gather: str = "bf16"
    """FSDP only. 'bf16': FSDP's own all-gather of the weights in their parameter dtype;
    'mx': the ``nn.Linear`` weights of the FSDP units whose dim 0 divides by ``shard`` (and
    in_features by 32) are all-gathered as MXFP8 bytes plus E8M0 scales
    (``gem_precision.enable_mx_all_gather``) and the forward uses the dequantized weight;
    other layers are logged and gather as usual."""
    fsdp_all_gather_collective: str = "auto"
    """FSDP only: which collective moves the weights (``fsdp_all_gather`` is their dtype),
    ``gem_parallel.apply_fsdp(all_gather=...)``. 'auto': the SM-free copy-engine all-gather
    where ``gem_parallel.copy_engine_status`` allows it (NCCL on one CUDA host), else the
    process group's own, with the choice logged; 'nccl': always FSDP's own all-gather on the
    process group's backend (NCCL kernels on GPUs, gloo on the CPU)."""
    sparse: str = "1d"
    """Embedding-table parallelism (``gem_parallel.shard_sparse``). '1d': torchrec shards the
    tables over all ranks; '2d': over model-parallel groups of world // ``sparse_replicas``
    contiguous ranks, each group holding a full copy, the copies' weights and row-wise Adagrad
    state averaged every ``sparse_sync_every`` steps; 'fully_sharded_2d': as '2d', but each
    rank keeps only 1/``sparse_replicas`` of its group's shard (all-gathered before the lookup,
    gradient reduce-scattered after backward), trains exactly like '1d'."""
    sparse_replicas: int = 2
    """'2d' / 'fully_sharded_2d': number of table copies (replica groups); must divide the
    world size (checked when the trainer starts). Ignored by '1d'."""
    sparse_sync_every: int = 1
    """'2d' only: steps between replica syncs of the tables and their optimizer state."""
    sparse_plan: str = "auto"
    """'1d' only: how the tables are placed on the ranks. 'auto': torchrec's
    ``EmbeddingShardingPlanner`` with every model-parallel sharding type allowed
    (``DenseParallel.sharding_plan``); 'row_wise': history (sequence) tables and pooled tables
    of >= 100k rows row-wise over all ranks, the other tables table-wise round-robin
    (``gem_train.parallel.row_wise_plan``). 'row_wise' measured slower on 2 H200s: 255 ms per
    2-GPU step against 168 ms on 1 GPU, scaling ratio 0.66
    (benchmarks/results/h200x2/tuning/train_rw_plan.json, from an uncommitted tree)."""

    def __post_init__(self) -> None:
        if self.dense not in PARALLEL_DENSE_MODES:
            raise ValueError(
                f"parallel.dense must be one of {PARALLEL_DENSE_MODES}, got {self.dense!r}"
            )
        if self.sparse not in PARALLEL_SPARSE_MODES:
            raise ValueError(
                f"parallel.sparse must be one of {PARALLEL_SPARSE_MODES}, got {self.sparse!r}"
            )
        for name, low in (
            ("shard", 0),
            ("expert_parallel", 1),
            ("gpus_per_host", 0),
            ("sparse_replicas", 1),
            ("sparse_sync_every", 1),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"parallel.{name} must be an int >= {low}, got {value!r}")
        if self.dense == "ddp" and self.shard != 0:
            raise ValueError(
                f"parallel.shard ({self.shard}) only applies to parallel.dense='fsdp'; "
                "leave it 0 with 'ddp'"
            )
        if self.fsdp_all_gather not in FSDP_ALL_GATHER_MODES:
            raise ValueError(
                f"parallel.fsdp_all_gather must be one of {FSDP_ALL_GATHER_MODES}, "
                f"got {self.fsdp_all_gather!r}"
            )
        if self.fsdp_all_gather != "bf16" and self.dense != "fsdp":
            raise ValueError(
                f"parallel.fsdp_all_gather={self.fsdp_all_gather!r} only applies to "
                f"parallel.dense='fsdp' (got dense={self.dense!r})"
            )
        _check_str("parallel.", self, "fsdp_all_gather_collective", FSDP_ALL_GATHER_COLLECTIVES)
        if self.fsdp_all_gather_collective != "auto" and self.dense != "fsdp":
            raise ValueError(
                f"parallel.fsdp_all_gather_collective={self.fsdp_all_gather_collective!r} only "
                f"applies to parallel.dense='fsdp' (got dense={self.dense!r})"
            )
        _check_str("parallel.", self, "sparse_plan", SPARSE_PLANS)
        if self.sparse_plan != "auto" and self.sparse != "1d":
            raise ValueError(
                f"parallel.sparse_plan={self.sparse_plan!r} only applies to parallel.sparse='1d' "
                f"(got sparse={self.sparse!r}; 2D modes plan per model-parallel group)"
            )


@dataclass
class TrainConfig:
    """One training run: data, model, optimizer, loop and outputs."""

    recipe: str = "custom"
    """Name of the recipe that produced this config (for the logs)."""
    data: DataConfig = field(default_factory=DataConfig)
    model: GemArchitecture = field(default_factory=GemArchitecture)
    """Model choices; feature names and cardinalities come from the dataset."""
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
    compile: bool = False
    """``torch.compile`` each module of the model's dense regions (``GemModel.regions()``: the
    self-attention layers, the cross-attentions, PMA, the DHEN layers, the heads), so their
    norms, casts, activations and residuals fuse and their launches shrink; the attention
    kernels are opaque operators inside the graphs. The torchrec lookups and the glue between
    regions run eagerly. On for the GPU recipes; the CPU recipe runs eagerly, as inductor's
    CPU compile takes longer than the run."""
    activation_checkpointing: str = "none"
    """'none'; 'full' (every dense region's module recomputes its forward in backward) or
    'auto': on the first step, each region module's forward time and saved activations are
    measured, and the modules with the least recompute time per byte freed are checkpointed
    until the rest's saved activations fit ``activation_budget_gib`` (``gem_train.
    checkpointing``)."""
    activation_budget_gib: float = 0.0
    """'auto' only: GiB of activations the regions may keep for backward."""
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    """GEMM precision of the dense linear layers (default: unchanged float32)."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Dense parallelism: DDP or 2D FSDP, and expert parallelism for the DHEN experts."""

    def __post_init__(self) -> None:
        for name, low in (
            ("seed", 0),
            ("batch_size", 1),
            ("eval_batch_size", 1),
            ("epochs", 0),
            ("max_steps", 0),
            ("log_every", 1),
            ("checkpoint_every", 0),
        ):
            _check_int("", self, name, low)
        _check_float("", self, "activation_budget_gib")
        _check_str("", self, "output_dir", None)
        _check_str("", self, "device", ("auto", "cpu", "cuda"))
        for name in ("compare_no_sequence", "compile"):
            _check_bool("", self, name)
        if self.activation_checkpointing not in ACTIVATION_CHECKPOINTING_MODES:
            raise ValueError(
                f"activation_checkpointing must be one of {ACTIVATION_CHECKPOINTING_MODES}, "
                f"got {self.activation_checkpointing!r}"
            )
        if self.activation_checkpointing == "auto" and not self.activation_budget_gib > 0:
            raise ValueError(
                "activation_checkpointing='auto' needs activation_budget_gib > 0, got "
                f"{self.activation_budget_gib}"
            )


ACTIVATION_CHECKPOINTING_MODES = ("none", "full", "auto")
"""Values of ``TrainConfig.activation_checkpointing``."""


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


def _override(target: object, path: list[str], value: str, full_path: str) -> object:
    """A copy of dataclass ``target`` with the field at ``path`` parsed from ``value``.

    Built with ``dataclasses.replace``, so frozen configs work and their checks run again.
    """
    name, rest = path[0], path[1:]
    fields = {f.name: f for f in dataclasses.fields(target)}
    if name not in fields:
        kind = "section" if rest else "field"
        raise ValueError(
            f"override {full_path!r}: unknown {kind} {name!r}; known: {sorted(fields)}"
        )
    current = getattr(target, name)
    if rest:
        if not dataclasses.is_dataclass(current):
            raise ValueError(f"override {full_path!r}: {name!r} is a field, not a section")
        return dataclasses.replace(target, **{name: _override(current, rest, value, full_path)})
    if dataclasses.is_dataclass(current):
        raise ValueError(f"override {full_path!r}: {name!r} is a section; name one of its fields")
    try:
        return dataclasses.replace(target, **{name: _convert(value, fields[name].type, full_path)})
    except (ValueError, TypeError) as error:  # the field's own checks, or the parse
        raise ValueError(f"override {full_path!r}: {error}") from error


def apply_overrides(config: TrainConfig, overrides: list[str]) -> TrainConfig:
    """Returns a copy of ``config`` with ``section.field=value`` (or ``field=value``) overrides.

    Raises ``TypeError`` when ``config`` is not a ``TrainConfig`` or ``overrides`` is not a list
    (or tuple) of str, and ``ValueError`` naming the override (``'section.field'``) when it is
    malformed, names no field, or its value does not parse or fails the field's checks.
    """
    if not isinstance(config, TrainConfig):
        raise TypeError(f"config must be a TrainConfig, got {type(config).__name__}")
    if not isinstance(overrides, (list, tuple)):
        raise TypeError(
            f"overrides must be a list of 'section.field=value' str, got {type(overrides).__name__}"
        )
    for override in overrides:
        if not isinstance(override, str):
            raise TypeError(f"overrides must hold str, got {override!r}")
        if "=" not in override:
            raise ValueError(f"override {override!r} must look like section.field=value")
        path, value = override.split("=", 1)
        config = _override(config, path.strip().split("."), value, path.strip())
    return config
