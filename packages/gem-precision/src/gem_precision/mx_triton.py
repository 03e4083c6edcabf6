"""MX quantise / dequantise as one-pass Triton kernels (bit-exact with :mod:`gem_precision.mx`).

Each program loads a tile of the input once, reduces the block maxima in registers, and writes
the FP8 elements and the E8M0 scale bytes: 3 bytes of traffic per bfloat16 element plus one
byte per block. Results equal :func:`gem_precision.quantize_mx` / :func:`dequantize_mx` bit for
bit (zeros, subnormals, NaN/Inf blocks and both scale roundings included). CUDA tensors run
compiled; CPU tensors run under the Triton interpreter when ``TRITON_INTERPRET=1`` is set.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gem_precision import _triton
from gem_precision.mx import (
    MXTensor,
    ScaleRounding,
    _check_quantize_args,
    _scale_shape,
)

__all__ = ["MxKernelConfig", "dequantize_mx_triton", "quantize_mx_triton"]


@dataclass(frozen=True)
class MxKernelConfig:
    """Tile shape and warps of the MX kernels (square blocks use ``block_size`` rows and at
    most 512 columns). The default was the fastest 1x32 configuration on an H200 (0.204 ms for
    65536 x 4096 bf16, 94% of HBM bandwidth; 32x32 blocks 0.201 ms), swept by
    ``benchmarks/bench_fp8_linear.py --sweep`` (``benchmarks/results/h200/fp8_linear.json``)."""

    block_rows: int = 8
    """Rows per program for 1 x block_size blocks (a power of two)."""
    block_cols: int = 1024
    """Columns per program (a power of two, a multiple of block_size)."""
    num_warps: int = 4
    """Warps per program."""


def _check_block_size(block_size: int) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise ValueError(f"block_size must be an int, got {block_size!r}")
    if block_size < 2 or block_size > 256 or block_size & (block_size - 1):
        raise ValueError(
            f"block_size must be a power of two in [2, 256] for the Triton kernels, "
            f"got {block_size}"
        )


def _grid_shape(rows: int, cols: int, block_size: int, square: bool, config: MxKernelConfig):
    block_c = max(config.block_cols, block_size)
    if square:
        # A square-block program holds block_size full rows: wider tiles spill (H200: a
        # 32x1024 tile ran at 40% of HBM bandwidth, 32x512 at 79%).
        block_c = max(block_size, min(block_c, 512))
    block_r = block_size if square else config.block_rows
    grid = (triton_cdiv(rows, block_r), triton_cdiv(cols, block_c))
    return block_r, block_c, grid


def triton_cdiv(a: int, b: int) -> int:
    """Ceiling division (a tiny helper so this module imports without Triton)."""
    return -(-a // b)


def quantize_mx_triton(
    x: torch.Tensor,
    *,
    block_size: int = 32,
    elem_dtype: torch.dtype = torch.float8_e4m3fn,
    scale_rounding: ScaleRounding = "floor",
    square: bool = False,
    config: MxKernelConfig | None = None,
) -> MXTensor:
    """:func:`gem_precision.quantize_mx` in one Triton pass (same arguments, same bits).

    ``block_size`` must be a power of two in [2, 256]. ``config`` overrides the tile shape.
    """
    _check_quantize_args(x, elem_dtype, scale_rounding)
    _check_block_size(block_size)
    scale_shape = _scale_shape(x.shape, block_size, "x", square)
    config = config or MxKernelConfig()
    x2 = x.contiguous().reshape(-1, x.shape[-1]) if x.dim() > 1 else x.reshape(1, -1)
    rows, cols = x2.shape
    data = torch.empty(x.shape, dtype=elem_dtype, device=x.device)
    scale = torch.empty(scale_shape, dtype=torch.uint8, device=x.device)
    if x.numel() > 0:
        k = _triton.kernels(x)
        soft = _triton.soft_fp8(x)
        block_r, block_c, grid = _grid_shape(rows, cols, block_size, square, config)
        x_arg, bf16_bits = _triton.float_arg(x2, soft)
        k.mx_quantize_kernel[grid](
            x_arg,
            _triton.fp8_arg(data, soft),
            scale,
            rows,
            cols,
            **_triton.fp8_constexprs(elem_dtype, soft),
            CEIL=scale_rounding == "ceil",
            SQUARE=square,
            BS=block_size,
            BF16_BITS=bf16_bits,
            BLOCK_R=block_r,
            BLOCK_C=block_c,
            num_warps=config.num_warps,
        )
    return MXTensor(
        data=data, scale=scale, block_size=block_size, orig_dtype=x.dtype, square=square
    )


def dequantize_mx_triton(
    mx: MXTensor, dtype: torch.dtype | None = None, *, config: MxKernelConfig | None = None
) -> torch.Tensor:
    """:func:`gem_precision.dequantize_mx` in one Triton pass (same bits)."""
    if not isinstance(mx, MXTensor):
        raise TypeError(f"mx must be an MXTensor, got {type(mx).__name__}")
    out_dtype = mx.orig_dtype if dtype is None else dtype
    if out_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"dtype must be float32, bfloat16 or float16, got {out_dtype}")
    _check_block_size(mx.block_size)
    config = config or MxKernelConfig()
    data = mx.data.contiguous()
    d2 = data.reshape(-1, data.shape[-1]) if data.dim() > 1 else data.reshape(1, -1)
    rows, cols = d2.shape
    out = torch.empty(data.shape, dtype=out_dtype, device=data.device)
    if data.numel() > 0:
        k = _triton.kernels(data)
        soft = _triton.soft_fp8(data)
        consts = _triton.fp8_constexprs(data.dtype, soft)
        block_r, block_c, grid = _grid_shape(rows, cols, mx.block_size, mx.square, config)
        out_arg, bf16_bits = _triton.float_arg(out, soft)
        k.mx_dequantize_kernel[grid](
            _triton.fp8_arg(d2, soft),
            mx.scale.contiguous(),
            out_arg,
            rows,
            cols,
            MBITS=consts["MBITS"],
            BIAS=consts["BIAS"],
            E4M3FN=data.dtype == torch.float8_e4m3fn,
            SOFT=soft,
            SQUARE=mx.square,
            BS=mx.block_size,
            BF16_BITS=bf16_bits,
            BLOCK_R=block_r,
            BLOCK_C=block_c,
            num_warps=config.num_warps,
        )
    return out
