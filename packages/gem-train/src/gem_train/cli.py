"""``gem-train``: generate (or reuse) the data, train GEM, evaluate, and compare with reference points."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import warnings
from dataclasses import asdict
from pathlib import Path

import torch.distributed as dist
from gem_data import DatasetInfo, SyntheticConfig, read_dataset_info, write_synthetic_dataset
from rich.console import Console
from rich.table import Table

from gem_train.config import DataConfig, TrainConfig, apply_overrides
from gem_train.recipes import RECIPES, get_recipe
from gem_train.trainer import Trainer, init_distributed, resolve_device

__all__ = ["main", "prepare_data", "run"]


def prepare_data(data: DataConfig, *, progress: bool = True) -> tuple[DatasetInfo, DatasetInfo]:
    """Returns the train and eval splits, generating them unless an identical copy exists.

    In a process group, rank 0 generates while the others wait, then every rank reads."""
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


def _prepare_data(data: DataConfig, *, progress: bool) -> tuple[DatasetInfo, DatasetInfo]:
    root = Path(data.directory)
    synthetic = synthetic_config(data)
    splits = {"train": (0, data.num_train), "eval": (data.num_train, data.num_eval)}
    infos = []
    for split, (start, count) in splits.items():
        directory = root / split
        try:
            info = read_dataset_info(directory)
            reusable = (
                info.num_samples == count and info.config == synthetic and info.start_index == start
            )
        except (FileNotFoundError, ValueError):
            reusable = False
        if not reusable:
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


def run(config: TrainConfig, *, resume: bool = False, console: Console | None = None) -> dict:
    """Trains and evaluates the recipe (and the no-sequence reference); returns the summary."""
    console = console or Console()
    started = time.perf_counter()
    rank, _ = init_distributed(resolve_device(config.device))
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
            console.print(f"{name}: resumed at step {trainer.step} from {checkpoints}")
        losses = trainer.fit(checkpoint_dir=checkpoints)
        if not config.checkpoint_every or trainer.step % config.checkpoint_every:
            trainer.save(checkpoints)  # fit() did not already save this final step
        results[name] = trainer.evaluate(eval_data)
        results[name]["train_seconds"] = time.perf_counter() - variant_started
        results[name]["final_train_loss"] = sum(losses[-20:]) / max(1, len(losses[-20:]))
        console.print(f"{name}: {trainer.step} steps in {results[name]['train_seconds']:.1f} s")

    summary = {
        "recipe": config.recipe,
        "config": asdict(config),
        "oracle_ne": eval_data.oracle_ne,
        "results": results,
        "seconds": time.perf_counter() - started,
    }
    if rank == 0:
        output.mkdir(parents=True, exist_ok=True)
        (output / "summary.json").write_text(json.dumps(summary, indent=2))
    _print_summary(console, summary)
    return summary


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
        row += [f"{summary['results'][key][f'ne_{task}']:.4f}" for key, _ in columns]
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="gem-train", description="Train and evaluate a GEM recommendation model."
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
    parser.add_argument("--print-config", action="store_true", help="print the config and exit")
    args = parser.parse_args(argv)
    try:
        config = apply_overrides(get_recipe(args.recipe), args.overrides)
    except ValueError as error:
        parser.error(str(error))
    if args.print_config:
        print(json.dumps(asdict(config), indent=2))
        return 0
    _quiet_third_party_logs()
    run(config, resume=args.resume)
    return 0


if __name__ == "__main__":
    sys.exit(main())
