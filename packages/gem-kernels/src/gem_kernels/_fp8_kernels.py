"""Triton kernel of the FP8 attention operands: E4M3 copies with one power-of-two scale per
128-token block of a sample and head (:func:`gem_kernels.reference.quantize_fp8_blocks` holds
the same numerics in PyTorch).

Loaded by :mod:`gem_kernels.fp8_quantize` through the kernel loader (never imported directly),
once per mode: compiled for CUDA, interpreted for the CPU tests.
"""

from __future__ import annotations

from pathlib import Path

import triton
import triton.language as tl

from gem_kernels.triton_loader import interpret_requested, load_kernel_module

# The E4M3 cast (with the interpreter's rounding workaround) is JFA's, in this file's mode.
_to_e4m3 = load_kernel_module(
    Path(__file__).with_name("_jfa_kernels.py"), interpret_requested()
)._to_e4m3


@triton.jit
def fp8_blocks_kernel(
    x_ptr,
    x8_ptr,
    scale_ptr,
    blocks_ptr,
    stride_xt,
    stride_xh,
    stride_8t,
    stride_8h,
    stride_8d,
    num_heads,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    PADDED: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """Program (block, head): rows ``[start, start + count)`` of the block table's row
    ``block`` (one sample's tokens, ``count <= BLOCK_T``), one head. Writes ``x8 = x / s`` in
    E4M3 and ``s`` on every row, ``s`` the smallest power of two with ``amax / s <= 448``
    (1 for a block of zeros), as exponent bits: no division, exact on every backend.

    ``x8`` is addressed by (token, head, column) strides. ``PADDED``: token ``t`` of the block
    goes to slot ``block * BLOCK_T + t`` and the block's ``BLOCK_T - count`` unused slots get
    zeros, so every block starts at a multiple of ``BLOCK_T`` slots."""
    block = tl.program_id(0)
    head = tl.program_id(1)
    start = tl.load(blocks_ptr + 2 * block).to(tl.int64)
    count = tl.load(blocks_ptr + 2 * block + 1)
    rows = tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < count
    mask = row_ok[:, None] & (cols[None, :] < HEAD_DIM)
    tokens = start + rows
    x = tl.load(x_ptr + tokens[:, None] * stride_xt + head * stride_xh + cols[None, :], mask=mask,
                other=0.0).to(tl.float32)  # fmt: skip
    amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
    bits = amax.to(tl.int32, bitcast=True)
    biased = (bits >> 23) & 0xFF
    # amax = 1.f * 2^E fits 448 * 2^e = 1.75 * 2^(8 + e) from e = E - 8 (+1 when 1.f > 1.75).
    e = biased - 127 - 8 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    e = tl.minimum(tl.maximum(e, -126), 127)
    # Zero, subnormal (below float32's smallest normal) and non-finite maxima: scale 1.
    e = tl.where((biased == 0) | (biased == 0xFF), 0, e)
    scale = ((e + 127) << 23).to(tl.float32, bitcast=True)
    inverse = ((127 - e) << 23).to(tl.float32, bitcast=True)  # finite inputs: e <= 120
    x8 = _to_e4m3(x * inverse, x8_ptr.dtype.element_ty, INTERPRETED)
    if PADDED:
        slots = block.to(tl.int64) * BLOCK_T + rows
        store_mask = (rows < BLOCK_T)[:, None] & (cols[None, :] < HEAD_DIM)
    else:
        slots = tokens
        store_mask = mask
    out = slots[:, None] * stride_8t + head * stride_8h + cols[None, :] * stride_8d
    tl.store(x8_ptr + out, x8, mask=store_mask)
    tl.store(scale_ptr + tokens * num_heads + head, tl.zeros([BLOCK_T], tl.float32) + scale,
             mask=row_ok)  # fmt: skip
