"""1D, 2D and fully sharded 2D embedding parallelism on torchrec's sharding primitives.

Embedding tables are sharded by torchrec (``EmbeddingShardingPlanner`` + ``DistributedModelParallel``)
over a *model-parallel* process group instead of the whole world. Both pooled tables
(``EmbeddingBagCollection``) and sequence tables (``EmbeddingCollection``, one row per id, as the
GEM model's history) are handled, alone or inside a larger model. The group comes from the
``sparse`` view of a :class:`~gem_parallel.GemMesh` (contiguous ranks, the fastest tier); the
``sparse_replica`` dimension strides over those groups.

* ``"1d"``: tables sharded over the whole world; torchrec's fused optimizer updates the rows
  inside the backward pass. Nothing else to do.
* ``"2d"``: tables sharded inside each model-parallel group (table-, row- or column-wise), every
  group holding a full copy. Groups train data-parallel, each updating its copy with the fused
  optimizer; :meth:`ShardedSparse.sync` (called by :meth:`ShardedSparse.step` every
  ``sync_every`` steps) averages each local shard's weights **and** optimizer state over the
  replica group. With plain SGD and ``sync_every=1`` this equals single-process training;
  with a stateful optimizer it is the average of the replicas' updates (local SGD).
* ``"fully_sharded_2d"``: as ``"2d"``, but each rank persistently holds only ``1/R`` of its
  local shard (``R`` = replica group size), as a flat slice, and the optimizer state only for
  that slice. Before the lookup the local shard is rebuilt by an all-gather over the replica
  group; after backward the dense shard gradient is reduce-scattered (averaged) over the replica
  group, each rank updates its own slice with a regular ``torch.optim`` optimizer (or
  torchrec's ``RowWiseAdagrad``, implemented here on flat slices) and the rebuilt shard is freed.
  Persistent memory per rank (weights and optimizer state) drops by ``R`` against ``"2d"``; the
  update equals single-process training with the same optimizer. The gather / scatter move the
  whole local shard every step and the gathered shard and its dense gradient live from forward
  to ``step()`` (:attr:`SparseMemory.transient_bytes`): this lowers what a rank keeps, not its
  peak. The collectives come from :func:`~gem_parallel.select_all_gather` /
  :func:`~gem_parallel.select_reduce_scatter` (copy engine on one CUDA host, else NCCL / gloo).

Gradient convention: torchrec divides a table's gradient by the model-parallel group size
(its all-to-all backward averages, like DDP), and the replica sync / reduce-scatter averages
over replica groups, so every mode trains like one process on the **mean** of the per-rank
losses, ``(1/world) * sum_r loss_r``, each rank feeding its own batch.

torchrec's own ``DMPCollection`` is CUDA-only, so the 2D sharding environment is built here:
a ``ShardingEnv`` over the model-parallel group, the plan made for that group's size, the plan's
shard placements remapped to global ranks (what ``ShardedTensor`` checks). Row-wise sharding
and the dense (gradient-producing) compute kernel, which torchrec's planner only offers on CUDA,
are enabled on CPU too, so everything runs on gloo (tables with fewer rows than a row-wise split
needs are planned table- or column-wise there). fbgemm's CPU dense kernel ignores unpooled
lookups, so fully sharded 2D looks sequence rows up in PyTorch (:func:`_sequence_lookup`).
"""

from __future__ import annotations

import copy
import hashlib
import logging
import types
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import _remote_device
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed.device_mesh import DeviceMesh
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.batched_embedding_kernel import (
    BaseBatchedEmbedding,
    BaseBatchedEmbeddingBag,
)
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DataParallelWrapper
from torchrec.distributed.planner import EmbeddingShardingPlanner
from torchrec.distributed.planner import Topology as PlannerTopology
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.distributed.types import ShardingEnv, ShardingPlan, ShardingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

from gem_parallel.collectives import (
    COLLECTIVE_CHOICES,
    select_all_gather,
    select_reduce_scatter,
)
from gem_parallel.cost_model import SPARSE_MODES
from gem_parallel.mesh import GemMesh

__all__ = [
    "SHARDING_TYPES",
    "ShardedSparse",
    "SparseMemory",
    "format_memory_table",
    "shard_sparse",
    "sparse_memory_report",
]

CollectiveFn = Callable[[torch.Tensor, torch.Tensor, dist.ProcessGroup], torch.Tensor]

SHARDING_TYPES = ("table_wise", "row_wise", "column_wise")
_OPTIMIZER_KEY = "optimizer"
"""Per-table sharding types accepted in ``shard_sparse(..., sharding_types=...)``."""

# Optimizers that update each element from its own gradient only: applying them to a flat
# slice of the weights equals applying them to the whole table (fully sharded 2D needs this).
_ELEMENTWISE_OPTIMIZERS = (
    torch.optim.SGD,
    torch.optim.Adagrad,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.RMSprop,
)


@dataclass(frozen=True)
class SparseMemory:
    """Embedding bytes one rank holds under one sharding mode (see :meth:`ShardedSparse.memory`)."""

    mode: str
    """One of ``"1d"``, ``"2d"``, ``"fully_sharded_2d"``."""
    rank: int
    """Global rank."""
    weight_bytes: int
    """Bytes of embedding weights held between steps."""
    optimizer_bytes: int
    """Bytes of optimizer state held between steps."""
    transient_bytes: int = 0
    """Extra bytes allocated only inside a step (their peak, at the end of backward): for fully
    sharded 2D every gathered local shard and its dense gradient plus one kernel's padded
    reduce-scatter buffer (2-3x the 2D shard's weights); 0 for 1D / 2D, whose fused kernels apply
    row gradients inside the backward without materialising them."""

    @property
    def total_bytes(self) -> int:
        """Weights plus optimizer state (persistent)."""
        return self.weight_bytes + self.optimizer_bytes


