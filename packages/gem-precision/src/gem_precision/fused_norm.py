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
from gem_precision.blockwise import (
    _DUAL_OPTIONS,
    _MAX_SCALE_EXP,
    _MIN_SCALE_EXP,
    BLOCK,
    Fp8Operand,
    quantize_operand,
)
from gem_precision.linear import Fp8Linear, Fp8Recipe, _gemm_out_dtype, _path
from gem_precision.mx import MX_ELEMENT_DTYPES
from gem_precision.scaled_gemm import scaled_mm_nt

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
    use_triton = backend == "triton" or (backend == "auto" and _triton.can_run(x))
    if not use_triton:
        with torch.no_grad():
            y, mean, rstd = norm_forward_reference(x, weight, bias, kind, eps)
        op = quantize_operand(y, "1x128", dtype, rows=True, cols=False, backend="torch")
        return op, mean, rstd
    rows_per_program = rows_per_program or _NORM_OPTIONS["rows_per_program"]
    num_warps = num_warps or _NORM_OPTIONS["num_warps"]
    r, c = x.shape
    if c % BLOCK:
        raise ValueError(f"x.shape[1] must be a multiple of {BLOCK} for the Triton kernel, got {c}")
    x = x if x.stride(1) == 1 else x.contiguous()
    dev = x.device
    soft = _triton.soft_fp8(x)
    q = torch.empty((r, c), dtype=dtype, device=dev)
    s = torch.empty((c // BLOCK, r), dtype=torch.float32, device=dev)
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
            c,
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
    x, weight, bias, mean, rstd, dtype, col_tiles: bool = False
) -> Fp8Operand:
    """``norm(x).T`` quantised with 1x128 blocks along the rows of ``x`` (or, ``col_tiles``,
    128x128 tiles) in one Triton pass."""
    r, c = x.shape
    dev = x.device
    soft = _triton.soft_fp8(x)
    qt = torch.empty((c, r), dtype=dtype, device=dev)
    nr, nc = -(-r // BLOCK), -(-c // BLOCK)
    st = torch.empty((nc, nr) if col_tiles else (nr, c), dtype=torch.float32, device=dev)
    dummy = torch.empty(1, dtype=torch.float32, device=dev)
    x_arg, bf16_bits = _triton.float_arg(x, soft)
    grid = (-(-r // BLOCK), -(-c // BLOCK))
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
        c,
        x.stride(0),
    )
    if col_tiles:
        _triton.kernels(x).blockwise_tile_kernel[grid](
            *args,
            **common,
            COL_TILE=True,
            EVEN=r % BLOCK == 0 and c % BLOCK == 0,
            num_warps=_NORM_OPTIONS["xt_warps"],
        )
    elif _DUAL_OPTIONS["variant"] == "tile":
        _triton.kernels(x).blockwise_tile_kernel[grid](
            *args,
            **common,
            COL_TILE=False,
            EVEN=r % BLOCK == 0 and c % BLOCK == 0,
            num_warps=_DUAL_OPTIONS["tile_warps"],
        )
    else:
        _triton.kernels(x).blockwise_dual_kernel[grid](
            *args,
            **common,
            TILE=False,
            TRANS=_DUAL_OPTIONS["trans"],
            num_warps=_DUAL_OPTIONS["num_warps"],
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


class _FusedNormFp8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, norm_w, norm_b, weight, bias, recipe, kind, eps, native):
        xq, mean, rstd = norm_quantize(
            x2d, norm_w, norm_b, kind=kind, eps=eps, dtype=recipe.fp8_dtype, backend="triton"
        )
        need_dx = x2d.requires_grad or (norm_w is not None and norm_w.requires_grad)
        wq = quantize_operand(weight, "128x128", recipe.fp8_dtype, rows=True, cols=need_dx)
        out = scaled_mm_nt(
            xq.data,
            xq.scale,
            "1x128",
            wq.data,
            wq.scale,
            "128x128",
            out_dtype=_gemm_out_dtype(x2d.dtype),
            native=native,
            bias=bias,
        )
        ctx.recipe, ctx.native, ctx.w_dtype = recipe, native, weight.dtype
        ctx.save_for_backward(x2d, norm_w, norm_b, mean, rstd, wq.data_t, wq.scale_t, bias)
        return out.to(x2d.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x2d, norm_w, norm_b, mean, rstd, w_t, w_t_scale, bias = ctx.saved_tensors
        recipe: Fp8Recipe = ctx.recipe
        need = ctx.needs_input_grad
        need_norm = need[0] or need[1] or need[2]
        grad_out = grad_out.contiguous()
        need_bias = need[4] and bias is not None
        gq = quantize_operand(
            grad_out,
            "1x128",
            recipe.grad_dtype,
            rows=need_norm,
            cols=need[3],
            backend="triton",
            col_sum=need_bias,
        )
        grads = [None] * 9
        if need[3]:
            xn_t = _normed_transposed_operand(
                x2d, norm_w, norm_b, mean, rstd, recipe.fp8_dtype, recipe.wgrad_x_tiles
            )
            grads[3] = scaled_mm_nt(
                gq.data_t,
                gq.scale_t,
                "1x128",
                xn_t.data_t,
                xn_t.scale_t,
                xn_t.kind_t or "1x128",
                out_dtype=_gemm_out_dtype(ctx.w_dtype),
                native=ctx.native,
            ).to(ctx.w_dtype)
        if need_norm:
            grad_xn = scaled_mm_nt(
                gq.data,
                gq.scale,
                "1x128",
                w_t,
                w_t_scale,
                "128x128",
                out_dtype=_gemm_out_dtype(x2d.dtype),
                native=ctx.native,
            )
            grads[0], grads[1], grads[2] = _norm_backward(grad_xn, x2d, norm_w, norm_b, mean, rstd)
        if need_bias:
            grads[4] = gq.col_sum.to(bias.dtype)
        return tuple(grads)


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
        if x.shape[-1] != in_f:
            raise ValueError(f"the last dim of x must be in_features={in_f}, got {x.shape}")
        x2d = x.reshape(-1, in_f)
        fused, native = self._fused(x)
        if fused:
            out = _FusedNormFp8LinearFunction.apply(
                x2d,
                self.norm_weight,
                self.norm_bias,
                self.linear.weight,
                self.linear.bias,
                self.linear.recipe,
                self.norm,
                self.eps,
                native,
            )
        else:
            y, _, _ = norm_forward_reference(
                x2d, self.norm_weight, self.norm_bias, self.norm, self.eps
            )
            out = self.linear(y).to(x.dtype)
        return out.reshape(*x.shape[:-1], self.linear.out_features)

    def extra_repr(self) -> str:
        return f"norm={self.norm!r}, eps={self.eps}"
