"""``gem-train``: generate (or reuse) the data, train GEM, evaluate, and compare with reference points.

torch, torchrec and the trainer are imported where a run needs them, not at the top, so that
``--help``, ``--print-config`` and misuse of ``--recipe`` / ``--set`` answer without waiting
for those imports.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import re
import sys
import time
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import NoReturn

from gem_data import (
    SOURCE_SYNTHETIC,
    DatasetFormatError,
    DatasetInfo,
    SyntheticConfig,
    read_dataset_info,
    write_synthetic_dataset,
)
from gem_data.writer import DATASET_INFO_FILE
from rich.console import Console
from rich.table import Table

from gem_train.config import DataConfig, TrainConfig, apply_overrides
from gem_train.recipes import RECIPES, get_recipe

__all__ = ["UsageError", "configure", "main", "prepare_data", "run", "validate"]


class UsageError(ValueError):
    """A misuse of ``gem-train``, found before any data is generated: ``option`` names the
    command-line option to change and the message says what is expected. ``main`` prints it
    as one line and exits with status 2."""

    def __init__(self, option: str, expected: str) -> None:
        super().__init__(f"{option}: {expected}")
        self.option = option


class _ForeignDataset(DatasetFormatError):
    """A dataset gem-train did not generate (converted logs): never overwritten."""


def prepare_data(data: DataConfig, *, progress: bool = True) -> tuple[DatasetInfo, DatasetInfo]:
    """Returns the train and eval splits, generating them unless an identical copy exists.

    In a process group, rank 0 generates while the others wait, then every rank reads."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        if dist.get_rank() == 0:
            _prepare_data(data, progress=progress)
        dist.barrier()
        progress = False
    return _prepare_data(data, progress=progress)


def synthetic_config(data: DataConfig) -> SyntheticConfig:
    """The generator's config for ``data`` (its profile, cap, table sizes and seed)."""
    fields = {
        "seed": data.seed,
        "num_items": data.num_items,
        "num_users": data.num_users,
        "num_ads": data.num_ads,
    }
    if data.profile == "gem":
        return SyntheticConfig.gpu_scale(data.max_seq_len, **fields)
    return SyntheticConfig(max_seq_len=data.max_seq_len, **fields)


def _split_ranges(data: DataConfig) -> dict[str, tuple[int, int]]:
    """``(start_index, num_samples)`` of the train and eval splits."""
    return {"train": (0, data.num_train), "eval": (data.num_train, data.num_eval)}


def _existing_split(
    directory: Path, synthetic: SyntheticConfig, start: int, count: int
) -> DatasetInfo | None:
    """The dataset in ``directory`` when it is exactly this split of ``synthetic`` and its
    shards' footers read back; None when it must be (re)generated: no ``dataset.json`` (empty,
    or a write that did not finish) or another synthetic config.

    Raises ``DatasetFormatError`` for what gem-train must not overwrite: an unreadable or
    malformed ``dataset.json``, converted interaction logs, a shard missing or corrupt."""
    if not (directory / DATASET_INFO_FILE).is_file():
        return None
    info = read_dataset_info(directory)
    if info.source != SOURCE_SYNTHETIC:
        raise _ForeignDataset(
            f"{directory} holds {info.source!r} data, which gem-train would overwrite with "
            "synthetic data: choose another data.directory"
        )
    if info.num_samples != count or info.config != synthetic or info.start_index != start:
        return None
    from gem_data import ShardedBatchLoader

    ShardedBatchLoader(directory, batch_size=1, shuffle=False)  # reads every shard's footer
    return info


def _prepare_data(data: DataConfig, *, progress: bool) -> tuple[DatasetInfo, DatasetInfo]:
    root = Path(data.directory)
    synthetic = synthetic_config(data)
    infos = []
    for split, (start, count) in _split_ranges(data).items():
        directory = root / split
        info = _existing_split(directory, synthetic, start, count)
        if info is None:
            info = write_synthetic_dataset(
                synthetic,
                directory,
                num_samples=count,
                start_index=start,
                num_shards=data.num_shards,
                workers=data.workers,
                progress=progress,
            )
        infos.append(info)
    return infos[0], infos[1]


