"""Block-scaled FP8 quantization of 2-D tensors with power-of-two scales (Hopper FP8 recipe).

A 2-D tensor is cut into tiles of ``block_shape`` (``(1, 128)`` for activations and gradients,
``(128, 128)`` for weights; edge tiles may be partial). Each tile gets the smallest power-of-two
scale ``s`` with ``amax / s <= max_normal``, so no element saturates, and the elements
``x / s`` are rounded to FP8 (nearest-even, or stochastically with Philox random bits).
``block_shape=None`` uses one scale for the whole tensor ("tensorwise").
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gem_precision.mx import MX_ELEMENT_DTYPES, _pow2_fp32
from gem_precision.rounding import stochastic_round_to_fp8

__all__ = [
    "BLOCK",
    "Fp8Operand",
    "dequantize_blockwise",
    "dequantize_operand",
    "fake_quantize_blockwise",
    "quantize_blockwise",
    "quantize_operand",
]

_POSITIVE_NAN = float("nan")  # sign bit clear (Python's NaN)

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


@functools.cache
def _float32_bits(value: float) -> int:
    """The IEEE float32 bit pattern of ``value`` (host arithmetic, no tensor per call)."""
    return struct.unpack("<i", struct.pack("<f", value))[0]


def _pow2_scale_exponent(amax: torch.Tensor, max_normal: float) -> torch.Tensor:
    """Smallest integer ``e`` with ``amax / 2**e <= max_normal``, clamped to
    [-120, 120] (0 for zero / non-finite ``amax``).

    Exact for every float32 ``amax``, subnormals included: with ``amax = 1.a * 2**E`` and
    ``max_normal = 1.m * 2**emax``, ``e = E - emax`` if ``1.a <= 1.m`` else ``E - emax + 1``
    (a subnormal ``amax`` gives an ``e`` below the clamp). Worked out on the float32 bits.
    """
    amax = amax.to(torch.float32)
    valid = torch.isfinite(amax) & (amax > 0)
    amax = torch.where(valid, amax, torch.ones_like(amax))
    max_bits = _float32_bits(max_normal)
    max_exp, max_mantissa = ((max_bits >> 23) & 0xFF) - 127, max_bits & 0x7FFFFF
    bits = amax.view(torch.int32)
    exp = ((bits >> 23) & 0xFF) - 127 - max_exp + ((bits & 0x7FFFFF) > max_mantissa).to(torch.int32)
    exp = exp.clamp(_MIN_SCALE_EXP, _MAX_SCALE_EXP)
    return torch.where(valid, exp, torch.zeros_like(exp)).to(torch.int32)


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
        # NaN of either sign is written as the positive NaN (0x7F), as the GPU conversion does.
        scaled = torch.where(torch.isnan(scaled), _POSITIVE_NAN, scaled)
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


# ---------------------------------------------------------------------------------------------
# Operands laid out for scaled GEMMs (quantised once, used by forward, dgrad and wgrad).

BLOCK = 128
"""Block length of the Hopper recipe (1x128 activations / gradients, 128x128 weights)."""

# Launch options of the one-pass operand kernels. ``variant`` picks the kernel of the 1x128 and
# tensorwise kinds: "tile" (blockwise_tile_kernel, one program per 128x128 tile with the integer
# block maximum and no explicit saturation) or "dual" (blockwise_dual_kernel, the first version;
# 31% of HBM for both layouts on the H200; it also serves the 128x128 kind). "tile_warps" (with
# "tile_warps_colsum" when column sums are also written, "tile_warps_x" for col_tiles) /
# "num_warps" are the warps of the tile / the other kernels, "trans" the transpose variant of
# the "dual" kernel, "rows_only_block_r" the rows per program when only the row layout is
# written. Defaults: the fastest bit-exact options on an H200 (65536 x 4096 bf16, both
# layouts): "tile" 0.390 ms with 8 warps (0.405 with 4, 0.618 with 16), but with the column
# sums 0.424 ms with 4 warps against 0.697 with 8; rows and 128x128 tiles of x.T 0.295 ms (4 or
# 8 warps); "dual" 0.834 ms. Rows only: 0.217 ms (32 or 64 rows per program). "early_col": the
# tile kernel reduces the column maxima before writing the row layout (dy 0.413 against 0.424
# ms, x with 1x128 blocks of x.T 0.346 ms with 8 warps).
# Measured on the H200, bit-exact, slower, and removed (2026-11-30): a kernel walking each tile
# in 32-row slices twice (1.57-1.67 ms), block maxima on the raw bfloat16 bits (dy 0.47-0.51
# ms), 2 or 4 column blocks per program (dy 0.63-1.0 ms, x tiles 0.45-0.49 against 0.33), the
# column maxima and sums in one two-value reduction (dy 0.430 against 0.412 ms), and a grid
# walking column blocks first (0.48 ms, no gain).
# "t_run" / "t_run_colsum" / "t_run_x" (0, 4, 8 or 16): the tile kernel stores x.T as packed
# runs of that many rows per thread instead of transposing FP8 bytes through shared memory (one
# byte load per element); whole tiles only. H200, 65536 x 4096 / 8192 bf16 (2026-11-30,
# benchmarks/results/h200/fp8_quant_explore.json): dy 0.415 -> 0.392 ms (62.0 -> 65.6% of HBM)
# and 0.803 -> 0.755 ms at 8192 with runs of 4 (8: 0.407, 16: 0.406); dy without sums 0.347 ->
# 0.327 ms (8 warps, runs of 4); x with 128x128 tiles of x.T slower with runs (0.321-0.341
# against 0.294 ms), so "t_run_x" stays 0. Runs are used for bfloat16 x with 1x128 blocks only:
# the tensorwise kind with runs wrote a misordered data_t on the H200 (Triton 3.6; bit-exact in
# the interpreter), and float32 x was not checked there. Measured for dy, slower, and removed
# (variants in fp8_quant_explore.json): an evict-first hint on the x read (0.428 ms), a register
# cap for 3 programs per SM (168: 0.412), column sums as ones(16|64, 128) @ x on the tensor
# cores (0.409-0.459), and a persistent grid with or without prefetching the next tile
# (0.44-0.78 ms).
# Measured for dy on the H200, bit-exact, slower, and removed (2026-12-01, fp8_quant_explore2.
# json; default 0.389-0.392 / 0.750-0.754 ms at N 4096 / 8192 in the same runs): a strip kernel
# (8-16 row tiles per program, column sums kept in registers across the strip: 0.48-0.51 ms),
# the same with the loop pipelined (cp.async, 2 stages: 0.76) or with TMA tensor-descriptor
# loads and/or stores (x.T transposed in shared memory: 0.67-1.13 ms), per-warp partial column
# sums with no cross-warp reduction (0.46 ms, 4 or 8 warps), and 8 warps capped at 128
# registers for 2 programs per SM (0.50-0.51 ms, no spills; 8 warps uncapped 0.50).
# Why the column sums cost ~0.07 ms (2026-12-01, fp8_quant_explore3.json; dy 0.3895 ms against
# 0.3172 without sums, same launch): ~0.023 ms is the second kernel, torch's sum over the
# (R/128, C) float32 partials (0.0230 / 0.0247 ms alone at C 4096 / 8192); the rest is in the
# tile kernel, whose SASS has 5 more BAR.SYNC, 24 more STS and 20 more LDS per tile than without
# sums: a second exchange of per-warp partials between warps (as for the column maxima) and a
# layout conversion of the 128 sums before their store, all before the row quantisation.
# "partials_reduce": "triton" (column_sum_kernel, 16 columns per program, rows in a fixed order)
# or "torch" (partials.sum(0)): the Triton reduction takes 0.0098 / 0.0117 ms, and dy 0.3757 /
# 0.7368 ms (68.5 / 69.9% of HBM) against 0.3895 / 0.7500 in the same run, the FP8 outputs
# bit-exact and the sums within the float64 bound on the H200. "triton" is the default for CUDA
# tensors; the interpreter sums with torch (the GPU fused-norm tests compare against it: Triton
# 3.6's interpreter failed on the kernel's runtime loop bound, which made 3 of them fail).
# Measured and removed (bit-exact, slower): a kernel whose warps own 32 columns each (the column
# maxima and sums then need no exchange between warps: 10 BAR, 30 STS, 12 LDS; but 0.722 ms,
# the warp-wide loads and stores span 16 rows instead of 4), and the sums reduced after both
# layouts are stored (222 registers, 0.4068 ms).
# (2026-12-01, fp8_quant_explore4.json) Both 1x128 layouts without sums: 4 warps 0.3183 ms
# (80.2% of HBM) against 8 warps 0.3261 (78.3%), the same split in fp8_quant_explore3.json, so
# "tile_warps" is 4. With the sums, 8 warps (128 registers, 2 programs of 8 warps per SM) take
# 0.4875 ms against 0.3772 for 4: ncu (kernel_profiles dy_w8) shows the cross-warp exchange of
# the sums doubling the shared-memory wavefronts (37M loads, 80% of them bank conflicts), with
# short-scoreboard and MIO-throttle stalls on top. Packing the runs of x.T by a sum of shifted
# bytes along the run axis (no permute / split) was bit-exact but slower (dy 0.4775 ms, no-sums
# 0.3314 / 0.388 ms at 8 / 4 warps): the store is still re-laid-out through shared memory, for
# 4-byte instead of 16-byte vectors, and 4 warps need 255 registers. Removed.
_DUAL_OPTIONS = {
    "variant": "tile",
    "tile_warps": 4,
    "tile_warps_colsum": 4,
    "tile_warps_x": 8,
    "num_warps": 4,
    "trans": 1,
    "rows_only_block_r": 32,
    "early_col": True,
    "t_run": 4,
    "t_run_colsum": 4,
    "t_run_x": 0,
    "partials_reduce": "triton",
    # L2 prefetch distance of the tile kernel in programs, per SM of the GPU (0: off), with
    # column sums / without / x with 128x128 tiles of x.T (see _prefetch_distance).
    "prefetch_colsum": 1.25,
    "prefetch": 1.5,
    "prefetch_x": 0.0,
    # Packed runs of x.T made by inline PTX (two x2 conversions and a move per word, sm_89+),
    # without / with column sums: dy with sums and the prefetch 0.3624 -> 0.3356 ms (71.0 ->
    # 76.7% of HBM; 8192 columns 72.5 -> 78.2%), without sums slower (86.4 -> 76.6%), and
    # without the prefetch slower (0.4422 ms) (fp8_quant_explore9-11.json).
    "t_run_asm": False,
    "t_run_asm_colsum": True,
}


@dataclass
class Fp8Operand:
    """A 2-D tensor ``x`` (R, C) quantised for GEMMs that reduce along C and/or along R.

    Scale tensors are float32 powers of two (dequantisation multipliers) already in the layout
    ``torch._scaled_mm`` wants for its left operand.
    """

    kind: str
    """``"1x128"`` (blocks of 128 along the reduction dim), ``"128x128"`` (square tiles) or
    ``"tensorwise"``."""
    data: torch.Tensor | None = None
    """(R, C) FP8, row-major: ``x`` for GEMMs reducing along C."""
    scale: torch.Tensor | None = None
    """Scales of ``data``: 1x128: (R, ceil(C/128)) with strides (1, R) (outer-dim-major);
    128x128: (ceil(R/128), ceil(C/128)) contiguous; tensorwise: a one-element tensor."""
    data_t: torch.Tensor | None = None
    """(C, R) FP8, row-major: ``x.T`` for GEMMs reducing along R."""
    scale_t: torch.Tensor | None = None
    """Scales of ``data_t``, laid out like ``scale`` for a (C, R) tensor (128x128: the
    transpose of ``scale``, made contiguous)."""
    col_sum: torch.Tensor | None = None
    """float32 (C,) sums of ``x`` over its rows, when asked for (the bias gradient when ``x``
    is the output gradient), computed in the same pass."""
    kind_t: str | None = None
    """Scaling of ``data_t`` when it differs from ``kind``: ``"128x128"`` for a ``"1x128"``
    operand quantised with ``col_tiles=True``."""


def _outer_dim_major(scale: torch.Tensor) -> torch.Tensor:
    return scale.t().contiguous().t()


def _pow2_exponent_tensor(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return _pow2_scale_exponent(amax, MX_ELEMENT_DTYPES[dtype].max_normal)


def quantize_operand(
    x: torch.Tensor,
    kind: str = "1x128",
    dtype: torch.dtype = torch.float8_e4m3fn,
    *,
    rows: bool = True,
    cols: bool = True,
    stochastic_seed: int | None = None,
    offset: int = 0,
    backend: str = "auto",
    col_sum: bool = False,
    col_tiles: bool = False,
) -> Fp8Operand:
    """Quantise a 2-D tensor into :class:`Fp8Operand` layouts in one pass over memory.

    Args:
        x: (R, C) float tensor.
        kind: ``"1x128"``: ``data`` has 1x128 blocks along C and ``data_t`` (= x.T) 1x128
            blocks along R; ``"128x128"``: one scale per 128x128 tile shared by both;
            ``"tensorwise"``: one scale for the whole tensor.
        dtype: FP8 element dtype.
        rows / cols: whether to produce ``data`` / ``data_t``.
        stochastic_seed, offset: stochastic rounding (PyTorch path only; ``data`` uses
            Philox counters from ``offset``, ``data_t`` from ``offset + x.numel()``).
        backend: ``"triton"`` (CUDA, or CPU under ``TRITON_INTERPRET=1``), ``"torch"`` or
            ``"auto"`` (Triton where it can run and no stochastic rounding is asked for).
        col_sum: also return ``x.sum(0)`` in float32 (``col_sum`` field).
        col_tiles: with ``kind="1x128"``, quantise ``data_t`` with one scale per 128x128 tile
            (``kind_t="128x128"``, ``scale_t`` (ceil(C/128), ceil(R/128)) contiguous, the
            layout of a 128x128 operand) instead of 1x128 blocks along R. With power-of-two
            scales the FP8 values only differ from the 1x128 ones for elements more than
            ~2**14 below their tile's maximum (they fall into the subnormals), and Hopper's
            ``scaled_mm`` runs 1x128 x 128x128 about 1.4x faster than 1x128 x 1x128.

    The values equal :func:`quantize_blockwise` (``block_shape`` (1, 128) on ``x`` / ``x.T``,
    (128, 128), or ``None``) bit for bit on either backend.
    """
    from gem_precision import _triton

    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() != 2:
        raise TypeError(f"x must be a 2-D floating point torch.Tensor, got {type(x).__name__}")
    if kind not in ("1x128", "128x128", "tensorwise"):
        raise ValueError(f"kind must be '1x128', '128x128' or 'tensorwise', got {kind!r}")
    if dtype not in MX_ELEMENT_DTYPES:
        raise TypeError(f"dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    if backend == "triton" and stochastic_seed is not None:
        raise ValueError("stochastic rounding is only available with backend='torch'")
    if col_tiles and kind != "1x128":
        raise ValueError(f"col_tiles=True needs kind='1x128', got kind={kind!r}")
    use_triton = backend == "triton" or (
        backend == "auto" and stochastic_seed is None and _triton.can_run(x)
    )
    if use_triton:
        return _quantize_operand_triton(x, kind, dtype, rows, cols, col_sum, col_tiles)
    out = _quantize_operand_torch(x, kind, dtype, rows, cols, stochastic_seed, offset, col_tiles)
    if col_sum:
        out.col_sum = x.sum(0, dtype=torch.float32)
    return out


def _quantize_operand_torch(x, kind, dtype, rows, cols, seed, offset, col_tiles) -> Fp8Operand:
    out = Fp8Operand(kind=kind)
    if kind == "1x128" and col_tiles:
        if rows:
            out.data, s = quantize_blockwise(
                x, (1, BLOCK), dtype, stochastic_seed=seed, offset=offset
            )
            out.scale = _outer_dim_major(s)
        if cols:
            out.data_t, out.scale_t = quantize_blockwise(
                x.t().contiguous(),
                (BLOCK, BLOCK),
                dtype,
                stochastic_seed=seed,
                offset=offset + x.numel(),
            )
            out.kind_t = "128x128"
        return out
    if kind == "1x128":
        if rows:
            out.data, s = quantize_blockwise(
                x, (1, BLOCK), dtype, stochastic_seed=seed, offset=offset
            )
            out.scale = _outer_dim_major(s)
        if cols:
            out.data_t, s = quantize_blockwise(
                x.t().contiguous(),
                (1, BLOCK),
                dtype,
                stochastic_seed=seed,
                offset=offset + x.numel(),
            )
            out.scale_t = _outer_dim_major(s)
        return out
    block = (BLOCK, BLOCK) if kind == "128x128" else None
    data, s = quantize_blockwise(x, block, dtype, stochastic_seed=seed, offset=offset)
    if kind == "tensorwise":
        s = s.reshape(())
    if rows:
        out.data, out.scale = data, s
    if cols:
        out.data_t = data.t().contiguous()
        out.scale_t = s.t().contiguous() if s.dim() == 2 else s
    return out


def _tile_warps(cols: bool, col_tiles: bool, col_sum: bool) -> int:
    if not cols:
        return _DUAL_OPTIONS["num_warps"]
    if col_tiles:
        return _DUAL_OPTIONS["tile_warps_x"]
    return _DUAL_OPTIONS["tile_warps_colsum" if col_sum else "tile_warps"]


def _tile_t_run(cols: bool, col_tiles: bool, col_sum: bool) -> int:
    if not cols:
        return 0
    if col_tiles:
        return _DUAL_OPTIONS["t_run_x"]
    return _DUAL_OPTIONS["t_run_colsum" if col_sum else "t_run"]


def _prefetch_distance(x: torch.Tensor, cols: bool, col_tiles: bool, col_sum: bool) -> int:
    """How many programs ahead the tile kernel prefetches x into L2, 0 for none.

    H200 (65536 x 4096 bfloat16, fp8_quant_explore6-8/10.json): dy with column sums 0.3760 ->
    0.3632 ms (68.5 -> 70.9% of HBM; 8192 columns 69.8 -> 72.5%) at one SM's worth of programs
    ahead (132), slower below 96 or at 528, and with the runs of x.T packed by inline PTX best at
    1.25 per SM (0.3348 ms); without sums 0.3176 -> 0.2951 ms (80.4 -> 86.5%) at 1.5 per SM; x
    with tiles of x.T (8 warps, more programs per SM) gains nothing. Scaled by the SM count so
    the distance keeps its meaning (programs resident per SM) on other GPUs.
    """
    if not cols:
        return 0
    key = "prefetch_x" if col_tiles else ("prefetch_colsum" if col_sum else "prefetch")
    return int(_DUAL_OPTIONS[key] * _sm_count(x.device))


def _run_asm(x: torch.Tensor, col_sum: bool) -> bool:
    key = "t_run_asm_colsum" if col_sum else "t_run_asm"
    return _DUAL_OPTIONS[key] and x.is_cuda and _capability(x.device) >= (8, 9)


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _quantize_operand_triton(
    x, kind, dtype, rows, cols, col_sum=False, col_tiles=False
) -> Fp8Operand:
    from gem_precision import _triton

    if kind == "tensorwise" and cols:
        # With one scale for the whole tensor the bytes of x.T are those of x transposed, so
        # they are transposed by a byte-transpose kernel. The tile kernel's own x.T wrote
        # constant bytes into 37.5% of its whole tiles on the H200 (Triton 3.6 for float32 x,
        # Triton 3.8 for any x; by tl.trans, by packed runs, and transposing before the FP8
        # conversion alike; bit-exact in the interpreter). 65536 x 4096 bfloat16, both layouts:
        # 0.66 ms (0.18 of it the transpose), against 2.20 ms with torch's FP8 .t().contiguous().
        out = _quantize_operand_triton(x, kind, dtype, True, False, col_sum)
        out.data_t, out.scale_t = _transpose_fp8(out.data), out.scale
        if not rows:
            out.data = out.scale = None
        return out
    x = x if x.stride(1) == 1 else x.contiguous()
    r, c = x.shape
    block_r = BLOCK
    if kind != "128x128" and not cols:
        block_r = _DUAL_OPTIONS["rows_only_block_r"]
    nr, nc = -(-r // block_r), -(-c // BLOCK)
    dev = x.device
    soft = _triton.soft_fp8(x)
    out = Fp8Operand(kind=kind)
    q = torch.empty((r, c), dtype=dtype, device=dev) if rows else None
    qt = torch.empty((c, r), dtype=dtype, device=dev) if cols else None
    dummy = torch.empty(1, dtype=torch.float32, device=dev)
    s = st = exp = dummy
    col_tiles = col_tiles and cols
    if kind == "1x128":
        s = torch.empty((nc, r), dtype=torch.float32, device=dev) if rows else dummy
        st = torch.empty((nr, c), dtype=torch.float32, device=dev) if cols else dummy
        if col_tiles:
            st = torch.empty((nc, nr), dtype=torch.float32, device=dev)
    elif kind == "128x128":
        s = torch.empty((nr, nc), dtype=torch.float32, device=dev)
    else:
        if x.numel():  # one read of x (x.abs().amax() would write |x| first)
            lo, hi = torch.aminmax(x)
            amax = torch.maximum(lo.abs(), hi.abs()).to(torch.float32)
        else:
            amax = torch.zeros((), device=dev)
        exp = _pow2_exponent_tensor(amax.reshape(1), dtype).to(torch.int32)
    variant = _DUAL_OPTIONS["variant"] if kind != "128x128" else "dual"
    if col_tiles:
        variant = "tile"  # the only kernel that writes tile scales for one layout
    sums = torch.empty((nr, c), dtype=torch.float32, device=dev) if col_sum else dummy
    # Outputs and options shared by the tile and dual kernels (no norm: plain quantisation).
    outputs = (
        _triton.fp8_arg(q, soft) if rows else dummy,
        s,
        _triton.fp8_arg(qt, soft) if cols else dummy,
        st,
        exp,
        dummy,
        dummy,
        dummy,
        dummy,
        sums,
        r,
        c,
        x.stride(0),
    )
    common = dict(
        **_triton.fp8_constexprs(dtype, soft),
        MIN_EXP=_MIN_SCALE_EXP,
        MAX_EXP=_MAX_SCALE_EXP,
        ROW=rows,
        COL=cols,
        FIXED=kind == "tensorwise",
        NORM=False,
        HAS_MEAN=False,
        HAS_W=False,
        HAS_B=False,
        COLSUM=col_sum,
        BLOCK_R=block_r,
        BLOCK=BLOCK,
    )
    if x.numel() and variant == "tile":
        x_arg, bf16_bits = _triton.float_arg(x, soft)
        even = r % block_r == 0 and c % BLOCK == 0
        # Packed runs of x.T need whole tiles (no masks) and an int32 view of qt. Only for the
        # H200-checked case: 1x128 blocks of bfloat16 x (the tensorwise kind with runs wrote a
        # misordered data_t on the H200 with Triton 3.6, though bit-exact in the interpreter).
        t_run = 0
        if even and kind == "1x128" and x.dtype == torch.bfloat16:
            t_run = _tile_t_run(cols, col_tiles, col_sum) if x.stride(0) % 16 == 0 else 0
        if t_run:
            outputs = (*outputs[:2], qt.view(torch.int32), *outputs[3:])
        # L2 prefetch of a later program's tile: compiled (CUDA), whole tiles of bfloat16 x.
        prefetch = 0
        if even and x.is_cuda and x.dtype == torch.bfloat16 and not bf16_bits:
            prefetch = _prefetch_distance(x, cols, col_tiles, col_sum)
        _triton.kernels(x).blockwise_tile_kernel[(nr, nc)](
            x_arg,
            *outputs,
            **common,
            BF16_BITS=bf16_bits,
            COL_TILE=col_tiles,
            EVEN=even,
            EARLY_COL=_DUAL_OPTIONS["early_col"],
            T_RUN=t_run,
            PREFETCH=prefetch,
            RUN_ASM=bool(t_run) and _run_asm(x, col_sum),
            num_warps=_tile_warps(cols, col_tiles, col_sum),
        )
    elif x.numel():
        x_arg, bf16_bits = _triton.float_arg(x, soft)
        _triton.kernels(x).blockwise_dual_kernel[(nr, nc)](
            x_arg,
            *outputs,
            **common,
            BF16_BITS=bf16_bits,
            TILE=kind == "128x128",
            TRANS=_DUAL_OPTIONS["trans"],
            num_warps=_DUAL_OPTIONS["num_warps"],
        )
    if kind == "1x128":
        if rows:
            out.data, out.scale = q, s.t()
        if cols and col_tiles:
            out.data_t, out.scale_t, out.kind_t = qt, st, "128x128"
        elif cols:
            out.data_t, out.scale_t = qt, st.t()
    elif kind == "128x128":
        out.data, out.data_t = q, qt
        out.scale = s if rows else None
        out.scale_t = s.t().contiguous() if cols else None
    else:
        scale = _pow2_fp32(exp.reshape(()))
        out.data, out.data_t = q, qt
        out.scale = scale if rows else None
        out.scale_t = scale if cols else None
    if col_sum:
        out.col_sum = _sum_partials(sums) if x.numel() else torch.zeros(c, device=dev)
    return out


def _transpose_fp8(data: torch.Tensor) -> torch.Tensor:
    """``data.t().contiguous()`` for a 2-D FP8 tensor, by ``transpose_bytes_kernel`` (Triton:
    CUDA, or the interpreter). H200: 0.18 ms for 65536 x 4096, against ~1.7 ms for torch's copy."""
    from gem_precision import _triton

    r, c = data.shape
    out = torch.empty((c, r), dtype=data.dtype, device=data.device)
    block = 64
    if data.numel():
        _triton.kernels(data).transpose_bytes_kernel[(-(-r // block), -(-c // block))](
            data.view(torch.uint8), out.view(torch.uint8), r, c, BLOCK=block, num_warps=4
        )
    return out


def _sum_partials(partials: torch.Tensor) -> torch.Tensor:
    """Column sums of the kernels' float32 (row tiles, C) partial sums."""
    if _DUAL_OPTIONS["partials_reduce"] == "triton" and partials.is_cuda:
        return _column_sums_triton(partials)
    # CPU tensors (the interpreter) sum with torch: Triton 3.6's interpreter cannot take a
    # kernel argument as a loop bound (int() of its 1-element array fails under NumPy 2).
    return partials.sum(0)


def _column_sums_triton(partials: torch.Tensor) -> torch.Tensor:
    """``partials.sum(0)`` by ``column_sum_kernel`` (fixed row order)."""
    from gem_precision import _triton

    nr, c = partials.shape
    out = torch.empty(c, dtype=torch.float32, device=partials.device)
    block_c = 16
    _triton.kernels(partials).column_sum_kernel[(-(-c // block_c),)](
        partials, out, nr, c, BLOCK_R=256, BLOCK_C=block_c, num_warps=4
    )
    return out


def dequantize_operand(data: torch.Tensor, scale: torch.Tensor, kind: str) -> torch.Tensor:
    """float32 values of one (data, scale) pair of an :class:`Fp8Operand`."""
    if kind == "1x128":
        return dequantize_blockwise(data, scale, (1, BLOCK))
    if kind == "128x128":
        return dequantize_blockwise(data, scale, (BLOCK, BLOCK))
    if kind == "tensorwise":
        return data.to(torch.float32) * scale.to(torch.float32)
    raise ValueError(f"kind must be '1x128', '128x128' or 'tensorwise', got {kind!r}")
