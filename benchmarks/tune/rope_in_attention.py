"""Exploration: what RoPE inside an attention kernel's loads would cost, against the separate
rotation the sequence layers run today (``gem_kernels.rope_qkv`` before JFA, 6.7 ms of the h200
step's kernels, forward and backward).

A minimal causal window-256 flash-attention forward over a dense ``(B*H, L, D)`` batch at the
h200 recipe's JFA tiles (64x32, 4 warps, D=128), with ``ROPE=False`` (q and k rotated before)
and ``ROPE=True`` (q rotated once per program, every key tile rotated as it is loaded, from its
rows, their rotate-half partners and the ``(L, D/2)`` float32 tables). The two are checked
against each other and timed beside ``rope_qkv``'s forward on the same tokens. This is not
JFA: the difference says what fused loads add to a kernel of this shape, to weigh against the
rotation they remove. The backward's two kernels would rotate in their loops too.

    PYTHONPATH=packages/gem-kernels/src python benchmarks/tune/rope_in_attention.py [--json F]
    TRITON_INTERPRET=1 ... --check-only      # the CPU check at a small shape
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
import triton
import triton.language as tl


@triton.jit
def _rotated_rows(x_ptr, rows, cols, partner, sign, cos_ptr, sin_ptr, HALF: tl.constexpr):
    """The rotate-half RoPE of the tile at ``rows`` x ``cols`` of a row-major ``(n, D)``
    tensor, as a (rows, cols) tile."""
    x = tl.load(x_ptr + rows[:, None] * (2 * HALF) + cols[None, :]).to(tl.float32)
    y = tl.load(x_ptr + rows[:, None] * (2 * HALF) + partner[None, :]).to(tl.float32)
    table = rows[:, None] * HALF + (cols % HALF)[None, :]
    return x * tl.load(cos_ptr + table) + y * sign[None, :] * tl.load(sin_ptr + table)


@triton.jit
def _rotated_cols(x_ptr, rows, cols, partner, sign, cos_ptr, sin_ptr, HALF: tl.constexpr):
    """The same tile loaded as (cols, rows), the orientation the key side of the dot wants
    (Triton needs one return type per function, so the orientations are two functions)."""
    x = tl.load(x_ptr + rows[None, :] * (2 * HALF) + cols[:, None]).to(tl.float32)
    y = tl.load(x_ptr + rows[None, :] * (2 * HALF) + partner[:, None]).to(tl.float32)
    table = rows[None, :] * HALF + (cols % HALF)[:, None]
    return x * tl.load(cos_ptr + table) + y * sign[:, None] * tl.load(sin_ptr + table)


@triton.jit
def window_attention_fwd(
    q_ptr, k_ptr, v_ptr, o_ptr, cos_ptr, sin_ptr, seq_len, qk_scale,
    WINDOW: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ROPE: tl.constexpr,
):  # fmt: skip
    start_m = tl.program_id(0) * BLOCK_M
    base = tl.program_id(1).to(tl.int64) * seq_len * D
    q_ptr, k_ptr, v_ptr, o_ptr = q_ptr + base, k_ptr + base, v_ptr + base, o_ptr + base
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    partner = (offs_d + D // 2) % D
    sign = tl.where(offs_d < D // 2, -1.0, 1.0)
    if ROPE:
        q = _rotated_rows(q_ptr, offs_m, offs_d, partner, sign, cos_ptr, sin_ptr, D // 2)
        q = q.to(v_ptr.dtype.element_ty)
    else:
        q = tl.load(q_ptr + offs_m[:, None] * D + offs_d[None, :])
    m_i = tl.full((BLOCK_M,), -1.0e30, tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    lo = tl.maximum(start_m - WINDOW, 0) // BLOCK_N * BLOCK_N
    for start in range(lo, start_m + BLOCK_M, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        if ROPE:
            kt = _rotated_cols(k_ptr, offs_n, offs_d, partner, sign, cos_ptr, sin_ptr, D // 2)
            kt = kt.to(v_ptr.dtype.element_ty)
        else:
            kt = tl.load(k_ptr + offs_n[None, :] * D + offs_d[:, None])
        v = tl.load(v_ptr + offs_n[:, None] * D + offs_d[None, :])
        s = tl.dot(q, kt) * qk_scale
        gap = offs_m[:, None] - offs_n[None, :]
        s = tl.where((gap >= 0) & (gap <= WINDOW), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(o_ptr + offs_m[:, None] * D + offs_d[None, :], out.to(o_ptr.dtype.element_ty))


def attention(q, k, v, cos, sin, window, rope, block_m, block_n, warps):
    """``(B*H, L, D)`` contiguous q, k, v; q and k rotated by position inside when ``rope``."""
    bh, seq_len, dim = q.shape
    out = torch.empty_like(q)
    grid = (seq_len // block_m, bh)
    window_attention_fwd[grid](
        q, k, v, out, cos, sin, seq_len, math.log2(math.e) / math.sqrt(dim),
        WINDOW=window, D=dim, BLOCK_M=block_m, BLOCK_N=block_n, ROPE=rope, num_warps=warps,
    )  # fmt: skip
    return out


def _rope_dense(x, cos, sin):
    """Rotate-half RoPE of ``(B*H, L, D)`` by each row's index, in float32, rounded once."""
    half = x.shape[-1] // 2
    x1, x2 = x.float()[..., :half], x.float()[..., half:]
    c, s = cos[: x.shape[1]], sin[: x.shape[1]]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1).to(x.dtype)


