"""Triton kernels of SwiGLU's gate (:mod:`gem_kernels.swiglu_triton`).

Loaded through ``gem_kernels.triton_loader`` (never imported directly): Triton decides at
decoration time whether ``@triton.jit`` compiles or interprets, so the loader executes this file
once per mode under distinct module names.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _gate_and_value(
    h_ptr, bias_ptr, rows, cols, num_rows, width, stride_h, HAS_BIAS: tl.constexpr
):  # fmt: skip
    """The mask and the gate and value halves of ``hidden (+ bias)`` at ``rows`` x ``cols``, in
    float32."""
    mask = (rows < num_rows)[:, None] & (cols < width)[None, :]
    gate_ptrs = h_ptr + rows[:, None] * stride_h + cols[None, :]
    gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
    value = tl.load(gate_ptrs + width, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        col_mask = cols < width
        gate += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        value += tl.load(bias_ptr + width + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    return mask, gate, value


@triton.jit(do_not_specialize=["num_rows"])
def swiglu_fwd_kernel(
    h_ptr,
    bias_ptr,
    out_ptr,
    num_rows,
    width,
    stride_h,
    stride_o,
    HAS_BIAS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """``out[r, c] = silu(gate) * value`` with ``gate = h[r, c] + bias[c]`` and ``value =
    h[r, width + c] + bias[width + c]``: float32 math, one rounding."""
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask, gate, value = _gate_and_value(
        h_ptr, bias_ptr, rows, cols, num_rows, width, stride_h, HAS_BIAS
    )
    out = gate * tl.sigmoid(gate) * value
    out = out.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :], out, mask=mask)


@triton.jit(do_not_specialize=["num_rows", "rows_per_program"])
def swiglu_bwd_kernel(
    h_ptr,
    bias_ptr,
    grad_ptr,
    dh_ptr,
    dbias_ptr,
    num_rows,
    width,
    stride_h,
    stride_g,
    stride_dh,
    rows_per_program,
    HAS_BIAS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Both halves of the gradient from one read of the gate, the value and ``grad``:
    ``d_gate = grad * value * s * (1 + gate * (1 - s))`` with ``s = sigmoid(gate)``, and
    ``d_value = grad * silu(gate)``, over ``rows_per_program`` rows (a multiple of ``BLOCK_R``).

    With ``HAS_BIAS`` the program also writes its rows' float32 column sums of both halves, the
    bias gradient's partial sums, to row ``program_id(0)`` of ``dbias`` ``(programs, 2 * width)``:
    the bias gradient costs no second read of hidden's gradient, and a fixed summation order
    keeps it deterministic."""
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    first = tl.program_id(0).to(tl.int64) * rows_per_program
    sum_gate = tl.zeros((BLOCK_R, BLOCK_C), tl.float32)
    sum_value = tl.zeros((BLOCK_R, BLOCK_C), tl.float32)
    for start in range(0, rows_per_program, BLOCK_R):
        rows = first + start + tl.arange(0, BLOCK_R)
        mask, gate, value = _gate_and_value(
            h_ptr, bias_ptr, rows, cols, num_rows, width, stride_h, HAS_BIAS
        )
        grad = tl.load(grad_ptr + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0)
        grad = grad.to(tl.float32)
        sig = tl.sigmoid(gate)
        d_gate = grad * value * sig * (1.0 + gate * (1.0 - sig))
        d_value = grad * gate * sig
        dh_ptrs = dh_ptr + rows[:, None] * stride_dh + cols[None, :]
        tl.store(dh_ptrs, d_gate.to(dh_ptr.dtype.element_ty), mask=mask)
        tl.store(dh_ptrs + width, d_value.to(dh_ptr.dtype.element_ty), mask=mask)
        if HAS_BIAS:
            # masked-off elements load a zero grad, so their d_gate and d_value are zero
            sum_gate += d_gate
            sum_value += d_value
    if HAS_BIAS:
        partial = dbias_ptr + tl.program_id(0).to(tl.int64) * (2 * width) + cols
        col_mask = cols < width
        tl.store(partial, tl.sum(sum_gate, 0), mask=col_mask)
        tl.store(partial + width, tl.sum(sum_value, 0), mask=col_mask)
