"""FP8 linear layer (Hopper block-scaled recipe, MXFP8 on Blackwell) and a per-layer policy.

:class:`Fp8Linear` runs its three GEMMs on FP8-quantized operands:

* forward ``y = x @ W.T``: ``x`` 1x128 tiles along K, ``W`` 128x128 tiles;
* dgrad ``dx = dy @ W``: ``dy`` 1x128 tiles along N, ``W`` 128x128 tiles;
* wgrad ``dW = dy.T @ x``: ``dy.T`` 1x128 tiles along the token dim M, ``x.T`` 128x128 tiles
  (``Fp8Recipe.wgrad_x_tiles``; 1x128 along M without it), or plain bf16 with
  ``Fp8Recipe.wgrad_in_bf16``.

Scales are powers of two (see :mod:`gem_precision.blockwise`). Each operand is quantised once,
in one Triton pass that writes both layouts it is needed in (``x`` along K for the forward and
``x.T`` in tiles for wgrad; ``dy`` along N and ``dy.T`` along M), so the forward saves FP8
copies rather than the bf16 input. The GEMM backend depends on the device
(:func:`gem_precision.scaled_gemm.gemm_backend`):

* Hopper (sm90): ``torch._scaled_mm`` with blockwise (1x128 / 128x128) or tensorwise scales;
* Blackwell (sm100, or ``Fp8Recipe(scaling="mx")`` anywhere): MXFP8, E8M0 scales per 1x32
  block (weights in 32x32 squares, so one copy serves W and W.T), native ``_scaled_mm`` on
  sm100;
* CPU and other GPUs: the same quantised operands, dequantised and multiplied in float32, the
  result rounded to bfloat16 like ``_scaled_mm``'s output, so CI checks the GPU numerics up to
  summation order.

``Fp8Recipe(hadamard=True)`` keeps the high-precision x and W for backward and, per GEMM,
rotates both operands along that GEMM's reduction dim (a PyTorch pass, not fused into the
quantisation kernels), quantises them and runs the same GEMM as above: native on Hopper /
Blackwell, emulated elsewhere.
"""

from __future__ import annotations

import contextlib
import fnmatch
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from gem_precision import ops as _ops
from gem_precision.blockwise import _quantize_operand, fake_quantize_blockwise
from gem_precision.hadamard import random_hadamard_transform
from gem_precision.mx import MX_ELEMENT_DTYPES
from gem_precision.scaled_gemm import _gemm_out_dtype, _scaled_mm_nt, gemm_backend

__all__ = [
    "ConversionReport",
    "Fp8Linear",
    "Fp8Recipe",
    "PrecisionPolicy",
    "convert_to_fp8",
    "fp8_gemm_emulated",
    "load_rounding_state",
    "rounding_state",
]

_ACT_BLOCK = (1, 128)
_WEIGHT_BLOCK = (128, 128)

#: Largest ``Fp8Recipe.hadamard_block_size``.
MAX_HADAMARD_BLOCK_SIZE = 4096
#: dtypes of ``Fp8Linear`` parameters and inputs.
_LINEAR_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: MX GEMM operands are quantised in blocks (weights: squares) of this size.
_MX_BLOCK = 32


