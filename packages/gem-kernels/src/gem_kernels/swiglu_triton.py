"""Triton SwiGLU gate: ``silu(gate) * value`` of the two halves of an up projection's rows, and
its gradient, each one pass over memory.

Inductor compiles SwiGLU's backward (the gradient of ``chunk`` is a concatenation) into one
kernel over the ``(T, 2H)`` gradient that loads the gate and the output gradient once for each
half, at 2.3 TB/s on the H200 at the h200 recipe's shape
(``benchmarks/results/h200/tuning/train_d512_profile.json``). This backward reads the gate,
the value and the output gradient once and writes both halves from the same program. Given the
up projection's bias, the kernels add it, and the backward sums its gradient from the rows it
holds (an ``nn.Linear`` bias's backward reads the whole ``(T, 2H)`` gradient again). The public,
validating entry point is :func:`gem_kernels.swiglu`.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import torch

from gem_kernels import _triton_host as host
from gem_kernels.triton_loader import load_kernel_module

__all__ = ["swiglu", "swiglu_backward", "triton_unsupported_reason"]

# An (8, 512) tile: long contiguous row segments per program (the fastest measured tile,
# docs/kernel-tuning.md).
_BLOCK_R, _BLOCK_C = 8, 512
# The backward with a bias loops over 512 rows per program in (4, 512) tiles and writes one row
# of float32 partial sums: few enough rows of partial sums to reduce cheaply, and registers
# left for the two accumulators (the measured choice, docs/kernel-tuning.md). A constant, so
# the summation order, and with it the result, is the same on every device.
_BIAS_BLOCK_R, _BIAS_ROWS_PER_PROGRAM = 4, 512

_KERNEL_FILE = Path(__file__).with_name("_swiglu_kernels.py")


def _kernels(interpret: bool) -> ModuleType:
    return load_kernel_module(_KERNEL_FILE, interpret)


def triton_unsupported_reason(hidden: torch.Tensor) -> str | None:
    """Why the kernels cannot run on ``hidden`` ``(T, 2H)``, or ``None`` when they can: float16,
    bfloat16 or float32 on CUDA (or any device under ``TRITON_INTERPRET=1``)."""
    return host.unsupported_reason(hidden, None)


def swiglu(hidden: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``(T, 2H)`` (and ``(2H,)`` bias) -> ``(T, H)`` contiguous, in hidden's dtype (validated
    by the caller)."""
    interpret = host.interpret_for(hidden)
    hidden = host.unit_stride(hidden)
    bias = None if bias is None else bias.contiguous()
    rows, width = hidden.shape[0], hidden.shape[1] // 2
    out = torch.empty((rows, width), dtype=hidden.dtype, device=hidden.device)
    if rows and width:
        grid = (-(-rows // _BLOCK_R), -(-width // _BLOCK_C))
        _kernels(interpret).swiglu_fwd_kernel[grid](
            hidden, hidden if bias is None else bias, out, rows, width, hidden.stride(0),
            out.stride(0), HAS_BIAS=bias is not None, BLOCK_R=_BLOCK_R, BLOCK_C=_BLOCK_C,
            num_warps=4,
        )  # fmt: skip
    return out


def swiglu_backward(
    grad_out: torch.Tensor, hidden: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The ``(T, 2H)`` gradient of ``hidden`` from ``grad_out`` ``(T, H)``, in hidden's dtype,
    and the bias gradient in the bias's dtype (``None`` without a bias)."""
    interpret = host.interpret_for(hidden)
    hidden, grad_out = host.unit_stride(hidden), host.unit_stride(grad_out)
    bias = None if bias is None else bias.contiguous()
    rows, width = hidden.shape[0], hidden.shape[1] // 2
    grad = torch.empty((rows, 2 * width), dtype=hidden.dtype, device=hidden.device)
    block_r, per_program = (
        (_BLOCK_R, _BLOCK_R) if bias is None else (_BIAS_BLOCK_R, _BIAS_ROWS_PER_PROGRAM)
    )
    programs = -(-rows // per_program)
    partials = None
    if bias is not None:
        # every (program, column) is written by the kernel
        partials = torch.empty((programs, 2 * width), dtype=torch.float32, device=hidden.device)
    if rows and width:
        _kernels(interpret).swiglu_bwd_kernel[(programs, -(-width // _BLOCK_C))](
            hidden, hidden if bias is None else bias, grad_out, grad,
            grad if partials is None else partials, rows, width, hidden.stride(0),
            grad_out.stride(0), grad.stride(0), per_program, HAS_BIAS=bias is not None,
            BLOCK_R=block_r, BLOCK_C=_BLOCK_C, num_warps=4,
        )  # fmt: skip
    if bias is None:
        return grad, None
    return grad, partials.sum(0).to(bias.dtype)
