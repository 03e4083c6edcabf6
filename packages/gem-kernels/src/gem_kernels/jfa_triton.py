"""Triton implementation of jagged flash attention: tile planning, launches, autograd.

The kernels live in ``_jfa_kernels.py``. :func:`jagged_flash_attention_triton` runs them on
validated input (the public, validating entry point is
:func:`gem_kernels.jagged_flash_attention`, which dispatches here).

Jagged-aware scheduling: the host builds, from the sample lengths, one table row per real tile
(``(sample, tile)`` pairs for samples that have rows; no program exists for padding) and deals
them sample by sample: the samples with the longest tile first, each sample's tiles together and
longest work first, so the long tiles start early, the short ones fill the tail of the grid, and
the programs running at once share one sample's keys and values in L2. The forward and the dQ
kernel walk query tiles; the dK/dV kernel walks key tiles. Plans are cached by lengths and tiling (a model's layers and their backward
share one batch), so repeated calls only hash the lengths. The split backward (a dK/dV kernel
and a dQ kernel) is deterministic: no atomics; the relative-position bias gradient is
accumulated per dK/dV program into its own row of a partial buffer and summed afterwards. With
``JfaTritonConfig.bwd_fused`` the dK/dV kernel adds dQ in float32 instead (TMA bulk reduces,
summation order not fixed); ``torch.use_deterministic_algorithms(True)`` selects the split one.

``precision="fp8"``: one Triton launch per operand quantises q, k and v to the values of
:func:`gem_kernels.reference.quantize_fp8_blocks` (the emulation's), stores v keys-contiguous
(the K-major operand Hopper's FP8 MMA needs for P V) in whole 128-token blocks, and runs the
forward kernel with ``FP8=True``; the backward is the bf16 one, given the FP8 forward's out and
lse.

CPU tensors run under the Triton interpreter when ``TRITON_INTERPRET=1`` is set at call time:
the kernel module is loaded once per mode (interpreted or compiled), so the variable may be set
after ``gem_kernels`` was imported.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType

import torch

from gem_kernels import _triton_host as host
from gem_kernels import reference
from gem_kernels.fp8_quantize import padded_starts, quantize_fp8_blocks
from gem_kernels.triton_loader import load_kernel_module

__all__ = [
    "JFA_CONFIGS",
    "JaggedFlashAttentionFunction",
    "JfaTritonConfig",
    "MAX_TRITON_BUCKETS",
    "MAX_TRITON_HEAD_DIM",
    "MEDIUM_SEQUENCE_LEN",
    "SHORT_SEQUENCE_LEN",
    "backward_from_lengths",
    "default_config",
    "forward_from_lengths",
    "jagged_flash_attention_from_lengths",
    "jagged_flash_attention_triton",
    "triton_unsupported_reason",
]

#: Largest head dimension the Triton kernels take (bigger ones go to the reference).
MAX_TRITON_HEAD_DIM = 256
#: Largest ``rel_pos_bias`` table (buckets) the Triton kernels take (its gradient lives in
#: registers of each dK/dV program).
MAX_TRITON_BUCKETS = 2048

_LOG2E = 1.4426950408889634
_TABLE_WIDTH = 7  # [q_start, q_len, k_start, k_len, tile_start, bias_start, k_slot]


@dataclass(frozen=True)
class JfaTritonConfig(host.FlashTileConfig):
    """Tile sizes and launch parameters of the three kernels (powers of two, >= 16).

    The defaults are ``JFA_CONFIGS["d128_long"]``, the H200's configuration of unmasked,
    unbiased calls at head_dim 65..128 longer than ``MEDIUM_SEQUENCE_LEN``.
    """

    dq_warps: int = 0
    """Warps per dQ program (0: ``bwd_warps``)."""
    dq_stages: int = 0
    """Software-pipelining depth of the dQ kernel's key loop (0: ``bwd_stages``)."""
    bwd_fused: bool = True
    """The dK/dV kernel also adds dQ into a zeroed float32 buffer (summation order not fixed)
    and no dQ kernel runs: S and dP are computed once instead of twice. Compiled at a
    power-of-two head_dim, each tile's dQ rows go in one TMA bulk reduce; otherwise (the
    interpreter) with an atomic per element. Calls with ``jagged_bias`` (its gradient is
    written by the dQ kernel) and every call under ``torch.use_deterministic_algorithms(True)``
    keep the separate dQ kernel (no atomics)."""
    fwd_one_loop: bool = False
    """Unbiased calls: the forward runs all the key tiles of a query tile in one loop and masks
    only those that need it (diagonal, window edges, partial tile), instead of separate loops
    for the masked tiles."""


#: Longest sample (queries or keys, or the keys a query row can see under a window that
#: bounds both sides) for which unbiased and ``rel_pos_bias`` calls at head_dim 65..128 take
#: the short tiles: 64x32 forward tiles and 64-key dK/dV tiles, 4 warps (several programs per
#: SM, so one program's prologue and epilogue overlap another's loop).
SHORT_SEQUENCE_LEN = 1024
#: Up to this longest sample (above ``SHORT_SEQUENCE_LEN``), unbiased calls at head_dim
#: 65..128 keep the long forward tiles but take the short dK/dV tiles.
MEDIUM_SEQUENCE_LEN = 2048


