"""Fused RMSNorm / LayerNorm -> FP8 quantise, and the :class:`Fp8NormLinear` that uses it.

:func:`norm_quantize` normalises each row in float32 and writes the FP8 activation (1x128
blocks along the row, power-of-two scales, in the layout ``torch._scaled_mm`` wants) straight
from registers: the normalised tensor never goes to memory in bf16 and there is no separate
cast pass. :class:`Fp8NormLinear` is ``Linear(Norm(x))`` built on it: its forward runs the
fused kernel and the FP8 GEMM; its backward quantises ``dy`` once (both layouts), recomputes
the normalised input transposed and quantised for wgrad (128x128 tiles, or 1x128 along the
tokens) in one Triton pass (from ``x`` and the saved per-row statistics), and runs the norm
backward in a Triton kernel.

Where Triton cannot run (CPU without ``TRITON_INTERPRET=1``) or the recipe needs another path
(tensorwise, stochastic rounding, bf16 wgrad, Hadamard, MXFP8), :class:`Fp8NormLinear` computes
the norm in float32 with PyTorch and hands it to :class:`~gem_precision.Fp8Linear`: the same
numerics, unfused.

:class:`NormLinear` is the high-precision module a model is built from: plain
``F.layer_norm`` / ``F.rms_norm`` then ``nn.Linear``, with Fp8NormLinear's parameter names, so
:func:`~gem_precision.convert_to_fp8` can turn it into an :class:`Fp8NormLinear` in place.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gem_precision import _triton
from gem_precision import ops as _ops
from gem_precision.blockwise import (
    _DEFAULT_OPERAND_CONFIG,
    _MAX_SCALE_EXP,
    _MIN_SCALE_EXP,
    BLOCK,
    Fp8Operand,
    _gemm_k,
    _gemm_rows,
    _launch_tile_kernel,
    _quantize_operand,
    _row_outputs,
    _transposed_outputs,
)
from gem_precision.linear import (
    Fp8Linear,
    Fp8Recipe,
    _check_linear_input,
    _path,
    autocast_input,
    autocast_off,
)
from gem_precision.mx import MX_ELEMENT_DTYPES
from gem_precision.scaled_gemm import _gemm_out_dtype, _scaled_mm_nt

__all__ = ["Fp8NormLinear", "NormLinear", "norm_forward_reference", "norm_quantize"]

_KINDS = ("rms", "layer")

# The fused autograd function on CUDA (native scaled_mm). It was off for a while: its input
# gradient disagreed with the CPU emulation on the H200 (relative error 0.71), which turned out
# to be the dgrad GEMM, not the fused kernels: cuBLAS reads 128x128 block scales with K/128
# rounded up to a multiple of 4, and that layer had K=256 (scaled_gemm now pads K). Unfused
# Fp8Linear failed the same way at that shape. Set it False to run norm + Fp8Linear instead.
FUSED_ON_CUDA = True

# Launch options of the norm kernels: the fastest on an H200 (65536 x 4096 bf16; the benchmark
# sweeps them, timings in docs/kernel-tuning.md). "xt_warps": warps of the backward's kernel
# that recomputes norm(x).T in 128x128 tiles for wgrad. (The results do not depend on the
# warps: block maxima are exact in any order and each element is scaled on its own.)
_NORM_OPTIONS = {
    "rows_per_program": 2,
    "num_warps": 4,
    "bwd_rows_per_program": 64,
    "xt_warps": 8,
}


def norm_forward_reference(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    kind: str = "rms",
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """float32 ``(y, mean, rstd)`` of RMSNorm (``kind="rms"``, ``mean`` is None) or LayerNorm
    over the last dim of a 2-D ``x`` (differentiable)."""
    x32 = x.to(torch.float32)
    mean = None
    if kind == "layer":
        mean = x32.mean(dim=1)
        x32 = x32 - mean[:, None]
    rstd = torch.rsqrt((x32 * x32).mean(dim=1) + eps)
    y = x32 * rstd[:, None]
    if weight is not None:
        y = y * weight.to(torch.float32)
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y, mean, rstd


def _check_norm_args(x, weight, bias, kind):
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or not x.is_floating_point():
        raise TypeError(f"x must be a 2-D floating point tensor, got {type(x).__name__}")
    if kind not in _KINDS:
        raise ValueError(f"kind must be 'rms' or 'layer', got {kind!r}")
    if kind == "rms" and bias is not None:
        raise ValueError("bias is only supported with kind='layer'")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and tuple(t.shape) != (x.shape[1],):
            raise ValueError(f"{name} must have shape ({x.shape[1]},), got {tuple(t.shape)}")


def norm_quantize(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    *,
    kind: str = "rms",
    eps: float = 1e-6,
    dtype: torch.dtype = torch.float8_e4m3fn,
    backend: str = "auto",
    rows_per_program: int | None = None,
    num_warps: int | None = None,
) -> tuple[Fp8Operand, torch.Tensor | None, torch.Tensor]:
    """Normalise the rows of ``x`` (R, C) and quantise them to FP8 in one pass.

    Returns ``(operand, mean, rstd)``: ``operand.data`` (R, C) FP8 with 1x128 power-of-two
    scales ``operand.scale`` (R, C/128) in the outer-dim-major layout, ``mean`` (LayerNorm
    only, else None) and ``rstd`` float32 per row. ``backend``: ``"triton"``, ``"torch"`` or
    ``"auto"``. ``C`` must be a multiple of 128 for the Triton kernel. ``rows_per_program`` /
    ``num_warps`` override the kernel's launch options.
    """
    _check_norm_args(x, weight, bias, kind)
    if dtype not in MX_ELEMENT_DTYPES:
        raise TypeError(f"dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    for name, value in (("rows_per_program", rows_per_program), ("num_warps", num_warps)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise TypeError(f"{name} must be None or an int, got {value!r}")
    data, scale, mean, rstd = torch.ops.gem_precision.norm_quantize(
        x, weight, bias, kind, float(eps), dtype, backend, rows_per_program, num_warps
    )
    return Fp8Operand(kind="1x128", data=data, scale=scale), mean if kind == "layer" else None, rstd


def _norm_quantize(
    x, weight, bias, kind, eps, dtype, backend, rows_per_program, num_warps, gemm_padded=False
):
    """:func:`norm_quantize` on checked arguments: the body of its operator, and what the
    fused linear's operator calls (``gemm_padded``: rows stored as ``_quantize_operand``
    stores them for the native GEMMs)."""
    use_triton = backend == "triton" or (backend == "auto" and _triton.can_run(x))
    if not use_triton:
        with torch.no_grad():
            y, mean, rstd = norm_forward_reference(x, weight, bias, kind, eps)
        op = _quantize_operand(
            y, "1x128", dtype, True, False, None, 0, False, False, "torch",
            gemm_padded=gemm_padded,
        )  # fmt: skip
        return op, mean, rstd
    rows_per_program = rows_per_program or _NORM_OPTIONS["rows_per_program"]
    num_warps = num_warps or _NORM_OPTIONS["num_warps"]
    r, c = x.shape
    if c % BLOCK:
        raise ValueError(f"x.shape[1] must be a multiple of {BLOCK} for the Triton kernel, got {c}")
    x = x if x.stride(1) == 1 else x.contiguous()
    dev = x.device
    soft = _triton.soft_fp8(x)
    rq, cq = (_gemm_rows(r, False), _gemm_k(c)) if gemm_padded else (r, c)
    q, s = _row_outputs(r, c, rq, cq, dtype, dev)
    rstd = torch.empty(r, dtype=torch.float32, device=dev)
    mean = torch.empty(r, dtype=torch.float32, device=dev) if kind == "layer" else None
    dummy = torch.empty(1, dtype=torch.float32, device=dev)
    if r:
        x_arg, bf16_bits = _triton.float_arg(x, soft)
        block_c = 1 << (c - 1).bit_length()
        grid = (-(-r // rows_per_program),)
        _triton.kernels(x).norm_quantize_kernel[grid](
            x_arg,
            dummy if weight is None else weight,
            dummy if bias is None else bias,
            _triton.fp8_arg(q, soft),
            s,
            dummy if mean is None else mean,
            rstd,
            r,
            rq,
            c,
            cq,
            x.stride(0),
            float(eps),
            **_triton.fp8_constexprs(dtype, soft),
            MIN_EXP=_MIN_SCALE_EXP,
            MAX_EXP=_MAX_SCALE_EXP,
            LAYERNORM=kind == "layer",
            HAS_W=weight is not None,
            HAS_B=bias is not None,
            BF16_BITS=bf16_bits,
            ROWS=rows_per_program,
            BLOCK_C=block_c,
            GROUP=BLOCK,
            EVEN=c == block_c and r % rows_per_program == 0,
            num_warps=num_warps,
        )
    return Fp8Operand(kind="1x128", data=q, scale=s.t()), mean, rstd


def _normed_transposed_operand(
    x, weight, bias, mean, rstd, dtype, col_tiles: bool = False, gemm_padded: bool = False
) -> Fp8Operand:
    """``norm(x).T`` quantised with 1x128 blocks along the rows of ``x`` (or, ``col_tiles``,
    128x128 tiles) in one Triton pass (``gemm_padded``: stored as ``_quantize_operand`` stores
    ``data_t`` for the native GEMMs)."""
    r, c = x.shape
    dev = x.device
    soft = _triton.soft_fp8(x)
    rt = _gemm_rows(r, True) if gemm_padded else r
    qt, st = _transposed_outputs(r, c, rt, BLOCK, col_tiles, dtype, dev)
    dummy = torch.empty(1, dtype=torch.float32, device=dev)
    x_arg, bf16_bits = _triton.float_arg(x, soft)
    common = dict(
        **_triton.fp8_constexprs(dtype, soft),
        MIN_EXP=_MIN_SCALE_EXP,
        MAX_EXP=_MAX_SCALE_EXP,
        ROW=False,
        COL=True,
        FIXED=False,
        NORM=True,
        HAS_MEAN=mean is not None,
        HAS_W=weight is not None,
        HAS_B=bias is not None,
        BF16_BITS=bf16_bits,
        COLSUM=False,
        BLOCK_R=BLOCK,
        BLOCK=BLOCK,
    )
    # Only the x^T outputs are written: no row data, row scales or tensorwise exponent.
    args = (
        x_arg,
        dummy,
        dummy,
        _triton.fp8_arg(qt, soft),
        st,
        dummy,
        dummy if mean is None else mean,
        rstd,
        dummy if weight is None else weight,
        dummy if bias is None else bias,
        dummy,
        r,
        r,
        rt,
        c,
        c,
        x.stride(0),
    )
    # 1x128 blocks of x.T: the warps of quantize_operand's tile kernel for both 1x128 layouts.
    warps = _NORM_OPTIONS["xt_warps"] if col_tiles else _DEFAULT_OPERAND_CONFIG.tile_warps
    no_runs = dict(T_RUN=0, PREFETCH=0, RUN_ASM=False)
    _launch_tile_kernel(
        x, args, BLOCK, dict(**common, COL_TILE=col_tiles, num_warps=warps), no_runs
    )
    if col_tiles:
        return Fp8Operand(kind="1x128", data_t=qt, scale_t=st, kind_t="128x128")
    return Fp8Operand(kind="1x128", data_t=qt, scale_t=st.t())


def _norm_backward(dy, x, weight, bias, mean, rstd):
    """(dx, dweight, dbias) of the norm, in one Triton pass plus a small partial-sum reduce."""
    rows_per_program = _NORM_OPTIONS["bwd_rows_per_program"]
    r, c = x.shape
    dev = x.device
    soft = _triton.soft_fp8(x)
    programs = max(1, -(-r // rows_per_program))
    dx = torch.empty((r, c), dtype=x.dtype, device=dev)
    dw_part = torch.empty((programs, c), dtype=torch.float32, device=dev)
    db_part = torch.empty((programs, c), dtype=torch.float32, device=dev)
    dummy = torch.empty(1, dtype=torch.float32, device=dev)
    dy = dy.contiguous()
    if soft and (x.dtype == torch.bfloat16 or dy.dtype == torch.bfloat16):
        # The interpreter flushes bfloat16 subnormals: widen exactly in PyTorch first.
        x, dy = x.float(), dy.float()
        dx_out = torch.empty((r, c), dtype=torch.float32, device=dev)
    else:
        dx_out = dx
    if r:
        _triton.kernels(x).norm_backward_kernel[(programs,)](
            dy,
            x,
            dummy if weight is None else weight,
            dummy if mean is None else mean,
            rstd,
            dx_out,
            dw_part,
            db_part,
            r,
            c,
            x.stride(0),
            dy.stride(0),
            LAYERNORM=mean is not None,
            HAS_W=weight is not None,
            HAS_B=bias is not None,
            ROWS_PER_PROGRAM=rows_per_program,
            BLOCK_C=1 << (c - 1).bit_length(),
            num_warps=8,
        )
    if dx_out is not dx:
        dx.copy_(dx_out)
    dw = None if weight is None else dw_part.sum(0).to(weight.dtype)
    db = None if bias is None else db_part.sum(0).to(bias.dtype)
    return dx, dw, db


# ---------------------------------------------------------------------------------------------
# Operators (see gem_precision.ops, which defines the others): norm_quantize, and the fused
# Fp8NormLinear's forward and backward.

_NORM_QUANTIZE_SCHEMA = (
    "(Tensor x, Tensor? weight, Tensor? bias, str kind, float eps, ScalarType dtype, "
    "str backend, int? rows_per_program, int? num_warps) -> (Tensor, Tensor, Tensor, Tensor)"
)
_NORM_LINEAR_SCHEMA = (
    "(Tensor x, Tensor? norm_weight, Tensor? norm_bias, Tensor weight, Tensor? bias, "
    "str norm, float eps, ScalarType fp8_dtype, ScalarType grad_dtype, bool wgrad_x_tiles, "
    "bool need_norm_grad, bool native) -> (Tensor, Tensor, Tensor, Tensor, Tensor)"
)
_NORM_LINEAR_BACKWARD_SCHEMA = (
    "(Tensor grad_out, Tensor x, Tensor? norm_weight, Tensor? norm_bias, Tensor mean, "
    "Tensor rstd, Tensor w_t, Tensor w_t_scale, str norm, ScalarType fp8_dtype, "
    "ScalarType grad_dtype, bool wgrad_x_tiles, ScalarType w_dtype, ScalarType? bias_dtype, "
    "bool need_x, bool need_norm_weight, bool need_norm_bias, bool need_w, bool need_b, "
    "bool native) -> Tensor[]"
)


@_ops._operator("norm_quantize", _NORM_QUANTIZE_SCHEMA)
def _norm_quantize_op(x, weight, bias, kind, eps, dtype, backend, rows_per_program, num_warps):
    op, mean, rstd = _norm_quantize(
        x, weight, bias, kind, eps, dtype, backend, rows_per_program, num_warps
    )
    mean = rstd.new_empty((0,)) if mean is None else mean
    return tuple(_ops._unaliased([op.data, op.scale, mean, rstd], [x, weight, bias]))


def _norm_stats_fake(x, kind):
    """Fake ``(mean, rstd)``: float32 per row (``mean`` empty for RMSNorm)."""
    r = x.shape[0]
    mean = x.new_empty((r,) if kind == "layer" else (0,), dtype=torch.float32)
    return mean, x.new_empty((r,), dtype=torch.float32)


@_ops._fake("norm_quantize")
def _norm_quantize_fake(x, weight, bias, kind, eps, dtype, *_):
    data, scale = _ops._fake_layouts(x, "1x128", dtype, True, False, False)
    return (data, scale, *_norm_stats_fake(x, kind))


_ops._not_differentiable("norm_quantize")


@_ops._operator("fp8_norm_linear", _NORM_LINEAR_SCHEMA)
def _norm_linear(
    x, norm_w, norm_b, weight, bias, norm, eps, fp8_dtype, grad_dtype, wgrad_x_tiles,
    need_norm_grad, native,
):  # fmt: skip
    xq, mean, rstd = _norm_quantize(
        x, norm_w, norm_b, norm, eps, fp8_dtype, "triton", None, None, native
    )
    wq = _quantize_operand(
        weight, "128x128", fp8_dtype, True, need_norm_grad, None, 0, False, False, "auto"
    )
    out = _scaled_mm_nt(
        xq.data, xq.scale, "1x128", wq.data, wq.scale, "128x128",
        _gemm_out_dtype(x.dtype), native, bias,
    )[: x.shape[0]].to(x.dtype)  # fmt: skip
    mean = rstd.new_empty((0,)) if mean is None else mean
    w_t = wq.data_t.view(torch.uint8) if need_norm_grad else x.new_empty((0,), dtype=torch.uint8)
    w_t_scale = wq.scale_t if need_norm_grad else x.new_empty((0,), dtype=torch.float32)
    return tuple(
        _ops._unaliased([out, mean, rstd, w_t, w_t_scale], [x, norm_w, norm_b, weight, bias])
    )


@_ops._fake("fp8_norm_linear")
def _norm_linear_fake(x, norm_w, norm_b, weight, bias, norm, eps, fp8_dtype, grad_dtype,
                      wgrad_x_tiles, need_norm_grad, native):  # fmt: skip
    out = x.new_empty((x.shape[0], weight.shape[0]))
    if need_norm_grad:
        w_t, w_t_scale = _ops._fake_layouts(weight, "128x128", torch.uint8, False, True, False)
    else:
        w_t = x.new_empty((0,), dtype=torch.uint8)
        w_t_scale = x.new_empty((0,), dtype=torch.float32)
    return (out, *_norm_stats_fake(x, norm), w_t, w_t_scale)


def _norm_linear_setup_context(ctx, inputs, output):
    x, norm_w, norm_b, weight, bias, norm, _, fp8_dtype, grad_dtype, wgrad_x_tiles = inputs[:10]
    need_norm_grad, native = inputs[10:]
    _, mean, rstd, w_t, w_t_scale = output
    ctx.mark_non_differentiable(mean, rstd, w_t, w_t_scale)
    # x itself, not an FP8 copy: the backward recomputes norm(x).T for wgrad, and the norm's
    # own backward reads x.
    ctx.save_for_backward(x, norm_w, norm_b, mean, rstd, w_t, w_t_scale)
    ctx.options = (
        norm, fp8_dtype, grad_dtype, wgrad_x_tiles, weight.dtype,
        None if bias is None else bias.dtype,
    )  # fmt: skip
    ctx.computed = (need_norm_grad, native)


def _norm_linear_backward(ctx, grad_out, *_):
    need_norm_grad, native = ctx.computed
    # x, norm weight, norm bias (their gradients need the saved W.T), weight, bias.
    need = [n and need_norm_grad for n in ctx.needs_input_grad[:3]]
    need += list(ctx.needs_input_grad[3:5])
    grads = list(
        torch.ops.gem_precision.fp8_norm_linear_backward(
            grad_out, *ctx.saved_tensors, *ctx.options, *need, native
        )
    )
    return tuple(grads.pop(0) if n else None for n in need) + (None,) * 7


_ops._autograd("fp8_norm_linear", _norm_linear_backward, _norm_linear_setup_context)


@_ops._operator("fp8_norm_linear_backward", _NORM_LINEAR_BACKWARD_SCHEMA)
def _norm_linear_backward_impl(
    grad_out, x, norm_w, norm_b, mean, rstd, w_t, w_t_scale, norm, fp8_dtype, grad_dtype,
    wgrad_x_tiles, w_dtype, bias_dtype, need_x, need_norm_w, need_norm_b, need_w, need_b,
    native,
):  # fmt: skip
    inputs = [grad_out, x, norm_w, norm_b, mean, rstd, w_t, w_t_scale]
    mean = mean if norm == "layer" else None
    need_norm = need_x or need_norm_w or need_norm_b
    grad_out = grad_out.contiguous()
    gq = _quantize_operand(
        grad_out, "1x128", grad_dtype, need_norm, need_w, None, 0, need_b, False, "triton",
        gemm_padded=native,
    )  # fmt: skip
    grads = []
    if need_norm:
        grad_xn = _scaled_mm_nt(
            gq.data, gq.scale, "1x128", w_t.view(fp8_dtype), w_t_scale, "128x128",
            _gemm_out_dtype(x.dtype), native, None,
        )[: x.shape[0]]  # fmt: skip
        dx, dnw, dnb = _norm_backward(grad_xn, x, norm_w, norm_b, mean, rstd)
        grads += [g for g, n in ((dx, need_x), (dnw, need_norm_w), (dnb, need_norm_b)) if n]
    if need_w:
        xn_t = _normed_transposed_operand(
            x, norm_w, norm_b, mean, rstd, fp8_dtype, wgrad_x_tiles, native
        )
        grad_w = _scaled_mm_nt(
            gq.data_t, gq.scale_t, "1x128", xn_t.data_t, xn_t.scale_t, xn_t.kind_t or "1x128",
            _gemm_out_dtype(w_dtype), native, None,
        )  # fmt: skip
        grads.append(grad_w.to(w_dtype))
    if need_b:
        grads.append(gq.col_sum.to(bias_dtype))
    return _ops._unaliased(grads, inputs)


@_ops._fake("fp8_norm_linear_backward")
def _norm_linear_backward_fake(
    grad_out, x, norm_w, norm_b, mean, rstd, w_t, w_t_scale, norm, fp8_dtype, grad_dtype,
    wgrad_x_tiles, w_dtype, bias_dtype, need_x, need_norm_w, need_norm_b, need_w, need_b,
    native,
):  # fmt: skip
    n = grad_out.shape[1]
    grads = []
    for tensor, needed in ((x, need_x), (norm_w, need_norm_w), (norm_b, need_norm_b)):
        if needed:
            grads.append(tensor.new_empty(tensor.shape))
    if need_w:
        grads.append(grad_out.new_empty((n, x.shape[1]), dtype=w_dtype))
    if need_b:
        grads.append(grad_out.new_empty((n,), dtype=bias_dtype))
    return grads


_ops._once_differentiable("fp8_norm_linear_backward")


def _fused_norm_fp8_linear(
    x2d, norm_w, norm_b, weight, bias, recipe: Fp8Recipe, norm: str, eps: float, native: bool
):
    """The fused norm -> FP8 linear: one ``gem_precision::fp8_norm_linear`` operator."""
    need_norm_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x2d, norm_w, norm_b)
    )
    out, *_ = torch.ops.gem_precision.fp8_norm_linear(
        x2d, norm_w, norm_b, weight, bias, norm, eps, recipe.fp8_dtype, recipe.grad_dtype,
        recipe.wgrad_x_tiles, need_norm_grad, native,
    )  # fmt: skip
    return out


def _init_norm(module, in_features, out_features, norm, eps, elementwise_affine, device, dtype):
    """Checks the arguments shared by :class:`NormLinear` and :class:`Fp8NormLinear` and gives
    ``module`` its ``norm``, ``eps``, ``norm_weight`` and ``norm_bias`` (one place, so the two
    stay interchangeable)."""
    for name, value in (("in_features", in_features), ("out_features", out_features)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if norm not in _KINDS:
        raise ValueError(f"norm must be 'rms' or 'layer', got {norm!r}")
    if not isinstance(eps, float) or eps <= 0:
        raise ValueError(f"eps must be a positive float, got {eps!r}")
    module.norm, module.eps = norm, eps
    factory = {"device": device, "dtype": dtype}
    module.norm_weight = (
        nn.Parameter(torch.ones(in_features, **factory)) if elementwise_affine else None
    )
    module.norm_bias = (
        nn.Parameter(torch.zeros(in_features, **factory))
        if elementwise_affine and norm == "layer"
        else None
    )


class NormLinear(nn.Module):
    """``Linear(Norm(x))`` in high precision: the module to build a model's norm -> linear pairs
    from, so that :func:`~gem_precision.convert_to_fp8` can fuse the norm into the FP8
    quantisation of the GEMM input (it becomes an :class:`Fp8NormLinear`) wherever the policy
    selects the linear.

    The forward is ``F.layer_norm`` (or ``F.rms_norm``) then ``self.linear``: the same ops as
    ``nn.LayerNorm`` (``nn.RMSNorm``) + ``nn.Linear``, bit for bit, with nothing added. The
    default ``eps`` is ``nn.LayerNorm``'s (``Fp8NormLinear`` defaults to RMSNorm with 1e-6;
    conversion keeps the ``norm`` and ``eps`` of the module it replaces).

    Args:
        in_features, out_features, bias: as :class:`torch.nn.Linear`.
        norm: ``"layer"`` (LayerNorm, scale and shift) or ``"rms"`` (RMSNorm, scale only).
        eps: the norm's epsilon.
        elementwise_affine: learn the norm's scale (and shift for LayerNorm).

    Parameters, named like :class:`Fp8NormLinear`'s so state dicts carry over:
    ``norm_weight`` / ``norm_bias`` (the norm's), ``linear.weight`` / ``linear.bias`` (an
    :class:`torch.nn.Linear`, which ``convert_to_bf16_gemms`` may swap on its own).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        norm: str = "layer",
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        _init_norm(self, in_features, out_features, norm, eps, elementwise_affine, device, dtype)
        self.linear = nn.Linear(in_features, out_features, bias=bias, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``linear(norm(x))`` over the last dim; leading dims are kept."""
        shape = (self.linear.in_features,)
        if self.norm == "layer":
            y = F.layer_norm(x, shape, self.norm_weight, self.norm_bias, self.eps)
        else:
            y = F.rms_norm(x, shape, self.norm_weight, self.eps)
        return self.linear(y)

    def extra_repr(self) -> str:
        return f"norm={self.norm!r}, eps={self.eps}"


def _fp8_norm_linear(module: NormLinear, recipe: Fp8Recipe) -> Fp8NormLinear:
    """The :class:`Fp8NormLinear` of ``module`` (what :func:`~gem_precision.convert_to_fp8`
    puts in its place), holding its parameters (shared, not copied, so optimizers and state
    dicts keep working) and its norm, eps and train/eval mode."""
    new = Fp8NormLinear.__new__(Fp8NormLinear)
    nn.Module.__init__(new)
    new.norm, new.eps = module.norm, module.eps
    new.norm_weight = module.norm_weight
    new.norm_bias = module.norm_bias
    new.linear = Fp8Linear.from_linear(module.linear, recipe)
    return new.train(module.training)


class Fp8NormLinear(nn.Module):
    """``Linear(Norm(x))`` with the norm fused into the FP8 quantisation of the GEMM input.

    Args:
        in_features, out_features, bias: as :class:`torch.nn.Linear`.
        norm: ``"rms"`` (RMSNorm, scale only) or ``"layer"`` (LayerNorm, scale and shift).
        eps: the norm's epsilon.
        elementwise_affine: learn the norm's scale (and shift for LayerNorm).
        recipe: the :class:`~gem_precision.Fp8Recipe` of the linear layer.

    Parameters: ``norm_weight`` / ``norm_bias`` (the norm's), ``linear.weight`` /
    ``linear.bias`` (an :class:`~gem_precision.Fp8Linear`).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        norm: str = "rms",
        eps: float = 1e-6,
        elementwise_affine: bool = True,
        recipe: Fp8Recipe | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        _init_norm(self, in_features, out_features, norm, eps, elementwise_affine, device, dtype)
        self.linear = Fp8Linear(
            in_features, out_features, bias=bias, recipe=recipe, device=device, dtype=dtype
        )

    def _fused(self, x: torch.Tensor) -> tuple[bool, bool]:
        recipe = self.linear.recipe
        path, native = _path(recipe, x.device)
        fusable = (
            path == "blockwise"
            and not recipe.tensorwise
            and not recipe.wgrad_in_bf16
            and not recipe.stochastic_rounding_grads
            and self.linear.in_features % BLOCK == 0
            and _triton.can_run(x)
            and (FUSED_ON_CUDA or x.device.type != "cuda")
        )
        return fusable, native

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``linear(norm(x))`` over the last dim; leading dims are kept."""
        in_f = self.linear.in_features
        _check_linear_input(x, in_f, self.linear.weight)
        x2d = x.reshape(-1, in_f)
        fused, native = self._fused(x)
        if fused:
            # Under autocast the norm reads the activation in the autocast dtype: its output
            # is quantised to FP8 next, 4 mantissa bits against bf16's 8.
            x2d = autocast_input(x2d)
            bias = self.linear.bias
            if bias is not None and x2d.dtype != x.dtype:
                bias = bias.to(x2d.dtype)
            with autocast_off(x.device):
                out = _fused_norm_fp8_linear(
                    x2d,
                    self.norm_weight,
                    self.norm_bias,
                    self.linear.weight,
                    bias,
                    self.linear.recipe,
                    self.norm,
                    self.eps,
                    native,
                )
        else:
            y, _, _ = norm_forward_reference(
                x2d, self.norm_weight, self.norm_bias, self.norm, self.eps
            )
            out = self.linear(y).to(autocast_input(x[:0]).dtype)  # x's, or autocast's
        return out.reshape(*x.shape[:-1], self.linear.out_features)

    def extra_repr(self) -> str:
        return f"norm={self.norm!r}, eps={self.eps}"
