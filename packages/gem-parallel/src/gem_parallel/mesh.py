"""Topology-aware device mesh with named dense, expert and sparse views.

Ranks are laid out host-major: consecutive ranks fill a host (the NVLink domain), consecutive
hosts fill a zone (one scale-out network fabric), and zones are joined by the slowest,
cross-zone network. Every view puts its most communication-hungry dimension on contiguous ranks
so that it lands on the fastest tier:

* ``dense``  = ``(replicate, shard)``: 2D FSDP; ``shard`` is contiguous (parameters are
  all-gathered / reduce-scattered every step), ``replicate`` strides over shard groups.
* ``expert`` = 1-D, contiguous groups of ``expert`` ranks nested inside a shard group and inside
  a host, so expert all-to-all / all-gather stay on NVLink.
* ``sparse`` = ``(sparse_replica, model_parallel)``: embedding tables are sharded inside a
  contiguous ``model_parallel`` group and replicated across ``sparse_replica``.

The layout math (which global ranks form each group, which tier a dimension lands on) is plain
Python with no process group, so it can be unit tested and printed before launching a job;
:func:`build_gem_mesh` turns it into ``torch.distributed`` ``DeviceMesh`` objects.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

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
    "validate_layout",
]

TIER_NVLINK = "nvlink"
"""All ranks of the group are on one host."""
TIER_ZONE = "zone"
"""All ranks of the group are in one zone, on more than one host."""
TIER_CROSS_ZONE = "cross-zone"
"""The group spans more than one zone."""
TIERS = (TIER_NVLINK, TIER_ZONE, TIER_CROSS_ZONE)
"""Network tiers from fastest to slowest."""

DIM_NAMES = ("replicate", "shard", "expert", "sparse_replica", "model_parallel")
"""Named mesh dimensions accepted by :func:`rank_groups`, :func:`group_of` and :func:`dim_tier`."""

# (view, dim) pairs in the order describe() prints them.
_VIEW_DIMS = (
    ("dense", "replicate"),
    ("dense", "shard"),
    ("expert", "expert"),
    ("sparse", "sparse_replica"),
    ("sparse", "model_parallel"),
)


def _check_positive_int(value: object, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class Topology:
    """Physical layout of the ranks: hosts of ``gpus_per_host`` ranks, zones of hosts."""

    gpus_per_host: int
    """Ranks per host (the NVLink domain); consecutive ranks fill a host."""
    hosts_per_zone: int = 1
    """Hosts per zone (one scale-out fabric); consecutive hosts fill a zone."""

    def __post_init__(self) -> None:
        _check_positive_int(self.gpus_per_host, "topology.gpus_per_host")
        _check_positive_int(self.hosts_per_zone, "topology.hosts_per_zone")

    @property
    def gpus_per_zone(self) -> int:
        """Ranks per zone."""
        return self.gpus_per_host * self.hosts_per_zone

    def num_zones(self, world_size: int) -> int:
        """Number of zones for ``world_size`` ranks (raises if the world does not fill zones)."""
        self.check_world_size(world_size)
        return world_size // self.gpus_per_zone

    def check_world_size(self, world_size: int) -> None:
        """Raise ``ValueError`` unless ``world_size = gpus_per_host * hosts_per_zone * zones``."""
        _check_positive_int(world_size, "world_size")
        if world_size % self.gpus_per_zone != 0:
            raise ValueError(
                f"world size {world_size} does not match the topology: it must equal "
                f"topology.gpus_per_host ({self.gpus_per_host}) * topology.hosts_per_zone "
                f"({self.hosts_per_zone}) * number of zones, i.e. be a multiple of "
                f"{self.gpus_per_zone}"
            )

    def host_of(self, rank: int) -> int:
        """Index of the host that holds global ``rank``."""
        return rank // self.gpus_per_host

    def zone_of(self, rank: int) -> int:
        """Index of the zone that holds global ``rank``."""
        return rank // self.gpus_per_zone

    def tier_of(self, ranks: Iterable[int]) -> str:
        """Slowest network tier a collective over ``ranks`` has to cross."""
        ranks = list(ranks)
        if len({self.host_of(r) for r in ranks}) <= 1:
            return TIER_NVLINK
        if len({self.zone_of(r) for r in ranks}) <= 1:
            return TIER_ZONE
        return TIER_CROSS_ZONE


def default_topology(world_size: int, local_world_size: int | None = None) -> Topology:
    """Topology used when none is given: one zone of hosts with ``local_world_size`` ranks each.

    ``local_world_size`` defaults to ``world_size`` (a single host).
    """
    _check_positive_int(world_size, "world_size")
    gpus_per_host = world_size if local_world_size is None else local_world_size
    _check_positive_int(gpus_per_host, "local_world_size")
    if world_size % gpus_per_host != 0:
        raise ValueError(
            f"local_world_size ({gpus_per_host}) must divide the world size ({world_size})"
        )
    return Topology(gpus_per_host=gpus_per_host, hosts_per_zone=world_size // gpus_per_host)


@dataclass(frozen=True)
class ParallelLayout:
    """Sizes of the dense (2D FSDP + experts) and sparse (embedding model parallel) groups."""

    replicate: int = 1
    """Dense replica groups: FSDP replicas (HSDP outer dim); ``replicate * shard = world``."""
    shard: int = 1
    """Dense shard group size: parameters are sharded over these contiguous ranks."""
    expert: int = 1
    """Expert-parallel group size: divides ``shard`` and fits inside one host."""
    model_parallel: int = 1
    """Ranks over which embedding tables are sharded (contiguous); divides the world."""

    def __post_init__(self) -> None:
        for name in ("replicate", "shard", "expert", "model_parallel"):
            _check_positive_int(getattr(self, name), f"layout.{name}")
        if self.shard % self.expert != 0:
            raise ValueError(
                f"layout.expert ({self.expert}) must divide layout.shard ({self.shard}) so that "
                "expert groups nest inside dense shard groups"
            )
        if self.world_size % self.model_parallel != 0:
            raise ValueError(
                f"layout.model_parallel ({self.model_parallel}) must divide the world size "
                f"layout.replicate * layout.shard ({self.world_size})"
            )

    @property
    def world_size(self) -> int:
        """Number of ranks the layout covers: ``replicate * shard``."""
        return self.replicate * self.shard

    @property
    def sparse_replica(self) -> int:
        """Number of copies of each embedding shard: ``world_size // model_parallel``."""
        return self.world_size // self.model_parallel

    def size(self, dim: str) -> int:
        """Size of the named dimension (one of :data:`DIM_NAMES`)."""
        _check_dim(dim)
        return getattr(self, dim)