#: Smallest forward key tile of a compiled FP8 call on a default config at head_dim <= 128:
#: at the short tiles' 32 keys P V is one 32-deep FP8 MMA per tile; 64x64 in 4 warps was the
#: fastest FP8 forward there (H200; results/h200/tuning/fp8_attention_tiles_0cf030f.json).
_FP8_MIN_FWD_BLOCK_N = 64

_SHORT = JfaTritonConfig(
    fwd_block_m=64, fwd_block_n=32, fwd_warps=4, fwd_stages=3, dkdv_block_n=64, dkdv_block_m=32,
    dq_block_m=64, dq_block_n=32, bwd_warps=4, bwd_stages=3, bwd_fused=False,
)  # fmt: skip
_MEDIUM = replace(
    JfaTritonConfig(), dkdv_block_n=64, dkdv_block_m=32, bwd_warps=4, dq_warps=8, bwd_fused=False
)
_D64 = JfaTritonConfig(
    fwd_block_m=128, fwd_block_n=64, fwd_warps=4, fwd_stages=3, dkdv_block_n=128,
    dkdv_block_m=64, dq_block_m=128, dq_block_n=64, bwd_warps=8, bwd_stages=2, bwd_fused=False,
)  # fmt: skip

#: The configurations :func:`default_config` chooses from (Hopper; other GPUs take the same
#: entries unmeasured), each with the reason it is the one. ``_masked`` entries serve causal and
#: window calls: the forward's one key loop (separate loops for the diagonal and window-edge
#: tiles each start and drain a pipeline of their own, and the one loop needs fewer
#: registers) and the split backward.
JFA_CONFIGS: dict[str, host.TunedConfig] = {
    "interpret": host.TunedConfig(
        JfaTritonConfig(
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
            bwd_fused=False,
        ),
        "the Triton interpreter on the CPU: 16-row tiles, so that short test samples cross "
        "tile boundaries; the split backward (the fused one has tests of its own)",
    ),
    "d64": host.TunedConfig(_D64, "head_dim <= 64: 128x64 forward tiles in 4 warps"),
    "d64_bias": host.TunedConfig(
        replace(_D64, dkdv_block_m=32),
        "head_dim <= 64 with rel_pos_bias: 32 query rows per dK/dV step for the bias tiles",
    ),
    "d64_jagged_bias": host.TunedConfig(
        replace(_D64, dkdv_block_m=32, dq_block_n=32),
        "head_dim <= 64 with jagged_bias: also 32-key dQ steps (it stores the bias gradient)",
    ),
    "d128_short": host.TunedConfig(
        _SHORT,
        "head_dim 65..128, unmasked, samples <= SHORT_SEQUENCE_LEN (rel_pos_bias too): 64x32 "
        "tiles in 4 warps, several programs per SM overlap prologues and epilogues",
    ),
    "d128_short_masked": host.TunedConfig(
        replace(_SHORT, fwd_one_loop=True), "d128_short for causal and window calls"
    ),
    "d128_medium": host.TunedConfig(
        _MEDIUM,
        "head_dim 65..128, unmasked, unbiased, samples <= MEDIUM_SEQUENCE_LEN: the long "
        "forward tiles with the short 4-warp dK/dV tiles and 128x64 dQ tiles in 8 warps",
    ),
    "d128_medium_masked": host.TunedConfig(
        replace(_MEDIUM, fwd_one_loop=True), "d128_medium for causal and window calls"
    ),
    "d128_long": host.TunedConfig(
        JfaTritonConfig(),
        "head_dim 65..128, unmasked, unbiased, longer samples: 128x128 forward, 128-key dK/dV "
        "tiles whose 10 * BLOCK_N flops per dQ element amortise the fused backward's reduces",
    ),
    "d128_long_masked": host.TunedConfig(
        replace(JfaTritonConfig(), fwd_one_loop=True, bwd_fused=False),
        "d128_long for causal and window calls (the split backward measured faster there)",
    ),
    "d128_bias_long": host.TunedConfig(
        replace(_MEDIUM, fwd_block_n=64),
        "head_dim 65..128 with rel_pos_bias, samples > SHORT_SEQUENCE_LEN: bias tiles in the "
        "loops leave no shared memory for 128x128 forward tiles",
    ),
    "d128_jagged_bias": host.TunedConfig(
        JfaTritonConfig(
            fwd_block_m=128,
            fwd_block_n=64,
            fwd_warps=8,
            fwd_stages=3,
            dkdv_block_n=128,
            dkdv_block_m=32,
            dq_block_m=128,
            dq_block_n=32,
            bwd_warps=8,
            bwd_stages=3,
            bwd_fused=False,
        ),
        "head_dim 65..128 with jagged_bias, every length: it loads the bias tile and stores "
        "its gradient, so 64-key tiles spill registers",
    ),
    "d256": host.TunedConfig(
        JfaTritonConfig(
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
            bwd_fused=False,
        ),
        "head_dim 129..256, biased or not: twice the D=128 operand bytes, 64x32 tiles",
    ),
}


