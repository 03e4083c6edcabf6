"""Triton kernels of gem-precision: MX and blockwise FP8 quantisation, fused norm -> quantise.

Loaded by :mod:`gem_precision._triton` through ``importlib`` (never imported directly):
``triton.jit`` decides at decoration time whether it compiles or interprets, so the loader runs
this file once per mode under distinct module names.

Every kernel makes one pass over memory: it loads a tile, reduces the block maxima in
registers, and writes the FP8 elements and their scales. All scale arithmetic is done on the
float32 exponent bits, so the results are bit-exact against the PyTorch references
(:func:`gem_precision.quantize_mx`, :func:`gem_precision.quantize_blockwise`).
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

# 0x600000 below is the float32 mantissa field of 1.75 = max_normal / 2**emax (both FP8 formats).


# Reductions never call tl.max / tl.sum: those are jit functions of triton.language, decorated
# once, in the mode TRITON_INTERPRET had when Triton was first imported. Imported under
# TRITON_INTERPRET=1 (the CPU test fixtures), they are interpreter functions, and a compiled
# kernel that calls them fails or is wrong. tl.reduce is a builtin that works in both modes:
# interpreted, it gets triton.language's own combine functions (which the interpreter reduces
# with numpy); compiled, the combine functions of this file (decorated by the loader in the
# compiled mode, whatever the order of imports).
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _add_combine(a, b):
    return a + b


_MAX = getattr(tl.standard, "_elementwise_max", _max_combine)
_ADD = getattr(tl.standard, "_sum_combine", _add_combine)

if _INTERPRETED:

    @triton.jit
    def _rmax(x, axis: tl.constexpr):
        return tl.reduce(x, axis, _MAX)

    @triton.jit
    def _rsum(x, axis: tl.constexpr):
        return tl.reduce(x, axis, _ADD)

else:

    @triton.jit
    def _rmax(x, axis: tl.constexpr):
        return tl.reduce(x, axis, _max_combine)

    @triton.jit
    def _rsum(x, axis: tl.constexpr):
        return tl.reduce(x, axis, _add_combine)


# The tensorwise kind's x.T is its row layout transposed (transpose_bytes_kernel): the kernels'
# x.T of a FIXED tile wrote wrong bytes on the H200 (Triton 3.6 for float32 x, Triton 3.8 for
# any x; see quantize_operand), so they refuse to compile it.
_FIXED_ROWS_ONLY = tl.constexpr("FIXED (tensorwise) kernels write the row layout only")


@triton.jit
def _pow2(e):
    """Exact float32 ``2**e`` for int32 ``e`` in [-127, 127] (``2**-127`` is subnormal)."""
    bits = tl.where(e <= -127, 0x400000, tl.maximum(e + 127, 1) << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _fp8_bits(v, MBITS: tl.constexpr, BIAS: tl.constexpr):
    """FP8 bit pattern (uint8) of float32 ``v`` rounded to nearest-even, in integer arithmetic.

    ``v`` must already be saturated to the format's range (or be NaN). Used where the hardware
    conversion is unavailable or not trusted (the Triton interpreter): exact on every backend.
    """
    b = v.to(tl.int32, bitcast=True)
    sign = (b >> 24) & 0x80
    a = b & 0x7FFFFFFF
    SHIFT: tl.constexpr = 23 - MBITS
    rounded = (a + ((1 << (SHIFT - 1)) - 1) + ((a >> SHIFT) & 1)) >> SHIFT
    normal = rounded - ((127 - BIAS) << MBITS)
    # Below the smallest normal the code is the integer multiple of the subnormal step.
    t = tl.abs(v) * (1 << (BIAS - 1 + MBITS))
    whole = tl.floor(t)
    frac = t - whole
    q = whole.to(tl.int32)
    q += ((frac > 0.5) | ((frac == 0.5) & ((q & 1) == 1))).to(tl.int32)
    out = tl.where(a < ((128 - BIAS) << 23), q, normal) | sign
    # NaN of either sign becomes 0x7F, as the GPU's conversion writes it.
    out = tl.where(a > 0x7F800000, 0x7F, out)
    return out.to(tl.uint8)


@triton.jit
def _fp8_value(u, MBITS: tl.constexpr, BIAS: tl.constexpr, E4M3FN: tl.constexpr):
    """float32 value of FP8 bits ``u`` (any integer dtype), exact on every backend."""
    u = u.to(tl.int32) & 0xFF
    sign = (u & 0x80) << 24
    e = (u >> MBITS) & ((1 << (7 - MBITS)) - 1)
    m = u & ((1 << MBITS) - 1)
    normal = (sign | ((e - BIAS + 127) << 23) | (m << (23 - MBITS))).to(tl.float32, bitcast=True)
    sub = m.to(tl.float32) / (1 << (BIAS - 1 + MBITS))
    sub = tl.where(sign != 0, -sub, sub)
    val = tl.where(e == 0, sub, normal)
    if E4M3FN:
        val = tl.where((u & 0x7F) == 0x7F, float("nan"), val)
    else:
        EMASK: tl.constexpr = (1 << (7 - MBITS)) - 1
        inf = tl.where(sign != 0, float("-inf"), float("inf"))
        val = tl.where(e == EMASK, tl.where(m == 0, inf, float("nan")), val)
    return val


@triton.jit
def _store_fp8(ptr, v, mask, SOFT: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr):
    """Store float32 ``v`` as FP8: integer rounding into a uint8 view (``SOFT``) or a cast."""
    if SOFT:
        tl.store(ptr, _fp8_bits(v, MBITS, BIAS), mask=mask)
    else:
        tl.store(ptr, v.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _load_f32(ptr, mask, BF16_BITS: tl.constexpr):
    """Load as float32; ``BF16_BITS``: ``ptr`` holds bfloat16 bits as int16 (widened exactly,
    the interpreter's own conversion flushes bfloat16 subnormals)."""
    if BF16_BITS:
        bits = tl.load(ptr, mask=mask, other=0).to(tl.int32)
        return (bits << 16).to(tl.float32, bitcast=True)
    else:
        return tl.load(ptr, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _store_out(ptr, v, mask, BF16_BITS: tl.constexpr):
    """Store float32 ``v`` in ``ptr``'s dtype; ``BF16_BITS``: round to bfloat16 (nearest-even)
    in integer arithmetic into an int16 view."""
    if BF16_BITS:
        b = v.to(tl.int32, bitcast=True)
        r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        r = tl.where((b & 0x7FFFFFFF) > 0x7F800000, (b >> 16) | 0x40, r)
        tl.store(ptr, r.to(tl.int16), mask=mask)
    else:
        tl.store(ptr, v.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_fp8_t(
    ptr,
    v,
    rows,
    cols,
    R,
    rmask,
    cmask,
    SOFT: tl.constexpr,
    MBITS: tl.constexpr,
    BIAS: tl.constexpr,
):
    """Store the (rows, cols) tile ``v`` transposed into a (C, R) row-major FP8 tensor by
    transposing the FP8 bytes (the shipped one of three ways tried, docs/kernel-tuning.md)."""
    offs = cols[:, None].to(tl.int64) * R + rows[None, :]
    mask = cmask[:, None] & rmask[None, :]
    if SOFT:
        tl.store(ptr + offs, tl.trans(_fp8_bits(v, MBITS, BIAS)), mask=mask)
    else:
        tl.store(ptr + offs, tl.trans(v.to(ptr.dtype.element_ty)), mask=mask)


@triton.jit
def _finite(x):
    return ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) != 0xFF


@triton.jit
def _blockwise_exponent(
    amax, bad, EMAX: tl.constexpr, MIN_EXP: tl.constexpr, MAX_EXP: tl.constexpr
):
    """Smallest ``e`` with ``amax / 2**e <= max_normal`` (0 for zero or non-finite blocks)."""
    bits = amax.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127 - EMAX + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    e = tl.minimum(tl.maximum(e, MIN_EXP), MAX_EXP)
    return tl.where((amax > 0) & (bad == 0), e, 0)


@triton.jit
def _saturate(s, MAX_NORMAL: tl.constexpr):
    # NaN must stay NaN (tl.maximum may drop it), everything else clamps to +-max_normal.
    return tl.where(s != s, s, tl.minimum(tl.maximum(s, -MAX_NORMAL), MAX_NORMAL))


# ---------------------------------------------------------------------------------------------
# OCP MX (E8M0 scale per 1x32 or 32x32 block).


@triton.jit
def _mx_scale_offsets(pid_r, pid_c, R, C, SQUARE: tl.constexpr, BS: tl.constexpr,
                      BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):  # fmt: skip
    """Offsets and mask of a program's scale bytes, (BLOCK_R, NB) or, for square blocks,
    (BLOCK_R // BS, NB), NB = BLOCK_C // BS, in the (rows or R // BS, C // BS) scale tensor."""
    NB: tl.constexpr = BLOCK_C // BS
    groups = pid_c * NB + tl.arange(0, NB)
    if SQUARE:
        srows = pid_r * (BLOCK_R // BS) + tl.arange(0, BLOCK_R // BS)
        s_mask = (srows[:, None] < R // BS) & (groups[None, :] < C // BS)
    else:
        srows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        s_mask = (srows[:, None] < R) & (groups[None, :] < C // BS)
    return srows[:, None].to(tl.int64) * (C // BS) + groups[None, :], s_mask


@triton.jit
def mx_quantize_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    R,
    C,
    EMAX: tl.constexpr,
    MAX_NORMAL: tl.constexpr,
    MBITS: tl.constexpr,
    BIAS: tl.constexpr,
    SOFT: tl.constexpr,
    CEIL: tl.constexpr,
    SQUARE: tl.constexpr,
    BS: tl.constexpr,
    BF16_BITS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    NB: tl.constexpr = BLOCK_C // BS
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows[:, None] < R) & (cols[None, :] < C)
    offs = rows[:, None].to(tl.int64) * C + cols[None, :]
    x = _load_f32(x_ptr + offs, mask, BF16_BITS)
    # One integer max of |x|'s bits gives the block maximum and the non-finite flag.
    ab = _abs_bits(x)
    if SQUARE:
        RB: tl.constexpr = BLOCK_R // BS
        bits = _rmax(_rmax(tl.reshape(ab, (RB, BS, NB, BS)), axis=3), axis=1)
    else:
        bits = _rmax(tl.reshape(ab, (BLOCK_R, NB, BS)), axis=2)
    bad = (bits >= 0x7F800000).to(tl.int32)
    e = ((bits >> 23) & 0xFF) - 127 - EMAX
    if CEIL:
        e += ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    e = tl.minimum(tl.maximum(e, -127), 127)
    inv = _pow2(-e)
    # The GPU's FP8 conversion saturates by itself (cvt.rn.satfinite); the integer path does not.
    if SQUARE:
        scaled = tl.reshape(x, (RB, BS, NB, BS)) * inv[:, None, :, None]
        if SOFT:
            scaled = _saturate(scaled, MAX_NORMAL)
        zero = tl.broadcast_to(bad[:, None, :, None], (RB, BS, NB, BS)) != 0
        scaled = tl.where(zero, 0.0, scaled)
        scaled = tl.reshape(scaled, (BLOCK_R, BLOCK_C))
    else:
        scaled = tl.reshape(x, (BLOCK_R, NB, BS)) * inv[:, :, None]
        if SOFT:
            scaled = _saturate(scaled, MAX_NORMAL)
        zero = tl.broadcast_to(bad[:, :, None], (BLOCK_R, NB, BS)) != 0
        scaled = tl.where(zero, 0.0, scaled)
        scaled = tl.reshape(scaled, (BLOCK_R, BLOCK_C))
    _store_fp8(q_ptr + offs, scaled, mask, SOFT, MBITS, BIAS)
    byte = tl.where(bad != 0, 255, e + 127).to(tl.uint8)
    s_offs, s_mask = _mx_scale_offsets(pid_r, pid_c, R, C, SQUARE, BS, BLOCK_R, BLOCK_C)
    tl.store(s_ptr + s_offs, byte, mask=s_mask)


@triton.jit
def mx_dequantize_kernel(
    q_ptr,
    s_ptr,
    out_ptr,
    R,
    C,
    MBITS: tl.constexpr,
    BIAS: tl.constexpr,
    E4M3FN: tl.constexpr,
    SOFT: tl.constexpr,
    SQUARE: tl.constexpr,
    BS: tl.constexpr,
    BF16_BITS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows[:, None] < R) & (cols[None, :] < C)
    offs = rows[:, None].to(tl.int64) * C + cols[None, :]
    if SOFT:
        q = _fp8_value(tl.load(q_ptr + offs, mask=mask, other=0), MBITS, BIAS, E4M3FN)
    else:
        q = tl.load(q_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    # One scale byte per block, loaded once and broadcast over its block by a reshape (C and,
    # for square blocks, R are multiples of BS). Loading a byte per element (the same address
    # for a block's 32 elements) ran at 45% of HBM on the H200 with Triton 3.6.
    NB: tl.constexpr = BLOCK_C // BS
    s_offs, s_mask = _mx_scale_offsets(pid_r, pid_c, R, C, SQUARE, BS, BLOCK_R, BLOCK_C)
    byte = tl.load(s_ptr + s_offs, mask=s_mask, other=127).to(tl.int32)
    scale = _pow2(tl.minimum(byte - 127, 127))
    scale = tl.where(byte == 255, float("nan"), scale)
    if SQUARE:
        out = tl.reshape(q, (BLOCK_R // BS, BS, NB, BS)) * scale[:, None, :, None]
    else:
        out = tl.reshape(q, (BLOCK_R, NB, BS)) * scale[:, :, None]
    _store_out(out_ptr + offs, tl.reshape(out, (BLOCK_R, BLOCK_C)), mask, BF16_BITS)


# ---------------------------------------------------------------------------------------------
# Blockwise FP8 with power-of-two float32 scales (Hopper recipe), two layouts in one pass.


@triton.jit
def blockwise_dual_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    qt_ptr,
    cs_ptr,
    R,
    C,
    stride_xr,
    EMAX: tl.constexpr,
    MAX_NORMAL: tl.constexpr,
    MBITS: tl.constexpr,
    BIAS: tl.constexpr,
    SOFT: tl.constexpr,
    MIN_EXP: tl.constexpr,
    MAX_EXP: tl.constexpr,
    ROW: tl.constexpr,
    COL: tl.constexpr,
    BF16_BITS: tl.constexpr,
    COLSUM: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Quantise a BLOCKxBLOCK tile of ``x`` (R, C) with one scale for the tile: ``q`` (R, C)
    and/or ``qt`` (C, R) = the same values of x.T, the scale stored at (R/BLOCK, C/BLOCK) of
    ``s``. ``COLSUM``: also write per-program column sums of ``x`` to ``cs`` (R/BLOCK, C)."""
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = pid_r * BLOCK + tl.arange(0, BLOCK)
    cols = pid_c * BLOCK + tl.arange(0, BLOCK)
    rmask = rows < R
    cmask = cols < C
    mask = rmask[:, None] & cmask[None, :]
    x = _load_f32(x_ptr + rows[:, None].to(tl.int64) * stride_xr + cols[None, :], mask, BF16_BITS)
    if COLSUM:
        tl.store(cs_ptr + pid_r.to(tl.int64) * C + cols, _rsum(x, axis=0), mask=cmask)
    fin = _finite(x)
    ax = tl.where(fin, tl.abs(x), 0.0)
    nonfin = (fin == 0).to(tl.int32)
    amax = _rmax(_rmax(ax, axis=1), axis=0)
    bad = _rmax(_rmax(nonfin, axis=1), axis=0)
    e = _blockwise_exponent(amax, bad, EMAX, MIN_EXP, MAX_EXP)
    q = _saturate(x * _pow2(-e), MAX_NORMAL)
    if ROW:
        offs = rows[:, None].to(tl.int64) * C + cols[None, :]
        _store_fp8(q_ptr + offs, q, mask, SOFT, MBITS, BIAS)
    if COL:
        _store_fp8_t(qt_ptr, q, rows, cols, R, rmask, cmask, SOFT, MBITS, BIAS)
    tl.store(s_ptr + pid_r * ((C + BLOCK - 1) // BLOCK) + pid_c, _pow2(e))


@triton.jit
def _abs_bits(x):
    """The float32 bits of ``|x|`` as int32: ordered like ``|x|`` for finite values, and
    ``>= 0x7F800000`` exactly for Inf / NaN, so one integer max gives both the block maximum
    and whether the block holds a non-finite value."""
    return x.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def _exponent_from_bits(m, EMAX: tl.constexpr, MIN_EXP: tl.constexpr, MAX_EXP: tl.constexpr):
    """:func:`_blockwise_exponent` from the max of :func:`_abs_bits` over a block."""
    e = ((m >> 23) & 0xFF) - 127 - EMAX + ((m & 0x7FFFFF) > 0x600000).to(tl.int32)
    e = tl.minimum(tl.maximum(e, MIN_EXP), MAX_EXP)
    return tl.where((m > 0) & (m < 0x7F800000), e, 0)


@triton.jit
def _to_fp8(
    ptr,
    v,
    mask,
    SOFT: tl.constexpr,
    MBITS: tl.constexpr,
    BIAS: tl.constexpr,
    MAX_NORMAL: tl.constexpr,
    EVEN: tl.constexpr,
):
    """Store ``v`` as FP8, saturated (NaN stays NaN, everything else clamps to +-max_normal).

    On the GPU the conversion saturates by itself (``cvt.rn.satfinite``, H200-checked against
    the reference with Inf and out-of-range values at cacefdc and again in test_cuda_kernel_bit_
    exact); only the integer path (``SOFT``) needs the explicit clamp. (What failed that GPU test
    was the sign of NaN, which the conversion drops: the reference now writes NaN as 0x7F too.)
    """
    if EVEN:
        if SOFT:
            tl.store(ptr, _fp8_bits(_saturate(v, MAX_NORMAL), MBITS, BIAS))
        else:
            tl.store(ptr, v.to(ptr.dtype.element_ty))
    else:
        if SOFT:
            v = _saturate(v, MAX_NORMAL)
        _store_fp8(ptr, v, mask, SOFT, MBITS, BIAS)


@triton.jit
def _store_fp8_t_runs(
    qt32_ptr,
    v,
    pid_r,
    cols,
    R,
    SOFT: tl.constexpr,
    MBITS: tl.constexpr,
    BIAS: tl.constexpr,
    MAX_NORMAL: tl.constexpr,
    T_RUN: tl.constexpr,
    BLOCK_R: tl.constexpr,
    RUN_ASM: tl.constexpr = False,
):
    """Store the float32 tile ``v`` (tile position i = row (i % GB) * T_RUN + i // GB of the
    program's BLOCK_R rows, GB = BLOCK_R // T_RUN) as FP8 into ``qt`` (C, R), viewed as int32:
    the T_RUN bytes of a column's run of rows become T_RUN / 4 little-endian words."""
    GB: tl.constexpr = BLOCK_R // T_RUN
    BLOCK_C: tl.constexpr = v.shape[1]
    if RUN_ASM and not SOFT:
        # Each word straight from its 4 float32 values: two saturating x2 conversions and a
        # move (the bytes are not unpacked to int32 and shifted back together).
        v = tl.reshape(tl.permute(tl.reshape(v, (T_RUN, GB, BLOCK_C)), (1, 2, 0)),
                       (GB, BLOCK_C, T_RUN // 4, 2, 2))  # fmt: skip
        even_t, odd_t = tl.split(v)
        t0, t2 = tl.split(even_t)
        t1, t3 = tl.split(odd_t)
        CVT: tl.constexpr = "cvt.rn.satfinite." + ("e4m3x2" if MBITS == 3 else "e5m2x2") + ".f32"
        words = tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; " + CVT + " lo, $2, $1; " + CVT + " hi, $4, $3; "
            "mov.b32 $0, {lo, hi}; }",
            "=r,f,f,f,f", [t0, t1, t2, t3], dtype=tl.int32, is_pure=True, pack=1,
        )  # fmt: skip
    else:
        if SOFT:
            u = _fp8_bits(_saturate(v, MAX_NORMAL), MBITS, BIAS)
        elif MBITS == 3:
            u = v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)  # saturates (see _to_fp8)
        else:
            u = v.to(tl.float8e5).to(tl.uint8, bitcast=True)
        # (T_RUN, GB, C) -> (GB, C, T_RUN): the run index moves last, then bytes pair into words.
        u = tl.permute(tl.reshape(u.to(tl.int32), (T_RUN, GB, BLOCK_C)), (1, 2, 0))
        u = tl.reshape(u, (GB, BLOCK_C, T_RUN // 4, 2, 2))
        lo, hi = tl.split(u)
        u = lo | (hi << 8)
        lo, hi = tl.split(u)
        words = lo | (hi << 16)
    run = tl.arange(0, GB)
    word = tl.arange(0, T_RUN // 4)
    offs = (
        cols[None, :, None].to(tl.int64) * (R // 4)
        + pid_r * (BLOCK_R // 4)
        + run[:, None, None] * (T_RUN // 4)
        + word[None, None, :]
    )
    tl.store(qt32_ptr + offs, words)


@triton.jit
def _prefetch_tile_l2(
    x_ptr, pid_r, pid_c, stride_xr, AHEAD: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK: tl.constexpr
):
    """Ask L2 for the x tile of the program launched ``AHEAD`` programs after this one (grid
    (R/BLOCK_R, C/BLOCK) of whole bfloat16 tiles, launched row-tile first): two 128-byte lines
    per row, each thread its own row. HBM then streams the later tile while the resident
    programs reduce theirs, and no registers wait for it. (One ``cp.async.bulk.prefetch`` per
    row instead needs a warp-uniform address: ptxas loops over the warp's rows, 254 registers,
    slower on the H200, see docs/kernel-tuning.md.)"""
    n_r = tl.num_programs(0)
    later = pid_r + AHEAD
    tile_c = pid_c + later // n_r
    if tile_c < tl.num_programs(1):
        tl.static_assert(
            BLOCK * x_ptr.dtype.element_ty.primitive_bitwidth == 2048,
            "prefetch: rows of 256 bytes (128 bfloat16)",
        )
        rows = (later % n_r) * BLOCK_R + tl.arange(0, BLOCK_R)
        addr = (x_ptr + rows.to(tl.int64) * stride_xr + tile_c * BLOCK).to(tl.int64, bitcast=True)
        tl.inline_asm_elementwise(
            "prefetch.global.L2 [$1]; prefetch.global.L2 [$1+128]; mov.b32 $0, 0;",
            "=r,l",
            [addr],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )


@triton.jit
def blockwise_tile_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    qt_ptr,
    st_ptr,
    exp_ptr,
    mean_ptr,
    rstd_ptr,
    w_ptr,
    b_ptr,
    cs_ptr,
    R,
    RQ,
    RT,
    C,
    CQ,
    stride_xr,
    ROW0,
    COL0,
    EMAX: tl.constexpr,
    MAX_NORMAL: tl.constexpr,
    MBITS: tl.constexpr,
    BIAS: tl.constexpr,
    SOFT: tl.constexpr,
    MIN_EXP: tl.constexpr,
    MAX_EXP: tl.constexpr,
    ROW: tl.constexpr,
    COL: tl.constexpr,
    FIXED: tl.constexpr,
    COL_TILE: tl.constexpr,
    NORM: tl.constexpr,
    HAS_MEAN: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    BF16_BITS: tl.constexpr,
    COLSUM: tl.constexpr,
    EVEN: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK: tl.constexpr,
    T_RUN: tl.constexpr = 0,
    PREFETCH: tl.constexpr = 0,
    RUN_ASM: tl.constexpr = False,
):
    """Quantise a BLOCK_R x BLOCK tile of ``x`` (``NORM``: normalised first, as
    ``(x - mean[r]) * rstd[r] * w[c] + b[c]``) with 1xBLOCK blocks (or one ``FIXED``,
    tensorwise, exponent read from ``exp_ptr``): ``q`` (R, C) with scales ``s`` stored
    (C/BLOCK, R), ``qt`` (C, R) = x.T with 1xBLOCK blocks along R, scales ``st`` stored
    (R/BLOCK_R, C); ``COLSUM``: per-program column sums of ``x`` in ``cs`` (R/BLOCK_R, C).
    ``RQ``, ``RT`` (>= R) and ``CQ`` (>= C) are the rows and columns the outputs are stored with:
    ``q`` (RQ, CQ), ``s`` (CQ/BLOCK, RQ), ``qt`` (C, RT), ``st`` (RT/BLOCK_R, C) or (C/BLOCK,
    RT/BLOCK_R); rows from R and columns from C on are not written. One
    integer max per direction gives the block maximum and the non-finite flag
    (:func:`_abs_bits`), and ``EVEN`` (the launch covers whole tiles only) drops the masks.
    ``ROW0``, ``COL0``: the row and column tile of the launch's first program
    (``blockwise._launch_tile_kernel`` launches the whole tiles and the ragged last row and
    column of tiles separately). Both block maxima are reduced before the row layout is
    written (the bits die sooner).
    ``COL_TILE``: ``qt`` gets one scale per BLOCK_R x BLOCK tile, ``st`` stored
    (C/BLOCK, R/BLOCK_R). The transposed tile is converted to FP8 first and transposed in
    registers (``tl.trans``), then stored: one BLOCK_R-byte run of ``qt`` per column of ``x``.
    ``T_RUN`` (4, 8 or 16; needs ``EVEN``, ``qt_ptr`` an int32 view of ``qt``): the tile's rows
    are loaded in an order that puts runs of ``T_RUN`` consecutive rows of ``x`` into one
    thread's registers (with the load layouts Triton picks), so ``qt`` is stored as packed
    ``T_RUN``-byte words with no transpose through shared memory (one byte load each before).
    ``PREFETCH`` (> 0; needs ``EVEN`` and bfloat16 ``x``, compiled only): after loading its tile
    each program asks L2 for the tile of the program ``PREFETCH`` launches later
    (:func:`_prefetch_tile_l2`).
    ``RUN_ASM`` (with ``T_RUN``; compiled for sm_89+ only): each packed word of ``qt`` is made by
    inline PTX from its 4 float32 values (:func:`_store_fp8_t_runs`), same bits.
    """
    pid_r = tl.program_id(0) + ROW0
    pid_c = tl.program_id(1) + COL0
    if T_RUN > 0:
        # Tile position i holds row (i % GB) * T_RUN + i // GB: the rows a thread holds (GB
        # apart in the tile) are consecutive in x. Any order gives the same bits.
        GB: tl.constexpr = BLOCK_R // T_RUN
        order = tl.arange(0, BLOCK_R)
        rows = pid_r * BLOCK_R + (order % GB) * T_RUN + order // GB
    else:
        rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = pid_c * BLOCK + tl.arange(0, BLOCK)
    rmask = rows < R
    cmask = cols < C
    mask = rmask[:, None] & cmask[None, :]
    x_offs = rows[:, None].to(tl.int64) * stride_xr + cols[None, :]
    if EVEN:
        x_in = tl.load(x_ptr + x_offs)
        if PREFETCH > 0:
            _prefetch_tile_l2(x_ptr, pid_r, pid_c, stride_xr, PREFETCH, BLOCK_R, BLOCK)
        if BF16_BITS:
            x = (x_in.to(tl.int32) << 16).to(tl.float32, bitcast=True)
        else:
            x = x_in.to(tl.float32)
    else:
        x = _load_f32(x_ptr + x_offs, mask, BF16_BITS)
    if NORM:
        rstd = tl.load(rstd_ptr + rows, mask=rmask, other=0.0)
        if HAS_MEAN:
            x = x - tl.load(mean_ptr + rows, mask=rmask, other=0.0)[:, None]
        x = x * rstd[:, None]
        if HAS_W:
            x = x * tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        if HAS_B:
            x = x + tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        if not EVEN:
            x = tl.where(mask, x, 0.0)
    if COLSUM:
        tl.store(cs_ptr + pid_r.to(tl.int64) * C + cols, _rsum(x, axis=0), mask=cmask)
    if FIXED:
        inv_fixed = _pow2(-tl.load(exp_ptr))  # one scalar for the whole tensor
    else:
        bits = _abs_bits(x)
    if not FIXED and (ROW or COL_TILE):
        row_bits = _rmax(bits, axis=1)
    if COL and not FIXED and not COL_TILE:
        col_bits = _rmax(bits, axis=0)
    if ROW:
        if FIXED:
            q = x * inv_fixed
        else:
            e_r = _exponent_from_bits(row_bits, EMAX, MIN_EXP, MAX_EXP)
            q = x * _pow2(-e_r)[:, None]
        offs = rows[:, None].to(tl.int64) * CQ + cols[None, :]
        _to_fp8(q_ptr + offs, q, mask, SOFT, MBITS, BIAS, MAX_NORMAL, EVEN)
        if not FIXED:
            s_offs = pid_c.to(tl.int64) * RQ + rows
            if EVEN:
                tl.store(s_ptr + s_offs, _pow2(e_r))
            else:
                tl.store(s_ptr + s_offs, _pow2(e_r), mask=rmask)
    if COL:
        tl.static_assert(not FIXED, _FIXED_ROWS_ONLY)
        if COL_TILE:
            # One scale per BLOCK_R x BLOCK tile (the max of the row maxima).
            e_t = _exponent_from_bits(_rmax(row_bits, axis=0), EMAX, MIN_EXP, MAX_EXP)
            qt = x * _pow2(-e_t)
        else:
            e_c = _exponent_from_bits(col_bits, EMAX, MIN_EXP, MAX_EXP)
            qt = x * _pow2(-e_c)[None, :]
        if T_RUN > 0:
            _store_fp8_t_runs(
                qt_ptr,
                qt,
                pid_r,
                cols,
                RT,
                SOFT,
                MBITS,
                BIAS,
                MAX_NORMAL,
                T_RUN,
                BLOCK_R,
                RUN_ASM,
            )
        else:
            t_offs = cols[:, None].to(tl.int64) * RT + rows[None, :]
            t_mask = cmask[:, None] & rmask[None, :]
            if SOFT:
                qt = _fp8_bits(_saturate(qt, MAX_NORMAL), MBITS, BIAS)
            else:
                qt = qt.to(qt_ptr.dtype.element_ty)  # saturates (see _to_fp8)
            if EVEN:
                tl.store(qt_ptr + t_offs, tl.trans(qt))
            else:
                tl.store(qt_ptr + t_offs, tl.trans(qt), mask=t_mask)
        if COL_TILE:
            # (C/BLOCK, R/BLOCK_R) contiguous: the layout of a 128x128 operand's scale_t.
            n_row_blocks = (RT + BLOCK_R - 1) // BLOCK_R
            tl.store(st_ptr + pid_c.to(tl.int64) * n_row_blocks + pid_r, _pow2(e_t))
        else:
            if EVEN:
                tl.store(st_ptr + pid_r.to(tl.int64) * C + cols, _pow2(e_c))
            else:
                tl.store(st_ptr + pid_r.to(tl.int64) * C + cols, _pow2(e_c), mask=cmask)


@triton.jit
def column_sum_kernel(p_ptr, out_ptr, NR, C, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """``out[c] = sum over r of p[r, c]`` for a float32 (NR, C) ``p`` (the per-tile column sums
    of the quantise kernels), one program per BLOCK_C columns, rows in a fixed order."""
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    # tl.full, not tl.zeros: that is a jit function of triton.language, decorated in the mode of
    # Triton's first import (see _rmax), which fails in the other mode.
    acc = tl.full((BLOCK_R, BLOCK_C), 0.0, tl.float32)
    for r0 in range(0, NR, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        mask = (rows[:, None] < NR) & cmask[None, :]
        acc += tl.load(p_ptr + rows[:, None].to(tl.int64) * C + cols[None, :], mask=mask, other=0.0)
    tl.store(out_ptr + cols, _rsum(acc, axis=0), mask=cmask)


# ---------------------------------------------------------------------------------------------
# Fused RMSNorm / LayerNorm -> 1x128 blockwise FP8.


@triton.jit
def norm_quantize_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    q_ptr,
    s_ptr,
    mean_ptr,
    rstd_ptr,
    R,
    RQ,
    C,
    CQ,
    stride_xr,
    eps,
    EMAX: tl.constexpr,
    MAX_NORMAL: tl.constexpr,
    MBITS: tl.constexpr,
    BIAS: tl.constexpr,
    SOFT: tl.constexpr,
    MIN_EXP: tl.constexpr,
    MAX_EXP: tl.constexpr,
    LAYERNORM: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    BF16_BITS: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_C: tl.constexpr,
    GROUP: tl.constexpr,
    EVEN: tl.constexpr = False,
):
    """Normalise ``ROWS`` full rows and write them as FP8 with one scale per 1xGROUP block.

    ``q`` is stored (RQ, CQ) and its scales ``s`` (CQ/GROUP, RQ), RQ >= R and CQ >= C (rows
    from R and columns from C on not written); ``mean`` (LayerNorm only) and ``rstd`` per row.
    ``EVEN`` (C == BLOCK_C and R % ROWS == 0) drops the masks.
    """
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_C)
    rmask = rows < R
    cmask = cols < C
    mask = rmask[:, None] & cmask[None, :]
    x_offs = rows[:, None].to(tl.int64) * stride_xr + cols[None, :]
    if EVEN:
        if BF16_BITS:
            x = (tl.load(x_ptr + x_offs).to(tl.int32) << 16).to(tl.float32, bitcast=True)
        else:
            x = tl.load(x_ptr + x_offs).to(tl.float32)
    else:
        x = _load_f32(x_ptr + x_offs, mask, BF16_BITS)
    if LAYERNORM:
        mean = _rsum(x, axis=1) / C
        x = x - mean[:, None]
        if not EVEN:
            x = tl.where(mask, x, 0.0)
        tl.store(mean_ptr + rows, mean, mask=rmask)
    var = _rsum(x * x, axis=1) / C
    rstd = 1.0 / tl.sqrt_rn(var + eps)
    tl.store(rstd_ptr + rows, rstd, mask=rmask)
    y = x * rstd[:, None]
    if HAS_W:
        y = y * tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    if HAS_B:
        y = y + tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    if not EVEN:
        y = tl.where(mask, y, 0.0)
    NG: tl.constexpr = BLOCK_C // GROUP
    y3 = tl.reshape(y, (ROWS, NG, GROUP))
    e = _exponent_from_bits(_rmax(_abs_bits(y3), axis=2), EMAX, MIN_EXP, MAX_EXP)
    q = tl.reshape(y3 * _pow2(-e)[:, :, None], (ROWS, BLOCK_C))
    offs = rows[:, None].to(tl.int64) * CQ + cols[None, :]
    _to_fp8(q_ptr + offs, q, mask, SOFT, MBITS, BIAS, MAX_NORMAL, EVEN)
    groups = tl.arange(0, NG)
    s_offs = groups[None, :].to(tl.int64) * RQ + rows[:, None]
    s_mask = rmask[:, None] & (groups[None, :] * GROUP < C)
    tl.store(s_ptr + s_offs, _pow2(e), mask=s_mask)


@triton.jit
def norm_backward_kernel(
    dy_ptr,
    x_ptr,
    w_ptr,
    mean_ptr,
    rstd_ptr,
    dx_ptr,
    dw_part_ptr,
    db_part_ptr,
    R,
    C,
    stride_xr,
    stride_dyr,
    LAYERNORM: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    ROWS_PER_PROGRAM: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """dx of RMSNorm / LayerNorm, plus per-program partial sums of dw and db (float32)."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_C)
    cmask = cols < C
    if HAS_W:
        w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    dw_acc = tl.full((BLOCK_C,), 0.0, tl.float32)
    db_acc = tl.full((BLOCK_C,), 0.0, tl.float32)
    for i in range(ROWS_PER_PROGRAM):
        row = pid * ROWS_PER_PROGRAM + i
        m = cmask & (row < R)
        x = tl.load(x_ptr + row.to(tl.int64) * stride_xr + cols, mask=m, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row.to(tl.int64) * stride_dyr + cols, mask=m, other=0.0).to(
            tl.float32
        )
        rstd = tl.load(rstd_ptr + row, mask=row < R, other=0.0)
        if LAYERNORM:
            x = tl.where(m, x - tl.load(mean_ptr + row, mask=row < R, other=0.0), 0.0)
        xhat = x * rstd
        g = dy * w if HAS_W else dy
        dw_acc += dy * xhat
        db_acc += dy
        c1 = _rsum(g * xhat, axis=0) / C
        if LAYERNORM:
            c2 = _rsum(g, axis=0) / C
            dx = (g - xhat * c1 - c2) * rstd
        else:
            dx = (g - xhat * c1) * rstd
        tl.store(dx_ptr + row.to(tl.int64) * C + cols, dx.to(dx_ptr.dtype.element_ty), mask=m)
    if HAS_W:
        tl.store(dw_part_ptr + pid * C + cols, dw_acc, mask=cmask)
    if HAS_B:
        tl.store(db_part_ptr + pid * C + cols, db_acc, mask=cmask)


@triton.jit
def transpose_bytes_kernel(src_ptr, dst_ptr, R, C, BLOCK: tl.constexpr):
    """``dst`` (C, R) = ``src`` (R, C) transposed, for one-byte elements (uint8 views)."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = (rows[:, None] < R) & (cols[None, :] < C)
    tile = tl.load(src_ptr + rows[:, None].to(tl.int64) * C + cols[None, :], mask=mask)
    t_offs = cols[:, None].to(tl.int64) * R + rows[None, :]
    tl.store(dst_ptr + t_offs, tl.trans(tile), mask=tl.trans(mask))
