"""Per-rank embedding memory (weights + optimizer state) under 1D, 2D and fully sharded 2D.

    python packages/gem-parallel/benchmarks/sparse_memory.py            # world 8
    python packages/gem-parallel/benchmarks/sparse_memory.py --world 4

Starts ``--world`` gloo processes on the CPU, shards the same EmbeddingBagCollection (8 tables,
some table-wise, some row-wise, one column-wise) with ``gem_parallel.shard_sparse`` under each
mode and measures what every rank keeps between steps (``ShardedSparse.memory``), with Adagrad
(one state value per weight). For each model-parallel group size it prints the per-rank table
and writes ``benchmarks/results/cpu/sparse_memory.json`` (schema: BENCHMARKS.md): per mode, the
largest rank's bytes (``max_rank_mib``), the sum over ranks (``all_ranks_mib``) and the largest
rank's bytes relative to 2D (``vs_2d``) and, for fully sharded 2D, what a step allocates on
top (``max_rank_step_transient_mib``: the gathered shard, its dense gradient, a padded
buffer). Expected: 2D holds ``R = world / model_parallel`` times 1D's bytes per rank, fully
sharded 2D gets back to about 1D's.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import warnings
from pathlib import Path

import torch
from gem_parallel import ParallelLayout, build_gem_mesh, run_in_processes
from gem_parallel.sparse import SparseMemory, format_memory_table, sparse_memory_report
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "benchmarks"))
from harness import meta, write_results  # noqa: E402

ROWS, DIM = 20_000, 64
SHARDING = {
    "t0": "table_wise",
    "t1": "table_wise",
    "t2": "table_wise",
    "t3": "table_wise",
    "t4": "row_wise",
    "t5": "row_wise",
    "t6": "row_wise",
    "t7": "column_wise",
}


def make_ebc() -> EmbeddingBagCollection:
    tables = [
        EmbeddingBagConfig(name=name, embedding_dim=DIM, num_embeddings=ROWS, feature_names=[name])
        for name in SHARDING
    ]
    return EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))


def _worker(rank: int, world: int, model_parallel: int, out: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mesh = build_gem_mesh(ParallelLayout(shard=world, model_parallel=model_parallel))
    rows = sparse_memory_report(
        make_ebc(),
        mesh,
        optimizer=torch.optim.Adagrad,
        optimizer_kwargs={"lr": 0.01},
        sharding_types=SHARDING,
    )
    if rank == 0:
        torch.save([r.__dict__ for r in rows], out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks" / "results" / "cpu" / "sparse_memory.json"
    )
    args = parser.parse_args()
    world = args.world
    mib = 1024.0 * 1024.0
    results = []
    for model_parallel in [m for m in (world // 2, 2) if 1 < m < world]:
        replicas = world // model_parallel
        with tempfile.TemporaryDirectory() as tmp:
            out = str(Path(tmp, "rows.pt"))
            run_in_processes(
                _worker, world, world, model_parallel, out, timeout=600, preload=("torchrec",)
            )
            rows = [SparseMemory(**r) for r in torch.load(out)]
        case = f"world={world} model_parallel={model_parallel} R={replicas}"
        print(f"\n{case}: 8 tables x {ROWS} x {DIM} fp32, Adagrad")
        print(format_memory_table(rows))
        transient = max(r.transient_bytes for r in rows if r.mode == "fully_sharded_2d") / mib
        print(f"fully_sharded_2d, extra bytes inside a step (largest rank): {transient:.2f} MiB")
        max_2d = max(r.total_bytes for r in rows if r.mode == "2d")
        for mode in dict.fromkeys(r.mode for r in rows):
            mode_rows = [r for r in rows if r.mode == mode]
            largest = max(r.total_bytes for r in mode_rows)
            for metric, value in (
                ("max_rank_mib", largest / mib),
                ("all_ranks_mib", sum(r.total_bytes for r in mode_rows) / mib),
                ("max_rank_weight_mib", max(r.weight_bytes for r in mode_rows) / mib),
                ("max_rank_optimizer_mib", max(r.optimizer_bytes for r in mode_rows) / mib),
                ("max_rank_step_transient_mib", max(r.transient_bytes for r in mode_rows) / mib),
                ("vs_2d", largest / max_2d),
            ):
                results.append(
                    {
                        "case": case,
                        "provider": "gem",
                        "mode": mode,
                        "metric": metric,
                        "value": value,
                    }
                )
    command = "python packages/gem-parallel/benchmarks/sparse_memory.py" + (
        f" --world {world}" if world != 8 else ""
    )
    write_results(
        args.out,
        meta(
            "sparse_memory",
            command,
            device="cpu (2 cores), gloo",
            optimizer="Adagrad",
        ),
        results,
    )
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
