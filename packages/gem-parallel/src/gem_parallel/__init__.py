"""gem-parallel: topology-aware device meshes and parallelism for the GEM training stack."""

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
    "DIM_NAMES",
    "TIERS",
    "TIER_CROSS_ZONE",
    "TIER_NVLINK",
    "TIER_ZONE",
    "GemMesh",
    "MeshDim",
    "ParallelLayout",
    "Topology",
    "build_gem_mesh",
    "default_topology",
    "describe_layout",
    "dim_tier",
    "group_of",
    "mesh_dims",
    "rank_groups",
    "run_in_processes",
    "validate_layout",
]
