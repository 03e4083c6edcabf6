"""Activation checkpointing per model region, chosen by measured recompute time per byte.

Checkpointing a region (``GemModel.regions()``: each self-attention layer, the cross-
attentions, the tower's output norm, PMA, each DHEN layer, each head) frees the activations it saves for backward,
except its inputs, at the price of running its forward again in backward. Regions differ
widely in both: a self-attention layer saves its whole jagged history at every projection,
a head a few ``(B, d)`` tensors. So ``"auto"`` measures each region once, on the first
training batch (a forward without backward, so no weight moves), and checkpoints the regions
with the least forward time per byte freed first, until the saved activations fit the
budget. ``"full"`` checkpoints every region.

A checkpointed module keeps its parameters and state-dict names: its own ``forward`` runs
under ``torch.utils.checkpoint`` (non-reentrant, which ``torch.compile`` traces).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["RegionCost", "checkpoint_module", "choose_regions", "measure_regions"]


@dataclasses.dataclass(frozen=True)
class RegionCost:
    """What checkpointing one module would cost and free, measured on one forward."""

    name: str
    """The module's qualified name in the model."""
    forward_seconds: float
    """Its forward: what backward would run again."""
    freed_bytes: int
    """Activation bytes it saves for backward, without its inputs (which checkpointing keeps)
    and parameters."""

    @property
    def seconds_per_gib(self) -> float:
        return self.forward_seconds / max(self.freed_bytes, 1) * 2**30


def checkpoint_module(module: nn.Module) -> None:
    """Runs ``module``'s forward under non-reentrant ``torch.utils.checkpoint`` from now on.

    The wrapper is a plain function that calls ``checkpoint``: dynamo traces that call into
    one graph (the recompute then happens inside the compiled backward). A
    ``functools.partial(checkpoint, ...)`` as the forward is not traced: ``module.compile()``
    then captured no graph and the region, with its recompute, ran eagerly."""
    forward = module.forward

    @functools.wraps(forward)
    def checkpointed(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    module.forward = checkpointed


def _storage_key(tensor: torch.Tensor) -> tuple[int, int]:
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def _drop(_tensor: torch.Tensor) -> None:
    return None


def _no_backward(_packed: None) -> torch.Tensor:
    raise RuntimeError("measure_regions' forward keeps no activations: it has no backward")


def measure_regions(
    model: nn.Module, modules: dict[str, nn.Module], forward: Callable[[], object]
) -> list[RegionCost]:
    """Runs ``forward()`` once with grad enabled and measures every module of ``modules``
    (qualified name -> module) on it: its forward seconds (device-synchronised) and the bytes
    of activations it saves, counted once per storage. The saved activations are counted and
    dropped: the forward's graph cannot run backward."""
    parameters = {_storage_key(p) for p in model.parameters() if p.numel()}
    costs: dict[str, dict] = {}
    active: list[tuple[str, torch.autograd.graph.saved_tensors_hooks, set]] = []

    def synchronize(tensors) -> None:
        for value in tensors:
            if isinstance(value, torch.Tensor) and value.is_cuda:
                torch.cuda.synchronize(value.device)
                return

    def pre_hook(name):
        def hook(_module, args, kwargs):
            inputs = {_storage_key(a) for a in (*args, *kwargs.values())
                      if isinstance(a, torch.Tensor)}  # fmt: skip
            seen: set = set()
            record = costs.setdefault(name, {"seconds": 0.0, "bytes": 0})

            def pack(tensor: torch.Tensor) -> None:
                key = _storage_key(tensor)
                if key not in seen and key not in parameters and key not in inputs:
                    seen.add(key)
                    record["bytes"] += key[1]

            hooks = torch.autograd.graph.saved_tensors_hooks(pack, _no_backward)
            hooks.__enter__()
            active.append((name, hooks, seen))
            synchronize((*args, *kwargs.values()))
            record["started"] = time.perf_counter()

        return hook

    def post_hook(name):
        def hook(_module, _args, output):
            synchronize(output if isinstance(output, tuple | list) else (output,))
            record = costs[name]
            record["seconds"] += time.perf_counter() - record.pop("started")
            _, hooks, _ = active.pop()
            hooks.__exit__(None, None, None)

        return hook

    handles = []
    for name, module in modules.items():
        handles.append(module.register_forward_pre_hook(pre_hook(name), with_kwargs=True))
        handles.append(module.register_forward_hook(post_hook(name)))
    try:
        # Nothing saved is kept (the innermost hooks win: a region's count, else this one), so
        # the forward holds about one region's activations at a time and can be measured at a
        # batch whose full set of activations does not fit, the batch checkpointing is for.
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_drop, _no_backward):
            forward()
    finally:
        for handle in handles:
            handle.remove()
        while active:
            active.pop()[1].__exit__(None, None, None)
    return [
        RegionCost(name, costs[name]["seconds"], costs[name]["bytes"])
        for name in modules
        if name in costs
    ]


def choose_regions(costs: list[RegionCost], budget_bytes: int) -> list[str]:
    """The modules to checkpoint so that the activations saved by the rest fit
    ``budget_bytes``: least forward time per byte freed first (each module that frees
    nothing stays)."""
    saved = sum(cost.freed_bytes for cost in costs)
    chosen = []
    for cost in sorted(costs, key=lambda c: c.seconds_per_gib):
        if saved <= budget_bytes:
            break
        if cost.freed_bytes > 0:
            chosen.append(cost.name)
            saved -= cost.freed_bytes
    return chosen
