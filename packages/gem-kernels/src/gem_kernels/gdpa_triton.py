"""Triton implementation of GDPA (``act(scale * Q K^T) V``): work lists, schedules, autograd.

The kernels live in ``_gdpa_kernels.py``. :func:`gdpa_triton` runs them on validated input (the
public, validating entry point is :func:`gem_kernels.gdpa`, which dispatches here).

Jagged scheduling. The host builds one work list per kernel from the sample lengths: one item
per ``(tile, head)`` of every sample that has rows (no item exists for padding) with its
amount of work (key or query tiles it will visit). The kernels are persistent: program ``p`` of
``P`` runs items ``p, p + P, ...``. The list is sorted longest-first and dealt in zigzag (round
0 to programs ``0..P-1``, round 1 to ``P-1..0``, ...), ``P`` = SMs x programs per SM; sample
order dealt round-robin and one program per item both balanced worse (docs/kernel-tuning.md).
:func:`schedule_loads` gives the per-program work of that dealing. Shapes: self (queries and keys share lengths), cross (own key lengths) and PMA
(``Nq`` shared queries over every sample's keys). Cross/PMA calls whose samples all have at
most ``short_kv_max`` keys use a short-KV forward that loads a sample's whole K and V once and
streams a run of query tiles past them. Backward, without atomics: dK/dV per key tile (loop
over the query tiles that see it), dQ per query tile (loop over key tiles); for PMA each
sample's dQ is written to its own rows and the samples are summed on the host. The unmasked
self/cross default (``bwd_loop="fused"``) instead adds dQ from the dK/dV loop with float32 atomics
(one kernel, S and dP computed once; dQ's summation order is not fixed).

Split work with deterministic combines (float32 partials, summed in a fixed order by
``segment_sum_kernel``, never atomics): the PMA dQ (and the PMA forward with a mask) split every
sample's keys into ``pma_kv_chunk`` chunks (one program per (sample, head) has too few bytes in
flight); the unmasked PMA forward streams instead (``GdpaTritonConfig.pma_stream``): program
``p`` runs an equal, contiguous share of all (sample, head, key tile) steps in one pipelined
loop, and the segments that straddle two programs are summed from float32 partials by
``gdpa_pma_combine_kernel``;
cross-attention dK/dV split samples with more than ``dkdv_q_chunk`` queries into query chunks
(a key tile of a short KV otherwise walks thousands of query rows alone). Samples that fit in
one chunk write their result directly.

Plans (work tables and combines) are cached by lengths, heads, masks and config, so a repeated
call costs one lengths copy to the host and a dictionary lookup. Host time matters: the PMA
forward takes ~0.15 ms on an H200, and an eager call whose host work is longer is bound by it
(see docs/kernel-tuning.md).

``precision="fp8"``: one Triton launch per operand quantises q, k, v to the values of
:func:`gem_kernels.reference.gdpa_fp8_operands` (the emulation's), stores v keys-contiguous in
whole 128-token blocks (the K-major operand Hopper's FP8 MMA needs for A V; the work items
carry each sample's first slot), and runs the phased forward with ``FP8=True``. A's E4M3
scales are made in the kernel, per row of a ``reference.FP8_ACT_TILE``-key tile, the tile the
config is set to along that reduction. The one-loop, pipelined, warp-specialised, short-KV and
streamed-PMA forwards have no FP8 mode: FP8 calls run the phased forward whatever the config
says. The backward is the bf16 one, on the input-precision operands.

CPU tensors run under the Triton interpreter when ``TRITON_INTERPRET=1`` is set at call time.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, fields, replace
from pathlib import Path
from types import ModuleType

import numpy as np
import torch

from gem_kernels import _triton_host as host
from gem_kernels import reference
from gem_kernels.fp8_quantize import padded_starts, quantize_fp8_blocks
from gem_kernels.triton_loader import load_kernel_module

__all__ = [
    "GDPA_BWD_LOOPS",
    "GDPA_CONFIGS",
    "GDPA_FWD_LOOPS",
    "GELU_FAST_F16_MAX_ABS_ERROR",
    "GdpaFunction",
    "GdpaTritonConfig",
    "MAX_TRITON_HEAD_DIM",
    "SHORT_SEQUENCE_LEN",
    "backward_from_lengths",
    "default_config",
    "descriptor_layout",
    "forward_from_lengths",
    "gdpa_from_lengths",
    "gdpa_triton",
    "schedule_loads",
    "triton_unsupported_reason",
]

#: Largest head dimension the Triton kernels take (bigger ones go to the reference).
MAX_TRITON_HEAD_DIM = 256
#: Bound on ``|x * cdf - gelu(x)|`` of the packed path (``GdpaTritonConfig.packed_gelu``): the
#: polynomial CDF in float16 (coefficients rounded to float16, fused multiply-adds), times x in
#: float32, before the bfloat16 rounding the PV MMA applies anyway (measured 4.13e-3 at
#: x ~= -2.92 on a dense grid; 1.4e-3 for |x| <= 1). Exact tails (x or 0) past |x| ~= 3.42.
GELU_FAST_F16_MAX_ABS_ERROR = 4.5e-3
#: Values of ``GdpaTritonConfig.fwd_loop``, the self/cross forward's key loop when no causal or
#: window mask applies (masked calls run the phased loop whatever the value):
#:
#: * ``"phased"``: masked first tiles, unmasked tiles inside the band, masked last tiles;
#: * ``"one_loop"``: one loop over a query tile's key tiles with no score mask (key rows past
#:   the sample's end load as zeros and act(0) = 0); K and V through per-item TMA descriptors
#:   that end at the sample's last key where rows are 16-byte aligned, pointer loads otherwise.
#:   The short-KV forward drops its score mask too;
#: * ``"pipelined"``: ``"one_loop"`` issuing the next key tile's ``Q K^T`` before this tile's
#:   activation (software pipelining by hand);
#: * ``"warp_specialized"``: ``"one_loop"`` under Triton's automatic warp specialisation (on
#:   Hopper a producer warpgroup issues the TMA loads, two 4-warp consumer groups split the
#:   128-row tile): needs ``fwd_warps=4`` and ``fwd_stages <= 2`` (3 gave NaN on triton 3.6), and
#:   Q, K, V readable through whole-tensor descriptors (:func:`descriptor_layout`; other calls
#:   run ``"one_loop"``).
GDPA_FWD_LOOPS = ("phased", "one_loop", "pipelined", "warp_specialized")
#: Values of ``GdpaTritonConfig.bwd_loop``, the self/cross backward (PMA always runs the
#: phased kernels):
#:
#: * ``"phased"``: dK/dV and dQ kernels, each in masked / inside-the-band / masked phases;
#: * ``"fused"``: one kernel per (key tile, head) keeps dK, dV on chip, computes S and dP once
#:   per query tile and adds that tile's dQ rows to a zeroed float32 buffer with atomic adds
#:   (summation order not fixed); without a causal or window mask its query tiles run in one
#:   loop with masked loads and no score mask. Under ``torch.use_deterministic_algorithms(True)``
#:   the dQ rows come from the dQ kernel (one loop likewise).
GDPA_BWD_LOOPS = ("phased", "fused")

_ACTIVATION_CODES = {
    "silu": 0,
    "gelu": 1,
    "gelu_tanh": 2,
    "gelu_fast": 3,
    "relu2": 4,
    "identity": 5,
}
# [q_start, q_len, k_start, k_len, tile_start, out_start, head, tile_end, range_lo, range_hi,
#  dst_start, to_partial, k_slot]: see _gdpa_kernels.py (its TABLE_WIDTH must match).
# k_slot: the sample's first slot in the FP8 forward's v, stored keys-contiguous
# (fp8_quantize.padded_starts of the key lengths).
_TABLE_WIDTH = 13
_NO_LIMIT = 1 << 30  # range_hi of items that see the whole other side


@dataclass(frozen=True)
class GdpaTritonConfig(host.FlashTileConfig):
    """Tile sizes, launch parameters and schedule of the kernels (tiles: powers of two >= 16).

    The field defaults are the D=128 bfloat16 configuration of masked (causal / window) and
    PMA calls on Hopper, ``GDPA_CONFIGS["d128_masked"]``; :func:`default_config` picks the
    table entry of a call. Each value won an H200 sweep of ``benchmarks/bench_gdpa.py``; the
    numbers, and the variants measured and removed, are in docs/kernel-tuning.md.
    """

    fwd_block_n: int = 64
    """Keys per inner iteration of the forward (64: the 128-key tile spills registers)."""

    short_kv_max: int = 256
    """Cross/PMA calls whose samples all have at most this many keys use the short-KV forward
    (whole K, V of a sample on chip); 0 turns that path off."""
    short_block_m: int = 128
    """Query rows per inner iteration of the short-KV forward."""
    short_rows_per_item: int = 512
    """Query rows one short-KV item streams past its resident K and V."""
    short_warps: int = 8
    """Warps per short-KV forward program."""
    pma_block_n: int = 128
    """PMA: keys per inner iteration of the forward and dQ kernels (their query tile is the
    ``Nq`` shared queries, padded to a power of two >= 16, at most ``fwd_block_m``)."""
    pma_warps: int = 4
    """PMA: warps per forward / dQ program."""
    pma_stages: int = 2
    """PMA: software-pipelining depth of the forward's key loop."""
    pma_programs_per_sm: int = 2
    """PMA: persistent programs per SM of the forward / dQ (memory-bound: several programs
    per SM hide each other's pipeline fill)."""
    short_stages: int = 2
    """Software-pipelining depth of the short-KV forward's query loop."""
    programs_per_sm: int = 1
    """Persistent programs per SM of the kernels that have no count of their own."""
    pma_kv_chunk: int = 1024
    """PMA (generic path): keys per split-KV item of the forward and dQ (rounded up to a
    multiple of their key tiles); each (sample, chunk, head) writes a float32 partial that a
    second pass sums in a fixed order. 0: one item per (sample, head)."""
    pma_dq_block_n: int = 64
    """PMA: keys per inner iteration of the dQ kernel."""
    dkdv_q_chunk: int = 2048
    """Cross attention: query rows per dK/dV item of samples with more queries than this
    (float32 partials per chunk, summed in a fixed order by a second pass); 0: no split."""
    pma_stream: bool = True
    """PMA forward without window or causal mask (and Nq <= ``fwd_block_m``): each of
    ``pma_programs_per_sm`` x SMs programs streams an equal share of all (sample, head, key
    tile) steps in one pipelined loop (``pma_block_n`` keys, ``pma_warps``, ``pma_stages``): no
    tail wave, and the next tile's loads overlap this one's math across segment ends. Segments
    shared by two programs go through float32 partials summed in a fixed order. Off (and for
    masked PMA): the split-KV items (``pma_kv_chunk``)."""
    packed_gelu: bool = True
    """``gelu_fast`` on bfloat16 inputs, self and cross attention: evaluate the polynomial CDF
    in packed f16x2 arithmetic (inline PTX, two elements per instruction; the same math in
    plain tl under the interpreter). Max abs error against exact GELU before the bfloat16
    rounding of P: ``GELU_FAST_F16_MAX_ABS_ERROR`` (float32 path: 1.07e-3)."""
    fwd_programs_per_sm: int = 0
    """Persistent programs per SM of the self/cross forward (not the short-KV one); 0: use
    ``programs_per_sm``."""
    bwd_programs_per_sm: int = 0
    """Persistent programs per SM of the self/cross dK/dV and dQ kernels; 0: use
    ``programs_per_sm``."""
    fwd_loop: str = "phased"
    """The unmasked self/cross forward's key loop, one of ``GDPA_FWD_LOOPS``."""
    bwd_loop: str = "phased"
    """The self/cross backward, one of ``GDPA_BWD_LOOPS``."""

    def __hash__(self) -> int:
        # Every call hashes its config several times (config, plan and flag caches): hash the
        # fields once per instance. Not pickled (str hashes differ between processes).
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash(tuple(getattr(self, f.name) for f in fields(self)))
            object.__setattr__(self, "_hash", cached)
        return cached

    def __getstate__(self) -> dict:
        return {key: value for key, value in self.__dict__.items() if key != "_hash"}