@functools.lru_cache(maxsize=64)  # called on every call without a config
def default_config(
    head_dim: int,
    *,
    interpret: bool = False,
    with_bias: bool = False,
    with_jagged_bias: bool = False,
    max_len: int | None = None,
    masked: bool = False,
) -> JfaTritonConfig:
    """The ``JFA_CONFIGS`` entry of a call.

    ``max_len``: the longest sample of the batch, or the keys a query row can see when a window
    bounds both sides (causal with a left window: ``left + 1``), whichever is smaller; ``None``:
    unknown (long tiles). ``masked``: a causal mask or a window. ``with_bias``:
    ``rel_pos_bias``; ``with_jagged_bias`` implies it. The entry is ``"interpret"`` under the
    interpreter, ``"d64*"`` up to head_dim 64 and ``"d256"`` above 128. At 65..128:
    ``"d128_jagged_bias"`` with a jagged bias; ``"d128_short"`` up to ``SHORT_SEQUENCE_LEN``;
    longer biased calls ``"d128_bias_long"``; unbiased ones ``"d128_medium"`` up to
    ``MEDIUM_SEQUENCE_LEN`` and ``"d128_long"`` beyond; unbiased masked calls take the
    ``_masked`` entry of their length (biased kernels keep separate loops either way).

    Each choice won an H200 tile sweep (D=128, bf16); the numbers, and the variants measured
    and removed (hand-pipelined, warp-specialised and persistent forwards), are in
    docs/kernel-tuning.md.
    """
    name = _config_name(head_dim, interpret, with_bias, with_jagged_bias, max_len, masked)
    return JFA_CONFIGS[name].config


def _config_name(head_dim, interpret, with_bias, with_jagged_bias, max_len, masked) -> str:
    if interpret:
        return "interpret"
    if head_dim > 128:
        return "d256"
    if head_dim <= 64:
        return "d64_jagged_bias" if with_jagged_bias else "d64_bias" if with_bias else "d64"
    if with_jagged_bias:
        return "d128_jagged_bias"
    masked_suffix = "_masked" if masked and not with_bias else ""
    if max_len is not None and max_len <= SHORT_SEQUENCE_LEN:
        return "d128_short" + masked_suffix
    if with_bias:
        return "d128_bias_long"
    if max_len is not None and max_len <= MEDIUM_SEQUENCE_LEN:
        return "d128_medium" + masked_suffix
    return "d128_long" + masked_suffix


# ---------------------------------------------------------------------------------------------
# Kernel module loading (compiled or interpreted).


_KERNEL_FILE = Path(__file__).with_name("_jfa_kernels.py")


def _kernels(interpret: bool) -> ModuleType:
    """The kernel module decorated for this mode (compiled for CUDA, interpreted for CPU tests)."""
    return load_kernel_module(_KERNEL_FILE, interpret)


# ---------------------------------------------------------------------------------------------
# Support check.


def triton_unsupported_reason(
    q: torch.Tensor,
    *,
    rel_pos_bias: torch.Tensor | None = None,
    jagged_bias: torch.Tensor | None = None,
    precision: str = "bf16",
) -> str | None:
    """Why the Triton path cannot run this call, or ``None`` when it can.

    The Triton path takes float16/bfloat16/float32 on CUDA (float32 with IEEE-exact dot
    products), or CPU tensors when ``TRITON_INTERPRET=1`` is set; head_dim up to
    ``MAX_TRITON_HEAD_DIM``; ``rel_pos_bias`` tables up to ``MAX_TRITON_BUCKETS`` buckets;
    ``precision="fp8"`` float16/bfloat16 only.
    """
    too_many_buckets = rel_pos_bias is not None and rel_pos_bias.shape[1] > MAX_TRITON_BUCKETS
    extra = None
    if too_many_buckets:
        extra = f"rel_pos_bias has {rel_pos_bias.shape[1]} buckets, more than {MAX_TRITON_BUCKETS}"
    elif precision == "fp8" and q.dtype not in (torch.float16, torch.bfloat16):
        extra = f"precision='fp8' takes float16/bfloat16 inputs, got {q.dtype}"
    return host.unsupported_reason(q, MAX_TRITON_HEAD_DIM, extra)


# ---------------------------------------------------------------------------------------------
# Tile planning (host, vectorised over tiles).


@dataclass(frozen=True)
class _Plan:
    """Tile tables (device int64, one row per real tile, dealt by ``_table``)."""

    fwd: torch.Tensor
    dkdv: torch.Tensor | None
    dq: torch.Tensor | None