def check(device, dtype, batch_heads, seq_len, dim, window, block_m, block_n, warps) -> float:
    from gem_kernels.reference import rope_tables

    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (
        torch.randn(batch_heads, seq_len, dim, generator=gen, device=device).to(dtype)
        for _ in range(3)
    )
    cos, sin = rope_tables(seq_len, dim, device=device)
    fused = attention(q, k, v, cos, sin, window, True, block_m, block_n, warps)
    rotated = attention(
        _rope_dense(q, cos, sin), _rope_dense(k, cos, sin), v, cos, sin, window, False,
        block_m, block_n, warps,
    )  # fmt: skip
    return float((fused.float() - rotated.float()).abs().max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check-only", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.check_only:
        error = check("cpu", torch.float32, 2, 64, 16, 24, 16, 16, 1)
        print(f"max |fused - rotated first| = {error:.2e}")
        assert error < 1e-4
        return
    from gem_kernels import rope_qkv
    from gem_kernels.reference import rope_tables
    from triton.testing import do_bench

    device, dtype = torch.device("cuda"), torch.bfloat16
    heads, dim, seq_len, window = 4, 128, 512, 256
    batch = 1024  # 524k tokens, the h200 recipe's batch
    error = check(device, dtype, 8, seq_len, dim, window, 64, 32, 4)
    gen = torch.Generator(device=device).manual_seed(1)
    q, k, v = (
        torch.randn(batch * heads, seq_len, dim, generator=gen, device=device, dtype=dtype)
        for _ in range(3)
    )
    cos, sin = rope_tables(seq_len, dim, device=device)
    ms = {
        f"fwd_rope_{rope}": do_bench(
            lambda rope=rope: attention(q, k, v, cos, sin, window, rope, 64, 32, 4),
            warmup=50,
            rep=300,
        )  # fmt: skip
        for rope in (False, True)
    }
    qkv = torch.randn(batch * seq_len, 3, heads, dim, generator=gen, device=device, dtype=dtype)
    positions = torch.arange(seq_len, device=device).repeat(batch)
    ms["rope_qkv_fwd"] = do_bench(lambda: rope_qkv(qkv, positions, cos, sin), warmup=50, rep=300)
    result = {
        "meta": {
            "shape": f"B{batch} x L{seq_len} x H{heads} x D{dim}, causal window {window}",
            "tiles": "64x32, 4 warps",
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "triton": triton.__version__,
        },
        "max_abs_diff_fused_vs_rotated_first": error,
        "ms": ms,
        "added_by_fused_loads_ms": ms["fwd_rope_True"] - ms["fwd_rope_False"],
    }
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