class _GroupShardingEnv(ShardingEnv):
    """A ``ShardingEnv`` over a sub-group, without ``ShardingEnv.__init__``'s
    ``init_device_mesh`` (which only works for a group spanning the whole world)."""

    def __init__(self, group: dist.ProcessGroup, device_type: str) -> None:
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.process_group = group
        self.device_mesh = DeviceMesh.from_group(group, device_type)
        self.output_dtensor = False


class _AnyDeviceSharder(EmbeddingBagCollectionSharder):
    """EBC sharder offering table-, row- and column-wise sharding on every device.

    torchrec only offers row-wise sharding on CUDA, but its CPU path (fbgemm CPU bucketize +
    all-to-all) works. Data-parallel tables are excluded: they would need DDP, not this sync.
    """

    def sharding_types(self, compute_device_type: str) -> list[str]:
        return [
            ShardingType.TABLE_WISE.value,
            ShardingType.ROW_WISE.value,
            ShardingType.COLUMN_WISE.value,
            ShardingType.TABLE_COLUMN_WISE.value,
        ]

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        # The planner picks the fused kernel; fully sharded 2D switches the plan to "dense".
        return ["fused"]


class _AnyDeviceSequenceSharder(EmbeddingCollectionSharder):
    """The same for ``EmbeddingCollection`` (sequence embeddings: one row per id, no pooling);
    torchrec shards those table-, row- or column-wise (no table-column-wise)."""

    def sharding_types(self, compute_device_type: str) -> list[str]:
        return [
            ShardingType.TABLE_WISE.value,
            ShardingType.ROW_WISE.value,
            ShardingType.COLUMN_WISE.value,
        ]

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        return ["fused"]


def _sharders() -> list[Any]:
    return [_AnyDeviceSharder(), _AnyDeviceSequenceSharder()]


@contextmanager
def _quiet_planner() -> Iterator[None]:
    """The planner warns about hand-built topologies and dry-run estimates on every call."""
    logger = logging.getLogger("torchrec.distributed.planner")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


def _table_rows(module: nn.Module) -> dict[str, int]:
    """Rows of every (pooled or sequence) table of ``module``, by table name."""
    rows: dict[str, int] = {}
    for sub in module.modules():
        if isinstance(sub, EmbeddingBagCollection):
            rows.update({c.name: c.num_embeddings for c in sub.embedding_bag_configs()})
        elif isinstance(sub, EmbeddingCollection):
            rows.update({c.name: c.num_embeddings for c in sub.embedding_configs()})
    return rows


def _table_names(module: nn.Module) -> list[str]:
    return list(_table_rows(module))