def _check_dim(dim: str) -> None:
    if dim not in DIM_NAMES:
        raise ValueError(f"dim must be one of {DIM_NAMES}, got {dim!r}")


def validate_layout(layout: ParallelLayout, topology: Topology, world_size: int) -> None:
    """Check that ``layout`` fits ``world_size`` ranks laid out as ``topology``.

    Raises ``ValueError`` naming the offending argument; warns when the embedding
    ``model_parallel`` group has to cross zones (it should stay inside a host or a zone).
    """
    if not isinstance(layout, ParallelLayout):
        raise TypeError(f"layout must be a ParallelLayout, got {type(layout).__name__}")
    if not isinstance(topology, Topology):
        raise TypeError(f"topology must be a Topology, got {type(topology).__name__}")
    _check_positive_int(world_size, "world_size")
    if layout.world_size != world_size:
        raise ValueError(
            f"layout.replicate * layout.shard ({layout.replicate} * {layout.shard} = "
            f"{layout.world_size}) must equal the world size ({world_size})"
        )
    topology.check_world_size(world_size)
    if layout.expert > topology.gpus_per_host or topology.gpus_per_host % layout.expert != 0:
        raise ValueError(
            f"layout.expert ({layout.expert}) must fit inside one host: it must divide "
            f"topology.gpus_per_host ({topology.gpus_per_host}) so expert collectives stay "
            "on NVLink"
        )
    if dim_tier(layout, topology, "model_parallel") == TIER_CROSS_ZONE:
        warnings.warn(
            f"layout.model_parallel ({layout.model_parallel}) spans more than one zone "
            f"({topology.gpus_per_zone} ranks per zone): embedding all-to-alls will cross "
            "the slowest network tier",
            stacklevel=2,
        )


