"""Block-scaled FP8 quantization of 2-D tensors with power-of-two scales (Hopper FP8 recipe).

A 2-D tensor is cut into tiles of ``block_shape`` (``(1, 128)`` for activations and gradients,
``(128, 128)`` for weights; edge tiles may be partial). Each tile gets the smallest power-of-two
scale ``s`` with ``amax / s <= max_normal``, so no element saturates, and the elements
``x / s`` are rounded to FP8 (nearest-even, or stochastically with Philox random bits).
``block_shape=None`` uses one scale for the whole tensor ("tensorwise").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gem_precision.mx import MX_ELEMENT_DTYPES, _pow2_fp32
from gem_precision.rounding import stochastic_round_to_fp8

__all__ = [
    "dequantize_blockwise",
    "fake_quantize_blockwise",
    "quantize_blockwise",
]

# Keeps 2**-exponent a normal float32 for any input (tiny amax would otherwise overflow it).
_MIN_SCALE_EXP = -120
_MAX_SCALE_EXP = 120


def _tile_shape(x: torch.Tensor, block_shape: tuple[int, int] | None) -> tuple[int, int]:
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D, got shape {tuple(x.shape)}")
    if block_shape is None:
        return max(x.shape[0], 1), max(x.shape[1], 1)
    if (
        not isinstance(block_shape, tuple)
        or len(block_shape) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block_shape)
    ):
        raise ValueError(
            f"block_shape must be None or a tuple of 2 positive ints, got {block_shape!r}"
        )
    return block_shape


def _pow2_scale_exponent(amax: torch.Tensor, max_normal: float) -> torch.Tensor:
    """Smallest integer ``e`` with ``amax / 2**e <= max_normal`` (0 for zero / non-finite)."""
    amax = torch.where(torch.isfinite(amax) & (amax > 0), amax, torch.zeros_like(amax))
    _, exp = torch.frexp(amax / max_normal)  # ratio in [2**(exp-1), 2**exp)
    exp = exp.to(torch.int32).clamp(-125, 126)
    # Correct the estimate exactly (the division above rounds); powers of two built from bits
    # are exact on every backend, and dividing by them is exact for normal results.
    exp = torch.where(amax / _pow2_fp32(exp - 1) <= max_normal, exp - 1, exp)
    exp = torch.where(amax / _pow2_fp32(exp) > max_normal, exp + 1, exp)
    exp = torch.where(amax > 0, exp, torch.zeros_like(exp))
    return exp.clamp(_MIN_SCALE_EXP, _MAX_SCALE_EXP)


def quantize_blockwise(
    x: torch.Tensor,
    block_shape: tuple[int, int] | None = (1, 128),
    dtype: torch.dtype = torch.float8_e4m3fn,
    *,
    stochastic_seed: int | None = None,
    offset: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D float tensor to FP8 with one power-of-two float32 scale per tile.

    Args:
        x: 2-D float32/bfloat16/float16 tensor of shape ``(R, C)``.
        block_shape: tile ``(rows, cols)``; ``None`` for a single tensorwise scale.
        dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        stochastic_seed: if given, round stochastically (:func:`stochastic_round_to_fp8`) with
            this Philox seed and ``offset``; otherwise round to nearest-even.
        offset: Philox counter offset for stochastic rounding.

    Returns:
        ``(data, scale)``: FP8 ``data`` of shape ``(R, C)`` and float32 ``scale`` of shape
        ``(ceil(R / rows), ceil(C / cols))`` with ``x ~= data * scale`` tile by tile.
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"x must be a floating point torch.Tensor, got {type(x).__name__}")
    if dtype not in MX_ELEMENT_DTYPES:
        raise TypeError(f"dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")
    rows, cols = _tile_shape(x, block_shape)
    max_normal = MX_ELEMENT_DTYPES[dtype].max_normal
    r, c = x.shape
    pad_r, pad_c = (-r) % rows, (-c) % cols
    padded = F.pad(x.to(torch.float32), (0, pad_c, 0, pad_r))
    tiles = padded.reshape(padded.shape[0] // rows, rows, padded.shape[1] // cols, cols)
    amax = tiles.abs().amax(dim=(1, 3))
    exponent = _pow2_scale_exponent(amax, max_normal)
    scale = _pow2_fp32(exponent)
    scaled = tiles * _pow2_fp32(-exponent)[:, None, :, None]
    scaled = scaled.reshape(padded.shape)[:r, :c]
    if stochastic_seed is None:
        data = scaled.clamp(-max_normal, max_normal).to(dtype)
    else:
        data = stochastic_round_to_fp8(scaled, dtype, seed=stochastic_seed, offset=offset)
    return data, scale


def dequantize_blockwise(
    data: torch.Tensor, scale: torch.Tensor, block_shape: tuple[int, int] | None = (1, 128)
) -> torch.Tensor:
    """Float32 ``data * scale`` with each tile scale broadcast over its ``block_shape`` tile."""
    rows, cols = _tile_shape(data, block_shape)
    expanded = scale.repeat_interleave(rows, dim=0).repeat_interleave(cols, dim=1)
    return data.to(torch.float32) * expanded[: data.shape[0], : data.shape[1]]


def fake_quantize_blockwise(
    x: torch.Tensor,
    block_shape: tuple[int, int] | None = (1, 128),
    dtype: torch.dtype = torch.float8_e4m3fn,
    *,
    stochastic_seed: int | None = None,
    offset: int = 0,
) -> torch.Tensor:
    """Quantize then dequantize (float32 result): the values an FP8 GEMM would see."""
    data, scale = quantize_blockwise(
        x, block_shape, dtype, stochastic_seed=stochastic_seed, offset=offset
    )
    return dequantize_blockwise(data, scale, block_shape)
