"""Dense parallelism of the trainer (``TrainConfig.parallel``) around torchrec's DMP.

torchrec's ``DistributedModelParallel`` shards the embedding tables and, by default, wraps the
rest of the model in DDP. :class:`DenseParallel` decides what happens to that dense rest:

* ``dense="ddp"``: torchrec's DDP wrapper with buckets fixed at construction (so that resume
  is exact), minus the expert parameters when expert parallelism is on.
* ``dense="fsdp"``: a ``DataParallelWrapper`` that applies FSDP2 (``gem_parallel.apply_fsdp``)
  over the ``(replicate, shard)`` dense mesh instead of DDP. The sharded tables and the expert
  parameters are left out (``ignored_params``).
* ``expert_parallel > 1``: before DMP, every DHEN layer is replaced by
  :class:`ExpertParallelDHENLayer`, which keeps only this rank's experts and runs them through
  ``gem_parallel.ExpertParallel`` over the expert group.

Checkpoint names do not depend on the layout: a local expert keeps its global index in its
parameter names (``interaction.0.experts.2.…`` on whichever rank owns expert 2), FSDP2 keeps
the plain names and stores DTensors, so DCP can load a checkpoint into any other layout.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any

import torch
import torch.distributed as dist
from gem_model.dhen import DHENLayer
from gem_parallel import (
    ExpertParallel,
    GemMesh,
    ParallelLayout,
    ShardedSparse,
    apply_fsdp,
    build_gem_mesh,
    default_topology,
    shard_sparse,
    validate_layout,
)
from gem_parallel import Topology as LayoutTopology
from gem_precision import enable_mx_all_gather
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torchrec import EmbeddingBagCollection, EmbeddingCollection
from torchrec.distributed.comm import get_local_size
from torchrec.distributed.model_parallel import (
    DataParallelWrapper,
    DefaultDataParallelWrapper,
    DistributedModelParallel,
)
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.sharding_plan import (
    construct_module_sharding_plan,
    get_default_sharders,
    row_wise,
    table_wise,
)
from torchrec.distributed.types import ShardedModule, ShardingEnv, ShardingPlan, ShardingType
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

from gem_train.config import ParallelConfig

__all__ = [
    "ROW_WISE_MIN_ROWS",
    "DenseParallel",
    "ExpertParallelDHENLayer",
    "FSDPWrapper",
    "SparseParallel",
    "fsdp_blocks",
    "mx_all_gather_layers",
    "row_wise_plan",
]

_LOG = logging.getLogger(__name__)

_MX_BLOCK = 32  # gem-precision's MX block along in_features

ROW_WISE_MIN_ROWS = 100_000
"""Pooled tables with at least this many rows go row-wise in :func:`row_wise_plan`."""


class _ExpertsByGlobalIndex(nn.Module):
    """This rank's experts of one layer, registered under their global indices ("0", "2"...)
    so that their parameter names match the unsplit layer's on every rank."""

    def __init__(self, experts: list[nn.Module], indices: tuple[int, ...]) -> None:
        super().__init__()
        for index, expert in zip(indices, experts, strict=True):
            self.add_module(str(index), expert)

    def __iter__(self):
        return iter(self._modules.values())

    def __len__(self) -> int:
        return len(self._modules)


class ExpertParallelDHENLayer(nn.Module):
    """A ``DHENLayer`` whose experts are split over an expert-parallel group.

    Computes ``x + sum_e expert_e(norm(x))`` like the layer it replaces: each rank runs its own
    experts on the group's gathered batch (``gem_parallel.ExpertParallel``). Holds the original
    ``norm`` and the local experts (as ``experts.<global index>``).

    With ``uniform_train_batch`` (an attribute too), training-mode calls assume every rank of
    the group passes the same batch size and skip the per-call size exchange, which would
    otherwise sync the host with the GPU once per layer; eval-mode calls always exchange sizes
    (evaluation batches may differ between ranks).
    """

    def __init__(
        self,
        layer: DHENLayer,
        group: dist.ProcessGroup,
        replica_group: dist.ProcessGroup | None = None,
        *,
        uniform_train_batch: bool = False,
    ) -> None:
        super().__init__()
        if not isinstance(layer, DHENLayer):
            raise TypeError(f"layer must be a gem_model DHENLayer, got {type(layer).__name__}")
        if not isinstance(uniform_train_batch, bool):
            raise TypeError(
                f"uniform_train_batch must be a bool, got {type(uniform_train_batch).__name__}"
            )
        self.uniform_train_batch = uniform_train_batch
        parallel = ExpertParallel(list(layer.experts), group, replica_group=replica_group)
        self.norm = layer.norm
        self.experts = _ExpertsByGlobalIndex(list(parallel.experts), parallel.expert_indices)
        # Kept out of the module tree: its parameters are the ones registered under `experts`,
        # and a second path would give them a second, layout-dependent name.
        self.__dict__["parallel"] = parallel

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        uniform = self.training and self.uniform_train_batch
        return tokens + self.parallel(self.norm(tokens), uniform_batch=uniform)

    def reduce_grads(self) -> None:
        """Averages the local experts' gradients over the data-parallel world (collective)."""
        self.parallel.reduce_grads(average=True)