def _tiles_of(lengths: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sample index, tile start within the sample) of every block-sized tile of every sample."""
    per_sample = (lengths + block - 1) // block
    sample = torch.repeat_interleave(torch.arange(lengths.numel()), per_sample)
    first = torch.cumsum(per_sample, 0) - per_sample
    start = (torch.arange(sample.numel()) - first[sample]) * block
    return sample, start


def _table(columns: list[torch.Tensor], work: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
    """Tile table rows dealt sample by sample: the samples with the longest tile first, and
    each sample's tiles together, longest work first among them.

    The programs running at once then read one sample's keys and values (queries, for dK/dV),
    which stay in L2. Ordering all tiles by work alone interleaves the tiles of every sample
    under a causal mask (each of a sample's tiles has different work), so dozens of samples'
    keys and values compete for L2 (H200 numbers in docs/kernel-tuning.md); unmasked and
    windowed calls, whose tiles of a sample have equal work, were already together."""
    table = torch.stack(columns, dim=1)
    if work.numel() == 0:
        return table
    order = torch.argsort(work, descending=True, stable=True)
    sample_work = torch.zeros(int(sample.max()) + 1, dtype=work.dtype)
    sample_work.scatter_reduce_(0, sample, work, "amax")
    rank = torch.empty_like(sample_work)
    rank[torch.argsort(sample_work, descending=True, stable=True)] = torch.arange(
        sample_work.numel()
    )
    order = order[torch.argsort(rank[sample[order]], stable=True)]
    return table[order].contiguous()


def _columns(samples, sample: torch.Tensor, start: torch.Tensor) -> list[torch.Tensor]:
    """A tile table's 7 columns: the sample's query start and length, key start and length,
    the tile's start within the sample, the sample's jagged-bias offset, and the sample's first
    key slot in the FP8 forward's v, stored keys-contiguous (``padded_starts``)."""
    q_len, k_len, q_start, k_start, bias_start, k_slot = samples
    return [
        q_start[sample], q_len[sample], k_start[sample], k_len[sample], start,
        bias_start[sample], k_slot[sample],
    ]  # fmt: skip


def _query_tile_table(samples, block_m, left, right) -> torch.Tensor:
    q_len, k_len = samples[:2]
    sample, start = _tiles_of(q_len, block_m)
    lq, lk = q_len[sample], k_len[sample]
    shift = lk - lq
    key_lo = torch.zeros_like(start)
    key_hi = lk
    if left is not None:
        key_lo = (start + shift - left).clamp(min=0)
    if right is not None:
        last_row = torch.minimum(start + block_m, lq) - 1
        key_hi = torch.minimum(lk, last_row + shift + right + 1)
    work = (key_hi - key_lo).clamp(min=0)
    return _table(_columns(samples, sample, start), work, sample)


def _key_tile_table(samples, block_n, left, right) -> torch.Tensor:
    q_len, k_len = samples[:2]
    sample, start = _tiles_of(k_len, block_n)
    lq, lk = q_len[sample], k_len[sample]
    shift = lk - lq
    row_lo = torch.zeros_like(start)
    row_hi = lq
    if right is not None:
        row_lo = (start - right - shift).clamp(min=0)
    if left is not None:
        last_key = torch.minimum(start + block_n, lk) - 1
        row_hi = torch.minimum(lq, last_key + left - shift + 1)
    work = (row_hi - row_lo).clamp(min=0)
    return _table(_columns(samples, sample, start), work, sample)


#: Plans of recent batches, keyed by their lengths and tiling: every attention layer of a model
#: (and its backward) sees the same batch, so only the first call per batch builds tables.
_PLAN_CACHE = host.PlanCache(maxsize=16)


def _plan(
    q_lengths: torch.Tensor | host.HostLengths,
    k_lengths: torch.Tensor | host.HostLengths,
    left: int | None,
    right: int | None,
    config: JfaTritonConfig,
    device: torch.device,
    with_backward: bool,
) -> _Plan:
    """The plan of these lengths (tensors, or their :func:`host.host_lengths_of`), keyed on
    their bytes: a hit costs no per-sample host work."""
    if isinstance(q_lengths, torch.Tensor):
        q_lengths = host.host_lengths_of(q_lengths)
    if isinstance(k_lengths, torch.Tensor):
        k_lengths = host.host_lengths_of(k_lengths)
    q_len, k_len = q_lengths.values, k_lengths.values
    key = (
        q_lengths.key,
        k_lengths.key,
        left,
        right,
        config.fwd_block_m,
        config.dkdv_block_n,
        config.dq_block_m,
        str(device),
        with_backward,
    )
    return _PLAN_CACHE.get(
        key, lambda: _build_plan(q_len, k_len, left, right, config, device, with_backward)
    )


def _build_plan(q_len, k_len, left, right, config, device, with_backward) -> _Plan:
    q_start = torch.cumsum(q_len, 0) - q_len
    k_start = torch.cumsum(k_len, 0) - k_len
    pairs = q_len * k_len
    samples = (
        q_len, k_len, q_start, k_start, torch.cumsum(pairs, 0) - pairs, padded_starts(k_len),
    )  # fmt: skip
    tables = [_query_tile_table(samples, config.fwd_block_m, left, right)]
    if with_backward:
        tables.append(_key_tile_table(samples, config.dkdv_block_n, left, right))
        if config.dq_block_m != config.fwd_block_m:
            tables.append(_query_tile_table(samples, config.dq_block_m, left, right))
    # One host-to-device copy for all tables.
    sizes = [t.shape[0] for t in tables]
    packed = torch.cat(tables)
    packed = host.copy_to_device(packed, device)
    parts = list(torch.split(packed, sizes))
    fwd = parts[0]
    dkdv = parts[1] if with_backward else None
    dq = (parts[2] if len(parts) > 2 else fwd) if with_backward else None
    return _Plan(fwd=fwd, dkdv=dkdv, dq=dq)


# ---------------------------------------------------------------------------------------------
# Launches.


@dataclass(frozen=True)
class _Launch:
    """Everything the launches share besides tensors."""

    scale: float
    left: int | None
    right: int | None
    config: JfaTritonConfig
    interpret: bool
    fp8: bool = False
    q_lengths: torch.Tensor | None = None  # host lengths, kept for the FP8 quantisation
    k_lengths: torch.Tensor | None = None


@dataclass(frozen=True)
class _Fp8Operands:
    """E4M3 q, k and v of an FP8 call (``fp8_quantize.quantize_fp8_blocks``: the emulation's
    values) and their per-token scales ``(tokens, heads)`` float32. v is stored keys-contiguous
    in whole 128-slot blocks (``quantize_fp8_blocks(tokens_contiguous=True)``): Hopper's FP8
    MMA reads both operands K-major, and P V reduces over the keys (as Triton's FP8 attention
    tutorial stores V); the blocks make every key tile an aligned, unmasked 16-byte load
    (masked at the sample's end, a token-contiguous tile loads byte by byte)."""

    q8: torch.Tensor
    k8: torch.Tensor
    v8: torch.Tensor
    q_scale: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor


def _fp8_operands(q, k, v, launch: _Launch) -> _Fp8Operands:
    q8, q_scale = quantize_fp8_blocks(q, launch.q_lengths, interpret=launch.interpret)
    k8, k_scale = quantize_fp8_blocks(k, launch.k_lengths, interpret=launch.interpret)
    v8, v_scale = quantize_fp8_blocks(
        v, launch.k_lengths, interpret=launch.interpret, tokens_contiguous=True
    )
    return _Fp8Operands(q8, k8, v8, q_scale, k_scale, v_scale)


def _flags(q: torch.Tensor, launch: _Launch) -> dict:
    head_dim = q.shape[2]
    block_d = host.padded_block(head_dim)
    if launch.fp8 and not launch.interpret:
        # FP8 MMAs reduce at least 32 elements per instruction (Hopper's wgmma k = 32): the
        # Q K^T operands are padded with zeros from head_dim 16 to 32.
        block_d = max(block_d, 32)
    return {
        "HEAD_DIM": head_dim,
        "BLOCK_D": block_d,
        "HAS_LEFT": launch.left is not None,
        "HAS_RIGHT": launch.right is not None,
        **host.dot_flags(q, launch.interpret),
        # The interpreter multiplies float8 operands through float32 (exact products).
        **({"UPCAST": True} if launch.fp8 and launch.interpret else {}),
    }


def _bias_args(q, rel_pos_bias, jagged_bias, scale: float):
    # The kernels read the (small) table in float32, pre-divided by the score scale, for tiles
    # whose pairs all fall in one clamped bucket: the bias enters the q.k dot as its
    # accumulator, which is multiplied by scale * log2(e) after.
    rel = q if rel_pos_bias is None else (rel_pos_bias.float() / scale).contiguous()
    jb = q if jagged_bias is None else jagged_bias
    num_buckets = 1 if rel_pos_bias is None else rel_pos_bias.shape[1]
    stride_rel = 0 if rel_pos_bias is None else rel.stride(0)
    stride_jb = 0 if jagged_bias is None else jagged_bias.stride(0)
    return rel, jb, num_buckets, stride_rel, stride_jb


@functools.lru_cache(maxsize=16)
def _strip_index(num_buckets: int, pad: int, width: int, device: torch.device) -> torch.Tensor:
    rows = num_buckets + width + 2 * pad - 1
    y = torch.arange(rows, device=device)[:, None]
    x = torch.arange(width, device=device)[None, :]
    return (y - pad - x).clamp_(0, num_buckets - 1)


def _rel_strip(q, rel_pos_bias, config: JfaTritonConfig) -> dict:
    """Kernel arguments of the ``rel_pos_bias`` strip ``A[h, y, x] = table[h, clamp(y - P - x)]``
    (raw table values): any tile of buckets ``g + row - col`` is the 2-D block at rows
    ``g + P ..``, columns ``0 ..``, so the kernels load tiles that span several buckets as
    plain blocks instead of computing and gathering a bucket per element. P (rows a tile can
    have, minus one) and the width (columns a tile can have) cover the three kernels' tiles;
    the strip holds H * (buckets + width + 2P - 1) * width values, independent of the lengths."""
    if rel_pos_bias is None:
        return {"rs_ptr": q, "stride_rs_h": 0, "STRIP_P": 0, "STRIP_W": 1}
    pad = max(config.fwd_block_m, config.dq_block_m, config.dkdv_block_m) - 1
    width = max(config.fwd_block_n, config.dq_block_n, config.dkdv_block_n)
    strip = rel_pos_bias[:, _strip_index(rel_pos_bias.shape[1], pad, width, q.device)]
    return {"rs_ptr": strip, "stride_rs_h": strip.stride(0), "STRIP_P": pad, "STRIP_W": width}


def _forward(q, k, v, rel_pos_bias, jagged_bias, plan: _Plan, launch: _Launch):
    num_rows, heads, _ = q.shape
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((heads, num_rows), dtype=torch.float32, device=q.device)
    num_tiles = plan.fwd.shape[0]
    if num_tiles == 0:
        return out, lse
    cfg = launch.config
    scale = launch.scale
    if scale < 0:  # the kernel takes each row's maximum before the scale
        q, scale = -q, -scale
    rel, jb, num_buckets, stride_rel, stride_jb = _bias_args(q, rel_pos_bias, jagged_bias, scale)
    fp8 = {}
    if launch.fp8:
        ops8 = _fp8_operands(q, k, v, launch)
        q, k, v = ops8.q8, ops8.k8, ops8.v8
        fp8 = dict(FP8=True, qs_ptr=ops8.q_scale, ks_ptr=ops8.k_scale, vs_ptr=ops8.v_scale)
    _kernels(launch.interpret).jfa_fwd_kernel[(num_tiles * heads,)](
        q, k, v, out, lse, plan.fwd, rel, jb,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), lse.stride(0), stride_rel, stride_jb,
        heads, num_buckets, launch.left or 0, launch.right or 0, scale * _LOG2E,
        BLOCK_M=cfg.fwd_block_m, BLOCK_N=cfg.fwd_block_n,
        HAS_REL=rel_pos_bias is not None, HAS_JAGGED=jagged_bias is not None,
        ONE_LOOP=cfg.fwd_one_loop, num_warps=cfg.fwd_warps, num_stages=cfg.fwd_stages,
        **_rel_strip(q, rel_pos_bias, cfg), **_flags(out, launch), **fp8,
    )  # fmt: skip
    return out, lse


