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
    "OperandKernelConfig",
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

# What the H200's cuBLAS takes for 1x128-scaled operands (see scaled_gemm._pad_for_block_scales):
# M a multiple of 4, and K a multiple of 4 blocks of 128.
_GEMM_ROWS_MULTIPLE = 4
_GEMM_K_MULTIPLE = 4 * 128


def _gemm_rows(rows: int, transposed: bool) -> int:
    """Rows an activation operand is stored with for the native GEMMs: in ``data`` a multiple
    of 4 (the M of forward and dgrad), in ``data_t`` (``transposed``) a multiple of 512 (the K
    of the wgrad). Works on SymInts (the operators' fake layouts)."""
    multiple = _GEMM_K_MULTIPLE if transposed else _GEMM_ROWS_MULTIPLE
    return -(-rows // multiple) * multiple


def _gemm_k(k: int) -> int:
    """The K of a native block-scaled GEMM: ``k`` when its 128-blocks are a multiple of 4 and
    it is one of 16, else the next multiple of 512."""
    if -(-k // 128) % 4 == 0 and k % 16 == 0:
        return k
    return -(-k // _GEMM_K_MULTIPLE) * _GEMM_K_MULTIPLE


def _row_outputs(r, c, rq, cq, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The 1x128 row layout the quantise kernels write into: ``q`` (rq, cq) and its scales
    stored (cq/128, rq), columns from ``c`` on zero with unit scales (they add nothing to a
    GEMM); the kernels write rows below ``r``, rows from ``r`` on only make cut-off outputs."""
    q = torch.empty((rq, cq), dtype=dtype, device=device)
    s = torch.empty((-(-cq // BLOCK), rq), dtype=torch.float32, device=device)
    if cq > c:
        q[:, c:].view(torch.uint8).zero_()
        s[-(-c // BLOCK) :] = 1.0
    return q, s


def _transposed_outputs(
    r, c, rt, block_r, col_tiles, dtype, device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The layout of ``x.T`` the tile kernel writes into: ``qt`` (c, rt) and its scales, stored
    (rt/block_r, c) (1x128 blocks) or (c/128, rt/block_r) (``col_tiles``), columns from ``r`` on
    zero with unit scales (they add nothing to a wgrad)."""
    qt = torch.empty((c, rt), dtype=dtype, device=device)
    nr, nrt = -(-r // block_r), -(-rt // block_r)
    shape = (-(-c // BLOCK), nrt) if col_tiles else (nrt, c)
    st = torch.empty(shape, dtype=torch.float32, device=device)
    if rt > r:
        qt[:, r:].view(torch.uint8).zero_()
        (st[:, nr:] if col_tiles else st[nr:]).fill_(1.0)
    return qt, st


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
    offset: int | torch.Tensor = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D float tensor to FP8 with one power-of-two float32 scale per tile.

    Args:
        x: 2-D float32/bfloat16/float16 tensor of shape ``(R, C)``.
        block_shape: tile ``(rows, cols)``; ``None`` for a single tensorwise scale.
        dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        stochastic_seed: if given, round stochastically (:func:`stochastic_round_to_fp8`) with
            this Philox seed and ``offset``; otherwise round to nearest-even.
        offset: Philox counter offset for stochastic rounding (an int, or a one-element int64
            tensor on ``x``'s device: see :func:`stochastic_round_to_fp8`).

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
    tiles = (-(-data.shape[0] // rows), -(-data.shape[1] // cols))
    if tuple(scale.shape) != tiles:
        raise ValueError(
            f"scale must hold one scale per {rows}x{cols} tile of the {tuple(data.shape)} data "
            f"(block_shape={block_shape}), shape {tiles}; got {tuple(scale.shape)}"
        )
    expanded = scale.repeat_interleave(rows, dim=0).repeat_interleave(cols, dim=1)
    return data.to(torch.float32) * expanded[: data.shape[0], : data.shape[1]]


def fake_quantize_blockwise(
    x: torch.Tensor,
    block_shape: tuple[int, int] | None = (1, 128),
    dtype: torch.dtype = torch.float8_e4m3fn,
    *,
    stochastic_seed: int | None = None,
    offset: int | torch.Tensor = 0,
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


def _check_warps(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value not in (1, 2, 4, 8, 16, 32):
        raise ValueError(f"{name} must be a power of two in [1, 32], got {value!r}")


@dataclass(frozen=True)
class OperandKernelConfig:
    """Launch options of the one-pass FP8 operand kernels (the Triton backend of
    :func:`quantize_operand`). They change speed only: every configuration writes the same
    bits.

    The defaults are the fastest bit-exact options on an H200 (65536 x 4096 bfloat16, Triton
    3.6; the timings, and the variants measured and removed, are in docs/kernel-tuning.md). No
    other GPU was measured, so every device gets them. Three cases of the tile kernel (one
    program per 128x128 tile) have their own options: both 1x128 layouts (``x`` and ``x.T``),
    the same with column sums (an output gradient with its bias gradient) and rows plus
    128x128 tiles of ``x.T`` (``col_tiles``, the input of the default recipe). Packed runs
    (``t_run*``) and the L2 prefetch (``prefetch_per_sm*``) only apply to whole tiles of
    bfloat16 ``x`` with 1x128 blocks; the PTX packing (``run_asm*``) to those, compiled for
    sm_89 or newer.
    """

    num_warps: int = 4
    """Warps of the rows-only kernel and of the 128x128 (weight) kernel."""
    rows_only_block_r: int = 32
    """Rows per program when only the row layout is written (32 and 64 tied on the H200)."""
    tile_warps: int = 4
    """Warps of the tile kernel writing both 1x128 layouts (4 beat 8: 0.318 against 0.326 ms)."""
    tile_warps_col_sum: int = 4
    """The same with column sums (8 warps double the shared-memory traffic of the sums'
    cross-warp exchange: 0.488 against 0.377 ms)."""
    tile_warps_col_tiles: int = 8
    """Warps of the tile kernel writing rows and 128x128 tiles of ``x.T`` (0.295 ms at 4 or 8;
    8 also won the fused norm's x.T tiles)."""
    t_run: int = 4
    """Both 1x128 layouts: ``x.T`` stored as packed runs of this many rows per thread instead
    of transposing FP8 bytes through shared memory (0, 4, 8 or 16; 4 was fastest)."""
    t_run_col_sum: int = 4
    """The same with column sums."""
    t_run_col_tiles: int = 0
    """The same for 128x128 tiles of ``x.T`` (runs were slower there: 0.32-0.34 against
    0.294 ms)."""
    prefetch_per_sm: float = 1.5
    """Both 1x128 layouts: how many programs ahead each program prefetches its tile of ``x``
    into L2, per SM of the GPU (so it keeps its meaning on other GPUs); 0 for none."""
    prefetch_per_sm_col_sum: float = 1.25
    """The same with column sums (best with the PTX-packed runs)."""
    prefetch_per_sm_col_tiles: float = 0.0
    """The same for 128x128 tiles of ``x.T`` (nothing gained)."""
    run_asm: bool = False
    """Both 1x128 layouts: make the packed runs with inline PTX (slower without column sums)."""
    run_asm_col_sum: bool = True
    """The same with column sums (faster, with the L2 prefetch)."""

    def __post_init__(self) -> None:
        for name in ("num_warps", "tile_warps", "tile_warps_col_sum", "tile_warps_col_tiles"):
            _check_warps(name, getattr(self, name))
        block_r = self.rows_only_block_r
        if isinstance(block_r, bool) or not isinstance(block_r, int) or block_r not in (
            1, 2, 4, 8, 16, 32, 64, 128,
        ):  # fmt: skip
            raise ValueError(
                f"rows_only_block_r must be a power of two in [1, {BLOCK}], got {block_r!r}"
            )
        for name in ("t_run", "t_run_col_sum", "t_run_col_tiles"):
            value = getattr(self, name)
            if isinstance(value, bool) or value not in (0, 4, 8, 16):
                raise ValueError(f"{name} must be 0, 4, 8 or 16, got {value!r}")
        for name in ("prefetch_per_sm", "prefetch_per_sm_col_sum", "prefetch_per_sm_col_tiles"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not (0 <= value <= 64)
            ):
                raise ValueError(f"{name} must be a number in [0, 64], got {value!r}")
        for name in ("run_asm", "run_asm_col_sum"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")

    def _tile_options(self, col_sum: bool, col_tiles: bool) -> tuple[int, int, float, bool]:
        """``(warps, t_run, prefetch_per_sm, run_asm)`` of the tile kernel writing both
        layouts (``col_tiles`` wins over ``col_sum``)."""
        if col_tiles:
            return (
                self.tile_warps_col_tiles,
                self.t_run_col_tiles,
                self.prefetch_per_sm_col_tiles,
                False,
            )
        if col_sum:
            return (
                self.tile_warps_col_sum,
                self.t_run_col_sum,
                self.prefetch_per_sm_col_sum,
                self.run_asm_col_sum,
            )
        return self.tile_warps, self.t_run, self.prefetch_per_sm, self.run_asm


_DEFAULT_OPERAND_CONFIG = OperandKernelConfig()


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
    config: OperandKernelConfig | None = None,
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
        config: launch options of the Triton kernels (None: the shipped
            ``OperandKernelConfig()``); any config gives the same bits. The call runs
            the ``gem_precision::quantize_operand`` operator (opaque to ``torch.compile``);
            with another config it runs the kernels directly (for tuning, in eager code).

    The values equal :func:`quantize_blockwise` (``block_shape`` (1, 128) on ``x`` / ``x.T``,
    (128, 128), or ``None``) bit for bit on either backend.
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() != 2:
        raise TypeError(f"x must be a 2-D floating point torch.Tensor, got {type(x).__name__}")
    _check_operand_options(kind, dtype, stochastic_seed, backend, col_tiles)
    for name, flag in (
        ("rows", rows),
        ("cols", cols),
        ("col_sum", col_sum),
        ("col_tiles", col_tiles),
    ):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {flag!r}")
    if config is not None and not isinstance(config, OperandKernelConfig):
        raise TypeError(
            f"config must be an OperandKernelConfig or None, got {type(config).__name__}"
        )
    if config is not None and config != _DEFAULT_OPERAND_CONFIG:
        return _quantize_operand(
            x, kind, dtype, rows, cols, stochastic_seed, offset, col_sum, col_tiles, backend,
            config,
        )  # fmt: skip
    # The operator returns the requested layouts only (see gem_precision.ops).
    outputs = list(
        torch.ops.gem_precision.quantize_operand(
            x, kind, dtype, rows, cols, stochastic_seed, offset, col_sum, col_tiles, backend
        )
    )
    out = Fp8Operand(kind=kind)
    if rows:
        out.data, out.scale = outputs.pop(0), outputs.pop(0)
    if cols:
        out.data_t, out.scale_t = outputs.pop(0), outputs.pop(0)
        if col_tiles:
            out.kind_t = "128x128"
    if col_sum:
        out.col_sum = outputs.pop(0)
    return out


def _check_operand_options(kind, dtype, stochastic_seed, backend, col_tiles) -> None:
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


def _quantize_operand(
    x,
    kind,
    dtype,
    rows,
    cols,
    stochastic_seed,
    offset,
    col_sum,
    col_tiles,
    backend,
    config: OperandKernelConfig = _DEFAULT_OPERAND_CONFIG,
    *,
    gemm_padded: bool = False,
) -> Fp8Operand:
    """:func:`quantize_operand` on checked arguments: the body of the
    ``gem_precision::quantize_operand`` operator, and what the linear operators call.

    ``gemm_padded`` (``"1x128"`` only; the linear operators' native GEMMs): the layouts are
    stored with :func:`_gemm_rows` rows and :func:`_gemm_k` columns, so cuBLAS takes them as
    they are: ``data`` (RQ, CQ) with zeros from column C on and unit scales for the blocks past
    C (they add nothing), its rows from R on unwritten (they only make output rows that are cut
    off); ``data_t`` (C, RT) with zeros from column R on and unit scales for the blocks past R.
    The GEMMs then copy no activation operand (``_pad_for_block_scales``)."""
    from gem_precision import _triton

    r, c = x.shape
    padded = gemm_padded and kind == "1x128"
    rq, rt, cq = (_gemm_rows(r, False), _gemm_rows(r, True), _gemm_k(c)) if padded else (r, r, c)
    use_triton = backend == "triton" or (
        backend == "auto" and stochastic_seed is None and _triton.can_run(x)
    )
    if use_triton:
        return _quantize_operand_triton(
            x, kind, dtype, rows, cols, col_sum, col_tiles, config, (rq, rt, cq)
        )
    out = _quantize_operand_torch(x, kind, dtype, rows, cols, stochastic_seed, offset, col_tiles)
    if col_sum:
        out.col_sum = x.sum(0, dtype=torch.float32)
    return _pad_layouts(out, r, c, rq, rt, cq) if padded else out


def _pad_layouts(op: Fp8Operand, r: int, c: int, rq: int, rt: int, cq: int) -> Fp8Operand:
    """A 1x128 operand of ``x`` (r, c) stored as the Triton kernels write it with
    ``gemm_padded``: ``data`` (rq, cq), ``data_t`` (c, rt) (the pad rows of ``data`` here zero):
    a copy, on the PyTorch path only."""
    if op.data is not None and (rq, cq) != (r, c):  # scale (R, C/128), strides (1, R)
        op.data = F.pad(op.data.view(torch.uint8), (0, cq - c, 0, rq - r)).view(op.data.dtype)
        blocks = -(-cq // BLOCK) - op.scale.shape[1]
        op.scale = F.pad(op.scale.t(), (0, rq - r, 0, blocks), value=1.0).t()
    if op.data_t is not None and rt > r:
        op.data_t = F.pad(op.data_t.view(torch.uint8), (0, rt - r)).view(op.data_t.dtype)
        blocks = rt // BLOCK - op.scale_t.shape[1]
        if op.kind_t == "128x128":  # scale_t (C/128, R/128) contiguous
            op.scale_t = F.pad(op.scale_t, (0, blocks), value=1.0)
        else:  # scale_t (C, R/128), strides (1, C)
            op.scale_t = F.pad(op.scale_t.t(), (0, 0, 0, blocks), value=1.0).t()
    return op


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


def _prefetch_distance(x: torch.Tensor, per_sm: float) -> int:
    """Programs ahead of the tile kernel's L2 prefetch on ``x``'s GPU (0: none)."""
    return int(per_sm * _sm_count(x.device))


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _launch_tile_kernel(x, args, block_r, options, whole_options) -> None:
    """``blockwise_tile_kernel`` over ``x`` (R, C) with ``args`` (its pointer and size
    arguments up to ``stride_xr``, ``qt`` fourth) and constexpr ``options``: the whole
    ``block_r`` x ``BLOCK`` tiles in one launch without masks (``EVEN``) and with
    ``whole_options`` (``T_RUN``, ``PREFETCH``, ``RUN_ASM``), then the ragged last row of tiles
    and the ragged last column of tiles in masked launches of their own. Jagged token counts
    are rarely a multiple of ``block_r`` (nor is SwiGLU's 8/3 width of ``BLOCK``), and one
    masked launch over every tile ran 1.4x slower (524289 x 1024 and x 5632 on the H200, both
    1x128 layouts, with or without column sums, against 524288 rows: docs/kernel-tuning.md)."""
    from gem_precision import _triton

    r, c = x.shape
    kernel = _triton.kernels(x).blockwise_tile_kernel
    whole_r, whole_c = r // block_r, c // BLOCK
    if whole_r and whole_c:
        whole_args = args
        if whole_options["T_RUN"] and args[3].shape[-1] % 4 == 0:
            whole_args = (*args[:3], args[3].view(torch.int32), *args[4:])
        else:  # the runs are stored as int32 words of qt's rows
            whole_options = dict(whole_options, T_RUN=0, RUN_ASM=False)
        kernel[(whole_r, whole_c)](*whole_args, 0, 0, **options, **whole_options, EVEN=True)
    if r % block_r and whole_c:  # the last row of tiles, but its corner
        kernel[(1, whole_c)](*args, whole_r, 0, **options, EVEN=False)
    if c % BLOCK and r:  # the last column of tiles, with the corner
        kernel[(-(-r // block_r), 1)](*args, 0, whole_c, **options, EVEN=False)


def _quantize_operand_triton(
    x, kind, dtype, rows, cols, col_sum, col_tiles, config: OperandKernelConfig, padded=None
) -> Fp8Operand:
    """``padded``: ``(rq, rt, cq)``, the rows ``data`` / ``data_t`` and the columns ``data`` of
    a 1x128 kind are stored with (None: those of ``x``), see ``_quantize_operand``'s
    ``gemm_padded``."""
    from gem_precision import _triton

    if kind == "tensorwise" and cols:
        # With one scale for the whole tensor the bytes of x.T are those of x transposed, so
        # they are transposed by a byte-transpose kernel. The tile kernel's own x.T wrote
        # constant bytes into 37.5% of its whole tiles on the H200 (Triton 3.6 for float32 x,
        # Triton 3.8 for any x; by tl.trans, by packed runs, and transposing before the FP8
        # conversion alike; bit-exact in the interpreter). 65536 x 4096 bfloat16, both layouts:
        # 0.66 ms (0.18 of it the transpose), against 2.20 ms with torch's FP8 .t().contiguous().
        out = _quantize_operand_triton(x, kind, dtype, True, False, col_sum, False, config)
        out.data_t, out.scale_t = _transpose_fp8(out.data), out.scale
        if not rows:
            out.data = out.scale = None
        return out
    x = x if x.stride(1) == 1 else x.contiguous()
    r, c = x.shape
    block_r = BLOCK
    if kind != "128x128" and not cols:
        block_r = config.rows_only_block_r
    nr, nc = -(-r // block_r), -(-c // BLOCK)
    rq, rt, cq = padded or (r, r, c)
    dev = x.device
    soft = _triton.soft_fp8(x)
    out = Fp8Operand(kind=kind)
    q = torch.empty((r, c), dtype=dtype, device=dev) if rows else None
    qt = torch.empty((c, r), dtype=dtype, device=dev) if cols else None
    dummy = torch.empty(1, dtype=torch.float32, device=dev)
    s = st = exp = dummy
    col_tiles = col_tiles and cols
    if kind == "1x128":
        if rows:
            q, s = _row_outputs(r, c, rq, cq, dtype, dev)
        if cols:
            qt, st = _transposed_outputs(r, c, rt, block_r, col_tiles, dtype, dev)
    elif kind == "128x128":
        s = torch.empty((nr, nc), dtype=torch.float32, device=dev)
    else:
        if x.numel():  # one read of x (x.abs().amax() would write |x| first)
            lo, hi = torch.aminmax(x)
            amax = torch.maximum(lo.abs(), hi.abs()).to(torch.float32)
        else:
            amax = torch.zeros((), device=dev)
        exp = _pow2_exponent_tensor(amax.reshape(1), dtype).to(torch.int32)
    sums = torch.empty((nr, c), dtype=torch.float32, device=dev) if col_sum else dummy
    # The tile kernel's outputs (the dual kernel takes those it writes) and options (no norm:
    # plain quantisation).
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
        rq,
        rt,
        c,
        cq,
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
    # 128x128 tiles of both layouts: blockwise_dual_kernel; the other kinds: the tile kernel.
    if x.numel() and kind != "128x128":
        warps, t_run, prefetch_per_sm, run_asm = config._tile_options(col_sum, col_tiles)
        if not cols:
            warps, t_run, prefetch_per_sm, run_asm = config.num_warps, 0, 0.0, False
        x_arg, bf16_bits = _triton.float_arg(x, soft)
        # Packed runs of x.T: only for the H200-checked case, 1x128 blocks of bfloat16 x (the
        # tensorwise kind with runs wrote a misordered data_t on the H200 with Triton 3.6,
        # though bit-exact in the interpreter).
        if not (kind == "1x128" and x.dtype == torch.bfloat16 and x.stride(0) % 16 == 0):
            t_run = 0
        # L2 prefetch of a later program's tile: compiled (CUDA), bfloat16 x.
        prefetch = 0
        if x.is_cuda and x.dtype == torch.bfloat16 and not bf16_bits:
            prefetch = _prefetch_distance(x, prefetch_per_sm)
        # PTX-packed runs: compiled for sm_89+ only.
        run_asm = bool(t_run) and run_asm and x.is_cuda and _capability(x.device) >= (8, 9)
        _launch_tile_kernel(
            x,
            (x_arg, *outputs),
            block_r,
            dict(**common, BF16_BITS=bf16_bits, COL_TILE=col_tiles, num_warps=warps),
            dict(T_RUN=t_run, PREFETCH=prefetch, RUN_ASM=run_asm),
        )
    elif x.numel():
        x_arg, bf16_bits = _triton.float_arg(x, soft)
        _triton.kernels(x).blockwise_dual_kernel[(nr, nc)](
            x_arg,
            outputs[0],
            s,
            outputs[2],
            sums,
            r,
            c,
            x.stride(0),
            **_triton.fp8_constexprs(dtype, soft),
            MIN_EXP=_MIN_SCALE_EXP,
            MAX_EXP=_MAX_SCALE_EXP,
            ROW=rows,
            COL=cols,
            BF16_BITS=bf16_bits,
            COLSUM=col_sum,
            BLOCK=BLOCK,
            num_warps=config.num_warps,
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
    if partials.is_cuda:
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