@dataclass(frozen=True)
class Fp8Recipe:
    """Options of the FP8 GEMM recipe used by :class:`Fp8Linear`."""

    fp8_dtype: torch.dtype = torch.float8_e4m3fn
    """Element dtype of activations and weights."""
    grad_dtype: torch.dtype = torch.float8_e4m3fn
    """Element dtype of output gradients (E4M3 with fine block scales, as in DeepSeek-V3)."""
    wgrad_in_bf16: bool = False
    """Compute the weight-gradient GEMM on bfloat16 operands instead of FP8."""
    tensorwise: bool = False
    """Fast mode: one scale per tensor instead of 1x128 / 128x128 tiles."""
    wgrad_x_tiles: bool = True
    """Quantise ``x.T`` for the weight-gradient GEMM with one scale per 128x128 tile (like the
    weights) instead of 1x128 blocks along the tokens. With power-of-two scales the FP8 values
    are the same except for elements more than ~2**14 below their tile's maximum (those become
    subnormal or zero), and Hopper's ``scaled_mm`` runs the 1x128 x 128x128 GEMM at about 1090
    TFLOP/s against 870 for 1x128 x 1x128 (H200, M=65536, K=N=4096, fp8_linear.json)."""
    stochastic_rounding_grads: bool = False
    """Round output gradients to FP8 stochastically (Philox) instead of nearest-even."""
    hadamard: bool = False
    """Apply a random Hadamard transform along the reduction dim of both operands of each GEMM
    before quantizing (it cancels in the product, but spreads outliers)."""
    hadamard_block_size: int = 32
    """Block size of the random Hadamard transform (a power of two)."""
    seed: int = 0
    """Philox seed for stochastic rounding and the Hadamard signs."""
    scaling: str = "auto"
    """``"blockwise"`` (Hopper recipe: 1x128 / 128x128 power-of-two float32 scales),
    ``"mx"`` (MXFP8: E8M0 scales per 1x32 block, weights per 32x32 square) or ``"auto"``
    (MXFP8 on Blackwell, blockwise everywhere else)."""
    mx_scale_rounding: str = "ceil"
    """E8M0 scale rounding of the MX recipe: ``"ceil"`` (RCEIL, never saturates) or
    ``"floor"`` (OCP spec)."""

    def __post_init__(self) -> None:
        for name in ("fp8_dtype", "grad_dtype"):
            value = getattr(self, name)
            if not isinstance(value, torch.dtype) or value not in MX_ELEMENT_DTYPES:
                raise TypeError(
                    f"{name} must be torch.float8_e4m3fn or torch.float8_e5m2, "
                    f"got {getattr(self, name)}"
                )
        for name in (
            "wgrad_in_bf16",
            "tensorwise",
            "stochastic_rounding_grads",
            "hadamard",
            "wgrad_x_tiles",
        ):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        b = self.hadamard_block_size
        if isinstance(b, bool) or not isinstance(b, int) or b <= 0 or b & (b - 1):
            raise ValueError(f"hadamard_block_size must be a positive power of two, got {b!r}")
        if b > MAX_HADAMARD_BLOCK_SIZE:
            # The transform multiplies by a dense b x b matrix and pads K up to b.
            raise ValueError(
                f"hadamard_block_size must be at most {MAX_HADAMARD_BLOCK_SIZE}, got {b}"
            )
        seed = self.seed
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
            raise ValueError(f"seed must be an int in [0, 2**63), got {seed!r}")
        if not isinstance(self.scaling, str) or self.scaling not in ("auto", "blockwise", "mx"):
            raise ValueError(f"scaling must be 'auto', 'blockwise' or 'mx', got {self.scaling!r}")
        if not isinstance(self.mx_scale_rounding, str) or self.mx_scale_rounding not in (
            "ceil",
            "floor",
        ):
            raise ValueError(
                f"mx_scale_rounding must be 'ceil' or 'floor', got {self.mx_scale_rounding!r}"
            )


def autocast_input(x: torch.Tensor) -> torch.Tensor:
    """``x`` in the autocast dtype when autocast is on for its device, as autocast casts a
    linear's input: an FP8 layer under bf16 autocast then reads bf16 activations and writes
    bf16 outputs, like the bf16 layer it replaces, not float32 ones (twice the bytes, and a
    float32 bias that cuBLAS's epilogue does not take)."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type) and x.is_floating_point():
        return x.to(torch.get_autocast_dtype(device_type))
    return x


def autocast_off(device: torch.device) -> contextlib.AbstractContextManager:
    """Autocast off on ``device`` for an FP8 operator's call: its operands are cast already
    (:func:`autocast_input`), and autocast would otherwise reach the operator's own float32
    GEMMs (the CPU emulation's, the bf16 wgrad's) and round them to bf16."""
    if torch.is_autocast_enabled(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def _sr_draws(rows: int, cols: int, recipe: Fp8Recipe) -> int:
    """Philox counters that stochastic rounding of a ``(rows, cols)`` gradient operand uses:
    with ``recipe.hadamard`` it is rotated along ``cols``, zero-padded to the block size."""
    if recipe.hadamard:
        cols = -(-cols // recipe.hadamard_block_size) * recipe.hadamard_block_size
    return rows * cols


def _rotated_operands(
    a: torch.Tensor, b: torch.Tensor, recipe: Fp8Recipe
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``a`` and ``b``, both rotated along their shared last dim K when
    ``recipe.hadamard`` (K zero-padded to the block size, which keeps ``a @ b.T``)."""
    a32, b32 = a.to(torch.float32), b.to(torch.float32)
    if recipe.hadamard:
        pad = (-a32.shape[1]) % recipe.hadamard_block_size
        a32, b32 = F.pad(a32, (0, pad)), F.pad(b32, (0, pad))
        a32 = random_hadamard_transform(
            a32, block_size=recipe.hadamard_block_size, seed=recipe.seed
        )
        b32 = random_hadamard_transform(
            b32, block_size=recipe.hadamard_block_size, seed=recipe.seed
        )
    return a32, b32


