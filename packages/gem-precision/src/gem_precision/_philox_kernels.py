"""Triton kernel of gem-precision's Philox stream (:func:`gem_precision.philox_uint32`).

Loaded by :mod:`gem_precision.rounding` through ``gem_kernels.triton_loader`` (never imported
directly), like ``_quant_kernels``. The PyTorch implementation takes ~100 element-wise kernels
per call (ten rounds of 64-bit arithmetic); on a GPU that made every stochastically rounded
gradient cost several milliseconds of launches. This kernel is one launch.

The rounds are written out here rather than taken from ``tl.randint``: Triton's handling of
64-bit offsets changed between versions, and the stream must equal the PyTorch one bit for bit
on every device (key ``(seed lo, seed hi)``, counter ``(c lo, c hi, 0, 0)``, ``c = offset + i``).
The offset is loaded from a one-element int64 tensor: a counter kept on the GPU is never read on
the host, and Triton does not specialise the kernel on its value as it does on int arguments.
"""

from __future__ import annotations

import triton
import triton.language as tl

_M0 = tl.constexpr(0xD2511F53)
_M1 = tl.constexpr(0xCD9E8D57)
_W0 = tl.constexpr(0x9E3779B9)
_W1 = tl.constexpr(0xBB67AE85)


@triton.jit
def philox_uint32_kernel(out_ptr, numel, offset_ptr, seed_lo, seed_hi, BLOCK: tl.constexpr):
    """``out[i]`` (int64) = first word of Philox-4x32-10 for counter ``offset + i``, with
    ``offset = offset_ptr[0]``."""
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    # Python ints arrive as int32, uint32, int64 or (when 1) a constexpr depending on their
    # value: adding them to an int64 block makes all of them int64 blocks.
    zero = idx * 0
    counter = idx + tl.load(offset_ptr)
    c0 = (counter & 0xFFFFFFFF).to(tl.uint32)
    c1 = (counter >> 32).to(tl.uint32)
    c2 = c0 * 0
    c3 = c0 * 0
    k0 = ((zero + seed_lo) & 0xFFFFFFFF).to(tl.uint32)
    k1 = ((zero + seed_hi) & 0xFFFFFFFF).to(tl.uint32)
    for _ in tl.static_range(10):
        hi0 = tl.umulhi(c0, _M0)
        hi1 = tl.umulhi(c2, _M1)
        lo0 = c0 * _M0
        lo1 = c2 * _M1
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = k0 + _W0
        k1 = k1 + _W1
    tl.store(out_ptr + idx, c0.to(tl.int64) & 0xFFFFFFFF, mask=idx < numel)