def _backward(grad_out, q, k, v, out, lse, rel_pos_bias, jagged_bias, plan, launch: _Launch):
    num_rows, heads, head_dim = q.shape
    cfg = launch.config
    kernels = _kernels(launch.interpret)
    grad_out = host.unit_stride(grad_out)
    # precision="fp8" quantises the forward's GEMMs only: the backward is the bf16 one, on the
    # input-precision q, k, v and dO, with the FP8 forward's out and lse (on Hopper FP8 backward
    # GEMMs were slower and no more accurate: docs/kernel-tuning.md, "FP8 backward in bf16").
    flags = _flags(q, replace(launch, fp8=False))
    fused_dq = (
        cfg.bwd_fused and jagged_bias is None and not torch.are_deterministic_algorithms_enabled()
    )
    # Fused: dQ accumulates in float32 across key tiles; split: the dQ kernel writes it once.
    dq32 = torch.zeros(q.shape, dtype=torch.float32, device=q.device) if fused_dq else q
    dq = None if fused_dq else torch.empty(q.shape, dtype=q.dtype, device=q.device)
    # Compiled, D a power of two: the dQ adds are TMA bulk reduces (the interpreter has none).
    dq_tma = (
        fused_dq and not launch.interpret and flags["BLOCK_D"] == head_dim
        and host.tma_ready(dq32, interpret=False)
    )  # fmt: skip
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    jb_grad = None if jagged_bias is None else _new_bias_grad(jagged_bias)
    rel_grad = None
    num_key_tiles = plan.dkdv.shape[0]
    rel, jb, num_buckets, stride_rel, stride_jb = _bias_args(
        q, rel_pos_bias, jagged_bias, launch.scale
    )
    strip = _rel_strip(q, rel_pos_bias, cfg)
    buckets_pad = host.padded_block(num_buckets)
    rel_partial = None
    if rel_pos_bias is not None:
        rel_partial = torch.empty(
            (num_key_tiles * heads, buckets_pad), dtype=torch.float32, device=q.device
        )

    delta = torch.empty((heads, num_rows), dtype=torch.float32, device=q.device)
    if num_rows > 0:
        block = 16 if launch.interpret else 64
        kernels.jfa_bwd_preprocess_kernel[(_cdiv(num_rows, block), heads)](
            out, grad_out, delta, num_rows,
            out.stride(0), out.stride(1), grad_out.stride(0), grad_out.stride(1), delta.stride(0),
            HEAD_DIM=head_dim, BLOCK_M=block, BLOCK_D=flags["BLOCK_D"],
        )  # fmt: skip
    if num_key_tiles > 0:
        kernels.jfa_bwd_dkdv_kernel[(num_key_tiles * heads,)](
            q, k, v, grad_out, lse, delta, dk, dv, plan.dkdv, rel, jb,
            q if rel_partial is None else rel_partial,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            grad_out.stride(0), grad_out.stride(1), dk.stride(0), dk.stride(1),
            dv.stride(0), dv.stride(1), lse.stride(0), stride_rel, stride_jb,
            heads, num_buckets, launch.left or 0, launch.right or 0,
            launch.scale * _LOG2E, launch.scale,
            BLOCK_M=cfg.dkdv_block_m, BLOCK_N=cfg.dkdv_block_n,
            HAS_REL=rel_pos_bias is not None, HAS_JAGGED=jagged_bias is not None,
            DIAG_W=1 << (cfg.dkdv_block_m + cfg.dkdv_block_n - 2).bit_length(),
            BUCKETS_PAD=buckets_pad, dq_ptr=dq32, stride_dqt=dq32.stride(0),
            stride_dqh=dq32.stride(1), FUSED_DQ=fused_dq, DQ_TMA=dq_tma, num_q_rows=num_rows,
            num_warps=cfg.bwd_warps, num_stages=cfg.bwd_stages,
            **strip, **flags,
        )  # fmt: skip
    num_query_tiles = 0 if fused_dq else plan.dq.shape[0]
    if fused_dq:
        dq = (dq32 * launch.scale).to(q.dtype)
    if num_query_tiles > 0:
        kernels.jfa_bwd_dq_kernel[(num_query_tiles * heads,)](
            q, k, v, grad_out, lse, delta, dq, plan.dq, rel, jb,
            q if jb_grad is None else jb_grad,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            grad_out.stride(0), grad_out.stride(1), dq.stride(0), dq.stride(1),
            lse.stride(0), stride_rel, stride_jb,
            heads, num_buckets, launch.left or 0, launch.right or 0,
            launch.scale * _LOG2E, launch.scale,
            BLOCK_M=cfg.dq_block_m, BLOCK_N=cfg.dq_block_n,
            HAS_REL=rel_pos_bias is not None, HAS_JAGGED=jagged_bias is not None,
            num_warps=cfg.dq_warps or cfg.bwd_warps, num_stages=cfg.dq_stages or cfg.bwd_stages,
            **strip, **flags,
        )  # fmt: skip
    if rel_pos_bias is not None:
        # Fixed-order reduction of the per-program partials: deterministic.
        summed = rel_partial.view(num_key_tiles, heads, buckets_pad).sum(0)
        rel_grad = summed[:, :num_buckets].to(rel_pos_bias.dtype)
    return dq, dk, dv, rel_grad, jb_grad


