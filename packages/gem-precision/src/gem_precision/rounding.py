"""Stochastic rounding to FP8 with counter-based (Philox-4x32-10) random bits.

The random bits come from our own tensor implementation of Philox-4x32-10 (Salmon et al., SC'11)
rather than from a ``torch.Generator``: the stream is then a pure function of ``(seed, offset,
element index)``, identical on every device and torch version, and a caller can skip ahead by
moving ``offset`` (e.g. ``offset = step * numel``) without generating the skipped numbers.
``offset`` may also be a one-element int64 tensor on the data's device, read there (no host
sync), so a counter kept in a tensor (:class:`~gem_precision.Fp8Linear`'s) can move every step
without ``torch.compile`` recompiling.

Element ``i`` (row-major over ``x``) uses the first output word of Philox with key
``(seed & 0xFFFFFFFF, seed >> 32)`` and counter ``(c & 0xFFFFFFFF, c >> 32, 0, 0)`` where
``c = offset + i``. The top 24 bits of that word give a uniform ``u`` in ``[0, 1)``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from gem_kernels.triton_loader import load_kernel_module, triton_importable

from gem_precision.mx import MX_ELEMENT_DTYPES

__all__ = [
    "philox_uint32",
    "philox_uniform",
    "stochastic_round_to_fp8",
]

_MASK32 = 0xFFFFFFFF
_PHILOX_M0 = 0xD2511F53
_PHILOX_M1 = 0xCD9E8D57
_PHILOX_W0 = 0x9E3779B9
_PHILOX_W1 = 0xBB67AE85
_PHILOX_ROUNDS = 10
_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Largest finite FP8 code (sign bit clear): E4M3fn 0x7E = 448, E5M2 0x7B = 57344.
_MAX_CODE = {torch.float8_e4m3fn: 0x7E, torch.float8_e5m2: 0x7B}


def _mulhilo(multiplier: int, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32-bit words of ``multiplier * value`` (both < 2**32) in int64 tensors.

    The 64-bit product overflows signed int64, so it is assembled from two 48-bit partial
    products (``value`` split into 16-bit halves).
    """
    low_part = (value & 0xFFFF) * multiplier  # < 2**48
    high_part = (value >> 16) * multiplier  # < 2**48
    hi = (high_part + (low_part >> 16)) >> 16
    lo = (((high_part & 0xFFFF) << 16) + low_part) & _MASK32
    return hi, lo


def _check_seed_offset(seed: int, offset: int | torch.Tensor, device: torch.device) -> None:
    if isinstance(offset, torch.Tensor):
        # Its value is not checked: that would read it on the host (a sync on a GPU).
        if (
            offset.dtype != torch.int64
            or offset.numel() != 1
            or offset.device.type != device.type
            or device.index not in (None, offset.device.index)
        ):
            raise ValueError(
                f"a tensor offset must be one int64 element on {device}, got "
                f"{offset.dtype} {tuple(offset.shape)} on {offset.device}"
            )
        values = (("seed", seed),)
    else:
        values = (("seed", seed), ("offset", offset))
    for name, value in values:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if not 0 <= value < 2**63:
            raise ValueError(f"{name} must be in [0, 2**63), got {value}")


