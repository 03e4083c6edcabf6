"""Triton kernels of GDPA, ``act(scale * Q K^T) V`` (forward, short-KV forward, dK/dV, dQ).

Loaded by :mod:`gem_kernels.gdpa_triton` through ``importlib`` (never imported directly): Triton
decides at decoration time whether ``@triton.jit`` compiles or interprets, so the loader
executes this file once per mode (``TRITON_INTERPRET`` set or not) under distinct module names.

Conventions shared by the kernels:

* Work items come from a host-built table, one int64 row per item: ``[q_start, q_len,
  k_start, k_len, tile_start, out_start, head, tile_end, range_lo, range_hi, dst_start]``.
  ``q_start`` is the first row of the sample's queries in q (0 for PMA broadcast queries),
  ``out_start`` the first row of its dO; ``tile_start`` is the first row (query or key, by
  kernel) of the item, ``tile_end`` the end of the item's row range (short-KV kernel only).
  ``[range_lo, range_hi)`` (tile-aligned) restricts the rows of the other side that the item
  visits: split-KV forward / dQ (keys) and split-Q dK/dV (queries) write partial results that
  a second pass sums in a fixed order (deterministic, no atomics). ``dst_start`` is the row
  of the item's sample in the destination (output, partial buffer, dQ or dK/dV); the last
  column, ``to_partial``, sends the forward's output or dK/dV to the float32 partial buffers
  instead (only the samples that are split go there).
* Every kernel is persistent: program ``p`` of ``P`` runs items ``p, p + P, p + 2P, ...``; the
  host orders the table so that this deals the work longest-first in zigzag. With ``P`` =
  number of items it is one item a program.
* Query ``i`` of a sample sits at the aligned position ``p = i + shift`` with
  ``shift = k_len - q_len`` and sees keys ``p - left <= j <= p + right`` (causal is
  ``right = 0``); ``HAS_LEFT`` / ``HAS_RIGHT`` are false for unbounded sides.
* No softmax, so no running max, no log-sum-exp and no backward preprocess: the backward
  recomputes ``S`` and uses ``dS = dP * act'(S)``. Masked pairs get ``P = 0`` and ``dS = 0``.
* ``FUSED_DQ`` (dK/dV kernel): the one exception to "no atomics": dQ is added per (query
  tile, key tile) into a zeroed float32 buffer, so dQ's float32 summation order varies.
* Each KV (or Q) loop runs in three phases: masked tiles, tiles fully inside the visible band
  (no mask arithmetic), masked tiles. Tiles outside the band are never visited.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import triton
import triton.language as tl

from gem_kernels.reference import _GELU_FAST_COEFFS
from gem_kernels.triton_loader import interpret_requested, load_kernel_module

# The E4M3 cast (with the interpreter's rounding workaround) is JFA's: loaded from its kernel
# file in this file's mode (the loader sets TRITON_INTERPRET while executing this file).
_to_e4m3 = load_kernel_module(
    Path(__file__).with_name("_jfa_kernels.py"), interpret_requested()
)._to_e4m3

# Columns of a work-table row (gdpa_triton builds the table).
TABLE_WIDTH = 13
_W = tl.constexpr(TABLE_WIDTH)

# Activation codes (the ``ACT`` constexpr); gdpa_triton maps names to them.
ACT_SILU = 0
ACT_GELU = 1
ACT_GELU_TANH = 2
ACT_GELU_FAST = 3
ACT_RELU2 = 4
ACT_IDENTITY = 5

if interpret_requested():

    @triton.jit
    def _sigmoid(x):
        return tl.sigmoid(x)

else:

    @triton.jit
    def _sigmoid(x):
        """1 / (1 + 2^(-x log2 e)) from the flush-to-zero approximate exponential and reciprocal
        (one special-function instruction each, relative error near 2^-22): ``tl.sigmoid``'s
        full-range exponential and division cost about 10 more instructions per score, which
        made the silu / gelu_tanh loops issue-bound (``benchmarks/tune/issue_budget.py``).
        Large negative x: the exponential overflows to inf and the reciprocal gives 0."""
        e = tl.math.exp2(x * -1.4426950408889634)
        return tl.inline_asm_elementwise(
            "rcp.approx.ftz.f32 $0, $1;", "=f,f", [1.0 + e], dtype=tl.float32, is_pure=True, pack=1
        )


# The polynomial of reference.gelu_fast (globals read by a jit function must be constexpr).
assert len(_GELU_FAST_COEFFS) == 5, "the kernels hard-code a degree-4 P of reference.gelu_fast"
_GF0 = tl.constexpr(_GELU_FAST_COEFFS[0])
_GF1 = tl.constexpr(_GELU_FAST_COEFFS[1])
_GF2 = tl.constexpr(_GELU_FAST_COEFFS[2])
_GF3 = tl.constexpr(_GELU_FAST_COEFFS[3])
_GF4 = tl.constexpr(_GELU_FAST_COEFFS[4])


@triton.jit
def _act_scale(amax):
    """(scale, 1 / scale) of A's FP8 cast from its non-negative float32 absolute maximum:
    ``2^(floor(log2 amax) - 7)`` from the exponent bits, clamped to [2^-126, 2^120] (exact, and
    the same bits as ``reference._pow2_floor_scale``): ``amax / scale`` lies in [128, 256)."""
    exponent = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 7
    exponent = tl.minimum(tl.maximum(exponent, 1), 247)
    scale = (exponent << 23).to(tl.float32, bitcast=True)
    inverse = ((254 - exponent) << 23).to(tl.float32, bitcast=True)
    return scale, inverse


@triton.jit
def _dot(a, b, acc, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    # UPCAST: the Triton 3.8 interpreter multiplies bfloat16 operands wrongly; fp32 is exact.
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=DOT_PRECISION)


@triton.jit
def _gelu_fast_cdf(s):
    """Polynomial normal CDF of reference.gelu_fast: ``clamp(0.5 + s * P(s^2), 0, 1)``.

    The leading coefficient is positive, so past |s| ~= 3.42 the raw value stays beyond [0, 1]
    and the clamp gives the exact limits (also for huge |s|, where it overflows to +-inf)."""
    s2 = s * s
    poly = _GF4 * s2 + _GF3
    poly = poly * s2 + _GF2
    poly = poly * s2 + _GF1
    poly = poly * s2 + _GF0
    raw = 0.5 + s * poly
    cdf = tl.minimum(tl.maximum(raw, 0.0), 1.0)
    return cdf, raw, s2, poly


# ---------------------------------------------------------------------------------------------
# Packed half2 gelu_fast (``PACKED`` constexpr: 0 float32 path, 1 inline PTX, 2 the same math in
# plain tl for the interpreter, which cannot run inline asm).
#
# The polynomial CDF runs in f16x2 (two elements per instruction, ``fma.rn.sat`` folds the clamp
# to [0, 1]); ``s * cdf`` is taken in float32 and rounded once to bfloat16 for the PV MMA, so the
# tails stay exact (cdf is exactly 0 or 1 there, also when s^2 overflows f16 to inf). Error
# (RMS over s ~ N(0, 1), relative to RMS GELU, after the bf16 rounding the MMA needs anyway):
# 2.05e-3 against 1.98e-3 for the float32 path; max abs error before that rounding: below
# gdpa_triton.GELU_FAST_F16_MAX_ABS_ERROR (4.5e-3; float32 path 1.07e-3). Evaluating in bf16x2
# instead would save one op per pair but nearly double the RMS error (3.6e-3). Measured on an
# H200: the forward is not faster with it at a 128x128 tile (which spills registers), the
# backward is (see docs/kernel-tuning.md).


def _half2(value: float) -> str:
    """PTX b32 immediate holding ``value`` rounded to float16 in both halves."""
    bits = int(np.float16(value).view(np.uint16))
    return f"0x{bits | bits << 16:08x}"


_C = [_half2(c) for c in _GELU_FAST_COEFFS]
_D = [_half2(2.0 * (k + 1) * c) for k, c in enumerate(_GELU_FAST_COEFFS[1:])]  # 2 (k+1) c_{k+1}
# $s0, $s1: scaled scores (f32). Leaves h = s (f16x2), h2 = s^2, p = P(s^2), cdf.
_POLY_PTX = f"""
cvt.rn.f16x2.f32 h, $S1, $S0;
mul.rn.f16x2 h2, h, h;
mov.b32 k, {_C[4]};
mov.b32 p, {_C[3]};
fma.rn.f16x2 p, k, h2, p;
mov.b32 k, {_C[2]};
fma.rn.f16x2 p, p, h2, k;
mov.b32 k, {_C[1]};
fma.rn.f16x2 p, p, h2, k;
mov.b32 k, {_C[0]};
fma.rn.f16x2 p, p, h2, k;
mov.b32 k, 0x38003800;
fma.rn.sat.f16x2 cdf, h, p, k;
"""
# Forward: $0 = bf16x2 of s * cdf; $1, $2 = s.
_GELU_FAST_F16X2_PTX = tl.constexpr(
    "{\n.reg .b32 h, h2, p, k, cdf;\n.reg .f16 c0, c1;\n.reg .f32 a0, a1;\n"
    + _POLY_PTX.replace("$S0", "$1").replace("$S1", "$2")
    + "mov.b32 {c0, c1}, cdf;\ncvt.f32.f16 a0, c0;\ncvt.f32.f16 a1, c1;\n"
    + "mul.f32 a0, a0, $1;\nmul.f32 a1, a1, $2;\ncvt.rn.bf16x2.f32 $0, a1, a0;\n}"
)
# Backward: the derivative is cdf + s * (P + 2 s^2 P'(s^2)) where the clamp is inactive
# (cdf == raw; an and-mask keeps inf * 0 out where s^2 overflowed), ds = dp * act'(s).
_GRAD_PTX = f"""
mov.b32 k, 0x38003800;
fma.rn.f16x2 raw, h, p, k;
mov.b32 k, {_D[3]};
mov.b32 d, {_D[2]};
fma.rn.f16x2 d, k, h2, d;
mov.b32 k, {_D[1]};
fma.rn.f16x2 d, d, h2, k;
mov.b32 k, {_D[0]};
fma.rn.f16x2 d, d, h2, k;
fma.rn.f16x2 d, h2, d, p;
mul.rn.f16x2 d, h, d;
set.eq.u32.f16x2 m, cdf, raw;
and.b32 d, d, m;
add.rn.f16x2 g, cdf, d;
mov.b32 {{g0, g1}}, g;
cvt.f32.f16 a0, g0;
cvt.f32.f16 a1, g1;
"""
_GRAD_REGS = "{\n.reg .b32 h, h2, p, k, cdf, raw, d, m, g;\n.reg .f16 g0, g1, c0, c1;\n"
_GRAD_REGS += ".reg .f32 a0, a1;\n"
# dK/dV: $0 = bf16x2 of act(s), $1 = bf16x2 of ds; $2, $3 = s; $4, $5 = dp.
_GELU_FAST_GRAD_F16X2_PTX = tl.constexpr(
    _GRAD_REGS
    + _POLY_PTX.replace("$S0", "$2").replace("$S1", "$3")
    + _GRAD_PTX
    + "mul.f32 a0, a0, $4;\nmul.f32 a1, a1, $5;\ncvt.rn.bf16x2.f32 $1, a1, a0;\n"
    + "mov.b32 {c0, c1}, cdf;\ncvt.f32.f16 a0, c0;\ncvt.f32.f16 a1, c1;\n"
    + "mul.f32 a0, a0, $2;\nmul.f32 a1, a1, $3;\ncvt.rn.bf16x2.f32 $0, a1, a0;\n}"
)
# dQ: $0 = bf16x2 of ds; $1, $2 = s; $3, $4 = dp.
_GELU_FAST_DS_F16X2_PTX = tl.constexpr(
    _GRAD_REGS
    + _POLY_PTX.replace("$S0", "$1").replace("$S1", "$2")
    + _GRAD_PTX
    + "mul.f32 a0, a0, $3;\nmul.f32 a1, a1, $4;\ncvt.rn.bf16x2.f32 $0, a1, a0;\n}"
)


@triton.jit
def _gelu_fast_f16_tl(s):
    """The packed path's math in plain tl (interpreter): (cdf f16, raw f16, s f16, s^2, P)."""
    h = s.to(tl.float16)
    h2 = h * h
    p = (h2 * _GF4 + _GF3).to(tl.float16)
    p = (p * h2 + _GF2).to(tl.float16)
    p = (p * h2 + _GF1).to(tl.float16)
    p = (p * h2 + _GF0).to(tl.float16)
    raw = (h * p + 0.5).to(tl.float16)
    cdf = tl.minimum(tl.maximum(raw, 0.0), 1.0).to(tl.float16)
    return cdf, raw, h, h2, p


