"""Triton kernels of jagged flash attention (forward, backward preprocess, dK/dV, dQ).

Loaded by :mod:`gem_kernels.jfa_triton` through ``importlib`` (never imported directly): Triton
decides at decoration time whether ``@triton.jit`` compiles or interprets, so the loader
executes this file once per mode (``TRITON_INTERPRET`` set or not) under distinct module names.

Conventions shared by the kernels:

* Every program handles one ``(tile, head)`` pair; ``pid = tile * num_heads + head`` so the
  heads of one tile run side by side and the host's longest-first tile order is kept.
* A tile table row (int64) is ``[q_start, q_len, k_start, k_len, tile_start, bias_start, 0, 0]``.
* Query ``i`` of a sample sits at the aligned position ``p = i + shift`` with
  ``shift = k_len - q_len`` and sees keys ``p - left <= j <= p + right`` (causal is
  ``right = 0``); ``HAS_LEFT`` / ``HAS_RIGHT`` are false for unbounded sides.
* Scores are kept in the log2 domain (``exp2``): ``s2 = log2(e) * (scale * q.k + bias)``; the
  saved log-sum-exp ``lse`` is in the same domain and is ``+inf`` for rows with no visible key,
  which makes every recomputed probability of such rows exactly 0.
* Each KV (or Q) loop runs in three phases: masked tiles, tiles fully inside the visible band
  (no mask arithmetic), masked tiles. Tiles outside the band are never visited.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634

# FP8: P enters its E4M3 cast times 2^8 (``reference.FP8_P_SCALE``): 1.0 exact, the top binades
# at full precision.
_P8_LOG2 = tl.constexpr(8.0)

# Kernels do not specialise on the integer arguments that depend on the batch's token or pair
# counts (Triton would otherwise compile a new variant whenever their divisibility by 16
# changes): one compiled kernel serves every batch of a configuration.


@triton.jit
def _dot(a, b, acc, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    # UPCAST: the Triton 3.8 interpreter multiplies bfloat16 operands wrongly; fp32 is exact.
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=DOT_PRECISION)


@triton.jit
def _to_e4m3(x, dtype, INTERPRETED: tl.constexpr):
    """float32 ``x`` (``|x|`` at most 448) cast to E4M3 ``dtype``, rounded to nearest even.

    ``INTERPRETED`` (the kernels' ``UPCAST``, set only under the interpreter): the Triton 3.8
    interpreter's float32 -> float8 cast loses the carry of a mantissa round-up into the exponent
    (125.7 -> 64) and rounds ties away from zero, so the value is first rounded to an E4M3 value
    in float32 (Veltkamp's split to 4 significant bits; below 2^-6, E4M3's subnormal spacing
    2^-9 via the float32 spacing at 2^14), which the cast then keeps exactly. The magnitude is
    rounded and the sign put back (the subnormal trick needs |x| + 2^14 inside [2^14, 2^15)).
    Compiled kernels use the hardware's round-to-nearest-even cast. Shared with the GDPA
    kernels (``_gdpa_kernels.py`` loads it from this file in the same mode)."""
    if INTERPRETED:
        a = tl.abs(x)
        t = a * 1048577.0  # 2^20 + 1: keeps 24 - 20 = 4 significant bits
        normal = t - (t - a)
        tiny = (a + 16384.0) - 16384.0
        a = tl.where(a < 0.015625, tiny, normal)
        x = tl.where(x < 0.0, -a, a)
    return x.to(dtype)


@triton.jit
def _mask_tile(tile, rows, start, BLOCK_N: tl.constexpr, shift, k_len, left, right,
               HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, fill):  # fmt: skip
    """A forward or dQ ``tile`` (sample-local query ``rows`` x the BLOCK_N keys from
    ``start``) with the pairs outside the mask set to ``fill``: keys past the sample and
    outside each row's window. The tile-local key index meets per-row bounds, so the loop's
    key offset stays out of the per-score compares (with it they ran in 64 bits), and rows
    past the sample are left as they are (never stored; the dQ kernel's have p = 0)."""
    j = tl.arange(0, BLOCK_N)[None, :]
    end = k_len - start
    if HAS_RIGHT:
        end = tl.minimum(end, rows + (shift + right + 1 - start))
    mask = j < end
    if HAS_LEFT:
        mask = mask & (j >= rows + (shift - left - start))
    return tl.where(mask, tile, fill)


@triton.jit
def _mask_tile_t(tile, keys, start, BLOCK_M: tl.constexpr, shift, k_len, left, right,
                 HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, fill):  # fmt: skip
    """dK/dV's transposed ``tile`` (sample-local ``keys`` x the BLOCK_M queries from ``start``)
    with the pairs outside the mask set to ``fill``: keys past the sample (they would reach the
    ``rel_pos_bias`` gradient) and pairs outside the window, as :func:`_mask_tile` with per-key
    bounds. Queries past the sample have p = 0 already (their lse loads as inf)."""
    j = tl.arange(0, BLOCK_M)[None, :]
    first = tl.where(keys < k_len, 0, BLOCK_M)
    if HAS_RIGHT:
        first = tl.maximum(first, keys - (shift + right + start))
    mask = j >= first
    if HAS_LEFT:
        mask = mask & (j <= keys + (left - shift - start))
    return tl.where(mask, tile, fill)


@triton.jit
def _scores(
    a,
    b,
    qk_scale,
    rel_value,
    rel_tile,
    jb_tile,
    HAS_REL: tl.constexpr,
    REL_CONST: tl.constexpr,
    HAS_JAGGED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    SCALED: tl.constexpr = True,
):
    """Scores ``log2(e) * (scale * a @ b + bias)`` of a tile (``qk_scale`` = log2(e) * scale),
    or without ``SCALED`` the same before the multiply by ``qk_scale``.

    The bias tiles (``rel_tile`` from the ``rel_pos_bias`` strip, ``jb_tile`` from the jagged
    bias, both raw values loaded one iteration ahead by the caller) enter as the accumulator of
    the dot, in units of ``1 / scale``: their loads then convert to the dot's register layout
    once, and everything after the dot stays in that layout (adding them after the dot made the
    compiler run the softmax in the load's layout as well, twice the exponentials plus register
    spills). ``REL_CONST``: every pair of the tile falls in one clamped bucket whose value,
    pre-divided by the scale on the host, is ``rel_value``: no load at all.
    """
    inv_scale = 1.4426950408889634 / qk_scale
    if HAS_REL and not REL_CONST:
        bias = rel_tile.to(tl.float32)
        if HAS_JAGGED:
            bias += jb_tile.to(tl.float32)
        s = _dot(a, b, bias * inv_scale, DOT_PRECISION, UPCAST)
    elif HAS_JAGGED:
        s = _dot(a, b, jb_tile.to(tl.float32) * inv_scale, DOT_PRECISION, UPCAST)
    else:
        s = _dot(a, b, None, DOT_PRECISION, UPCAST)
    if HAS_REL and REL_CONST:
        s += rel_value
    if SCALED:
        s = s * qk_scale
    return s


@triton.jit
def _strip_load(rs_base, g, offsets, num_buckets, live, STRIP_P: tl.constexpr,
                STRIP_W: tl.constexpr):  # fmt: skip
    """The ``rel_pos_bias`` tile whose (row 0, column 0) pair has unclamped bucket ``g``, from
    the host's strip ``A[y, x] = table[clamp(y - STRIP_P - x)]`` (``rs_base`` is its row
    ``STRIP_P``; ``offsets`` = tile row * STRIP_W + tile column, int32). A tile's values depend
    on g only while some pair's bucket lies inside the table, so g is clamped to the range
    where they do, which keeps every row inside the strip: one plain 2-D load instead of a
    per-element bucket computation and gather. ``live`` false (prefetch past the last tile):
    nothing is loaded and the result is never used."""
    g = tl.minimum(tl.maximum(g, -STRIP_P), num_buckets + STRIP_W - 2)
    return tl.load(rs_base + g * STRIP_W + offsets, mask=live)


@triton.jit
def _jagged_load(tile_ptr, offsets, cols, limit, live, MASKED: tl.constexpr):
    """A tile of the jagged bias: ``tile_ptr`` (a scalar pointer, advanced per iteration) plus
    loop-invariant int32 ``offsets`` (rows already clamped into the sample by the caller, so
    no row mask); ``live`` false (prefetch past the last tile) loads zeros. Only ``MASKED``
    tiles test the tile's columns ``cols`` against ``limit``; the other tiles lie inside the
    sample, so their loads carry one scalar predicate.

    Called one loop iteration ahead of its use: the load is plain global memory (two-byte
    elements at any alignment cannot go through the asynchronous copy pipeline), so issuing it
    early hides its latency behind the current iteration's dots.
    """
    if MASKED:
        return tl.load(tile_ptr + offsets, mask=(cols < limit) & live, other=0.0)
    # No ``other``: a dead prefetch is never used, and zeroing the registers first costs one
    # instruction per element.
    return tl.load(tile_ptr + offsets, mask=live)


@triton.jit
def _rel_const_split(lo, hi, near, far, BLOCK: tl.constexpr):
    """Split the BLOCK-aligned range [lo, hi) at BLOCK-aligned points a <= b: tiles before
    ``near`` (exclusive end, rounded down) and from ``far`` on (rounded up) are constant-bucket
    tiles; the caller decides which side is which."""
    a = (tl.maximum(near, 0) // BLOCK) * BLOCK
    a = tl.minimum(tl.maximum(a, lo), hi)
    b = ((tl.maximum(far, 0) + BLOCK - 1) // BLOCK) * BLOCK
    b = tl.minimum(tl.maximum(b, a), hi)
    return a, b


@triton.jit
def _zero_bias_grad(base, rows_left, start_n, end_n, k_len, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr):  # fmt: skip
    """Zeros into the jagged-bias gradient of a query tile's rows (``base`` is its row 0),
    columns ``[start_n, end_n)``: the pairs the tile never visits (outside its window or
    causal band). With these, every element of the gradient is written by a kernel and the
    buffer needs no zero-fill pass."""
    rows = tl.arange(0, BLOCK_M)[:, None]
    zeros = tl.zeros([BLOCK_M, BLOCK_N], dtype=base.dtype.element_ty)
    end_n = tl.minimum(end_n, k_len)
    for start in range(start_n, end_n, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)[None, :]
        tl.store(base + (rows * k_len + cols), zeros, mask=(rows < rows_left) & (cols < end_n))


# ---------------------------------------------------------------------------------------------
# Forward.


@triton.jit
def _fwd_inner(
    acc,
    l_i,
    m_i,
    q,
    k_base,
    v_base,
    stride_kt,
    stride_vt,
    stride_vd,
    start_n,
    end_n,
    offs_m,
    offs_d,
    shift,
    q_len,
    k_len,
    left,
    right,
    qk_scale,
    rs_base,
    num_buckets,
    rel_value,
    jb_base,
    m0,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MASKED: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    HAS_REL: tl.constexpr,
    REL_CONST: tl.constexpr,
    HAS_JAGGED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    STRIP_P: tl.constexpr,
    STRIP_W: tl.constexpr,
    mask_lo=0,
    mask_hi=0,
    ONE_LOOP: tl.constexpr = False,
    FP8: tl.constexpr = False,
    q_scale=1.0,
    ks_base=0,
    vs_base=0,
    num_heads=1,
):
    """Key tiles [start_n, end_n): ``MASKED`` tiles test every score against the mask;
    ``ONE_LOOP`` (unbiased calls) runs all of a query tile's key tiles in one loop and masks
    only those outside [mask_lo, mask_hi), so the diagonal and partial tiles are loaded with
    the others instead of each starting (and draining) a pipelined loop of its own.

    ``FP8``: q, k and v are E4M3 (v stored keys-contiguous, the K-major operand Hopper's FP8
    MMA needs for P V, in whole zero-padded blocks from the sample's first slot ``v_base``);
    ``q_scale`` is the query tile's power-of-two scale, ``ks_base`` /
    ``vs_base`` point at the per-token key / value scales (token stride ``num_heads``): every
    key tile lies inside one quantisation block, so its scale is one scalar."""
    d_ok = offs_d < HEAD_DIM
    jb_next = 0.0
    rel_next = 0.0
    HAS_BAND: tl.constexpr = HAS_REL and not REL_CONST
    if HAS_JAGGED:
        rows_local = (offs_m - m0)[:, None]
        # Rows past the sample read row 0 (their scores are never stored): no row mask.
        row_offsets = tl.where(rows_local < q_len - m0, rows_local, 0) * k_len
        tile_offsets = row_offsets + tl.arange(0, BLOCK_N)[None, :]
        jb_next = _jagged_load(
            jb_base + start_n, tile_offsets, (start_n + tl.arange(0, BLOCK_N))[None, :], k_len,
            start_n < end_n, MASKED,
        )  # fmt: skip
    if HAS_BAND:
        # Bucket of (query m0 + r, key start + c): g0 - start + r - c.
        g0 = m0 + shift + num_buckets // 2
        strip_offsets = (offs_m - m0)[:, None] * STRIP_W + tl.arange(0, BLOCK_N)[None, :]
        rel_next = _strip_load(
            rs_base, g0 - start_n, strip_offsets, num_buckets, start_n < end_n, STRIP_P, STRIP_W
        )
    P_LOG2: tl.constexpr = _P8_LOG2 if FP8 else 0.0  # log2 of P's scale
    # FP8: inside the loop acc is in units of the current value tile's scale, so that P V
    # accumulates into it in the MMA (no second register tile, no multiply-add per element);
    # it enters and leaves in plain units. Exact while a sample's value blocks have scales
    # within 2^100 of each other.
    v_unit = 1.0
    for start in range(start_n, end_n, BLOCK_N):
        jb_tile = jb_next
        rel_tile = rel_next
        if HAS_JAGGED:
            jb_next = _jagged_load(
                jb_base + (start + BLOCK_N), tile_offsets,
                (start + BLOCK_N + tl.arange(0, BLOCK_N))[None, :], k_len,
                start + BLOCK_N < end_n, MASKED,
            )  # fmt: skip
        if HAS_BAND:
            rel_next = _strip_load(
                rs_base, g0 - start - BLOCK_N, strip_offsets, num_buckets,
                start + BLOCK_N < end_n, STRIP_P, STRIP_W,
            )  # fmt: skip
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < k_len
        rows64 = offs_n.to(tl.int64)
        if MASKED or ONE_LOOP:
            kt = tl.load(
                k_base + rows64[None, :] * stride_kt + offs_d[:, None],
                mask=n_ok[None, :] & d_ok[:, None],
                other=0.0,
            )
            if not FP8:
                v = tl.load(
                    v_base + rows64[:, None] * stride_vt + offs_d[None, :] * stride_vd,
                    mask=n_ok[:, None] & d_ok[None, :],
                    other=0.0,
                )
        else:
            kt = tl.load(
                k_base + rows64[None, :] * stride_kt + offs_d[:, None],
                mask=d_ok[:, None],
                other=0.0,
            )
            if not FP8:
                v = tl.load(
                    v_base + rows64[:, None] * stride_vt + offs_d[None, :] * stride_vd,
                    mask=d_ok[None, :],
                    other=0.0,
                )
        if FP8:
            # Keys-contiguous in whole zero-padded blocks (v_base is the sample's first slot):
            # no key mask, so the loads are 16-byte vectors; keys past the sample are zeros
            # that meet p = 0.
            v = tl.load(v_base + rows64[:, None] + offs_d[None, :] * stride_vd,
                        mask=d_ok[None, :], other=0.0)  # fmt: skip
        tile_scale = qk_scale
        tile_rel = rel_value
        if FP8:
            # Dequantisation folded into the score scale (and the constant bias, which is
            # added before it): scale * sq * sk * (q8 . k8).
            qk_s = q_scale * tl.load(ks_base + start * num_heads)
            tile_scale = qk_scale * qk_s
            tile_rel = rel_value / qk_s
        s = _scores(
            q, kt, tile_scale, tile_rel, rel_tile, jb_tile, HAS_REL, REL_CONST, HAS_JAGGED,
            DOT_PRECISION, UPCAST, SCALED=False,
        )  # fmt: skip
        if MASKED:
            s = _mask_tile(s, offs_m[:, None], start, BLOCK_N, shift, k_len, left, right,
                           HAS_LEFT, HAS_RIGHT, float("-inf"))  # fmt: skip
        elif ONE_LOOP:  # noqa: SIM102 (a constexpr branch, then a runtime one)
            if (start < mask_lo) | (start >= mask_hi):
                s = _mask_tile(s, offs_m[:, None], start, BLOCK_N, shift, k_len, left, right,
                               HAS_LEFT, HAS_RIGHT, float("-inf"))  # fmt: skip
        # m_i starts at a finite -1e30, so a row whose tile is fully masked keeps alpha = 1 and
        # p = 0 instead of producing inf - inf. s is unscaled: each row's maximum is taken
        # before the scale (positive: the host negates q for a negative one), which then rides
        # in the exponent's multiply-add instead of a multiply per score (the same values: a
        # positive scale keeps the order). FP8: P in [0, 1] times 2^8 keeps 1 exact and the top
        # binades at full E4M3 precision; the 2^8 is in the exponent too, l_i and acc carry it,
        # and the epilogue takes it out of the log-sum-exp.
        m_new = tl.maximum(m_i, tl.max(s, 1) * tile_scale)
        p = tl.math.exp2(s * tile_scale - (m_new - P_LOG2)[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if FP8:  # the change of unit (powers of two: exact) rides on alpha
            tile_unit = tl.load(vs_base + start * num_heads)
            acc = acc * (alpha * (v_unit / tile_unit))[:, None]
            acc = _dot(_to_e4m3(p, v.dtype, UPCAST), v, acc, DOT_PRECISION, UPCAST)
            v_unit = tile_unit
        else:
            acc = acc * alpha[:, None]
            acc = _dot(p.to(v.dtype), v, acc, DOT_PRECISION, UPCAST)
        m_i = m_new
    if FP8:
        acc = acc * v_unit
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["stride_lse_h", "stride_jb_h"])
def jfa_fwd_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    lse_ptr,
    tiles_ptr,
    rel_ptr,
    jb_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_ot,
    stride_oh,
    stride_lse_h,
    stride_rel_h,
    stride_jb_h,
    num_heads,
    num_buckets,
    left,
    right,
    qk_scale,
    rs_ptr,
    stride_rs_h,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    HAS_REL: tl.constexpr,
    HAS_JAGGED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    STRIP_P: tl.constexpr,
    STRIP_W: tl.constexpr,
    ONE_LOOP: tl.constexpr = False,
    FP8: tl.constexpr = False,
    qs_ptr=0,
    ks_ptr=0,
    vs_ptr=0,
):
    """One program per (query tile, head). ``ONE_LOOP`` (unbiased calls): one key loop that
    masks only the tiles needing it (see :func:`_fwd_inner`). ``FP8``: q, k, v are E4M3 with
    per-token power-of-two scales ``qs_ptr`` / ``ks_ptr`` / ``vs_ptr`` (``(tokens, heads)``
    float32, constant over each ``FP8_BLOCK``-token block of a sample). ``qk_scale > 0``."""
    pid = tl.program_id(0)
    tile = pid // num_heads
    head = pid % num_heads
    info = tiles_ptr + tile.to(tl.int64) * 7
    q_start = tl.load(info)
    q_len = tl.load(info + 1).to(tl.int32)
    k_start = tl.load(info + 2)
    k_len = tl.load(info + 3).to(tl.int32)
    m0 = tl.load(info + 4).to(tl.int32)
    jb_start = tl.load(info + 5)
    shift = k_len - q_len

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < q_len
    d_ok = offs_d < HEAD_DIM
    q_base = q_ptr + q_start * stride_qt + head * stride_qh
    q = tl.load(
        q_base + offs_m.to(tl.int64)[:, None] * stride_qt + offs_d[None, :],
        mask=m_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    k_base = k_ptr + k_start * stride_kt + head * stride_kh
    v_base = v_ptr + k_start * stride_vt + head * stride_vh
    rel_base = rel_ptr + head * stride_rel_h
    rs_base = rs_ptr + head * stride_rs_h + STRIP_P * STRIP_W
    # Row m0 of the sample's bias block: the tile's loads use int32 offsets from it.
    jb_base = jb_ptr + head * stride_jb_h + jb_start + m0.to(tl.int64) * k_len
    q_scale8 = 1.0
    ks_base = ks_ptr
    vs_base = vs_ptr
    if FP8:
        q_scale8 = tl.load(qs_ptr + (q_start + m0) * num_heads + head)
        ks_base = ks_ptr + k_start * num_heads + head
        vs_base = vs_ptr + k_start * num_heads + head
        v_base = v_ptr + tl.multiple_of(tl.load(info + 6), 128) + head * stride_vh

    # Keys any real row of this tile can see; rows past q_len are never stored, so the
    # "inside the band" test only considers real rows.
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

    UNBIASED_ONE_LOOP: tl.constexpr = ONE_LOOP and not HAS_REL and not HAS_JAGGED
    mid_lo = full_lo
    mid_hi = full_hi
    if UNBIASED_ONE_LOOP:  # the masked ranges below are empty; the middle loop covers every tile
        mid_lo = lo_t
        mid_hi = hi_t

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - 1.0e30
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, stride_vd,
        lo_t, mid_lo, offs_m, offs_d,
        shift, q_len, k_len, left, right, qk_scale, rs_base, num_buckets, 0.0, jb_base, m0,
        HEAD_DIM, BLOCK_N, BLOCK_D, True, HAS_LEFT, HAS_RIGHT, HAS_REL, False, HAS_JAGGED,
        DOT_PRECISION, UPCAST, STRIP_P, STRIP_W,
        FP8=FP8, q_scale=q_scale8, ks_base=ks_base, vs_base=vs_base, num_heads=num_heads,
    )  # fmt: skip
    if HAS_REL:
        # Key tiles far below the diagonal (all distances clamp to the last bucket), the band
        # that needs the table, and tiles far above it (first bucket).
        far_hi, near_lo = _rel_const_split(
            full_lo, full_hi, m0 + shift - (num_buckets - 1 - num_buckets // 2) + 1,
            p_hi + num_buckets // 2, BLOCK_N,
        )  # fmt: skip
        acc, l_i, m_i = _fwd_inner(
            acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, stride_vd,
            full_lo, far_hi, offs_m,
            offs_d, shift, q_len, k_len, left, right, qk_scale, rs_base, num_buckets,
            tl.load(rel_base + num_buckets - 1), jb_base, m0,
            HEAD_DIM, BLOCK_N, BLOCK_D, False, HAS_LEFT, HAS_RIGHT, HAS_REL, True, HAS_JAGGED,
            DOT_PRECISION, UPCAST, STRIP_P, STRIP_W,
            FP8=FP8, q_scale=q_scale8, ks_base=ks_base, vs_base=vs_base, num_heads=num_heads,
        )  # fmt: skip
        acc, l_i, m_i = _fwd_inner(
            acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, stride_vd,
            far_hi, near_lo, offs_m,
            offs_d, shift, q_len, k_len, left, right, qk_scale, rs_base, num_buckets, 0.0,
            jb_base, m0,
            HEAD_DIM, BLOCK_N, BLOCK_D, False, HAS_LEFT, HAS_RIGHT, HAS_REL, False, HAS_JAGGED,
            DOT_PRECISION, UPCAST, STRIP_P, STRIP_W,
            FP8=FP8, q_scale=q_scale8, ks_base=ks_base, vs_base=vs_base, num_heads=num_heads,
        )  # fmt: skip
        acc, l_i, m_i = _fwd_inner(
            acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, stride_vd,
            near_lo, full_hi, offs_m,
            offs_d, shift, q_len, k_len, left, right, qk_scale, rs_base, num_buckets,
            tl.load(rel_base), jb_base, m0,
            HEAD_DIM, BLOCK_N, BLOCK_D, False, HAS_LEFT, HAS_RIGHT, HAS_REL, True, HAS_JAGGED,
            DOT_PRECISION, UPCAST, STRIP_P, STRIP_W,
            FP8=FP8, q_scale=q_scale8, ks_base=ks_base, vs_base=vs_base, num_heads=num_heads,
        )  # fmt: skip
    else:
        acc, l_i, m_i = _fwd_inner(
            acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, stride_vd,
            mid_lo, mid_hi, offs_m,
            offs_d, shift, q_len, k_len, left, right, qk_scale, rs_base, num_buckets, 0.0,
            jb_base, m0,
            HEAD_DIM, BLOCK_N, BLOCK_D, False, HAS_LEFT, HAS_RIGHT, HAS_REL, False, HAS_JAGGED,
            DOT_PRECISION, UPCAST, STRIP_P, STRIP_W, full_lo, full_hi,
            UNBIASED_ONE_LOOP,
            FP8=FP8, q_scale=q_scale8, ks_base=ks_base, vs_base=vs_base, num_heads=num_heads,
        )  # fmt: skip
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, stride_vd,
        mid_hi, hi_t, offs_m, offs_d,
        shift, q_len, k_len, left, right, qk_scale, rs_base, num_buckets, 0.0, jb_base, m0,
        HEAD_DIM, BLOCK_N, BLOCK_D, True, HAS_LEFT, HAS_RIGHT, HAS_REL, False, HAS_JAGGED,
        DOT_PRECISION, UPCAST, STRIP_P, STRIP_W,
        FP8=FP8, q_scale=q_scale8, ks_base=ks_base, vs_base=vs_base, num_heads=num_heads,
    )  # fmt: skip

    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    if FP8:  # l_i holds the row sums times 2^8
        m_i = m_i - _P8_LOG2
    lse = tl.where(empty, float("inf"), m_i + tl.math.log2(tl.where(empty, 1.0, l_i)))
    o_base = o_ptr + q_start * stride_ot + head * stride_oh
    tl.store(
        o_base + offs_m.to(tl.int64)[:, None] * stride_ot + offs_d[None, :],
        out.to(o_ptr.dtype.element_ty),
        mask=m_ok[:, None] & d_ok[None, :],
    )
    tl.store(lse_ptr + head * stride_lse_h + q_start + offs_m, lse, mask=m_ok)


# ---------------------------------------------------------------------------------------------
# Backward.


@triton.jit(do_not_specialize=["num_rows", "stride_delta_h"])
def jfa_bwd_preprocess_kernel(
    o_ptr,
    do_ptr,
    delta_ptr,
    num_rows,
    stride_ot,
    stride_oh,
    stride_dot,
    stride_doh,
    stride_delta_h,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """delta[h, t] = sum_d dO[t, h, d] * O[t, h, d] (fp32)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    head = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (rows < num_rows)[:, None] & (offs_d < HEAD_DIM)[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    o = tl.load(o_ptr + rows64 * stride_ot + head * stride_oh + offs_d[None, :], mask=mask, other=0)
    do = tl.load(
        do_ptr + rows64 * stride_dot + head * stride_doh + offs_d[None, :], mask=mask, other=0
    )
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(delta_ptr + head * stride_delta_h + rows, delta, mask=rows < num_rows)


@triton.jit
def _rel_bias_grad_update(
    rel_acc,
    ds_t,
    m0,
    n0,
    shift,
    num_buckets,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DIAG_W: tl.constexpr,
    BUCKETS_PAD: tl.constexpr,
):
    """Add the bucket sums of a transposed dS tile (keys x queries) to rel_acc (BUCKETS_PAD,).

    The bucket of (i, j) depends only on the distance d = i + shift - j, so the tile is reduced
    to its BLOCK_M + BLOCK_N - 1 diagonal sums first (a gather skews each key row), then the
    diagonals are mapped to buckets (a shift, plus the two clamped end buckets).
    """
    buckets = tl.arange(0, BUCKETS_PAD)
    # Distance of local diagonal u: d = d_base + u.
    d_base = m0 - n0 + shift - (BLOCK_N - 1)
    b_first = tl.minimum(tl.maximum(d_base + num_buckets // 2, 0), num_buckets - 1)
    b_last = tl.minimum(
        tl.maximum(d_base + BLOCK_M + BLOCK_N - 2 + num_buckets // 2, 0), num_buckets - 1
    )
    if b_first == b_last:
        # The whole tile lies beyond the table's reach: one (clamped) bucket.
        rel_acc += tl.where(buckets == b_first, tl.sum(tl.sum(ds_t, 1), 0), 0.0)
    else:
        # Skew every key row into its diagonals, a (BLOCK_N x DIAG_W) tile. (Rotating each row
        # inside BLOCK_M columns instead, a tile of dS's shape, and skewing along the keys, a
        # (DIAG_W x BLOCK_M) tile, were both slower on the H200: their gathers cross warps or
        # need reshapes that cost more than the registers they save.)
        diag = tl.arange(0, DIAG_W)
        key_rows = tl.arange(0, BLOCK_N)
        col = diag[None, :] - (BLOCK_N - 1) + key_rows[:, None]  # query column of (row, diag)
        skewed = tl.gather(ds_t, tl.minimum(tl.maximum(col, 0), BLOCK_M - 1), 1)
        skewed = tl.where((col >= 0) & (col < BLOCK_M), skewed, 0.0)
        diag_sums = tl.sum(skewed, 0)  # (DIAG_W,)
        diag_bucket = tl.minimum(tl.maximum(d_base + diag + num_buckets // 2, 0), num_buckets - 1)
        first_sum = tl.sum(tl.where(diag_bucket == 0, diag_sums, 0.0), 0)
        last_sum = tl.sum(tl.where(diag_bucket == num_buckets - 1, diag_sums, 0.0), 0)
        diag_of_bucket = buckets - num_buckets // 2 - d_base
        inner = (
            (buckets > 0)
            & (buckets < num_buckets - 1)
            & (diag_of_bucket >= 0)
            & (diag_of_bucket < DIAG_W)
        )
        picked = tl.gather(diag_sums, tl.minimum(tl.maximum(diag_of_bucket, 0), DIAG_W - 1), 0)
        rel_acc += tl.where(inner, picked, 0.0)
        rel_acc += tl.where(buckets == 0, first_sum, 0.0)
        rel_acc += tl.where((buckets == num_buckets - 1) & (num_buckets > 1), last_sum, 0.0)
    return rel_acc


@triton.jit
def _dkdv_inner(
    dk,
    dv,
    rel_acc,
    rel_const_sum,
    k,
    v,
    q_base,
    do_base,
    lse_base,
    delta_base,
    stride_qt,
    stride_dot,
    start_m,
    end_m,
    n0,
    offs_n,
    offs_d,
    shift,
    q_len,
    k_len,
    left,
    right,
    qk_scale,
    rs_base,
    num_buckets,
    rel_value,
    jb_base,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MASKED: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    HAS_REL: tl.constexpr,
    REL_CONST: tl.constexpr,
    HAS_JAGGED: tl.constexpr,
    DIAG_W: tl.constexpr,
    BUCKETS_PAD: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    STRIP_P: tl.constexpr,
    STRIP_W: tl.constexpr,
    dq_base,
    stride_dqt,
    FUSED_DQ: tl.constexpr,
    dq_desc,
    dq_row0,
    dq_col,
    DQ_TMA: tl.constexpr,
):
    d_ok = offs_d < HEAD_DIM
    jb_next = 0.0
    rel_next = 0.0
    HAS_BAND: tl.constexpr = HAS_REL and not REL_CONST
    if HAS_BAND:
        # Bucket of (query start + c, key n0 + r): g0 + start + c - r; the transposed tile
        # reads the strip with queries as its rows and keys as its columns.
        g0 = shift + num_buckets // 2 - n0
        strip_offsets = tl.arange(0, BLOCK_M)[None, :] * STRIP_W + (offs_n - n0)[:, None]
        rel_next = _strip_load(
            rs_base, g0 + start_m, strip_offsets, num_buckets, start_m < end_m, STRIP_P, STRIP_W
        )
    if HAS_JAGGED:
        k_len64 = k_len.to(tl.int64)
        # Transposed bias tile (keys x queries): contiguous along the keys. Keys past the
        # sample read its last key (their dK / dV rows are never stored): no key mask.
        queries = tl.arange(0, BLOCK_M)[None, :]
        tile_offsets = queries * k_len + tl.minimum(offs_n, k_len - 1)[:, None]
        jb_next = _jagged_load(
            jb_base + start_m * k_len64, tile_offsets, start_m + queries, q_len,
            start_m < end_m, MASKED,
        )  # fmt: skip
    for start in range(start_m, end_m, BLOCK_M):
        jb_tile = jb_next
        rel_tile = rel_next
        if HAS_BAND:
            rel_next = _strip_load(
                rs_base, g0 + start + BLOCK_M, strip_offsets, num_buckets,
                start + BLOCK_M < end_m, STRIP_P, STRIP_W,
            )  # fmt: skip
        if HAS_JAGGED:
            jb_next = _jagged_load(
                jb_base + (start + BLOCK_M) * k_len64, tile_offsets, start + BLOCK_M + queries,
                q_len, start + BLOCK_M < end_m, MASKED,
            )  # fmt: skip
        offs_m = start + tl.arange(0, BLOCK_M)
        m_ok = offs_m < q_len
        rows64 = offs_m.to(tl.int64)
        if MASKED:
            q_t = tl.load(
                q_base + rows64[None, :] * stride_qt + offs_d[:, None],
                mask=m_ok[None, :] & d_ok[:, None],
                other=0.0,
            )
            do = tl.load(
                do_base + rows64[:, None] * stride_dot + offs_d[None, :],
                mask=m_ok[:, None] & d_ok[None, :],
                other=0.0,
            )
            lse = tl.load(lse_base + offs_m, mask=m_ok, other=float("inf"))
            delta = tl.load(delta_base + offs_m, mask=m_ok, other=0.0)
        else:
            q_t = tl.load(
                q_base + rows64[None, :] * stride_qt + offs_d[:, None],
                mask=d_ok[:, None],
                other=0.0,
            )
            do = tl.load(
                do_base + rows64[:, None] * stride_dot + offs_d[None, :],
                mask=d_ok[None, :],
                other=0.0,
            )
            lse = tl.load(lse_base + offs_m)
            delta = tl.load(delta_base + offs_m)
        # Transposed tile: rows are keys (offs_n), columns are queries (offs_m).
        s_t = _scores(
            k, q_t, qk_scale, rel_value, rel_tile, jb_tile, HAS_REL, REL_CONST, HAS_JAGGED,
            DOT_PRECISION, UPCAST,
        )  # fmt: skip
        p_t = tl.math.exp2(s_t - lse[None, :])
        if MASKED:
            p_t = _mask_tile_t(p_t, offs_n[:, None], start, BLOCK_M, shift, k_len, left, right,
                               HAS_LEFT, HAS_RIGHT, 0.0)  # fmt: skip
        dv = _dot(p_t.to(do.dtype), do, dv, DOT_PRECISION, UPCAST)
        dp_t = _dot(v, tl.trans(do), None, DOT_PRECISION, UPCAST)
        ds_t = p_t * (dp_t - delta[None, :])
        ds_low = ds_t.to(q_t.dtype)
        dk = _dot(ds_low, tl.trans(q_t), dk, DOT_PRECISION, UPCAST)
        if FUSED_DQ:  # this key tile's share of the dQ rows, added in float32 (order not fixed)
            dq = _dot(tl.trans(ds_low), k, None, DOT_PRECISION, UPCAST)
            if DQ_TMA:
                # One bulk reduce (TMA, from shared memory) per tile instead of an atomic per
                # element. Rows past the sample add exact zeros (their dS is 0) to the next one.
                dq_desc.atomic_add([dq_row0 + start, dq_col], dq)
            else:
                tl.atomic_add(
                    dq_base + rows64[:, None] * stride_dqt + offs_d[None, :],
                    dq,
                    mask=m_ok[:, None] & d_ok[None, :],
                    sem="relaxed",
                )
        if HAS_REL:
            if REL_CONST:
                # Per key row (a reduction inside each thread quad); the rows are summed once
                # after the loop, not across warps every iteration (H200, B32xL16384 causal:
                # forward+backward 1.09x faster).
                rel_const_sum += tl.sum(ds_t, 1)
            else:
                rel_acc = _rel_bias_grad_update(
                    rel_acc, ds_t, start, n0, shift, num_buckets, BLOCK_M, BLOCK_N, DIAG_W,
                    BUCKETS_PAD,
                )  # fmt: skip
    return dk, dv, rel_acc, rel_const_sum


# The token count is not specialised on: one compiled kernel serves every batch, where one
# whose count divides by 16 would otherwise compile a second variant in the middle of a run.
@triton.jit(do_not_specialize=["stride_lse_h", "stride_jb_h", "num_q_rows"])
def jfa_bwd_dkdv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    do_ptr,
    lse_ptr,
    delta_ptr,
    dk_ptr,
    dv_ptr,
    tiles_ptr,
    rel_ptr,
    jb_ptr,
    rel_partial_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_dot,
    stride_doh,
    stride_dkt,
    stride_dkh,
    stride_dvt,
    stride_dvh,
    stride_lse_h,
    stride_rel_h,
    stride_jb_h,
    num_heads,
    num_buckets,
    left,
    right,
    qk_scale,
    scale,
    rs_ptr,
    stride_rs_h,
    dq_ptr,
    stride_dqt,
    stride_dqh,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    HAS_REL: tl.constexpr,
    HAS_JAGGED: tl.constexpr,
    DIAG_W: tl.constexpr,
    BUCKETS_PAD: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    STRIP_P: tl.constexpr,
    STRIP_W: tl.constexpr,
    FUSED_DQ: tl.constexpr,
    DQ_TMA: tl.constexpr = False,
    num_q_rows=0,
):
    """One program per (KV tile, head): loops over the query tiles that see the tile.

    ``FUSED_DQ``: also adds each query tile's dQ rows (unscaled) into the zeroed float32
    ``dq_ptr`` with atomics, so no dQ kernel runs (S and dP are computed once, not twice).
    ``DQ_TMA`` (compiled, contiguous ``(num_q_rows, H, HEAD_DIM)`` dQ, HEAD_DIM == BLOCK_D):
    the atomics are TMA bulk reduces through one descriptor over the whole dQ."""
    pid = tl.program_id(0)
    tile = pid // num_heads
    head = pid % num_heads
    info = tiles_ptr + tile.to(tl.int64) * 7
    q_start = tl.load(info)
    q_len = tl.load(info + 1).to(tl.int32)
    k_start = tl.load(info + 2)
    k_len = tl.load(info + 3).to(tl.int32)
    n0 = tl.load(info + 4).to(tl.int32)
    jb_start = tl.load(info + 5)
    shift = k_len - q_len

    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    n_ok = offs_n < k_len
    d_ok = offs_d < HEAD_DIM
    kv_mask = n_ok[:, None] & d_ok[None, :]
    rows64 = offs_n.to(tl.int64)[:, None]
    k = tl.load(
        k_ptr + k_start * stride_kt + head * stride_kh + rows64 * stride_kt + offs_d[None, :],
        mask=kv_mask,
        other=0.0,
    )
    v = tl.load(
        v_ptr + k_start * stride_vt + head * stride_vh + rows64 * stride_vt + offs_d[None, :],
        mask=kv_mask,
        other=0.0,
    )
    q_base = q_ptr + q_start * stride_qt + head * stride_qh
    do_base = do_ptr + q_start * stride_dot + head * stride_doh
    lse_base = lse_ptr + head * stride_lse_h + q_start
    delta_base = delta_ptr + head * stride_lse_h + q_start
    rel_base = rel_ptr + head * stride_rel_h
    rs_base = rs_ptr + head * stride_rs_h + STRIP_P * STRIP_W
    jb_base = jb_ptr + head * stride_jb_h + jb_start
    dq_base = dq_ptr + q_start * stride_dqt + head * stride_dqh
    dq_desc = None
    dq_row0 = q_start.to(tl.int32)
    dq_col = head * HEAD_DIM
    if DQ_TMA:
        dq_desc = tl.make_tensor_descriptor(
            dq_ptr, shape=[num_q_rows, stride_dqt], strides=[stride_dqt, 1],
            block_shape=[BLOCK_M, BLOCK_D],
        )  # fmt: skip

    # Query rows that see any key of this tile, and the sub-range that sees all of them.
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

    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    rel_acc = tl.zeros([BUCKETS_PAD], dtype=tl.float32)
    zero = tl.zeros([BLOCK_N], dtype=tl.float32)
    lo_sum = zero  # dS summed per key row over the tiles whose pairs all fall in bucket 0
    hi_sum = zero  # ... in the last bucket
    dk, dv, rel_acc, zero = _dkdv_inner(
        dk, dv, rel_acc, zero, k, v, q_base, do_base, lse_base, delta_base, stride_qt,
        stride_dot, lo_t, full_lo, n0, offs_n, offs_d, shift, q_len, k_len, left, right,
        qk_scale, rs_base, num_buckets, 0.0, jb_base,
        HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_D, True, HAS_LEFT, HAS_RIGHT, HAS_REL, False,
        HAS_JAGGED, DIAG_W, BUCKETS_PAD, DOT_PRECISION, UPCAST, STRIP_P, STRIP_W,
        dq_base, stride_dqt, FUSED_DQ, dq_desc, dq_row0, dq_col, DQ_TMA,
    )  # fmt: skip
    if HAS_REL:
        # Query tiles far above the diagonal (first bucket), the band, far below (last bucket).
        near_hi, far_lo = _rel_const_split(
            full_lo, full_hi, n0 - num_buckets // 2 - shift + 1,
            n0 + BLOCK_N - 1 + (num_buckets - 1 - num_buckets // 2) - shift, BLOCK_M,
        )  # fmt: skip
        dk, dv, rel_acc, lo_sum = _dkdv_inner(
            dk, dv, rel_acc, lo_sum, k, v, q_base, do_base, lse_base, delta_base, stride_qt,
            stride_dot, full_lo, near_hi, n0, offs_n, offs_d, shift, q_len, k_len, left, right,
            qk_scale, rs_base, num_buckets, tl.load(rel_base), jb_base,
            HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_D, False, HAS_LEFT, HAS_RIGHT, HAS_REL, True,
            HAS_JAGGED, DIAG_W, BUCKETS_PAD, DOT_PRECISION, UPCAST, STRIP_P, STRIP_W,
            dq_base, stride_dqt, FUSED_DQ, dq_desc, dq_row0, dq_col, DQ_TMA,
        )  # fmt: skip
        dk, dv, rel_acc, zero = _dkdv_inner(
            dk, dv, rel_acc, zero, k, v, q_base, do_base, lse_base, delta_base, stride_qt,
            stride_dot, near_hi, far_lo, n0, offs_n, offs_d, shift, q_len, k_len, left, right,
            qk_scale, rs_base, num_buckets, 0.0, jb_base,
            HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_D, False, HAS_LEFT, HAS_RIGHT, HAS_REL, False,
            HAS_JAGGED, DIAG_W, BUCKETS_PAD, DOT_PRECISION, UPCAST, STRIP_P, STRIP_W,
            dq_base, stride_dqt, FUSED_DQ, dq_desc, dq_row0, dq_col, DQ_TMA,
        )  # fmt: skip
        dk, dv, rel_acc, hi_sum = _dkdv_inner(
            dk, dv, rel_acc, hi_sum, k, v, q_base, do_base, lse_base, delta_base, stride_qt,
            stride_dot, far_lo, full_hi, n0, offs_n, offs_d, shift, q_len, k_len, left, right,
            qk_scale, rs_base, num_buckets, tl.load(rel_base + num_buckets - 1), jb_base,
            HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_D, False, HAS_LEFT, HAS_RIGHT, HAS_REL, True,
            HAS_JAGGED, DIAG_W, BUCKETS_PAD, DOT_PRECISION, UPCAST, STRIP_P, STRIP_W,
            dq_base, stride_dqt, FUSED_DQ, dq_desc, dq_row0, dq_col, DQ_TMA,
        )  # fmt: skip
    else:
        dk, dv, rel_acc, zero = _dkdv_inner(
            dk, dv, rel_acc, zero, k, v, q_base, do_base, lse_base, delta_base, stride_qt,
            stride_dot, full_lo, full_hi, n0, offs_n, offs_d, shift, q_len, k_len, left, right,
            qk_scale, rs_base, num_buckets, 0.0, jb_base,
            HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_D, False, HAS_LEFT, HAS_RIGHT, HAS_REL, False,
            HAS_JAGGED, DIAG_W, BUCKETS_PAD, DOT_PRECISION, UPCAST, STRIP_P, STRIP_W,
            dq_base, stride_dqt, FUSED_DQ, dq_desc, dq_row0, dq_col, DQ_TMA,
        )  # fmt: skip
    dk, dv, rel_acc, zero = _dkdv_inner(
        dk, dv, rel_acc, zero, k, v, q_base, do_base, lse_base, delta_base, stride_qt,
        stride_dot, full_hi, hi_t, n0, offs_n, offs_d, shift, q_len, k_len, left, right,
        qk_scale, rs_base, num_buckets, 0.0, jb_base,
        HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_D, True, HAS_LEFT, HAS_RIGHT, HAS_REL, False,
        HAS_JAGGED, DIAG_W, BUCKETS_PAD, DOT_PRECISION, UPCAST, STRIP_P, STRIP_W,
        dq_base, stride_dqt, FUSED_DQ, dq_desc, dq_row0, dq_col, DQ_TMA,
    )  # fmt: skip

    tl.store(
        dk_ptr + k_start * stride_dkt + head * stride_dkh + rows64 * stride_dkt + offs_d[None, :],
        (dk * scale).to(dk_ptr.dtype.element_ty),
        mask=kv_mask,
    )
    tl.store(
        dv_ptr + k_start * stride_dvt + head * stride_dvh + rows64 * stride_dvt + offs_d[None, :],
        dv.to(dv_ptr.dtype.element_ty),
        mask=kv_mask,
    )
    if HAS_REL:
        buckets = tl.arange(0, BUCKETS_PAD)
        rel_acc += tl.where(buckets == 0, tl.sum(lo_sum, 0), 0.0)
        rel_acc += tl.where(buckets == num_buckets - 1, tl.sum(hi_sum, 0), 0.0)
        tl.store(rel_partial_ptr + pid.to(tl.int64) * BUCKETS_PAD + buckets, rel_acc)


@triton.jit
def _dq_inner(
    dq,
    q,
    do,
    lse,
    delta,
    k_base,
    v_base,
    stride_kt,
    stride_vt,
    start_n,
    end_n,
    offs_m,
    offs_d,
    shift,
    q_len,
    k_len,
    left,
    right,
    qk_scale,
    rs_base,
    num_buckets,
    rel_value,
    jb_base,
    m0,
    jb_grad_base,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MASKED: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    HAS_REL: tl.constexpr,
    REL_CONST: tl.constexpr,
    HAS_JAGGED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    STRIP_P: tl.constexpr,
    STRIP_W: tl.constexpr,
):
    d_ok = offs_d < HEAD_DIM
    jb_next = 0.0
    rel_next = 0.0
    HAS_BAND: tl.constexpr = HAS_REL and not REL_CONST
    if HAS_JAGGED:
        rows_local = (offs_m - m0)[:, None]
        # Rows past the sample read row 0 (their scores are never stored): no row mask.
        row_offsets = tl.where(rows_local < q_len - m0, rows_local, 0) * k_len
        tile_offsets = row_offsets + tl.arange(0, BLOCK_N)[None, :]
        jb_next = _jagged_load(
            jb_base + start_n, tile_offsets, (start_n + tl.arange(0, BLOCK_N))[None, :], k_len,
            start_n < end_n, MASKED,
        )  # fmt: skip
    if HAS_BAND:
        # Bucket of (query m0 + r, key start + c): g0 - start + r - c.
        g0 = m0 + shift + num_buckets // 2
        strip_offsets = (offs_m - m0)[:, None] * STRIP_W + tl.arange(0, BLOCK_N)[None, :]
        rel_next = _strip_load(
            rs_base, g0 - start_n, strip_offsets, num_buckets, start_n < end_n, STRIP_P, STRIP_W
        )
    for start in range(start_n, end_n, BLOCK_N):
        jb_tile = jb_next
        rel_tile = rel_next
        if HAS_JAGGED:
            jb_next = _jagged_load(
                jb_base + (start + BLOCK_N), tile_offsets,
                (start + BLOCK_N + tl.arange(0, BLOCK_N))[None, :], k_len,
                start + BLOCK_N < end_n, MASKED,
            )  # fmt: skip
        if HAS_BAND:
            rel_next = _strip_load(
                rs_base, g0 - start - BLOCK_N, strip_offsets, num_buckets,
                start + BLOCK_N < end_n, STRIP_P, STRIP_W,
            )  # fmt: skip
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < k_len
        rows64 = offs_n.to(tl.int64)
        if MASKED:  # noqa: SIM108 - constexpr branch, kept as a plain if for Triton
            load_mask = n_ok[None, :] & d_ok[:, None]
        else:
            load_mask = d_ok[:, None]
        kt = tl.load(
            k_base + rows64[None, :] * stride_kt + offs_d[:, None], mask=load_mask, other=0.0
        )
        vt = tl.load(
            v_base + rows64[None, :] * stride_vt + offs_d[:, None], mask=load_mask, other=0.0
        )
        s = _scores(
            q, kt, qk_scale, rel_value, rel_tile, jb_tile, HAS_REL, REL_CONST, HAS_JAGGED,
            DOT_PRECISION, UPCAST,
        )  # fmt: skip
        p = tl.math.exp2(s - lse[:, None])
        if MASKED:  # rows past the sample have p = 0 already (their lse loads as inf)
            p = _mask_tile(p, offs_m[:, None], start, BLOCK_N, shift, k_len, left, right,
                           HAS_LEFT, HAS_RIGHT, 0.0)  # fmt: skip
        dp = _dot(do, vt, None, DOT_PRECISION, UPCAST)
        ds = p * (dp - delta[:, None])
        dq = _dot(ds.to(kt.dtype), tl.trans(kt), dq, DOT_PRECISION, UPCAST)
        if HAS_JAGGED:
            # dL/d(bias) = dS, written here (not in the dK/dV kernel, whose registers are full):
            # each (i, j) pair is visited by exactly one dQ program, rows contiguous in keys.
            grad_mask = rows_local < q_len - m0
            if MASKED:
                grad_mask = grad_mask & (offs_n < k_len)[None, :]
            tl.store(
                jb_grad_base + (rows_local * k_len + offs_n[None, :]),
                ds.to(jb_grad_base.dtype.element_ty),
                mask=grad_mask,
            )
    return dq


@triton.jit(do_not_specialize=["stride_lse_h", "stride_jb_h"])
def jfa_bwd_dq_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    do_ptr,
    lse_ptr,
    delta_ptr,
    dq_ptr,
    tiles_ptr,
    rel_ptr,
    jb_ptr,
    jb_grad_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_dot,
    stride_doh,
    stride_dqt,
    stride_dqh,
    stride_lse_h,
    stride_rel_h,
    stride_jb_h,
    num_heads,
    num_buckets,
    left,
    right,
    qk_scale,
    scale,
    rs_ptr,
    stride_rs_h,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    HAS_REL: tl.constexpr,
    HAS_JAGGED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    STRIP_P: tl.constexpr,
    STRIP_W: tl.constexpr,
):
    """One program per (Q tile, head): loops over the KV tiles the tile sees."""
    pid = tl.program_id(0)
    tile = pid // num_heads
    head = pid % num_heads
    info = tiles_ptr + tile.to(tl.int64) * 7
    q_start = tl.load(info)
    q_len = tl.load(info + 1).to(tl.int32)
    k_start = tl.load(info + 2)
    k_len = tl.load(info + 3).to(tl.int32)
    m0 = tl.load(info + 4).to(tl.int32)
    jb_start = tl.load(info + 5)
    shift = k_len - q_len

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < q_len
    d_ok = offs_d < HEAD_DIM
    row_mask = m_ok[:, None] & d_ok[None, :]
    rows64 = offs_m.to(tl.int64)[:, None]
    q = tl.load(
        q_ptr + q_start * stride_qt + head * stride_qh + rows64 * stride_qt + offs_d[None, :],
        mask=row_mask,
        other=0.0,
    )
    do = tl.load(
        do_ptr + q_start * stride_dot + head * stride_doh + rows64 * stride_dot + offs_d[None, :],
        mask=row_mask,
        other=0.0,
    )
    lse = tl.load(lse_ptr + head * stride_lse_h + q_start + offs_m, mask=m_ok, other=float("inf"))
    delta = tl.load(delta_ptr + head * stride_lse_h + q_start + offs_m, mask=m_ok, other=0.0)
    k_base = k_ptr + k_start * stride_kt + head * stride_kh
    v_base = v_ptr + k_start * stride_vt + head * stride_vh
    rel_base = rel_ptr + head * stride_rel_h
    rs_base = rs_ptr + head * stride_rs_h + STRIP_P * STRIP_W
    # Row m0 of the sample's bias block: the tile's loads use int32 offsets from it.
    jb_base = jb_ptr + head * stride_jb_h + jb_start + m0.to(tl.int64) * k_len
    jb_grad_base = jb_grad_ptr + head * stride_jb_h + jb_start + m0.to(tl.int64) * k_len

    # Same key ranges as the forward kernel.
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

    if HAS_JAGGED:
        # Pairs left of and right of the visited key range get zero gradients (issued first:
        # the stores drain while the loops below compute).
        _zero_bias_grad(jb_grad_base, q_len - m0, 0, lo_t, k_len, BLOCK_M, BLOCK_N)
        _zero_bias_grad(jb_grad_base, q_len - m0, hi_t, k_len, k_len, BLOCK_M, BLOCK_N)

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    dq = _dq_inner(
        dq, q, do, lse, delta, k_base, v_base, stride_kt, stride_vt, lo_t, full_lo, offs_m,
        offs_d, shift, q_len, k_len, left, right, qk_scale, rs_base, num_buckets, 0.0, jb_base, m0,
        jb_grad_base,
        HEAD_DIM, BLOCK_N, BLOCK_D, True, HAS_LEFT, HAS_RIGHT, HAS_REL, False, HAS_JAGGED,
        DOT_PRECISION, UPCAST, STRIP_P, STRIP_W,
    )  # fmt: skip
    if HAS_REL:
        # Same split as the forward.
        far_hi, near_lo = _rel_const_split(
            full_lo, full_hi, m0 + shift - (num_buckets - 1 - num_buckets // 2) + 1,
            p_hi + num_buckets // 2, BLOCK_N,
        )  # fmt: skip
        dq = _dq_inner(
            dq, q, do, lse, delta, k_base, v_base, stride_kt, stride_vt, full_lo, far_hi,
            offs_m, offs_d, shift, q_len, k_len, left, right, qk_scale, rs_base, num_buckets,
            tl.load(rel_base + num_buckets - 1), jb_base, m0, jb_grad_base,
            HEAD_DIM, BLOCK_N, BLOCK_D, False, HAS_LEFT, HAS_RIGHT, HAS_REL, True, HAS_JAGGED,
            DOT_PRECISION, UPCAST, STRIP_P, STRIP_W,
        )  # fmt: skip
        dq = _dq_inner(
            dq, q, do, lse, delta, k_base, v_base, stride_kt, stride_vt, far_hi, near_lo,
            offs_m, offs_d, shift, q_len, k_len, left, right, qk_scale, rs_base, num_buckets,
            0.0, jb_base, m0, jb_grad_base,
            HEAD_DIM, BLOCK_N, BLOCK_D, False, HAS_LEFT, HAS_RIGHT, HAS_REL, False, HAS_JAGGED,
            DOT_PRECISION, UPCAST, STRIP_P, STRIP_W,
        )  # fmt: skip
        dq = _dq_inner(
            dq, q, do, lse, delta, k_base, v_base, stride_kt, stride_vt, near_lo, full_hi,
            offs_m, offs_d, shift, q_len, k_len, left, right, qk_scale, rs_base, num_buckets,
            tl.load(rel_base), jb_base, m0, jb_grad_base,
            HEAD_DIM, BLOCK_N, BLOCK_D, False, HAS_LEFT, HAS_RIGHT, HAS_REL, True, HAS_JAGGED,
            DOT_PRECISION, UPCAST, STRIP_P, STRIP_W,
        )  # fmt: skip
    else:
        dq = _dq_inner(
            dq, q, do, lse, delta, k_base, v_base, stride_kt, stride_vt, full_lo, full_hi,
            offs_m, offs_d, shift, q_len, k_len, left, right, qk_scale, rs_base, num_buckets,
            0.0, jb_base, m0, jb_grad_base,
            HEAD_DIM, BLOCK_N, BLOCK_D, False, HAS_LEFT, HAS_RIGHT, HAS_REL, False, HAS_JAGGED,
            DOT_PRECISION, UPCAST, STRIP_P, STRIP_W,
        )  # fmt: skip
    dq = _dq_inner(
        dq, q, do, lse, delta, k_base, v_base, stride_kt, stride_vt, full_hi, hi_t, offs_m,
        offs_d, shift, q_len, k_len, left, right, qk_scale, rs_base, num_buckets, 0.0, jb_base, m0,
        jb_grad_base,
        HEAD_DIM, BLOCK_N, BLOCK_D, True, HAS_LEFT, HAS_RIGHT, HAS_REL, False, HAS_JAGGED,
        DOT_PRECISION, UPCAST, STRIP_P, STRIP_W,
    )  # fmt: skip
    tl.store(
        dq_ptr + q_start * stride_dqt + head * stride_dqh + rows64 * stride_dqt + offs_d[None, :],
        (dq * scale).to(dq_ptr.dtype.element_ty),
        mask=row_mask,
    )
