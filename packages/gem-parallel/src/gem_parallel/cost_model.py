"""Per-step communication volume and time of the GEM parallelism dimensions.

An alpha-beta (latency + bandwidth) model of one training step per GPU. Each collective over a
group of ``p`` ranks moves, per GPU, in each direction (ring / pairwise algorithms):

* all-gather producing ``N`` bytes, or reduce-scatter consuming ``N`` bytes: ``N (p-1)/p``;
* all-reduce of ``N`` bytes: ``2 N (p-1)/p``;
* all-to-all where each rank holds ``N`` bytes spread over the group: ``N (p-1)/p``;

and takes ``bytes / bandwidth`` of the slowest network tier its groups cross
(:func:`gem_parallel.dim_tier`), plus a latency term: every call pays ``alpha`` of that tier
(:class:`Latencies`) once per algorithm step,

* ``latency_model="ring"`` (default): ``p - 1`` steps for all-gather, reduce-scatter and
  all-to-all, ``2 (p - 1)`` for all-reduce (reduce-scatter + all-gather rings);
* ``latency_model="log"``: ``ceil(log2 p)`` steps (recursive doubling / halving, Bruck),
  ``2 ceil(log2 p)`` for all-reduce: what tree / PAT algorithms reach at scale.

The number of calls per step: FSDP runs each collective once per FSDP unit
(``ModelSizes.fsdp_units``; the all-gather twice with ``reshard_after_forward``), expert
parallelism 4 per expert layer (``ModelSizes.expert_layers``), the sparse all-to-all 2 (forward
and backward) and each fully-sharded-2D collective 1; the 2D replica sync one all-reduce every
``sparse_sync_interval`` steps (amortised). Using the slowest tier's alpha for every step of a
group that spans tiers makes the latency an upper bound. The latency term is what makes a
dimension that grows with the world (1D sharding, ``replicate``, ``sparse_replica``) cost more
at 4k GPUs than at 1k even when its bytes per GPU barely change.

What each dimension communicates per step (``B`` = samples per GPU):

* dense FSDP over ``shard`` (``s`` ranks): all-gather the bf16 parameters before forward and,
  with ``reshard_after_forward``, again before backward; reduce-scatter the gradients. With
  expert parallelism of size ``ep`` a rank gathers only its own experts, so expert parameters
  count ``1/ep`` (the rest of the shard group holds the other experts);
* dense replicas over ``replicate`` (``r``): all-reduce of the gradient shard
  (``dense_params * grad_bytes / s``);
* experts over ``expert`` (``ep``): forward all-gather of the input activations and
  reduce-scatter of the summed outputs, both mirrored in backward: 4 collectives over
  ``ep * B * expert_activation_bytes_per_sample`` bytes (see :class:`ExpertParallel`);
* sparse all-to-all over ``model_parallel`` (``mp``): the looked-up embeddings forward and their
  gradients backward, ``B * embedding_lookup_bytes_per_sample`` each;
* ``"1d"`` sparse sharding: tables sharded over the whole world (``mp = world``), nothing else;
* ``"2d"``: tables sharded over ``mp`` and replicated over ``sparse_replica`` (``world / mp``);
  replicas are synchronised by an all-reduce of the local table shard
  (``embedding_table_bytes / mp``) every ``sparse_sync_interval`` steps (amortised per step);
* ``"fully_sharded_2d"``: each ``mp`` shard is further split by rows over ``sparse_replica``;
  the rows a rank serves are fetched from their owners (an all-gather of the served rows,
  ``B * embedding_lookup_bytes_per_sample`` bytes, counted without deduplication: an upper
  bound) and their gradients sent back (a reduce-scatter of the same size); no replica sync.

Exposed time: FSDP collectives overlap with dense compute (prefetch), so only the part
exceeding ``Workload.dense_compute_s`` is exposed; expert, sparse and replica-sync collectives
sit on the critical path and count in full.

Default bandwidths (:class:`Bandwidths`, bytes/s per GPU, one direction) are H100/H200-class
assumptions: NVLink 4 is 900 GB/s bidirectional = 450 GB/s per direction; the scale-out NIC is
one 400 Gb/s ConnectX-7 per GPU = 50 GB/s; the cross-zone (datacenter building to building)
fabric is assumed oversubscribed 4:1 relative to the NIC, 12.5 GB/s. Replace them with
measured numbers for a real cluster. Default per-step latencies (:class:`Latencies`) are
assumptions in the same spirit: 2 us inside a host (NCCL's low-latency protocol over NVLink),
6 us between hosts of a zone (RoCE through two or three switch hops) and 25 us across zones
(kilometres of fibre, about 5 us/km, plus more hops).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from gem_parallel.mesh import (
    TIER_CROSS_ZONE,
    TIER_NVLINK,
    TIER_ZONE,
    ParallelLayout,
    Topology,
    _validate_layout_quietly,
    dim_tier,
)

__all__ = [
    "SPARSE_MODES",
    "Bandwidths",
    "CollectiveCost",
    "LATENCY_MODELS",
    "Latencies",
    "ModelSizes",
    "StepCost",
    "Workload",
    "all_gather_bytes",
    "all_reduce_bytes",
    "all_to_all_bytes",
    "estimate_step",
    "latency_steps",
    "reduce_scatter_bytes",
]

SPARSE_MODES = ("1d", "2d", "fully_sharded_2d")
"""Embedding sharding schemes :func:`estimate_step` models."""

LATENCY_MODELS = ("ring", "log")
"""Step counts of the latency term (module doc): ``p - 1`` or ``ceil(log2 p)`` per call."""


def _check_non_negative(value: object, name: str) -> None:
    # NaN passes "< 0" and a NaN compute time hid every exposed transfer (max(0, x - nan) = 0).
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value < 0
    ):
        raise ValueError(f"{name} must be a finite non-negative number, got {value!r}")


def _check_positive(value: object, name: str) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(f"{name} must be a finite positive number, got {value!r}")


@dataclass(frozen=True)
class ModelSizes:
    """Sizes of the model parts that generate communication."""

    dense_params: float
    """Dense parameters under FSDP, including the expert parameters."""
    expert_params: float = 0.0
    """The part of ``dense_params`` in expert modules (split by expert parallelism)."""
    param_bytes: float = 2.0
    """Bytes per parameter element in the FSDP all-gather (bf16: 2)."""
    grad_bytes: float = 4.0
    """Bytes per gradient element in reduce-scatter / all-reduce (fp32: 4)."""
    embedding_table_bytes: float = 0.0
    """Total bytes of all embedding tables (weights only)."""
    embedding_lookup_bytes_per_sample: float = 0.0
    """Bytes of pooled/sequence embeddings one sample looks up (= the all-to-all payload)."""
    expert_activation_bytes_per_sample: float = 0.0
    """Input activation bytes per sample entering the expert layers, summed over the layers
    (outputs are assumed the same size, as in DHEN)."""
    fsdp_units: int = 1
    """FSDP units (blocks sharded separately): each runs its own collectives (latency term)."""
    expert_layers: int = 1
    """Layers with expert parallelism: each runs 4 collectives per step (latency term)."""

    def __post_init__(self) -> None:
        for name in ("fsdp_units", "expert_layers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"model.{name} must be a positive int, got {value!r}")
        for name in (
            "dense_params",
            "expert_params",
            "embedding_table_bytes",
            "embedding_lookup_bytes_per_sample",
            "expert_activation_bytes_per_sample",
        ):
            _check_non_negative(getattr(self, name), f"model.{name}")
        _check_positive(self.param_bytes, "model.param_bytes")
        _check_positive(self.grad_bytes, "model.grad_bytes")
        if self.expert_params > self.dense_params:
            raise ValueError(
                f"model.expert_params ({self.expert_params}) must not exceed "
                f"model.dense_params ({self.dense_params})"
            )


@dataclass(frozen=True)
class Workload:
    """What one step processes on one GPU."""

    batch_per_gpu: int
    """Samples per GPU per step."""
    dense_compute_s: float = 0.0
    """Dense forward + backward compute time per step; FSDP traffic hides behind it."""

    def __post_init__(self) -> None:
        if (
            isinstance(self.batch_per_gpu, bool)
            or not isinstance(self.batch_per_gpu, int)
            or self.batch_per_gpu <= 0
        ):
            raise ValueError(
                f"workload.batch_per_gpu must be a positive int, got {self.batch_per_gpu!r}"
            )
        _check_non_negative(self.dense_compute_s, "workload.dense_compute_s")


@dataclass(frozen=True)
class Bandwidths:
    """Per-GPU, one-direction bandwidth of each network tier in bytes/s (defaults: module doc)."""

    nvlink: float = 450e9
    """Inside one host (NVLink 4: 900 GB/s bidirectional)."""
    zone: float = 50e9
    """Between hosts of one zone (one 400 Gb/s NIC per GPU)."""
    cross_zone: float = 12.5e9
    """Between zones (assumed 4:1 oversubscribed relative to the NIC)."""

    def __post_init__(self) -> None:
        for name in ("nvlink", "zone", "cross_zone"):
            _check_positive(getattr(self, name), f"bandwidths.{name}")

    def of(self, tier: str) -> float:
        """Bandwidth of ``tier`` (one of :data:`gem_parallel.TIERS`)."""
        table = {TIER_NVLINK: self.nvlink, TIER_ZONE: self.zone, TIER_CROSS_ZONE: self.cross_zone}
        if tier not in table:
            raise ValueError(f"tier must be one of {tuple(table)}, got {tier!r}")
        return table[tier]


def all_gather_bytes(output_bytes: float, group_size: int) -> float:
    """Bytes each rank receives in an all-gather whose result is ``output_bytes``."""
    return output_bytes * (group_size - 1) / group_size


def reduce_scatter_bytes(input_bytes: float, group_size: int) -> float:
    """Bytes each rank sends in a reduce-scatter of ``input_bytes``."""
    return input_bytes * (group_size - 1) / group_size


def all_reduce_bytes(tensor_bytes: float, group_size: int) -> float:
    """Bytes each rank sends in a (ring) all-reduce of ``tensor_bytes``."""
    return 2 * tensor_bytes * (group_size - 1) / group_size


def all_to_all_bytes(local_bytes: float, group_size: int) -> float:
    """Bytes each rank sends in an all-to-all spreading ``local_bytes`` over the group."""
    return local_bytes * (group_size - 1) / group_size


@dataclass(frozen=True)
class Latencies:
    """Per-step latency (alpha) of each network tier in seconds (defaults: module doc)."""

    nvlink: float = 2e-6
    """Inside one host."""
    zone: float = 6e-6
    """Between hosts of one zone."""
    cross_zone: float = 25e-6
    """Between zones."""

    def __post_init__(self) -> None:
        for name in ("nvlink", "zone", "cross_zone"):
            _check_non_negative(getattr(self, name), f"latencies.{name}")

    def of(self, tier: str) -> float:
        """Latency of ``tier`` (one of :data:`gem_parallel.TIERS`)."""
        table = {TIER_NVLINK: self.nvlink, TIER_ZONE: self.zone, TIER_CROSS_ZONE: self.cross_zone}
        if tier not in table:
            raise ValueError(f"tier must be one of {tuple(table)}, got {tier!r}")
        return table[tier]


def latency_steps(group_size: int, latency_model: str = "ring") -> int:
    """Algorithm steps of one all-gather / reduce-scatter / all-to-all over ``group_size``
    ranks (an all-reduce takes twice as many)."""
    if latency_model not in LATENCY_MODELS:
        raise ValueError(f"latency_model must be one of {LATENCY_MODELS}, got {latency_model!r}")
    if group_size <= 1:
        return 0
    if latency_model == "ring":
        return group_size - 1
    return (group_size - 1).bit_length()  # ceil(log2(group_size))


@dataclass(frozen=True)
class CollectiveCost:
    """One kind of collective in a step."""

    name: str
    """What it is, e.g. ``"fsdp_all_gather"``."""
    dim: str
    """Mesh dimension it runs over (one of :data:`gem_parallel.DIM_NAMES`)."""
    tier: str
    """Slowest network tier it crosses."""
    group_size: int
    """Ranks per group."""
    bytes_per_gpu: float
    """Bytes each GPU sends per step (amortised for periodic collectives)."""
    seconds: float
    """``bytes_per_gpu / bandwidth(tier) + latency_seconds``."""
    overlapped: bool
    """Whether it can hide behind dense compute (FSDP) or sits on the critical path."""
    calls: float = 1.0
    """Calls per step (amortised for periodic collectives)."""
    latency_seconds: float = 0.0
    """The latency part of ``seconds``: ``calls * steps * alpha(tier)``."""


@dataclass(frozen=True)
class StepCost:
    """Predicted communication of one step on one GPU."""

    collectives: tuple[CollectiveCost, ...]
    """Every collective with non-zero traffic."""
    dense_compute_s: float
    """Copied from the workload: the window FSDP traffic can hide in."""
    embedding_bytes_per_gpu: float = 0.0
    """Embedding table bytes each GPU stores under the chosen sparse sharding."""
    notes: tuple[str, ...] = field(default_factory=tuple)
    """Human-readable assumptions applied."""

    @property
    def total_bytes(self) -> float:
        """Bytes sent per GPU per step over all collectives."""
        return sum(c.bytes_per_gpu for c in self.collectives)

    @property
    def total_seconds(self) -> float:
        """Communication time per step if nothing overlapped."""
        return sum(c.seconds for c in self.collectives)

    @property
    def latency_seconds(self) -> float:
        """The latency part of :attr:`total_seconds`."""
        return sum(c.latency_seconds for c in self.collectives)

    @property
    def exposed_seconds(self) -> float:
        """Communication time not hidden behind dense compute."""
        overlapped = sum(c.seconds for c in self.collectives if c.overlapped)
        blocking = sum(c.seconds for c in self.collectives if not c.overlapped)
        return blocking + max(0.0, overlapped - self.dense_compute_s)

    def seconds_by_dim(self) -> dict[str, float]:
        """Communication time per mesh dimension."""
        out: dict[str, float] = {}
        for c in self.collectives:
            out[c.dim] = out.get(c.dim, 0.0) + c.seconds
        return out

    def bytes_by_dim(self) -> dict[str, float]:
        """Bytes per GPU per mesh dimension."""
        out: dict[str, float] = {}
        for c in self.collectives:
            out[c.dim] = out.get(c.dim, 0.0) + c.bytes_per_gpu
        return out


def estimate_step(
    model: ModelSizes,
    workload: Workload,
    layout: ParallelLayout,
    topology: Topology,
    bandwidths: Bandwidths | None = None,
    *,
    sparse: str = "2d",
    sparse_sync_interval: int = 1,
    reshard_after_forward: bool = True,
    latencies: Latencies | None = None,
    latency_model: str = "ring",
) -> StepCost:
    """Predict per-GPU communication volume and time of one step (formulas: module doc).

    Args:
        model: sizes of the communicating model parts.
        workload: samples per GPU and the dense compute window.
        layout: group sizes; ``layout.expert`` is the expert-parallel size and
            ``layout.model_parallel`` the embedding sharding group (must be the world for
            ``sparse="1d"``).
        topology: hosts and zones, for the tier of each dimension.
        bandwidths: per-tier bandwidths (default :class:`Bandwidths`).
        sparse: one of :data:`SPARSE_MODES`.
        sparse_sync_interval: steps between replica syncs for ``sparse="2d"``.
        reshard_after_forward: FSDP gathers parameters twice per step when true.
        latencies: per-tier latency per algorithm step (default :class:`Latencies`; pass
            ``Latencies(0, 0, 0)`` for the bandwidth-only model).
        latency_model: one of :data:`LATENCY_MODELS` (module doc).
    """
    for value, name, kind in (
        (model, "model", ModelSizes),
        (workload, "workload", Workload),
        (layout, "layout", ParallelLayout),
        (topology, "topology", Topology),
    ):
        if not isinstance(value, kind):
            raise TypeError(f"{name} must be a {kind.__name__}, got {type(value).__name__}")
    bandwidths = Bandwidths() if bandwidths is None else bandwidths
    latencies = Latencies() if latencies is None else latencies
    if not isinstance(bandwidths, Bandwidths):
        raise TypeError(f"bandwidths must be a Bandwidths, got {type(bandwidths).__name__}")
    if not isinstance(latencies, Latencies):
        raise TypeError(f"latencies must be a Latencies, got {type(latencies).__name__}")
    latency_steps(2, latency_model)  # validates latency_model
    if sparse not in SPARSE_MODES:
        raise ValueError(f"sparse must be one of {SPARSE_MODES}, got {sparse!r}")
    if (
        isinstance(sparse_sync_interval, bool)
        or not isinstance(sparse_sync_interval, int)
        or sparse_sync_interval <= 0
    ):
        raise ValueError(
            f"sparse_sync_interval must be a positive int, got {sparse_sync_interval!r}"
        )
    if not isinstance(reshard_after_forward, bool):
        raise TypeError(f"reshard_after_forward must be a bool, got {reshard_after_forward!r}")
    world = layout.world_size
    # The layouts build_gem_mesh accepts, no others; a cross-zone embedding group is what this
    # prices, so validate_layout's warning about it is left out.
    _validate_layout_quietly(layout, topology)
    if sparse == "1d" and layout.model_parallel != world:
        raise ValueError(
            f"sparse='1d' shards tables over the whole world: layout.model_parallel "
            f"({layout.model_parallel}) must equal the world size ({world})"
        )

    batch = workload.batch_per_gpu
    s, r, ep = layout.shard, layout.replicate, layout.expert
    mp, sr = layout.model_parallel, layout.sparse_replica
    collectives: list[CollectiveCost] = []

    def add(
        name: str,
        dim: str,
        size: int,
        nbytes: float,
        overlapped: bool,
        calls: float,
        all_reduce: bool = False,
    ) -> None:
        if nbytes <= 0 or size <= 1:
            return
        tier = dim_tier(layout, topology, dim)
        steps = latency_steps(size, latency_model) * (2 if all_reduce else 1)
        latency = calls * steps * latencies.of(tier)
        seconds = nbytes / bandwidths.of(tier) + latency
        collectives.append(
            CollectiveCost(name, dim, tier, size, nbytes, seconds, overlapped, calls, latency)
        )

    # Dense FSDP: each rank gathers the non-expert parameters and 1/ep of the expert ones.
    gathered_params = model.dense_params - model.expert_params + model.expert_params / ep
    gathers = 2 if reshard_after_forward else 1
    add(
        "fsdp_all_gather",
        "shard",
        s,
        gathers * all_gather_bytes(gathered_params * model.param_bytes, s),
        True,
        gathers * model.fsdp_units,
    )
    add(
        "fsdp_reduce_scatter",
        "shard",
        s,
        reduce_scatter_bytes(gathered_params * model.grad_bytes, s),
        True,
        model.fsdp_units,
    )
    add(
        "fsdp_all_reduce",
        "replicate",
        r,
        all_reduce_bytes(model.dense_params * model.grad_bytes / s, r),
        True,
        model.fsdp_units,
        all_reduce=True,
    )

    # Experts: all-gather inputs + reduce-scatter outputs, forward and backward.
    gathered_activations = ep * batch * model.expert_activation_bytes_per_sample
    ep_calls = 2 * model.expert_layers
    add(
        "ep_all_gather",
        "expert",
        ep,
        2 * all_gather_bytes(gathered_activations, ep),
        False,
        ep_calls,
    )
    add(
        "ep_reduce_scatter",
        "expert",
        ep,
        2 * reduce_scatter_bytes(gathered_activations, ep),
        False,
        ep_calls,
    )

    # Sparse: lookups forward, their gradients backward.
    lookup = batch * model.embedding_lookup_bytes_per_sample
    add("sparse_all_to_all", "model_parallel", mp, 2 * all_to_all_bytes(lookup, mp), False, 2)
    notes = []
    if sparse == "2d":
        add(
            "sparse_replica_sync",
            "sparse_replica",
            sr,
            all_reduce_bytes(model.embedding_table_bytes / mp, sr) / sparse_sync_interval,
            False,
            1 / sparse_sync_interval,
            all_reduce=True,
        )
        notes.append(f"2D replica sync every {sparse_sync_interval} step(s), amortised")
        table_per_gpu = model.embedding_table_bytes / mp
    elif sparse == "fully_sharded_2d":
        add("sparse_fs2d_all_gather", "sparse_replica", sr, all_gather_bytes(lookup, sr), False, 1)
        add(
            "sparse_fs2d_reduce_scatter",
            "sparse_replica",
            sr,
            reduce_scatter_bytes(lookup, sr),
            False,
            1,
        )
        notes.append("fully sharded 2D rows counted without deduplication (upper bound)")
        table_per_gpu = model.embedding_table_bytes / world
    else:
        table_per_gpu = model.embedding_table_bytes / world
    return StepCost(
        collectives=tuple(collectives),
        dense_compute_s=workload.dense_compute_s,
        embedding_bytes_per_gpu=table_per_gpu,
        notes=tuple(notes),
    )
