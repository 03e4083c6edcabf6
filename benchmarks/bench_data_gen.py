"""Synthetic data generation throughput, tiny and GPU-scale profiles (``SyntheticConfig``).

Cases: ``tiny`` (the defaults, max_seq_len 128), ``L1024`` and ``L4096``
(``SyntheticConfig.gpu_scale(max_seq_len)``: half the cap filled on average).

1. ``generate_table`` in this process, in row groups of 4096 samples: samples per minute per
   core from the process CPU time (so other load on a shared machine does not count against
   it), and from the wall clock.
2. ``write_synthetic_dataset`` (zstd Parquet shards, one shard per worker, row groups of 4096)
   with ``--workers`` processes, each as many samples as in 1.: samples per minute in all and
   per worker, wall clock, fork and the ``dataset.json`` summary included.

The issue's target is 1M samples per minute on 16 cores, i.e. 62.5k per minute per core.
Every number is the median of ``--repeats`` runs.

Usage (from the workspace root):
    uv run --extra cpu python benchmarks/bench_data_gen.py   # -> benchmarks/results/cpu/data_gen.json
    PYTHONPATH=packages/gem-data/src python3 benchmarks/bench_data_gen.py --workers 16 --out x.json
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from gem_data import SyntheticConfig, generate_table, hidden_parameters, write_synthetic_dataset
from harness import meta, results_parser, user_args, write_results

TARGET_PER_MIN_PER_CORE = 1_000_000 / 16
ROW_GROUP = 4096


def cases(scale: float) -> list[tuple[str, SyntheticConfig, int]]:
    """(case, config, samples per process and run): a few seconds of work on one core each."""
    return [
        ("tiny", SyntheticConfig(), int(65536 * scale)),
        ("L1024", SyntheticConfig.gpu_scale(1024), int(16384 * scale)),
        ("L4096", SyntheticConfig.gpu_scale(4096), int(4096 * scale)),
    ]


def time_generate(config: SyntheticConfig, num_samples: int, start: int) -> tuple[float, float]:
    """(process CPU seconds, wall seconds) to generate ``num_samples`` in row groups."""
    cpu, wall = time.process_time(), time.perf_counter()
    for lo in range(start, start + num_samples, ROW_GROUP):
        generate_table(config, lo, min(ROW_GROUP, start + num_samples - lo))
    return time.process_time() - cpu, time.perf_counter() - wall


def main() -> None:
    parser = results_parser(__doc__, "cpu/data_gen.json")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies every sample count")
    args = parser.parse_args()
    rows: list[dict] = []

    def add(case: str, mode: str, metric: str, value: float) -> None:
        rows.append(
            {"case": case, "provider": "gem", "mode": mode, "metric": metric, "value": value}
        )

    print(f"target: {TARGET_PER_MIN_PER_CORE:,.0f} samples/min/core (1M/min on 16 cores)")
    for case, config, num_samples in cases(args.scale):
        hidden_parameters(config)
        lengths = np.diff(
            generate_table(config, 10**9, 2000).column("hist_item_ids").combine_chunks().offsets
        )
        mean_fraction = float(lengths.mean()) / config.max_seq_len
        add(case, "2000 samples", "mean_length_fraction", mean_fraction)
        add(case, "2000 samples", "at_cap_fraction", float((lengths == config.max_seq_len).mean()))

        runs = [time_generate(config, num_samples, i * num_samples) for i in range(args.repeats)]
        cpu = statistics.median(run[0] for run in runs)
        wall = statistics.median(run[1] for run in runs)
        mode = f"generate_table, {num_samples} samples, 1 process"
        add(case, mode, "samples_per_min_per_core", 60 * num_samples / cpu)
        add(case, mode, "samples_per_min_per_core_wall", 60 * num_samples / wall)
        add(case, mode, "events_per_s_per_core", num_samples * float(lengths.mean()) / cpu)
        print(
            f"{case:>6} (max_seq_len {config.max_seq_len}, mean length "
            f"{mean_fraction:.2f} of it): generate_table {60 * num_samples / cpu:11,.0f} "
            f"samples/min/core (CPU time; wall {60 * num_samples / wall:,.0f})"
        )

        total = num_samples * args.workers
        seconds = []
        with tempfile.TemporaryDirectory() as directory:
            for _ in range(args.repeats):
                started = time.perf_counter()
                write_synthetic_dataset(
                    config,
                    directory,
                    num_samples=total,
                    num_shards=args.workers,
                    workers=args.workers,
                    progress=False,
                    row_group_size=ROW_GROUP,
                )
                seconds.append(time.perf_counter() - started)
        rate = 60 * total / statistics.median(seconds)
        mode = f"write_synthetic_dataset, {total} samples, workers={args.workers}, wall"
        add(case, mode, "samples_per_min", rate)
        add(case, mode, "samples_per_min_per_core", rate / args.workers)
        print(
            f"{'':>6} write_synthetic_dataset, {args.workers} workers: {rate:11,.0f} samples/min "
            f"({rate / args.workers:,.0f} per worker), runs {[round(s, 2) for s in seconds]} s"
        )

    command = " ".join(["python benchmarks/bench_data_gen.py", *user_args()])
    device = f"cpu ({os.cpu_count()} cores)"
    write_results(Path(args.out), meta("data_gen", command, device=device), rows)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