def _fp8_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    a_block: tuple[int, int] | None,
    b_block: tuple[int, int] | None,
    recipe: Fp8Recipe,
    *,
    native: bool,
    a_dtype: torch.dtype | None = None,
    b_dtype: torch.dtype | None = None,
    a_stochastic_offset: int | torch.Tensor | None = None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """:func:`fp8_gemm_emulated` as the linear layers run it: the same rotation and the same
    quantised values (``quantize_operand`` equals ``fake_quantize_blockwise`` bit for bit), the
    GEMM on ``torch._scaled_mm`` with ``native`` (else emulated by :func:`scaled_mm_nt`), float32
    accumulation, the result rounded to ``out_dtype`` (see :func:`_gemm_out_dtype`) and
    returned as float32."""
    a32, b32 = _rotated_operands(a, b, recipe)

    def kind(block):
        if block is None or recipe.tensorwise:
            return "tensorwise"
        return "1x128" if block == _ACT_BLOCK else "128x128"

    a_kind, b_kind = kind(a_block), kind(b_block)
    seed, offset = (None, 0) if a_stochastic_offset is None else (recipe.seed, a_stochastic_offset)
    a_q = _quantize_operand(
        a32, a_kind, a_dtype or recipe.fp8_dtype, True, False, seed, offset, False, False, "auto"
    )
    b_dtype = b_dtype or recipe.fp8_dtype
    b_q = _quantize_operand(b32, b_kind, b_dtype, True, False, None, 0, False, False, "auto")
    out = _scaled_mm_nt(
        a_q.data, a_q.scale, a_kind, b_q.data, b_q.scale, b_kind, out_dtype, native, None
    )
    return out.float()


def fp8_gemm_emulated(
    a: torch.Tensor,
    b: torch.Tensor,
    a_block: tuple[int, int] | None,
    b_block: tuple[int, int] | None,
    recipe: Fp8Recipe,
    *,
    a_dtype: torch.dtype | None = None,
    b_dtype: torch.dtype | None = None,
    a_stochastic_offset: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """``a @ b.T`` (float32) with both operands quantized along their shared last dim K.

    ``a`` is ``(M, K)``, ``b`` is ``(N, K)``. Tiles are ``a_block`` / ``b_block`` (``None`` =
    tensorwise; ``recipe.tensorwise`` forces it). With ``a_stochastic_offset`` the ``a`` operand
    is rounded stochastically with ``recipe.seed`` and that Philox offset (an int, or a
    one-element int64 tensor on ``a``'s device).
    """
    a32, b32 = _rotated_operands(a, b, recipe)
    if recipe.tensorwise:
        a_block = b_block = None
    a_q = fake_quantize_blockwise(
        a32,
        a_block,
        a_dtype or recipe.fp8_dtype,
        stochastic_seed=None if a_stochastic_offset is None else recipe.seed,
        offset=0 if a_stochastic_offset is None else a_stochastic_offset,
    )
    b_q = fake_quantize_blockwise(b32, b_block, b_dtype or recipe.fp8_dtype)
    return a_q @ b_q.T


# The Hadamard recipe: each GEMM rotates its operands along its own reduction dim, then
# quantises them, from the high-precision x and W the forward saves. One operator per pass,
# like gem_precision.ops' linears; the recipe travels as its fields. ``sr_offset`` is the
# stochastic rounding counter as in gem_precision.ops (a tensor, None without stochastic
# rounding), saved with x and W.

_HADAMARD_RECIPE = (
    "ScalarType fp8_dtype, ScalarType grad_dtype, bool tensorwise, bool wgrad_in_bf16, "
    "bool wgrad_x_tiles, bool stochastic_rounding_grads, SymInt block_size, int seed, "
)
_HADAMARD_LINEAR_SCHEMA = (
    f"(Tensor x, Tensor weight, Tensor? sr_offset, {_HADAMARD_RECIPE}bool native) -> Tensor"
)
_HADAMARD_LINEAR_BACKWARD_SCHEMA = (
    f"(Tensor grad_out, Tensor x, Tensor weight, Tensor? sr_offset, {_HADAMARD_RECIPE}"
    "bool need_x, bool need_w, bool native) -> Tensor[]"
)


def _hadamard_recipe(
    fp8_dtype, grad_dtype, tensorwise, wgrad_in_bf16, wgrad_x_tiles, sr, block, seed
) -> Fp8Recipe:
    return Fp8Recipe(
        fp8_dtype=fp8_dtype, grad_dtype=grad_dtype, tensorwise=tensorwise,
        wgrad_in_bf16=wgrad_in_bf16, wgrad_x_tiles=wgrad_x_tiles, stochastic_rounding_grads=sr,
        hadamard=True, hadamard_block_size=block, seed=seed,
    )  # fmt: skip


@_ops._operator("fp8_hadamard_linear", _HADAMARD_LINEAR_SCHEMA)
def _hadamard_linear(x, weight, sr_offset, *recipe_fields):
    *fields, native = recipe_fields
    recipe = _hadamard_recipe(*fields)
    out_dtype = _gemm_out_dtype(x.dtype)
    out = _fp8_gemm(
        x, weight, _ACT_BLOCK, _WEIGHT_BLOCK, recipe, native=native, out_dtype=out_dtype
    )
    return _ops._unaliased([out], [x, weight, sr_offset])[0]


@_ops._fake("fp8_hadamard_linear")
def _hadamard_linear_fake(x, weight, *_):
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=torch.float32)


