"""Triton kernels of block attention with fused rotary embedding (forward and backward).

Loaded by :mod:`gem_kernels.block_attention_triton` through ``importlib`` (never imported
directly): Triton decides at decoration time whether ``@triton.jit`` compiles or interprets,
so the loader executes this file once per mode under distinct module names.

Conventions shared by the kernels:

* One program per (block, group of heads): ``program_id(0)`` is the global block index (the
  blocks of all samples in order), ``program_id(1)`` the head group. The host ships one int64
  vector: ``offsets`` (B + 1), ``cum_blocks`` (exclusive prefix sum of the per-sample block
  counts, B + 1) and the sample of every block; a program reads its sample, then its rows
  (two dependent loads).
* A whole block (at most ``BLOCK_M`` tokens) sits in registers: the softmax is exact in one
  pass and the backward recomputes it, so neither a log-sum-exp nor ``rowsum(dO * O)`` is
  stored: ``delta = rowsum(P * dP)`` is the same number.
* RoPE (rotate-half, pairs ``(x[i], x[i + D/2])``) is applied in registers to q and k right
  after loading; the backward rotates dq and dk back (the transpose rotation) before storing.
  The angle ``pos * theta^(-2i/D)`` is taken modulo one turn in 40-bit fixed point
  (``freq_ptr`` holds ``round(theta^(-2i/D) / (2 pi) * 2^40)``): an exact integer product, so
  large positions lose no accuracy before ``sin``/``cos`` (which then see ``[-pi, pi)`` only).
  The sines and cosines are computed once per program and reused by all its heads.
* Scores are kept in the log2 domain (``exp2``): ``s2 = log2(e) * scale * q_rot . k_rot``.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
TWO_PI = 6.283185307179586


@triton.jit
def _dot(a, b, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    # UPCAST: the Triton 3.8 interpreter multiplies bfloat16 operands wrongly; fp32 is exact.
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def _locate_block(meta_ptr, num_samples, block_size, pid):
    """(first row, rows in the block, position of its first row within the sample) of block
    ``pid`` (int64), from the offsets: three dependent loads."""
    # meta: offsets (B + 1), cum_blocks (B + 1), then the sample of every block.
    cum_ptr = meta_ptr + num_samples + 1
    sample = tl.load(cum_ptr + num_samples + 1 + pid)
    sample_start = tl.load(meta_ptr + sample)
    sample_len = tl.load(meta_ptr + sample + 1) - sample_start
    first_pos = (pid - tl.load(cum_ptr + sample)) * block_size
    rows = tl.minimum(sample_len - first_pos, block_size)
    return sample_start + first_pos, rows, first_pos


@triton.jit
def _rope_tables(
    pos_ptr,
    row0,
    first_pos,
    offs_m,
    m_ok,
    freq_ptr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    HAS_POS: tl.constexpr,
    FAST_TRIG: tl.constexpr,
):
    """cos / sin of every (row, frequency) angle of the block, float32 (BLOCK_M, BLOCK_HALF).

    ``FAST_TRIG``: the hardware approximations (``cos.approx`` / ``sin.approx``, absolute error
    below 2^-20.5 on [-pi, pi], the only range they see here) instead of libdevice's
    range-reducing functions (inline PTX: compiled kernels only)."""
    if HAS_POS:
        pos = tl.load(pos_ptr + row0 + offs_m, mask=m_ok, other=0).to(tl.int64)
    else:
        pos = first_pos + offs_m.to(tl.int64)
    offs_f = tl.arange(0, BLOCK_HALF)
    freq = tl.load(freq_ptr + offs_f, mask=offs_f < HALF, other=0)
    # Turns in 40-bit fixed point; bits 16..39 are the fraction of a turn to 2^-24.
    turns_fixed = pos[:, None] * freq[None, :]
    frac = ((turns_fixed >> 16) & 0xFFFFFF).to(tl.int32).to(tl.float32) * (1.0 / 16777216.0)
    frac = tl.where(frac >= 0.5, frac - 1.0, frac)
    angle = frac * 6.283185307179586
    if FAST_TRIG:
        cos = tl.inline_asm_elementwise(
            "cos.approx.f32 $0, $1;", "=f,f", [angle], dtype=tl.float32, is_pure=True, pack=1
        )
        sin = tl.inline_asm_elementwise(
            "sin.approx.f32 $0, $1;", "=f,f", [angle], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        cos = tl.cos(angle)
        sin = tl.sin(angle)
    return cos, sin


@triton.jit
def _load_halves(base, rows64, stride_t, m_ok, offs_f, HALF: tl.constexpr):
    """The two rotate-half halves of a (rows, D) tile as float32, zero-padded."""
    mask = m_ok[:, None] & (offs_f[None, :] < HALF)
    ptrs = base + rows64[:, None] * stride_t + offs_f[None, :]
    x1 = tl.load(ptrs, mask=mask, other=0.0)
    x2 = tl.load(ptrs + HALF, mask=mask, other=0.0)
    return x1.to(tl.float32), x2.to(tl.float32)


@triton.jit
def _rotated_probabilities(
    q1, q2, k1, k2, cos, sin, m_ok, qk_scale, dtype,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """RoPE on the q/k halves in registers, then the unnormalised softmax numerator of the
    block's scores (``exp2`` of the max-shifted, masked scores) and the rotated q/k halves."""
    qr1 = (q1 * cos - q2 * sin).to(dtype)
    qr2 = (q2 * cos + q1 * sin).to(dtype)
    kr1 = (k1 * cos - k2 * sin).to(dtype)
    kr2 = (k2 * cos + k1 * sin).to(dtype)
    s = _dot(qr1, tl.trans(kr1), DOT_PRECISION, UPCAST)
    s += _dot(qr2, tl.trans(kr2), DOT_PRECISION, UPCAST)
    s = tl.where(m_ok[None, :], s * qk_scale, float("-inf"))
    p = tl.math.exp2(s - tl.max(s, 1)[:, None])
    return p, qr1, qr2, kr1, kr2


