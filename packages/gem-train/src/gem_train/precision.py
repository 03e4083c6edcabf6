"""Applies ``TrainConfig.precision`` to the dense linear layers of a model (gem-precision)."""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch

import torch
from gem_model import AttentionPrecision
from gem_precision import (
    Fp8Recipe,
    PrecisionPolicy,
    SavedActivationStats,
    convert_to_bf16_gemms,
    convert_to_fp8,
    mx_saved_activations,
)
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingCollection
from torchrec.distributed.types import ShardedModule

from gem_train.config import PrecisionConfig

__all__ = ["SavedActivations", "apply_precision", "autocast", "precision_policy"]


def precision_policy(config: PrecisionConfig) -> PrecisionPolicy:
    """The gem-precision policy (layer selection and FP8 recipe) described by ``config``."""
    return PrecisionPolicy(
        exclude=tuple(config.exclude),
        min_features=config.min_features,
        recipe=Fp8Recipe(
            wgrad_in_bf16=config.wgrad_in_bf16,
            wgrad_x_tiles=config.wgrad_x_tiles,
            tensorwise=config.tensorwise,
            stochastic_rounding_grads=config.stochastic_rounding_grads,
            hadamard=config.hadamard,
        ),
    )


def apply_precision(model: nn.Module, config: PrecisionConfig, device: torch.device) -> list[str]:
    """Converts the selected ``nn.Linear`` layers of ``model`` in place for training on
    ``device``; returns their names. The forward then runs under :func:`autocast`.

    - ``'fp32'`` changes nothing.
    - ``'bf16'`` on CUDA converts nothing: autocast runs every linear as a bf16 tensor-core
      GEMM (float32 master weights). On the CPU it swaps in ``Bf16GemmLinear``: the same GEMM
      numerics (bf16-rounded operands, float32 accumulation), emulated, with the rest of the
      model in float32, the peer the FP8 emulation is compared with.
    - ``'fp8'`` swaps in ``Fp8Linear``; the ``bf16_layers`` stay bf16 GEMMs (autocast on CUDA,
      ``Bf16GemmLinear`` on the CPU).

    The attention modules matched by ``fp8_attention`` run their kernels in FP8, whatever the
    mode (their names are returned too). Embedding tables keep their precision.
    """
    attention = _apply_fp8_attention(model, config.fp8_attention)
    if config.mode == "fp32":
        return attention
    linears = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    # A pattern that matches nothing is most often misspelled (bf16_layers' default names
    # GEM's heads, and may match nothing in another model).
    default = PrecisionConfig().bf16_layers
    for field in ("exclude", "bf16_layers") if config.mode == "fp8" else ("exclude",):
        for pattern in getattr(config, field):
            if field == "bf16_layers" and pattern in default:
                continue
            if not any(fnmatch.fnmatchcase(name, pattern) for name in linears):
                raise ValueError(
                    f"precision.{field} pattern {pattern!r} matches none of the model's linear "
                    f"layers (such as {linears[:3]})"
                )
    policy = precision_policy(config)
    emulate_bf16 = device.type != "cuda"
    if config.mode == "bf16":
        return attention + (convert_to_bf16_gemms(model, policy) if emulate_bf16 else [])
    converted = []
    if config.bf16_layers:
        if emulate_bf16:
            bf16_policy = dataclasses.replace(policy, include=tuple(config.bf16_layers))
            converted = convert_to_bf16_gemms(model, bf16_policy)
        policy = dataclasses.replace(policy, exclude=(*policy.exclude, *config.bf16_layers))
    return attention + converted + convert_to_fp8(model, policy).converted


def _apply_fp8_attention(model: nn.Module, patterns: tuple[str, ...]) -> list[str]:
    """Sets ``precision='fp8'`` on the attention modules whose names match ``patterns``."""
    layers = {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, AttentionPrecision)
    }
    chosen = []
    for pattern in patterns:
        matched = [name for name in layers if fnmatch.fnmatchcase(name, pattern)]
        if layers and not matched:  # (a model without a sequence tower has none to match)
            raise ValueError(
                f"precision.fp8_attention pattern {pattern!r} matches none of the model's "
                f"attention modules {sorted(layers)}"
            )
        chosen += [name for name in matched if name not in chosen]
    for name in chosen:
        layers[name].precision = "fp8"  # a 'block' layer refuses with a ValueError
    return chosen


def autocast(config: PrecisionConfig, device: torch.device) -> contextlib.AbstractContextManager:
    """The context of the forward pass: bf16 autocast on CUDA for ``'bf16'`` and ``'fp8'``
    (activations, norms' inputs and outputs, the attention inputs and every GEMM not in FP8
    in bf16, reductions in float32 as autocast's policy says); nothing elsewhere."""
    if device.type == "cuda" and config.mode != "fp32":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _keep(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


class SavedActivations:
    """``PrecisionConfig.saved_activations`` for the training step of one model.

    ``with saved.step(): loss = ...`` runs the forward under
    ``gem_precision.mx_saved_activations`` when the mode is ``'mx'`` (a no-op for ``'none'``);
    backward may run after the block. The torchrec embedding modules (sharded or not) of
    ``model`` push pass-through saved-tensor hooks around their own forward, so the lookups
    keep their saved tensors exact: the fused in-backward optimizer must see the real tables.
    ``last_stats`` holds the counters of the latest step (None for ``'none'``).
    """

    def __init__(self, model: nn.Module, config: PrecisionConfig) -> None:
        self.enabled = config.saved_activations == "mx"
        self.last_stats: SavedActivationStats | None = None
        self.excluded: list[str] = []
        if not self.enabled:
            return
        embedding_types = (ShardedModule, EmbeddingBagCollection, EmbeddingCollection)
        for name, module in model.named_modules():
            if isinstance(module, embedding_types) and not any(
                name.startswith(f"{outer}.") for outer in self.excluded
            ):
                self._exclude(module)
                self.excluded.append(name)

    @staticmethod
    def _exclude(module: nn.Module) -> None:
        """Innermost saved-tensor hooks win: pass-through ones shadow the MX ones."""
        active: list[torch.autograd.graph.saved_tensors_hooks] = []

        def enter(*_: object) -> None:
            hooks = torch.autograd.graph.saved_tensors_hooks(_keep, _keep)
            hooks.__enter__()
            active.append(hooks)

        def leave(*_: object) -> None:
            if active:
                active.pop().__exit__(None, None, None)

        module.register_forward_pre_hook(enter)
        module.register_forward_hook(leave, always_call=True)

    def step(self) -> contextlib.AbstractContextManager:
        """Context for one training forward; its counters become ``last_stats``."""
        if not self.enabled:
            return contextlib.nullcontext()
        self.last_stats = SavedActivationStats()
        return mx_saved_activations(stats=self.last_stats)

    def metrics(self) -> dict[str, float | None]:
        """Step-metric fields of the latest step (empty for ``'none'`` or before a step)."""
        stats = self.last_stats
        if stats is None:
            return {}
        return {
            "saved_act_bytes_fp": stats.bytes_before,
            "saved_act_bytes_mx": stats.bytes_after,
            "saved_act_bytes_saved": stats.bytes_saved,
            # None rather than NaN when nothing was packed: metrics.jsonl stays strict JSON.
            "saved_act_compression": stats.compression if stats.bytes_before else None,
            "saved_act_unpacked_bytes": stats.skipped_bytes,
        }