def rank_groups(layout: ParallelLayout, dim: str) -> list[tuple[int, ...]]:
    """All groups of global ranks along ``dim``, ordered by their first rank.

    Each group is ordered by its local rank in the dimension.
    """
    _check_dim(dim)
    world = layout.world_size
    if dim in ("shard", "expert", "model_parallel"):  # contiguous ranks
        size = layout.size(dim)
        return [tuple(range(start, start + size)) for start in range(0, world, size)]
    # Strided dims: one rank from each contiguous group of the inner dimension.
    inner = layout.shard if dim == "replicate" else layout.model_parallel
    return [tuple(range(offset, world, inner)) for offset in range(inner)]


def group_of(layout: ParallelLayout, dim: str, rank: int) -> tuple[int, ...]:
    """The group along ``dim`` that contains global ``rank``."""
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < layout.world_size:
        raise ValueError(f"rank must be an int in [0, {layout.world_size}), got {rank!r}")
    return next(g for g in rank_groups(layout, dim) if rank in g)


def dim_tier(layout: ParallelLayout, topology: Topology, dim: str) -> str:
    """Slowest network tier that any group of ``dim`` crosses (one of :data:`TIERS`)."""
    tiers = {topology.tier_of(group) for group in rank_groups(layout, dim)}
    return max(tiers, key=TIERS.index)


@dataclass(frozen=True)
class MeshDim:
    """One named dimension of one view of the mesh."""

    view: str
    """``"dense"``, ``"expert"`` or ``"sparse"``."""
    name: str
    """Dimension name (one of :data:`DIM_NAMES`)."""
    size: int
    """Ranks per group along this dimension."""
    stride: int
    """Global-rank distance between neighbours in a group (1 = contiguous)."""
    tier: str
    """Slowest network tier the dimension's groups cross."""
    groups: tuple[tuple[int, ...], ...]
    """Every group of global ranks along this dimension."""


def mesh_dims(layout: ParallelLayout, topology: Topology) -> list[MeshDim]:
    """The named dimensions of every view, with their groups and network tiers."""
    dims = []
    for view, name in _VIEW_DIMS:
        groups = tuple(rank_groups(layout, name))
        first = groups[0]
        stride = first[1] - first[0] if len(first) > 1 else 1
        tier = dim_tier(layout, topology, name)
        dims.append(MeshDim(view, name, layout.size(name), stride, tier, groups))
    return dims


def _validate_layout_quietly(layout: ParallelLayout, topology: Topology) -> None:
    """:func:`validate_layout` at the layout's own world size, without the cross-zone warning:
    for callers that show or price the tiers themselves (:func:`describe_layout`, the cost
    model)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        validate_layout(layout, topology, layout.world_size)


def describe_layout(layout: ParallelLayout, topology: Topology) -> str:
    """A table of the views' dimensions, their sizes and the network tier each lands on.
    A layout that :func:`validate_layout` refuses is refused here too."""
    _validate_layout_quietly(layout, topology)
    world = layout.world_size
    zones = topology.num_zones(world)
    lines = [
        f"world {world} = {zones} zone(s) x {topology.hosts_per_zone} host(s)/zone x "
        f"{topology.gpus_per_host} GPU(s)/host",
        f"{'view':<8}{'dim':<16}{'size':>6}{'stride':>8}  tier",
    ]
    for d in mesh_dims(layout, topology):
        lines.append(f"{d.view:<8}{d.name:<16}{d.size:>6}{d.stride:>8}  {d.tier}")
    return "\n".join(lines)


@dataclass(frozen=True)
class GemMesh:
    """Named ``DeviceMesh`` views of one world, built by :func:`build_gem_mesh`."""

    layout: ParallelLayout
    """The parallel layout the views realise."""
    topology: Topology
    """The physical topology used for tier assignment."""
    dense: DeviceMesh
    """2-D mesh with dims ``("replicate", "shard")``; ``shard`` is contiguous ranks."""
    expert: DeviceMesh
    """1-D mesh over this rank's expert group (contiguous ranks inside its shard group)."""
    sparse: DeviceMesh
    """2-D mesh with dims ``("sparse_replica", "model_parallel")``; ``model_parallel`` is
    contiguous ranks."""
    expert_replica: DeviceMesh | None = None
    """1-D mesh over the ranks holding the same experts as this one, one per expert group
    (stride ``expert``); set by :func:`build_gem_mesh`."""

    @property
    def dense_shard_group(self) -> dist.ProcessGroup:
        """This rank's dense FSDP shard group."""
        return self.dense.get_group("shard")

    @property
    def dense_replicate_group(self) -> dist.ProcessGroup:
        """This rank's dense replica group (same shard position in every shard group)."""
        return self.dense.get_group("replicate")

    @property
    def expert_group(self) -> dist.ProcessGroup:
        """This rank's expert-parallel group."""
        return self.expert.get_group()

    @property
    def expert_replica_group(self) -> dist.ProcessGroup:
        """Ranks holding the same experts (same position in every expert group); expert
        gradients are summed over it (see ``ExpertParallel.reduce_grads``)."""
        if self.expert_replica is None:
            raise ValueError("this GemMesh was built without an expert_replica mesh")
        return self.expert_replica.get_group()

    @property
    def model_parallel_group(self) -> dist.ProcessGroup:
        """This rank's embedding model-parallel group (tables are sharded over it)."""
        return self.sparse.get_group("model_parallel")

    @property
    def sparse_replica_group(self) -> dist.ProcessGroup:
        """This rank's sparse replica group (ranks holding the same embedding shard)."""
        return self.sparse.get_group("sparse_replica")

    def describe(self) -> str:
        """Table of dims, sizes and network tiers (see :func:`describe_layout`)."""
        return describe_layout(self.layout, self.topology)


