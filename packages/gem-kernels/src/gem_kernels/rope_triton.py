"""Triton rotary embedding: one kernel rotates the rows of q (or k) by their positions' table
rows, reading a strided view (a slice of the fused qkv projection) and writing a contiguous
result. Its gradient is the inverse rotation, the same kernel with the sines negated.

Inductor compiles RoPE's backward (undoing the slices and the concatenation of the rotate-half
form) into a kernel that runs at a fifth of the H200's bandwidth at the h200 recipe's shape
(``benchmarks/results/h200/tuning/rope_backward.json``); this kernel reads ``x`` once and writes
the output once, in both directions. The public, validating entry point is
:func:`gem_kernels.rope`.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import torch

from gem_kernels import _triton_host as host
from gem_kernels.triton_loader import load_kernel_module

__all__ = ["MAX_TRITON_HEAD_DIM", "rope", "triton_unsupported_reason"]

#: Largest head dimension the kernel takes (bigger ones go to the reference).
MAX_TRITON_HEAD_DIM = 256

# Tokens per program: a (32, D/2) tile per half at D = 128 keeps every load a full 128-byte
# line per row and leaves tens of thousands of programs at training sizes.
_BLOCK_T = 32

_KERNEL_FILE = Path(__file__).with_name("_rope_kernels.py")


def _kernels(interpret: bool) -> ModuleType:
    return load_kernel_module(_KERNEL_FILE, interpret)


def triton_unsupported_reason(x: torch.Tensor) -> str | None:
    """Why the kernel cannot rotate ``x`` ``(T, H, D)``, or ``None`` when it can: float16,
    bfloat16 or float32, head_dim up to ``MAX_TRITON_HEAD_DIM``, on CUDA (or any device under
    ``TRITON_INTERPRET=1``)."""
    return host.unsupported_reason(x, MAX_TRITON_HEAD_DIM)


def rope(
    x: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    inverse: bool,
    out: torch.Tensor | None = None,
    *,
    rotate: bool = True,
) -> torch.Tensor:
    """``x`` ``(T, H, D)`` rotated by the ``(L, D/2)`` float32 tables' rows at ``positions``
    (validated by the caller); ``inverse`` rotates the other way. Contiguous, in x's dtype, or
    written into ``out`` (``x``'s shape, unit stride in its last dimension: a slice of a fused
    gradient). ``rotate=False``: ``x`` copied as it is (``rope_qkv``'s v)."""
    interpret = host.interpret_for(x)
    x = host.unit_stride(x)
    num_tokens, num_heads, head_dim = x.shape
    if out is None:
        out = torch.empty((num_tokens, num_heads, head_dim), dtype=x.dtype, device=x.device)
    if num_tokens == 0 or num_heads == 0:
        return out
    half = head_dim // 2
    _kernels(interpret).rope_kernel[(-(-num_tokens // _BLOCK_T),)](
        x, out, positions.contiguous(), cos.contiguous(), sin.contiguous(),
        num_tokens, num_heads, cos.shape[0], x.stride(0), x.stride(1), out.stride(0),
        out.stride(1),
        HALF=half, BLOCK_T=_BLOCK_T, BLOCK_HALF=host.padded_block(half), INVERSE=inverse,
        ROTATE=rotate, num_warps=4,
    )  # fmt: skip
    return out