def fsdp_blocks(model: nn.Module) -> list[nn.Module]:
    """The GEM model's FSDP units in forward order: sequence layers, the history cross, PMA,
    the target attention, interaction layers and task heads. The root unit keeps the small rest (norms, recency,
    dense projection); the torchrec-sharded tables are never FSDP units."""
    blocks: list[nn.Module] = []
    for name in (
        "sequence_layers",
        "history_cross",
        "pma",
        "cross_attention",
        "interaction",
        "heads",
    ):
        child = getattr(model, name, None)
        if child is None:
            continue
        if isinstance(child, nn.ModuleDict):
            members = list(child.values())
        elif isinstance(child, nn.ModuleList | nn.Sequential):
            members = list(child)
        else:
            members = [child]
        blocks.extend(m for m in members if any(True for _ in m.parameters()))
    return blocks


def _sharded_parameters(module: nn.Module) -> set[nn.Parameter]:
    """Parameters of torchrec-sharded submodules, as FSDP2 would enumerate them."""
    found: set[nn.Parameter] = set()
    for sharded in (m for m in module.modules() if isinstance(m, ShardedModule)):
        for sub in sharded.modules():
            found.update(p for _, p in sub.named_parameters(recurse=False))
        found.update(sharded.parameters())
    return found


def mx_all_gather_layers(
    module: nn.Module, shard_size: int, ignored: set[nn.Parameter] | None = None
) -> tuple[list[str], dict[str, str]]:
    """Which ``nn.Linear`` layers of ``module`` can all-gather their weight as MXFP8 under
    FSDP with ``shard_size`` ranks per shard group.

    Returns ``(eligible names, {skipped name: reason})``: a weight needs dim 0 divisible by
    ``shard_size`` (FSDP2 pads uneven shards, and the padding cannot carry a scale) and
    ``in_features`` divisible by 32 (the MX block); with ``shard_size == 1`` every layer is
    skipped, since nothing is gathered. Layers whose weight is in ``ignored``
    (not FSDP-managed, e.g. expert-parallel experts) are not listed at all.
    """
    if isinstance(shard_size, bool) or not isinstance(shard_size, int) or shard_size < 1:
        raise ValueError(f"shard_size must be a positive int, got {shard_size!r}")
    ignored = ignored or set()
    eligible: list[str] = []
    skipped: dict[str, str] = {}
    for name, layer in module.named_modules():
        if not isinstance(layer, nn.Linear) or layer.weight in ignored:
            continue
        rows, cols = layer.weight.shape
        if shard_size == 1:
            # Nothing is gathered (and FSDP2's 1-rank path takes a single all-gather input,
            # so it cannot run the MX extension either).
            skipped[name] = "shard group of 1 rank: FSDP gathers nothing"
        elif rows % shard_size:
            skipped[name] = f"out_features {rows} not divisible by the shard size {shard_size}"
        elif cols % _MX_BLOCK:
            skipped[name] = f"in_features {cols} not a multiple of {_MX_BLOCK}"
        else:
            eligible.append(name)
    return eligible, skipped


