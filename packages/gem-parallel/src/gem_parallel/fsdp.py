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
as a fallback. It runs on CPU with gloo (the tests) as well as on CUDA with NCCL (not yet run
here on GPUs).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from gem_parallel.mesh import GemMesh

__all__ = ["apply_fsdp", "default_fsdp_blocks"]

_log = logging.getLogger(__name__)


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
    return module