def _new_bias_grad(jagged_bias: torch.Tensor) -> torch.Tensor:
    """Uninitialised buffer for d(jagged_bias): the dQ kernel writes every element (dS for
    visited pairs, zeros for pairs outside the window or causal band). Tests replace it with a
    NaN-filled buffer to prove that."""
    return torch.empty_like(jagged_bias)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class JaggedFlashAttentionFunction(torch.autograd.Function):
    """Autograd wrapper of the Triton kernels (inputs validated and planned by the caller).

    ``apply(q, k, v, rel_pos_bias, jagged_bias, plan, launch)``; the biases may be ``None``.
    Backward is once-differentiable.
    """

    @staticmethod
    def forward(ctx, q, k, v, rel_pos_bias, jagged_bias, plan, launch):
        out, lse = _forward(q, k, v, rel_pos_bias, jagged_bias, plan, launch)
        ctx.save_for_backward(q, k, v, out, lse, rel_pos_bias, jagged_bias)
        ctx.plan = plan
        ctx.launch = launch
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        q, k, v, out, lse, rel_pos_bias, jagged_bias = ctx.saved_tensors
        if ctx.plan.dkdv is None:
            raise RuntimeError("jagged flash attention was planned without backward tables")
        dq, dk, dv, rel_grad, jb_grad = _backward(
            grad_out, q, k, v, out, lse, rel_pos_bias, jagged_bias, ctx.plan, ctx.launch
        )
        return dq, dk, dv, rel_grad, jb_grad, None, None