def _environment_int(name: str, default: int) -> int:
    """An integer torchrun announces (WORLD_SIZE, LOCAL_RANK), ``default`` without torchrun."""
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


def _require_int(config: object, name: str, low: int, prefix: str = "") -> None:
    value = getattr(config, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise UsageError(f"--set {prefix}{name}", f"expected an int >= {low}, got {value!r}")


def _require_number(config: object, name: str, prefix: str = "") -> None:
    value = getattr(config, name)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise UsageError(f"--set {prefix}{name}", f"expected a finite number, got {value!r}")
    if value < 0:
        raise UsageError(f"--set {prefix}{name}", f"expected a number >= 0, got {value!r}")


def _require_creatable(option: str, directory: Path) -> None:
    """``directory`` exists as a writable directory or can be created."""
    existing = directory
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise UsageError(option, f"cannot create {directory}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(option, f"cannot write to {directory}: {existing} is not writable")


def _validate_device(name: str) -> None:
    import torch

    from gem_train.trainer import resolve_device

    if name not in ("auto", "cpu", "cuda"):
        raise UsageError("--set device", f"expected 'auto', 'cpu' or 'cuda', got {name!r}")
    if name == "cuda" and not torch.cuda.is_available():
        raise UsageError(
            "--set device", "'cuda' requested but torch sees no CUDA device (use cpu or auto)"
        )
    if resolve_device(name).type == "cuda":
        local_rank = _environment_int("LOCAL_RANK", 0)
        if local_rank >= torch.cuda.device_count():
            raise UsageError(
                "--set device",
                f"LOCAL_RANK {local_rank} but torch sees {torch.cuda.device_count()} CUDA devices",
            )


def _validate_data(data: DataConfig, world: int, batch_size: int) -> None:
    _require_int(data, "seed", 0, "data.")
    if data.num_shards > min(data.num_train, data.num_eval):
        raise UsageError(
            "--set data.num_shards",
            f"expected at most min(data.num_train, data.num_eval) = "
            f"{min(data.num_train, data.num_eval)}, got {data.num_shards}",
        )
    if data.num_eval < world:
        raise UsageError(
            "--set data.num_eval",
            f"expected at least one evaluation sample per rank ({world}), got {data.num_eval}",
        )
    if data.num_train // world < batch_size:
        raise UsageError(
            "--set batch_size",
            f"expected at most data.num_train / ranks = {data.num_train // world} "
            f"(one full batch per rank), got {batch_size}",
        )
    try:
        synthetic = synthetic_config(data)
    except (TypeError, ValueError) as error:
        fields = [f.name for f in dataclasses.fields(DataConfig)]
        named = next((name for name in fields if name in str(error)), None)
        raise UsageError(f"--set data.{named}" if named else "--set data", str(error)) from None
    root = Path(data.directory)
    if root.exists() and not root.is_dir():
        raise UsageError("--set data.directory", f"{root} is not a directory")
    for split, (start, count) in _split_ranges(data).items():
        directory = root / split
        try:
            info = _existing_split(directory, synthetic, start, count)
        except DatasetFormatError as error:
            hint = (
                ""
                if isinstance(error, _ForeignDataset)
                else f" (remove {directory} to regenerate it)"
            )
            raise UsageError("--set data.directory", f"{error}{hint}") from None
        if info is None:  # generated here
            _require_creatable("--set data.directory", directory)


def _validate_parallel(config: TrainConfig, world: int) -> None:
    from gem_train.parallel import check_dense_layout, check_sparse_layout

    parallel = config.parallel
    if parallel.dense == "fsdp" and parallel.shard and world % parallel.shard:
        raise UsageError(
            "--set parallel.shard",
            f"expected a divisor of the world size ({world}), got {parallel.shard}",
        )
    try:
        check_sparse_layout(parallel, world)
        if parallel.dense == "fsdp" or parallel.expert_parallel > 1:
            check_dense_layout(parallel, world)
    except ValueError as error:
        field = re.search(r"parallel\.\w+", str(error))
        raise UsageError(f"--set {field.group() if field else 'parallel'}", str(error)) from None


def _validate_resume(config: TrainConfig) -> None:
    """A whole checkpoint to resume from (a variant without any starts fresh). Damaged ones
    are skipped for the newest whole one (the trainer says so); a variant with checkpoints
    but none whole is an error."""
    from gem_train.checkpoint import find_resumable

    first = Path(config.output_dir) / "gem" / "checkpoints"
    variants = ["gem", "no_sequence"] if config.compare_no_sequence else ["gem"]
    found = []
    for name in variants:
        directory = Path(config.output_dir) / name / "checkpoints"
        try:
            path, skipped = find_resumable(directory)
        except OSError as error:
            raise UsageError("--resume", str(error)) from None
        if path is None and skipped:
            reasons = "; ".join(f"{bad.name}: {error}" for bad, error in skipped)
            raise UsageError("--resume", f"no whole checkpoint under {directory}: {reasons}")
        found.append(path)
    if not any(found):
        raise UsageError("--resume", f"no checkpoint under {first}")


def _require_no_previous_run(output: Path) -> None:
    """A fresh run would replace a previous run's checkpoints (its first save drops later
    steps): the user chooses instead. A run that crashed before its first whole checkpoint has
    nothing to lose, and starts again."""
    from gem_train.checkpoint import find_resumable  # here: the CLI's import stays torch-free

    found = []
    for checkpoints in sorted(output.glob("*/checkpoints")):
        path, _ = find_resumable(checkpoints)
        if path is not None:
            found.append(str(path.relative_to(output)))
    if found:
        raise UsageError(
            "--set output_dir",
            f"{output} holds a run with checkpoints ({', '.join(found)}): pass --resume to "
            "continue it, or choose another output_dir (or delete it)",
        )


def validate(config: TrainConfig, *, resume: bool = False) -> None:
    """Raises ``UsageError`` (naming the option) for a config ``run`` cannot train: sizes out
    of range, an option combination the trainer rejects, a device that is not there, a data
    directory that cannot be created or holds a corrupt dataset, ``resume`` without a
    checkpoint, a fresh run into an output directory that holds a previous run. Reads only
    ``dataset.json`` files and Parquet footers: nothing is generated."""
    for name, low in (
        ("batch_size", 1),
        ("eval_batch_size", 1),
        ("max_steps", 0),
        ("epochs", 1),
        ("log_every", 1),
        ("checkpoint_every", 0),
        ("seed", 0),
    ):
        _require_int(config, name, low)
    _require_int(config.optim, "warmup_steps", 0, "optim.")
    for name in ("dense_lr", "sparse_lr", "weight_decay", "max_grad_norm"):
        _require_number(config.optim, name, "optim.")
    _validate_device(config.device)
    world = max(1, _environment_int("WORLD_SIZE", 1))
    _validate_parallel(config, world)
    _validate_data(config.data, world, config.batch_size)
    _require_creatable("--set output_dir", Path(config.output_dir))
    if resume:
        _validate_resume(config)
    else:
        _require_no_previous_run(Path(config.output_dir))


def run(
    config: TrainConfig,
    *,
    resume: bool = False,
    profile: bool = False,
    console: Console | None = None,
) -> dict:
    """Trains and evaluates the recipe (and the no-sequence reference); returns the summary.

    ``validate`` runs first; with ``resume`` a missing checkpoint is a ``UsageError``. With
    ``profile`` each variant's training gets a profiler pass (``Trainer.fit``) whose
    per-region table is printed and written beside its metrics.

    A process group that ``run`` starts, it ends after the run (see ``init_distributed``)."""
    import torch.distributed as dist

    from gem_train.metrics import json_ready
    from gem_train.profiling import profile_table
    from gem_train.report import write_report
    from gem_train.throughput import speed_line
    from gem_train.trainer import Trainer, init_distributed, resolve_device

    validate(config, resume=resume)
    console = console or Console()
    started = time.perf_counter()
    owns_group = not dist.is_initialized()
    rank, world_size = init_distributed(resolve_device(config.device))
    if rank != 0:  # one rank reports; the others train and evaluate silently
        console = Console(quiet=True)
    train_data, eval_data = prepare_data(config.data, progress=console.is_terminal)
    console.print(
        f"data: {train_data.num_samples} train / {eval_data.num_samples} eval samples "
        f"in {config.data.directory} ({time.perf_counter() - started:.1f} s)"
    )
    output = Path(config.output_dir)
    variants = {"gem": True}
    if config.compare_no_sequence:
        variants["no_sequence"] = False
    results: dict[str, dict[str, float]] = {}
    for name, use_sequence in variants.items():
        variant_started = time.perf_counter()
        trainer = Trainer(
            config, train_data, use_sequence_tower=use_sequence, output_dir=output / name
        )
        checkpoints = output / name / "checkpoints"
        if resume and trainer.resume(checkpoints):
            console.print(f"{name}: resumed at step {trainer.step} from {trainer.resumed_from}")
        losses = trainer.fit(checkpoint_dir=checkpoints, profile=profile)
        if trainer.profile is not None:
            console.print(profile_table(trainer.profile, f"{name}: time per training step"))
            console.print(f"trace: {output / name / 'trace.json'}", soft_wrap=True, markup=False)
        if not config.checkpoint_every or trainer.step % config.checkpoint_every:
            trainer.save(checkpoints)  # fit() did not already save this final step
        results[name] = trainer.evaluate(eval_data)
        results[name]["train_seconds"] = time.perf_counter() - variant_started
        # Of this call's steps (None when a resume had none left to train).
        results[name]["final_train_loss"] = (
            sum(losses[-20:]) / len(losses[-20:]) if losses else None
        )
        seconds = results[name]["train_seconds"]
        console.print(
            f"{name}: {len(losses)} steps in {seconds:.1f} s (now at step {trainer.step})"
        )
        if trainer.last_speed is not None:
            steps = trainer.last_window_steps
            console.print(f"{name}, last {steps} steps: {speed_line(trainer.last_speed)}",
                          soft_wrap=True, markup=False)  # fmt: skip

    summary = {
        "recipe": config.recipe,
        "config": asdict(config),
        "oracle_ne": eval_data.oracle_ne,
        "results": results,
        "seconds": time.perf_counter() - started,
        "world_size": world_size,
    }
    if rank == 0:
        output.mkdir(parents=True, exist_ok=True)
        (output / "summary.json").write_text(
            json.dumps(json_ready(summary), indent=2, allow_nan=False)
        )
    _print_summary(console, summary)
    if rank == 0:
        # Unwrapped and literal, so the path can be copied (and read by scripts) as printed.
        console.print(f"report: {write_report(output)}", soft_wrap=True, markup=False)
    if owns_group:  # every rank gets here; after an error the group is left as it is
        dist.barrier()  # no rank ends the group while another is still in a collective
        dist.destroy_process_group()
    return summary


def _cell(value: float | None) -> str:
    """A metric for the eval table; an undefined one (NE of a one-class eval) as n/a."""
    return "n/a" if value is None or not math.isfinite(value) else f"{value:.4f}"


def _print_summary(console: Console, summary: dict) -> None:
    table = Table(
        title=f"eval on held-out users, recipe {summary['recipe']} (NE: lower is better)",
        caption="no-seq: the same model with the sequence tower off; "
        "oracle: NE of the generator's true probabilities",
    )
    table.add_column("task")
    columns = [("gem", "GEM")]
    if "no_sequence" in summary["results"]:
        columns.append(("no_sequence", "no-seq"))
    for _, title in columns:
        table.add_column(f"{title} NE", justify="right")
    table.add_column("oracle NE", justify="right")
    for _, title in columns:
        table.add_column(f"{title} AUC", justify="right")
    for task, oracle in summary["oracle_ne"].items():
        row = [task]
        row += [_cell(summary["results"][key][f"ne_{task}"]) for key, _ in columns]
        row.append(f"{oracle:.4f}")
        row += [f"{summary['results'][key][f'auc_{task}']:.4f}" for key, _ in columns]
        table.add_row(*row)
    console.print(table)
    console.print(f"total {summary['seconds']:.1f} s")


def _quiet_third_party_logs() -> None:
    """torchrec's planner and DDP print deprecation notices on every model build; they say
    nothing about the user's run, so the command line shows errors only."""
    for name in ("torchrec", "torch.fx._symbolic_trace", "root"):
        logging.getLogger(name if name != "root" else None).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torchrec\..*")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed\..*")
    warnings.filterwarnings("ignore", message=r".*autograd kernel was not registered.*")


def _field_annotation(config: TrainConfig, path: list[str]) -> object:
    """The annotation of the config field at ``path`` (None when there is none)."""
    target: object = config
    annotation: object = None
    for name in path:
        if not dataclasses.is_dataclass(target):
            return None
        fields = {f.name: f for f in dataclasses.fields(target)}
        if name not in fields:
            return None
        annotation, target = fields[name].type, getattr(target, name)
    return annotation


def configure(recipe: str, overrides: list[str]) -> TrainConfig:
    """``recipe`` with ``--set`` ``overrides`` applied in order; ``UsageError`` names the
    first one that does not parse or makes an invalid config."""
    try:
        config = get_recipe(recipe)
    except ValueError as error:
        raise UsageError("--recipe", str(error)) from None
    for override in overrides:
        option = f"--set {override}"
        if "=" not in override:
            raise UsageError(option, "expected [SECTION.]FIELD=VALUE, e.g. model.embedding_dim=64")
        path, value = (part.strip() for part in override.split("=", 1))
        annotation = _field_annotation(config, path.split("."))
        for kind, parse, expected in ((int, int, "an int"), (float, float, "a number")):
            if annotation in (kind, kind.__name__):
                try:
                    parse(value)
                except ValueError:
                    raise UsageError(option, f"expected {expected}, got {value!r}") from None
        try:
            config = apply_overrides(config, [override])
        except (TypeError, ValueError) as error:
            # apply_overrides prefixes "override 'path': " (twice for some); the option says it
            message = re.sub(r"^(override '?[^':]*'?: )+", "", str(error))
            raise UsageError(option, message) from None
    return config


class _Parser(argparse.ArgumentParser):
    """Reports every misuse as one line, ``gem-train: error: ...``, and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())}\n")


def _report_main(argv: list[str]) -> int:
    """``gem-train report RUN_DIR``: (re)writes the HTML report of a finished run."""
    parser = _Parser(
        prog="gem-train report",
        description="Write RUN_DIR/report.html (one self-contained page) and print its path.",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run's output_dir")
    args = parser.parse_args(argv)
    from gem_train.report import RunDirectoryError, write_report

    try:
        path = write_report(args.run_dir)
    except RunDirectoryError as error:
        parser.error(str(UsageError("RUN_DIR", error.reason)))
    print(path)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["report"]:  # a subcommand; the training options stay top-level
        return _report_main(argv[1:])
    parser = _Parser(
        prog="gem-train",
        description="Train and evaluate a GEM recommendation model.",
        epilog="gem-train report RUN_DIR: write the HTML report of a finished run.",
    )
    parser.add_argument(
        "--recipe", default="tiny", help=f"recipe name, one of {sorted(RECIPES)} (default: tiny)"
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.FIELD=VALUE",
        help="override a config field, e.g. --set model.embedding_dim=64 --set max_steps=100",
    )
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="profile 3 training steps: per-region time and MFU table, Chrome trace",
    )
    parser.add_argument("--print-config", action="store_true", help="print the config and exit")
    args = parser.parse_args(argv)
    try:
        config = configure(args.recipe, args.overrides)
        if args.print_config:
            print(json.dumps(asdict(config), indent=2))
            return 0
        _quiet_third_party_logs()
        # Validates first: misuse ends before any data is made.
        run(config, resume=args.resume, profile=args.profile)
    except UsageError as error:
        parser.error(str(error))
    except ValueError as error:
        # A checkpoint that does not fit the config (another model, batch size or world size)
        # is a misuse of --resume too; torch is loaded by the time one can be raised.
        from gem_train.checkpoint import CheckpointMismatchError

        if not isinstance(error, CheckpointMismatchError):
            raise
        parser.error(f"--resume: {error}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
