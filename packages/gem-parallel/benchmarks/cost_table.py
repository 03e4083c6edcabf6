"""Print predicted per-step communication for 1k, 2k and 4k GPUs under four strategies.

    python packages/gem-parallel/benchmarks/cost_table.py

Strategies: 1D (dense FSDP over the whole world, embedding tables sharded over the whole
world), 2D (HSDP with a 64-GPU shard group, tables sharded over 64 GPUs and replicated),
fully sharded 2D (2D with each table shard split over the replicas), and fully sharded 2D plus
expert parallelism over the 8 GPUs of a host. The model and cluster numbers below are
illustrative assumptions for a GEM-sized model, not measurements; the bandwidths are
gem_parallel.cost_model.Bandwidths' defaults (450 / 50 / 12.5 GB/s per GPU) and the per-step
latencies are gem_parallel.cost_model.Latencies' defaults (2 / 6 / 25 us).

Times include the latency term with ring step counts (alpha * (p - 1) per call, twice for an
all-reduce); ``lat`` is that latency part of ``total``, and ``exp(log)`` the exposed time when
the collectives use logarithmic (tree / recursive doubling) algorithms instead.
"""

from __future__ import annotations

from gem_parallel import (
    Bandwidths,
    Latencies,
    ModelSizes,
    ParallelLayout,
    Topology,
    Workload,
    estimate_step,
)

GPUS_PER_HOST = 8
HOSTS_PER_ZONE = 64  # 512 GPUs per zone: 1k GPUs already span two zones
GROUP = 64  # dense shard group and embedding model-parallel group (8 hosts, one zone)
EXPERT = 8  # expert-parallel group: one host

MODEL = ModelSizes(
    dense_params=2e9,
    expert_params=1.2e9,
    param_bytes=2,  # bf16 all-gather
    grad_bytes=4,  # fp32 reduce
    embedding_table_bytes=1e12,  # 1 TB of tables
    embedding_lookup_bytes_per_sample=512 * 256 * 2,  # 512 features x 256 dims, bf16
    expert_activation_bytes_per_sample=4 * 64 * 1024 * 2,  # 4 DHEN layers x 64 tokens x 1024
    fsdp_units=16,  # blocks sharded separately: each runs its own collectives
    expert_layers=4,
)
WORKLOAD = Workload(batch_per_gpu=2048, dense_compute_s=0.25)
SYNC_INTERVAL = 100  # 2D embedding replicas synchronised every 100 steps


def strategies(world: int):
    yield "1D", ParallelLayout(1, world, 1, world), "1d"
    yield "2D", ParallelLayout(world // GROUP, GROUP, 1, GROUP), "2d"
    yield "FS-2D", ParallelLayout(world // GROUP, GROUP, 1, GROUP), "fully_sharded_2d"
    yield "FS-2D+EP8", ParallelLayout(world // GROUP, GROUP, EXPERT, GROUP), "fully_sharded_2d"


def rows():
    """(world, strategy name, ring-latency StepCost, log-latency StepCost) for every row."""
    topology = Topology(GPUS_PER_HOST, HOSTS_PER_ZONE)
    for world in (1024, 2048, 4096):
        for name, layout, sparse in strategies(world):
            costs = [
                estimate_step(
                    MODEL,
                    WORKLOAD,
                    layout,
                    topology,
                    Bandwidths(),
                    sparse=sparse,
                    sparse_sync_interval=SYNC_INTERVAL,
                    latencies=Latencies(),
                    latency_model=model,
                )
                for model in ("ring", "log")
            ]
            yield world, name, costs[0], costs[1]


def main() -> None:
    dims = ("shard", "replicate", "expert", "model_parallel", "sparse_replica")
    header = (
        f"{'GPUs':>5} {'strategy':<10}"
        + "".join(f"{d[:14]:>15}" for d in dims)
        + f"{'total':>9}{'lat':>8}{'exposed':>9}{'exp(log)':>9}{'GB/step':>9}{'emb GB/GPU':>11}"
    )
    print("per-GPU communication time per step in ms, by mesh dimension")
    print(header)
    for world, name, cost, log_cost in rows():
        by_dim = cost.seconds_by_dim()
        print(
            f"{world:>5} {name:<10}"
            + "".join(f"{1e3 * by_dim.get(d, 0.0):>15.1f}" for d in dims)
            + f"{1e3 * cost.total_seconds:>9.1f}{1e3 * cost.latency_seconds:>8.1f}"
            + f"{1e3 * cost.exposed_seconds:>9.1f}{1e3 * log_cost.exposed_seconds:>9.1f}"
            + f"{cost.total_bytes / 1e9:>9.2f}{cost.embedding_bytes_per_gpu / 1e9:>11.2f}"
        )


if __name__ == "__main__":
    main()