_MASKED = GdpaTritonConfig()
# Only the D=128 bfloat16 tiles were measured with packing and 2 PMA programs per SM.
_UNMEASURED = dict(pma_programs_per_sm=1, packed_gelu=False)
_UNMASKED = dict(bwd_loop="fused", bwd_programs_per_sm=2, short_rows_per_item=4096, dkdv_q_chunk=0)

#: The configurations :func:`default_config` chooses from (Hopper; other GPUs take the same
#: entries unmeasured), each with the reason it is the one.
GDPA_CONFIGS: dict[str, host.TunedConfig] = {
    "interpret": host.TunedConfig(
        GdpaTritonConfig(
            fwd_block_m=16,
            fwd_block_n=16,
            fwd_warps=1,
            fwd_stages=1,
            dkdv_block_n=16,
            dkdv_block_m=16,
            dq_block_m=16,
            dq_block_n=16,
            bwd_warps=1,
            bwd_stages=1,
            short_kv_max=256,
            short_block_m=16,
            short_rows_per_item=32,
            short_warps=1,
            pma_block_n=16,
            pma_warps=1,
            pma_stages=1,
            pma_kv_chunk=32,
            pma_dq_block_n=16,
            dkdv_q_chunk=32,
        ),
        "the Triton interpreter on the CPU: 16-row tiles, so that tests with short samples "
        "still cross tile, chunk and split boundaries",
    ),
    "d64": host.TunedConfig(
        GdpaTritonConfig(
            fwd_block_m=128,
            fwd_block_n=64,
            fwd_warps=4,
            fwd_stages=3,
            dkdv_block_n=128,
            dkdv_block_m=64,
            dq_block_m=128,
            dq_block_n=64,
            bwd_warps=8,
            bwd_stages=2,
            **_UNMEASURED,
        ),
        "head_dim <= 64: half the D=128 operand bytes fit 128x64 forward tiles in 4 warps",
    ),
    "d128_masked": host.TunedConfig(
        _MASKED,
        "head_dim 65..128 in 16-bit: causal / window calls, PMA (whose kernels were tuned "
        "with it) and float16 (the loop variants were measured in bfloat16 only)",
    ),
    "d128_short": host.TunedConfig(
        replace(
            _MASKED,
            fwd_block_n=128,
            fwd_warps=4,
            fwd_stages=2,
            fwd_programs_per_sm=1,
            fwd_loop="warp_specialized",
            short_kv_max=0,
            **_UNMASKED,
        ),  # fmt: skip
        "bfloat16, unmasked, keys <= SHORT_SEQUENCE_LEN, whole-tensor descriptors: the "
        "warp-specialised 128x128 forward beat the pipelined loop and the short-KV kernel",
    ),
    "d128_short_strided": host.TunedConfig(
        replace(
            _MASKED,
            fwd_block_m=64,
            fwd_block_n=32,
            fwd_warps=4,
            fwd_programs_per_sm=3,
            fwd_loop="one_loop",
            **_UNMASKED,
        ),  # fmt: skip
        "as d128_short without whole-tensor descriptors: 64x32 one-loop tiles, 3 programs "
        "per SM (the warp-specialised loop's pointer-load fallback spills registers)",
    ),
    "d128_long": host.TunedConfig(
        replace(_MASKED, fwd_stages=4, fwd_programs_per_sm=2, fwd_loop="pipelined", **_UNMASKED),
        "bfloat16, unmasked, keys > SHORT_SEQUENCE_LEN or unknown: the hand-pipelined "
        "128x64 loop (warp specialisation lost at 4096 keys)",
    ),
    "d128_fp32": host.TunedConfig(
        GdpaTritonConfig(
            fwd_block_m=64,
            fwd_block_n=64,
            fwd_warps=4,
            fwd_stages=2,
            dkdv_block_n=64,
            dkdv_block_m=32,
            dq_block_m=64,
            dq_block_n=32,
            bwd_warps=4,
            bwd_stages=2,
            short_kv_max=128,
            short_block_m=32,
            short_rows_per_item=256,
            short_warps=4,
            pma_block_n=32,
            pma_warps=4,
            pma_stages=2,
            **_UNMEASURED,
        ),
        "float32, head_dim 65..128: operands take twice the shared memory, so tiles halve",
    ),
    "d256": host.TunedConfig(
        GdpaTritonConfig(
            fwd_block_m=64,
            fwd_block_n=32,
            fwd_warps=4,
            fwd_stages=2,
            dkdv_block_n=64,
            dkdv_block_m=32,
            dq_block_m=64,
            dq_block_n=32,
            bwd_warps=4,
            bwd_stages=2,
            short_kv_max=128,
            short_block_m=16,
            short_rows_per_item=256,
            short_warps=4,
            pma_block_n=32,
            pma_warps=4,
            pma_stages=2,
            **_UNMEASURED,
        ),
        "head_dim 129..256 (16-bit): twice the D=128 operand bytes, 64x32 tiles",
    ),
}

