"""Triton kernels of SwiGLU's gate (:mod:`gem_kernels.swiglu_triton`).

Loaded through ``gem_kernels.triton_loader`` (never imported directly): Triton decides at
decoration time whether ``@triton.jit`` compiles or interprets, so the loader executes this file
once per mode under distinct module names.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _gate_and_value(h_ptr, num_rows, width, stride_h, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """This program's tile: its rows (int64), columns, mask, and the gate and value halves of
    hidden there in float32."""
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows < num_rows)[:, None] & (cols < width)[None, :]
    gate_ptrs = h_ptr + rows[:, None] * stride_h + cols[None, :]
    gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
    value = tl.load(gate_ptrs + width, mask=mask, other=0.0).to(tl.float32)
    return rows, cols, mask, gate, value


@triton.jit(do_not_specialize=["num_rows"])
def swiglu_fwd_kernel(
    h_ptr,
    out_ptr,
    num_rows,
    width,
    stride_h,
    stride_o,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """``out[r, c] = silu(h[r, c]) * h[r, width + c]``: float32 math, one rounding."""
    rows, cols, mask, gate, value = _gate_and_value(
        h_ptr, num_rows, width, stride_h, BLOCK_R, BLOCK_C
    )
    out = gate * tl.sigmoid(gate) * value
    out = out.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :], out, mask=mask)


@triton.jit(do_not_specialize=["num_rows"])
def swiglu_bwd_kernel(
    h_ptr,
    grad_ptr,
    dh_ptr,
    num_rows,
    width,
    stride_h,
    stride_g,
    stride_dh,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Both halves of the gradient from one read of the gate, the value and ``grad``:
    ``d_gate = grad * value * s * (1 + gate * (1 - s))`` with ``s = sigmoid(gate)``, and
    ``d_value = grad * silu(gate)``."""
    rows, cols, mask, gate, value = _gate_and_value(
        h_ptr, num_rows, width, stride_h, BLOCK_R, BLOCK_C
    )
    grad = tl.load(grad_ptr + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0)
    grad = grad.to(tl.float32)
    sig = tl.sigmoid(gate)
    d_gate = grad * value * sig * (1.0 + gate * (1.0 - sig))
    d_value = grad * gate * sig
    dh_ptrs = dh_ptr + rows[:, None] * stride_dh + cols[None, :]
    tl.store(dh_ptrs, d_gate.to(dh_ptr.dtype.element_ty), mask=mask)
    tl.store(dh_ptrs + width, d_value.to(dh_ptr.dtype.element_ty), mask=mask)