def _hadamard_setup_context(ctx, inputs, output):
    x, weight, sr_offset, *recipe_fields = inputs
    ctx.save_for_backward(x, weight, sr_offset)
    ctx.options = recipe_fields[:-1]
    ctx.native = recipe_fields[-1]


def _hadamard_backward(ctx, grad_out):
    need_x, need_w = ctx.needs_input_grad[:2]
    grads = list(
        torch.ops.gem_precision.fp8_hadamard_linear_backward(
            grad_out, *ctx.saved_tensors, *ctx.options, need_x, need_w, ctx.native
        )
    )
    grad_x = grads.pop(0) if need_x else None
    grad_w = grads.pop(0) if need_w else None
    return (grad_x, grad_w) + (None,) * (len(ctx.options) + 2)


_ops._autograd("fp8_hadamard_linear", _hadamard_backward, _hadamard_setup_context)


@_ops._operator("fp8_hadamard_linear_backward", _HADAMARD_LINEAR_BACKWARD_SCHEMA)
def _hadamard_linear_backward(grad_out, x, weight, sr_offset, *rest):
    *fields, need_x, need_w, native = rest
    recipe = _hadamard_recipe(*fields)
    sr = recipe.stochastic_rounding_grads
    grads = []
    if need_x:
        # dgrad: dy (M, N) @ W (N, K) = dy @ (W.T).T, reduction over N.
        grad_x = _fp8_gemm(
            grad_out, weight.T, _ACT_BLOCK, _WEIGHT_BLOCK, recipe, native=native,
            a_dtype=recipe.grad_dtype, a_stochastic_offset=sr_offset if sr else None,
            out_dtype=_gemm_out_dtype(x.dtype),
        )  # fmt: skip
        grads.append(grad_x.to(x.dtype))
    if need_w:
        # wgrad: dy.T (N, M) @ x (M, K), reduction over tokens M.
        if recipe.wgrad_in_bf16:
            grad_w = _ops._bf16_wgrad(grad_out, x, native)
        else:
            grad_w = _fp8_gemm(
                grad_out.T, x.T, _ACT_BLOCK,
                _WEIGHT_BLOCK if recipe.wgrad_x_tiles else _ACT_BLOCK, recipe, native=native,
                a_dtype=recipe.grad_dtype,
                # A second, disjoint range of counters after dgrad's (its padded grad_out).
                a_stochastic_offset=sr_offset + _sr_draws(*grad_out.shape, recipe) if sr else None,
                out_dtype=_gemm_out_dtype(weight.dtype),
            )  # fmt: skip
        grads.append(grad_w.to(weight.dtype))
    return _ops._unaliased(grads, [grad_out, x, weight, sr_offset])


@_ops._fake("fp8_hadamard_linear_backward")
def _hadamard_linear_backward_fake(grad_out, x, weight, sr_offset, *rest):
    need_x, need_w = rest[-3:-1]
    return [t.new_empty(t.shape) for t, n in ((x, need_x), (weight, need_w)) if n]


_ops._once_differentiable("fp8_hadamard_linear_backward")