#: Longest key length (over a call's samples) for which unmasked bfloat16 self/cross calls at
#: head_dim 65..128 take ``d128_short`` / ``d128_short_strided`` (see :func:`default_config`).
SHORT_SEQUENCE_LEN = 1024


def default_config(
    head_dim: int,
    *,
    interpret: bool = False,
    dtype: torch.dtype = torch.bfloat16,
    max_len: int | None = None,
    masked: bool = False,
    descriptor_layout: bool = True,
) -> GdpaTritonConfig:
    """The ``GDPA_CONFIGS`` entry of a call.

    ``max_len``: the longest key length of the call (``None``: unknown). ``masked``: a causal
    or window mask (:func:`gdpa_from_lengths` also passes it for PMA). ``descriptor_layout``:
    q, k and v can be read through whole-tensor TMA descriptors (:func:`descriptor_layout`).
    The entry is ``"interpret"`` under the interpreter, else by head_dim: ``"d64"`` up to 64,
    ``"d256"`` above 128; at 65..128 ``"d128_fp32"`` for float32, ``"d128_masked"`` for masked
    and float16 calls, and for unmasked bfloat16 calls ``"d128_short"`` (or
    ``"d128_short_strided"`` without descriptors) up to ``SHORT_SEQUENCE_LEN`` keys and
    ``"d128_long"`` beyond.
    """
    return GDPA_CONFIGS[
        _config_name(head_dim, interpret, dtype, max_len, masked, descriptor_layout)
    ].config


def _config_name(head_dim, interpret, dtype, max_len, masked, descriptor_layout) -> str:
    if interpret:
        return "interpret"
    if head_dim <= 64:
        return "d64"
    if head_dim > 128:
        return "d256"
    if dtype == torch.float32:
        return "d128_fp32"
    if masked or dtype != torch.bfloat16:
        return "d128_masked"
    if max_len is not None and max_len <= SHORT_SEQUENCE_LEN:
        return "d128_short" if descriptor_layout else "d128_short_strided"
    return "d128_long"


# ---------------------------------------------------------------------------------------------
# Kernel module loading (compiled or interpreted).


_KERNEL_FILE = Path(__file__).with_name("_gdpa_kernels.py")


def _kernels(interpret: bool) -> ModuleType:
    """The kernel module decorated for this mode (compiled for CUDA, interpreted for CPU tests)."""
    return load_kernel_module(_KERNEL_FILE, interpret)


def triton_unsupported_reason(q: torch.Tensor, *, precision: str = "bf16") -> str | None:
    """Why the Triton path cannot run this call, or ``None`` when it can.

    The Triton path takes float16/bfloat16/float32 on CUDA (float32 with IEEE-exact dot
    products), or CPU tensors when ``TRITON_INTERPRET=1`` is set; head_dim up to
    ``MAX_TRITON_HEAD_DIM`` (128 for float32); ``precision="fp8"`` float16/bfloat16 only.
    """
    extra = None
    if q.dtype == torch.float32 and q.shape[2] > 128:
        extra = f"float32 with head_dim {q.shape[2]} > 128 needs more shared memory than a GPU has"
    elif precision == "fp8" and q.dtype not in (torch.float16, torch.bfloat16):
        extra = f"precision='fp8' takes float16/bfloat16 inputs, got {q.dtype}"
    return host.unsupported_reason(q, MAX_TRITON_HEAD_DIM, extra)


# ---------------------------------------------------------------------------------------------
# Work lists and schedules (host, numpy: a few microseconds per op on small vectors, where
# torch's per-op dispatch would cost more than the kernels of small calls).


@dataclass(frozen=True)
class _Samples:
    """Per-sample int64 numpy vectors shared by every work list."""

    q_len: np.ndarray
    k_len: np.ndarray
    q_start: np.ndarray
    k_start: np.ndarray
    out_start: np.ndarray
    k_slot: np.ndarray


def _samples(q_lengths, k_lengths, num_queries: int | None) -> _Samples:
    k_len = k_lengths.detach().to("cpu", torch.int64).numpy()
    k_start = np.cumsum(k_len) - k_len
    if num_queries is None:
        q_len = q_lengths.detach().to("cpu", torch.int64).numpy()
        q_start = np.cumsum(q_len) - q_len
        out_start = q_start
    else:  # PMA: every sample reads the same Nq query rows and owns Nq output rows
        q_len = np.full_like(k_len, num_queries)
        q_start = np.zeros_like(k_len)
        out_start = np.arange(k_len.size, dtype=np.int64) * num_queries
    k_slot = padded_starts(torch.from_numpy(k_len)).numpy()
    return _Samples(q_len, k_len, q_start, k_start, out_start, k_slot)


