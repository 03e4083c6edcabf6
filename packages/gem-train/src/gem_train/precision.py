"""Applies ``TrainConfig.precision`` to the dense linear layers of a model (gem-precision)."""

from __future__ import annotations

import dataclasses

from gem_precision import Fp8Recipe, PrecisionPolicy, convert_to_bf16_gemms, convert_to_fp8
from torch import nn

from gem_train.config import PrecisionConfig

__all__ = ["apply_precision", "precision_policy"]


def precision_policy(config: PrecisionConfig) -> PrecisionPolicy:
    """The gem-precision policy (layer selection and FP8 recipe) described by ``config``."""
    return PrecisionPolicy(
        exclude=tuple(config.exclude),
        min_features=config.min_features,
        recipe=Fp8Recipe(
            wgrad_in_bf16=config.wgrad_in_bf16,
            tensorwise=config.tensorwise,
            stochastic_rounding_grads=config.stochastic_rounding_grads,
            hadamard=config.hadamard,
        ),
    )


def apply_precision(model: nn.Module, config: PrecisionConfig) -> list[str]:
    """Converts the selected ``nn.Linear`` layers of ``model`` in place; returns their names.

    ``mode='fp32'`` changes nothing; ``'fp8'`` swaps in ``Fp8Linear`` (``Bf16GemmLinear`` for
    layers matching ``bf16_layers``); ``'bf16'`` swaps in ``Bf16GemmLinear`` (bf16-rounded GEMM
    operands, float32 accumulation and master weights).
    Embedding tables and attention kernels are not linear layers and keep their precision.
    """
    if config.mode == "fp32":
        return []
    policy = precision_policy(config)
    if config.mode == "bf16":
        return convert_to_bf16_gemms(model, policy)
    converted = []
    if config.bf16_layers:
        bf16_policy = dataclasses.replace(policy, include=tuple(config.bf16_layers))
        converted = convert_to_bf16_gemms(model, bf16_policy)
        policy = dataclasses.replace(policy, exclude=(*policy.exclude, *config.bf16_layers))
    return converted + convert_to_fp8(model, policy).converted
