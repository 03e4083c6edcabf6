"""Rank balance of jagged batches: no balancing vs Base Batch Shuffling vs a global rebalance.

Simulates, for 8 / 64 / 512 data-parallel ranks, the per-step cost of each rank's batch of
1024 samples (sub-batches of 128) drawn from the synthetic history-length distribution, and
reports max/mean rank cost (1.0 = perfect balance; the step waits for the busiest rank):

* ``none``: each rank merges its next 8 sub-batches in stream order;
* ``bbs``: Base Batch Shuffling, pools of 32 batches per rank, sorted and snake-dealt
  (``gem_data.bbs_merge``, the code the loader runs), no communication;
* ``global``: every step, all ranks' sub-batches re-assigned, 8 per rank, by LPT + improving
  swaps (``gem_data.global_rebalance``; needs an all-gather of the costs per step).

Cost model: attention, sum of L^2 per batch. Also: pool-size sweep, BBS sorting by the wrong
cost model (sum of L), a longer-history distribution, and an end-to-end check with the real
``ShardedBatchLoader`` on generated Parquet data.

Usage (from the workspace root):
    .venv/bin/python benchmarks/bench_bbs_balance.py            # writes benchmarks/results/cpu/bbs_balance.json
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from gem_data import (
    ShardedBatchLoader,
    SyntheticConfig,
    linear_cost,
    sample_history_lengths,
    simulate_balance,
    write_synthetic_dataset,
)
from harness import ROOT, meta, write_results


def simulate(config: SyntheticConfig, ranks: int, seeds: int, **kwargs) -> dict[str, float]:
    """Mean over seeds of the per-strategy mean-over-steps max/mean."""

    def sampler(n: int, rng: np.random.Generator) -> np.ndarray:
        return sample_history_lengths(config, n, rng)

    summaries = [
        simulate_balance(sampler, num_ranks=ranks, seed=seed, **kwargs).summary()
        for seed in range(seeds)
    ]
    return {key: float(np.mean([s[key] for s in summaries])) for key in summaries[0]}


def loader_check(
    ranks: int, batch_size: int, sub_batch_size: int, pool_batches: int, epochs: int
) -> dict:
    """max/mean of the real loader's batches (sum of L^2 from the offsets), step by step.

    Two pools per rank and epoch; every epoch reshuffles the stream, so pools differ.
    """
    samples = 2 * ranks * pool_batches * batch_size
    with tempfile.TemporaryDirectory() as directory:
        # Row groups of 512: a pool of 4096 samples mixes 8 row groups, new ones every epoch.
        write_synthetic_dataset(
            SyntheticConfig(seed=1),
            directory,
            num_samples=samples,
            num_shards=8,
            progress=False,
            row_group_size=512,
        )
        results = {}
        for balance in ("none", "bbs"):
            costs = []
            for rank in range(ranks):
                loader = ShardedBatchLoader(
                    directory,
                    batch_size,
                    rank=rank,
                    world_size=ranks,
                    balance=balance,
                    sub_batch_size=sub_batch_size,
                    pool_batches=pool_batches,
                    drop_last=True,
                )
                costs.append(
                    [
                        float((batch.sequence_offsets.diff().double() ** 2).sum())
                        for _ in range(epochs)
                        for batch in loader
                    ]
                )
            loads = np.array(costs)  # (ranks, steps)
            results[balance] = float((loads.max(axis=0) / loads.mean(axis=0)).mean())
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 64, 512])
    parser.add_argument("--pools", type=int, default=4, help="pools simulated per seed")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--pool-batches", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--sub-batch-size", type=int, default=128)
    parser.add_argument("--output", default=str(ROOT / "benchmarks/results/cpu/bbs_balance.json"))
    args = parser.parse_args()

    config = SyntheticConfig()
    common = {
        "batch_size": args.batch_size,
        "sub_batch_size": args.sub_batch_size,
        "num_pools": args.pools,
    }
    mode = (
        f"sim: cost=sum L^2, batch={args.batch_size}, sub={args.sub_batch_size}, "
        f"pool={args.pool_batches}, max_seq_len={config.max_seq_len}, "
        f"{args.pools * args.pool_batches} steps x {args.seeds} seeds"
    )
    rows = []

    def add(case: str, provider: str, row_mode: str, metric: str, value: float) -> None:
        rows.append(
            {"case": case, "provider": provider, "mode": row_mode, "metric": metric, "value": value}
        )

    print(f"{'case':<12} {'none':>7} {'bbs':>7} {'global':>7} {'gap removed':>12}  (max/mean)")
    for ranks in args.ranks:
        started = time.perf_counter()
        result = simulate(config, ranks, args.seeds, pool_batches=args.pool_batches, **common)
        case = f"ranks={ranks}"
        for provider in ("none", "bbs", "global"):
            add(case, provider, mode, "max_over_mean", result[provider])
        add(case, "bbs", mode, "gap_removed_vs_global", result["bbs_gap_removed"])
        add(case, "bbs", mode, "gap_removed_vs_bound_1", result["bbs_gap_removed_vs_bound"])
        print(
            f"{case:<12} {result['none']:7.4f} {result['bbs']:7.4f} {result['global']:7.4f} "
            f"{result['bbs_gap_removed']:11.1%}  ({time.perf_counter() - started:.0f} s)"
        )

    print("\nBBS variants (1 seed, no global reference):")
    variants = {
        f"bbs_pool{pool}": {"pool_batches": pool}
        for pool in (8, 16, 64)
        if pool != args.pool_batches
    }
    variants["bbs_sorted_by_L"] = {
        "pool_batches": args.pool_batches,
        "balance_cost_model": linear_cost,
    }
    for ranks in args.ranks:
        line = f"ranks={ranks:<6}"
        for provider, extra in variants.items():
            kwargs = {
                **common,
                "num_pools": max(1, args.pools * args.pool_batches // extra["pool_batches"] // 2),
            }
            result = simulate(config, ranks, 1, rebalance_globally=False, **extra, **kwargs)
            variant_mode = mode.replace(
                f"pool={args.pool_batches}", f"pool={extra['pool_batches']}"
            )
            if "balance_cost_model" in extra:
                variant_mode += ", BBS sorts by sum L (mismatched)"
            add(f"ranks={ranks}", provider, variant_mode, "max_over_mean", result["bbs"])
            line += f"  {provider} {result['bbs']:.4f}"
        print(line)

    long_config = SyntheticConfig(max_seq_len=1024)
    result = simulate(long_config, 64, 1, pool_batches=args.pool_batches, **common)
    long_mode = mode.replace("max_seq_len=128", "max_seq_len=1024").replace(
        f"x {args.seeds} seeds", "x 1 seed"
    )
    for provider in ("none", "bbs", "global"):
        add("ranks=64,max_seq_len=1024", provider, long_mode, "max_over_mean", result[provider])
    print(
        f"\nranks=64, max_seq_len=1024: none {result['none']:.4f} bbs {result['bbs']:.4f} "
        f"global {result['global']:.4f} (gap removed {result['bbs_gap_removed']:.1%})"
    )

    check = loader_check(ranks=8, batch_size=256, sub_batch_size=32, pool_batches=16, epochs=4)
    sim = simulate(
        SyntheticConfig(seed=1),
        8,
        args.seeds,
        batch_size=256,
        sub_batch_size=32,
        pool_batches=16,
        num_pools=8,
    )
    check_mode = (
        "ShardedBatchLoader on 65536 Parquet samples (row groups of 512), 4 epochs: "
        "batch=256, sub=32, pool=16, "
        f"128 steps (sim: 128 steps x {args.seeds} seeds)"
    )
    for provider in ("none", "bbs"):
        add("ranks=8,batch=256", f"{provider}_loader", check_mode, "max_over_mean", check[provider])
        add("ranks=8,batch=256", f"{provider}_sim", check_mode, "max_over_mean", sim[provider])
    print(
        f"loader check (8 ranks, batch 256): loader none {check['none']:.4f} bbs {check['bbs']:.4f}"
        f" | simulation none {sim['none']:.4f} bbs {sim['bbs']:.4f}"
    )

    output = Path(args.output)
    command = "python benchmarks/bench_bbs_balance.py" + (
        " " + " ".join(sys.argv[1:]) if sys.argv[1:] else ""
    )
    write_results(output, meta("bbs_balance", command), rows)
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