def _fp8_hadamard_linear(x2d, weight, recipe: Fp8Recipe, sr_offset, native: bool):
    """The Hadamard recipe's linear (no bias), one ``gem_precision::fp8_hadamard_linear``
    operator: float32 output."""
    return torch.ops.gem_precision.fp8_hadamard_linear(
        x2d, weight, sr_offset, recipe.fp8_dtype, recipe.grad_dtype, recipe.tensorwise,
        recipe.wgrad_in_bf16, recipe.wgrad_x_tiles, recipe.stochastic_rounding_grads,
        recipe.hadamard_block_size, recipe.seed, native,
    )  # fmt: skip


def _fp8_linear(x2d, weight, bias, recipe: Fp8Recipe, sr_offset, native: bool):
    """The blockwise / tensorwise FP8 linear, one ``gem_precision::fp8_linear`` operator: each
    operand quantised once, in both layouts it needs; the forward saves the FP8 copies."""
    grad = torch.is_grad_enabled()
    sr = recipe.stochastic_rounding_grads
    out, *_ = torch.ops.gem_precision.fp8_linear(
        x2d, weight, bias, recipe.fp8_dtype, recipe.grad_dtype, recipe.tensorwise,
        recipe.wgrad_in_bf16, recipe.wgrad_x_tiles, recipe.seed if sr else None, sr_offset,
        grad and x2d.requires_grad, grad and weight.requires_grad, native,
    )  # fmt: skip
    return out


def _mx_linear(x2d, weight, bias, recipe: Fp8Recipe, native: bool):
    """The MXFP8 linear, one ``gem_precision::mx_linear`` operator."""
    grad = torch.is_grad_enabled()
    out, *_ = torch.ops.gem_precision.mx_linear(
        x2d, weight, bias, recipe.fp8_dtype, recipe.grad_dtype, recipe.mx_scale_rounding,
        grad and x2d.requires_grad, native,
    )  # fmt: skip
    return out


def _path(recipe: Fp8Recipe, device: torch.device) -> tuple[str, bool]:
    """(``"blockwise"`` | ``"mx"`` | ``"hadamard"``, native GEMM?) for a recipe on a device."""
    backend = gemm_backend(device)
    if recipe.hadamard:
        return "hadamard", backend in ("sm90", "sm100")
    scaling = recipe.scaling
    if scaling == "auto":
        scaling = "mx" if backend == "sm100" and not recipe.tensorwise else "blockwise"
    if scaling == "mx":
        return "mx", backend == "sm100"
    return "blockwise", backend in ("sm90", "sm100")