def philox_uint32(
    numel: int,
    *,
    seed: int,
    offset: int | torch.Tensor = 0,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """First Philox-4x32-10 output word for counters ``offset .. offset + numel - 1``.

    Returns an int64 tensor of shape ``(numel,)`` with values in ``[0, 2**32)``; see the module
    docstring for the key/counter layout. ``offset``: an int in ``[0, 2**63)`` or a
    one-element int64 tensor on ``device`` holding one.
    """
    device = torch.device(device or "cpu")
    _check_seed_offset(seed, offset, device)
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ValueError(f"numel must be a non-negative int, got {numel!r}")
    if device.type == "cuda" and triton_importable():
        return _philox_uint32_triton(numel, seed, offset, device)
    if isinstance(offset, torch.Tensor):
        offset = offset.reshape(())
    counter = torch.arange(numel, dtype=torch.int64, device=device) + offset
    zeros = torch.zeros_like(counter)
    words = _philox4x32(
        (counter & _MASK32, (counter >> 32) & _MASK32, zeros, zeros),
        (seed & _MASK32, (seed >> 32) & _MASK32),
    )
    return words[0]


_PHILOX_KERNEL_FILE = Path(__file__).with_name("_philox_kernels.py")
_PHILOX_BLOCK = 1024


def _philox_uint32_triton(
    numel: int, seed: int, offset: int | torch.Tensor, device: torch.device
) -> torch.Tensor:
    """:func:`philox_uint32` in one Triton launch (compiled on CUDA, interpreted on CPU)."""
    kernels = load_kernel_module(_PHILOX_KERNEL_FILE, interpret=device.type != "cuda")
    out = torch.empty(numel, dtype=torch.int64, device=device)
    if not isinstance(offset, torch.Tensor):
        # The kernel loads the offset from memory (a tensor offset is never read on the host);
        # a fill kernel, no host-to-device copy.
        offset = torch.full((1,), offset, dtype=torch.int64, device=device)
    if numel:
        grid = (-(-numel // _PHILOX_BLOCK),)
        kernels.philox_uint32_kernel[grid](
            out, numel, offset, seed & _MASK32, seed >> 32, BLOCK=_PHILOX_BLOCK
        )
    return out


def _philox4x32(
    counter: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], key: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Philox-4x32-10 on int64 tensors holding 32-bit words; returns the four output words."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for round_index in range(_PHILOX_ROUNDS):
        if round_index > 0:
            k0, k1 = (k0 + _PHILOX_W0) & _MASK32, (k1 + _PHILOX_W1) & _MASK32
        hi0, lo0 = _mulhilo(_PHILOX_M0, c0)
        hi1, lo1 = _mulhilo(_PHILOX_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def philox_uniform(
    shape: tuple[int, ...] | torch.Size,
    *,
    seed: int,
    offset: int | torch.Tensor = 0,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Float32 uniforms in ``[0, 1)`` (24 random bits each) of ``shape``, deterministic in
    ``(seed, offset)``; element ``i`` in row-major order uses Philox counter ``offset + i``
    (``offset`` as in :func:`philox_uint32`)."""
    numel = 1
    for size in shape:
        numel *= int(size)
    bits = philox_uint32(numel, seed=seed, offset=offset, device=device)
    return ((bits >> 8).to(torch.float32) * 2.0**-24).reshape(tuple(shape))


def stochastic_round_to_fp8(
    x: torch.Tensor,
    dtype: torch.dtype = torch.float8_e4m3fn,
    *,
    seed: int,
    offset: int | torch.Tensor = 0,
) -> torch.Tensor:
    """Round ``x`` stochastically to the FP8 grid of ``dtype`` and return it in that dtype.

    A value between neighbouring representable values ``lo < |x| < hi`` becomes ``hi`` with
    probability ``(|x| - lo) / (hi - lo)`` (unbiased up to the 2**-24 resolution of the random
    numbers); representable values are exact. Magnitudes at or beyond the max normal (448 for
    E4M3, 57344 for E5M2), including +-Inf, saturate to +-max normal; NaN stays NaN. Random
    numbers come from :func:`philox_uniform` with ``(seed, offset)``, so the result is
    deterministic and identical on every device.

    Args:
        x: float32, bfloat16 or float16 tensor (no scaling is applied: scale it first).
        dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        seed: Philox key, an int in ``[0, 2**63)``.
        offset: Philox counter of the first element; use disjoint ranges for independent draws.
            An int, or a one-element int64 tensor on ``x``'s device (read there, no host sync).
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _INPUT_DTYPES:
        raise TypeError(f"x must have dtype float32, bfloat16 or float16, got {x.dtype}")
    if dtype not in MX_ELEMENT_DTYPES:
        raise TypeError(f"dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")
    _check_seed_offset(seed, offset, x.device)
    max_normal = MX_ELEMENT_DTYPES[dtype].max_normal

    values = x.to(torch.float32)
    magnitude = values.abs().clamp(max=max_normal)  # NaN passes through clamp
    nearest = magnitude.to(dtype)  # round-to-nearest-even, in range thanks to the clamp
    nearest_value = nearest.to(torch.float32)
    # Positive FP8 codes are ordered like their values, so the other neighbour is one code away.
    code = nearest.view(torch.uint8).to(torch.int16)
    other_code = torch.where(nearest_value < magnitude, code + 1, code - 1)
    other_code = other_code.clamp(0, _MAX_CODE[dtype]).to(torch.uint8)
    other_value = other_code.view(dtype).to(torch.float32)
    low = torch.minimum(nearest_value, other_value)
    high = torch.maximum(nearest_value, other_value)
    gap = high - low
    prob_up = torch.where(gap > 0, (magnitude - low) / torch.where(gap > 0, gap, 1.0), 0.0)
    uniform = philox_uniform(x.shape, seed=seed, offset=offset, device=x.device)
    rounded = torch.where(uniform < prob_up, high, low)
    rounded = torch.where(magnitude == nearest_value, nearest_value, rounded)  # exact values
    rounded = torch.where(torch.isnan(values), values, torch.copysign(rounded, values))
    return rounded.to(dtype)
