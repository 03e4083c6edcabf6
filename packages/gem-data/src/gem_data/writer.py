"""Write synthetic samples to Parquet shards plus a ``dataset.json`` description."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import math
import multiprocessing
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
from tqdm.auto import tqdm

from gem_data.config import NUM_ACTION_TYPES, SyntheticConfig
from gem_data.schema import DatasetFormatError, dataset_schema
from gem_data.synthetic import (
    _binary_entropy,
    _generate,
    _interest_quantiles,
    _logloss_sum,
    _no_sequence_probs,
    hidden_parameters,
    normalized_entropy,
)

__all__ = [
    "DatasetInfo",
    "write_synthetic_dataset",
    "read_dataset_info",
    "DATASET_INFO_FILE",
    "FORMAT_VERSION",
    "SOURCE_SYNTHETIC",
    "SOURCE_INTERACTIONS",
]

DATASET_INFO_FILE = "dataset.json"
FORMAT_VERSION = 1
_PARQUET_COMPRESSION = "zstd"
#: ``DatasetInfo.source`` of generated data (true label probabilities and oracle NE known).
SOURCE_SYNTHETIC = "synthetic"
#: ``DatasetInfo.source`` of converted interaction logs (no true probabilities, no oracle NE).
SOURCE_INTERACTIONS = "interactions"


@dataclass
class DatasetInfo:
    """What ``dataset.json`` says about a dataset directory."""

    directory: Path
    """The dataset directory."""
    num_samples: int
    """Rows over all shards."""
    files: list[Path]
    """Shard paths in sample order."""
    sequence_features: dict[str, int]
    """History feature name -> cardinality (``hist_item_ids``, ``hist_category_ids``,
    ``hist_action_types``)."""
    sparse_features: dict[str, int]
    """Sparse feature name -> cardinality (``user_id``, ``user_segments``, ``device_type``,
    ``region``, ``ad_id``, ``ad_category_id``)."""
    num_dense_features: int
    """Width of ``dense_features``."""
    max_seq_len: int
    """No history is longer than this."""
    oracle_ne: dict[str, float]
    """NE of the true probabilities on this dataset's labels: ``{"ctr", "cvr"}``. NaN when the
    true probabilities are unknown (real interaction data, ``label_probs_known`` False)."""
    config: SyntheticConfig | None
    """The generator config; ``None`` for data that was not generated (interaction logs)."""
    start_index: int = 0
    """Sample index of the first row (splits are disjoint index ranges of one seed)."""
    no_sequence_ne: dict[str, float] = field(default_factory=dict)
    """NE of the Bayes-optimal prediction that ignores the history: ``{"ctr", "cvr"}``."""
    label_means: dict[str, float] = field(default_factory=dict)
    """Mean click and conversion label: ``{"ctr", "cvr"}``."""
    source: str = SOURCE_SYNTHETIC
    """``"synthetic"`` (generated) or ``"interactions"`` (converted user-item-rating logs)."""
    label_probs_known: bool = True
    """Whether ``click_prob`` / ``conversion_prob`` hold true probabilities; when False they
    are NaN in every row (and ``Batch.label_probs`` is NaN)."""
    file_num_rows: list[int] = field(default_factory=list)
    """Rows of each shard, aligned with ``files`` (readers check them against the footers)."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """Source-specific description, e.g. the interaction conversion settings and input file."""


def _feature_spec(config: SyntheticConfig) -> tuple[dict[str, int], dict[str, int]]:
    sequence = {
        "hist_item_ids": config.num_items,
        "hist_category_ids": config.num_categories,
        "hist_action_types": NUM_ACTION_TYPES,
    }
    sparse = {
        "user_id": config.num_users,
        "user_segments": config.num_user_segments,
        "device_type": config.num_device_types,
        "region": config.num_regions,
        "ad_id": config.num_ads,
        "ad_category_id": config.num_categories,
    }
    return sequence, sparse


# Set in each pool worker by _init_worker: a shared counter of generated samples for the bar.
_progress_counter: Any = None


def _init_worker(counter: Any) -> None:
    global _progress_counter
    _progress_counter = counter


def _write_shard(
    config: SyntheticConfig, path: str, start_index: int, num_samples: int, row_group_size: int
) -> dict[str, Any]:
    """Write one shard; returns label / log-loss sums and the hidden terms for the NE summary."""
    temporary = f"{path}.tmp-{os.getpid()}"
    stats: dict[str, Any] = {"ctr_logloss": 0.0, "cvr_logloss": 0.0, "parts": []}
    schema = dataset_schema(config.num_dense_features)
    try:
        with pq.ParquetWriter(
            temporary, schema, compression=_PARQUET_COMPRESSION, write_page_checksum=True
        ) as writer:
            for lo in range(start_index, start_index + num_samples, row_group_size):
                count = min(row_group_size, start_index + num_samples - lo)
                table, arrays = _generate(config, lo, count)
                writer.write_table(table, row_group_size=count)
                # NE from the float32 probabilities that are stored, so it can be recomputed exactly.
                stats["ctr_logloss"] += _logloss_sum(arrays["click_prob"], arrays["click"])
                stats["cvr_logloss"] += _logloss_sum(
                    arrays["conversion_prob"], arrays["conversion"]
                )
                stats["parts"].append(arrays)
                if _progress_counter is not None:
                    with _progress_counter.get_lock():
                        _progress_counter.value += count
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    os.replace(temporary, path)
    return stats


def _shard_bounds(start_index: int, num_samples: int, num_shards: int) -> list[tuple[int, int]]:
    edges = [start_index + (num_samples * shard) // num_shards for shard in range(num_shards + 1)]
    return [(edges[shard], edges[shard + 1] - edges[shard]) for shard in range(num_shards)]


def _require_int(name: str, value: Any, minimum: int) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def _pool_context() -> multiprocessing.context.BaseContext:
    # fork is fast and needs no re-import; elsewhere spawn (workers import numpy/pyarrow only).
    if sys.platform.startswith("linux"):
        return multiprocessing.get_context("fork")
    return multiprocessing.get_context("spawn")


def write_synthetic_dataset(
    config: SyntheticConfig,
    directory: str | os.PathLike[str],
    *,
    num_samples: int,
    start_index: int = 0,
    num_shards: int = 4,
    workers: int = 2,
    progress: bool = True,
    row_group_size: int = 4096,
) -> DatasetInfo:
    """Generate samples ``[start_index, start_index + num_samples)`` into Parquet shards.

    Writes ``part-00000.parquet`` ... (contiguous index ranges, row groups of
    ``row_group_size`` rows) and then ``dataset.json``. Shards are generated by a pool of
    ``workers`` processes (``workers=1`` runs in this process). Existing ``part-*.parquet``
    files and ``dataset.json`` in ``directory`` are replaced. The content does not depend on
    ``num_shards``, ``workers`` or ``row_group_size``.
    """
    if not isinstance(config, SyntheticConfig):
        raise TypeError(f"config must be a SyntheticConfig, got {type(config).__name__}")
    num_samples = _require_int("num_samples", num_samples, 1)
    start_index = _require_int("start_index", start_index, 0)
    num_shards = _require_int("num_shards", num_shards, 1)
    workers = _require_int("workers", workers, 1)
    row_group_size = _require_int("row_group_size", row_group_size, 1)
    if num_shards > num_samples:
        raise ValueError(f"num_shards ({num_shards}) must be <= num_samples ({num_samples})")

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    info_path = directory / DATASET_INFO_FILE
    info_path.unlink(missing_ok=True)  # a half-written dataset must not look complete
    names = [f"part-{shard:05d}.parquet" for shard in range(num_shards)]
    jobs = [
        (config, str(directory / name), lo, count, row_group_size)
        for name, (lo, count) in zip(
            names, _shard_bounds(start_index, num_samples, num_shards), strict=True
        )
    ]

    with contextlib.ExitStack() as stack:
        pool = None
        if workers > 1 and num_shards > 1:
            context = _pool_context()
            hidden_parameters(config)  # computed once here; forked workers inherit the cache
            counter = context.Value("q", 0)
            # Flush before forking so children do not inherit (and later re-print) buffered
            # output.
            sys.stdout.flush()
            sys.stderr.flush()
            pool = stack.enter_context(
                concurrent.futures.ProcessPoolExecutor(
                    max_workers=min(workers, num_shards),
                    mp_context=context,
                    initializer=_init_worker,
                    initargs=(counter,),
                )
            )
        bar = stack.enter_context(
            tqdm(total=num_samples, desc="generating", unit="sample", disable=not progress)
        )
        if pool is None:
            results = []
            for job in jobs:
                results.append(_write_shard(*job))
                bar.update(job[3])
        else:
            futures = [pool.submit(_write_shard, *job) for job in jobs]
            pending = set(futures)
            while pending:
                _, pending = concurrent.futures.wait(pending, timeout=0.2)
                bar.update(counter.value - bar.n)
            results = [future.result() for future in futures]

        parts = [part for result in results for part in result["parts"]]
        hidden = {key: np.concatenate([part[key] for part in parts]) for key in parts[0]}
        # The no-sequence predictions cost ~3 us per sample, as much as a tiny sample's
        # generation: split per shard over the same workers (rows are independent).
        quantiles = _interest_quantiles(hidden["interest"])
        shards = [slice(lo - start_index, lo - start_index + count) for _, _, lo, count, _ in jobs]
        arguments = (
            [hidden["ctr_base"][shard] for shard in shards],
            [hidden["cvr_base"][shard] for shard in shards],
            [quantiles] * num_shards,
            [config] * num_shards,
        )
        run = map if pool is None else pool.map
        predictions = list(run(_no_sequence_probs, *arguments))
    no_seq_click = np.concatenate([click for click, _ in predictions])
    no_seq_conversion = np.concatenate([conversion for _, conversion in predictions])

    for stale in directory.glob("part-*.parquet"):
        if stale.name not in names:
            stale.unlink()

    click_mean = float(hidden["click"].astype(np.float64).mean())
    conversion_mean = float(hidden["conversion"].astype(np.float64).mean())
    oracle_ne = {
        "ctr": sum(r["ctr_logloss"] for r in results) / num_samples / _binary_entropy(click_mean),
        "cvr": sum(r["cvr_logloss"] for r in results)
        / num_samples
        / _binary_entropy(conversion_mean),
    }
    no_sequence_ne = {
        "ctr": normalized_entropy(no_seq_click, hidden["click"]),
        "cvr": normalized_entropy(no_seq_conversion, hidden["conversion"]),
    }
    sequence_features, sparse_features = _feature_spec(config)
    document = {
        "format_version": FORMAT_VERSION,
        "num_samples": num_samples,
        "start_index": start_index,
        "files": [
            {"name": name, "start_index": lo, "num_rows": count}
            for name, (_, _, lo, count, _) in zip(names, jobs, strict=True)
        ],
        "sequence_features": sequence_features,
        "sparse_features": sparse_features,
        "num_dense_features": config.num_dense_features,
        "max_seq_len": config.max_seq_len,
        "labels": ["click", "conversion"],
        "oracle_ne": oracle_ne,
        "no_sequence_ne": no_sequence_ne,
        "label_means": {"ctr": click_mean, "cvr": conversion_mean},
        "config": config.to_dict(),
        "source": SOURCE_SYNTHETIC,
        "label_probs_known": True,
    }
    _write_document(directory, document)
    return read_dataset_info(directory)


def _json_number(value: float) -> float | None:
    """Strict JSON has no NaN: unknown numbers are written as ``null``."""
    return None if math.isnan(value) else value


def _write_document(directory: Path, document: dict[str, Any]) -> None:
    """Write ``dataset.json`` atomically (strict JSON: NaN values become ``null``)."""
    document = dict(document)
    for key in ("oracle_ne", "no_sequence_ne", "label_means"):
        if key in document:
            document[key] = {k: _json_number(float(v)) for k, v in document[key].items()}
    temporary = directory / f"{DATASET_INFO_FILE}.tmp-{os.getpid()}"
    temporary.write_text(json.dumps(document, indent=2, allow_nan=False) + "\n")
    os.replace(temporary, directory / DATASET_INFO_FILE)


def _float_or_nan(value: Any) -> float:
    return math.nan if value is None else float(value)


def read_dataset_info(directory: str | os.PathLike[str]) -> DatasetInfo:
    """Read ``dataset.json`` of a dataset directory.

    Raises:
        DatasetFormatError: the file is missing, not JSON, or lacks a required key.
    """
    directory = Path(directory)
    path = directory / DATASET_INFO_FILE
    if not path.is_file():
        raise DatasetFormatError(
            f"{path}: missing dataset description (write it with write_synthetic_dataset)"
        )
    try:
        document = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise DatasetFormatError(f"{path}: not a readable JSON file: {error}") from error
    try:
        if document["format_version"] != FORMAT_VERSION:
            raise DatasetFormatError(
                f"{path}: format_version {document['format_version']!r}, "
                f"this reader understands {FORMAT_VERSION}"
            )
        source = str(document.get("source", SOURCE_SYNTHETIC))
        if source not in (SOURCE_SYNTHETIC, SOURCE_INTERACTIONS):
            raise DatasetFormatError(
                f"{path}: unknown source {source!r}, expected "
                f"{SOURCE_SYNTHETIC!r} or {SOURCE_INTERACTIONS!r}"
            )
        raw_config = document["config"] if source == SOURCE_SYNTHETIC else document.get("config")
        # A dataset without true probabilities must say so; older files always had them.
        label_probs_known = bool(document.get("label_probs_known", source == SOURCE_SYNTHETIC))
        return DatasetInfo(
            directory=directory,
            num_samples=int(document["num_samples"]),
            files=[directory / entry["name"] for entry in document["files"]],
            sequence_features={k: int(v) for k, v in document["sequence_features"].items()},
            sparse_features={k: int(v) for k, v in document["sparse_features"].items()},
            num_dense_features=int(document["num_dense_features"]),
            max_seq_len=int(document["max_seq_len"]),
            oracle_ne={k: _float_or_nan(v) for k, v in document["oracle_ne"].items()},
            config=None if raw_config is None else SyntheticConfig.from_dict(raw_config),
            start_index=int(document.get("start_index", 0)),
            no_sequence_ne={
                k: _float_or_nan(v) for k, v in document.get("no_sequence_ne", {}).items()
            },
            label_means={k: _float_or_nan(v) for k, v in document.get("label_means", {}).items()},
            source=source,
            label_probs_known=label_probs_known,
            file_num_rows=[int(entry["num_rows"]) for entry in document["files"]],
            metadata=dict(document.get("metadata", {})),
        )
    except (KeyError, TypeError, AttributeError) as error:
        raise DatasetFormatError(f"{path}: malformed dataset description: {error!r}") from error
    except ValueError as error:
        if isinstance(error, DatasetFormatError):
            raise
        raise DatasetFormatError(f"{path}: malformed dataset description: {error}") from error