def _table_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The weights of every (pooled or sequence) embedding table of ``module``."""
    params: list[nn.Parameter] = []
    for sub in module.modules():
        if isinstance(sub, EmbeddingBagCollection | EmbeddingCollection):
            params += list(sub.parameters())
    return params


def _plan(
    module: nn.Module,
    group: dist.ProcessGroup,
    device: torch.device,
    sharding_types: dict[str, str] | None,
    compute_kernel: str,
) -> tuple[ShardingPlan, str]:
    """Plan for the group's size, then remap shard placements to global ranks.

    Returns the plan and a fingerprint of it taken before the remap."""
    group_size = dist.get_world_size(group)
    constraints = {
        name: ParameterConstraints(sharding_types=[kind], compute_kernels=["fused"])
        for name, kind in (sharding_types or {}).items()
    }
    if device.type == "cpu":
        # Tables too small to give every rank a row are never offered row-wise on CPU
        # (fbgemm's CPU kernels cannot run an empty shard); asked-for row-wise still fails.
        for name, rows in _table_rows(module).items():
            if name not in constraints and (group_size - 1) * -(-rows // group_size) >= rows:
                constraints[name] = ParameterConstraints(
                    sharding_types=[ShardingType.TABLE_WISE.value, ShardingType.COLUMN_WISE.value],
                    compute_kernels=["fused"],
                )
    planner = EmbeddingShardingPlanner(
        topology=PlannerTopology(
            world_size=group_size, local_world_size=group_size, compute_device=device.type
        ),
        constraints=constraints,
    )
    with _quiet_planner():
        plan = planner.plan(module, _sharders())
    # Fingerprint in group-local ranks, before the remap: equal across replica groups.
    digest = hashlib.sha256(str(plan).encode()).hexdigest()
    global_ranks = dist.get_process_group_ranks(group)
    for module_plan in plan.plan.values():
        for name, param_sharding in module_plan.items():  # type: ignore[union-attr]
            shards = param_sharding.sharding_spec.shards  # type: ignore[union-attr]
            if device.type == "cpu" and any(s.shard_sizes[0] == 0 for s in shards):
                # fbgemm's CPU kernels dispatch an empty table to the CUDA kernel and fail.
                raise ValueError(
                    f"row-wise sharding of table {name!r} over {group_size} ranks leaves a rank "
                    "without rows, which fbgemm's CPU kernels cannot run: give it at least "
                    f"{group_size - 1} * ceil(rows / {group_size}) + 1 rows or shard it "
                    "table_wise (sharding_types)"
                )
            param_sharding.compute_kernel = compute_kernel
            for shard in param_sharding.sharding_spec.shards:  # type: ignore[union-attr]
                local = shard.placement.rank()
                # ShardedTensor checks placements against global ranks; torchrec's own
                # ranks (param_sharding.ranks) stay group-local.
                rank = global_ranks[local]
                # One process per GPU, ranks filling hosts in order (as torchrun starts them).
                where = (
                    f"cuda:{rank % torch.cuda.device_count()}"
                    if device.type == "cuda"
                    else device.type
                )
                shard.placement = _remote_device(f"rank:{rank}/{where}")
    return plan, digest


def _embedding_kernels(module: nn.Module) -> list[BaseBatchedEmbeddingBag | BaseBatchedEmbedding]:
    """The table-batched kernels (pooled and sequence) holding this rank's shards, in a
    rank-independent order.

    Sharded modules keep their lookups in a plain list (not registered submodules)."""
    kinds = (BaseBatchedEmbeddingBag, BaseBatchedEmbedding)
    kernels: list[BaseBatchedEmbeddingBag | BaseBatchedEmbedding] = []
    for sub in module.modules():
        for lookup in getattr(sub, "_lookups", None) or []:
            kernels += [m for m in lookup.modules() if isinstance(m, kinds)]
    return kernels


def _sequence_lookup(
    emb_module: nn.Module,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None = None,
    **unused: Any,
) -> torch.Tensor:
    """Unpooled lookup of a dense table-batched kernel: one row per id, ``(ids, D)``.

    fbgemm's CPU dense kernel ignores ``PoolingMode.NONE`` (it returns pooled ``(B, sum D)``,
    which torchrec then reads as ``(ids, D)`` past its end), so sequence tables under fully
    sharded 2D look their rows up here, from the flat weights: autograd then produces the same
    dense weight gradient as the kernel would.
    """
    if per_sample_weights is not None:
        raise ValueError("sequence embeddings take no per-sample weights")
    dims = emb_module.D_offsets.diff()
    dim = int(dims[0]) if dims.numel() else 0
    if dims.numel() and not bool((dims == dim).all()):
        raise ValueError(f"a sequence kernel's features must share one dim, got {dims.tolist()}")
    features = emb_module.weights_offsets.numel()
    batch = (offsets.numel() - 1) // max(features, 1)
    if batch == 0:
        return emb_module.weights.new_zeros(0, dim)
    # Offsets are feature-major: feature f's ids are offsets[f * batch] .. offsets[(f+1) * batch].
    ids_per_feature = offsets[::batch][: features + 1].diff().long()
    base = torch.repeat_interleave(emb_module.weights_offsets, ids_per_feature)
    first = base + indices.long() * dim
    flat = first.unsqueeze(1) + torch.arange(dim, device=indices.device)
    return emb_module.weights[flat]


def _float_tensors(states: Any) -> list[torch.Tensor]:
    flat: list[torch.Tensor] = []
    if isinstance(states, torch.Tensor):
        if states.is_floating_point() and states.numel() > 0:
            flat.append(states)
    elif isinstance(states, list | tuple):
        for state in states:
            flat += _float_tensors(state)
    return flat


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class _FlatSlice:
    """One dense TBE's flat weights, of which this rank owns slice ``index`` of ``R``."""

    def __init__(
        self,
        weights: nn.Parameter,
        group: dist.ProcessGroup,
        all_gather: CollectiveFn,
        reduce_scatter: CollectiveFn,
    ) -> None:
        self.weights = weights
        self.group = group
        self.all_gather = all_gather
        self.reduce_scatter = reduce_scatter
        self.replicas = dist.get_world_size(group)
        self.index = dist.get_rank(group)
        self.numel = weights.numel()
        self.chunk = -(-self.numel // self.replicas)  # ceil: the last slice may hold padding
        self.full_nbytes = weights.untyped_storage().nbytes()
        start = min(self.index * self.chunk, self.numel)
        stop = min(start + self.chunk, self.numel)
        owned = torch.zeros(self.chunk, dtype=weights.dtype, device=weights.device)
        owned[: stop - start] = weights.detach().view(-1)[start:stop]
        self.owned = nn.Parameter(owned)
        self.materialized = True

    def refresh_owned(self) -> None:
        """Copy this rank's slice out of the materialized full weights (after a load)."""
        start = min(self.index * self.chunk, self.numel)
        stop = min(start + self.chunk, self.numel)
        with torch.no_grad():
            self.owned.zero_()
            self.owned[: stop - start] = self.weights.detach().view(-1)[start:stop]

    def unshard(self) -> None:
        if self.materialized:
            return
        self.weights.untyped_storage().resize_(self.full_nbytes)
        gathered = torch.empty(
            self.chunk * self.replicas, dtype=self.owned.dtype, device=self.owned.device
        )
        self.all_gather(gathered, self.owned.detach(), self.group)
        with torch.no_grad():
            self.weights.view(-1).copy_(gathered[: self.numel])
        self.materialized = True

    def reshard(self) -> None:
        if not self.materialized:
            return
        self.weights.grad = None
        self.weights.untyped_storage().resize_(0)
        self.materialized = False

    def reduce_scatter_grad(self) -> None:
        """Average the full-shard gradient over the replica group into ``owned.grad``."""
        padded = torch.zeros(
            self.chunk * self.replicas, dtype=self.owned.dtype, device=self.owned.device
        )
        if self.weights.grad is not None:
            padded[: self.numel] = self.weights.grad.view(-1)
        owned_grad = torch.empty_like(self.owned)
        self.reduce_scatter(owned_grad, padded, self.group)  # sum
        owned_grad /= self.replicas
        self.owned.grad = owned_grad
        self.weights.grad = None


class ShardedSparse(nn.Module):
    """Embedding module sharded by :func:`shard_sparse`; call ``step()`` after each backward.

    ``forward`` takes what the wrapped module takes (a ``KeyedJaggedTensor`` of this rank's
    batch for an ``EmbeddingBagCollection``) and returns its output for that batch.
    """

    def __init__(
        self,
        module: DistributedModelParallel,
        *,
        mode: str,
        replica_group: dist.ProcessGroup | None,
        sync_every: int,
        optimizer_class: type[torch.optim.Optimizer],
        optimizer_kwargs: dict[str, Any],
        collectives: str = "auto",
    ) -> None:
        super().__init__()
        self.module = module
        self.mode = mode
        self.replica_group = replica_group
        self.sync_every = sync_every
        self.steps = 0
        self._kernels = _embedding_kernels(module)
        self._slices: list[_FlatSlice] = []
        self.slice_optimizer: torch.optim.Optimizer | None = None
        self.collective_choices: dict[str, str] = {}
        self._gathered_states: list[torch.Tensor] = []  # FS-2D optimizer state, while saving
        """Fully sharded 2D: which all-gather / reduce-scatter was picked, and why."""
        if mode == "fully_sharded_2d":
            assert replica_group is not None
            # Copy-engine (SM-free) collectives where available, else NCCL / gloo; logged.
            all_gather, gather_reason = select_all_gather(replica_group, prefer=collectives)
            scatter, scatter_reason = select_reduce_scatter(replica_group, prefer=collectives)
            self.collective_choices = {
                "all_gather": gather_reason,
                "reduce_scatter": scatter_reason,
            }
            self._slices = [
                _FlatSlice(k.emb_module.weights, replica_group, all_gather, scatter)
                for k in self._kernels
            ]
            for kernel in self._kernels:
                if isinstance(kernel, BaseBatchedEmbedding):
                    kernel.emb_module.forward = types.MethodType(
                        _sequence_lookup, kernel.emb_module
                    )
            if issubclass(optimizer_class, RowWiseAdagrad):
                layouts = [_table_layout(k) for k in self._kernels]
                self.slice_optimizer = _FlatRowWiseAdagrad(
                    self._slices, layouts, **optimizer_kwargs
                )
            else:
                self.slice_optimizer = optimizer_class(
                    [s.owned for s in self._slices], **optimizer_kwargs
                )
            self.reshard()

    @property
    def plan(self) -> ShardingPlan:
        """The torchrec sharding plan (shard placements in global ranks)."""
        return self.module.plan

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Look up this rank's batch. Fully sharded 2D gathers its shards first and keeps them
        until :meth:`step` (or :meth:`reshard`, e.g. after evaluation)."""
        self.before_forward()
        out = self.module(*args, **kwargs)
        return out.wait() if hasattr(out, "wait") else out

    def before_forward(self) -> None:
        """What :meth:`forward` does before calling the module (for callers that call
        ``.module`` directly): fully sharded 2D unshards."""
        self.unshard()

    def unshard(self) -> None:
        """Fully sharded 2D: all-gather each local shard over the replica group (no-op
        otherwise or when already gathered)."""
        for flat in self._slices:
            flat.unshard()

    def reshard(self) -> None:
        """Fully sharded 2D: free the gathered local shards, keeping only the owned slices."""
        for flat in self._slices:
            flat.reshard()

    def step(self) -> None:
        """Call once after each ``backward``.

        ``"1d"``: nothing (the fused optimizer already ran in backward). ``"2d"``: every
        ``sync_every`` calls, :meth:`sync`. ``"fully_sharded_2d"``: reduce-scatter the
        gradients, update the owned slices, free the gathered shards.
        """
        self.steps += 1
        if self.mode == "2d" and self.steps % self.sync_every == 0:
            self.sync()
        elif self.mode == "fully_sharded_2d":
            assert self.slice_optimizer is not None
            for flat in self._slices:
                flat.reduce_scatter_grad()
                flat.reshard()  # free this kernel's shard and gradient before the next one's
            self.slice_optimizer.step()
            self.slice_optimizer.zero_grad(set_to_none=True)

    def _fused_tensors(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        weights: list[torch.Tensor] = []
        states: list[torch.Tensor] = []
        for kernel in self._kernels:
            emb = kernel.emb_module
            weights += list(emb.split_embedding_weights())
            with suppress(NotImplementedError):  # no optimizer attached
                states += _float_tensors(emb.split_optimizer_states())
        return weights, states

    @torch.no_grad()
    def sync(self) -> None:
        """``"2d"``: average every local shard's weights and optimizer state over the replica
        group (collective over it). Other modes: nothing to do."""
        if self.mode != "2d" or self.replica_group is None:
            return
        replicas = dist.get_world_size(self.replica_group)
        if replicas == 1:
            return
        weights, states = self._fused_tensors()
        tensors = weights + states
        # SUM then divide: gloo has no ReduceOp.AVG. The tensors are views into the TBE
        # storage, so the in-place all-reduce updates the live weights and state.
        works = [dist.all_reduce(t, group=self.replica_group, async_op=True) for t in tensors]
        for work, tensor in zip(works, tensors, strict=True):
            work.wait()
            tensor.div_(replicas)

    def memory(self) -> SparseMemory:
        """This rank's persistent embedding bytes (weights and optimizer state)."""
        if self.mode == "fully_sharded_2d":
            assert self.slice_optimizer is not None
            weight_bytes = _nbytes([s.owned for s in self._slices])
            # Peak at the end of backward: every gathered shard and its dense gradient, plus
            # one kernel's padded reduce-scatter buffer (reduced and freed in turn).
            transient = sum(2 * s.numel * s.owned.element_size() for s in self._slices) + max(
                (s.chunk * s.replicas * s.owned.element_size() for s in self._slices),
                default=0,
            )
            optimizer_bytes = 0
            for state in self.slice_optimizer.state.values():
                optimizer_bytes += _nbytes([t for t in state.values() if torch.is_tensor(t)])
        else:
            weights, states = self._fused_tensors()
            weight_bytes, optimizer_bytes = _nbytes(weights), _nbytes(states)
            transient = 0
        return SparseMemory(self.mode, dist.get_rank(), weight_bytes, optimizer_bytes, transient)

    def sharded_state_dict(self, *, include_optimizer: bool = False) -> dict[str, Any]:
        """Table weights as ``ShardedTensor`` (global table shapes): pass to
        ``torch.distributed.checkpoint.save`` / ``load``; loadable under any mode and world.

        The values are views of the live weights. Fully sharded 2D gathers its shards first and
        keeps them until the next :meth:`step` or :meth:`reshard`.

        With ``include_optimizer``, key ``"optimizer"`` holds the optimizer state in torchrec's
        fused-optimizer layout, ``{weight key: {"<table>.momentum1": ShardedTensor, ...}}``,
        the same under every mode: 1D / 2D return torchrec's fused state (views of the live
        state); fully sharded 2D gathers its slices' state like the weights (Adagrad's ``sum``
        as ``momentum1``; plain SGD has none; other optimizers raise ``NotImplementedError``).
        """
        self.unshard()
        state = dict(self.module.state_dict())
        if include_optimizer:
            state[_OPTIMIZER_KEY] = self._optimizer_state()
        return state

    def _slice_state_name(self) -> str | None:
        """The torch optimizer state entry that maps to torchrec's ``momentum1``, if any."""
        assert self.slice_optimizer is not None
        optimizer = self.slice_optimizer
        if isinstance(optimizer, torch.optim.Adagrad | _FlatRowWiseAdagrad):
            return "sum"
        if isinstance(optimizer, torch.optim.SGD) and all(
            group.get("momentum", 0) == 0 for group in optimizer.param_groups
        ):
            return None
        raise NotImplementedError(
            f"checkpointing {type(optimizer).__name__} state under fully_sharded_2d is not "
            "supported (Adagrad and SGD without momentum are)"
        )

    def _locate(self, tensor: torch.Tensor) -> tuple[int, int]:
        """Which flat slice's weights ``tensor`` views, and at which element offset."""
        for index, flat in enumerate(self._slices):
            if tensor.untyped_storage().data_ptr() == flat.weights.untyped_storage().data_ptr():
                return index, tensor.storage_offset() - flat.weights.storage_offset()
        raise RuntimeError("a table shard is not a view of any fully sharded kernel's weights")

    def _optimizer_state(self) -> dict[str, Any]:
        if self.mode != "fully_sharded_2d":
            return dict(self.module.fused_optimizer.state_dict()["state"])
        assert self.slice_optimizer is not None
        name = self._slice_state_name()
        self._gathered_states = []
        if name is None:
            return {}
        for flat in self._slices:
            owned_state = self.slice_optimizer.state[flat.owned][name]
            gathered = torch.empty(
                flat.chunk * flat.replicas, dtype=owned_state.dtype, device=owned_state.device
            )
            flat.all_gather(gathered, owned_state.detach().contiguous(), flat.group)
            self._gathered_states.append(gathered)
        optimizer_state: dict[str, Any] = {}
        for key, weight in self.module.state_dict().items():
            if not isinstance(weight, ShardedTensor):
                continue
            shards = []
            for shard in weight.local_shards():
                index, offset = self._locate(shard.tensor)
                view = self._gathered_states[index][offset : offset + shard.tensor.numel()]
                shards.append(Shard(view.view(shard.tensor.shape), shard.metadata))
            metadata = copy.deepcopy(weight.metadata())
            metadata.tensor_properties.requires_grad = False
            table = key.split(".")[-2]
            optimizer_state[key] = {
                f"{table}.momentum1": ShardedTensor._init_from_local_shards_and_global_metadata(
                    shards, metadata, process_group=weight._process_group
                )
            }
        return optimizer_state

    @torch.no_grad()
    def load_sharded_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Copy weights (and, when ``state_dict`` has ``"optimizer"``, optimizer state) from
        ``state_dict`` (e.g. filled by ``dcp.load`` from :meth:`sharded_state_dict`) into the
        live shards; fully sharded 2D then re-slices both."""
        include_optimizer = _OPTIMIZER_KEY in state_dict
        current = self.sharded_state_dict(include_optimizer=include_optimizer)
        _copy_state(current, state_dict, "state_dict")
        if include_optimizer and self.mode == "fully_sharded_2d":
            name = self._slice_state_name()
            if name is not None:
                assert self.slice_optimizer is not None
                for flat, gathered in zip(self._slices, self._gathered_states, strict=True):
                    mine = gathered[flat.index * flat.chunk : (flat.index + 1) * flat.chunk]
                    self.slice_optimizer.state[flat.owned][name].copy_(mine)
        self._gathered_states = []
        for flat in self._slices:
            flat.refresh_owned()
        self.reshard()


def _copy_state(target: dict[str, Any], source: dict[str, Any], where: str) -> None:
    """Copy ``source`` into ``target``'s tensors (nested dicts, ``ShardedTensor`` local shards)."""
    missing = sorted(set(target) - set(source))
    if missing:
        raise ValueError(f"{where} is missing keys {missing}")
    for key, dst in target.items():
        src = source[key]
        if isinstance(dst, dict):
            if not isinstance(src, dict):
                raise TypeError(f"{where}[{key!r}] must be a dict")
            _copy_state(dst, src, f"{where}[{key!r}]")
        elif isinstance(dst, ShardedTensor):
            if not isinstance(src, ShardedTensor):
                raise TypeError(f"{where}[{key!r}] must be a ShardedTensor")
            for mine, theirs in zip(dst.local_shards(), src.local_shards(), strict=True):
                if mine.tensor.data_ptr() != theirs.tensor.data_ptr():
                    mine.tensor.copy_(theirs.tensor)
        elif torch.is_tensor(dst) and dst.data_ptr() != src.data_ptr():
            dst.copy_(src)


class _FlatRowWiseAdagrad(torch.optim.Optimizer):
    """Row-wise Adagrad (torchrec's ``RowWiseAdagrad``, fbgemm's exact row-wise Adagrad) on the
    owned flat slices of fully sharded 2D.

    Per row: ``sum += mean(g**2)`` over the row's columns, ``w -= lr * g / (sqrt(sum) + eps)``.
    A slice starts and ends anywhere inside a row, so each rank sums ``g**2`` over its part of
    every row and the per-row sums (one float per row, ``1/dim`` of the gradient) are
    all-reduced over the replica group. The state ``"sum"`` is kept per element (every element
    of a row holds the row's value) so it is sliced, gathered and checkpointed like Adagrad's.
    """

    def __init__(
        self,
        slices: list[_FlatSlice],
        tables: list[list[tuple[int, int, int]]],
        lr: float = 0.01,
        eps: float = 1e-10,
        weight_decay: float = 0.0,
        lr_decay: float = 0.0,
        initial_accumulator_value: float = 0.0,
        **unused: Any,
    ) -> None:
        if weight_decay != 0.0 or lr_decay != 0.0:
            raise ValueError(
                "optimizer=RowWiseAdagrad under mode='fully_sharded_2d' supports weight_decay=0 "
                f"and lr_decay=0 only, got weight_decay={weight_decay}, lr_decay={lr_decay}"
            )
        super().__init__([s.owned for s in slices], {"lr": lr, "eps": eps})
        self._slices = slices
        # Per slice: (start in slice, stop in slice, first row, row count, dim, lead) pieces
        # of the tables its owned range covers, and the slice's total rows.
        self._pieces: list[list[tuple[int, int, int, int, int, int]]] = []
        self._rows: list[int] = []
        for flat, layout in zip(slices, tables, strict=True):
            start = flat.index * flat.chunk
            stop = start + flat.chunk
            pieces = []
            row_base = 0
            for offset, rows, dim in layout:
                low, high = max(offset, start), min(offset + rows * dim, stop)
                if low < high:
                    first = (low - offset) // dim
                    last = (high - 1 - offset) // dim + 1
                    lead = low - offset - first * dim
                    pieces.append(
                        (low - start, high - start, row_base + first, last - first, dim, lead)
                    )
                row_base += rows
            self._pieces.append(pieces)
            self._rows.append(row_base)
        for flat in slices:
            self.state[flat.owned]["sum"] = torch.full_like(
                flat.owned, initial_accumulator_value, memory_format=torch.preserve_format
            )

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        group = self.param_groups[0]
        for flat, pieces, rows in zip(self._slices, self._pieces, self._rows, strict=True):
            grad = flat.owned.grad
            if grad is None:
                continue
            row_squares = torch.zeros(rows, dtype=grad.dtype, device=grad.device)
            for low, high, first, count, dim, lead in pieces:
                padded = grad.new_zeros(count * dim)
                padded[lead : lead + high - low] = grad[low:high]
                row_squares[first : first + count] += padded.view(count, dim).square().sum(1)
            if flat.replicas > 1:
                dist.all_reduce(row_squares, group=flat.group)
            increment = torch.zeros_like(grad)
            for low, high, first, count, dim, lead in pieces:
                means = (row_squares[first : first + count] / dim).repeat_interleave(dim)
                increment[low:high] = means[lead : lead + high - low]
            state = self.state[flat.owned]["sum"]
            state.add_(increment)
            flat.owned.addcdiv_(grad, state.sqrt().add_(group["eps"]), value=-group["lr"])


def _table_layout(kernel: nn.Module) -> list[tuple[int, int, int]]:
    """``(flat offset, rows, dim)`` of each table in a dense kernel's flat weights."""
    layout = []
    offset = 0
    for rows, dim in zip(kernel._local_rows, kernel._local_cols, strict=True):
        layout.append((offset, rows, dim))
        offset += rows * dim
    expected = sorted({int(o) for o in kernel.emb_module.weights_offsets.tolist()})
    if [o for o, rows, dim in layout if rows * dim] != [o for o in expected if o < offset] or (
        offset != kernel.emb_module.weights.numel()
    ):
        raise RuntimeError("unexpected table layout in a dense table-batched embedding kernel")
    return layout


def _check_args(
    module: object,
    mesh: object,
    mode: object,
    sync_every: object,
    optimizer_class: object,
    sharding_types: object,
) -> None:
    if mode not in SPARSE_MODES:
        raise ValueError(f"mode must be one of {SPARSE_MODES}, got {mode!r}")
    if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every <= 0:
        raise ValueError(f"sync_every must be a positive int, got {sync_every!r}")
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
    tables = _table_names(module)
    if not tables:
        raise ValueError(
            "module must contain at least one torchrec EmbeddingBagCollection or "
            "EmbeddingCollection"
        )
    if not (
        isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)
    ):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer class, got {optimizer_class!r}")
    if mode == "fully_sharded_2d" and not issubclass(
        optimizer_class, (*_ELEMENTWISE_OPTIMIZERS, RowWiseAdagrad)
    ):
        names = ", ".join(o.__name__ for o in _ELEMENTWISE_OPTIMIZERS)
        raise ValueError(
            f"mode='fully_sharded_2d' updates flat weight slices, so optimizer must be "
            f"element-wise ({names}) or torchrec's RowWiseAdagrad, got {optimizer_class.__name__}"
        )
    if mode != "1d" and not isinstance(mesh, GemMesh | DeviceMesh):
        raise TypeError(
            f"mode={mode!r} needs mesh to be a GemMesh or a 2-D DeviceMesh, "
            f"got {type(mesh).__name__}"
        )
    if isinstance(mesh, DeviceMesh):
        names = tuple(mesh.mesh_dim_names or ())
        if sorted(names) != ["model_parallel", "sparse_replica"]:
            raise ValueError(
                "a DeviceMesh mesh must have exactly the dims ('sparse_replica', "
                f"'model_parallel'), got {names}"
            )
    if sharding_types is not None:
        if not isinstance(sharding_types, dict):
            raise TypeError("sharding_types must be a dict of table name -> sharding type")
        for name, kind in sharding_types.items():
            if name not in tables:
                raise ValueError(f"sharding_types names unknown table {name!r}; tables: {tables}")
            if kind not in SHARDING_TYPES:
                raise ValueError(
                    f"sharding_types[{name!r}] must be one of {SHARDING_TYPES}, got {kind!r}"
                )
    for param in module.parameters():
        if hasattr(param, "_in_backward_optimizers"):
            raise ValueError(
                "module already has in-backward optimizers applied; pass the optimizer to "
                "shard_sparse instead"
            )


