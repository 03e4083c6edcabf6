"""The run report: one self-contained HTML page about a finished ``gem-train`` run.

``gem-train`` leaves a run as files (``summary.json``, per variant ``metrics.jsonl`` and,
when profiled, ``profile.json``) that answer "did it learn, was it fast, and why" only after
some plotting. :func:`write_report` draws them once, with matplotlib, into
``<run_dir>/report.html``: the plots are inline base64 PNGs and the styles inline, so the page
opens offline, can be mailed or attached to an issue, and needs nothing but a browser.

The page shows the loss and eval-NE curves against the generator's oracle and the best
no-sequence NE, the training data's history-length histogram, the per-rank cost of every
step with and without Base Batch Shuffling (recomputed from the loader's own plan and cost
model, so it is what the trainer's loader does, not a simulation of a similar one), the
throughput and MFU breakdown with the per-region table of a profiled run, and the config.
"""

from __future__ import annotations

import base64
import dataclasses
import html
import io
import json
import math
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq
from gem_data import DatasetFormatError, DatasetInfo, ShardedBatchLoader, read_dataset_info
from gem_data.schema import SEQUENCE_FEATURE_NAMES
from gem_data.writer import DATASET_INFO_FILE
from matplotlib.figure import Figure

from gem_train.checkpoint import latest_checkpoint, read_trainer_state

__all__ = ["REPORT_FILE", "RunDirectoryError", "write_report"]

REPORT_FILE = "report.html"
"""The report's name inside the run directory."""

_VARIANTS = {"gem": "GEM", "no_sequence": "GEM without sequence"}
_COLORS = {"gem": "tab:blue", "no_sequence": "tab:orange"}
_PHASES = ("data", "forward", "backward", "optimizer")
_TASKS = ("ctr", "cvr")
_HYPOTHETICAL_WORLD_SIZES = (2, 4, 8)
"""Shown for a one-rank run: the balance question only exists from two ranks on."""
_PROFILE_REGION_KEYS = ("region", "forward_ms", "backward_ms", "ms", "model_tflop", "mfu")


