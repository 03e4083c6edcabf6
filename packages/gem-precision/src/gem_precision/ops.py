"""The FP8 quantise and GEMM paths as PyTorch operators (``torch.ops.gem_precision.*``).

:func:`~gem_precision.quantize_operand`, :func:`~gem_precision.scaled_mm_nt`,
:func:`~gem_precision.norm_quantize`, :class:`~gem_precision.Fp8Linear` (every recipe) and
the fused path of :class:`~gem_precision.Fp8NormLinear` check
their arguments and run these operators, so ``torch.compile`` sees each call as one opaque node
(shapes from the fake implementations) and a model using them compiles without graph breaks;
AOTAutograd traces the linears' registered backwards, themselves operators:

==================================  ==========================================================
operator                            returns
==================================  ==========================================================
``quantize_operand``                the requested layouts of the ``Fp8Operand``, in order:
                                    ``data, scale`` (rows), ``data_t, scale_t`` (cols),
                                    ``col_sum``
``scaled_mm_nt``                    ``(M, N)`` ``out_dtype`` (differentiable in ``bias``)
``fp8_linear``                      ``(out, x_t, x_t_scale, w_t, w_t_scale)``: the output and
                                    the FP8 copies the backward reads
``fp8_linear_backward``             ``[grad_x] + [grad_w] + [grad_b]``, those asked for
``mx_linear``                       ``(out, w_data, w_scale)``: the 32x32-block MX weight the
                                    input gradient reads
``mx_linear_backward``              as ``fp8_linear_backward``
``fp8_hadamard_linear``             ``(M, N)`` float32, no bias (linear.py)
``fp8_hadamard_linear_backward``    ``[grad_x] + [grad_w]``, those asked for (linear.py)
``norm_quantize``                   ``(data, scale, mean, rstd)`` (fused_norm.py)
``fp8_norm_linear``                 ``(out, mean, rstd, w_t, w_t_scale)`` (fused_norm.py)
``fp8_norm_linear_backward``        the gradients asked for, in input order (fused_norm.py)
``advance_offset``                  a copy of ``offset`` (int64), to which it then adds ``n``
                                    in place
==================================  ==========================================================

(schemas: the ``_*_SCHEMA`` strings here, in :mod:`gem_precision.fused_norm` and in
:mod:`gem_precision.linear`). Arguments
mean what they mean in the public functions and in :class:`~gem_precision.Fp8Recipe`;
``stochastic_seed`` is the recipe's seed when output gradients are rounded stochastically
(else None) and ``sr_offset`` then the Philox counter of the step, a one-element int64
tensor on the input's device (None without stochastic rounding or backward): a tensor, not an
int, so that a compiled training loop keeps one graph while the counter moves every step, and
read on the device, not the host. A forward saves it for its backward, which passes it on to
the quantisation of the output gradient. :class:`~gem_precision.Fp8Linear` takes it from
``advance_offset`` on its counter buffer. ``need_*_grad`` say which layouts a forward
quantises for its backward (the operator runs below autograd and cannot see
``requires_grad``) and a backward's ``need_*`` which gradients it returns; ``native`` runs ``torch._scaled_mm``. ``fp8_linear_backward``'s
``x`` is the input itself when the weight gradient is a bfloat16 GEMM (``wgrad_in_bf16``),
else None. Outputs a backward reads but that carry no gradient are marked non-differentiable;
a tensor an output has no use for is empty; FP8 copies saved for a backward travel as raw
bytes (uint8), so that tools which treat an operator's outputs as numbers (opcheck's
AOTAutograd check sums them) work on CPU, where torch has no FP8 arithmetic. Quantising and
GEMMs are not differentiable (FP8 data, power-of-two scales).

The operators are opaque, not ``torch.library.triton_op``: they pick Triton, ``_scaled_mm`` or
the PyTorch emulation at run time, and their kernels take host-side launch options. Defined
like the attention operators of ``gem_kernels.ops``: with ``torch.library.Library`` (not
``custom_op``, whose wrapper imports ``torch._dynamo`` at the first eager call, after which the
Triton interpreter of the CPU tests cannot run, and costs host time per call), fake and
autograd implementations from ``register_fake`` / ``register_autograd``. The backward operators
raise when differentiated: the linears are once-differentiable, as before.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from gem_kernels.library import OperatorLibrary

from gem_precision.blockwise import BLOCK, Fp8Operand, _gemm_k, _gemm_rows, _quantize_operand
from gem_precision.mx import MXTensor, quantize_mx
from gem_precision.scaled_gemm import _gemm_out_dtype, _scaled_mm_nt, mx_scaled_mm_nt

__all__: list[str] = []

_QUANTIZE_SCHEMA = (
    "(Tensor x, str kind, ScalarType dtype, bool rows, bool cols, int? stochastic_seed, "
    "SymInt offset, bool col_sum, bool col_tiles, str backend) -> Tensor[]"
)
_SCALED_MM_SCHEMA = (
    "(Tensor a_data, Tensor a_scale, str a_kind, Tensor b_data, Tensor b_scale, str b_kind, "
    "ScalarType out_dtype, bool native, Tensor? bias) -> Tensor"
)
_LINEAR_SCHEMA = (
    "(Tensor x, Tensor weight, Tensor? bias, ScalarType fp8_dtype, ScalarType grad_dtype, "
    "bool tensorwise, bool wgrad_in_bf16, bool wgrad_x_tiles, int? stochastic_seed, "
    "Tensor? sr_offset, bool need_x_grad, bool need_w_grad, bool native) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor)"
)
_LINEAR_BACKWARD_SCHEMA = (
    "(Tensor grad_out, Tensor x_t, Tensor x_t_scale, Tensor? x, Tensor w_t, Tensor w_t_scale, "
    "Tensor? sr_offset, ScalarType fp8_dtype, ScalarType grad_dtype, bool tensorwise, "
    "bool x_t_tiles, int? stochastic_seed, SymInt in_features, ScalarType w_dtype, "
    "ScalarType? bias_dtype, bool need_x, bool need_w, bool need_b, bool native) -> Tensor[]"
)

_MX_LINEAR_SCHEMA = (
    "(Tensor x, Tensor weight, Tensor? bias, ScalarType fp8_dtype, ScalarType grad_dtype, "
    "str scale_rounding, bool need_x_grad, bool native) -> (Tensor, Tensor, Tensor)"
)
_MX_LINEAR_BACKWARD_SCHEMA = (
    "(Tensor grad_out, Tensor x, Tensor w_data, Tensor w_scale, ScalarType fp8_dtype, "
    "ScalarType grad_dtype, str scale_rounding, ScalarType w_dtype, ScalarType? bias_dtype, "
    "bool need_x, bool need_w, bool need_b, bool native) -> Tensor[]"
)

_LIBRARY = OperatorLibrary("gem_precision")
_operator, _fake, _autograd = _LIBRARY.operator, _LIBRARY.fake, _LIBRARY.autograd
_once_differentiable = _LIBRARY.once_differentiable


def _not_differentiable(name: str) -> None:
    """``gem_precision::<name>``'s outputs (FP8 data, power-of-two scales, column sums) carry
    no gradient, whatever its inputs."""

    def setup_context(ctx, inputs, output):
        ctx.mark_non_differentiable(*output)

    def backward(ctx, *grads):  # pragma: no cover - no output is differentiable
        raise RuntimeError(f"gem_precision::{name} is not differentiable")

    _autograd(name, backward, setup_context)


def _unaliased(outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor | None]):
    """``outputs`` with copies for those sharing memory with an input or an earlier output (an
    operator's outputs must be fresh): a one-element tensorwise scale serves both layouts, and
    ``.t().contiguous()`` of a one-row or one-column tensor is a view."""
    seen = {t.untyped_storage().data_ptr() for t in inputs if t is not None and t.numel()}
    fresh = []
    for t in outputs:
        ptr = t.untyped_storage().data_ptr()
        if t.numel() and ptr in seen:
            t = t.clone()
            ptr = t.untyped_storage().data_ptr()
        seen.add(ptr)
        fresh.append(t)
    return fresh


# ---------------------------------------------------------------------------------------------
# Shapes of quantised operands (the fake implementations).


def _scale_like(x: torch.Tensor, shape) -> torch.Tensor:
    return x.new_empty(shape, dtype=torch.float32)


def _outer_dim_major_scale(x: torch.Tensor, rows, blocks) -> torch.Tensor:
    """(rows, blocks) float32 with strides (1, rows): 1x128 scales as ``_scaled_mm`` reads them."""
    return x.new_empty_strided((rows, blocks), (1, rows), dtype=torch.float32)


def _fake_layouts(x, kind, dtype, rows, cols, col_tiles, gemm_padded=False) -> list[torch.Tensor]:
    """Fake ``data, scale`` (``rows``) and ``data_t, scale_t`` (``cols``) of ``x`` (R, C)
    (``gemm_padded``: rows and columns as ``_quantize_operand`` stores them for the native
    GEMMs)."""
    r, c = x.shape
    rq, rt, cq = r, r, c
    if gemm_padded and kind == "1x128":
        rq, rt, cq = _gemm_rows(r, False), _gemm_rows(r, True), _gemm_k(c)
    nr, nc = -(-rt // BLOCK), -(-c // BLOCK)
    out: list[torch.Tensor] = []
    if rows:
        out.append(x.new_empty((rq, cq), dtype=dtype))
        if kind == "1x128":
            out.append(_outer_dim_major_scale(x, rq, -(-cq // BLOCK)))
        elif kind == "128x128":
            out.append(_scale_like(x, (nr, nc)))
        else:
            out.append(_scale_like(x, ()))
    if cols:
        out.append(x.new_empty((c, rt), dtype=dtype))
        if kind == "1x128" and col_tiles:
            out.append(_scale_like(x, (nc, nr)))
        elif kind == "1x128":
            out.append(_outer_dim_major_scale(x, c, nr))
        elif kind == "128x128":
            out.append(_scale_like(x, (nc, nr)))
        else:
            out.append(_scale_like(x, ()))
    return out


# ---------------------------------------------------------------------------------------------
# Quantise.


def _operand_tensors(op: Fp8Operand, rows: bool, cols: bool, col_sum: bool) -> list[torch.Tensor]:
    out = []
    if rows:
        out += [op.data, op.scale]
    if cols:
        out += [op.data_t, op.scale_t]
    if col_sum:
        out.append(op.col_sum)
    return out


@_operator("quantize_operand", _QUANTIZE_SCHEMA)
def _quantize(x, kind, dtype, rows, cols, stochastic_seed, offset, col_sum, col_tiles, backend):
    op = _quantize_operand(
        x, kind, dtype, rows, cols, stochastic_seed, offset, col_sum, col_tiles, backend
    )
    return _unaliased(_operand_tensors(op, rows, cols, col_sum), [x])


@_fake("quantize_operand")
def _quantize_fake(x, kind, dtype, rows, cols, stochastic_seed, offset, col_sum, col_tiles, _):
    out = _fake_layouts(x, kind, dtype, rows, cols, col_tiles)
    if col_sum:
        out.append(x.new_empty((x.shape[1],), dtype=torch.float32))
    return out


_not_differentiable("quantize_operand")


# ---------------------------------------------------------------------------------------------
# Scaled GEMM.


@_operator("scaled_mm_nt", _SCALED_MM_SCHEMA)
def _scaled_mm(a_data, a_scale, a_kind, b_data, b_scale, b_kind, out_dtype, native, bias):
    out = _scaled_mm_nt(a_data, a_scale, a_kind, b_data, b_scale, b_kind, out_dtype, native, bias)
    return _unaliased([out], [a_data, a_scale, b_data, b_scale, bias])[0]


@_fake("scaled_mm_nt")
def _scaled_mm_fake(a_data, a_scale, a_kind, b_data, b_scale, b_kind, out_dtype, native, bias):
    return a_data.new_empty((a_data.shape[0], b_data.shape[0]), dtype=out_dtype)


def _scaled_mm_setup_context(ctx, inputs, output):
    bias = inputs[-1]
    ctx.bias_dtype = None if bias is None else bias.dtype


def _scaled_mm_backward(ctx, grad_out):
    # Only the bias is differentiable: it is added to every row of the output.
    grad_bias = None
    if ctx.needs_input_grad[8]:
        grad_bias = grad_out.sum(0, dtype=torch.float32).to(ctx.bias_dtype)
    return (None,) * 8 + (grad_bias,)


_autograd("scaled_mm_nt", _scaled_mm_backward, _scaled_mm_setup_context)


# ---------------------------------------------------------------------------------------------
# The stochastic rounding counter.


@_operator("advance_offset", "(Tensor(a!) offset, SymInt n) -> Tensor")
def _advance_offset(offset, n):
    # One operator rather than ``clone`` and ``add_`` in the module: under torch.compile the
    # partitioner may save the buffer itself for the backward instead of a cheap copy of it,
    # and the backward would then read the advanced value (seen with inductor). An operator's
    # output is saved as it is.
    old = offset.clone()
    offset.add_(n)
    return old


@_fake("advance_offset")
def _advance_offset_fake(offset, n):
    return torch.empty_like(offset)


# ---------------------------------------------------------------------------------------------
# The blockwise / tensorwise FP8 linear.


def _kinds(tensorwise: bool) -> tuple[str, str]:
    return ("tensorwise", "tensorwise") if tensorwise else ("1x128", "128x128")


def _x_t_plan(tensorwise, wgrad_in_bf16, wgrad_x_tiles, need_w_grad) -> tuple[bool, bool]:
    """(quantise x.T for an FP8 wgrad?, with 128x128 tiles?)."""
    fp8_wgrad = need_w_grad and not wgrad_in_bf16
    return fp8_wgrad, fp8_wgrad and wgrad_x_tiles and not tensorwise


@_operator("fp8_linear", _LINEAR_SCHEMA)
def _linear(
    x, weight, bias, fp8_dtype, grad_dtype, tensorwise, wgrad_in_bf16, wgrad_x_tiles,
    stochastic_seed, sr_offset, need_x_grad, need_w_grad, native,
):  # fmt: skip
    act_kind, w_kind = _kinds(tensorwise)
    x_t, x_t_tiles = _x_t_plan(tensorwise, wgrad_in_bf16, wgrad_x_tiles, need_w_grad)
    xq = _quantize_operand(
        x, act_kind, fp8_dtype, True, x_t, None, 0, False, x_t_tiles, "auto", gemm_padded=native
    )
    wq = _quantize_operand(
        weight, w_kind, fp8_dtype, True, need_x_grad, None, 0, False, False, "auto"
    )
    out = _scaled_mm_nt(
        xq.data, xq.scale, act_kind, wq.data, wq.scale, w_kind,
        _gemm_out_dtype(x.dtype), native, bias,
    )[: x.shape[0]].to(x.dtype)  # fmt: skip
    empty_bytes = x.new_empty((0,), dtype=torch.uint8)
    empty_scale = x.new_empty((0,), dtype=torch.float32)
    saved = [
        xq.data_t.view(torch.uint8) if x_t else empty_bytes,
        xq.scale_t if x_t else empty_scale,
        wq.data_t.view(torch.uint8) if need_x_grad else empty_bytes.clone(),
        wq.scale_t if need_x_grad else empty_scale.clone(),
    ]
    return tuple(_unaliased([out, *saved], [x, weight, bias]))


@_fake("fp8_linear")
def _linear_fake(
    x, weight, bias, fp8_dtype, grad_dtype, tensorwise, wgrad_in_bf16, wgrad_x_tiles,
    stochastic_seed, sr_offset, need_x_grad, need_w_grad, native,
):  # fmt: skip
    act_kind, w_kind = _kinds(tensorwise)
    x_t, x_t_tiles = _x_t_plan(tensorwise, wgrad_in_bf16, wgrad_x_tiles, need_w_grad)
    out = x.new_empty((x.shape[0], weight.shape[0]))
    empty = [x.new_empty((0,), dtype=torch.uint8), x.new_empty((0,), dtype=torch.float32)]
    saved_x = (
        _fake_layouts(x, act_kind, torch.uint8, False, True, x_t_tiles, native) if x_t else empty
    )
    saved_w = (
        _fake_layouts(weight, w_kind, torch.uint8, False, True, False)
        if need_x_grad
        else [t.clone() for t in empty]
    )
    return (out, *saved_x, *saved_w)


def _linear_setup_context(ctx, inputs, output):
    x, weight, bias, fp8_dtype, grad_dtype, tensorwise, wgrad_in_bf16, wgrad_x_tiles = inputs[:8]
    stochastic_seed, sr_offset, need_x_grad, need_w_grad, native = inputs[8:]
    _, x_t, x_t_scale, w_t, w_t_scale = output
    ctx.mark_non_differentiable(x_t, x_t_scale, w_t, w_t_scale)
    # The bfloat16 wgrad multiplies the input itself; the FP8 GEMMs read the FP8 copies only.
    saved_x = x if need_w_grad and wgrad_in_bf16 else None
    ctx.save_for_backward(x_t, x_t_scale, saved_x, w_t, w_t_scale, sr_offset)
    ctx.options = (
        fp8_dtype,
        grad_dtype,
        tensorwise,
        _x_t_plan(tensorwise, wgrad_in_bf16, wgrad_x_tiles, need_w_grad)[1],
        stochastic_seed,
        weight.shape[1],
        weight.dtype,
        None if bias is None else bias.dtype,
    )
    ctx.computed = (need_x_grad, need_w_grad, native)


def _linear_backward(ctx, grad_out, *_):
    need_x_grad, need_w_grad, native = ctx.computed
    need_x = ctx.needs_input_grad[0] and need_x_grad
    need_w = ctx.needs_input_grad[1] and need_w_grad
    need_b = ctx.needs_input_grad[2]
    grads = torch.ops.gem_precision.fp8_linear_backward(
        grad_out, *ctx.saved_tensors, *ctx.options, need_x, need_w, need_b, native
    )
    grads = list(grads)
    grad_x = grads.pop(0) if need_x else None
    grad_w = grads.pop(0) if need_w else None
    grad_b = grads.pop(0) if need_b else None
    return (grad_x, grad_w, grad_b) + (None,) * 10


_autograd("fp8_linear", _linear_backward, _linear_setup_context)


def _bf16_wgrad(grad_out: torch.Tensor, x: torch.Tensor, native: bool) -> torch.Tensor:
    """``grad_out.T @ x`` as a bf16 GEMM (the ``wgrad_in_bf16`` option): bf16 operands, float32
    accumulation, a bf16 result (what ``torch.mm`` of bf16 tensors returns on the GPU; the
    emulation rounds the same way)."""
    g, x = grad_out.to(torch.bfloat16), x.to(torch.bfloat16)
    if native:
        return g.T @ x
    return (g.float().T @ x.float()).to(torch.bfloat16)


@_operator("fp8_linear_backward", _LINEAR_BACKWARD_SCHEMA)
def _linear_backward_impl(
    grad_out, x_t, x_t_scale, x, w_t, w_t_scale, sr_offset, fp8_dtype, grad_dtype, tensorwise,
    x_t_tiles, stochastic_seed, in_features, w_dtype, bias_dtype, need_x, need_w, need_b,
    native,
):  # fmt: skip
    act_kind, w_kind = _kinds(tensorwise)
    fp8_wgrad = need_w and x is None
    inputs = [grad_out, x_t, x_t_scale, x, w_t, w_t_scale, sr_offset]
    x_t, w_t = x_t.view(fp8_dtype), w_t.view(fp8_dtype)
    grad_out = grad_out.contiguous()
    if need_x or fp8_wgrad or need_b:
        gq = _quantize_operand(
            grad_out, act_kind, grad_dtype, need_x, fp8_wgrad, stochastic_seed,
            0 if sr_offset is None else sr_offset, need_b, False, "auto", gemm_padded=native,
        )  # fmt: skip
    x_dtype = grad_out.dtype
    grads = []
    if need_x:
        # dgrad: dy (M, N) @ W (N, K) = dy @ (W.T).T, reduction over N.
        grad_x = _scaled_mm_nt(
            gq.data, gq.scale, act_kind, w_t, w_t_scale, w_kind,
            _gemm_out_dtype(x_dtype), native, None,
        )[: grad_out.shape[0]]  # fmt: skip
        grads.append(grad_x.to(x_dtype))
    if need_w:
        if fp8_wgrad:
            # wgrad: dy.T (N, M) @ x (M, K) = dy.T @ (x.T).T, reduction over tokens M.
            grad_w = _scaled_mm_nt(
                gq.data_t, gq.scale_t, act_kind, x_t, x_t_scale,
                "128x128" if x_t_tiles else act_kind, _gemm_out_dtype(w_dtype), native, None,
            )  # fmt: skip
        else:
            grad_w = _bf16_wgrad(grad_out, x, native)
        grads.append(grad_w.to(w_dtype))
    if need_b:
        grads.append(gq.col_sum.to(bias_dtype))  # summed in the quantisation pass
    return _unaliased(grads, inputs)


@_fake("fp8_linear_backward")
def _linear_backward_fake(
    grad_out, x_t, x_t_scale, x, w_t, w_t_scale, sr_offset, fp8_dtype, grad_dtype, tensorwise,
    x_t_tiles, stochastic_seed, in_features, w_dtype, bias_dtype, need_x, need_w, need_b,
    native,
):  # fmt: skip
    m, n = grad_out.shape
    grads = []
    if need_x:
        grads.append(grad_out.new_empty((m, in_features)))
    if need_w:
        grads.append(grad_out.new_empty((n, in_features), dtype=w_dtype))
    if need_b:
        grads.append(grad_out.new_empty((n,), dtype=bias_dtype))
    return grads


_once_differentiable("fp8_linear_backward")


# ---------------------------------------------------------------------------------------------
# The MXFP8 linear (Blackwell recipe): 1x32 E8M0 blocks along each GEMM's reduction dim.

_MX_BLOCK = 32


def _mx(x: torch.Tensor, dtype: torch.dtype, scale_rounding: str, square: bool = False):
    return quantize_mx(
        x.contiguous(), block_size=_MX_BLOCK, elem_dtype=dtype, scale_rounding=scale_rounding,
        square=square,
    )  # fmt: skip


@_operator("mx_linear", _MX_LINEAR_SCHEMA)
def _mx_linear(x, weight, bias, fp8_dtype, grad_dtype, scale_rounding, need_x_grad, native):
    # 32x32 weight squares: one quantisation serves W (forward) and W.T (dgrad).
    wq = _mx(weight, fp8_dtype, scale_rounding, square=True)
    xq = _mx(x, fp8_dtype, scale_rounding)
    out = mx_scaled_mm_nt(xq, wq, out_dtype=_gemm_out_dtype(x.dtype), native=native)
    if bias is not None:
        out = out + bias.to(out.dtype)
    out = out.to(x.dtype)
    if not need_x_grad:  # only the input gradient reads the quantised weight
        empty = x.new_empty((0,), dtype=torch.uint8)
        return tuple(_unaliased([out, empty, empty.clone()], [x, weight, bias]))
    return tuple(_unaliased([out, wq.data.view(torch.uint8), wq.scale], [x, weight, bias]))


@_fake("mx_linear")
def _mx_linear_fake(x, weight, bias, fp8_dtype, grad_dtype, scale_rounding, need_x_grad, native):
    out = x.new_empty((x.shape[0], weight.shape[0]))
    if not need_x_grad:
        return out, x.new_empty((0,), dtype=torch.uint8), x.new_empty((0,), dtype=torch.uint8)
    n, k = weight.shape
    w_data = weight.new_empty((n, k), dtype=torch.uint8)
    w_scale = weight.new_empty((n // _MX_BLOCK, k // _MX_BLOCK), dtype=torch.uint8)
    return out, w_data, w_scale


def _mx_linear_setup_context(ctx, inputs, output):
    x, weight, bias, fp8_dtype, grad_dtype, scale_rounding, need_x_grad, native = inputs
    _, w_data, w_scale = output
    ctx.mark_non_differentiable(w_data, w_scale)
    ctx.save_for_backward(x, w_data, w_scale)
    ctx.options = (
        fp8_dtype, grad_dtype, scale_rounding, weight.dtype, None if bias is None else bias.dtype
    )  # fmt: skip
    ctx.computed = (need_x_grad, native)


def _mx_linear_backward(ctx, grad_out, *_):
    need_x_grad, native = ctx.computed
    need_x = ctx.needs_input_grad[0] and need_x_grad
    need_w, need_b = ctx.needs_input_grad[1:3]
    grads = list(
        torch.ops.gem_precision.mx_linear_backward(
            grad_out, *ctx.saved_tensors, *ctx.options, need_x, need_w, need_b, native
        )
    )
    return tuple(grads.pop(0) if n else None for n in (need_x, need_w, need_b)) + (None,) * 5


_autograd("mx_linear", _mx_linear_backward, _mx_linear_setup_context)


@_operator("mx_linear_backward", _MX_LINEAR_BACKWARD_SCHEMA)
def _mx_linear_backward_impl(
    grad_out, x, w_data, w_scale, fp8_dtype, grad_dtype, scale_rounding, w_dtype, bias_dtype,
    need_x, need_w, need_b, native,
):  # fmt: skip
    if need_w and x.shape[0] % _MX_BLOCK:
        # The weight gradient quantises dy.T and x.T in blocks along the tokens.
        raise ValueError(
            f"Fp8Recipe(scaling='mx') needs a multiple of {_MX_BLOCK} rows of x (tokens) for "
            f"the weight gradient, got {x.shape[0]}"
        )
    grads = []
    if need_x:
        gq = _mx(grad_out, grad_dtype, scale_rounding)
        # W.T from the square blocks of W (transpose-invariant).
        w_t = MXTensor(
            data=w_data.view(fp8_dtype).t().contiguous(), scale=w_scale.t().contiguous(),
            block_size=_MX_BLOCK, orig_dtype=w_dtype, square=True,
        )  # fmt: skip
        grad_x = mx_scaled_mm_nt(gq, w_t, out_dtype=_gemm_out_dtype(x.dtype), native=native)
        grads.append(grad_x.to(x.dtype))
    if need_w:
        gtq = _mx(grad_out.t(), grad_dtype, scale_rounding)
        xtq = _mx(x.t(), fp8_dtype, scale_rounding)
        grad_w = mx_scaled_mm_nt(gtq, xtq, out_dtype=_gemm_out_dtype(w_dtype), native=native)
        grads.append(grad_w.to(w_dtype))
    if need_b:
        grads.append(grad_out.sum(0, dtype=torch.float32).to(bias_dtype))
    return _unaliased(grads, [grad_out, x, w_data, w_scale])


@_fake("mx_linear_backward")
def _mx_linear_backward_fake(
    grad_out, x, w_data, w_scale, fp8_dtype, grad_dtype, scale_rounding, w_dtype, bias_dtype,
    need_x, need_w, need_b, native,
):  # fmt: skip
    grads = []
    if need_x:
        grads.append(x.new_empty(x.shape))
    if need_w:
        grads.append(x.new_empty((grad_out.shape[1], x.shape[1]), dtype=w_dtype))
    if need_b:
        grads.append(x.new_empty((grad_out.shape[1],), dtype=bias_dtype))
    return grads


_once_differentiable("mx_linear_backward")
