"""Triton kernel of the rotary embedding on q or k rows (:mod:`gem_kernels.rope_triton`).

Loaded through ``gem_kernels.triton_loader`` (never imported directly): Triton decides at
decoration time whether ``@triton.jit`` compiles or interprets, so the loader executes this file
once per mode under distinct module names.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["num_tokens"])
def rope_kernel(
    x_ptr,
    out_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    num_tokens,
    num_heads,
    num_positions,
    stride_xt,
    stride_xh,
    stride_ot,
    stride_oh,
    HALF: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    INVERSE: tl.constexpr,
    ROTATE: tl.constexpr,
):
    """Rotates ``BLOCK_T`` tokens, every head: ``(x1, x2) -> (x1 c - x2 s, x2 c + x1 s)`` with
    ``c, s`` the table rows of each token's position (``INVERSE``: ``-s``, the gradient). The
    table rows are gathered once and reused by all heads; math in float32, one rounding.
    ``ROTATE=False`` copies the rows as they are (v beside q and k, strided in or out), at the
    bandwidth of the rotation rather than of a strided ATen copy."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_HALF)
    row_ok = rows < num_tokens
    mask = row_ok[:, None] & (cols < HALF)[None, :]
    if ROTATE:
        positions = tl.load(pos_ptr + rows, mask=row_ok, other=0).to(tl.int64)
        table = positions[:, None] * HALF + cols[None, :]
        # A position outside the tables (unchecked on the GPU) reads nothing: its row is zeros.
        in_table = mask & ((positions >= 0) & (positions < num_positions))[:, None]
        cos = tl.load(cos_ptr + table, mask=in_table, other=0.0)
        sin = tl.load(sin_ptr + table, mask=in_table, other=0.0)
        if INVERSE:
            sin = -sin
    rows = rows.to(tl.int64)
    x_rows = x_ptr + rows[:, None] * stride_xt + cols[None, :]
    out_rows = out_ptr + rows[:, None] * stride_ot + cols[None, :]
    for head in range(num_heads):
        x1 = tl.load(x_rows + head * stride_xh, mask=mask, other=0.0)
        x2 = tl.load(x_rows + head * stride_xh + HALF, mask=mask, other=0.0)
        if ROTATE:
            x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
            first = (x1 * cos - x2 * sin).to(out_ptr.dtype.element_ty)
            second = (x2 * cos + x1 * sin).to(out_ptr.dtype.element_ty)
        else:
            first, second = x1, x2
        tl.store(out_rows + head * stride_oh, first, mask=mask)
        tl.store(out_rows + head * stride_oh + HALF, second, mask=mask)