# ---------------------------------------------------------------------------------------------
# Entry points (validated input).


def _resolve_window(causal: bool, window) -> tuple[int | None, int | None]:
    left, right = (None, None) if window is None else (window[0], window[1])
    if causal:
        right = 0  # causal sees j <= p, i.e. a right window of 0 (intersected with any other)
    return left, right


def _prepare(
    q, k, v, q_lengths, k_lengths, *, scale, causal, window, rel_pos_bias, jagged_bias, config,
    with_backward, precision="bf16",
):  # fmt: skip
    """Config, launch parameters and plan of a call, and its tensors as the kernels take them:
    ``(q, k, v, rel_pos_bias, jagged_bias, plan, launch)``. A zero ``scale`` returns ``q * 0``
    and a unit scale (the kernels divide biases by the scale; ``scale * q.k == 1 * (0 * q).k``,
    with the same zero gradients for q and k through the product)."""
    interpret = host.interpret_for(q)
    if k_lengths is None:
        k_lengths = q_lengths
    head_dim = q.shape[2]
    left, right = _resolve_window(causal, window)
    q_info, k_info = host.host_lengths_of(q_lengths), host.host_lengths_of(k_lengths)
    if config is None:
        longest = max(q_info.longest, k_info.longest)
        if left is not None and right is not None:
            # A query row sees at most left + right + 1 keys: the tiles of a short batch fit.
            longest = min(longest, left + right + 1)
        config = default_config(
            head_dim,
            interpret=interpret,
            with_bias=rel_pos_bias is not None,
            with_jagged_bias=jagged_bias is not None,
            max_len=longest,
            masked=left is not None or right is not None,
        )
        if precision == "fp8" and not interpret:
            config = _fp8_default(config, head_dim)
    fp8 = precision == "fp8"
    if fp8:
        _check_fp8_config(config, interpret)
    launch = _Launch(
        scale=1.0 / math.sqrt(head_dim) if scale is None else float(scale),
        left=left,
        right=right,
        config=config,
        interpret=interpret,
        fp8=fp8,
        q_lengths=q_lengths if fp8 else None,
        k_lengths=k_lengths if fp8 else None,
    )
    if launch.scale == 0.0:
        q = q * 0.0
        launch = replace(launch, scale=1.0)
    plan = _plan(q_info, k_info, left, right, config, q.device, with_backward)
    q, k, v = host.unit_stride(q), host.unit_stride(k), host.unit_stride(v)
    if fp8:  # the kernels address the E4M3 copies of q and k with q's and k's strides
        q, k = q.contiguous(), k.contiguous()
    if rel_pos_bias is not None:
        rel_pos_bias = rel_pos_bias.contiguous()
    if jagged_bias is not None:
        jagged_bias = jagged_bias.contiguous()
    return q, k, v, rel_pos_bias, jagged_bias, plan, launch


def _fp8_default(config: JfaTritonConfig, head_dim: int) -> JfaTritonConfig:
    """The default ``config`` of a compiled FP8 call (head_dim 129..256, untuned in FP8, keeps
    its own)."""
    if head_dim > 128:
        return config
    return replace(config, fwd_block_n=max(config.fwd_block_n, _FP8_MIN_FWD_BLOCK_N))


def _check_fp8_config(config: JfaTritonConfig, interpret: bool) -> None:
    """The FP8 forward reads one scale per tile and operand: its tiles must lie inside one
    ``reference.FP8_BLOCK``-token quantisation block (tiles are powers of two from 16 and start
    at multiples of their size within a sample, so a size up to FP8_BLOCK does). Compiled, the
    key tile that P V reduces over needs 32 rows: an FP8 MMA instruction reduces 32 elements.
    (The backward runs in bf16, at any tiles.)"""
    sizes = {"fwd_block_m": config.fwd_block_m, "fwd_block_n": config.fwd_block_n}
    for name, size in sizes.items():
        if size > reference.FP8_BLOCK:
            raise ValueError(
                f"config.{name}={size} is larger than the FP8 quantisation block "
                f"({reference.FP8_BLOCK} tokens) that precision='fp8' needs"
            )
    if not interpret and config.fwd_block_n < 32:
        raise ValueError(
            f"config.fwd_block_n={config.fwd_block_n} is below 32, which FP8 MMAs need"
        )