def _check_same_plan(digest: str, replica_group: dist.ProcessGroup) -> None:
    """Replicas must shard identically for the replica collectives to pair up."""
    digests: list[str | None] = [None] * dist.get_world_size(replica_group)
    dist.all_gather_object(digests, digest, group=replica_group)
    if len(set(digests)) != 1:
        raise RuntimeError("model-parallel groups planned different shardings; replicas differ")


def shard_sparse(
    module: nn.Module,
    mesh: GemMesh | DeviceMesh | None,
    mode: str = "2d",
    *,
    optimizer: type[torch.optim.Optimizer] = torch.optim.SGD,
    optimizer_kwargs: dict[str, Any] | None = None,
    sharding_types: dict[str, str] | None = None,
    sync_every: int = 1,
    device: torch.device | str | None = None,
    collectives: str = "auto",
    data_parallel_wrapper: DataParallelWrapper | None = None,
) -> ShardedSparse:
    """Shard the torchrec embedding tables of ``module`` as ``mode`` over ``mesh``.

    Collective: call on every rank with the same arguments after ``init_process_group``.

    Args:
        module: an ``EmbeddingBagCollection`` (or a module containing some). Its current
            weights are copied into the shards (a ``meta`` module gets torchrec's init,
            made equal across replicas). The module is consumed: use the returned wrapper.
        mesh: the :class:`GemMesh`; tables are sharded over ``mesh.model_parallel_group``
            and replicated over ``mesh.sparse_replica_group``. ``"1d"`` ignores it (shards over
            the whole world) and accepts ``None``. A 2-D ``DeviceMesh`` with dims
            ``("sparse_replica", "model_parallel")`` (any rank order) is accepted too, e.g. to
            put the replica dimension, over which fully sharded 2D all-gathers every step, on
            contiguous ranks (the fastest tier) instead of GemMesh's strided layout.
        mode: ``"1d"``, ``"2d"`` or ``"fully_sharded_2d"`` (see the module docstring).
        optimizer: ``torch.optim`` class for the tables (fused into torchrec's TBE for 1D / 2D,
            e.g. SGD, Adagrad, Adam, ``torchrec.optim.RowWiseAdagrad``; element-wise only for
            fully sharded 2D). ``optimizer_kwargs`` are its arguments (``lr`` ...).
        sharding_types: optional ``{table name: "table_wise" | "row_wise" | "column_wise"}``;
            tables not named are left to torchrec's planner.
        sync_every: ``"2d"`` only: steps between replica syncs of weights and optimizer state.
        device: where the shards live (default CPU).
        collectives: fully sharded 2D only: ``"auto"`` (copy-engine all-gather / reduce-scatter
            when :func:`~gem_parallel.copy_engine_status` allows, else the backend's),
            ``"copy_engine"`` (same, warning when unavailable) or ``"nccl"`` (the backend's);
            see :func:`~gem_parallel.select_all_gather`.
        data_parallel_wrapper: when ``module`` also holds dense layers (a whole model), the
            torchrec ``DataParallelWrapper`` that DMP applies to them after sharding the
            tables. DMP hands it the *model-parallel* group's ``ShardingEnv``; a wrapper that
            must span all ranks (DDP) has to bring its own group. None: dense layers are left
            as they are.
    """
    _check_args(module, mesh, mode, sync_every, optimizer, sharding_types)
    if collectives not in COLLECTIVE_CHOICES:
        raise ValueError(f"collectives must be one of {COLLECTIVE_CHOICES}, got {collectives!r}")
    kwargs = dict(optimizer_kwargs or {})
    device = torch.device(device if device is not None else "cpu")
    if mode == "1d":
        model_parallel_group = dist.group.WORLD
        replica_group = None
    else:
        sparse_mesh = mesh.sparse if isinstance(mesh, GemMesh) else mesh
        assert isinstance(sparse_mesh, DeviceMesh)
        model_parallel_group = sparse_mesh.get_group("model_parallel")
        replica_group = sparse_mesh.get_group("sparse_replica")
    assert model_parallel_group is not None

    on_meta = any(p.is_meta for p in module.parameters())
    # References (no copy): sharding builds new storage, the originals stay untouched.
    original = {k: v.detach() for k, v in module.state_dict().items()} if not on_meta else {}

    fully_sharded = mode == "fully_sharded_2d"
    table_params = _table_parameters(module)
    if not fully_sharded:
        apply_optimizer_in_backward(optimizer, table_params, kwargs)
    plan, digest = _plan(
        module,
        model_parallel_group,
        device,
        sharding_types,
        compute_kernel="dense" if fully_sharded else "fused",
    )
    if replica_group is not None:
        _check_same_plan(digest, replica_group)
    with _quiet_planner():
        sharded = DistributedModelParallel(
            module,
            env=_GroupShardingEnv(model_parallel_group, device.type),
            device=device,
            plan=plan,
            sharders=_sharders(),
            init_data_parallel=data_parallel_wrapper is not None,
            data_parallel_wrapper=data_parallel_wrapper,
        )
    with torch.no_grad():
        for key, value in sharded.state_dict().items():
            if key in original and isinstance(value, ShardedTensor):
                full = original[key]
                for shard in value.local_shards():
                    (r0, c0), (rows, cols) = (
                        shard.metadata.shard_offsets,
                        shard.metadata.shard_sizes,
                    )
                    shard.tensor.copy_(full[r0 : r0 + rows, c0 : c0 + cols])
        if on_meta and replica_group is not None:
            first = dist.get_process_group_ranks(replica_group)[0]
            for value in sharded.state_dict().values():
                if isinstance(value, ShardedTensor):
                    for shard in value.local_shards():
                        dist.broadcast(shard.tensor, src=first, group=replica_group)
    return ShardedSparse(
        sharded,
        mode=mode,
        replica_group=replica_group,
        sync_every=sync_every,
        optimizer_class=optimizer,
        optimizer_kwargs=kwargs,
        collectives=collectives,
    )