@triton.jit
def _act_packed(s, PACKED: tl.constexpr):
    """gelu_fast(s) as bfloat16 (s: scaled float32 scores) through the f16x2 polynomial."""
    if PACKED == 1:
        a = tl.inline_asm_elementwise(
            _GELU_FAST_F16X2_PTX, "=r,r,r", [s], dtype=tl.bfloat16, is_pure=True, pack=2
        )
    else:
        cdf, raw, h, h2, p = _gelu_fast_f16_tl(s)
        a = (s * cdf.to(tl.float32)).to(tl.bfloat16)
    return a


@triton.jit
def _grad_f16_tl(s, dp):
    cdf, raw, h, h2, p = _gelu_fast_f16_tl(s)
    d = (h2 * (_GF4 * 8.0) + _GF3 * 6.0).to(tl.float16)
    d = (d * h2 + _GF2 * 4.0).to(tl.float16)
    d = (d * h2 + _GF1 * 2.0).to(tl.float16)
    d = (h * (h2 * d + p).to(tl.float16)).to(tl.float16)
    g = tl.where(cdf == raw, (cdf + d).to(tl.float16), cdf)
    return cdf, (dp * g.to(tl.float32)).to(tl.bfloat16)


@triton.jit
def _act_grad_packed(s, dp, PACKED: tl.constexpr):
    """(gelu_fast(s), dp * gelu_fast'(s)) as bfloat16 through the f16x2 polynomial."""
    if PACKED == 1:
        a, ds = tl.inline_asm_elementwise(
            _GELU_FAST_GRAD_F16X2_PTX, "=r,=r,r,r,r,r", [s, dp],
            dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=2,
        )  # fmt: skip
    else:
        cdf, ds = _grad_f16_tl(s, dp)
        a = (s * cdf.to(tl.float32)).to(tl.bfloat16)
    return a, ds


@triton.jit
def _ds_packed(s, dp, PACKED: tl.constexpr):
    """dp * gelu_fast'(s) as bfloat16 through the f16x2 polynomial."""
    if PACKED == 1:
        ds = tl.inline_asm_elementwise(
            _GELU_FAST_DS_F16X2_PTX, "=r,r,r,r,r", [s, dp], dtype=tl.bfloat16, is_pure=True,
            pack=2,
        )  # fmt: skip
    else:
        cdf, ds = _grad_f16_tl(s, dp)
    return ds


@triton.jit
def _act(s, ACT: tl.constexpr):
    """act(s), element-wise, float32."""
    if ACT == 0:
        a = s * _sigmoid(s)
    elif ACT == 1:
        a = 0.5 * s * (1.0 + tl.math.erf(s * 0.7071067811865476))
    elif ACT == 2:
        # 0.5 * (1 + tanh(x)) == sigmoid(2x): gelu_tanh(s) = s * sigmoid(2k(s + 0.044715 s^3)).
        a = s * _sigmoid(1.5957691216057308 * s * (1.0 + 0.044715 * s * s))
    elif ACT == 3:
        cdf, raw, s2, poly = _gelu_fast_cdf(s)
        a = s * cdf
    elif ACT == 4:
        r = tl.maximum(s, 0.0)
        a = r * r
    else:
        a = s
    return a