@triton.jit
def _fwd_heads(
    q_ptr, k_ptr, v_ptr, o_ptr, rows64, m_ok, offs_f, offs_d, d_ok, cos, sin, head0,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    qk_scale, h,
    HALF: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):  # fmt: skip
    """Attention of head ``head0 + h`` of one block (q and k rotated in registers)."""
    head = (head0 + h).to(tl.int64)
    q1, q2 = _load_halves(q_ptr + head * stride_qh, rows64, stride_qt, m_ok, offs_f, HALF)
    k1, k2 = _load_halves(k_ptr + head * stride_kh, rows64, stride_kt, m_ok, offs_f, HALF)
    v = tl.load(
        v_ptr + head * stride_vh + rows64[:, None] * stride_vt + offs_d[None, :],
        mask=m_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    dtype = v.dtype
    p, _, _, _, _ = _rotated_probabilities(
        q1, q2, k1, k2, cos, sin, m_ok, qk_scale, dtype, DOT_PRECISION, UPCAST
    )
    inv_l = 1.0 / tl.sum(p, 1)
    out = _dot(p.to(dtype), v, DOT_PRECISION, UPCAST) * inv_l[:, None]
    tl.store(
        o_ptr + head * stride_oh + rows64[:, None] * stride_ot + offs_d[None, :],
        out.to(o_ptr.dtype.element_ty),
        mask=m_ok[:, None] & d_ok[None, :],
    )


@triton.jit(do_not_specialize=["num_samples", "num_items"])
def block_attn_fwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, meta_ptr, freq_ptr, pos_ptr, blocks_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    num_samples, block_size, qk_scale, num_items, head_groups,
    HEADS_PER_PROGRAM: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_POS: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    FAST_TRIG: tl.constexpr,
):  # fmt: skip
    """Items are (block, group of heads), block-major. Program ``p`` of ``P`` runs items ``p,
    p + P, ...`` (``P`` = items: one item each). A block's first row, row count and first
    position come from the per-block table ``blocks_ptr`` (three independent loads, where the
    backward derives them from the offsets by three dependent ones). With one head per item
    the head loop folds away and the item loop is the software-pipelined one (the next item's
    loads overlap this one's math)."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_f = tl.arange(0, BLOCK_HALF)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    for item in range(tl.program_id(0), num_items, tl.num_programs(0)):
        block = (item // head_groups).to(tl.int64)
        info = blocks_ptr + block * 3
        row0 = tl.load(info)
        num_rows = tl.load(info + 1)
        first_pos = tl.load(info + 2)
        m_ok = offs_m < num_rows
        rows64 = row0 + offs_m.to(tl.int64)
        cos, sin = _rope_tables(pos_ptr, row0, first_pos, offs_m, m_ok, freq_ptr, HALF,
                                BLOCK_HALF, HAS_POS, FAST_TRIG)  # fmt: skip
        head0 = (item % head_groups) * HEADS_PER_PROGRAM
        for h in range(HEADS_PER_PROGRAM):
            _fwd_heads(
                q_ptr, k_ptr, v_ptr, o_ptr, rows64, m_ok, offs_f, offs_d, d_ok, cos, sin, head0,
                stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot,
                stride_oh, qk_scale, h, HALF, HEAD_DIM, DOT_PRECISION, UPCAST,
            )  # fmt: skip


@triton.jit
def _store_halves(base, rows64, stride_t, m_ok, offs_f, x1, x2, HALF: tl.constexpr):
    mask = m_ok[:, None] & (offs_f[None, :] < HALF)
    ptrs = base + rows64[:, None] * stride_t + offs_f[None, :]
    tl.store(ptrs, x1.to(base.dtype.element_ty), mask=mask)
    tl.store(ptrs + HALF, x2.to(base.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["num_samples"])
def block_attn_bwd_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    do_ptr,
    dq_ptr,
    dk_ptr,
    dv_ptr,
    meta_ptr,
    freq_ptr,
    pos_ptr,
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
    stride_dkt,
    stride_dkh,
    stride_dvt,
    stride_dvh,
    num_samples,
    block_size,
    qk_scale,
    scale,
    HEADS_PER_PROGRAM: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_POS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    FAST_TRIG: tl.constexpr,
):
    """dq, dk and dv of one block in one pass (the block is its own softmax: no atomics)."""
    pid = tl.program_id(0).to(tl.int64)
    row0, num_rows, first_pos = _locate_block(meta_ptr, num_samples, block_size, pid)
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < num_rows
    rows64 = row0 + offs_m.to(tl.int64)
    offs_f = tl.arange(0, BLOCK_HALF)
    offs_d = tl.arange(0, BLOCK_D)
    md_ok = m_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    cos, sin = _rope_tables(pos_ptr, row0, first_pos, offs_m, m_ok, freq_ptr, HALF, BLOCK_HALF,
                            HAS_POS, FAST_TRIG)  # fmt: skip
    head0 = tl.program_id(1) * HEADS_PER_PROGRAM
    for h in range(HEADS_PER_PROGRAM):
        head = (head0 + h).to(tl.int64)
        q1, q2 = _load_halves(q_ptr + head * stride_qh, rows64, stride_qt, m_ok, offs_f, HALF)
        k1, k2 = _load_halves(k_ptr + head * stride_kh, rows64, stride_kt, m_ok, offs_f, HALF)
        tile = rows64[:, None] * stride_vt + offs_d[None, :]
        v = tl.load(v_ptr + head * stride_vh + tile, mask=md_ok, other=0.0)
        d_out = tl.load(
            do_ptr + head * stride_doh + rows64[:, None] * stride_dot + offs_d[None, :],
            mask=md_ok,
            other=0.0,
        )
        dtype = v.dtype
        p, qr1, qr2, kr1, kr2 = _rotated_probabilities(
            q1, q2, k1, k2, cos, sin, m_ok, qk_scale, dtype, DOT_PRECISION, UPCAST
        )
        p = p * (1.0 / tl.sum(p, 1))[:, None]
        # Padding rows have dO = 0, so they add nothing to dv, dk (their dS row is 0).
        dv = _dot(tl.trans(p.to(dtype)), d_out, DOT_PRECISION, UPCAST)
        dp = _dot(d_out, tl.trans(v), DOT_PRECISION, UPCAST)
        delta = tl.sum(p * dp, 1)
        ds = (p * (dp - delta[:, None]) * scale).to(dtype)
        dqr1 = _dot(ds, kr1, DOT_PRECISION, UPCAST)
        dqr2 = _dot(ds, kr2, DOT_PRECISION, UPCAST)
        ds_t = tl.trans(ds)
        dkr1 = _dot(ds_t, qr1, DOT_PRECISION, UPCAST)
        dkr2 = _dot(ds_t, qr2, DOT_PRECISION, UPCAST)
        # Backward of the rotation: its transpose (rotate by -angle).
        _store_halves(dq_ptr + head * stride_dqh, rows64, stride_dqt, m_ok, offs_f,
                      dqr1 * cos + dqr2 * sin, dqr2 * cos - dqr1 * sin, HALF)  # fmt: skip
        _store_halves(dk_ptr + head * stride_dkh, rows64, stride_dkt, m_ok, offs_f,
                      dkr1 * cos + dkr2 * sin, dkr2 * cos - dkr1 * sin, HALF)  # fmt: skip
        tl.store(
            dv_ptr + head * stride_dvh + rows64[:, None] * stride_dvt + offs_d[None, :],
            dv.to(dv_ptr.dtype.element_ty),
            mask=md_ok,
        )