def sparse_memory_report(
    module: nn.Module,
    mesh: GemMesh | DeviceMesh,
    *,
    modes: tuple[str, ...] = SPARSE_MODES,
    optimizer: type[torch.optim.Optimizer] = torch.optim.Adagrad,
    optimizer_kwargs: dict[str, Any] | None = None,
    sharding_types: dict[str, str] | None = None,
) -> list[SparseMemory]:
    """Shard a copy of ``module`` under each of ``modes`` and measure every rank's persistent
    embedding bytes (weights + optimizer state). Collective; every rank gets all rows, ordered
    by mode then rank."""
    if not isinstance(modes, tuple | list) or any(m not in SPARSE_MODES for m in modes):
        raise ValueError(f"modes must be a sequence of {SPARSE_MODES}, got {modes!r}")
    rows: list[SparseMemory] = []
    for mode in modes:
        sharded = shard_sparse(
            copy.deepcopy(module),
            mesh,
            mode,
            optimizer=optimizer,
            optimizer_kwargs=optimizer_kwargs,
            sharding_types=sharding_types,
        )
        gathered: list[SparseMemory | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, sharded.memory())
        rows += [row for row in gathered if row is not None]
        del sharded
    return rows


def format_memory_table(rows: list[SparseMemory]) -> str:
    """A per-rank table (MiB) of weights, optimizer state and total, one column group per mode,
    plus the max over ranks."""
    modes = list(dict.fromkeys(r.mode for r in rows))
    ranks = sorted({r.rank for r in rows})
    by_key = {(r.mode, r.rank): r for r in rows}
    mib = 1024.0 * 1024.0
    width = 2 + max(len(m) for m in modes) + len(" (w/opt/total MiB)")
    header = f"{'rank':>6}" + "".join(f"{m + ' (w/opt/total MiB)':>{width}}" for m in modes)
    lines = [header]

    def cell(row: SparseMemory | None) -> str:
        if row is None:
            return f"{'-':>{width}}"
        text = f"{row.weight_bytes / mib:.2f}/{row.optimizer_bytes / mib:.2f}/"
        return f"{text + f'{row.total_bytes / mib:.2f}':>{width}}"

    for rank in ranks:
        lines.append(f"{rank:>6}" + "".join(cell(by_key.get((m, rank))) for m in modes))
    maxima = []
    for mode in modes:
        mode_rows = [r for r in rows if r.mode == mode]
        maxima.append(f"{max(r.total_bytes for r in mode_rows) / mib:>{width}.2f}")
    lines.append(f"{'max':>6}" + "".join(maxima))
    return "\n".join(lines)
