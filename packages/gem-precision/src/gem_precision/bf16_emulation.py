"""A bf16-GEMM baseline with the same structure as :class:`~gem_precision.Fp8Linear`.

:class:`Bf16GemmLinear` keeps float32 master weights and rounds both operands of each of its
three GEMMs (forward, dgrad, wgrad) to bfloat16, then multiplies in float32: the numerics of a
bf16 tensor-core GEMM with float32 accumulation, on any device. It is the honest "bf16" peer of
the emulated FP8 layer when comparing model quality on a CPU (where autocast would change other
ops too and the FP8 layer is itself emulated).
"""

from __future__ import annotations

import torch
from torch import nn

from gem_precision.linear import (
    Fp8Linear,
    PrecisionPolicy,
    _sharing_parameters_of,
    _swap_linears,
)

__all__ = ["Bf16GemmLinear", "convert_to_bf16_gemms"]


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(torch.float32)


class _Bf16GemmFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, weight):
        ctx.save_for_backward(x2d, weight)
        return _bf16(x2d) @ _bf16(weight).T

    @staticmethod
    def backward(ctx, grad_out):
        x2d, weight = ctx.saved_tensors
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = (_bf16(grad_out) @ _bf16(weight)).to(x2d.dtype)
        if ctx.needs_input_grad[1]:
            grad_w = (_bf16(grad_out).T @ _bf16(x2d)).to(weight.dtype)
        return grad_x, grad_w


class Bf16GemmLinear(nn.Linear):
    """``nn.Linear`` whose GEMM operands are rounded to bfloat16 (float32 accumulation).

    Parameters keep their dtype (the master copy); the bias is added in high precision.
    """

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Bf16GemmLinear:
        """Wrap an existing ``nn.Linear``, sharing (not copying) its parameters."""
        return _sharing_parameters_of(cls, linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T + b`` with bf16-rounded GEMM operands; leading dims are kept."""
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"the last dim of x must be in_features={self.in_features}, got {tuple(x.shape)}"
            )
        x2d = x.reshape(-1, self.in_features)
        out = _Bf16GemmFunction.apply(x2d, self.weight).to(x.dtype)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.reshape(*x.shape[:-1], self.out_features)


def convert_to_bf16_gemms(module: nn.Module, policy: PrecisionPolicy | None = None) -> list[str]:
    """Replace (in place) the ``nn.Linear`` layers that ``policy`` would make FP8 with
    :class:`Bf16GemmLinear`, so an FP8 run and its bf16 baseline differ only in the format.

    Returns the qualified names of the converted layers.
    """
    converted, _ = _swap_linears(
        module,
        policy or PrecisionPolicy(),
        Bf16GemmLinear.from_linear,
        skip=(Fp8Linear, Bf16GemmLinear),
        hint="use Bf16GemmLinear.from_linear",
    )
    return converted
