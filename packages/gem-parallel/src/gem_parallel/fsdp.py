"""HSDP / 2D FSDP of dense modules with FSDP2 ``fully_shard`` over ``GemMesh.dense``.

Parameters are sharded over the contiguous ``shard`` dim of the ``(replicate, shard)`` mesh and
replicated over ``replicate``. Per step, FSDP2 all-gathers each block's parameters over
``shard`` before its forward (and again before its backward when ``reshard_after_forward``),
reduce-scatters gradients over ``shard`` and all-reduces the resulting shards over
``replicate``.

Gradient semantics: FSDP2 averages, so after ``backward`` each (full) gradient is the mean over
all ``replicate * shard`` ranks of the per-rank gradients. If every rank's loss is the mean over
its own batch shard and shards are equal, that is the gradient of the mean loss over the global
batch, i.e. what one process computes on the whole batch.

``fully_shard`` is ``torch.distributed.fsdp.fully_shard`` in torch 2.6+; it and
``set_modules_to_forward_prefetch`` were imported and the tests passed on CPU/gloo with torch
2.11 and 2.14. Older releases kept it in ``torch.distributed._composable.fsdp``, which is tried
as a fallback. It runs on CPU with gloo (the tests) as well as on CUDA with NCCL (2 H200s,
torch 2.11, in ``benchmarks/bench_collectives.py``).

All-gather provider (``all_gather=``): with ``"auto"`` or ``"copy_engine"``, the shard group's
all-gather is chosen by :func:`gem_parallel.select_all_gather` (copy engine on one-host NCCL
groups, else NCCL / gloo; the choice is logged on the ``gem_parallel`` logger) and installed in
every FSDP unit with FSDP2's ``set_custom_all_gather`` (torch >= 2.9; on a torch without it FSDP's
default all-gather stays and that is logged). For the copy engine, the comm's ``allocate`` hands
FSDP all-gather buffers in symmetric memory, from a pool per (size, dtype) that reuses a buffer
once FSDP has dropped every reference to it, so the all-gather runs in place without SM copies.
``"nccl"`` leaves FSDP's own all-gather.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from gem_parallel.collectives import (
    COLLECTIVE_CHOICES,
    CollectiveFn,
    _all_gather_single,
    copy_engine_all_gather,
    select_all_gather,
    symmetric_empty,
)
from gem_parallel.mesh import GemMesh

__all__ = ["FsdpAllGather", "apply_fsdp", "default_fsdp_blocks", "set_fsdp_all_gather"]

_log = logging.getLogger(__name__)


def _fsdp_all_gather_base() -> type:
    """FSDP2's ``AllGather`` comm interface, or ``object`` on a torch without custom comms."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather
    except ImportError:
        return object
    return AllGather


def _storage_use_count(tensor: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)


class FsdpAllGather(_fsdp_all_gather_base()):
    """An FSDP2 all-gather comm that runs ``fn(out, inp, group)`` (see ``set_custom_all_gather``).

    With ``symmetric``, :meth:`allocate` returns buffers in symmetric memory (for
    :func:`gem_parallel.copy_engine_all_gather`, which FSDP then calls in place), pooled per
    (numel, dtype, device): a pooled buffer is handed out again only once nothing but the pool
    references it. Otherwise it allocates with ``torch.empty`` and, when ``fn`` is ``None``,
    runs the group's own all-gather (NCCL / gloo, async like FSDP's default).
    """

    def __init__(
        self,
        fn: CollectiveFn | None = None,
        *,
        group: dist.ProcessGroup | None = None,
        symmetric: bool = False,
    ) -> None:
        if symmetric and not hasattr(torch._C, "_storage_Use_Count"):
            raise RuntimeError("symmetric FSDP buffers need torch._C._storage_Use_Count")
        self.fn = fn
        self.group = group
        self.symmetric = symmetric
        self.calls = 0
        """Number of all-gathers run (for tests and logs)."""
        # (numel, dtype, device) -> [(buffer, its storage use count when only the pool holds it)]
        self._pool: dict[tuple, list[tuple[torch.Tensor, int]]] = {}

    def allocate(
        self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """An uninitialised all-gather output of ``size`` (symmetric memory when asked)."""
        if not self.symmetric:
            return torch.empty(size, dtype=dtype, device=device)
        numel = math.prod(int(s) for s in size)
        entries = self._pool.setdefault((numel, dtype, str(device)), [])
        for buffer, idle_count in entries:
            if _storage_use_count(buffer) == idle_count:
                return buffer.view(size)
        buffer = symmetric_empty((numel,), dtype, self.group, device)
        entries.append((buffer, _storage_use_count(buffer)))
        return buffer.view(size)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ):
        self.calls += 1
        if self.fn is None:
            return _all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)
        self.fn(output_tensor, input_tensor, group)  # stream-ordered: nothing to wait on
        return None


def set_fsdp_all_gather(module: nn.Module, comm: FsdpAllGather) -> bool:
    """Install ``comm`` as the all-gather of every FSDP unit in ``module`` (itself included).

    Returns ``False`` (and logs why) on a torch whose FSDP2 lacks ``set_custom_all_gather``.
    """
    if not isinstance(comm, FsdpAllGather):
        raise TypeError(f"comm must be an FsdpAllGather, got {type(comm).__name__}")
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in module.modules() if isinstance(m, FSDPModule)]
    if not units:
        raise ValueError("module holds no FSDP unit: call fully_shard / apply_fsdp first")
    if not all(hasattr(m, "set_custom_all_gather") for m in units):
        _log.info(
            "FSDP2 of torch %s has no set_custom_all_gather; keeping its default all-gather",
            torch.__version__,
        )
        return False
    for unit in units:
        unit.set_custom_all_gather(comm)
    return True


