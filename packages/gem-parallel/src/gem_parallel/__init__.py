"""gem-parallel: topology-aware device meshes and parallelism for the GEM training stack."""

from gem_parallel.collectives import (
    COLLECTIVE_CHOICES,
    all_gather_dim0,
    copy_engine_all_gather,
    copy_engine_reduce_scatter,
    copy_engine_status,
    plain_all_gather,
    plain_reduce_scatter,
    reduce_scatter_dim0,
    select_all_gather,
    select_reduce_scatter,
    symmetric_empty,
)
from gem_parallel.cost_model import (
    SPARSE_MODES,
    Bandwidths,
    CollectiveCost,
    Latencies,
    ModelSizes,
    StepCost,
    Workload,
    estimate_step,
)
from gem_parallel.expert import ExpertParallel, expert_assignment
from gem_parallel.fsdp import FsdpAllGather, apply_fsdp, default_fsdp_blocks, set_fsdp_all_gather
from gem_parallel.mesh import (
    DIM_NAMES,
    TIER_CROSS_ZONE,
    TIER_NVLINK,
    TIER_ZONE,
    TIERS,
    GemMesh,
    MeshDim,
    ParallelLayout,
    Topology,
    build_gem_mesh,
    default_topology,
    describe_layout,
    dim_tier,
    group_of,
    mesh_dims,
    rank_groups,
    validate_layout,
)
from gem_parallel.testing import run_in_processes

__all__ = [
    "SPARSE_MODES",
    "Bandwidths",
    "CollectiveCost",
    "Latencies",
    "ModelSizes",
    "StepCost",
    "Workload",
    "estimate_step",
    "DIM_NAMES",
    "TIERS",
    "TIER_CROSS_ZONE",
    "TIER_NVLINK",
    "TIER_ZONE",
    "ExpertParallel",
    "GemMesh",
    "MeshDim",
    "ParallelLayout",
    "Topology",
    "all_gather_dim0",
    "COLLECTIVE_CHOICES",
    "FsdpAllGather",
    "copy_engine_all_gather",
    "copy_engine_reduce_scatter",
    "copy_engine_status",
    "plain_all_gather",
    "plain_reduce_scatter",
    "select_all_gather",
    "select_reduce_scatter",
    "set_fsdp_all_gather",
    "symmetric_empty",
    "apply_fsdp",
    "build_gem_mesh",
    "default_fsdp_blocks",
    "default_topology",
    "describe_layout",
    "dim_tier",
    "expert_assignment",
    "group_of",
    "mesh_dims",
    "rank_groups",
    "reduce_scatter_dim0",
    "run_in_processes",
    "validate_layout",
    # gem_parallel.sparse, loaded on first use (see __getattr__)
    "SHARDING_TYPES",
    "ShardedSparse",
    "SparseMemory",
    "format_memory_table",
    "shard_sparse",
    "sparse_memory_report",
]

_SPARSE_NAMES = frozenset(
    (
        "SHARDING_TYPES",
        "ShardedSparse",
        "SparseMemory",
        "format_memory_table",
        "shard_sparse",
        "sparse_memory_report",
    )
)


def __getattr__(name: str) -> object:
    # gem_parallel.sparse imports torchrec, which takes seconds: only load it when asked for.
    if name in _SPARSE_NAMES:
        from gem_parallel import sparse

        return getattr(sparse, name)
    raise AttributeError(f"module 'gem_parallel' has no attribute {name!r}")
