"""Autograd-aware all-gather and reduce-scatter along dim 0, working on NCCL and gloo.

``all_gather_dim0`` and ``reduce_scatter_dim0`` are each other's adjoint, so each one's backward
is the other. They are written as small ``autograd.Function`` s rather than taken from
``torch.distributed.nn.functional`` because the latter's all-gather backward emulates
reduce-scatter with an all-to-all on non-NCCL backends, and its behaviour has changed between
torch releases; these two behave the same from torch 2.11 on.

Gloo has no native reduce-scatter in some torch releases: when the native call reports that it
is unsupported, ``reduce_scatter_dim0`` falls back to ``all_reduce`` of the whole input followed
by taking this rank's slice (same result, ``group_size`` times the traffic; only used for CPU
tests).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["all_gather_dim0", "reduce_scatter_dim0"]

# torch 2.14 deprecates *_tensor in favour of *_single; 2.11 only has *_tensor.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# Set once a backend reported that it cannot reduce-scatter; then all_reduce + slice is used.
_NATIVE_REDUCE_SCATTER_UNSUPPORTED: set[str] = set()


def _group_size(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group)


def _all_gather(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    tensor = tensor.contiguous()
    size = _group_size(group)
    if size == 1:
        return tensor.clone()
    out = tensor.new_empty((size * tensor.shape[0], *tensor.shape[1:]))
    _all_gather_single(out, tensor, group=group)
    return out


def _reduce_scatter(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    tensor = tensor.contiguous()
    size = _group_size(group)
    if size == 1:
        return tensor.clone()
    rows = tensor.shape[0] // size
    backend = str(dist.get_backend(group))
    if backend not in _NATIVE_REDUCE_SCATTER_UNSUPPORTED:
        out = tensor.new_empty((rows, *tensor.shape[1:]))
        try:
            _reduce_scatter_single(out, tensor, group=group)
            return out
        except RuntimeError as err:
            # Raised locally before any communication, so every rank takes the same branch.
            if "support" not in str(err).lower():
                raise
            _NATIVE_REDUCE_SCATTER_UNSUPPORTED.add(backend)
    total = tensor.clone()
    dist.all_reduce(total, group=group)
    rank = dist.get_rank(group)
    return total[rank * rows : (rank + 1) * rows].clone()


class _AllGatherDim0(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return _all_gather(tensor, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _reduce_scatter(grad, ctx.group), None


class _ReduceScatterDim0(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return _reduce_scatter(tensor, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_gather(grad, ctx.group), None


def all_gather_dim0(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along dim 0, in group-rank order (differentiable).

    Every rank must pass the same shape. Backward reduce-scatters (sums) the gradient, so each
    rank receives the sum over ranks of the gradient of its own rows.
    """
    if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0:
        raise ValueError("tensor must be a torch.Tensor with at least one dimension")
    return _AllGatherDim0.apply(tensor, group)


def reduce_scatter_dim0(
    tensor: torch.Tensor, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Sum ``tensor`` over ranks and return this rank's slice of dim 0 (differentiable).

    ``tensor.shape[0]`` must be a multiple of the group size; rank ``r`` of the group gets rows
    ``[r * n, (r + 1) * n)`` of the sum with ``n = tensor.shape[0] // group_size``. Backward
    all-gathers the gradient.
    """
    if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0:
        raise ValueError("tensor must be a torch.Tensor with at least one dimension")
    size = _group_size(group)
    if tensor.shape[0] % size != 0:
        raise ValueError(
            f"tensor.shape[0] ({tensor.shape[0]}) must be a multiple of the group size ({size})"
        )
    return _ReduceScatterDim0.apply(tensor, group)
