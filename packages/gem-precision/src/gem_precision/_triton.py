"""Loads :mod:`gem_precision._quant_kernels` compiled (CUDA) or interpreted (CPU tests).

``triton.jit`` reads ``TRITON_INTERPRET`` when it decorates, so the kernel file is executed once
per mode under its own module name. CUDA tensors use the compiled kernels; CPU tensors use the
interpreter, but only when ``TRITON_INTERPRET=1`` is set at call time (it is slow).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import torch

__all__: list[str] = []

_MODULES: dict[bool, ModuleType] = {}
_UNSET = object()


def _runtime_knobs():
    """``triton.knobs.runtime`` where this Triton has it (3.4+), else None."""
    try:
        from triton import knobs
    except ImportError:  # pragma: no cover - older Triton reads the environment only
        return None
    return getattr(knobs, "runtime", None)


def interpret_requested() -> bool:
    """Whether ``TRITON_INTERPRET`` asks for the interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def triton_available() -> bool:
    """Whether ``triton`` can be imported here."""
    try:
        import triton  # noqa: F401
    except Exception:  # pragma: no cover - depends on the environment
        return False
    return True


def can_run(t: torch.Tensor) -> bool:
    """Whether the Triton kernels can run on tensors on ``t``'s device."""
    if not triton_available():
        return False
    return t.is_cuda or (t.device.type == "cpu" and interpret_requested())


def kernels(t: torch.Tensor) -> ModuleType:
    """The kernel module for ``t``'s device (compiled for CUDA, interpreted for CPU)."""
    if not can_run(t):
        raise RuntimeError(
            f"the Triton kernels need CUDA tensors (or CPU tensors with TRITON_INTERPRET=1), "
            f"got a tensor on {t.device}"
        )
    interpret = not t.is_cuda
    module = _MODULES.get(interpret)
    if module is not None:
        return module
    name = f"gem_precision._quant_kernels_{'interpreted' if interpret else 'compiled'}"
    spec = importlib.util.spec_from_file_location(
        name, Path(__file__).with_name("_quant_kernels.py")
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    # Some imports (torch._dynamo) pin triton.knobs.runtime.interpret, which then wins over
    # the environment: pin it to this mode while decorating, then put it back.
    runtime_knobs = _runtime_knobs()
    pinned = runtime_knobs.__dict__.get("interpret", _UNSET) if runtime_knobs else _UNSET
    if runtime_knobs is not None:
        runtime_knobs.__dict__["interpret"] = interpret
    try:
        sys.modules[name] = module
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    finally:
        if runtime_knobs is not None:
            if pinned is _UNSET:
                runtime_knobs.__dict__.pop("interpret", None)
            else:
                runtime_knobs.__dict__["interpret"] = pinned
        if previous is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = previous
    _MODULES[interpret] = module
    return module


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
