"""Loads :mod:`gem_precision._quant_kernels` compiled (CUDA) or interpreted (CPU tests).

The loading itself is :func:`gem_kernels.triton_loader.load_kernel_module` (one module per
mode, since ``triton.jit`` reads the mode when it decorates). CUDA tensors use the compiled
kernels; CPU tensors use the interpreter, but only when ``TRITON_INTERPRET=1`` is set at call
time (it is slow).
"""

from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType

import torch
from gem_kernels.triton_loader import interpret_requested, load_kernel_module, triton_importable

__all__: list[str] = []

_KERNEL_FILE = Path(__file__).with_name("_quant_kernels.py")


def triton_available() -> bool:
    """Whether ``triton`` can be imported here."""
    return triton_importable()


def can_run(t: torch.Tensor) -> bool:
    """Whether the Triton kernels can run on tensors on ``t``'s device."""
    if not triton_importable():
        return False
    return t.is_cuda or (t.device.type == "cpu" and interpret_requested())


def kernels(t: torch.Tensor) -> ModuleType:
    """The kernel module for ``t``'s device (compiled for CUDA, interpreted for CPU)."""
    if not can_run(t):
        raise RuntimeError(
            f"the Triton kernels need CUDA tensors (or CPU tensors with TRITON_INTERPRET=1), "
            f"got a tensor on {t.device}"
        )
    return load_kernel_module(_KERNEL_FILE, interpret=not t.is_cuda)


_FP8_LAYOUT = {
    torch.float8_e4m3fn: (3, 7),
    torch.float8_e5m2: (2, 15),
}


def soft_fp8(t: torch.Tensor) -> bool:
    """Whether kernels round to FP8 in integer arithmetic rather than with the hardware cast.

    The interpreter's FP8 conversion is not exact for subnormals, so CPU runs always use the
    integer path; ``GEM_PRECISION_SOFT_FP8=1`` forces it on CUDA too.
    """
    return not t.is_cuda or os.environ.get("GEM_PRECISION_SOFT_FP8", "0") == "1"


def fp8_constexprs(dtype: torch.dtype, soft: bool) -> dict:
    """The FP8-format constexpr arguments shared by the kernels."""
    from gem_precision.mx import MX_ELEMENT_DTYPES

    fmt = MX_ELEMENT_DTYPES[dtype]
    mbits, bias = _FP8_LAYOUT[dtype]
    return {
        "EMAX": fmt.emax,
        "MAX_NORMAL": fmt.max_normal,
        "MBITS": mbits,
        "BIAS": bias,
        "SOFT": soft,
    }


def fp8_arg(t: torch.Tensor, soft: bool) -> torch.Tensor:
    """The FP8 tensor as the kernels expect it: a uint8 view for the integer path."""
    return t.view(torch.uint8) if soft else t


def float_arg(t: torch.Tensor, soft: bool) -> tuple[torch.Tensor, bool]:
    """A float tensor for the kernels and whether it travels as raw bfloat16 bits (int16)."""
    if soft and t.dtype == torch.bfloat16:
        return t.view(torch.int16), True
    return t, False
