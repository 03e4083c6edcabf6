"""gem-parallel: topology-aware device meshes and parallelism for the GEM training stack."""

from gem_parallel.collectives import all_gather_dim0, reduce_scatter_dim0
from gem_parallel.cost_model import (
    SPARSE_MODES,
    Bandwidths,
    CollectiveCost,
    ModelSizes,
    StepCost,
    Workload,
    estimate_step,
)
from gem_parallel.expert import ExpertParallel, expert_assignment
from gem_parallel.fsdp import apply_fsdp, default_fsdp_blocks
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
]
