"""OCP Microscaling (MX) formats: MXFP8 quantize / dequantize in plain PyTorch.

An MX tensor stores blocks of ``block_size`` consecutive elements (along the last dim) as FP8
elements (E4M3 or E5M2) that share one power-of-two scale stored as an E8M0 byte
(``2 ** (byte - 127)``, byte ``0xFF`` = NaN). With ``square=True`` a block is a
``block_size x block_size`` square of the last two dims instead, so the quantisation of ``x.T``
is the transpose of the quantisation of ``x`` (one copy serves both GEMM layouts). This follows the OCP Microscaling Formats (MX)
Specification v1.0, section 6.3:

* shared exponent ``= floor(log2(amax)) - emax_elem`` (``emax_elem`` = 8 for E4M3, 15 for E5M2),
  clamped to the E8M0 range ``[-127, 127]``;
* elements ``= x / 2 ** shared_exp`` rounded to nearest-even in the element format and saturated
  to its largest normal (448 for E4M3, 57344 for E5M2).

``scale_rounding="ceil"`` instead picks the smallest power of two ``s`` with ``amax / s <=
max_normal`` (the "RCEIL" recipe of Blackwell's MXFP8 hardware), so no element saturates.

Special values: a block that contains NaN or +-Inf gets scale ``0xFF`` (NaN) and zero elements,
so the whole block dequantizes to NaN (FP8 E4M3 has no Inf, and an Inf would leave the shared
exponent undefined). An all-zero block gets the smallest scale (byte 0, ``2**-127``) and zero
elements.

All arithmetic on scales is done on exponent bits, so it is exact for subnormal inputs too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

__all__ = [
    "E8M0_BIAS",
    "E8M0_NAN",
    "MX_ELEMENT_DTYPES",
    "MXTensor",
    "dequantize_mx",
    "quantize_mx",
]

E8M0_BIAS = 127
"""Bias of the E8M0 scale: a stored byte ``b`` means ``2 ** (b - 127)``."""

E8M0_NAN = 0xFF
"""E8M0 byte that encodes a NaN scale."""

_E8M0_MIN_EXP = -127
_E8M0_MAX_EXP = 127


@dataclass(frozen=True)
class _ElementFormat:
    emax: int
    max_normal: float


MX_ELEMENT_DTYPES: dict[torch.dtype, _ElementFormat] = {
    torch.float8_e4m3fn: _ElementFormat(emax=8, max_normal=448.0),
    torch.float8_e5m2: _ElementFormat(emax=15, max_normal=57344.0),
}
"""Supported MX element dtypes with their largest normal exponent and value."""

_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FP32_MANTISSA_BITS = 23
_FP32_MANTISSA_MASK = (1 << _FP32_MANTISSA_BITS) - 1
# Both FP8 max normals are 1.75 * 2**emax: mantissa field 0b11 followed by zeros in FP32.
_MAX_NORMAL_MANTISSA_FIELD = 0x600000

ScaleRounding = Literal["floor", "ceil"]


@dataclass
class MXTensor:
    """A tensor in an OCP MX format (block-scaled FP8 elements with E8M0 scales)."""

    data: torch.Tensor
    """FP8 elements (``torch.float8_e4m3fn`` or ``torch.float8_e5m2``) with the original shape."""
    scale: torch.Tensor
    """``uint8`` E8M0 biased exponents, shape ``data.shape[:-1] + (data.shape[-1] // block_size,)``;
    ``0xFF`` marks a NaN block."""
    block_size: int = 32
    """Number of consecutive last-dim elements sharing one scale."""
    orig_dtype: torch.dtype = torch.float32
    """Dtype of the tensor that was quantized; ``dequantize()`` returns it by default."""
    square: bool = False
    """Blocks are ``block_size x block_size`` squares of the last two dims; ``scale`` then has
    shape ``data.shape[:-2] + (rows // block_size, cols // block_size)``."""

    def __post_init__(self) -> None:
        if self.data.dtype not in MX_ELEMENT_DTYPES:
            raise TypeError(
                f"data must have dtype float8_e4m3fn or float8_e5m2, got {self.data.dtype}"
            )
        if self.scale.dtype != torch.uint8:
            raise TypeError(f"scale must have dtype uint8 (E8M0), got {self.scale.dtype}")
        expected = _scale_shape(self.data.shape, self.block_size, "data", self.square)
        if tuple(self.scale.shape) != expected:
            raise ValueError(
                f"scale must have shape {expected} for data of shape {tuple(self.data.shape)} "
                f"and block_size={self.block_size}, got {tuple(self.scale.shape)}"
            )

    @property
    def shape(self) -> torch.Size:
        """Shape of the represented (dequantized) tensor."""
        return self.data.shape

    @property
    def elem_dtype(self) -> torch.dtype:
        """FP8 dtype of the elements."""
        return self.data.dtype

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Return ``data * 2 ** (scale - 127)`` in ``dtype`` (default: ``orig_dtype``)."""
        return dequantize_mx(self, dtype=dtype)


def _scale_shape(
    shape: torch.Size, block_size: int, name: str, square: bool = False
) -> tuple[int, ...]:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if block_size >= 2**31:
        raise ValueError(f"block_size must be below 2**31, got {block_size}")
    if not isinstance(square, bool):
        raise TypeError(f"square must be a bool, got {square!r}")
    if len(shape) == 0:
        raise ValueError(f"{name} must have at least one dimension, got a 0-d tensor")
    if square and len(shape) < 2:
        raise ValueError(
            f"{name} must have at least two dimensions for square blocks, got {tuple(shape)}"
        )
    if shape[-1] % block_size != 0:
        raise ValueError(
            f"the last dim of {name} ({shape[-1]}) must be divisible by block_size={block_size}"
        )
    if square:
        if shape[-2] % block_size != 0:
            raise ValueError(
                f"the second-to-last dim of {name} ({shape[-2]}) must be divisible by "
                f"block_size={block_size} for square blocks"
            )
        return (*shape[:-2], shape[-2] // block_size, shape[-1] // block_size)
    return (*shape[:-1], shape[-1] // block_size)


def _to_blocks(x: torch.Tensor, block_size: int, square: bool) -> torch.Tensor:
    """``(*scale_shape, elements_per_block)`` view/copy of ``x``."""
    if not square:
        return x.reshape(*x.shape[:-1], x.shape[-1] // block_size, block_size)
    *batch, rows, cols = x.shape
    b = block_size
    blocks = x.reshape(*batch, rows // b, b, cols // b, b).transpose(-3, -2)
    return blocks.reshape(*batch, rows // b, cols // b, b * b)


def _from_blocks(
    blocks: torch.Tensor, shape: torch.Size, block_size: int, square: bool
) -> torch.Tensor:
    """Inverse of :func:`_to_blocks`."""
    if not square:
        return blocks.reshape(shape)
    *batch, rows, cols = shape
    b = block_size
    x = blocks.reshape(*batch, rows // b, cols // b, b, b).transpose(-3, -2)
    return x.reshape(shape)


def _fp32_exponent_field(x: torch.Tensor) -> torch.Tensor:
    """Biased exponent bits (0..255) of a float32 tensor, as int32."""
    return (x.view(torch.int32) >> _FP32_MANTISSA_BITS) & 0xFF


def _pow2_fp32(exponent: torch.Tensor) -> torch.Tensor:
    """Exact ``2 ** exponent`` in float32 for int32 exponents in ``[-127, 127]``.

    Built from bits instead of ``exp2`` so it is exact on every backend; ``2**-127`` is the
    float32 subnormal with only the top mantissa bit set.
    """
    normal = ((exponent + 127).clamp(min=1) << _FP32_MANTISSA_BITS).view(torch.float32)
    smallest = torch.full_like(exponent, 1 << (_FP32_MANTISSA_BITS - 1)).view(torch.float32)
    return torch.where(exponent <= -127, smallest, normal)


def _check_quantize_args(x: object, elem_dtype: object, scale_rounding: object) -> None:
    """The argument checks shared by :func:`quantize_mx` and its Triton twin."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _INPUT_DTYPES:
        raise TypeError(f"x must have dtype float32, bfloat16 or float16, got {x.dtype}")
    if not isinstance(elem_dtype, torch.dtype) or elem_dtype not in MX_ELEMENT_DTYPES:
        raise TypeError(
            f"elem_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {elem_dtype!r}"
        )
    if scale_rounding not in ("floor", "ceil"):
        raise ValueError(f"scale_rounding must be 'floor' or 'ceil', got {scale_rounding!r}")


def quantize_mx(
    x: torch.Tensor,
    *,
    block_size: int = 32,
    elem_dtype: torch.dtype = torch.float8_e4m3fn,
    scale_rounding: ScaleRounding = "floor",
    square: bool = False,
    backend: str = "auto",
) -> MXTensor:
    """Quantize ``x`` to an MX format with one E8M0 scale per ``block_size`` last-dim elements.

    Args:
        x: float32, bfloat16 or float16 tensor whose last dim is divisible by ``block_size``.
        block_size: elements per scale block (32 in the OCP spec).
        elem_dtype: ``torch.float8_e4m3fn`` (MXFP8 E4M3) or ``torch.float8_e5m2`` (MXFP8 E5M2).
        scale_rounding: ``"floor"`` (OCP spec: ``floor(log2(amax)) - emax``, elements beyond the
            max normal saturate) or ``"ceil"`` (smallest power-of-two scale with
            ``amax / scale <= max_normal``, never saturates).
        square: one scale per ``block_size x block_size`` square of the last two dims
            (transpose-invariant) instead of per 1 x ``block_size`` row segment.
        backend: ``"torch"`` (this reference), ``"triton"`` (the one-pass kernel of
            :mod:`gem_precision.mx_triton`, same bits) or ``"auto"`` (Triton for CUDA
            tensors whose ``block_size`` is a power of two in [2, 256]).

    Returns:
        An :class:`MXTensor` with ``data`` of ``x.shape`` and ``scale`` of shape
        ``x.shape[:-1] + (x.shape[-1] // block_size,)`` (square: ``x.shape[:-2] +
        (x.shape[-2] // block_size, x.shape[-1] // block_size)``).
    """
    _check_quantize_args(x, elem_dtype, scale_rounding)
    _scale_shape(x.shape, block_size, "x", square)
    if _use_triton(x, block_size, backend):
        from gem_precision.mx_triton import quantize_mx_triton

        return quantize_mx_triton(
            x,
            block_size=block_size,
            elem_dtype=elem_dtype,
            scale_rounding=scale_rounding,
            square=square,
        )
    fmt = MX_ELEMENT_DTYPES[elem_dtype]

    # float16/bfloat16 -> float32 is exact, so everything below works on float32 bits.
    blocks = _to_blocks(x.to(torch.float32), block_size, square)
    non_finite = ~torch.isfinite(blocks).all(dim=-1)
    # Non-finite blocks are overwritten with NaN scales below; zero them here so that amax stays
    # finite and the exponent arithmetic never sees Inf/NaN bits.
    amax = torch.where(torch.isfinite(blocks), blocks.abs(), 0.0).amax(dim=-1)

    # floor(log2(amax)) is the unbiased exponent field for normal amax. Zero and float32
    # subnormal amax have field 0 -> -127, which is an upper bound of the true value; after
    # subtracting emax it is below -127 either way, so the clamp below makes it exact.
    amax_bits = amax.view(torch.int32)
    shared_exp = _fp32_exponent_field(amax) - 127 - fmt.emax
    if scale_rounding == "ceil":
        # amax = 1.m * 2**e and max_normal = 1.75 * 2**emax: amax / 2**(e - emax) <= max_normal
        # exactly when 1.m <= 1.75, otherwise one more power of two is needed.
        shared_exp = shared_exp + (
            (amax_bits & _FP32_MANTISSA_MASK) > _MAX_NORMAL_MANTISSA_FIELD
        ).to(torch.int32)
    shared_exp = shared_exp.clamp(_E8M0_MIN_EXP, _E8M0_MAX_EXP)

    # Multiply by 2**-shared_exp (exact: shared_exp <= 127 - emax keeps the factor normal).
    inv_scale = _pow2_fp32(-shared_exp).unsqueeze(-1)
    scaled = (blocks * inv_scale).clamp(-fmt.max_normal, fmt.max_normal)
    scaled = torch.where(non_finite.unsqueeze(-1), torch.zeros_like(scaled), scaled)
    data = _from_blocks(scaled.to(elem_dtype), x.shape, block_size, square)

    scale = (shared_exp + E8M0_BIAS).to(torch.uint8)
    scale = torch.where(non_finite, torch.full_like(scale, E8M0_NAN), scale)
    return MXTensor(
        data=data, scale=scale, block_size=block_size, orig_dtype=x.dtype, square=square
    )


def _use_triton(x: torch.Tensor, block_size: int, backend: str) -> bool:
    if not isinstance(backend, str) or backend not in ("auto", "torch", "triton"):
        raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
    from gem_precision import _triton

    if backend == "triton" and not _triton.can_run(x):
        raise ValueError(
            f"backend='triton' cannot run on a tensor on {x.device}: the Triton kernels need "
            "CUDA tensors, or CPU tensors with TRITON_INTERPRET=1 (and triton installed)"
        )
    if x.numel() == 0:
        return False  # nothing to quantise: the reference returns the empty result
    if backend != "auto":
        return backend == "triton"

    power_of_two = 2 <= block_size <= 256 and not block_size & (block_size - 1)
    return x.is_cuda and power_of_two and _triton.triton_available()


def dequantize_mx(
    mx: MXTensor, dtype: torch.dtype | None = None, *, backend: str = "auto"
) -> torch.Tensor:
    """Expand an :class:`MXTensor` back to a dense tensor (``dtype`` defaults to ``orig_dtype``).

    Blocks whose scale is ``0xFF`` come back as NaN. The product (float32, float64 for a float64
    result) is exact; the final cast to ``dtype`` rounds to nearest-even if ``dtype`` is
    narrower. ``backend`` as in
    :func:`quantize_mx` (Triton for float32 / bfloat16 / float16 results).
    """
    if not isinstance(mx, MXTensor):
        raise TypeError(f"mx must be an MXTensor, got {type(mx).__name__}")
    out_dtype = mx.orig_dtype if dtype is None else dtype
    if not isinstance(out_dtype, torch.dtype) or not out_dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating point torch.dtype, got {out_dtype!r}")
    if out_dtype in _INPUT_DTYPES and _use_triton(mx.data, mx.block_size, backend):
        from gem_precision.mx_triton import dequantize_mx_triton

        return dequantize_mx_triton(mx, out_dtype)
    exponent = mx.scale.to(torch.int32) - E8M0_BIAS
    scale = _pow2_fp32(exponent.clamp(max=_E8M0_MAX_EXP))
    scale = torch.where(mx.scale == E8M0_NAN, torch.full_like(scale, float("nan")), scale)
    # float64: products past float32's range (a scale of 2^127 times 448) stay finite.
    work = torch.float64 if out_dtype == torch.float64 else torch.float32
    scale = scale.to(work)
    blocks = _to_blocks(mx.data.to(work), mx.block_size, mx.square)
    out = blocks * scale.unsqueeze(-1)
    return _from_blocks(out, mx.data.shape, mx.block_size, mx.square).to(out_dtype)
