"""Expert parallelism for layers whose output is a sum of independent experts.

A DHEN-style layer computes ``sum_e expert_e(x)``. :class:`ExpertParallel` splits the experts
over the ranks of an expert group: every rank keeps only the experts it owns, and

1. all-gathers the input activations over the group (each rank holds its own batch shard),
2. runs its local experts on the gathered batch and sums their outputs,
3. reduce-scatters the partial sums, so each rank gets ``sum over ALL experts`` for exactly its
   own batch rows.

Backward mirrors it (the all-gather's adjoint is a reduce-scatter and vice versa), so the
result equals the single-process computation on the group's concatenated batch, forward and
backward.

Gradient semantics. Let ``loss_r`` be the loss each rank computes from its own output. After
``backward``:

* the input gradient on rank ``r`` is ``d loss_r / d x_r`` (as without expert parallelism);
* a local expert's parameter gradient is ``d (sum over the expert group's ranks of loss_r)``,
  because the expert saw every group rank's rows.

When the expert group is smaller than the data-parallel world, every expert has one copy per
expert group; :meth:`ExpertParallel.reduce_grads` sums those copies over ``replica_group`` and,
with ``average=True`` (the default), divides by the data-parallel world size
(``group size * replica group size``), which matches FSDP/DDP's gradient averaging: if every
rank's ``loss_r`` is the mean over its shard and shards are equal, the result is the gradient of
the global-batch mean loss.

Batch sizes. Ranks may pass different batch sizes; then every call first all-gathers the
sizes, which needs them on the host (a device-to-host copy that waits for the GPU queue to drain,
once per layer call). When every rank of the group is known to pass the same batch size (a
training loader that drops the last partial batch does), ``uniform_batch=True`` skips that
exchange: no extra collective and no host synchronisation. A caller that breaks the promise
gets mismatched collectives (an error or a hang), not a wrong result silently.

Experts must treat samples independently (no BatchNorm-like statistics across the batch), and
every rank of the group must call forward and backward the same number of times, because both
contain collectives; the input must require grad on every rank of the group or on none.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from gem_parallel.collectives import all_gather_dim0, reduce_scatter_dim0

__all__ = ["ExpertParallel", "expert_assignment"]


def expert_assignment(num_experts: int, group_size: int) -> list[tuple[int, ...]]:
    """Global expert indices owned by each rank of an expert group: contiguous blocks.

    Rank ``g`` owns experts ``[g * E // G, (g + 1) * E // G)`` for ``E`` experts and ``G``
    ranks, so block sizes differ by at most one. Needs ``num_experts >= group_size`` so that
    every rank owns at least one expert.
    """
    for value, name in ((num_experts, "num_experts"), (group_size, "group_size")):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if num_experts < group_size:
        raise ValueError(
            f"num_experts ({num_experts}) must be at least the expert group size "
            f"({group_size}) so that every rank owns an expert"
        )
    return [
        tuple(range(g * num_experts // group_size, (g + 1) * num_experts // group_size))
        for g in range(group_size)
    ]


class ExpertParallel(nn.Module):
    """Sum of experts, with the experts split over the ranks of ``group``.

    Args:
        experts: either the full list of expert modules (every rank builds the same list; each
            keeps only its own), or a factory ``index -> nn.Module`` that is called only for the
            experts this rank owns (then ``num_experts`` is required).
        group: the expert-parallel process group (e.g. ``GemMesh.expert_group``); ``None`` is
            the default (world) group.
        num_experts: number of experts when ``experts`` is a factory.
        replica_group: ranks holding the same experts in other expert groups (e.g.
            ``GemMesh.expert_replica_group``); used only by :meth:`reduce_grads`. ``None`` means
            the expert group is the whole data-parallel world.
        uniform_batch: every rank of the group always passes the same batch size, so the
            per-call size exchange (a collective plus a host sync) is skipped. Can be
            overridden per call with ``forward(x, uniform_batch=...)``.

    Forward takes this rank's batch shard ``x`` (batch on dim 0; per-rank batch sizes may
    differ, including zero rows) and returns ``sum_e expert_e(x)`` for those rows. Every expert
    must map an ``(n, ...)`` input to an ``(n, ...)`` output of one common shape.
    Attributes: ``experts`` (``nn.ModuleList`` of the local experts), ``expert_indices``
    (their global indices), ``num_experts``.
    """

    def __init__(
        self,
        experts: Sequence[nn.Module] | Callable[[int], nn.Module],
        group: dist.ProcessGroup | None = None,
        *,
        num_experts: int | None = None,
        replica_group: dist.ProcessGroup | None = None,
        uniform_batch: bool = False,
    ) -> None:
        super().__init__()
        if not isinstance(uniform_batch, bool):
            raise TypeError(f"uniform_batch must be a bool, got {type(uniform_batch).__name__}")
        self.uniform_batch = uniform_batch
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "ExpertParallel needs an initialized default process group: call "
                "torch.distributed.init_process_group first"
            )
        self.group = group
        self.replica_group = replica_group
        group_size = dist.get_world_size(group)
        rank = dist.get_rank(group)
        if rank < 0:
            raise ValueError("group must contain this rank")

        if callable(experts) and not isinstance(experts, nn.Module):
            if num_experts is None:
                raise ValueError("num_experts is required when experts is a factory")
            owned = expert_assignment(num_experts, group_size)[rank]
            local = []
            for index in owned:
                module = experts(index)
                if not isinstance(module, nn.Module):
                    raise TypeError(
                        f"the experts factory must return nn.Module, got {type(module).__name__}"
                    )
                local.append(module)
        else:
            experts = list(experts)
            if not all(isinstance(e, nn.Module) for e in experts):
                raise TypeError("experts must be a sequence of nn.Module or a factory")
            if num_experts is not None and num_experts != len(experts):
                raise ValueError(
                    f"num_experts ({num_experts}) must equal len(experts) ({len(experts)})"
                )
            num_experts = len(experts)
            owned = expert_assignment(num_experts, group_size)[rank]
            local = [experts[i] for i in owned]
        self.num_experts = num_experts
        self.expert_indices = owned
        self.experts = nn.ModuleList(local)

    def forward(self, x: torch.Tensor, *, uniform_batch: bool | None = None) -> torch.Tensor:
        """``sum_e expert_e(x)`` for this rank's rows ``x``. ``uniform_batch`` overrides the
        constructor's setting for this call (``True``: every rank passes ``x.shape[0]`` rows,
        so no size exchange)."""
        if not isinstance(x, torch.Tensor) or x.dim() == 0:
            raise ValueError("x must be a tensor with the batch on dim 0")
        if uniform_batch is None:
            uniform_batch = self.uniform_batch
        group_size = dist.get_world_size(self.group)
        rank = dist.get_rank(self.group)
        # Equal sizes need no exchange (no collective, no host sync).
        sizes = [x.shape[0]] * group_size if uniform_batch else self._batch_sizes(x, group_size)
        widest = max(sizes)
        ragged = any(n != widest for n in sizes)

        # All-gather needs equal shapes: pad every shard to the widest, drop the padding after.
        padded = F.pad(x, (0, 0) * (x.dim() - 1) + (0, widest - x.shape[0])) if ragged else x
        gathered = all_gather_dim0(padded, self.group)
        if ragged:
            gathered = torch.cat(
                [gathered[g * widest : g * widest + n] for g, n in enumerate(sizes)]
            )

        partial = None
        for expert in self.experts:
            out = expert(gathered)
            if not isinstance(out, torch.Tensor) or out.dim() == 0 or out.shape[0] != sum(sizes):
                raise ValueError(
                    f"every expert must return a tensor with the batch ({sum(sizes)} rows) on "
                    f"dim 0, got {getattr(out, 'shape', type(out).__name__)}"
                )
            partial = out if partial is None else partial + out

        if ragged:
            pieces = partial.split(sizes)
            partial = torch.cat(
                [F.pad(p, (0, 0) * (p.dim() - 1) + (0, widest - p.shape[0])) for p in pieces]
            )
        mine = reduce_scatter_dim0(partial, self.group)
        return mine[: sizes[rank]]

    def _batch_sizes(self, x: torch.Tensor, group_size: int) -> list[int]:
        if group_size == 1:
            return [x.shape[0]]
        # One tiny all-gather per call so ranks may hold different batch sizes.
        local = torch.tensor([x.shape[0]], dtype=torch.int64, device=x.device)
        return [int(n) for n in all_gather_dim0(local, self.group)]

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, local experts={list(self.expert_indices)}"

    @torch.no_grad()
    def reduce_grads(self, *, average: bool = True) -> None:
        """Combine the local experts' gradients across expert groups (see module docstring).

        Sums over ``replica_group`` (if given) and, with ``average``, divides by the
        data-parallel world size ``group size * replica group size``. Collective over
        ``replica_group``; call after ``backward`` and before the optimizer step.
        """
        grads = [p.grad for p in self.experts.parameters() if p.grad is not None]
        replicas = 1
        if self.replica_group is not None:
            replicas = dist.get_world_size(self.replica_group)
            if replicas > 1:
                for grad in grads:
                    dist.all_reduce(grad, group=self.replica_group)
        if average:
            scale = 1.0 / (replicas * dist.get_world_size(self.group))
            for grad in grads:
                grad.mul_(scale)