def build_gem_mesh(
    layout: ParallelLayout,
    topology: Topology | None = None,
    *,
    device_type: str = "cpu",
) -> GemMesh:
    """Create the dense, expert and sparse ``DeviceMesh`` views for the current world.

    Must be called on every rank (after ``torch.distributed.init_process_group``) with the same
    arguments, because creating the process groups is collective. ``topology`` defaults to
    :func:`default_topology` with ``LOCAL_WORLD_SIZE`` (set by torchrun) ranks per host, or one
    host when it is not set.
    """
    if not isinstance(device_type, str) or not device_type.isalpha():
        raise ValueError(
            f"device_type must be a device type without index such as 'cpu' or 'cuda', "
            f"got {device_type!r}"
        )
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "build_gem_mesh needs an initialized default process group: call "
            "torch.distributed.init_process_group first"
        )
    world = dist.get_world_size()
    if topology is None:
        local = os.environ.get("LOCAL_WORLD_SIZE")
        if local and not local.isdigit():
            raise ValueError(
                f"LOCAL_WORLD_SIZE must be the number of ranks per host, got {local!r}"
            )
        topology = default_topology(world, int(local) if local else None)
    validate_layout(layout, topology, world)

    # Every rank creates the meshes in the same order; each creates its dims' process groups.
    # Separate public init_device_mesh calls rather than private _flatten / _unflatten tricks
    # keep this working from torch 2.11 on.
    dense = init_device_mesh(
        device_type, (layout.replicate, layout.shard), mesh_dim_names=("replicate", "shard")
    )
    expert_2d = init_device_mesh(
        device_type,
        (world // layout.expert, layout.expert),
        mesh_dim_names=("expert_replica", "expert"),
    )
    sparse = init_device_mesh(
        device_type,
        (layout.sparse_replica, layout.model_parallel),
        mesh_dim_names=("sparse_replica", "model_parallel"),
    )
    # A 1-D view of this rank's expert group. DeviceMesh.from_group (public since torch 2.4)
    # wraps the existing group; slicing expert_2d["expert"] would do the same but imports
    # torch._dynamo, which costs seconds per process.
    expert = DeviceMesh.from_group(
        expert_2d.get_group("expert"), device_type, mesh_dim_names=("expert",)
    )
    expert_replica = DeviceMesh.from_group(
        expert_2d.get_group("expert_replica"), device_type, mesh_dim_names=("expert_replica",)
    )
    return GemMesh(
        layout=layout,
        topology=topology,
        dense=dense,
        expert=expert,
        sparse=sparse,
        expert_replica=expert_replica,
    )