class FSDPWrapper(DataParallelWrapper):
    """torchrec ``DataParallelWrapper`` that applies FSDP2 instead of DDP to the dense part.

    Passed to ``DistributedModelParallel(data_parallel_wrapper=...)``; DMP calls :meth:`wrap`
    after sharding the tables. ``ignored`` parameters (the expert-parallel experts) stay
    unsharded, like the tables. With ``mx_all_gather`` the eligible linear weights (see
    :func:`mx_all_gather_layers`) all-gather as MXFP8; ``mx_layers`` / ``mx_skipped`` list
    them after :meth:`wrap`. ``all_gather`` picks the collective (``gem_parallel.apply_fsdp``'s
    argument: ``"auto"`` or ``"nccl"``).
    """

    def __init__(
        self,
        mesh: GemMesh,
        *,
        ignored: set[nn.Parameter] | None = None,
        reshard_after_forward: bool = True,
        mx_all_gather: bool = False,
        all_gather: str = "auto",
    ) -> None:
        self.mesh = mesh
        self.all_gather = all_gather
        self.ignored = set(ignored or ())
        self.reshard_after_forward = reshard_after_forward
        self.mx_all_gather = mx_all_gather
        self.mx_layers: list[str] = []
        self.mx_skipped: dict[str, str] = {}

    def wrap(self, dmp: DistributedModelParallel, env: ShardingEnv, device: torch.device) -> None:
        module = dmp._dmp_wrapped_module  # DMP exposes no public setter before wrapping
        ignored = self.ignored | _sharded_parameters(module)
        if self.mx_all_gather:
            self._enable_mx(module, ignored)
        apply_fsdp(
            module,
            self.mesh,
            blocks=fsdp_blocks(module),
            reshard_after_forward=self.reshard_after_forward,
            ignored_params=ignored,
            all_gather=self.all_gather,
        )

    def _enable_mx(self, module: nn.Module, ignored: set[nn.Parameter]) -> None:
        """Wraps the eligible linear weights before ``fully_shard`` (which replaces them)."""
        shard_size = self.mesh.layout.shard
        eligible, self.mx_skipped = mx_all_gather_layers(module, shard_size, ignored)
        for name, reason in self.mx_skipped.items():
            _LOG.info("MX all-gather skips %s: %s", name, reason)
        # Exact names as include globs: dotted module names hold no glob characters.
        self.mx_layers = enable_mx_all_gather(module, include=tuple(eligible)) if eligible else []
        _LOG.info(
            "MX all-gather on %d linear weight(s), %d skipped",
            len(self.mx_layers),
            len(self.mx_skipped),
        )