class Fp8Linear(nn.Linear):
    """Drop-in :class:`torch.nn.Linear` whose forward, dgrad and wgrad GEMMs use FP8 operands.

    Parameters stay in their original dtype (the master copy); only GEMM operands are quantized
    (native scaled GEMMs on Hopper / Blackwell, emulated elsewhere: see the module docstring).
    The bias is added in high precision.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        recipe: Fp8Recipe | None = None,
    ) -> None:
        for name, value in (("in_features", in_features), ("out_features", out_features)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {value!r}")
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if in_features * out_features >= 2**60:
            raise ValueError(
                f"in_features * out_features must be below 2**60 (a weight tensor), got "
                f"in_features={in_features}, out_features={out_features}"
            )
        if dtype is not None and dtype not in _LINEAR_DTYPES:
            raise TypeError(
                f"dtype must be None, torch.float16, bfloat16, float32 or float64, got {dtype!r}"
            )
        _check_recipe(recipe)
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.recipe = recipe or Fp8Recipe()
        _register_sr_offset(self, self.weight.device)

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: Fp8Recipe | None = None) -> Fp8Linear:
        """Wrap an existing ``nn.Linear``, sharing (not copying) its parameters."""
        _check_recipe(recipe)
        new = _sharing_parameters_of(cls, linear)
        new.recipe = recipe or Fp8Recipe()
        _register_sr_offset(new, linear.weight.device)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T + b`` with FP8-quantized GEMM operands; any leading dims are kept.

        float64 inputs and parameters are computed as float32. Raises ``TypeError`` (x not a
        float16/bfloat16/float32/float64 tensor) or ``ValueError`` (x 0-d, its last dim not
        ``in_features``, on another device than the weight; with an MX recipe, features not
        divisible by 32; its backward: a number of rows not divisible by 32 for the weight
        gradient).
        """
        _check_linear_input(x, self.in_features, self.weight)
        path, native = _path(self.recipe, x.device)
        if path == "mx" and (self.in_features % _MX_BLOCK or self.out_features % _MX_BLOCK):
            raise ValueError(
                f"Fp8Recipe(scaling='mx') needs in_features and out_features divisible by "
                f"{_MX_BLOCK}, got in_features={self.in_features}, "
                f"out_features={self.out_features}"
            )
        if x.is_cuda and not native:
            # Not silent: on a GPU a user expects FP8 speed, and this path only has FP8 numerics.
            warnings.warn(
                f"Fp8Linear emulates its FP8 GEMMs on {x.device} (recipe path {path!r}, "
                f"GEMM backend {gemm_backend(x.device)!r}): FP8 numerics, but slower than bf16",
                RuntimeWarning,
                stacklevel=2,
            )
        x2d = autocast_input(x).reshape(-1, self.in_features)
        out_dtype = x2d.dtype
        if x2d.shape[0] == 0:
            # No rows: nothing to quantise (a tensorwise scale of nothing is undefined). The
            # empty result still depends on the parameters, whose gradients are then zero.
            out = F.linear(x2d.to(self.weight.dtype), self.weight, self.bias)
            return out.to(out_dtype).reshape(*x.shape[:-1], self.out_features)
        weight, bias = self.weight, self.bias
        if bias is not None and x2d.dtype != x.dtype:  # autocast: the bias as well
            bias = bias.to(x2d.dtype)
        # The FP8 operand kernels take float32, bfloat16 and float16: float64 is computed as
        # float32 (quantised from float32 values, like the emulation), cast back at the end.
        if x2d.dtype == torch.float64:
            x2d = x2d.float()
        if weight.dtype == torch.float64:
            weight = weight.float()
            bias = None if bias is None else bias.float()
        offset = None
        if self.recipe.stochastic_rounding_grads and torch.is_grad_enabled():
            # This step's counter (a copy, saved for the backward), then room in the buffer for
            # the step's dgrad + wgrad draws; an evaluation forward does not move it.
            rows, cols = x2d.shape[0], self.out_features
            step = _sr_draws(rows, cols, self.recipe) + _sr_draws(cols, rows, self.recipe)
            step = step if self.training else 0
            offset = torch.ops.gem_precision.advance_offset(self._sr_offset, step)
        with autocast_off(x.device):
            if path == "blockwise":
                out = _fp8_linear(x2d, weight, bias, self.recipe, offset, native)
            elif path == "mx":
                out = _mx_linear(x2d, weight, bias, self.recipe, native)
            else:
                out = _fp8_hadamard_linear(x2d, weight, self.recipe, offset, native)
                if bias is not None:
                    out = out + bias.to(out.dtype)
        return out.to(out_dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe}"


@dataclass(frozen=True)
class PrecisionPolicy:
    """Which ``nn.Linear`` layers :func:`convert_to_fp8` turns into :class:`Fp8Linear`.

    A layer is converted when its qualified name matches one of ``include``, matches none of
    ``exclude``, is not in ``keep_high_precision`` and ``min(in_features, out_features) >=
    min_features``. Patterns are :mod:`fnmatch` globs on the dotted module name. The linear of
    a :class:`~gem_precision.NormLinear` is one of these layers, named ``<name>.linear``.
    """

    include: tuple[str, ...] = ("*",)
    """Glob patterns of layer names eligible for FP8."""
    exclude: tuple[str, ...] = ()
    """Glob patterns of layer names kept in high precision."""
    min_features: int = 1024
    """Layers with ``min(in_features, out_features)`` below this stay high precision: small
    GEMMs lose accuracy in FP8 and gain no speed, since quantising the operands costs about as
    much as the GEMM time saved (H200, M=65536: see ``benchmarks/bench_fp8_linear.py``)."""
    keep_high_precision: tuple[str, ...] = ()
    """Exact names of layers (e.g. the output head) that stay high precision; each must exist."""
    recipe: Fp8Recipe = field(default_factory=Fp8Recipe)
    """Recipe given to every converted layer."""

    def __post_init__(self) -> None:
        for name in ("include", "exclude", "keep_high_precision"):
            value = getattr(self, name)
            if not isinstance(value, tuple) or not all(isinstance(p, str) for p in value):
                raise TypeError(f"{name} must be a tuple of str, got {value!r}")
        m = self.min_features
        if isinstance(m, bool) or not isinstance(m, int) or m < 0:
            raise ValueError(f"min_features must be a non-negative int, got {m!r}")
        if not isinstance(self.recipe, Fp8Recipe):
            raise TypeError(f"recipe must be an Fp8Recipe, got {type(self.recipe).__name__}")

    def decide(self, name: str, linear: nn.Linear) -> str | None:
        """``None`` if the layer should be converted, else the reason it stays."""
        if name in self.keep_high_precision:
            return "keep_high_precision"
        if not any(fnmatch.fnmatchcase(name, p) for p in self.include):
            return "not included"
        if any(fnmatch.fnmatchcase(name, p) for p in self.exclude):
            return "excluded"
        if min(linear.in_features, linear.out_features) < self.min_features:
            return f"min(in, out) < {self.min_features}"
        return None