def _fully_shard():
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        try:
            from torch.distributed._composable.fsdp import fully_shard
        except ImportError as err:
            import torch

            raise RuntimeError(
                "apply_fsdp needs FSDP2 (torch.distributed.fsdp.fully_shard), which this torch "
                f"({torch.__version__}) does not provide; gem-parallel supports torch >= 2.11"
            ) from err
    return fully_shard


def default_fsdp_blocks(module: nn.Module) -> list[nn.Module]:
    """The blocks :func:`apply_fsdp` shards separately: the direct children of ``module`` that
    hold parameters, with ``nn.ModuleList`` / ``nn.ModuleDict`` children expanded into their
    elements, in registration order (which must be the forward execution order for prefetch)."""
    blocks: list[nn.Module] = []
    for child in module.children():
        members = (
            list(child.children()) if isinstance(child, nn.ModuleList | nn.ModuleDict) else [child]
        )
        blocks.extend(m for m in members if any(True for _ in m.parameters()))
    return blocks


def apply_fsdp(
    module: nn.Module,
    gem_mesh: GemMesh | DeviceMesh,
    *,
    reshard_after_forward: bool = True,
    prefetch: bool = True,
    blocks: Sequence[nn.Module] | None = None,
    all_gather: str = "auto",
    **fully_shard_kwargs: object,
) -> nn.Module:
    """Shard ``module`` with FSDP2 over the 2-D ``(replicate, shard)`` dense mesh, in place.

    Each block (default: :func:`default_fsdp_blocks`) becomes its own FSDP unit, so only one
    block's parameters are gathered at a time; then the root is wrapped, taking the remaining
    parameters. With ``prefetch``, block ``i`` explicitly prefetches block ``i + 1``'s
    all-gather during its forward (``set_modules_to_forward_prefetch``; skipped with a log
    message on a torch without it), overlapping communication with compute; ``blocks`` must
    then be in forward execution order.

    Args:
        module: the dense module; its parameters must be on the mesh's device type.
        gem_mesh: a :class:`GemMesh` (its ``dense`` view is used) or a 2-D ``DeviceMesh`` with
            dims ``("replicate", "shard")``.
        reshard_after_forward: free gathered parameters after forward (re-gathered in backward:
            less memory, one more all-gather per block).
        prefetch: explicit forward prefetch of the next block.
        blocks: override the blocks to shard separately.
        all_gather: one of :data:`gem_parallel.COLLECTIVE_CHOICES`: ``"auto"`` (copy engine
            where it works, else the backend's own), ``"copy_engine"`` (same, warning when it
            falls back), ``"nccl"`` (FSDP's default all-gather). See the module doc.
        **fully_shard_kwargs: passed to every ``fully_shard`` call (e.g. ``mp_policy``).

    Returns:
        ``module``, now an ``FSDPModule``.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
    if isinstance(gem_mesh, GemMesh):
        mesh = gem_mesh.dense
    elif isinstance(gem_mesh, DeviceMesh):
        mesh = gem_mesh
    else:
        raise TypeError(f"gem_mesh must be a GemMesh or DeviceMesh, got {type(gem_mesh).__name__}")
    if mesh.ndim != 2 or mesh.mesh_dim_names != ("replicate", "shard"):
        raise ValueError(
            "gem_mesh must be 2-D with dims ('replicate', 'shard'), got "
            f"{mesh.ndim}-D with dims {mesh.mesh_dim_names}"
        )
    if all_gather not in COLLECTIVE_CHOICES:
        raise ValueError(f"all_gather must be one of {COLLECTIVE_CHOICES}, got {all_gather!r}")
    blocks = default_fsdp_blocks(module) if blocks is None else list(blocks)
    if any(b is module for b in blocks):
        raise ValueError("blocks must not contain the root module itself")
    owned = {id(m) for m in module.modules()}
    if any(id(b) not in owned for b in blocks):
        raise ValueError("every entry of blocks must be a submodule of module")

    fully_shard = _fully_shard()
    for block in blocks:
        fully_shard(
            block, mesh=mesh, reshard_after_forward=reshard_after_forward, **fully_shard_kwargs
        )
    fully_shard(
        module, mesh=mesh, reshard_after_forward=reshard_after_forward, **fully_shard_kwargs
    )

    if prefetch and len(blocks) > 1:
        if not hasattr(blocks[0], "set_modules_to_forward_prefetch"):
            _log.info("FSDP2 of this torch has no set_modules_to_forward_prefetch; not prefetching")
        else:
            for block, following in zip(blocks, blocks[1:], strict=False):
                block.set_modules_to_forward_prefetch([following])

    if all_gather != "nccl":
        shard_group = mesh.get_group("shard")
        fn, reason = select_all_gather(shard_group, prefer=all_gather)
        if fn is copy_engine_all_gather:
            comm = FsdpAllGather(fn, group=shard_group, symmetric=True)
        else:  # the backend's own all-gather, through the same plumbing
            comm = FsdpAllGather(group=shard_group)
        if set_fsdp_all_gather(module, comm):
            _log.info("apply_fsdp: FSDP all-gather over 'shard' is %s", reason)
    return module