def jagged_flash_attention_from_lengths(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_lengths: torch.Tensor,
    k_lengths: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
    rel_pos_bias: torch.Tensor | None = None,
    jagged_bias: torch.Tensor | None = None,
    config: JfaTritonConfig | None = None,
    precision: str = "bf16",
) -> torch.Tensor:
    """Triton jagged attention from per-sample lengths (CPU tensors: no device sync needed).

    Same semantics as :func:`gem_kernels.jagged_flash_attention`; inputs are assumed valid
    (lengths sum to the row counts, biases shaped as documented there). Differentiable through
    :class:`JaggedFlashAttentionFunction`, with an optional tile ``config``: the entry point of
    the tests and benchmarks (the public function runs the ``gem_kernels::`` operators, whose
    forward and backward are :func:`forward_from_lengths` and :func:`backward_from_lengths`).
    """
    tensors = (q, k, v, rel_pos_bias, jagged_bias)
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    q, k, v, rel_pos_bias, jagged_bias, plan, launch = _prepare(
        q, k, v, q_lengths, k_lengths, scale=scale, causal=causal, window=window,
        rel_pos_bias=rel_pos_bias, jagged_bias=jagged_bias, config=config,
        with_backward=needs_grad, precision=precision,
    )  # fmt: skip
    if not needs_grad:  # inference: no autograd node to build, no LSE to keep
        return _forward(q, k, v, rel_pos_bias, jagged_bias, plan, launch)[0]
    return JaggedFlashAttentionFunction.apply(q, k, v, rel_pos_bias, jagged_bias, plan, launch)


def forward_from_lengths(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_lengths: torch.Tensor,
    k_lengths: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
    rel_pos_bias: torch.Tensor | None = None,
    jagged_bias: torch.Tensor | None = None,
    config: JfaTritonConfig | None = None,
    precision: str = "bf16",
    plan_backward: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' forward without autograd: ``(out (Tq, H, D), lse (H, Tq) float32)`` (lse in
    the log2 domain, ``+inf`` for rows without keys), as the operator returns them.
    ``plan_backward``: also plan the backward's work lists now (cached for its call)."""
    q, k, v, rel_pos_bias, jagged_bias, plan, launch = _prepare(
        q, k, v, q_lengths, k_lengths, scale=scale, causal=causal, window=window,
        rel_pos_bias=rel_pos_bias, jagged_bias=jagged_bias, config=config,
        with_backward=plan_backward, precision=precision,
    )  # fmt: skip
    return _forward(q, k, v, rel_pos_bias, jagged_bias, plan, launch)


def backward_from_lengths(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    q_lengths: torch.Tensor,
    k_lengths: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
    rel_pos_bias: torch.Tensor | None = None,
    jagged_bias: torch.Tensor | None = None,
    config: JfaTritonConfig | None = None,
) -> tuple[torch.Tensor, ...]:
    """Gradients ``(dq, dk, dv, d_rel_pos_bias, d_jagged_bias)`` (``None`` for absent biases)
    from the forward's ``out`` and ``lse``: the kernels :class:`JaggedFlashAttentionFunction`
    runs in its backward, on the same prepared inputs. The same for either forward precision
    (an FP8 forward's ``out`` and ``lse`` included): the backward runs in the inputs' precision."""
    q0, k, v, rel_pos_bias, jagged_bias, plan, launch = _prepare(
        q, k, v, q_lengths, k_lengths, scale=scale, causal=causal, window=window,
        rel_pos_bias=rel_pos_bias, jagged_bias=jagged_bias, config=config, with_backward=True,
    )  # fmt: skip
    dq, dk, dv, rel_grad, jb_grad = _backward(
        grad_out, q0, k, v, host.unit_stride(out), host.unit_stride(lse), rel_pos_bias,
        jagged_bias, plan, launch,
    )  # fmt: skip
    if scale is not None and float(scale) == 0.0:
        dq = dq * 0.0  # through _prepare's q * 0, as autograd does for the Function
    return dq, dk, dv, rel_grad, jb_grad


def jagged_flash_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor,
    k_offsets: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
    rel_pos_bias: torch.Tensor | None = None,
    jagged_bias: torch.Tensor | None = None,
    config: JfaTritonConfig | None = None,
    precision: str = "bf16",
) -> torch.Tensor:
    """Triton jagged attention from offsets; same semantics as the public function.

    Inputs are assumed valid: call :func:`gem_kernels.jagged_flash_attention` (with
    ``backend="triton"``) for argument checks. Offsets are read on the host (one device sync
    when they live on the GPU).
    """
    q_lengths = host.host_lengths(q_offsets)
    return jagged_flash_attention_from_lengths(
        q,
        k,
        v,
        q_lengths,
        q_lengths if k_offsets is None else host.host_lengths(k_offsets),
        scale=scale,
        causal=causal,
        window=window,
        rel_pos_bias=rel_pos_bias,
        jagged_bias=jagged_bias,
        config=config,
        precision=precision,
    )