@dataclass
class ConversionReport:
    """What :func:`convert_to_fp8` did."""

    converted: list[str] = field(default_factory=list)
    """Qualified names of the layers replaced by :class:`Fp8Linear` (``<name>.linear`` for a
    :class:`~gem_precision.NormLinear` replaced by an :class:`~gem_precision.Fp8NormLinear`)."""
    kept: dict[str, str] = field(default_factory=dict)
    """Linear layers left alone, with the reason."""

    @property
    def converted_fraction(self) -> float:
        """Fraction of linear layers that were converted (NaN if there are none)."""
        total = len(self.converted) + len(self.kept)
        return len(self.converted) / total if total else math.nan


def convert_to_fp8(module: nn.Module, policy: PrecisionPolicy | None = None) -> ConversionReport:
    """Replace (in place) the ``nn.Linear`` children of ``module`` selected by ``policy``.

    A selected linear that is the ``linear`` of a :class:`~gem_precision.NormLinear` (named
    ``<name>.linear``) does not become an :class:`Fp8Linear` on its own: the whole NormLinear
    becomes an :class:`~gem_precision.Fp8NormLinear` (norm fused into the quantisation of the
    GEMM input) with the same norm, eps and parameter names. Converted layers share their
    parameters with the originals, so optimizers built before the conversion keep working and
    state dict keys do not change. Layers that are already :class:`Fp8Linear` are left as they
    are. Raises ``ValueError`` if a name in ``policy.keep_high_precision`` is not a linear layer
    of ``module``.
    """
    # fused_norm builds on this module (Fp8Linear), so it can only be imported at call time.
    from gem_precision.fused_norm import NormLinear, _fp8_norm_linear

    policy = policy or PrecisionPolicy()
    report = ConversionReport()
    report.converted, report.kept = _swap_linears(
        module,
        policy,
        lambda linear: Fp8Linear.from_linear(linear, policy.recipe),
        skip=(Fp8Linear,),
        hint="wrap it with Fp8Linear.from_linear",
        owner=(NormLinear, lambda norm_linear: _fp8_norm_linear(norm_linear, policy.recipe)),
    )
    return report


def _register_sr_offset(module: nn.Module, device: torch.device) -> None:
    """The Philox counter of stochastic rounding, advanced by every training forward so that
    steps draw new bits. An int64 tensor moved in place rather than a Python int: torch.compile
    specialises on ints and would recompile every step, and the kernels read it on the device
    (no host sync). Not persistent: state dicts keep the keys of ``nn.Linear``, so checkpoints
    load either way and ``convert_to_fp8`` changes no key; a trainer saves and restores the
    counters with :func:`rounding_state` / :func:`load_rounding_state`, as it does RNG states."""
    module.register_buffer(
        "_sr_offset", torch.zeros((), dtype=torch.int64, device=device), persistent=False
    )


def rounding_state(model: nn.Module) -> dict[str, int]:
    """The stochastic-rounding counter of every :class:`Fp8Linear` in ``model``, by qualified
    name: with :func:`load_rounding_state`, what an exact resume needs beside the state dict
    (like an RNG state, it is not part of it). Reads device values: a host sync."""
    return {
        name: int(module._sr_offset)
        for name, module in model.named_modules()
        if isinstance(module, Fp8Linear)
    }


def load_rounding_state(model: nn.Module, state: dict[str, int]) -> None:
    """Restores the counters :func:`rounding_state` gave. Every :class:`Fp8Linear` of
    ``model`` must have an entry, and every entry a layer: a ``ValueError`` names the others."""
    layers = {name: m for name, m in model.named_modules() if isinstance(m, Fp8Linear)}
    if layers.keys() != state.keys():
        raise ValueError(
            f"state must hold the counter of every Fp8Linear of the model: missing "
            f"{sorted(layers.keys() - state.keys())}, unknown {sorted(state.keys() - layers.keys())}"
        )
    for name, layer in layers.items():
        value = state[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"state[{name!r}] must be an int >= 0, got {value!r}")
        layer._sr_offset.fill_(value)