def _tiles_of(lengths: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """(sample index, first row within the sample) of every block-sized tile of every sample."""
    per_sample = (lengths + block - 1) // block
    sample = np.repeat(np.arange(lengths.size, dtype=np.int64), per_sample)
    first = np.cumsum(per_sample) - per_sample
    start = (np.arange(sample.size, dtype=np.int64) - first[sample]) * block
    return sample, start


def _ceil_div(a: np.ndarray, b: int) -> np.ndarray:
    return (a + b - 1) // b


def _expand(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(row index, index within the row's group) of ``counts[i]`` copies of every row ``i``."""
    row = np.repeat(np.arange(counts.size, dtype=np.int64), counts)
    first = np.cumsum(counts) - counts
    return row, np.arange(row.size, dtype=np.int64) - first[row]


def _rows(s: _Samples, sample, start, dst_start, range_lo=None, range_hi=None, tile_end=None,
          to_partial=None) -> np.ndarray:  # fmt: skip
    """Work-table rows (head column 0, filled in by :func:`_item_table`)."""
    rows = np.zeros((sample.size, _TABLE_WIDTH), dtype=np.int64)
    rows[:, 0] = s.q_start[sample]
    rows[:, 1] = s.q_len[sample]
    rows[:, 2] = s.k_start[sample]
    rows[:, 3] = s.k_len[sample]
    rows[:, 4] = start
    rows[:, 5] = s.out_start[sample]
    rows[:, 7] = 0 if tile_end is None else tile_end
    rows[:, 8] = 0 if range_lo is None else range_lo
    rows[:, 9] = _NO_LIMIT if range_hi is None else range_hi
    rows[:, 10] = dst_start
    rows[:, 11] = 0 if to_partial is None else to_partial
    rows[:, 12] = s.k_slot[sample]
    # The kernels take the range bounds as 16-divisible (tl.multiple_of in _range_of).
    assert not (rows[:, 8:10] % 16).any(), "range bounds must be multiples of 16"
    return rows


def _chunks(lengths: np.ndarray, chunk: int) -> np.ndarray:
    """Chunks per sample (at least 1, so that empty samples still write their zeros)."""
    if chunk <= 0:
        return np.ones_like(lengths)
    return np.maximum(_ceil_div(lengths, chunk), 1)


def _query_tile_items(s: _Samples, block_m: int, block_n: int, left, right, kv_chunk: int = 0,
                      all_partial: bool = True):  # fmt: skip
    """Query tiles (x key chunks when ``kv_chunk`` > 0): table rows and work (key tiles
    visited, + 1 for the tile itself). Chunked items write row block ``global chunk index *
    q_len`` of a partial buffer (PMA: ``q_len`` = Nq) whose chunks the caller sums; with
    ``all_partial=False`` samples of one chunk write their output rows directly."""
    sample, start = _tiles_of(s.q_len, block_m)
    lq, lk = s.q_len[sample], s.k_len[sample]
    shift = lk - lq
    key_lo = np.zeros_like(start)
    key_hi = lk
    if left is not None:
        key_lo = np.maximum(start + shift - left, 0)
    if right is not None:
        last_row = np.minimum(start + block_m, lq) - 1
        key_hi = np.minimum(lk, last_row + shift + right + 1)
    key_hi = np.maximum(key_hi, key_lo)
    if kv_chunk <= 0:
        work = _ceil_div(key_hi, block_n) - key_lo // block_n + 1
        return _rows(s, sample, start, s.out_start[sample]), work
    counts = _chunks(s.k_len, kv_chunk)
    chunk_first = np.cumsum(counts) - counts
    tile, chunk = _expand(counts[sample])
    sample, start = sample[tile], start[tile]
    range_lo, range_hi = chunk * kv_chunk, (chunk + 1) * kv_chunk
    lo = np.maximum(key_lo[tile], range_lo)
    hi = np.maximum(np.minimum(key_hi[tile], range_hi), lo)
    work = _ceil_div(hi, block_n) - lo // block_n + 1
    dst = (chunk_first[sample] + chunk) * s.q_len[sample]
    split = np.ones_like(dst) if all_partial else (counts[sample] > 1).astype(np.int64)
    dst = np.where(split > 0, dst, s.out_start[sample])
    return _rows(s, sample, start, dst, range_lo, range_hi, to_partial=split), work


def _key_tile_items(s: _Samples, block_n: int, block_m: int, left, right, q_chunk: int = 0):
    """Key tiles (x query chunks of samples longer than ``q_chunk`` > 0): table rows and work
    (query tiles visited, + 1). Split samples write float32 partial rows at
    ``part_start + chunk * k_len``; :func:`_key_partials` gives the combine."""
    sample, start = _tiles_of(s.k_len, block_n)
    lq, lk = s.q_len[sample], s.k_len[sample]
    shift = lk - lq
    row_lo = np.zeros_like(start)
    row_hi = lq
    if right is not None:
        row_lo = np.maximum(start - right - shift, 0)
    if left is not None:
        last_key = np.minimum(start + block_n, lk) - 1
        row_hi = np.minimum(lq, last_key + left - shift + 1)
    row_hi = np.maximum(row_hi, row_lo)
    counts = _chunks(s.q_len, q_chunk)
    if q_chunk <= 0 or int(counts.max(initial=1)) == 1:
        work = _ceil_div(row_hi, block_m) - row_lo // block_m + 1
        return _rows(s, sample, start, s.k_start[sample]), work
    part_start = _key_partial_starts(s, counts)
    tile, chunk = _expand(counts[sample])
    sample, start = sample[tile], start[tile]
    split = counts[sample] > 1
    range_lo = np.where(split, chunk * q_chunk, 0)
    range_hi = np.where(split, (chunk + 1) * q_chunk, _NO_LIMIT)
    lo = np.maximum(row_lo[tile], range_lo)
    hi = np.maximum(np.minimum(row_hi[tile], range_hi), lo)
    work = _ceil_div(hi, block_m) - lo // block_m + 1
    dst = np.where(split, part_start[sample] + chunk * s.k_len[sample], s.k_start[sample])
    rows = _rows(s, sample, start, dst, range_lo, range_hi, to_partial=split.astype(np.int64))
    return rows, work


def _key_partial_starts(s: _Samples, counts: np.ndarray) -> np.ndarray:
    """First partial row of every sample (only samples split in more than one chunk own rows)."""
    sizes = np.where(counts > 1, counts * s.k_len, 0)
    return np.cumsum(sizes) - sizes


def _key_partials(s: _Samples, q_chunk: int) -> tuple[int, np.ndarray] | None:
    """(partial rows, combine entries ``[key row, first, count, step]``) of split dK/dV."""
    counts = _chunks(s.q_len, q_chunk)
    if q_chunk <= 0 or int(counts.max(initial=1)) == 1:
        return None
    part_start = _key_partial_starts(s, counts)
    split = np.flatnonzero(counts > 1)
    sample, local = _expand(s.k_len[split])
    sample = split[sample]
    meta = np.stack(
        [s.k_start[sample] + local, part_start[sample] + local, counts[sample], s.k_len[sample]],
        axis=1,
    )
    rows = int((counts[split] * s.k_len[split]).sum())
    return rows, meta


def _short_kv_items(s: _Samples, rows_per_item: int, block_m: int):
    """Runs of query rows of one sample for the short-KV forward; work = query tiles + 1."""
    sample, start = _tiles_of(s.q_len, rows_per_item)
    lq = s.q_len[sample]
    end = np.minimum(start + rows_per_item, lq)
    work = _ceil_div(end - start, block_m) + 1
    return _rows(s, sample, start, s.out_start[sample], tile_end=end), work


def _pma_stream_steps(s: _Samples, heads: int, block_n: int, num_programs: int):
    """Step list of the streamed PMA forward (``gdpa_pma_fwd_stream_kernel``).

    Steps run sample-major, then head, then key tile (an empty sample gets one step with no
    valid key, so that its zeros are written); program ``p`` runs steps ``[bounds[p],
    bounds[p + 1])``, an equal share. Returns ``(steps, bounds, combine, slots)``: ``combine``
    rows ``[out row, head, first slot, count]`` for segments split over programs, ``slots`` the
    number of float32 ``Nq x D`` partial blocks they write."""
    nq = int(s.q_len[0]) if s.q_len.size else 0
    tiles = np.maximum(_ceil_div(s.k_len, block_n), 1)
    seg_tiles = np.repeat(tiles, heads)
    seg_sample = np.repeat(np.arange(s.k_len.size, dtype=np.int64), heads)
    seg_head = np.tile(np.arange(heads, dtype=np.int64), s.k_len.size)
    seg_first = np.cumsum(seg_tiles) - seg_tiles
    total = int(seg_tiles.sum())
    programs = max(1, min(num_programs, total))
    bounds = (np.arange(programs + 1, dtype=np.int64) * total) // programs
    seg, local = _expand(seg_tiles)
    sample = seg_sample[seg]
    steps = np.zeros((total, 8), dtype=np.int64)
    steps[:, 0] = s.k_start[sample] + local * block_n
    steps[:, 1] = np.clip(s.k_len[sample] - local * block_n, 0, block_n)
    steps[:, 2] = seg_head[seg]
    steps[:, 5] = s.k_len[sample]
    step = np.arange(total, dtype=np.int64)
    program = np.searchsorted(bounds, step, side="right") - 1
    # A fragment is a segment's run of steps on one program; its last step flushes.
    last = (local == seg_tiles[seg] - 1) | np.isin(step + 1, bounds)
    first_prog = program[seg_first]
    last_prog = program[seg_first + seg_tiles - 1]
    split_seg = first_prog != last_prog
    flushes = np.flatnonzero(last)
    partial = split_seg[seg[flushes]]
    slot = np.cumsum(partial) - partial  # consecutive slots, in step order
    out_row = s.out_start[sample[flushes]]
    steps[:, 3] = -1
    steps[flushes, 3] = np.where(partial, slot * nq, out_row)
    steps[flushes, 4] = partial
    split = np.flatnonzero(split_seg)
    count = last_prog[split] - first_prog[split] + 1
    first_slot = np.zeros_like(split)
    if split.size:
        # Slot of each split segment's first fragment: flushes of split segments, in order.
        seg_of_slot = seg[flushes[partial]]
        first_slot = np.searchsorted(seg_of_slot, split)
    combine = np.stack(
        [s.out_start[seg_sample[split]], seg_head[split], first_slot, count], axis=1
    ).reshape(-1, 4)
    return steps, bounds.reshape(-1, 1), combine, int(partial.sum())


def schedule_loads(work, num_programs: int) -> torch.Tensor:
    """Total work of each of ``num_programs`` programs when ``work`` (tensor or array, in list
    order) is dealt as the kernels deal it: longest first, in zigzag (float64 CPU tensor)."""
    work = np.asarray(work, dtype=np.float64)
    order = _longest_first(work)
    rounds = -(-order.size // num_programs)
    padded = np.zeros(rounds * num_programs, dtype=np.float64)
    padded[: order.size] = work[order]
    grid = padded.reshape(rounds, num_programs)
    grid[1::2] = grid[1::2, ::-1].copy()  # odd rounds run from the last program to the first
    return torch.from_numpy(grid.sum(0))


def _longest_first(work: np.ndarray) -> np.ndarray:
    return np.argsort(-work, kind="stable")


def _item_table(base: np.ndarray, work, heads: int, num_programs: int):
    """Expand tiles to (tile, head) items dealt longest-first in zigzag; return (table, grid
    size).

    The heads of a tile have the same work, so tiles are ordered first (a sort of #tiles, not
    #items) and expanded to their heads afterwards, head fastest.
    """
    table = np.repeat(base[_longest_first(work)], heads, axis=0)
    table[:, 6] = np.tile(np.arange(heads, dtype=np.int64), base.shape[0])
    count = table.shape[0]
    if count == 0:
        return table, count
    rounds = -(-count // num_programs)
    # Empty slots (all zeros: q_len = k_len = 0) have nothing to do and write nothing.
    out = np.zeros((rounds * num_programs, _TABLE_WIDTH), dtype=np.int64)
    out[:count] = table
    grid = out.reshape(rounds, num_programs, _TABLE_WIDTH)
    grid[1::2] = grid[1::2, ::-1].copy()  # odd rounds run from the last program to the first
    return out, min(num_programs, out.shape[0])


@dataclass(frozen=True)
class _Plan:
    """Item tables (device int64), grid sizes and partial-sum combines of each kernel."""

    fwd: torch.Tensor
    fwd_grid: int
    short_kv_block: int  # 0: generic forward; else BLOCK_KV of the short-KV forward
    dkdv: torch.Tensor | None
    dkdv_grid: int
    dq: torch.Tensor | None
    dq_grid: int
    stream_bounds: torch.Tensor | None = None  # streamed PMA forward: steps of each program
    stream_slots: int = 0  # streamed PMA forward: float32 Nq x D partial blocks
    fwd_partial_rows: int = 0  # > 0: split-KV forward (PMA), float32 partial row blocks
    fwd_combine: torch.Tensor | None = None  # [out row block, first, count, step] per sample
    dkdv_partial_rows: int = 0  # > 0: split-Q dK/dV, float32 partial rows
    dkdv_combine: torch.Tensor | None = None  # [key row, first, count, step] per split key row
    dq_partial_blocks: int = 0  # PMA: dQ row blocks (one per (sample, key chunk)) to sum


def _pma_block_m(num_queries: int, config: GdpaTritonConfig, fp8_compiled: bool = False) -> int:
    """PMA query tile: Nq padded to a power of two (at least 16; 32 for compiled FP8, the
    smallest tile its forward has run at on a GPU), at most ``fwd_block_m``."""
    least = 32 if fp8_compiled else 16
    return min(config.fwd_block_m, max(least, 1 << max(0, num_queries - 1).bit_length()))


def _plan(s: _Samples, heads, left, right, config, device, with_backward, interpret, pma_m=0):
    """Work lists of every kernel; ``pma_m`` > 0: PMA query tile (rows) of the forward/dQ."""
    programs = host.num_programs(device, config.programs_per_sm, interpret)
    fwd_programs = host.num_programs(
        device, config.fwd_programs_per_sm or config.programs_per_sm, interpret
    )
    bwd_programs = host.num_programs(
        device, config.bwd_programs_per_sm or config.programs_per_sm, interpret
    )
    pma_programs = host.num_programs(device, config.pma_programs_per_sm, interpret)
    fwd_m, fwd_n = (
        (pma_m, config.pma_block_n) if pma_m else (config.fwd_block_m, config.fwd_block_n)
    )
    dq_m, dq_n = (pma_m, config.pma_dq_block_n) if pma_m else (config.dq_block_m, config.dq_block_n)
    dkdv_m = pma_m or config.dkdv_block_m
    q_programs = pma_programs if pma_m else fwd_programs
    dq_programs = pma_programs if pma_m else bwd_programs
    # PMA: split every sample's keys into chunks (more items in flight); dK/dV of cross calls:
    # split long query ranges. Both sum float32 partials in a second, deterministic pass.
    kv_chunk = _round_up(config.pma_kv_chunk, max(fwd_n, dq_n)) if pma_m else 0
    is_cross = not pma_m and not np.array_equal(s.q_start, s.k_start)
    q_chunk = _round_up(config.dkdv_q_chunk, dkdv_m) if is_cross else 0
    max_k = int(s.k_len.max()) if s.k_len.size else 0
    stream = bool(pma_m) and config.pma_stream and left is None and right is None
    stream = stream and (s.q_len.size == 0 or int(s.q_len[0]) <= pma_m)  # Nq in one tile
    short = 0
    tables, combines = [], []
    fwd_partial_rows = 0
    if config.short_kv_max > 0 and max_k <= config.short_kv_max:
        stream = False  # the short-KV forward keeps a sample's whole K and V on chip
        short = max(16, 1 << max(0, max_k - 1).bit_length())
        rows, work = _short_kv_items(s, config.short_rows_per_item, config.short_block_m)
        tables.append(_item_table(rows, work, heads, programs))
    elif stream:
        steps, bounds, stream_combine, stream_slots = _pma_stream_steps(
            s, heads, config.pma_block_n, pma_programs
        )
        tables.append((steps, bounds.size - 1))
    else:
        rows, work = _query_tile_items(s, fwd_m, fwd_n, left, right, kv_chunk, False)
        tables.append(_item_table(rows, work, heads, q_programs))
        counts = _chunks(s.k_len, kv_chunk)
        split = np.flatnonzero(counts > 1)
        if kv_chunk and split.size:
            fwd_partial_rows = int(counts.sum())
            first = (np.cumsum(counts) - counts)[split]
            ones = np.ones_like(split)
            combines.append(np.stack([split, first, counts[split], ones], axis=1))
    dkdv_partial = None
    if with_backward:
        rows, work = _key_tile_items(s, config.dkdv_block_n, dkdv_m, left, right, q_chunk)
        tables.append(_item_table(rows, work, heads, programs if pma_m else bwd_programs))
        rows, work = _query_tile_items(s, dq_m, dq_n, left, right, kv_chunk)
        tables.append(_item_table(rows, work, heads, dq_programs))
        dkdv_partial = _key_partials(s, q_chunk)
        if dkdv_partial is not None:
            combines.append(dkdv_partial[1])
    if stream:  # bounds and the combine list travel as the last two parts
        combines += [bounds, stream_combine]
    parts = _to_device(tables, combines, device)
    fwd_combine = parts[len(tables)] if fwd_partial_rows else None
    dkdv_combine = None
    if dkdv_partial is not None:
        dkdv_combine = parts[len(tables) + (1 if fwd_partial_rows else 0)]
    plan = _Plan(parts[0], tables[0][1], short, None, 0, None, 0,
                 fwd_partial_rows=fwd_partial_rows, fwd_combine=fwd_combine)  # fmt: skip
    if stream:
        plan = replace(plan, stream_bounds=parts[-2].view(-1), fwd_combine=parts[-1],
                       stream_slots=stream_slots)  # fmt: skip
    if not with_backward:
        return plan
    dq_blocks = int(_chunks(s.k_len, kv_chunk).sum()) if pma_m else 0
    return replace(
        plan, dkdv=parts[1], dkdv_grid=tables[1][1], dq=parts[2], dq_grid=tables[2][1],
        dkdv_partial_rows=0 if dkdv_partial is None else dkdv_partial[0],
        dkdv_combine=dkdv_combine, dq_partial_blocks=dq_blocks,
    )  # fmt: skip


def _round_up(value: int, multiple: int) -> int:
    return 0 if value <= 0 else -(-value // multiple) * multiple


def _to_device(tables, combines, device: torch.device) -> list[torch.Tensor]:
    """One host-to-device copy of every table and combine list (2-D int64 arrays), split back
    into views of the same widths."""
    matrices = [table for table, _ in tables] + list(combines)
    arrays = [m.reshape(-1) for m in matrices]
    packed = torch.from_numpy(np.concatenate(arrays).astype(np.int64, copy=False))
    packed = host.copy_to_device(packed, device)
    parts = torch.split(packed, [a.size for a in arrays])
    widths = [m.shape[1] for m in matrices]
    return [part.view(-1, width) for part, width in zip(parts, widths, strict=True)]


# Plans of recent calls: training repeats the same lengths for the forward of every layer, and
# benchmarks repeat whole calls; a hit skips all host work but the one lengths copy.
_PLAN_CACHE = host.PlanCache(maxsize=64)


def _cached_plan(q_lengths: host.HostLengths | None, k_lengths: host.HostLengths, num_queries,
                 heads, left, right, config, device, with_backward, interpret,
                 pma_m=0) -> _Plan:  # fmt: skip
    """The plan of these lengths (``q_lengths=None``: PMA with ``num_queries``), keyed on
    their bytes: a hit costs no per-sample host work."""
    key = (
        None if q_lengths is None else q_lengths.key, k_lengths.key, num_queries, heads, left,
        right, config, str(device), with_backward, interpret, pma_m,
    )  # fmt: skip

    def build() -> _Plan:
        q_values = None if q_lengths is None else q_lengths.values
        s = _samples(q_values, k_lengths.values, num_queries)
        return _plan(s, heads, left, right, config, device, with_backward, interpret, pma_m)

    return _PLAN_CACHE.get(key, build)


# ---------------------------------------------------------------------------------------------
# Launches and autograd.


@dataclass(frozen=True)
class _Launch:
    """Everything the launches share besides tensors."""

    scale: float
    left: int | None
    right: int | None
    activation: int
    normalize: bool
    num_queries: int | None  # PMA: Nq shared queries; None for self/cross
    config: GdpaTritonConfig
    interpret: bool
    descriptor_layout: bool  # q, k, v readable through whole-tensor descriptors
    fp8: bool = False
    q_lengths: torch.Tensor | None = None  # host lengths, kept for the FP8 quantisation
    k_lengths: torch.Tensor | None = None


def _fp8_compiled(launch: _Launch) -> bool:
    return launch.fp8 and not launch.interpret


def _packed_mode(q: torch.Tensor, launch: _Launch) -> int:
    """``PACKED`` constexpr: 1 inline-PTX f16x2 gelu_fast, 2 its tl emulation, 0 float32.

    Self and cross attention only: the bandwidth-bound PMA forward measured 0.48-0.50 ms with
    it at B128xL4096 against 0.23 ms without (H200), so PMA keeps the float32 activation."""
    if not (
        launch.config.packed_gelu
        and launch.activation == _ACTIVATION_CODES["gelu_fast"]
        and q.dtype == torch.bfloat16
        and launch.num_queries is None
    ):
        return 0
    return 2 if launch.interpret else 1


def _flags(q: torch.Tensor, launch: _Launch) -> dict:
    head_dim = q.shape[2]
    block_d = host.padded_block(head_dim)
    if launch.fp8 and not launch.interpret:
        # FP8 MMAs reduce at least 32 elements per instruction (Hopper's wgmma k = 32): the
        # Q K^T operands are padded with zeros from head_dim 16 to 32.
        block_d = max(block_d, 32)
    return {
        "PACKED": 0 if launch.fp8 else _packed_mode(q, launch),
        "HEAD_DIM": head_dim,
        "BLOCK_D": block_d,
        "ACT": launch.activation,
        "HAS_LEFT": launch.left is not None,
        "HAS_RIGHT": launch.right is not None,
        "NORMALIZE": launch.normalize,
        **host.dot_flags(q, launch.interpret),
        # The interpreter multiplies float8 operands through float32 (exact products) and
        # needs the E4M3 rounding workaround (``_to_e4m3``).
        **({"UPCAST": True} if launch.fp8 and launch.interpret else {}),
    }


@dataclass(frozen=True)
class _Fp8Operands:
    """E4M3 q, k, v of an FP8 call with their per-token scales ``(tokens, heads)``
    (``reference.gdpa_fp8_operands``' values). v is stored keys-contiguous in whole 128-slot
    blocks (``quantize_fp8_blocks(tokens_contiguous=True)``, from the items' ``k_slot``): A V
    reduces over the keys and Hopper's FP8 MMA reads its operands K-major, so the tile loads
    straight into that layout (token-major, it went through a transpose in shared memory)."""

    q8: torch.Tensor
    k8: torch.Tensor
    v8: torch.Tensor | None
    q_scale: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor | None


def _fp8_operands(q, k, v, launch: _Launch) -> _Fp8Operands:
    """``v=None`` (the backward, whose dA = dO V^T reads the input-precision v): no v8."""
    quantize = functools.partial(quantize_fp8_blocks, interpret=launch.interpret)
    (q8, q_scale), (k8, k_scale), _ = reference.gdpa_fp8_operands(
        q, k, None, launch.q_lengths, launch.k_lengths, quantize=quantize
    )
    v8, v_scale = (None, None) if v is None else quantize(
        v, launch.k_lengths, tokens_contiguous=True
    )  # fmt: skip
    return _Fp8Operands(q8, k8, v8, q_scale, k_scale, v_scale)


def descriptor_layout(q, k, v, *, interpret: bool) -> bool:
    """Whether unit-stride q, k, v can be read through whole-tensor (T, H * D) TMA descriptors,
    as the warp-specialised forward does: head_dim a power of two, each row's heads contiguous,
    16-byte aligned."""
    head_dim = q.shape[2]
    return (
        head_dim == host.padded_block(head_dim)
        and all(t.shape[1] == 1 or t.stride(1) == head_dim for t in (q, k, v))
        and host.tma_ready(q, k, v, interpret=interpret)
    )


def _forward(q, k, v, plan: _Plan, launch: _Launch, out_rows: int) -> torch.Tensor:
    heads = q.shape[1]
    out = torch.empty((out_rows, heads, q.shape[2]), dtype=q.dtype, device=q.device)
    if plan.fwd_grid == 0:
        return out
    cfg = launch.config
    kernels = _kernels(launch.interpret)
    if plan.stream_bounds is not None:
        return _stream_forward(q, k, v, out, plan, launch)
    partial = out
    if plan.fwd_partial_rows:  # PMA split-KV: one float32 Nq-row block per (sample, chunk)
        rows = plan.fwd_partial_rows * launch.num_queries
        partial = torch.empty((rows, heads, q.shape[2]), dtype=torch.float32, device=q.device)
    fp8 = {}
    if launch.fp8:  # E4M3 q and k with the (contiguous) inputs' strides, v keys-contiguous
        ops8 = _fp8_operands(q, k, v, launch)
        q, k, v = ops8.q8, ops8.k8, ops8.v8
        fp8 = dict(
            FP8=True, qs_ptr=ops8.q_scale, ks_ptr=ops8.k_scale, vs_ptr=ops8.v_scale,
            num_heads=heads, stride_v8_d=v.stride(2),
        )  # fmt: skip
    common = (
        q, k, v, out, plan.fwd, plan.fwd.shape[0],
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), launch.left or 0, launch.right or 0, launch.scale,
        partial, partial.stride(0), partial.stride(1),
    )  # fmt: skip
    if plan.short_kv_block:
        kernels.gdpa_fwd_short_kv_kernel[(plan.fwd_grid,)](
            *common, BLOCK_M=cfg.short_block_m, BLOCK_KV=plan.short_kv_block,
            num_warps=cfg.short_warps, num_stages=cfg.short_stages,
            MASK_FREE=cfg.fwd_loop != "phased", **_flags(q, launch),
        )  # fmt: skip
    elif launch.num_queries is not None:
        kernels.gdpa_fwd_kernel[(plan.fwd_grid,)](
            *common, BLOCK_M=_pma_block_m(launch.num_queries, cfg, _fp8_compiled(launch)),
            BLOCK_N=cfg.pma_block_n,
            num_warps=cfg.pma_warps, num_stages=cfg.pma_stages, **_flags(q, launch), **fp8,
        )  # fmt: skip
    else:
        one_loop = cfg.fwd_loop != "phased"
        tma = one_loop and host.tma_ready(k, v, interpret=launch.interpret)
        pipeline = cfg.fwd_loop == "pipelined"
        flags = _flags(q, launch)
        ws = tma and cfg.fwd_loop == "warp_specialized" and launch.descriptor_layout
        kernels.gdpa_fwd_kernel[(plan.fwd_grid,)](
            *common, BLOCK_M=cfg.fwd_block_m, BLOCK_N=cfg.fwd_block_n,
            num_warps=cfg.fwd_warps, num_stages=cfg.fwd_stages, ONE_LOOP=one_loop,
            KV_TMA=tma, PIPELINE=pipeline, WARP_SPECIALIZE=ws, q_rows=q.shape[0],
            k_rows=k.shape[0], **flags, **fp8,
        )  # fmt: skip
    if plan.fwd_combine is not None:
        # Per sample: sum of its chunks' Nq x H x D blocks (normalisation is in the partials).
        width = launch.num_queries * heads * q.shape[2]
        _segment_sum(partial.view(-1, width), out.view(-1, width), plan.fwd_combine, launch)
    return out


def _stream_forward(q, k, v, out, plan: _Plan, launch: _Launch) -> torch.Tensor:
    """Streamed PMA forward (``GdpaTritonConfig.pma_stream``), then the combine of the
    segments that two or more programs share."""
    cfg = launch.config
    kernels = _kernels(launch.interpret)
    nq, head_dim = launch.num_queries, q.shape[2]
    if nq == 0:
        return out
    partial = torch.empty(
        (max(plan.stream_slots, 1) * nq, head_dim), dtype=torch.float32, device=q.device
    )
    block_m = _pma_block_m(nq, cfg)
    flags = _flags(q, launch)
    kernels.gdpa_pma_fwd_stream_kernel[(plan.fwd_grid,)](
        q, k, v, out, partial, plan.fwd, plan.stream_bounds, nq,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), launch.scale,
        HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=cfg.pma_block_n, BLOCK_D=flags["BLOCK_D"],
        ACT=launch.activation, NORMALIZE=launch.normalize, DOT_PRECISION=flags["DOT_PRECISION"],
        UPCAST=flags["UPCAST"], num_warps=cfg.pma_warps, num_stages=cfg.pma_stages,
    )  # fmt: skip
    if plan.fwd_combine.shape[0]:
        kernels.gdpa_pma_combine_kernel[(plan.fwd_combine.shape[0],)](
            partial, out, plan.fwd_combine, nq, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_M=host.padded_block(nq), BLOCK_D=flags["BLOCK_D"],
            num_warps=4,
        )  # fmt: skip
    return out


def _segment_sum(src: torch.Tensor, dst: torch.Tensor, combine: torch.Tensor, launch: _Launch):
    """dst rows = fixed-order float32 sums of src rows (see ``segment_sum_kernel``)."""
    if combine.shape[0] == 0 or dst.shape[1] == 0:
        return
    block = 1024 if dst.shape[1] >= 1024 else host.padded_block(dst.shape[1])
    grid = (combine.shape[0], -(-dst.shape[1] // block))
    _kernels(launch.interpret).segment_sum_kernel[grid](
        src, dst, combine, dst.shape[1], src.stride(0), dst.stride(0), BLOCK=block, num_warps=4
    )


def _backward(grad_out, q, k, v, plan: _Plan, launch: _Launch):
    cfg = launch.config
    kernels = _kernels(launch.interpret)
    grad_out = host.unit_stride(grad_out)
    # precision="fp8" quantises the forward's GEMMs only: the backward is the bf16 one, on the
    # input-precision q, k, v and dO (on Hopper FP8 backward GEMMs were slower and no more
    # accurate: docs/kernel-tuning.md, "FP8 backward in bf16").
    flags = _flags(q, replace(launch, fp8=False))
    pma_m = 0
    if launch.num_queries is not None:
        pma_m = _pma_block_m(launch.num_queries, cfg, _fp8_compiled(launch))
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    # Under torch.use_deterministic_algorithms(True) dQ comes from its own kernel (a fixed
    # summation order) instead of the fused kernel's float32 atomics.
    one_loop = cfg.bwd_loop == "fused" and launch.num_queries is None
    fused_dq = one_loop and not torch.are_deterministic_algorithms_enabled()
    if fused_dq:  # float32 atomics target of the dK/dV kernel
        dq_rows = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    elif launch.num_queries is None:
        dq_rows = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    else:  # PMA: one float32 dQ row block per (sample, key chunk), summed below
        rows = plan.dq_partial_blocks * launch.num_queries
        dq_rows = torch.empty((rows, *q.shape[1:]), dtype=torch.float32, device=q.device)
    dk_part = dv_part = dk
    if plan.dkdv_partial_rows:
        shape = (plan.dkdv_partial_rows, *k.shape[1:])
        dk_part = torch.empty(shape, dtype=torch.float32, device=k.device)
        dv_part = torch.empty(shape, dtype=torch.float32, device=k.device)
    if plan.dkdv_grid > 0:
        kernels.gdpa_bwd_dkdv_kernel[(plan.dkdv_grid,)](
            q, k, v, grad_out, dk, dv, plan.dkdv, plan.dkdv.shape[0],
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            grad_out.stride(0), grad_out.stride(1), dk.stride(0), dk.stride(1),
            dv.stride(0), dv.stride(1), launch.left or 0, launch.right or 0, launch.scale,
            dk_part, dv_part, dk_part.stride(0), dk_part.stride(1),
            BLOCK_M=pma_m or cfg.dkdv_block_m, BLOCK_N=cfg.dkdv_block_n,
            num_warps=cfg.bwd_warps, num_stages=cfg.bwd_stages,
            ONE_LOOP=one_loop, dq_ptr=dq_rows,
            stride_dqt=dq_rows.stride(0), stride_dqh=dq_rows.stride(1), FUSED_DQ=fused_dq,
            **flags,
        )  # fmt: skip
    if plan.dq_grid > 0 and not fused_dq:
        kernels.gdpa_bwd_dq_kernel[(plan.dq_grid,)](
            q, k, v, grad_out, dq_rows, plan.dq, plan.dq.shape[0],
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            grad_out.stride(0), grad_out.stride(1), dq_rows.stride(0), dq_rows.stride(1),
            launch.left or 0, launch.right or 0, launch.scale,
            BLOCK_M=pma_m or cfg.dq_block_m,
            BLOCK_N=cfg.pma_dq_block_n if pma_m else cfg.dq_block_n,
            num_warps=cfg.pma_warps if pma_m else cfg.bwd_warps,
            num_stages=cfg.bwd_stages, ONE_LOOP=one_loop, **flags,
        )  # fmt: skip
    if plan.dkdv_combine is not None:
        width = k.shape[1] * k.shape[2]
        for part, grad in ((dk_part, dk), (dv_part, dv)):
            _segment_sum(part.view(-1, width), grad.view(-1, width), plan.dkdv_combine, launch)
    if launch.num_queries is None:
        dq = dq_rows.to(q.dtype)  # no copy unless fused (float32 atomics buffer)
    else:
        nq = launch.num_queries
        if nq == 0:
            dq = torch.zeros_like(q)
        else:
            dq = dq_rows.view(-1, nq, q.shape[1], q.shape[2]).sum(0).to(q.dtype)
    return dq, dk, dv


class GdpaFunction(torch.autograd.Function):
    """Autograd wrapper of the Triton kernels (inputs validated and planned by the caller).

    ``apply(q, k, v, plan, launch, out_rows)``. Backward is once-differentiable.
    """

    @staticmethod
    def forward(ctx, q, k, v, plan, launch, out_rows):
        out = _forward(q, k, v, plan, launch, out_rows)
        ctx.save_for_backward(q, k, v)
        ctx.plan = plan
        ctx.launch = launch
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        q, k, v = ctx.saved_tensors
        if ctx.plan.dkdv is None:
            raise RuntimeError("gdpa was planned without backward work lists")
        dq, dk, dv = _backward(grad_out, q, k, v, ctx.plan, ctx.launch)
        return dq, dk, dv, None, None, None


# ---------------------------------------------------------------------------------------------
# Entry points (validated input).


def _resolve_window(causal: bool, window) -> tuple[int | None, int | None]:
    left, right = (None, None) if window is None else (window[0], window[1])
    if causal:
        right = 0 if right is None else min(right, 0)  # causal: j <= p, intersected
    return left, right


def _prepare(
    q, k, v, q_lengths, k_lengths, *, activation, scale, causal, window, normalize_by_length,
    config, with_backward, precision="bf16",
):  # fmt: skip
    """Config, launch parameters and plan of a call, and its tensors as the kernels take them:
    ``(q, k, v, plan, launch, out_rows)``."""
    interpret = host.interpret_for(q)
    if activation not in _ACTIVATION_CODES:
        raise ValueError(
            f"activation must be one of {sorted(_ACTIVATION_CODES)}, got {activation!r}"
        )
    pma = q_lengths is None
    if pma and k_lengths is None:
        raise ValueError("PMA broadcast (q_lengths=None) needs k_lengths")
    self_attention = k_lengths is None
    left, right = _resolve_window(causal, window)
    q_info = None if pma else host.host_lengths_of(q_lengths)
    k_info = q_info if self_attention else host.host_lengths_of(k_lengths)
    q_host = None if pma else q_info.values
    k_host = k_info.values
    q, k, v = host.unit_stride(q), host.unit_stride(k), host.unit_stride(v)
    whole_tensor_descriptors = descriptor_layout(q, k, v, interpret=interpret)
    if config is None:
        max_len = None if pma or k_host.numel() == 0 else k_info.longest
        # PMA keeps the masked calls' configuration (its kernels were tuned with it).
        config = default_config(
            q.shape[2], interpret=interpret, dtype=q.dtype, max_len=max_len,
            masked=pma or left is not None or right is not None,
            descriptor_layout=whole_tensor_descriptors,
        )  # fmt: skip
        if precision == "fp8" and not (interpret or pma or left is not None or right is not None):
            config = _fp8_default(config)
    if config.fwd_loop not in GDPA_FWD_LOOPS:
        raise ValueError(
            f"config.fwd_loop must be one of {GDPA_FWD_LOOPS}, got {config.fwd_loop!r}"
        )
    if config.bwd_loop not in GDPA_BWD_LOOPS:
        raise ValueError(
            f"config.bwd_loop must be one of {GDPA_BWD_LOOPS}, got {config.bwd_loop!r}"
        )
    if self_attention:
        # Self-attention never takes the short-KV forward (its KV is as long as its queries).
        config = _without_short_kv(config)
    fp8 = precision == "fp8"
    if fp8:
        config = _fp8_config(config, pma)
        # The kernels address the E4M3 copies with the inputs' strides.
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    # Checked on the loop that runs (FP8 calls run the phased one whatever the config).
    if config.fwd_loop == "warp_specialized" and config.fwd_stages > 2:
        raise ValueError(
            'config.fwd_loop="warp_specialized" needs fwd_stages <= 2 (3 stages gave NaN on '
            f"triton 3.6), got fwd_stages={config.fwd_stages}"
        )
    launch = _Launch(
        scale=1.0 / math.sqrt(q.shape[2]) if scale is None else float(scale),
        left=left,
        right=right,
        activation=_ACTIVATION_CODES[activation],
        normalize=normalize_by_length,
        num_queries=q.shape[0] if pma else None,
        config=config,
        interpret=interpret,
        descriptor_layout=whole_tensor_descriptors,
        fp8=fp8,
        q_lengths=q_host if fp8 else None,
        k_lengths=k_host if fp8 else None,
    )
    pma_m = _pma_block_m(q.shape[0], config, _fp8_compiled(launch)) if pma else 0
    plan = _cached_plan(
        q_info, k_info, q.shape[0] if pma else None, q.shape[1], left, right, config, q.device,
        with_backward, interpret, pma_m,
    )  # fmt: skip
    out_rows = k_host.numel() * q.shape[0] if pma else q.shape[0]
    return q, k, v, plan, launch, out_rows


def gdpa_from_lengths(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_lengths: torch.Tensor | None,
    k_lengths: torch.Tensor | None = None,
    *,
    activation: str = "silu",
    scale: float | None = None,
    causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
    normalize_by_length: bool = False,
    config: GdpaTritonConfig | None = None,
    precision: str = "bf16",
) -> torch.Tensor:
    """Triton GDPA from per-sample lengths (CPU tensors: no device sync needed).

    ``q_lengths=None`` is PMA broadcast (``k_lengths`` required): the ``Nq`` rows of q attend
    over every sample's keys; ``k_lengths=None`` is self-attention. Same semantics as
    :func:`gem_kernels.gdpa`; inputs are assumed valid. Differentiable through
    :class:`GdpaFunction`, with an optional tile ``config``: the entry point of the tests and
    benchmarks (the public function runs the ``gem_kernels::`` operators, whose forward and
    backward are :func:`forward_from_lengths` and :func:`backward_from_lengths`).
    """
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    q, k, v, plan, launch, out_rows = _prepare(
        q, k, v, q_lengths, k_lengths, activation=activation, scale=scale, causal=causal,
        window=window, normalize_by_length=normalize_by_length, config=config,
        with_backward=needs_grad, precision=precision,
    )  # fmt: skip
    if not needs_grad:  # inference: no autograd node to build
        return _forward(q, k, v, plan, launch, out_rows)
    return GdpaFunction.apply(q, k, v, plan, launch, out_rows)


def forward_from_lengths(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_lengths: torch.Tensor | None,
    k_lengths: torch.Tensor | None = None,
    *,
    activation: str = "silu",
    scale: float | None = None,
    causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
    normalize_by_length: bool = False,
    config: GdpaTritonConfig | None = None,
    precision: str = "bf16",
    plan_backward: bool = False,
) -> torch.Tensor:
    """The kernels' forward without autograd (the operator's forward). ``plan_backward``: also
    plan the backward's work lists now (cached for its call)."""
    q, k, v, plan, launch, out_rows = _prepare(
        q, k, v, q_lengths, k_lengths, activation=activation, scale=scale, causal=causal,
        window=window, normalize_by_length=normalize_by_length, config=config,
        with_backward=plan_backward, precision=precision,
    )  # fmt: skip
    return _forward(q, k, v, plan, launch, out_rows)


def backward_from_lengths(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_lengths: torch.Tensor | None,
    k_lengths: torch.Tensor | None = None,
    *,
    activation: str = "silu",
    scale: float | None = None,
    causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
    normalize_by_length: bool = False,
    config: GdpaTritonConfig | None = None,
    precision: str = "bf16",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``(dq, dk, dv)``: the kernels :class:`GdpaFunction` runs in its backward, on
    the same prepared inputs (GDPA's backward needs no saved forward output). ``precision``
    is the forward's: it picks the plan (FP8 forward tiles), the backward runs in bf16."""
    q, k, v, plan, launch, _ = _prepare(
        q, k, v, q_lengths, k_lengths, activation=activation, scale=scale, causal=causal,
        window=window, normalize_by_length=normalize_by_length, config=config,
        with_backward=True, precision=precision,
    )  # fmt: skip
    return _backward(grad_out, q, k, v, plan, launch)


@functools.lru_cache(maxsize=32)
def _without_short_kv(config: GdpaTritonConfig) -> GdpaTritonConfig:
    return replace(config, short_kv_max=0)


#: Persistent programs per SM of the FP8 forward on a default unmasked self / cross config:
#: the bf16 entries' counts suit their own loops (``d128_short``'s warp-specialised one runs 1),
#: while the phased FP8 loop's 4-warp programs need a second per SM to hide each other's
#: latency (1.49x at B512xL1024, H200; results/h200/tuning/fp8_attention_tiles_0cf030f.json).
_FP8_FWD_PROGRAMS_PER_SM = 2


def _fp8_default(config: GdpaTritonConfig) -> GdpaTritonConfig:
    """The default ``config`` of a compiled, unmasked self / cross FP8 call (masked and PMA
    calls, untuned in FP8, keep theirs)."""
    return replace(config, fwd_programs_per_sm=_FP8_FWD_PROGRAMS_PER_SM)


@functools.lru_cache(maxsize=32)
def _fp8_config(config: GdpaTritonConfig, pma: bool) -> GdpaTritonConfig:
    """``config`` for an FP8 call (``pma``: PMA broadcast).

    Only the phased forward has an FP8 mode, so the other forward loops, the short-KV and
    streamed PMA forwards and gelu packing are switched off. A's E4M3 scale is per row of a
    key tile (A V): that tile is set to ``reference.FP8_ACT_TILE`` (``fwd_block_n``,
    ``pma_block_n``), so that the emulation groups A as the kernel does whatever the config
    (and the FP8 MMAs reduce at least 32 rows). q, k and v carry one scale per
    ``reference.FP8_BLOCK`` tokens: the query tile must fit in one block (tiles are powers of
    two from 16 that start at multiples of their size within a sample, so a size up to
    FP8_BLOCK does). The backward (bf16) keeps the config's tiles and loop."""
    sizes = {"fwd_block_m": config.fwd_block_m}
    for name, size in sizes.items():
        if size > reference.FP8_BLOCK:
            raise ValueError(
                f"config.{name}={size} is larger than the FP8 quantisation block "
                f"({reference.FP8_BLOCK} tokens) that precision='fp8' needs"
            )
    tile = reference.FP8_ACT_TILE
    return replace(
        config, fwd_loop="phased", short_kv_max=0, pma_stream=False, packed_gelu=False,
        fwd_block_n=tile, pma_block_n=tile, fwd_block_m=tile if pma else config.fwd_block_m,
    )  # fmt: skip


def gdpa_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor | None,
    k_offsets: torch.Tensor | None = None,
    *,
    activation: str = "silu",
    scale: float | None = None,
    causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
    normalize_by_length: bool = False,
    config: GdpaTritonConfig | None = None,
    precision: str = "bf16",
) -> torch.Tensor:
    """Triton GDPA from offsets; same semantics as :func:`gem_kernels.gdpa`.

    Inputs are assumed valid: call :func:`gem_kernels.gdpa` (with ``backend="triton"``) for
    argument checks. Offsets are read on the host (one device sync when they live on the GPU).
    """
    return gdpa_from_lengths(
        q,
        k,
        v,
        None if q_offsets is None else host.host_lengths(q_offsets),
        None if k_offsets is None else host.host_lengths(k_offsets),
        activation=activation,
        scale=scale,
        causal=causal,
        window=window,
        normalize_by_length=normalize_by_length,
        config=config,
        precision=precision,
    )