@triton.jit
def _act_grad(s, ACT: tl.constexpr):
    """(act(s), act'(s)), element-wise, float32."""
    if ACT == 0:
        sig = _sigmoid(s)
        a = s * sig
        g = sig * (1.0 + s * (1.0 - sig))
    elif ACT == 1:
        cdf = 0.5 * (1.0 + tl.math.erf(s * 0.7071067811865476))
        a = s * cdf
        g = cdf + s * (0.3989422804014327 * tl.exp(-0.5 * s * s))
    elif ACT == 2:
        s2 = s * s
        sig = _sigmoid(1.5957691216057308 * s * (1.0 + 0.044715 * s2))
        a = s * sig
        g = sig + s * sig * (1.0 - sig) * (1.5957691216057308 * (1.0 + 0.134145 * s2))
    elif ACT == 3:
        cdf, raw, s2, poly = _gelu_fast_cdf(s)
        # d/ds [s * P(s^2)] = P(s^2) + 2 s^2 P'(s^2); zero where the CDF is clamped.
        dpoly = 4.0 * _GF4 * s2 + 3.0 * _GF3
        dpoly = dpoly * s2 + 2.0 * _GF2
        dpoly = dpoly * s2 + _GF1
        dcdf = poly + 2.0 * s2 * dpoly
        inside = (raw > 0.0) & (raw < 1.0)
        a = s * cdf
        g = cdf + tl.where(inside, s * dcdf, 0.0)
    elif ACT == 4:
        r = tl.maximum(s, 0.0)
        a = r * r
        g = 2.0 * r
    else:
        a = s
        g = tl.full(s.shape, 1.0, tl.float32)
    return a, g


@triton.jit
def _visible(rows, cols, shift, q_len, k_len, left, right, HAS_LEFT, HAS_RIGHT):
    """Visibility of a (rows x cols) score tile; rows/cols are sample-local indices."""
    pos = rows + shift
    mask = (rows < q_len) & (cols < k_len)
    if HAS_LEFT:
        mask = mask & (cols >= pos - left)
    if HAS_RIGHT:
        mask = mask & (cols <= pos + right)
    return mask


