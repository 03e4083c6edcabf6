"""Benchmark: synthetic generation throughput and loader collation speed.

Usage (from the workspace root):
    uv run --extra cpu python packages/gem-data/benchmarks/bench_data.py --num-samples 60000
"""

from __future__ import annotations

import argparse
import tempfile
import time

from gem_data import ParquetBatchLoader, SyntheticConfig, write_synthetic_dataset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-samples", type=int, default=60_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--num-shards", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    config = SyntheticConfig()
    with tempfile.TemporaryDirectory() as directory:
        timings = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            info = write_synthetic_dataset(
                config,
                directory,
                num_samples=args.num_samples,
                num_shards=args.num_shards,
                workers=args.workers,
                progress=False,
            )
            timings.append(time.perf_counter() - start)
        best = min(timings)
        print(
            f"generate {args.num_samples} samples, {args.workers} workers: best {best:.2f} s "
            f"({args.num_samples / best:,.0f} samples/s), runs {[round(t, 2) for t in timings]}"
        )
        print(f"oracle NE {info.oracle_ne}  no-sequence NE {info.no_sequence_ne}")
        print(f"label means {info.label_means}")

        start = time.perf_counter()
        loader = ParquetBatchLoader(directory, args.batch_size, seed=0)
        print(f"open + validate: {time.perf_counter() - start:.2f} s")
        start = time.perf_counter()
        batches = sum(1 for _ in loader)
        elapsed = time.perf_counter() - start
        print(
            f"one epoch: {batches} batches of {args.batch_size} in {elapsed:.2f} s "
            f"({batches / elapsed:,.0f} batches/s, {args.num_samples / elapsed:,.0f} samples/s)"
        )


if __name__ == "__main__":
    main()