def _check_linear_input(x: object, in_features: int, weight: torch.Tensor) -> None:
    """``x`` for an FP8 linear of ``in_features`` whose weight is ``weight``: a floating tensor
    (float16, bfloat16, float32, float64) with that last dimension, on the weight's device."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _LINEAR_DTYPES:
        raise TypeError(f"x must have dtype float16, bfloat16, float32 or float64, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] != in_features:
        raise ValueError(
            f"the last dim of x must be in_features={in_features}, got {tuple(x.shape)}"
        )
    if x.device != weight.device:
        raise ValueError(f"x is on {x.device} but the weight is on {weight.device}")


def _check_recipe(recipe: object) -> None:
    if recipe is not None and not isinstance(recipe, Fp8Recipe):
        raise TypeError(f"recipe must be an Fp8Recipe or None, got {type(recipe).__name__}")


def _sharing_parameters_of(cls: type[nn.Module], linear: nn.Linear) -> nn.Module:
    """A ``cls`` instance, not ``__init__``-ed, holding ``linear``'s own weight and bias
    (shared, not copied, so optimizers and state dicts keep working)."""
    if not isinstance(linear, nn.Linear):
        raise TypeError(f"linear must be an nn.Linear, got {type(linear).__name__}")
    new = cls.__new__(cls)
    nn.Module.__init__(new)
    new.in_features, new.out_features = linear.in_features, linear.out_features
    new.weight = linear.weight
    new.register_parameter("bias", linear.bias)
    new.train(linear.training)
    return new


def _swap_linears(
    module: nn.Module,
    policy: PrecisionPolicy,
    make: Callable[[nn.Linear], nn.Module],
    *,
    skip: tuple[type, ...],
    hint: str,
    owner: tuple[type, Callable[[nn.Module], nn.Module]] | None = None,
) -> tuple[list[str], dict[str, str]]:
    """Replace in place every ``nn.Linear`` of ``module`` that ``policy`` does not keep.

    Layers that are instances of ``skip`` (already converted) are left alone. Returns the names
    replaced by ``make(linear)`` and, for the kept ones, the policy's reason. ``hint`` says what
    to do instead when ``module`` itself is a linear layer. With ``owner=(cls, make_owner)``, a
    selected linear that is the ``linear`` child of a ``cls`` module is converted by replacing
    that module with ``make_owner(it)`` (under the linear's name in the result).
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
    if not isinstance(policy, PrecisionPolicy):
        raise TypeError(f"policy must be a PrecisionPolicy, got {type(policy).__name__}")
    linears = {
        name: m
        for name, m in module.named_modules()
        if isinstance(m, nn.Linear) and not isinstance(m, skip)
    }
    missing = [n for n in policy.keep_high_precision if n not in linears]
    if missing:
        raise ValueError(
            f"policy.keep_high_precision names {missing} that are not nn.Linear layers of the "
            f"module (linear layers: {sorted(linears)})"
        )
    converted: list[str] = []
    kept: dict[str, str] = {}
    # nn.MultiheadAttention reads its out_proj's weight and bias itself, never its forward.
    attention_owned = {
        f"{owner_name}.out_proj" if owner_name else "out_proj"
        for owner_name, m in module.named_modules()
        if isinstance(m, nn.MultiheadAttention)
    }
    for name, linear in linears.items():
        if name in attention_owned:
            kept[name] = "out_proj of an nn.MultiheadAttention, which never calls its forward"
            continue
        reason = policy.decide(name, linear)
        if reason is not None:
            kept[name] = reason
            continue
        if not name:
            raise ValueError(f"module itself is an nn.Linear; {hint}")
        parent_name, _, child_name = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        if owner is not None and isinstance(parent, owner[0]) and child_name == "linear":
            if not parent_name:
                raise ValueError(
                    f"module itself is a {owner[0].__name__}; convert a module that contains it"
                )
            outer_name, _, attr = parent_name.rpartition(".")
            outer = module.get_submodule(outer_name) if outer_name else module
            setattr(outer, attr, owner[1](parent))
        else:
            setattr(parent, child_name, make(linear))
        converted.append(name)
    return converted, kept