@triton.jit
def _load_tile(base, rows, row_ok, stride, offs_d, HEAD_DIM, ROW_MASK, EVEN_D, TRANS):
    """Load rows x head_dim (or its transpose with TRANS) with only the masks that are needed."""
    rows64 = rows.to(tl.int64)
    if TRANS:
        ptrs = base + rows64[None, :] * stride + offs_d[:, None]
        if ROW_MASK:
            if EVEN_D:
                tile = tl.load(ptrs, mask=row_ok[None, :], other=0.0)
            else:
                tile = tl.load(ptrs, mask=row_ok[None, :] & (offs_d < HEAD_DIM)[:, None], other=0.0)
        elif EVEN_D:
            tile = tl.load(ptrs)
        else:
            tile = tl.load(ptrs, mask=(offs_d < HEAD_DIM)[:, None], other=0.0)
    else:
        ptrs = base + rows64[:, None] * stride + offs_d[None, :]
        if ROW_MASK:
            if EVEN_D:
                tile = tl.load(ptrs, mask=row_ok[:, None], other=0.0)
            else:
                tile = tl.load(ptrs, mask=row_ok[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
        elif EVEN_D:
            tile = tl.load(ptrs)
        else:
            tile = tl.load(ptrs, mask=(offs_d < HEAD_DIM)[None, :], other=0.0)
    return tile


@triton.jit
def _store_tile(base, rows, row_ok, stride, offs_d, value, HEAD_DIM, EVEN_D):
    ptrs = base + rows.to(tl.int64)[:, None] * stride + offs_d[None, :]
    if EVEN_D:
        tl.store(ptrs, value, mask=row_ok[:, None])
    else:
        tl.store(ptrs, value, mask=row_ok[:, None] & (offs_d < HEAD_DIM)[None, :])


@triton.jit
def _key_ranges(m0, shift, q_len, k_len, left, right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT):
    """Key tiles of a query tile: [lo, full_lo) masked, [full_lo, full_hi) inside the band
    (all pairs visible, all keys real), [full_hi, hi) masked. Only real rows count."""
    p_lo = m0 + shift
    p_hi = tl.minimum(m0 + BLOCK_M, q_len) - 1 + shift
    key_lo = 0
    key_hi = k_len
    if HAS_LEFT:
        key_lo = tl.maximum(p_lo - left, 0)
    if HAS_RIGHT:
        key_hi = tl.minimum(key_hi, p_hi + right + 1)
    key_hi = tl.maximum(key_hi, key_lo)
    lo_t = (key_lo // BLOCK_N) * BLOCK_N
    hi_t = ((key_hi + BLOCK_N - 1) // BLOCK_N) * BLOCK_N
    full_lo = lo_t
    if HAS_LEFT:
        full_lo = tl.maximum(
            full_lo, ((tl.maximum(p_hi - left, 0) + BLOCK_N - 1) // BLOCK_N) * BLOCK_N
        )
    limit = k_len
    if HAS_RIGHT:
        limit = tl.minimum(limit, p_lo + right + 1)
    full_hi = (tl.maximum(limit, 0) // BLOCK_N) * BLOCK_N
    full_lo = tl.minimum(full_lo, hi_t)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi_t)
    return lo_t, full_lo, full_hi, hi_t


@triton.jit
def _query_ranges(n0, shift, q_len, k_len, left, right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT):
    """Query tiles that see a key tile, split like :func:`_key_ranges`."""
    j_last = tl.minimum(n0 + BLOCK_N, k_len) - 1
    row_lo = 0
    row_hi = q_len
    if HAS_RIGHT:
        row_lo = tl.maximum(n0 - right - shift, 0)
    if HAS_LEFT:
        row_hi = tl.minimum(row_hi, j_last + left - shift + 1)
    row_hi = tl.maximum(row_hi, row_lo)
    lo_t = (row_lo // BLOCK_M) * BLOCK_M
    hi_t = ((row_hi + BLOCK_M - 1) // BLOCK_M) * BLOCK_M
    full_lo = lo_t
    if HAS_RIGHT:
        need = tl.maximum(n0 + BLOCK_N - 1 - shift - right, 0)
        full_lo = tl.maximum(full_lo, ((need + BLOCK_M - 1) // BLOCK_M) * BLOCK_M)
    limit = q_len
    if HAS_LEFT:
        limit = tl.minimum(limit, n0 + left - shift + 1)
    full_hi = (tl.maximum(limit, 0) // BLOCK_M) * BLOCK_M
    # A partial key tile is masked against every query tile.
    full_hi = tl.where(n0 + BLOCK_N > k_len, 0, full_hi)
    full_lo = tl.minimum(full_lo, hi_t)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi_t)
    return lo_t, full_lo, full_hi, hi_t


@triton.jit
def _clip_ranges(lo_t, full_lo, full_hi, hi_t, range_lo, range_hi):
    """Restrict the three phases to the tile-aligned rows [range_lo, range_hi)."""
    lo = tl.maximum(lo_t, range_lo)
    hi = tl.maximum(tl.minimum(hi_t, range_hi), lo)
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def _range_of(info):
    # Multiples of the tiles (at least 16): said to the compiler, so that the loop bounds clipped
    # to them stay 16-divisible and a tokens-contiguous tile loads as 16-byte vectors.
    lo = tl.multiple_of(tl.load(info + 8).to(tl.int32), 16)
    hi = tl.multiple_of(tl.load(info + 9).to(tl.int32), 16)
    return lo, hi, tl.load(info + 10), tl.load(info + 11) != 0


# ---------------------------------------------------------------------------------------------
# Forward.


@triton.jit
def _fwd_inner(
    acc, q, k_base, v_base, stride_kt, stride_vt, start_n, end_n, offs_m, offs_d, shift, q_len,
    k_len, left, right, scale,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, ACT: tl.constexpr, MASKED: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, EVEN_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, PACKED: tl.constexpr,
    FP8: tl.constexpr = False, q_scale=1.0, ks_base=0, vs_base=0, num_heads=1, stride_v8_d=0,
):  # fmt: skip
    """``FP8``: q, k, v are E4M3 (``q_scale`` the query tile's power-of-two scale, ``ks_base`` /
    ``vs_base`` the keys' / values' per-token scales, token stride ``num_heads``: every key
    tile lies inside one quantisation block); A is cast to E4M3 for A V with one power-of-two
    scale per row of this key tile (``reference.FP8_ACT_TILE`` keys, from the row's maximum:
    a scale must be constant along the GEMM's reduction). v is keys-contiguous in whole
    zero-padded blocks from the sample's first slot ``v_base`` (head_dim stride
    ``stride_v8_d``): no key mask, keys past the sample are zeros that meet A = 0."""
    for start in range(start_n, end_n, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < k_len
        kt = _load_tile(k_base, offs_n, n_ok, stride_kt, offs_d, HEAD_DIM, MASKED, EVEN_D, True)
        if FP8:
            v = _load_padded_t(v_base, offs_n, offs_d, stride_v8_d, HEAD_DIM, EVEN_D)
        else:
            v = _load_tile(v_base, offs_n, n_ok, stride_vt, offs_d, HEAD_DIM, MASKED, EVEN_D, False)
        tile_scale = scale
        if FP8:  # dequantisation folded into the score scale (powers of two: exact)
            tile_scale = scale * (q_scale * tl.load(ks_base + start * num_heads))
        s = _dot(q, kt, None, DOT_PRECISION, UPCAST) * tile_scale
        if PACKED:  # noqa: SIM108 (constexpr branch: only one side is compiled)
            p = _act_packed(s, PACKED)
        else:
            p = _act(s, ACT)
        if MASKED:
            visible = _visible(
                offs_m[:, None], offs_n[None, :], shift, q_len, k_len, left, right,
                HAS_LEFT, HAS_RIGHT,
            )  # fmt: skip
            p = tl.where(visible, p, 0.0)
        if FP8:
            a_scale, a_inv = _act_scale(tl.max(tl.abs(p), 1))
            a8 = _to_e4m3(p * a_inv[:, None], v.dtype, UPCAST)
            pv_scale = a_scale * tl.load(vs_base + start * num_heads)
            acc += _dot(a8, v, None, DOT_PRECISION, UPCAST) * pv_scale[:, None]
        else:
            acc = _dot(p.to(v.dtype), v, acc, DOT_PRECISION, UPCAST)
    return acc


@triton.jit
def _load_padded_t(base, rows, offs_d, stride_d, HEAD_DIM, EVEN_D):
    """Rows x head_dim of an FP8 copy stored tokens-contiguous in whole zero-padded blocks
    (``base``: the sample's first slot, token stride 1): no row mask, so the loads along the
    tokens are 16-byte vectors; rows past the sample are zeros."""
    ptrs = base + rows.to(tl.int64)[:, None] + offs_d[None, :] * stride_d
    if EVEN_D:  # noqa: SIM108 (constexpr branch in a Triton kernel)
        tile = tl.load(ptrs)
    else:
        tile = tl.load(ptrs, mask=(offs_d < HEAD_DIM)[None, :], other=0.0)
    return tile


@triton.jit
def _kv_tile(desc, base, start, offs_n, k_len, stride, offs_d, HEAD_DIM, EVEN_D, TRANS, KV_TMA):
    """One key tile (transposed with TRANS) whose rows past ``k_len`` are zeros: a TMA load
    through the item's descriptor (which ends at the sample's last key), or a masked load."""
    if KV_TMA:
        tile = desc.load([start, 0])
        if TRANS:
            tile = tl.trans(tile)
    else:
        rows = start + offs_n
        tile = _load_tile(base, rows, rows < k_len, stride, offs_d, HEAD_DIM, True, EVEN_D, TRANS)
    return tile


@triton.jit
def _fwd_p(s, ACT: tl.constexpr, PACKED: tl.constexpr):
    if PACKED:  # noqa: SIM108 (constexpr branch: only one side is compiled)
        p = _act_packed(s, PACKED)
    else:
        p = _act(s, ACT)
    return p


@triton.jit
def _fwd_one_loop(
    acc, q, k_desc, v_desc, k_base, v_base, stride_kt, stride_vt, lo, hi, offs_d, k_len, scale,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, ACT: tl.constexpr, EVEN_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, PACKED: tl.constexpr,
    KV_TMA: tl.constexpr, PIPELINE: tl.constexpr,
):  # fmt: skip
    """Unwindowed forward over key tiles [lo, hi) in one loop and without a score mask: key
    rows past ``k_len`` load as zeros, so their scores are 0, act(0) = 0 for every activation,
    and their V rows are 0 too (rows past ``q_len`` are never stored). ``PIPELINE``: the next
    tile's ``Q K^T`` is issued before this tile's activation (software pipelining by hand)."""
    offs_n = tl.arange(0, BLOCK_N)
    if PIPELINE:
        if hi > lo:
            kt = _kv_tile(k_desc, k_base, lo, offs_n, k_len, stride_kt, offs_d, HEAD_DIM, EVEN_D,
                          True, KV_TMA)  # fmt: skip
            s = _dot(q, kt, None, DOT_PRECISION, UPCAST) * scale
            for start in range(lo, hi - BLOCK_N, BLOCK_N):
                kt = _kv_tile(k_desc, k_base, start + BLOCK_N, offs_n, k_len, stride_kt, offs_d,
                              HEAD_DIM, EVEN_D, True, KV_TMA)  # fmt: skip
                v = _kv_tile(v_desc, v_base, start, offs_n, k_len, stride_vt, offs_d, HEAD_DIM,
                             EVEN_D, False, KV_TMA)  # fmt: skip
                s_next = _dot(q, kt, None, DOT_PRECISION, UPCAST) * scale
                p = _fwd_p(s, ACT, PACKED)
                acc = _dot(p.to(v.dtype), v, acc, DOT_PRECISION, UPCAST)
                s = s_next
            v = _kv_tile(v_desc, v_base, hi - BLOCK_N, offs_n, k_len, stride_vt, offs_d, HEAD_DIM,
                         EVEN_D, False, KV_TMA)  # fmt: skip
            p = _fwd_p(s, ACT, PACKED)
            acc = _dot(p.to(v.dtype), v, acc, DOT_PRECISION, UPCAST)
    else:
        for start in range(lo, hi, BLOCK_N):
            kt = _kv_tile(k_desc, k_base, start, offs_n, k_len, stride_kt, offs_d, HEAD_DIM,
                          EVEN_D, True, KV_TMA)  # fmt: skip
            v = _kv_tile(v_desc, v_base, start, offs_n, k_len, stride_vt, offs_d, HEAD_DIM,
                         EVEN_D, False, KV_TMA)  # fmt: skip
            s = _dot(q, kt, None, DOT_PRECISION, UPCAST) * scale
            p = _fwd_p(s, ACT, PACKED)
            acc = _dot(p.to(v.dtype), v, acc, DOT_PRECISION, UPCAST)
    return acc


@triton.jit
def _fwd_ws_loop(
    acc, q, k_desc, v_desc, k_row, col, lo, hi, k_len, scale,
    BLOCK_N: tl.constexpr, ACT: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    PACKED: tl.constexpr,
):  # fmt: skip
    """Unwindowed forward over key tiles [lo, hi) with Triton's automatic warp specialisation
    (Hopper: producer warps issue the TMA loads, consumer warpgroups the MMAs and activation).
    K and V come through whole-tensor descriptors made once per program (per-item descriptors
    remade in a persistent loop gave wrong results on triton 3.6), so rows past the sample's
    end belong to the next sample: their P is set to 0. The interpreter ignores the flag."""
    offs_n = tl.arange(0, BLOCK_N)
    for start in tl.range(lo, hi, BLOCK_N, warp_specialize=True):
        kt = k_desc.load([k_row + start, col]).T
        v = v_desc.load([k_row + start, col])
        s = _dot(q, kt, None, DOT_PRECISION, UPCAST) * scale
        p = tl.where((start + offs_n)[None, :] < k_len, _fwd_p(s, ACT, PACKED), 0.0)
        acc = _dot(p.to(v.dtype), v, acc, DOT_PRECISION, UPCAST)
    return acc


# The item and row counts depend on the batch: unspecialised, one compiled kernel serves every
# batch of a configuration (Triton would compile a variant per divisibility by 16 of each).
@triton.jit(do_not_specialize=["num_items", "q_rows", "k_rows"])
def gdpa_fwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, items_ptr, num_items,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    left, right, scale, part_ptr, stride_pt, stride_ph,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, ACT: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    NORMALIZE: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    PACKED: tl.constexpr, ONE_LOOP: tl.constexpr = False, KV_TMA: tl.constexpr = False,
    PIPELINE: tl.constexpr = False, WARP_SPECIALIZE: tl.constexpr = False, q_rows=0, k_rows=0,
    FP8: tl.constexpr = False, qs_ptr=0, ks_ptr=0, vs_ptr=0, num_heads=1, stride_v8_d=0,
):  # fmt: skip
    """Items are (query tile, head); each loops over the key tiles its rows see.

    ``ONE_LOOP`` (no window): one mask-free loop instead of the three phases (see
    :func:`_fwd_one_loop`), with ``KV_TMA`` K and V come through per-item TMA descriptors
    that end at the sample's last key, and ``PIPELINE`` overlaps the next tile's ``Q K^T``
    with this tile's activation by hand. ``WARP_SPECIALIZE`` (one loop, contiguous (T, H, D)
    inputs with ``q_rows`` / ``k_rows`` rows, HEAD_DIM a power of two): see
    :func:`_fwd_ws_loop`; Q is loaded through a whole-tensor descriptor too.

    ``FP8`` (phased loop only: the host turns the others off): q, k, v are E4M3 with per-token
    power-of-two scales ``qs_ptr`` / ``ks_ptr`` / ``vs_ptr`` ``(tokens, heads)``; v is stored
    keys-contiguous in whole 128-slot blocks (the item's ``k_slot``; head_dim stride
    ``stride_v8_d``)."""
    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D
    USE_ONE_LOOP: tl.constexpr = ONE_LOOP and not HAS_LEFT and not HAS_RIGHT
    WS: tl.constexpr = WARP_SPECIALIZE and USE_ONE_LOOP
    offs_d = tl.arange(0, BLOCK_D)
    q_all = None
    k_all = None
    v_all = None
    if WS:  # (T, H * D) views, made once: Hopper's partitioner takes descriptor loads only
        q_all = tl.make_tensor_descriptor(
            q_ptr, shape=[q_rows, stride_qt], strides=[stride_qt, 1], block_shape=[BLOCK_M, BLOCK_D]
        )
        k_all = tl.make_tensor_descriptor(
            k_ptr, shape=[k_rows, stride_kt], strides=[stride_kt, 1], block_shape=[BLOCK_N, BLOCK_D]
        )
        v_all = tl.make_tensor_descriptor(
            v_ptr, shape=[k_rows, stride_vt], strides=[stride_vt, 1], block_shape=[BLOCK_N, BLOCK_D]
        )
    for idx in range(tl.program_id(0), num_items, tl.num_programs(0)):
        info = items_ptr + idx * _W  # items < 2**27: int32 is enough
        q_start = tl.load(info)
        q_len = tl.load(info + 1).to(tl.int32)
        k_start = tl.load(info + 2)
        k_len = tl.load(info + 3).to(tl.int32)
        m0 = tl.load(info + 4).to(tl.int32)
        head = tl.load(info + 6)
        shift = k_len - q_len

        offs_m = m0 + tl.arange(0, BLOCK_M)
        m_ok = offs_m < q_len
        q_base = q_ptr + q_start * stride_qt + head * stride_qh
        if WS:  # rows past the sample's end are other queries: never stored
            q = q_all.load([(q_start + m0).to(tl.int32), (head * HEAD_DIM).to(tl.int32)])
        else:
            q = _load_tile(q_base, offs_m, m_ok, stride_qt, offs_d, HEAD_DIM, True, EVEN_D, False)
        k_base = k_ptr + k_start * stride_kt + head * stride_kh
        v_base = v_ptr + k_start * stride_vt + head * stride_vh
        lo_t, full_lo, full_hi, hi_t = _key_ranges(
            m0, shift, q_len, k_len, left, right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT
        )
        range_lo, range_hi, dst_start, to_partial = _range_of(info)
        lo_t, full_lo, full_hi, hi_t = _clip_ranges(
            lo_t, full_lo, full_hi, hi_t, range_lo, range_hi
        )
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        q_scale8 = 1.0
        ks_base = ks_ptr
        vs_base = vs_ptr
        if FP8:
            q_scale8 = tl.load(qs_ptr + (q_start + m0) * num_heads + head).to(tl.float32)
            ks_base = ks_ptr + k_start * num_heads + head
            vs_base = vs_ptr + k_start * num_heads + head
            v_base = v_ptr + tl.multiple_of(tl.load(info + 12), 128) + head * stride_vh
        if WS:
            acc = _fwd_ws_loop(
                acc, q, k_all, v_all, k_start.to(tl.int32), (head * HEAD_DIM).to(tl.int32),
                lo_t, hi_t, k_len, scale, BLOCK_N, ACT, DOT_PRECISION, UPCAST, PACKED,
            )  # fmt: skip
        elif USE_ONE_LOOP:
            k_desc = None
            v_desc = None
            if KV_TMA:  # rows past the sample's end read as zeros
                rows = tl.maximum(k_len, 1)
                k_desc = tl.make_tensor_descriptor(
                    k_base, shape=[rows, HEAD_DIM], strides=[stride_kt, 1],
                    block_shape=[BLOCK_N, BLOCK_D],
                )  # fmt: skip
                v_desc = tl.make_tensor_descriptor(
                    v_base, shape=[rows, HEAD_DIM], strides=[stride_vt, 1],
                    block_shape=[BLOCK_N, BLOCK_D],
                )  # fmt: skip
            acc = _fwd_one_loop(
                acc, q, k_desc, v_desc, k_base, v_base, stride_kt, stride_vt, lo_t, hi_t, offs_d,
                k_len, scale, HEAD_DIM, BLOCK_N, ACT, EVEN_D, DOT_PRECISION, UPCAST, PACKED,
                KV_TMA, PIPELINE,
            )  # fmt: skip
        else:
            acc = _fwd_inner(
                acc, q, k_base, v_base, stride_kt, stride_vt, lo_t, full_lo, offs_m, offs_d,
                shift, q_len, k_len, left, right, scale,
                HEAD_DIM, BLOCK_N, ACT, True, HAS_LEFT, HAS_RIGHT, EVEN_D, DOT_PRECISION, UPCAST,
                PACKED,
                FP8=FP8, q_scale=q_scale8, ks_base=ks_base, vs_base=vs_base, num_heads=num_heads,
                stride_v8_d=stride_v8_d,
            )  # fmt: skip
            acc = _fwd_inner(
                acc, q, k_base, v_base, stride_kt, stride_vt, full_lo, full_hi, offs_m, offs_d,
                shift, q_len, k_len, left, right, scale,
                HEAD_DIM, BLOCK_N, ACT, False, HAS_LEFT, HAS_RIGHT, EVEN_D, DOT_PRECISION, UPCAST,
                PACKED,
                FP8=FP8, q_scale=q_scale8, ks_base=ks_base, vs_base=vs_base, num_heads=num_heads,
                stride_v8_d=stride_v8_d,
            )  # fmt: skip
            acc = _fwd_inner(
                acc, q, k_base, v_base, stride_kt, stride_vt, full_hi, hi_t, offs_m, offs_d,
                shift, q_len, k_len, left, right, scale,
                HEAD_DIM, BLOCK_N, ACT, True, HAS_LEFT, HAS_RIGHT, EVEN_D, DOT_PRECISION, UPCAST,
                PACKED,
                FP8=FP8, q_scale=q_scale8, ks_base=ks_base, vs_base=vs_base, num_heads=num_heads,
                stride_v8_d=stride_v8_d,
            )  # fmt: skip
        if NORMALIZE:
            acc = acc * (1.0 / tl.maximum(k_len, 1).to(tl.float32))
        # Only PMA items go to the partials (never one-loop); a branch between two stores after
        # the loop stops Hopper's warp specialisation.
        if to_partial and not WS:
            _store_tile(
                part_ptr + dst_start * stride_pt + head * stride_ph, offs_m, m_ok, stride_pt,
                offs_d, acc, HEAD_DIM, EVEN_D,
            )  # fmt: skip
        else:
            _store_tile(
                o_ptr + dst_start * stride_ot + head * stride_oh, offs_m, m_ok, stride_ot,
                offs_d, acc.to(o_ptr.dtype.element_ty), HEAD_DIM, EVEN_D,
            )  # fmt: skip


@triton.jit(do_not_specialize=["num_items"])
def gdpa_fwd_short_kv_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, items_ptr, num_items,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    left, right, scale, part_ptr, stride_pt, stride_ph,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_KV: tl.constexpr,
    BLOCK_D: tl.constexpr, ACT: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    NORMALIZE: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    PACKED: tl.constexpr, MASK_FREE: tl.constexpr = False,
):  # fmt: skip
    """Short KV (every sample has <= BLOCK_KV keys): items are (sample, run of query tiles,
    head). The whole K and V of the sample are loaded once and stay on chip while the item's
    query tiles stream past them. ``MASK_FREE`` (no window): no score mask, since keys past
    ``k_len`` load as zeros (score 0, act(0) = 0, V row 0) and rows past ``q_len`` are never
    stored."""
    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D
    SCORE_MASK: tl.constexpr = HAS_LEFT or HAS_RIGHT or not MASK_FREE
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_KV)
    for idx in range(tl.program_id(0), num_items, tl.num_programs(0)):
        info = items_ptr + idx * _W  # items < 2**27: int32 is enough
        q_start = tl.load(info)
        q_len = tl.load(info + 1).to(tl.int32)
        k_start = tl.load(info + 2)
        k_len = tl.load(info + 3).to(tl.int32)
        row0 = tl.load(info + 4).to(tl.int32)
        head = tl.load(info + 6)
        row_end = tl.load(info + 7).to(tl.int32)
        dst_start = tl.load(info + 10)
        shift = k_len - q_len
        n_ok = offs_n < k_len
        kt = _load_tile(
            k_ptr + k_start * stride_kt + head * stride_kh, offs_n, n_ok, stride_kt, offs_d,
            HEAD_DIM, True, EVEN_D, True,
        )  # fmt: skip
        v = _load_tile(
            v_ptr + k_start * stride_vt + head * stride_vh, offs_n, n_ok, stride_vt, offs_d,
            HEAD_DIM, True, EVEN_D, False,
        )  # fmt: skip
        norm = 1.0
        if NORMALIZE:
            norm = 1.0 / tl.maximum(k_len, 1).to(tl.float32)
        q_base = q_ptr + q_start * stride_qt + head * stride_qh
        o_base = o_ptr + dst_start * stride_ot + head * stride_oh
        for m0 in range(row0, row_end, BLOCK_M):
            offs_m = m0 + tl.arange(0, BLOCK_M)
            m_ok = offs_m < q_len
            q = _load_tile(q_base, offs_m, m_ok, stride_qt, offs_d, HEAD_DIM, True, EVEN_D, False)
            s = _dot(q, kt, None, DOT_PRECISION, UPCAST) * scale
            if PACKED:  # noqa: SIM108 (constexpr branch: only one side is compiled)
                p = _act_packed(s, PACKED)
            else:
                p = _act(s, ACT)
            if SCORE_MASK:
                visible = _visible(
                    offs_m[:, None], offs_n[None, :], shift, q_len, k_len, left, right,
                    HAS_LEFT, HAS_RIGHT,
                )  # fmt: skip
                p = tl.where(visible, p, 0.0)
            acc = _dot(p.to(v.dtype), v, None, DOT_PRECISION, UPCAST) * norm
            _store_tile(
                o_base, offs_m, m_ok, stride_ot, offs_d, acc.to(o_ptr.dtype.element_ty),
                HEAD_DIM, EVEN_D,
            )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# PMA forward, streamed: one pipelined loop per program over an equal share of every
# (sample, head, key tile) step (no window or causal mask).

# Columns of a stream step row (int64): first key row of the tile, valid keys in it, head,
# flush row (-1: keep accumulating; else the output row, or partial slot row, of the segment's
# first query), to_partial (the flush goes to the float32 partial buffer), k_len (for 1/L_k),
# two unused.
STREAM_WIDTH = 8
_SW = tl.constexpr(STREAM_WIDTH)


@triton.jit
def gdpa_pma_fwd_stream_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, part_ptr, steps_ptr, bounds_ptr, num_queries,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, ACT: tl.constexpr, NORMALIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """Program ``p`` runs steps ``[bounds[p], bounds[p + 1])`` of the host-built step list
    (sample-major, then head, then key tile), so every program gets the same number of key
    tiles and the loads of the next tile overlap this one's math across segment boundaries. A
    step with a flush row ends its (sample, head) segment on this program: the accumulator
    goes to the output, or to a float32 partial slot when the segment is shared with the next
    or previous program (``gdpa_pma_combine_kernel`` sums those in a fixed order)."""
    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D
    offs_d = tl.arange(0, BLOCK_D)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    m_ok = offs_m < num_queries
    pid = tl.program_id(0)
    begin = tl.load(bounds_ptr + pid)
    end = tl.load(bounds_ptr + pid + 1)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for step in range(begin, end):
        info = steps_ptr + step * _SW
        k_row = tl.load(info).to(tl.int64)
        n_valid = tl.load(info + 1)
        head = tl.load(info + 2).to(tl.int64)
        flush = tl.load(info + 3)
        n_ok = offs_n < n_valid
        q = _load_tile(
            q_ptr + head * stride_qh, offs_m, m_ok, stride_qt, offs_d, HEAD_DIM, True, EVEN_D,
            False,
        )  # fmt: skip
        kt = _load_tile(
            k_ptr + k_row * stride_kt + head * stride_kh, offs_n, n_ok, stride_kt, offs_d,
            HEAD_DIM, True, EVEN_D, True,
        )  # fmt: skip
        v = _load_tile(
            v_ptr + k_row * stride_vt + head * stride_vh, offs_n, n_ok, stride_vt, offs_d,
            HEAD_DIM, True, EVEN_D, False,
        )  # fmt: skip
        s = _dot(q, kt, None, DOT_PRECISION, UPCAST) * scale
        p = tl.where(n_ok[None, :], _act(s, ACT), 0.0)
        acc = _dot(p.to(v.dtype), v, acc, DOT_PRECISION, UPCAST)
        if flush >= 0:
            result = acc
            if NORMALIZE:
                k_len = tl.load(info + 5)
                result = acc * (1.0 / tl.maximum(k_len, 1).to(tl.float32))
            if tl.load(info + 4) != 0:
                _store_tile(
                    part_ptr + flush.to(tl.int64) * HEAD_DIM, offs_m, m_ok, HEAD_DIM, offs_d,
                    result, HEAD_DIM, EVEN_D,
                )  # fmt: skip
            else:
                _store_tile(
                    o_ptr + flush.to(tl.int64) * stride_ot + head * stride_oh, offs_m, m_ok,
                    stride_ot, offs_d, result.to(o_ptr.dtype.element_ty), HEAD_DIM, EVEN_D,
                )  # fmt: skip
        acc = acc * (flush < 0).to(tl.float32)  # a flushed segment restarts from zero


@triton.jit
def gdpa_pma_combine_kernel(
    part_ptr, o_ptr, meta_ptr, num_queries, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Segments shared by several stream programs: ``out[row + i, head] = sum_c part[(slot +
    c) * Nq + i]`` for each ``meta`` entry ``[row, head, slot, count]``, in slot order (float32,
    deterministic). Grid: one program per entry."""
    meta = meta_ptr + tl.program_id(0).to(tl.int64) * 4
    row = tl.load(meta)
    head = tl.load(meta + 1)
    slot = tl.load(meta + 2)
    count = tl.load(meta + 3).to(tl.int32)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m < num_queries)[:, None] & (offs_d < HEAD_DIM)[None, :]
    tile = offs_m[:, None] * HEAD_DIM + offs_d[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for c in range(0, count):
        src = part_ptr + (slot + c) * num_queries * HEAD_DIM
        acc += tl.load(src + tile, mask=mask, other=0.0)
    dst = o_ptr + row * stride_ot + head * stride_oh
    ptrs = dst + offs_m.to(tl.int64)[:, None] * stride_ot + offs_d[None, :]
    tl.store(ptrs, acc.to(o_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------
# Backward.


@triton.jit
def _dkdv_inner(
    dk, dv, k, v, q_base, do_base, stride_qt, stride_dot, start_m, end_m, offs_n, offs_d,
    shift, q_len, k_len, left, right, scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, ACT: tl.constexpr, MASKED: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, EVEN_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, PACKED: tl.constexpr, NO_SCORE_MASK: tl.constexpr,
    dq_base=None, stride_dqt=0, dq_scale=1.0, FUSED_DQ: tl.constexpr = False,
):  # fmt: skip
    for start in range(start_m, end_m, BLOCK_M):
        offs_m = start + tl.arange(0, BLOCK_M)
        m_ok = offs_m < q_len
        qt = _load_tile(q_base, offs_m, m_ok, stride_qt, offs_d, HEAD_DIM, MASKED, EVEN_D, True)
        do = _load_tile(do_base, offs_m, m_ok, stride_dot, offs_d, HEAD_DIM, MASKED, EVEN_D, False)
        st = _dot(k, qt, None, DOT_PRECISION, UPCAST) * scale  # (keys, queries)
        dpt = _dot(v, tl.trans(do), None, DOT_PRECISION, UPCAST)
        if PACKED:
            pt, dst = _act_grad_packed(st, dpt, PACKED)
        else:
            pt, gt = _act_grad(st, ACT)
            dst = dpt * gt
        if MASKED and not NO_SCORE_MASK:
            visible = _visible(
                offs_m[None, :], offs_n[:, None], shift, q_len, k_len, left, right,
                HAS_LEFT, HAS_RIGHT,
            )  # fmt: skip
            pt = tl.where(visible, pt, 0.0)
            dst = tl.where(visible, dst, 0.0)
        dst = dst.to(qt.dtype)
        dv = _dot(pt.to(do.dtype), do, dv, DOT_PRECISION, UPCAST)
        dk = _dot(dst, tl.trans(qt), dk, DOT_PRECISION, UPCAST)
        if FUSED_DQ:  # this key tile's share of dQ rows, added in float32 (order not fixed)
            dq = _dot(tl.trans(dst), k, None, DOT_PRECISION, UPCAST) * dq_scale
            ptrs = dq_base + offs_m.to(tl.int64)[:, None] * stride_dqt + offs_d[None, :]
            if EVEN_D:  # noqa: SIM108 (constexpr branch in a Triton kernel)
                dq_ok = m_ok[:, None]
            else:
                dq_ok = m_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
            tl.atomic_add(ptrs, dq, mask=dq_ok, sem="relaxed")
    return dk, dv


@triton.jit(do_not_specialize=["num_items"])
def gdpa_bwd_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, dk_ptr, dv_ptr, items_ptr, num_items,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dkt, stride_dkh, stride_dvt, stride_dvh,
    left, right, scale, dkp_ptr, dvp_ptr, stride_pt, stride_ph,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, ACT: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    NORMALIZE: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    PACKED: tl.constexpr, ONE_LOOP: tl.constexpr = False,
    dq_ptr=None, stride_dqt=0, stride_dqh=0, FUSED_DQ: tl.constexpr = False,
):  # fmt: skip
    """Items are (key tile, head); each loops over the query tiles that see its keys and
    writes its dK, dV rows once (no atomics). ``FUSED_DQ``: the same loop also adds each
    tile's dQ rows into a zeroed float32 ``dq_ptr`` (atomics; no separate dQ kernel, S and dP
    computed once)."""
    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D
    USE_ONE_LOOP: tl.constexpr = ONE_LOOP and not HAS_LEFT and not HAS_RIGHT
    offs_d = tl.arange(0, BLOCK_D)
    for idx in range(tl.program_id(0), num_items, tl.num_programs(0)):
        info = items_ptr + idx * _W  # items < 2**27: int32 is enough
        q_start = tl.load(info)
        q_len = tl.load(info + 1).to(tl.int32)
        k_start = tl.load(info + 2)
        k_len = tl.load(info + 3).to(tl.int32)
        n0 = tl.load(info + 4).to(tl.int32)
        out_start = tl.load(info + 5)
        head = tl.load(info + 6)
        shift = k_len - q_len

        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < k_len
        k = _load_tile(
            k_ptr + k_start * stride_kt + head * stride_kh, offs_n, n_ok, stride_kt, offs_d,
            HEAD_DIM, True, EVEN_D, False,
        )  # fmt: skip
        v = _load_tile(
            v_ptr + k_start * stride_vt + head * stride_vh, offs_n, n_ok, stride_vt, offs_d,
            HEAD_DIM, True, EVEN_D, False,
        )  # fmt: skip
        q_base = q_ptr + q_start * stride_qt + head * stride_qh
        do_base = do_ptr + out_start * stride_dot + head * stride_doh
        lo_t, full_lo, full_hi, hi_t = _query_ranges(
            n0, shift, q_len, k_len, left, right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT
        )
        range_lo, range_hi, dst_start, to_partial = _range_of(info)
        lo_t, full_lo, full_hi, hi_t = _clip_ranges(
            lo_t, full_lo, full_hi, hi_t, range_lo, range_hi
        )
        dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        dq_base = dq_ptr
        dq_scale = scale
        if FUSED_DQ:
            dq_base = dq_ptr + q_start * stride_dqt + head * stride_dqh
            if NORMALIZE:
                dq_scale = scale / tl.maximum(k_len, 1).to(tl.float32)
        if USE_ONE_LOOP:  # every query tile in one loop, loads masked, no score mask
            dk, dv = _dkdv_inner(
                dk, dv, k, v, q_base, do_base, stride_qt, stride_dot, lo_t, hi_t, offs_n,
                offs_d, shift, q_len, k_len, left, right, scale,
                HEAD_DIM, BLOCK_M, ACT, True, HAS_LEFT, HAS_RIGHT, EVEN_D, DOT_PRECISION, UPCAST,
                PACKED, True, dq_base, stride_dqt, dq_scale, FUSED_DQ,
            )  # fmt: skip
        else:
            dk, dv = _dkdv_inner(
                dk, dv, k, v, q_base, do_base, stride_qt, stride_dot, lo_t, full_lo, offs_n, offs_d,
                shift, q_len, k_len, left, right, scale,
                HEAD_DIM, BLOCK_M, ACT, True, HAS_LEFT, HAS_RIGHT, EVEN_D, DOT_PRECISION, UPCAST,
                PACKED, False, dq_base, stride_dqt, dq_scale, FUSED_DQ,
            )  # fmt: skip
            dk, dv = _dkdv_inner(
                dk, dv, k, v, q_base, do_base, stride_qt, stride_dot, full_lo, full_hi, offs_n,
                offs_d, shift, q_len, k_len, left, right, scale,
                HEAD_DIM, BLOCK_M, ACT, False, HAS_LEFT, HAS_RIGHT, EVEN_D, DOT_PRECISION, UPCAST,
                PACKED, False, dq_base, stride_dqt, dq_scale, FUSED_DQ,
            )  # fmt: skip
            dk, dv = _dkdv_inner(
                dk, dv, k, v, q_base, do_base, stride_qt, stride_dot, full_hi, hi_t, offs_n, offs_d,
                shift, q_len, k_len, left, right, scale,
                HEAD_DIM, BLOCK_M, ACT, True, HAS_LEFT, HAS_RIGHT, EVEN_D, DOT_PRECISION, UPCAST,
                PACKED, False, dq_base, stride_dqt, dq_scale, FUSED_DQ,
            )  # fmt: skip
        dk_scale = scale
        if NORMALIZE:
            norm = 1.0 / tl.maximum(k_len, 1).to(tl.float32)
            dv = dv * norm
            dk_scale = scale * norm
        if to_partial:  # float32 partial sums over a query range, combined by the host
            p_off = dst_start * stride_pt + head * stride_ph
            _store_tile(
                dkp_ptr + p_off, offs_n, n_ok, stride_pt, offs_d, dk * dk_scale, HEAD_DIM, EVEN_D
            )
            _store_tile(dvp_ptr + p_off, offs_n, n_ok, stride_pt, offs_d, dv, HEAD_DIM, EVEN_D)
        else:
            _store_tile(
                dk_ptr + dst_start * stride_dkt + head * stride_dkh, offs_n, n_ok, stride_dkt,
                offs_d, (dk * dk_scale).to(dk_ptr.dtype.element_ty), HEAD_DIM, EVEN_D,
            )  # fmt: skip
            _store_tile(
                dv_ptr + dst_start * stride_dvt + head * stride_dvh, offs_n, n_ok, stride_dvt,
                offs_d, dv.to(dv_ptr.dtype.element_ty), HEAD_DIM, EVEN_D,
            )  # fmt: skip


@triton.jit
def _dq_inner(
    dq, q, do, k_base, v_base, stride_kt, stride_vt, start_n, end_n, offs_m, offs_d, shift,
    q_len, k_len, left, right, scale,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, ACT: tl.constexpr, MASKED: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, EVEN_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, PACKED: tl.constexpr, NO_SCORE_MASK: tl.constexpr,
):  # fmt: skip
    for start in range(start_n, end_n, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < k_len
        kt = _load_tile(k_base, offs_n, n_ok, stride_kt, offs_d, HEAD_DIM, MASKED, EVEN_D, True)
        vt = _load_tile(v_base, offs_n, n_ok, stride_vt, offs_d, HEAD_DIM, MASKED, EVEN_D, True)
        s = _dot(q, kt, None, DOT_PRECISION, UPCAST) * scale
        dp = _dot(do, vt, None, DOT_PRECISION, UPCAST)
        if PACKED:
            ds = _ds_packed(s, dp, PACKED)
        elif ACT == 5:
            ds = dp
        else:
            p, g = _act_grad(s, ACT)
            ds = dp * g
        if MASKED and not NO_SCORE_MASK:
            visible = _visible(
                offs_m[:, None], offs_n[None, :], shift, q_len, k_len, left, right,
                HAS_LEFT, HAS_RIGHT,
            )  # fmt: skip
            ds = tl.where(visible, ds, 0.0)
        dq = _dot(ds.to(kt.dtype), tl.trans(kt), dq, DOT_PRECISION, UPCAST)
    return dq


@triton.jit(do_not_specialize=["num_items"])
def gdpa_bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, dq_ptr, items_ptr, num_items,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dqt, stride_dqh,
    left, right, scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, ACT: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    NORMALIZE: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    PACKED: tl.constexpr, ONE_LOOP: tl.constexpr = False,
):  # fmt: skip
    """Items are (query tile, head); each loops over the key tiles its rows see (or the
    item's key range). dQ rows go to ``dst_start``: for PMA that is a partial buffer with one
    row block per (sample, key chunk) that the host sums (deterministic, no atomics)."""
    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D
    USE_ONE_LOOP: tl.constexpr = ONE_LOOP and not HAS_LEFT and not HAS_RIGHT
    offs_d = tl.arange(0, BLOCK_D)
    for idx in range(tl.program_id(0), num_items, tl.num_programs(0)):
        info = items_ptr + idx * _W  # items < 2**27: int32 is enough
        q_start = tl.load(info)
        q_len = tl.load(info + 1).to(tl.int32)
        k_start = tl.load(info + 2)
        k_len = tl.load(info + 3).to(tl.int32)
        m0 = tl.load(info + 4).to(tl.int32)
        out_start = tl.load(info + 5)
        head = tl.load(info + 6)
        shift = k_len - q_len

        offs_m = m0 + tl.arange(0, BLOCK_M)
        m_ok = offs_m < q_len
        q = _load_tile(
            q_ptr + q_start * stride_qt + head * stride_qh, offs_m, m_ok, stride_qt, offs_d,
            HEAD_DIM, True, EVEN_D, False,
        )  # fmt: skip
        do = _load_tile(
            do_ptr + out_start * stride_dot + head * stride_doh, offs_m, m_ok, stride_dot,
            offs_d, HEAD_DIM, True, EVEN_D, False,
        )  # fmt: skip
        k_base = k_ptr + k_start * stride_kt + head * stride_kh
        v_base = v_ptr + k_start * stride_vt + head * stride_vh
        lo_t, full_lo, full_hi, hi_t = _key_ranges(
            m0, shift, q_len, k_len, left, right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT
        )
        range_lo, range_hi, dst_start, _ = _range_of(info)
        lo_t, full_lo, full_hi, hi_t = _clip_ranges(
            lo_t, full_lo, full_hi, hi_t, range_lo, range_hi
        )
        dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        if USE_ONE_LOOP:  # every key tile in one loop, loads masked, no score mask
            dq = _dq_inner(
                dq, q, do, k_base, v_base, stride_kt, stride_vt, lo_t, hi_t, offs_m, offs_d,
                shift, q_len, k_len, left, right, scale,
                HEAD_DIM, BLOCK_N, ACT, True, HAS_LEFT, HAS_RIGHT, EVEN_D, DOT_PRECISION, UPCAST,
                PACKED, True,
            )  # fmt: skip
        else:
            dq = _dq_inner(
                dq, q, do, k_base, v_base, stride_kt, stride_vt, lo_t, full_lo, offs_m, offs_d,
                shift, q_len, k_len, left, right, scale,
                HEAD_DIM, BLOCK_N, ACT, True, HAS_LEFT, HAS_RIGHT, EVEN_D, DOT_PRECISION, UPCAST,
                PACKED, False,
            )  # fmt: skip
            dq = _dq_inner(
                dq, q, do, k_base, v_base, stride_kt, stride_vt, full_lo, full_hi, offs_m, offs_d,
                shift, q_len, k_len, left, right, scale,
                HEAD_DIM, BLOCK_N, ACT, False, HAS_LEFT, HAS_RIGHT, EVEN_D, DOT_PRECISION, UPCAST,
                PACKED, False,
            )  # fmt: skip
            dq = _dq_inner(
                dq, q, do, k_base, v_base, stride_kt, stride_vt, full_hi, hi_t, offs_m, offs_d,
                shift, q_len, k_len, left, right, scale,
                HEAD_DIM, BLOCK_N, ACT, True, HAS_LEFT, HAS_RIGHT, EVEN_D, DOT_PRECISION, UPCAST,
                PACKED, False,
            )  # fmt: skip
        dq_scale = scale
        if NORMALIZE:
            dq_scale = scale / tl.maximum(k_len, 1).to(tl.float32)
        _store_tile(
            dq_ptr + dst_start * stride_dqt + head * stride_dqh, offs_m, m_ok, stride_dqt,
            offs_d, (dq * dq_scale).to(dq_ptr.dtype.element_ty), HEAD_DIM, EVEN_D,
        )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Deterministic combine of partial results.


@triton.jit
def segment_sum_kernel(
    src_ptr, dst_ptr, meta_ptr, width, stride_src, stride_dst, BLOCK: tl.constexpr,
):  # fmt: skip
    """``dst[row] = sum_{c < count} src[first + c * step]`` for each ``meta`` entry ``[row,
    first, count, step]``, rows of ``width`` elements, summed in float32 in a fixed order
    (deterministic). Grid: (meta entries, column blocks)."""
    meta = meta_ptr + tl.program_id(0).to(tl.int64) * 4
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    row = tl.load(meta)
    first = tl.load(meta + 1)
    count = tl.load(meta + 2).to(tl.int32)
    step = tl.load(meta + 3)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for c in range(0, count):
        src = src_ptr + (first + c * step) * stride_src
        acc += tl.load(src + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(dst_ptr + row * stride_dst + cols, acc.to(dst_ptr.dtype.element_ty), mask=ok)