class RunDirectoryError(ValueError):
    """``run_dir`` is not a finished ``gem-train`` run (missing, no ``summary.json``, or a
    malformed run file); ``reason`` names the directory or file and what is wrong with it."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"run_dir: {reason}")
        self.reason = reason


# ------------------------------------------------------------------------- reading the run
@dataclasses.dataclass
class _Variant:
    """What one variant folder (``gem``, ``no_sequence``) holds."""

    name: str
    train: list[dict[str, Any]]
    """Train log lines, one per step (a resumed run's repeated steps keep the newer line)."""
    eval: list[dict[str, Any]]
    profile: dict[str, Any] | None
    directory: Path


@dataclasses.dataclass
class _Dataset:
    """A split of the run's data as found on disk, or why it is not shown."""

    info: DatasetInfo | None
    note: str


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise RunDirectoryError(f"{path} is not a readable JSON file ({error})") from None


def _read_metrics(path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Train and eval lines of ``metrics.jsonl``, each split by step (last line of a step wins:
    a resumed run logs the steps after its checkpoint again)."""
    if not path.is_file():
        raise RunDirectoryError(f"{path} is missing (every gem-train variant writes one)")
    by_split: dict[str, dict[int, dict[str, Any]]] = {"train": {}, "eval": {}}
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            by_split[record["split"]][int(record["step"])] = record
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as error:
            raise RunDirectoryError(f"{path}:{number} is not a metrics line ({error})") from None
    train, evaluation = (
        [by_step[step] for step in sorted(by_step)] for by_step in by_split.values()
    )
    return train, evaluation


def _read_profile(path: Path) -> dict[str, Any] | None:
    """``profile.json`` of a profiled variant, checked against the trainer's shape."""
    if not path.is_file():
        return None
    profile = _read_json(path)
    try:
        float(profile["step_ms"])
        str(profile["trace"])
        for region in profile["regions"]:
            missing = [key for key in _PROFILE_REGION_KEYS if key not in region]
            if missing:
                raise KeyError(", ".join(missing))
    except (KeyError, TypeError, ValueError) as error:
        raise RunDirectoryError(
            f"{path} does not have the shape {{step_ms, regions: [{{{', '.join(_PROFILE_REGION_KEYS)}}}], "
            f"trace}} (missing or bad: {error})"
        ) from None
    return profile


def _read_run(run_dir: Path) -> tuple[dict[str, Any], list[_Variant]]:
    if not run_dir.is_dir():
        what = "does not exist" if not run_dir.exists() else "is not a directory"
        raise RunDirectoryError(f"{run_dir} {what}")
    summary_path = run_dir / "summary.json"
    if not summary_path.is_file():
        raise RunDirectoryError(
            f"{run_dir} is not a finished gem-train run: no summary.json "
            "(gem-train writes it when training and evaluation are done)"
        )
    summary = _read_json(summary_path)
    if not isinstance(summary, dict) or not {"config", "results", "oracle_ne"} <= set(summary):
        raise RunDirectoryError(f"{summary_path} lacks config, results or oracle_ne")
    variants = []
    for name in summary["results"]:
        directory = run_dir / name
        train, evaluation = _read_metrics(directory / "metrics.jsonl")
        variants.append(
            _Variant(name, train, evaluation, _read_profile(directory / "profile.json"), directory)
        )
    return summary, variants


def _world_size(summary: dict[str, Any], run_dir: Path) -> tuple[int, str]:
    """Ranks the run trained on: ``summary.json`` says so; runs written before it did are
    read from their newest checkpoint."""
    if "world_size" in summary:
        return int(summary["world_size"]), ""
    for name in summary["results"]:
        checkpoint = latest_checkpoint(run_dir / name / "checkpoints")
        if checkpoint is not None:
            return int(read_trainer_state(checkpoint).get("world_size", 1)), ""
    return 1, "summary.json and the checkpoints do not say how many ranks trained: assumed 1"


def _find_dataset(run_dir: Path, config: dict[str, Any], split: str) -> _Dataset:
    """The run's ``split`` dataset. ``data.directory`` and ``output_dir`` are relative to the
    directory gem-train was started in: that is ``run_dir`` less ``output_dir``'s parts when
    they match, else the current directory."""
    data = Path(config["data"]["directory"]) / split
    candidates = [data] if data.is_absolute() else []
    if not data.is_absolute():
        output = Path(config["output_dir"])
        resolved = run_dir.resolve()
        if not output.is_absolute() and resolved.parts[-len(output.parts) :] == output.parts:
            candidates.append(resolved.parents[len(output.parts) - 1] / data)
        candidates.append(Path.cwd() / data)
    found = next((path for path in candidates if (path / DATASET_INFO_FILE).is_file()), None)
    if found is None:
        return _Dataset(None, f"the {split} data is no longer at {candidates[0]}")
    try:
        info = read_dataset_info(found)
    except DatasetFormatError as error:
        return _Dataset(None, f"the {split} data at {found} is unreadable ({error})")
    expected = config["data"]["num_train" if split == "train" else "num_eval"]
    if info.num_samples != expected or info.max_seq_len != config["data"]["max_seq_len"]:
        return _Dataset(
            None,
            f"the {split} data at {found} was regenerated since ({info.num_samples} samples up to "
            f"{info.max_seq_len} events; the run had {expected} up to "
            f"{config['data']['max_seq_len']})",
        )
    return _Dataset(info, "")


def _group_lengths(info: DatasetInfo) -> list[np.ndarray]:
    """History length of every sample, per non-empty row group in file order: the units
    ``ShardedBatchLoader`` plans with. Reads one history column, not the samples."""
    column = SEQUENCE_FEATURE_NAMES[-1]
    groups = []
    for path in info.files:
        parquet = pq.ParquetFile(path)
        for group in range(parquet.metadata.num_row_groups):
            if parquet.metadata.row_group(group).num_rows:
                values = parquet.read_row_group(group, columns=[column]).column(0)
                groups.append(pc.list_value_length(values).to_numpy().astype(np.int64))
    return groups


# ------------------------------------------------------------------------ per-rank balance
def _rank_step_costs(
    directory: Path,
    group_lengths: list[np.ndarray],
    *,
    batch_size: int,
    seed: int,
    world_size: int,
    balance: str,
    max_steps: int,
) -> np.ndarray:
    """``(steps, world_size)``: the cost of every rank's batch at each step of epoch 0, as the
    trainer's ``ShardedBatchLoader`` (same arguments) assembles and costs it.

    Reading and collating every batch would decode every history; the loader's own plan
    (``ShardedBatchLoader.planned_batch_costs``) needs only the lengths. gem-train's
    ``tests/test_report.py`` checks that the costs equal those of the batches the loader
    really yields."""
    steps = max_steps
    costs = np.zeros((0, world_size))
    for rank in range(world_size):
        loader = ShardedBatchLoader(
            directory,
            batch_size,
            shuffle=True,
            seed=seed,
            rank=rank,
            world_size=world_size,
            drop_last=True,
            balance=balance,
            pin_memory=False,
        )
        if rank == 0:
            steps = min(max_steps, len(loader))
            costs = np.zeros((steps, world_size))
        try:
            planned = loader.planned_batch_costs(group_lengths)[:steps]
        except ValueError as error:  # the row groups differ from the lengths read before
            raise DatasetFormatError(f"{directory}: row groups changed while reading") from error
        costs[: len(planned), rank] = planned
    return costs


@dataclasses.dataclass
class _Balance:
    world_size: int
    cost_model: str
    """The loader's cost model, by name and what it counts."""
    none: np.ndarray
    """(steps, ranks) per-rank batch cost in stream order (``balance="none"``)."""
    bbs: np.ndarray
    """(steps, ranks) the same with Base Batch Shuffling (``balance="bbs"``, the trainer's)."""

    @staticmethod
    def max_over_mean(costs: np.ndarray) -> np.ndarray:
        return costs.max(axis=1) / np.maximum(costs.mean(axis=1), 1e-300)


def _balances(
    train: DatasetInfo,
    group_lengths: list[np.ndarray],
    config: dict[str, Any],
    world_size: int,
    steps: int,
) -> tuple[list[_Balance], str]:
    """Per-rank costs over the run's ``steps`` on its world size, or over the first epoch of
    2, 4 and 8 ranks at the same per-rank batch when the run had one rank (where every step is
    balanced by construction); and why there are none, if so."""
    batch_size = int(config["batch_size"])
    sizes = [world_size] if world_size > 1 else list(_HYPOTHETICAL_WORLD_SIZES)
    sizes = [size for size in sizes if train.num_samples // size >= batch_size]
    model = ShardedBatchLoader(train.directory, batch_size, pin_memory=False).cost_model
    doc = (model.__doc__ or "").strip().splitlines()
    cost_model = getattr(model, "__name__", type(model).__name__)
    if doc:
        cost_model += f" ({doc[0].replace('``', '').rstrip('.')})"
    balances = []
    for size in sizes:
        per_mode = {
            balance: _rank_step_costs(
                train.directory,
                group_lengths,
                batch_size=batch_size,
                seed=int(config["seed"]),
                world_size=size,
                balance=balance,
                max_steps=steps if size == world_size else train.num_samples,
            )
            for balance in ("none", "bbs")
        }
        balances.append(_Balance(size, cost_model, per_mode["none"], per_mode["bbs"]))
    note = ""
    if not balances:
        note = (
            f"{train.num_samples} samples leave no full batch of {batch_size} per rank on "
            f"{world_size if world_size > 1 else _HYPOTHETICAL_WORLD_SIZES[0]} ranks"
        )
    return balances, note


# ----------------------------------------------------------------------------- figures
def _img(figure: Figure, alt: str) -> str:
    """``figure`` as an inline PNG ``<img>`` (no file beside the page, no network)."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    data = base64.b64encode(buffer.getvalue()).decode("ascii")
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def _base_rate_entropy(rate: float) -> float:
    """Entropy (nats) of a Bernoulli label with this mean: NE's denominator."""
    rate = min(max(rate, 1e-7), 1 - 1e-7)
    return -(rate * math.log(rate) + (1 - rate) * math.log1p(-rate))


def _reference_loss(info: DatasetInfo, ne: dict[str, float]) -> float | None:
    """The summed CTR + CVR log loss (the train loss) of a predictor with NE ``ne`` on this
    data: NE x entropy of the base rate, per task. None when unknown (NaN, converted logs)."""
    if not ne or not info.label_means:
        return None
    loss = sum(ne[task] * _base_rate_entropy(info.label_means[task]) for task in _TASKS)
    return loss if math.isfinite(loss) else None


def _loss_figure(variants: list[_Variant], train: _Dataset) -> str:
    figure = Figure(figsize=(10, 3.8))
    axes = figure.subplots()
    for variant in variants:
        steps = [line["step"] for line in variant.train]
        axes.plot(
            steps,
            [line["loss"] for line in variant.train],
            marker=".",
            color=_COLORS.get(variant.name),
            label=f"{_VARIANTS.get(variant.name, variant.name)} (train, mean of the window)",
        )
    if train.info is not None:
        for ne, label, style in (
            (train.info.oracle_ne, "oracle (true probabilities)", "--"),
            (train.info.no_sequence_ne, "best without the history (Bayes)", ":"),
        ):
            loss = _reference_loss(train.info, ne)
            if loss is not None:
                axes.axhline(loss, color="black", linestyle=style, label=f"{label}: {loss:.4f}")
    axes.set_xlabel("step")
    axes.set_ylabel("CTR + CVR log loss (nats)")
    axes.set_title("training loss")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    return _img(figure, "training loss against the oracle and no-sequence losses")


def _ne_figure(variants: list[_Variant], summary: dict[str, Any], evaluation: _Dataset) -> str:
    figure = Figure(figsize=(10, 3.8))
    last = max((line["step"] for v in variants for line in v.train + v.eval), default=1)
    for axes, task in zip(figure.subplots(1, len(_TASKS)), _TASKS, strict=True):
        for variant in variants:
            points = [
                (line["step"], line[f"ne_{task}"])
                for line in variant.eval
                if line.get(f"ne_{task}") is not None  # null: a one-class eval
            ]
            if points:
                steps, values = zip(*points, strict=True)
                axes.plot(
                    steps,
                    values,
                    marker="o",
                    color=_COLORS.get(variant.name),
                    label=_VARIANTS.get(variant.name, variant.name),
                )
        oracle = summary["oracle_ne"].get(task)
        if oracle is not None and math.isfinite(oracle):
            axes.axhline(oracle, color="black", linestyle="--", label=f"oracle: {oracle:.4f}")
        bayes = evaluation.info.no_sequence_ne.get(task) if evaluation.info else None
        if bayes is not None and math.isfinite(bayes):
            axes.axhline(
                bayes, color="black", linestyle=":", label=f"best without history: {bayes:.4f}"
            )
        axes.set_xlim(0, last * 1.05)  # the eval points where they fall in training
        axes.set_xlabel("step")
        axes.set_ylabel("eval NE (lower is better)")
        axes.set_title(f"{task.upper()} eval NE")
        axes.grid(alpha=0.3)
        axes.legend(fontsize=8)
    return _img(figure, "eval NE per task against the oracle and no-sequence NE")


def _length_figure(lengths: np.ndarray, max_seq_len: int) -> str:
    figure = Figure(figsize=(10, 3.8))
    axes = figure.subplots()
    bins = np.linspace(0, max_seq_len + 1, min(max_seq_len + 1, 64) + 1)
    _, edges, _ = axes.hist(lengths, bins=bins, color="tab:blue", alpha=0.75)
    axes.set_xlabel("history length (events)")
    axes.set_ylabel("samples")
    cost = axes.twinx()
    attention, _ = np.histogram(lengths, bins=edges, weights=lengths.astype(np.float64) ** 2)
    share = attention / max(attention.sum(), 1.0)
    cost.step(edges[:-1], share, where="post", color="tab:red", label="share of attention cost")
    cost.set_ylabel("share of Σ L² (attention cost)", color="tab:red")
    cost.set_ylim(bottom=0)
    axes.axvline(lengths.mean(), color="black", linestyle="--", label=f"mean {lengths.mean():.1f}")
    axes.set_title("history lengths of the training data")
    handles = axes.get_legend_handles_labels()[0] + cost.get_legend_handles_labels()[0]
    axes.legend(handles=handles, fontsize=8, loc="upper right")
    axes.grid(alpha=0.3)
    return _img(figure, "histogram of the training data's history lengths")


def _balance_figure(balances: list[_Balance]) -> str:
    figure = Figure(figsize=(10, 3.2 * len(balances)))
    grid = figure.subplots(len(balances), 2, squeeze=False)
    for (left, right), balance in zip(grid, balances, strict=True):
        for costs, label, color in (
            (balance.none, "without BBS", "tab:red"),
            (balance.bbs, "with BBS", "tab:green"),
        ):
            ratio = _Balance.max_over_mean(costs)
            steps = np.arange(1, len(ratio) + 1)
            left.plot(
                steps, ratio, color=color, linewidth=0.8, label=f"{label}: {ratio.mean():.3f}"
            )
            shares = (costs / np.maximum(costs.mean(axis=1, keepdims=True), 1e-300)).ravel()
            right.hist(shares, bins=40, alpha=0.55, color=color, label=label)
        left.set_title(f"{balance.world_size} ranks: busiest rank / mean, per step")
        left.set_xlabel("step")
        left.set_ylabel("busiest rank's cost / mean")
        left.grid(alpha=0.3)
        left.legend(fontsize=8)
        right.set_title(f"{balance.world_size} ranks: each rank's cost / the step's mean")
        right.set_xlabel("rank cost / step mean")
        right.set_ylabel("rank-steps")
        right.grid(alpha=0.3)
        right.legend(fontsize=8)
    figure.tight_layout()
    return _img(figure, "per-rank batch cost with and without Base Batch Shuffling")


def _steady(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Train lines past the first window, which holds compilation, caches and the first
    batch's reads; all of them when there is only one."""
    return lines[1:] if len(lines) > 1 else lines


def _mean(lines: list[dict[str, Any]], key: str) -> float | None:
    values = [line[key] for line in lines if isinstance(line.get(key), int | float)]
    return sum(values) / len(values) if values else None


def _time_figure(variants: list[_Variant]) -> str | None:
    timed = [v for v in variants if any(f"time_{p}" in line for line in v.train for p in _PHASES)]
    if not timed:
        return None
    figure = Figure(figsize=(10, 3.8))
    split, rate = figure.subplots(1, 2)
    colors = ("tab:gray", "tab:blue", "tab:orange", "tab:green", "tab:purple")
    labels = [_VARIANTS.get(v.name, v.name) for v in timed]
    left = np.zeros(len(timed))
    for phase, color in zip((*_PHASES, "other"), colors, strict=True):
        widths = []
        for variant in timed:
            lines = _steady(variant.train)
            if phase == "other":  # logging, FLOP counting, host work between the marks
                phases = sum(_mean(lines, f"time_{p}") or 0.0 for p in _PHASES) * 1e3
                widths.append(max(0.0, (_mean(lines, "step_ms") or 0.0) - phases))
            else:
                widths.append((_mean(lines, f"time_{phase}") or 0.0) * 1e3)
        split.barh(labels, widths, left=left, color=color, label=phase)
        left += widths
    split.set_xlabel("ms per step (mean past the first log window)")
    split.set_title("where a step's time goes")
    split.legend(fontsize=8, ncols=5, loc="lower center", bbox_to_anchor=(0.5, -0.45))
    key = "mfu" if any(line.get("mfu") is not None for v in timed for line in v.train) else None
    for variant in timed:
        steps = [line["step"] for line in variant.train]
        if key:
            values = [100 * (line.get("mfu") or 0.0) for line in variant.train]
        else:
            values = [line.get("tflops") or 0.0 for line in variant.train]
        rate.plot(
            steps,
            values,
            marker=".",
            color=_COLORS.get(variant.name),
            label=_VARIANTS.get(variant.name, variant.name),
        )
    rate.set_xlabel("step")
    rate.set_ylabel("MFU (%) of the bf16 peak" if key else "model TFLOP/s per rank")
    rate.set_title("MFU per log window" if key else "achieved model TFLOP/s (no MFU on a CPU)")
    rate.grid(alpha=0.3)
    rate.legend(fontsize=8)
    figure.tight_layout()
    return _img(figure, "time split per step and MFU over the run")


def _region_figure(profile: dict[str, Any]) -> str | None:
    regions = profile["regions"]
    if not regions:
        return None
    figure = Figure(figsize=(10, 0.9 + 0.32 * len(regions)))
    axes = figure.subplots()
    names = [str(region["region"]) for region in regions][::-1]
    # Rows without a forward / backward split ("other": the rest of the step) are one bar.
    split = [region["forward_ms"] is not None for region in regions][::-1]
    forward = [float(r["forward_ms"] or 0.0) for r in regions][::-1]
    backward = [float(r["backward_ms"] or 0.0) for r in regions][::-1]
    whole = [0.0 if s else float(r["ms"]) for s, r in zip(split, regions[::-1], strict=True)]
    axes.barh(names, forward, color="tab:blue", label="forward")
    axes.barh(names, backward, left=forward, color="tab:orange", label="backward")
    axes.barh(names, whole, color="tab:gray", label="rest of the step")
    axes.set_xlabel("ms per step")
    axes.grid(alpha=0.3, axis="x")
    axes.legend(fontsize=8)
    return _img(figure, "per-region forward and backward time")


# -------------------------------------------------------------------------------- HTML
def _format(value: Any, spec: str = ".4f", scale: float = 1.0, unit: str = "") -> str:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return "–"
    return f"{value * scale:{spec}}{unit}"


def _table(header: list[str] | None, rows: list[list[str]]) -> str:
    """A table of text cells; ``header`` None for a list of name / value rows."""
    head = ""
    if header is not None:
        head = (
            "<thead><tr>" + "".join(f"<th>{html.escape(c)}</th>" for c in header) + "</tr></thead>"
        )
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(cell)}</td>" for cell in row) + "</tr>" for row in rows
    )
    return f"<table>{head}<tbody>{body}</tbody></table>"


def _note(text: str) -> str:
    return f'<p class="note">{html.escape(text)}</p>'


def _results_section(summary: dict[str, Any], evaluation: _Dataset) -> str:
    names = list(summary["results"])
    header = ["task", *(f"{_VARIANTS.get(n, n)} NE" for n in names), "oracle NE"]
    bayes = evaluation.info.no_sequence_ne if evaluation.info is not None else {}
    if bayes:
        header.append("best NE without history")
    header += [f"{_VARIANTS.get(n, n)} AUC" for n in names]
    rows = []
    for task in _TASKS:
        row = [task.upper()]
        row += [_format(summary["results"][n].get(f"ne_{task}")) for n in names]
        row.append(_format(summary["oracle_ne"].get(task)))
        if bayes:
            row.append(_format(bayes.get(task)))
        row += [_format(summary["results"][n].get(f"auc_{task}")) for n in names]
        rows.append(row)
    times = ", ".join(
        f"{_VARIANTS.get(n, n)} {_format(summary['results'][n].get('train_seconds'), '.1f')} s"
        for n in names
    )
    return (
        "<h2 id='results'>Eval on held-out users</h2>"
        + _table(header, rows)
        + _note(
            "NE: log loss over the entropy of the base rate (lower is better). Oracle: the "
            "generator's true probabilities. Best without history: the Bayes-optimal "
            "prediction from every feature but the history, which no model without the "
            f"sequence tower can beat. Train and eval time: {times}."
        )
    )


def _curves_section(
    variants: list[_Variant], summary: dict[str, Any], train: _Dataset, evaluation: _Dataset
) -> str:
    notes = "".join(_note(d.note) for d in (train, evaluation) if d.note)
    return (
        "<h2 id='curves'>Loss and eval NE</h2>"
        + notes
        + _loss_figure(variants, train)
        + _note(
            "Each point is the mean loss of the steps since the previous log line. The lines "
            "are the losses of the oracle and of the best no-history prediction on the "
            "training data (their NE times the entropy of each task's base rate, summed)."
        )
        + _ne_figure(variants, summary, evaluation)
    )


def _data_section(train: _Dataset, lengths: np.ndarray | None) -> str:
    head = "<h2 id='data'>Training data</h2>"
    if train.info is None or lengths is None:
        return head + _note(f"No histogram: {train.note}.")
    percentiles = np.percentile(lengths, [50, 90, 99])
    capped = float(np.mean(lengths == train.info.max_seq_len))
    rows = [
        ["samples", f"{lengths.size}"],
        ["directory", str(train.info.directory)],
        ["mean / median / p90 / p99 / max length", " / ".join(
            [f"{lengths.mean():.1f}", *(f"{p:.0f}" for p in percentiles), f"{lengths.max()}"]
        )],
        ["length cap (max_seq_len), share at the cap", f"{train.info.max_seq_len}, {capped:.1%}"],
        ["empty histories", f"{float(np.mean(lengths == 0)):.1%}"],
    ]  # fmt: skip
    return (
        head
        + _length_figure(lengths, train.info.max_seq_len)
        + _table(None, rows)
        + _note(
            "The red line is each length bin's share of the attention cost (Σ L²): the few "
            "long histories set how long a rank's step takes, which is what BBS balances."
        )
    )


def _balance_section(
    balances: list[_Balance], note: str, world_size: int, variants: list[_Variant]
) -> str:
    head = "<h2 id='balance'>Per-rank balance with and without BBS</h2>"
    if not balances:
        return head + _note(f"Not computed: {note}.")
    cost = balances[0].cost_model
    if world_size == 1:
        intro = (
            "This run trained on one rank, where every step is balanced by construction. "
            f"Shown instead: what {', '.join(str(b.world_size) for b in balances)} ranks would "
            "get with this config and data, at the same per-rank batch "
            "(torchrun --nproc-per-node N), over their whole first epoch."
        )
    else:
        intro = (
            f"The run's {world_size} ranks over its first "
            f"{len(balances[0].bbs)} steps (epoch 0), with the trainer's loader settings."
        )
    measured = None
    if world_size > 1:
        measured = _mean([line for v in variants for line in v.train], "token_balance")
    rows = []
    for balance in balances:
        none, bbs = (_Balance.max_over_mean(c) for c in (balance.none, balance.bbs))
        saved = 1 - balance.bbs.max(axis=1).sum() / max(balance.none.max(axis=1).sum(), 1e-300)
        rows.append(
            [
                str(balance.world_size),
                str(len(none)),
                f"{none.mean():.3f}",
                f"{bbs.mean():.3f}",
                f"{none.max():.3f}",
                f"{bbs.max():.3f}",
                f"{saved:.1%}",
            ]
        )
    table = _table(
        [
            "ranks",
            "steps",
            "mean max/mean, no BBS",
            "mean max/mean, BBS",
            "worst step, no BBS",
            "worst step, BBS",
            "busiest-rank cost saved by BBS",
        ],
        rows,
    )
    measured_note = (
        _note(
            f"Measured in the run: the busiest rank's history tokens over the mean, "
            f"averaged over the log windows (token_balance): {measured:.3f}."
        )
        if measured is not None
        else ""
    )
    return (
        head
        + _note(intro)
        + _balance_figure(balances)
        + table
        + measured_note
        + _note(
            f"Cost: the loader's own cost model, {cost}, summed over each rank's batch, for "
            "the batches ShardedBatchLoader assembles with balance='none' (consecutive "
            "samples) and 'bbs' (each pool of 32 batches dealt heaviest with lightest). A "
            "synchronous step waits for its busiest rank, so max/mean is the step time over "
            "a perfectly balanced one when attention dominates."
        )
    )


def _throughput_section(variants: list[_Variant], world_size: int, run_dir: Path) -> str:
    head = "<h2 id='throughput'>Throughput and MFU</h2>"
    rows = []
    for variant in variants:
        lines = _steady(variant.train)
        mfu = _mean(lines, "mfu")
        if mfu is not None and world_size == 1:
            local, scaling = _format(mfu, ".1%"), "1"
        else:
            local, scaling = "–", "–"
        rows.append(
            [
                _VARIANTS.get(variant.name, variant.name),
                _format(mfu, ".1%"),
                local,
                scaling,
                _format(_mean(lines, "mfu_measured"), ".1%"),
                _format(_mean(lines, "tflops"), ".3g"),
                _format(_mean(lines, "model_tflop"), ".3g"),
                _format(_mean(lines, "step_ms"), ".1f"),
                _format(_mean(lines, "samples_per_s"), ".0f"),
                _format(_mean(lines, "tokens_per_s"), ".0f"),
                _format(_mean(lines, "peak_mem_gib"), ".2f"),
                _format(_mean(lines, "token_balance"), ".3f"),
            ]
        )
    table = _table(
        [
            "variant",
            "E2E MFU",
            "local MFU",
            "scaling ratio",
            "MFU vs measured peak",
            "TFLOP/s per rank",
            "model TFLOP per step",
            "step ms",
            "samples/s",
            "history tokens/s",
            "peak GiB",
            "token balance",
        ],
        rows,
    )
    has_mfu = any(line.get("mfu") is not None for v in variants for line in v.train)
    if not has_mfu:
        factors = "No MFU: the run had no GPU with a known bf16 peak (TFLOP/s are shown)."
    elif world_size == 1:
        factors = "One rank: local MFU is the E2E MFU and the scaling ratio is 1."
    else:
        factors = (
            f"{world_size} ranks: local MFU is that of a 1-GPU run of the same per-GPU batch, "
            "which this run does not contain; the scaling ratio is this E2E MFU over it."
        )
    parts = [
        head,
        table,
        _note(
            "E2E MFU = local MFU × scaling ratio. E2E MFU: each rank's achieved model TFLOP/s "
            "(gem_model.model_flops of the real history lengths, forward + backward) over the "
            f"GPU's bf16 dense datasheet peak. {factors} Means over the log windows past the "
            "first (warm-up)."
        ),
    ]
    timing = _time_figure(variants)
    parts.append(timing if timing else _note("This run's metrics have no time split."))
    for variant in variants:
        if variant.profile is None:
            continue
        profile = variant.profile
        trace = variant.directory / str(profile["trace"])
        href = Path(os.path.relpath(trace, run_dir)).as_posix()  # the page sits in run_dir
        link = (
            f'<a href="{html.escape(href)}">{html.escape(href)}</a>'
            if trace.exists()
            else html.escape(f"{trace} (not found)")
        )
        parts.append(
            f"<h3>Per-region profile: {html.escape(_VARIANTS.get(variant.name, variant.name))}</h3>"
        )
        parts.append(
            _table(
                ["region", "forward ms", "backward ms", "ms", "model TFLOP", "MFU"],
                [
                    [
                        str(region["region"]),
                        _format(region["forward_ms"], ".2f"),
                        _format(region["backward_ms"], ".2f"),
                        _format(region["ms"], ".2f"),
                        _format(region["model_tflop"], ".4g"),
                        _format(region["mfu"], ".1%"),
                    ]
                    for region in profile["regions"]
                ],
            )
        )
        figure = _region_figure(profile)
        if figure:
            parts.append(figure)
        parts.append(
            f"<p class='note'>Profiled step: {_format(profile['step_ms'], '.1f')} ms. Chrome "
            f"trace (open in Perfetto or chrome://tracing): {link}</p>"
        )
    return "".join(parts)


def _config_section(summary: dict[str, Any], world_size: int, world_note: str) -> str:
    facts = _table(
        None,
        [
            ["recipe", str(summary.get("recipe"))],
            ["ranks", str(world_size)],
            ["wall time", f"{_format(summary.get('seconds'), '.1f')} s"],
        ],
    )
    config = html.escape(json.dumps(summary["config"], indent=2))
    return (
        "<h2 id='config'>Config</h2>"
        + (_note(world_note) if world_note else "")
        + facts
        + "<p class='note'>The run's whole TrainConfig, as summary.json stores it; "
        "<code>gem-train --recipe RECIPE --set SECTION.FIELD=VALUE ...</code> with the fields "
        "that differ from the recipe gives it back.</p>" + f"<pre>{config}</pre>"
    )


_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1060px; color: #222; }
h1 { font-size: 1.5em; } h2 { border-bottom: 1px solid #ccc; padding-bottom: .2em; }
nav a { margin-right: 1em; } img { display: block; max-width: 100%; margin: 1em 0; }
table { border-collapse: collapse; margin: .5em 0; font-size: .9em; }
td, th { border: 1px solid #ddd; padding: .25em .6em; text-align: right; }
td:first-child, th:first-child { text-align: left; } th { background: #f4f4f4; }
.note { color: #555; font-size: .9em; }
pre { background: #f7f7f7; padding: 1em; overflow-x: auto; font-size: .8em; }
"""


def write_report(run_dir: str | os.PathLike[str]) -> Path:
    """Writes ``<run_dir>/report.html`` for a finished ``gem-train`` run and returns its path.

    ``run_dir`` is the run's ``output_dir``. The training data is found where the run's
    config says (relative paths from the directory gem-train ran in); when it has been
    removed or regenerated, the length histogram and the BBS balance say so and the rest of
    the page is still written. Raises ``RunDirectoryError`` when ``run_dir`` is missing, has
    no ``summary.json`` (not a run, or one that did not finish) or holds a malformed run file.
    """
    run_dir = Path(run_dir)
    summary, variants = _read_run(run_dir)
    config = summary["config"]
    world_size, world_note = _world_size(summary, run_dir)
    train = _find_dataset(run_dir, config, "train")
    evaluation = _find_dataset(run_dir, config, "eval")

    lengths, balances, balance_note = None, [], train.note
    if train.info is not None:
        groups = _group_lengths(train.info)
        lengths = np.concatenate(groups)
        steps = max((line["step"] for v in variants for line in v.train), default=0)
        balances, balance_note = _balances(train.info, groups, config, world_size, max(steps, 1))

    title = f"gem-train run report: {summary.get('recipe')} ({run_dir})"
    written = time.strftime("%Y-%m-%d %H:%M", time.localtime())
    sections = [
        _results_section(summary, evaluation),
        _curves_section(variants, summary, train, evaluation),
        _data_section(train, lengths),
        _balance_section(balances, balance_note, world_size, variants),
        _throughput_section(variants, world_size, run_dir),
        _config_section(summary, world_size, world_note),
    ]
    nav = " ".join(
        f"<a href='#{anchor}'>{name}</a>"
        for anchor, name in (
            ("results", "results"),
            ("curves", "curves"),
            ("data", "data"),
            ("balance", "balance"),
            ("throughput", "MFU"),
            ("config", "config"),
        )
    )
    page = (
        "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title><style>{_STYLE}</style></head><body>"
        f"<h1>{html.escape(title)}</h1>"
        f"<p class='note'>Written {written} from {html.escape(str(run_dir.resolve()))}.</p>"
        f"<nav>{nav}</nav>{''.join(sections)}</body></html>\n"
    )
    path = run_dir / REPORT_FILE
    path.write_text(page, encoding="utf-8")
    return path