def row_wise_plan(model: nn.Module, world_size: int, device_type: str) -> ShardingPlan:
    """A 1D table plan that spreads lookups and all-to-all volume evenly over ``world_size``
    ranks (``parallel.sparse_plan='row_wise'``).

    Sequence tables (``EmbeddingCollection``: one output row per history token, the bulk of the
    all-to-all) and pooled tables of >= :data:`ROW_WISE_MIN_ROWS` rows are row-wise over all
    ranks, so every rank serves about ``1/world_size`` of every token's lookups (a row and its
    row-wise Adagrad state stay on one rank: the same update as unsharded). Smaller pooled
    tables are table-wise, dealt round-robin in module order. Every table uses torchrec's fused
    kernel. Deterministic: every rank builds the same plan without communicating.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    plans = {}
    next_rank = 0
    for path, module in model.named_modules():
        if isinstance(module, EmbeddingCollection):
            configs, sequence = module.embedding_configs(), True
        elif isinstance(module, EmbeddingBagCollection):
            configs, sequence = module.embedding_bag_configs(), False
        else:
            continue
        spec = {}
        for config in configs:
            if sequence or config.num_embeddings >= ROW_WISE_MIN_ROWS:
                spec[config.name] = row_wise(compute_kernel="fused")
            else:
                spec[config.name] = table_wise(rank=next_rank % world_size, compute_kernel="fused")
                next_rank += 1
        plans[path] = construct_module_sharding_plan(
            module, spec, local_size=world_size, world_size=world_size, device_type=device_type
        )
    return ShardingPlan(plans)


class DenseParallel:
    """Applies ``ParallelConfig`` to a model around DMP and to its gradients.

    Call order: :meth:`prepare` on the unsharded model, pass :meth:`data_parallel_wrapper` to
    DMP, build the dense optimizer from :meth:`param_groups`, and call
    :meth:`finish_gradients` after ``backward`` and before the optimizer step.
    Needs an initialised process group (collective: every rank builds the same meshes).
    """

    def __init__(self, config: ParallelConfig, device: torch.device) -> None:
        self.config = config
        self.device = device
        self.world_size = dist.get_world_size()
        self.mesh: GemMesh | None = None
        self.expert_layers: list[ExpertParallelDHENLayer] = []
        self._expert_params: set[nn.Parameter] = set()
        self.fsdp_wrapper: FSDPWrapper | None = None
        world = self.world_size
        if config.dense == "fsdp" or config.expert_parallel > 1:
            layout, topology = check_dense_layout(config, world)
            self.mesh = build_gem_mesh(layout, topology, device_type=device.type)

    # ---------------------------------------------------------------- model
    def prepare(self, model: nn.Module) -> nn.Module:
        """Splits the DHEN experts over the expert groups (``expert_parallel > 1``), in place."""
        if self.config.expert_parallel == 1:
            return model
        assert self.mesh is not None
        replica = self.mesh.expert_replica_group if self.mesh.expert_replica else None
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, DHENLayer):
                    # The trainer's loader drops the last partial batch, so every rank trains
                    # on batch_size samples: no per-layer size exchange (and host sync) needed.
                    # 2 H200s, fresh processes: 102.1 ms/step against 104.2 with the exchange.
                    layer = ExpertParallelDHENLayer(
                        child, self.mesh.expert_group, replica, uniform_train_batch=True
                    )
                    setattr(parent, name, layer)
                    self.expert_layers.append(layer)
        if not self.expert_layers:
            raise ValueError("parallel.expert_parallel > 1 but the model has no DHEN layers")
        self._expert_params = {
            p for layer in self.expert_layers for p in layer.experts.parameters()
        }
        return model

    def sharding_plan(self, model: nn.Module) -> ShardingPlan:
        """The 1D plan for the tables (``parallel.sparse_plan``): :func:`row_wise_plan` for
        'row_wise'; for 'auto', torchrec's plan with model-parallel sharding types only
        (collective).

        torchrec's planner would make small tables DATA_PARALLEL (replicated) depending on the
        world size; such tables get no fused optimizer and would be trained by the dense AdamW
        instead of the sparse row-wise Adagrad, so the optimizer of a table would depend on
        the number of ranks (and under FSDP their gradients would not be reduced at all).
        """
        if self.config.sparse_plan == "row_wise":
            return row_wise_plan(model, self.world_size, self.device.type)
        allowed = [t.value for t in ShardingType if t != ShardingType.DATA_PARALLEL]
        tables = [
            table.name
            for module in model.modules()
            if isinstance(module, EmbeddingBagCollection | EmbeddingCollection)
            for table in (
                module.embedding_bag_configs()
                if isinstance(module, EmbeddingBagCollection)
                else module.embedding_configs()
            )
        ]
        planner = EmbeddingShardingPlanner(
            topology=Topology(
                local_world_size=get_local_size(self.world_size),
                world_size=self.world_size,
                compute_device=self.device.type,
            ),
            constraints={name: ParameterConstraints(sharding_types=allowed) for name in tables},
        )
        return planner.collective_plan(model, get_default_sharders(), dist.GroupMember.WORLD)

    def data_parallel_wrapper(self, model: nn.Module) -> DataParallelWrapper | None:
        """The wrapper DMP applies to the dense part: FSDP2, or DDP with a fixed bucket layout;
        None (no wrapper) for DDP on one rank."""
        if self.config.dense == "fsdp":
            assert self.mesh is not None
            self.fsdp_wrapper = FSDPWrapper(
                self.mesh,
                ignored=self._expert_params,
                reshard_after_forward=self.config.reshard_after_forward,
                mx_all_gather=self.config.fsdp_all_gather == "mx",
                all_gather=self.config.fsdp_all_gather_collective,
            )
            return self.fsdp_wrapper
        if self.world_size == 1:
            # Nothing to reduce, and under DDP dynamo splits every compiled region at DDP's
            # bucket boundaries (DDPOptimizer): less fusion, and on torch 2.11 an Inductor
            # error for the FP8 layers' padded token count ("expected [s29] to have been
            # codegen-ed") at the h200-large shape.
            return None
        ids = {id(p) for p in self._expert_params}
        names = [name for name, p in model.named_parameters() if id(p) in ids]
        # DDP with static_graph (torchrec's default) reduces its first step's gradients in one
        # bucket, then rebuilds the buckets in the order the gradients became ready. The
        # all-reduce (gloo's and NCCL's rings alike) sums an element's ranks in an order set by
        # its offset in the bucket, so a resumed job's first step, reduced in the first-step
        # layout, differed in the last bits from the uninterrupted job's. Without the rebuild
        # (the only public way: find_unused_parameters) the layout is fixed at construction and
        # resume is exact; the cost is a host-side walk of the autograd graph per step, paid
        # only where there is something to reduce.
        fixed_buckets = dist.get_world_size() > 1
        return DefaultDataParallelWrapper(
            static_graph=not fixed_buckets,
            find_unused_parameters=fixed_buckets,
            params_to_ignore=names,
        )

    # ------------------------------------------------------------ optimizer
    def is_expert(self, parameter: torch.Tensor) -> bool:
        """Whether ``parameter`` belongs to an expert split by expert parallelism."""
        return parameter in self._expert_params

    def param_groups(self, parameters: list[torch.Tensor]) -> list[torch.Tensor] | list[dict]:
        """Optimizer parameter groups: FSDP DTensors and plain tensors apart (foreach kernels
        take one kind per call); a plain list when there is only one kind."""
        sharded = [p for p in parameters if isinstance(p, DTensor)]
        plain = [p for p in parameters if not isinstance(p, DTensor)]
        if not sharded or not plain:
            return list(parameters)
        return [{"params": sharded}, {"params": plain}]

    def finish_gradients(self, parameters: list[torch.Tensor], max_norm: float) -> None:
        """Averages expert gradients over their replicas and clips the dense gradients to
        ``max_norm`` by their global norm (0: no clipping). Collective."""
        for layer in self.expert_layers:
            layer.reduce_grads()
        if max_norm <= 0:
            return
        if self.mesh is None:  # plain DDP: every rank holds the full, averaged gradients
            torch.nn.utils.clip_grad_norm_(parameters, max_norm)
            return
        with_grad = [p for p in parameters if p.grad is not None]
        sharded = [p for p in with_grad if isinstance(p.grad, DTensor)]
        experts = [p for p in with_grad if not isinstance(p.grad, DTensor) and self.is_expert(p)]
        replicated = [
            p for p in with_grad if not isinstance(p.grad, DTensor) and not self.is_expert(p)
        ]
        squares = torch.zeros((), dtype=torch.float32, device=self.device)
        if sharded:
            norm = torch.nn.utils.get_total_norm([p.grad for p in sharded])
            squares = squares + norm.full_tensor().float().square()
        if replicated:
            squares = (
                squares
                + torch.nn.utils.get_total_norm([p.grad for p in replicated]).float().square()
            )
        if experts:
            # Experts are disjoint within a group and equal across groups (after reduce_grads).
            local = torch.nn.utils.get_total_norm([p.grad for p in experts]).float().square()
            dist.all_reduce(local, group=self.mesh.expert_group)
            squares = squares + local
        total = squares.sqrt()
        for group in (sharded, replicated, experts):
            if group:
                torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)

    def describe(self) -> str:
        """One line: the dense mode, mesh sizes and expert groups."""
        config = self.config
        if self.mesh is None:
            return f"dense ddp over {self.world_size} rank(s)"
        layout = self.mesh.layout
        text = (
            f"dense {config.dense} (replicate {layout.replicate} x shard {layout.shard})"
            if config.dense == "fsdp"
            else f"dense ddp over {self.world_size} rank(s)"
        )
        if self.fsdp_wrapper is not None and self.fsdp_wrapper.all_gather != "auto":
            text += f", {self.fsdp_wrapper.all_gather} all-gather"
        if self.fsdp_wrapper is not None and self.fsdp_wrapper.mx_all_gather:
            text += (
                f", MX all-gather on {len(self.fsdp_wrapper.mx_layers)} linear(s)"
                f" ({len(self.fsdp_wrapper.mx_skipped)} skipped)"
            )
        if config.expert_parallel > 1:
            text += f", experts over groups of {config.expert_parallel}"
        return text


# --------------------------------------------------------------------------------------------
# Sparse: 1D (torchrec DMP over all ranks), 2D and fully sharded 2D (gem_parallel.shard_sparse)
# --------------------------------------------------------------------------------------------


class _AllRanksDataParallel(DataParallelWrapper):
    """Runs another ``DataParallelWrapper`` with a ``ShardingEnv`` over all ranks.

    Under 2D sparse, DMP shards the tables over a model-parallel group and hands that group's
    env to its wrapper; the dense part must still be data-parallel over every rank."""

    def __init__(self, inner: DataParallelWrapper) -> None:
        self.inner = inner

    def wrap(self, dmp: DistributedModelParallel, env: ShardingEnv, device: torch.device) -> None:
        self.inner.wrap(dmp, ShardingEnv.from_process_group(dist.group.WORLD), device)


def check_dense_layout(config: ParallelConfig, world: int) -> tuple[ParallelLayout, LayoutTopology]:
    """The gem-parallel layout and topology of the dense part on ``world`` ranks, checked as
    ``build_gem_mesh`` checks them (no process group needed), or a ``ValueError`` that names
    the ``parallel.*`` option: ``shard`` dividing the world, ``expert_parallel`` dividing the
    shard group and fitting a host (``gpus_per_host``, else torchrun's ``LOCAL_WORLD_SIZE``)."""
    shard = (config.shard or world) if config.dense == "fsdp" else world
    if world % shard:
        raise ValueError(f"parallel.shard ({shard}) must divide the world size ({world})")
    local = config.gpus_per_host or os.environ.get("LOCAL_WORLD_SIZE")
    try:
        topology = default_topology(world, int(local) if local else None)
        layout = ParallelLayout(
            replicate=world // shard, shard=shard, expert=config.expert_parallel,
            model_parallel=world,
        )  # fmt: skip
        with warnings.catch_warnings():  # build_gem_mesh warns about the layout, once
            warnings.simplefilter("ignore", UserWarning)
            validate_layout(layout, topology, world)
    except ValueError as error:  # gem-parallel names its own fields: say which options they are
        message = str(error).replace("layout.expert", "parallel.expert_parallel")
        raise ValueError(message.replace("layout.shard", "the shard group")) from error
    return layout, topology


def check_sparse_layout(config: ParallelConfig, world: int) -> None:
    """``ValueError`` (its message starts with the field's name) for sparse options that do not
    fit ``parallel.sparse`` or a world of ``world`` ranks."""
    mode = config.sparse
    if mode != "2d" and config.sparse_sync_every != 1:
        raise ValueError(
            f"parallel.sparse_sync_every ({config.sparse_sync_every}) only applies to "
            f"parallel.sparse='2d' (got {mode!r}); leave it 1"
        )
    if mode != "1d" and world % config.sparse_replicas:
        raise ValueError(
            f"parallel.sparse_replicas ({config.sparse_replicas}) must divide the world size "
            f"({world}) for parallel.sparse={mode!r}"
        )


class SparseParallel:
    """Applies ``ParallelConfig.sparse`` to the GEM model's tables (pooled and history).

    ``"1d"``: torchrec's ``DistributedModelParallel`` over all ranks with the fused row-wise
    Adagrad (unchanged behaviour). ``"2d"`` / ``"fully_sharded_2d"``: ``gem_parallel.shard_sparse``
    over a ``(sparse_replica, model_parallel)`` mesh of ``sparse_replicas`` x world //
    ``sparse_replicas`` ranks (model-parallel groups on contiguous ranks), with torchrec's
    ``RowWiseAdagrad`` (fused for 2D, on the owned flat slices for fully sharded 2D). The
    dense part goes through :class:`DenseParallel`'s wrapper over all ranks in every mode.

    The trainer keeps using the DMP (:meth:`shard` returns it), so state-dict names are the
    same in every mode and DCP checkpoints load across modes and worlds. Call :meth:`step`
    after ``backward`` and use :meth:`model_state_dict`, :meth:`extra_state` and
    :meth:`finish_load` around checkpoints (fully sharded 2D keeps only slices between steps).
    Collective: every rank builds the same mesh.
    """

    def __init__(self, config: ParallelConfig, device: torch.device) -> None:
        self.config = config
        self.mode = config.sparse
        self.device = device
        self.sharded: ShardedSparse | None = None
        self._tables: set[nn.Parameter] = set()
        check_sparse_layout(config, dist.get_world_size())

    def shard(
        self, model: nn.Module, dense: DenseParallel, sparse_lr: float
    ) -> DistributedModelParallel:
        """Shards the tables of ``model`` (and wraps its dense part through ``dense``);
        returns the ``DistributedModelParallel`` to train. Collective."""
        tables = [
            p
            for m in model.modules()
            if isinstance(m, EmbeddingBagCollection | EmbeddingCollection)
            for p in m.parameters()
        ]
        wrapper = dense.data_parallel_wrapper(model)
        if self.mode == "1d":
            apply_optimizer_in_backward(RowWiseAdagrad, tables, {"lr": sparse_lr})
            return DistributedModelParallel(
                model,
                device=self.device,
                plan=dense.sharding_plan(model),
                init_data_parallel=wrapper is not None,
                data_parallel_wrapper=wrapper,
            )
        world = dist.get_world_size()
        replicas = self.config.sparse_replicas
        ranks = torch.arange(world).reshape(replicas, world // replicas)
        mesh = DeviceMesh(
            self.device.type, ranks, mesh_dim_names=("sparse_replica", "model_parallel")
        )
        self.sharded = shard_sparse(
            model,
            mesh,
            self.mode,
            optimizer=RowWiseAdagrad,
            optimizer_kwargs={"lr": sparse_lr},
            sync_every=self.config.sparse_sync_every,
            device=self.device,
            data_parallel_wrapper=None if wrapper is None else _AllRanksDataParallel(wrapper),
        )
        dmp = self.sharded.module
        # As DMP lists them (per-table views of the kernels' weights).
        self._tables = _sharded_parameters(dmp)
        if self.mode == "fully_sharded_2d":
            # The trainer calls the DMP: gather the shards first (no-op while gathered).
            dmp.register_forward_pre_hook(lambda module, args: self.sharded.before_forward())
        return dmp

    def is_table(self, parameter: torch.Tensor) -> bool:
        """Whether ``parameter`` is an embedding kernel's weights (trained by the sparse
        optimizer, never by the dense one)."""
        return parameter in self._tables

    def step(self) -> None:
        """After ``backward``: 2D syncs the replicas every ``sparse_sync_every`` steps; fully
        sharded 2D reduce-scatters the table gradients and updates the owned slices."""
        if self.sharded is not None:
            self.sharded.step()

    def model_state_dict(self, model: nn.Module) -> dict[str, Any]:
        """``model.state_dict()`` with fully sharded 2D's tables gathered (views of them).

        2D first syncs the replicas (weights and optimizer state): a checkpoint holds one copy
        of each shard, so replicas that drifted since the last sync would resume different
        from how they continue. Collective."""
        if self.sharded is not None:
            self.sharded.unshard()
            self.sharded.sync()
        return model.state_dict()

    def extra_state(self) -> dict[str, Any]:
        """Checkpoint entries beyond model and optimizer: fully sharded 2D's slice optimizer
        state as ``{"sparse_optimizer": ...}`` (torchrec's fused layout); empty otherwise."""
        if self.mode != "fully_sharded_2d" or self.sharded is None:
            return {}
        state = self.sharded.sharded_state_dict(include_optimizer=True)
        return {"sparse_optimizer": state["optimizer"]}

    def finish_load(self, app_state: dict[str, Any], step: int) -> None:
        """After DCP loaded ``app_state`` in place (and ``model.load_state_dict``): fully
        sharded 2D re-slices the tables and, when ``app_state`` has ``"sparse_optimizer"``,
        their optimizer state; 2D resumes its sync counter at ``step``."""
        if self.sharded is None:
            return
        self.sharded.steps = step
        if self.mode == "fully_sharded_2d":
            # DCP loaded the tables in place into the gathered shards (app_state["model"]
            # itself may have been renamed by DMP's load_state_dict, which adds DDP's prefix).
            state = self.sharded.sharded_state_dict()
            if "sparse_optimizer" in app_state:  # absent: a model-only load
                state["optimizer"] = app_state["sparse_optimizer"]
            self.sharded.load_sharded_state_dict(state)

    def describe(self) -> str:
        """One line: the sparse mode and its groups."""
        if self.mode == "1d":
            text = f"sparse 1d over {dist.get_world_size()} rank(s)"
            if self.config.sparse_plan != "auto":
                text += f", {self.config.sparse_plan} plan"
            return text
        replicas = self.config.sparse_replicas
        text = (
            f"sparse {self.mode} ({replicas} replica(s) x model-parallel "
            f"{dist.get_world_size() // replicas})"
        )
        if self.mode == "fully_sharded_2d" and self.sharded is not None:
            text += f", all-gather: {self.sharded.collective_choices.get('all_gather', '?')}"
        return text
