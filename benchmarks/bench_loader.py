"""Data-path throughput on CPU: synthetic generation and the read -> merge -> collate loader path.

1. ``write_synthetic_dataset``: samples/s with 1 and 2 worker processes (and per core).
2. ``ShardedBatchLoader`` (row-group streaming, sub-batches of 128, BBS pools of 32 batches,
   KeyedJaggedTensor collation) at 1024-sample batches: batches/s per epoch with 0, 1 and 2
   reader threads, without balancing, and the in-memory ``ParquetBatchLoader`` for reference.
3. Where the time goes: the loader's per-stage timers (0 reader threads, so stages do not
   overlap) and the top functions of a cProfile run.

Timings on a shared machine are noisy: every number is the median of ``--repeats`` runs.

Usage (from the workspace root):
    .venv/bin/python benchmarks/bench_loader.py     # writes benchmarks/results/cpu/loader.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

from gem_data import (
    ParquetBatchLoader,
    ShardedBatchLoader,
    SyntheticConfig,
    write_synthetic_dataset,
)
from harness import ROOT, meta, write_results


def timed_epochs(loader, repeats: int) -> tuple[float, int]:
    """Median seconds of one epoch over ``repeats`` epochs, and batches per epoch."""
    seconds, count = [], 0
    for _ in range(repeats):
        started = time.perf_counter()
        count = sum(1 for _ in loader)
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds), count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-samples", type=int, default=131_072)
    parser.add_argument("--num-shards", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", default=str(ROOT / "benchmarks/results/cpu/loader.json"))
    args = parser.parse_args()
    rows = []

    def add(case: str, provider: str, mode: str, metric: str, value: float) -> None:
        rows.append(
            {"case": case, "provider": provider, "mode": mode, "metric": metric, "value": value}
        )

    config = SyntheticConfig()
    with tempfile.TemporaryDirectory() as directory:
        print(f"generate {args.num_samples} samples into {args.num_shards} shards:")
        for workers in (1, 2):
            seconds = []
            for _ in range(max(1, args.repeats // 2)):
                started = time.perf_counter()
                write_synthetic_dataset(
                    config,
                    directory,
                    num_samples=args.num_samples,
                    num_shards=args.num_shards,
                    workers=workers,
                    progress=False,
                )
                seconds.append(time.perf_counter() - started)
            rate = args.num_samples / statistics.median(seconds)
            mode = f"{args.num_samples} samples, {args.num_shards} shards, workers={workers}"
            add("generate", "write_synthetic_dataset", mode, "samples_per_s", rate)
            add(
                "generate",
                "write_synthetic_dataset",
                mode,
                "samples_per_s_per_core",
                rate / workers,
            )
            print(
                f"  workers={workers}: {rate:9,.0f} samples/s ({rate / workers:,.0f} per core), "
                f"runs {[round(s, 2) for s in seconds]} s"
            )

        case = f"batch={args.batch_size}"
        print(f"\nloader, batches of {args.batch_size} (median epoch of {args.repeats}):")
        configs = {
            "sharded_bbs_w0": {"num_workers": 0},
            "sharded_bbs_w1": {"num_workers": 1},
            "sharded_bbs_w2": {"num_workers": 2},
            "sharded_none_w0": {"num_workers": 0, "balance": "none"},
        }
        for provider, kwargs in configs.items():
            started = time.perf_counter()
            loader = ShardedBatchLoader(directory, args.batch_size, seed=0, **kwargs)
            opened = time.perf_counter() - started
            epoch, count = timed_epochs(loader, args.repeats)
            mode = (
                f"read->merge->collate, {loader.balance}, sub=128, pool=32, "
                f"{loader.num_workers} reader threads"
            )
            add(case, provider, mode, "batches_per_s", count / epoch)
            add(case, provider, mode, "open_seconds", opened)
            print(
                f"  {provider:<18} {count / epoch:7.1f} batches/s "
                f"({count * args.batch_size / epoch:9,.0f} samples/s, open {opened:.3f} s)"
            )
        started = time.perf_counter()
        memory_loader = ParquetBatchLoader(directory, args.batch_size, seed=0)
        opened = time.perf_counter() - started
        epoch, count = timed_epochs(memory_loader, args.repeats)
        mode = "whole dataset read and validated at open, then gather -> collate"
        add(case, "in_memory_parquet_loader", mode, "batches_per_s", count / epoch)
        add(case, "in_memory_parquet_loader", mode, "open_seconds", opened)
        print(
            f"  {'in_memory (ref)':<18} {count / epoch:7.1f} batches/s "
            f"(+ {opened:.2f} s to open and load everything)"
        )

        print("\nprofile (0 reader threads, seconds per batch, median of epochs):")
        per_stage: dict[str, list[float]] = {}
        walls = []
        for _ in range(args.repeats):
            loader = ShardedBatchLoader(directory, args.batch_size, seed=0)
            started = time.perf_counter()
            count = sum(1 for _ in loader)
            walls.append((time.perf_counter() - started) / count)
            for stage, seconds in loader.stage_seconds.items():
                per_stage.setdefault(stage, []).append(seconds / count)
        wall = statistics.median(walls)
        stages = {stage: statistics.median(values) for stage, values in per_stage.items()}
        stages["other"] = max(0.0, wall - sum(stages.values()))
        for stage, seconds in stages.items():
            if stage == "pin" and seconds == 0.0:
                continue  # no CUDA: batches are not pinned
            add(
                "profile",
                stage,
                "ShardedBatchLoader stage timers, 0 reader threads",
                "ms_per_batch",
                1e3 * seconds,
            )
            add(
                "profile",
                stage,
                "ShardedBatchLoader stage timers, 0 reader threads",
                "fraction",
                seconds / wall,
            )
            print(f"  {stage:<10} {1e3 * seconds:7.2f} ms  {seconds / wall:6.1%}")
        print(f"  {'total':<10} {1e3 * wall:7.2f} ms")

        profiler = cProfile.Profile()
        loader = ShardedBatchLoader(directory, args.batch_size, seed=0)
        profiler.enable()
        for _ in loader:
            pass
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(12)
        print("\ncProfile, one epoch, top functions by own time:")
        lines = text.getvalue().splitlines()
        header = next(i for i, line in enumerate(lines) if "ncalls" in line)
        print("\n".join(line[:150] for line in lines[header : header + 13]))

    output = Path(args.output)
    command = "python benchmarks/bench_loader.py" + (
        " " + " ".join(sys.argv[1:]) if sys.argv[1:] else ""
    )
    write_results(output, meta("loader", command), rows)
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
