"""Triton implementation of block attention with fused RoPE: launches and autograd.

The kernels live in ``_block_kernels.py``. :func:`block_attention_triton` runs them on validated
input (the public, validating entry point is :func:`gem_kernels.block_attention`, which
dispatches here for CUDA float16/bfloat16 inputs).

One forward kernel and one backward kernel, no other launches: RoPE is applied to q and k in
registers (no rotated copies in HBM), and the backward computes dq, dk and dv of a block in one
program (a block is at most 128 tokens and fits in registers/shared memory), rotating dq and dk
back before storing them. No atomics, no saved softmax statistics: the backward reads q, k, v
and dO and writes dq, dk, dv; the forward reads q, k, v and writes out.

The host ships ``offsets``, the per-sample block prefix sums and the sample of every block in
one small copy (pinned, non-blocking: no device sync when the offsets are on the CPU).

CPU tensors run under the Triton interpreter when ``TRITON_INTERPRET=1`` is set at call time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from gem_kernels import _triton_host as host
from gem_kernels.triton_loader import load_kernel_module

__all__ = [
    "BLOCK_ATTENTION_CONFIGS",
    "MAX_TRITON_BLOCK_SIZE",
    "MAX_TRITON_HEAD_DIM",
    "BlockAttentionFunction",
    "BlockAttentionTritonConfig",
    "backward_from_lengths",
    "block_attention_from_lengths",
    "block_attention_triton",
    "default_config",
    "forward_from_lengths",
    "triton_unsupported_reason",
]

#: Largest head dimension the Triton kernels take (bigger ones go to the reference).
MAX_TRITON_HEAD_DIM = 256
#: Largest block the Triton kernels take: a whole block lives in one program's registers.
MAX_TRITON_BLOCK_SIZE = 128

_LOG2E = 1.4426950408889634
_TURN_BITS = 40  # fixed-point fraction bits of the per-frequency "turns per position" table


@dataclass(frozen=True)
class BlockAttentionTritonConfig:
    """Launch parameters of the two kernels (heads per program are reduced to divide H).

    The defaults are the fastest of H200 sweeps at D=128 (bf16); the numbers, and the
    variants measured slower, are in docs/kernel-tuning.md.
    """

    fwd_heads_per_program: int = 4
    """Heads handled by one forward program (sines/cosines computed once for all of them)."""
    fwd_warps: int = 4
    """Warps per forward program."""
    fwd_stages: int = 1
    """Software-pipelining depth of the forward's head loop (1: none; smaller shared-memory
    footprint, more programs per SM)."""
    bwd_heads_per_program: int = 4
    """Heads handled by one backward program."""
    bwd_warps: int = 8
    """Warps per backward program."""
    bwd_stages: int = 2
    """Software-pipelining depth of the backward's head loop."""


#: The configurations :func:`default_config` chooses from, each with the reason it is the one.
BLOCK_ATTENTION_CONFIGS: dict[str, host.TunedConfig] = {
    "interpret": host.TunedConfig(
        BlockAttentionTritonConfig(
            fwd_heads_per_program=2,
            fwd_warps=1,
            fwd_stages=1,
            bwd_heads_per_program=2,
            bwd_warps=1,
            bwd_stages=1,
        ),
        "the Triton interpreter on the CPU: one warp, 2 heads per program (the head loop runs)",
    ),
    "d128": host.TunedConfig(
        BlockAttentionTritonConfig(),
        "head_dim <= 128: the H200 sweep's fastest (docs/kernel-tuning.md)",
    ),
    "d256": host.TunedConfig(
        BlockAttentionTritonConfig(
            fwd_heads_per_program=1,
            fwd_warps=8,
            fwd_stages=1,
            bwd_heads_per_program=1,
            bwd_warps=8,
            bwd_stages=1,
        ),
        "head_dim 129..256: one head per program in 8 warps, so a block's rows fit registers",
    ),
}


def default_config(head_dim: int, *, interpret: bool = False) -> BlockAttentionTritonConfig:
    """The ``BLOCK_ATTENTION_CONFIGS`` entry of a call: ``"interpret"`` under the interpreter,
    else ``"d128"`` up to head_dim 128 and ``"d256"`` above."""
    name = "interpret" if interpret else "d256" if head_dim > 128 else "d128"
    return BLOCK_ATTENTION_CONFIGS[name].config


# ---------------------------------------------------------------------------------------------
# Kernel module loading (compiled or interpreted).


_KERNEL_FILE = Path(__file__).with_name("_block_kernels.py")


def _kernels(interpret: bool) -> ModuleType:
    """The kernel module decorated for this mode (compiled for CUDA, interpreted for CPU tests)."""
    return load_kernel_module(_KERNEL_FILE, interpret)


# ---------------------------------------------------------------------------------------------
# Support check.


def triton_unsupported_reason(q: torch.Tensor, block_size: int) -> str | None:
    """Why the Triton path cannot run this call, or ``None`` when it can.

    The Triton path takes float16/bfloat16/float32 on CUDA (float32 with IEEE-exact dot
    products), or CPU tensors when ``TRITON_INTERPRET=1`` is set; head_dim up to
    ``MAX_TRITON_HEAD_DIM`` and block_size up to ``MAX_TRITON_BLOCK_SIZE``.
    """
    return host.unsupported_reason(
        q,
        MAX_TRITON_HEAD_DIM,
        f"block_size {block_size} is larger than {MAX_TRITON_BLOCK_SIZE}"
        if block_size > MAX_TRITON_BLOCK_SIZE
        else None,
    )


# ---------------------------------------------------------------------------------------------
# Planning and launches.


@dataclass(frozen=True)
class _Launch:
    """Everything both launches share besides tensors."""

    meta: torch.Tensor
    """Device int64: ``offsets`` (B + 1), ``cum_blocks`` (B + 1), the sample of every block
    (``num_blocks``), the fixed-point RoPE frequencies (D / 2), then ``[first row, rows,
    first position]`` of every block (3 x ``num_blocks``)."""
    num_samples: int
    num_blocks: int
    block_size: int
    scale: float
    config: BlockAttentionTritonConfig
    interpret: bool


def _turn_frequencies(head_dim: int, theta: float) -> list[int]:
    """``round(theta^(-2i/D) / (2 pi) * 2^40)``: turns per position unit, fixed point."""
    half = head_dim // 2
    return [
        round(theta ** (-2.0 * i / head_dim) / (2.0 * math.pi) * (1 << _TURN_BITS))
        for i in range(half)
    ]


_PLAN_CACHE = host.PlanCache(maxsize=16)


def _plan(lengths, block_size, head_dim, theta, scale, config, interpret, device) -> _Launch:
    info = host.host_lengths_of(lengths)  # the bytes key and host copy, made once per tensor
    key = (info.key, block_size, head_dim, theta, scale, config, interpret, str(device))
    return _PLAN_CACHE.get(
        key,
        lambda: _build_plan(
            info.values, block_size, head_dim, theta, scale, config, interpret, device
        ),
    )


def _build_plan(lengths, block_size, head_dim, theta, scale, config, interpret, device) -> _Launch:
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=offsets[1:])
    blocks = (lengths + block_size - 1) // block_size
    cum_blocks = torch.zeros_like(offsets)
    torch.cumsum(blocks, 0, out=cum_blocks[1:])
    num_blocks = int(cum_blocks[-1])
    # Sample of every block: +1 at each sample's first block, then a prefix sum (cheaper on the
    # host than repeat_interleave, which goes multi-threaded from a few hundred samples on).
    marks = torch.zeros(num_blocks + 1, dtype=torch.int64)
    firsts = cum_blocks[1:-1]
    marks.scatter_add_(0, firsts, torch.ones_like(firsts))
    block_sample = torch.cumsum(marks[:num_blocks], 0)
    freqs = torch.tensor(_turn_frequencies(head_dim, theta), dtype=torch.int64)
    first_pos = torch.arange(num_blocks, dtype=torch.int64) - cum_blocks[block_sample]
    first_pos *= block_size
    row0 = offsets[block_sample] + first_pos
    rows = torch.minimum(lengths[block_sample] - first_pos, torch.tensor(block_size))
    block_table = torch.stack([row0, rows, first_pos], dim=1).reshape(-1)
    packed = torch.cat([offsets, cum_blocks, block_sample, freqs, block_table])
    packed = host.copy_to_device(packed, device)
    return _Launch(
        meta=packed,
        num_samples=lengths.numel(),
        num_blocks=num_blocks,
        block_size=block_size,
        scale=scale,
        config=config,
        interpret=interpret,
    )


def _common(q: torch.Tensor, launch: _Launch, positions: torch.Tensor | None, per_program: int):
    heads, head_dim = q.shape[1], q.shape[2]
    half = head_dim // 2
    per_program = math.gcd(heads, per_program)
    grid = (launch.num_blocks, heads // per_program)
    freq_start = 2 * (launch.num_samples + 1) + launch.num_blocks
    freq = launch.meta[freq_start : freq_start + half]
    args = (
        launch.meta,
        freq,
        launch.meta if positions is None else positions,
    )
    sizes = (
        launch.num_samples,
        launch.block_size,
        launch.scale * _LOG2E,
    )
    flags = {
        "HEADS_PER_PROGRAM": per_program,
        "HEAD_DIM": head_dim,
        "HALF": half,
        "BLOCK_M": host.padded_block(launch.block_size),
        "BLOCK_HALF": host.padded_block(half),
        "BLOCK_D": host.padded_block(head_dim),
        "HAS_POS": positions is not None,
        # RoPE sines/cosines by the hardware approximations (error < 2^-20.5 on the [-pi, pi)
        # angles the kernels reduce to; inline PTX, so compiled kernels only).
        "FAST_TRIG": not launch.interpret,
        **host.dot_flags(q, launch.interpret),
    }
    return grid, args, sizes, flags


def _forward(q, k, v, positions, launch: _Launch) -> torch.Tensor:
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if launch.num_blocks == 0:
        return out
    cfg = launch.config
    (num_blocks, groups), args, sizes, flags = _common(
        q, launch, positions, cfg.fwd_heads_per_program
    )
    blocks = launch.meta[2 * (launch.num_samples + 1) + num_blocks + q.shape[2] // 2 :]
    items = num_blocks * groups
    _kernels(launch.interpret).block_attn_fwd_kernel[(items,)](
        q, k, v, out, *args, blocks,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), *sizes, items, groups,
        num_warps=cfg.fwd_warps, num_stages=cfg.fwd_stages, **flags,
    )  # fmt: skip
    return out


def _backward(grad_out, q, k, v, positions, launch: _Launch):
    grad_out = host.unit_stride(grad_out)
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if launch.num_blocks == 0:
        return dq, dk, dv
    cfg = launch.config
    grid, args, sizes, flags = _common(q, launch, positions, cfg.bwd_heads_per_program)
    _kernels(launch.interpret).block_attn_bwd_kernel[grid](
        q, k, v, grad_out, dq, dk, dv, *args,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        grad_out.stride(0), grad_out.stride(1), dq.stride(0), dq.stride(1),
        dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1), *sizes, launch.scale,
        num_warps=cfg.bwd_warps, num_stages=cfg.bwd_stages, **flags,
    )  # fmt: skip
    return dq, dk, dv


class BlockAttentionFunction(torch.autograd.Function):
    """Autograd wrapper of the two kernels (inputs validated and planned by the caller).

    ``apply(q, k, v, positions, launch)``; ``positions`` may be ``None``. Backward is
    once-differentiable; ``positions`` gets no gradient.
    """

    @staticmethod
    def forward(ctx, q, k, v, positions, launch):
        out = _forward(q, k, v, positions, launch)
        ctx.save_for_backward(q, k, v, positions)
        ctx.launch = launch
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        q, k, v, positions = ctx.saved_tensors
        dq, dk, dv = _backward(grad_out, q, k, v, positions, ctx.launch)
        return dq, dk, dv, None, None


# ---------------------------------------------------------------------------------------------
# Entry points (validated input).


def _prepare(q, k, v, lengths, *, block_size, positions, rope_theta, scale, config):
    """Plan and launch parameters of a call, and its tensors as the kernels take them:
    ``(q, k, v, positions, launch)``."""
    interpret = host.interpret_for(q)
    head_dim = q.shape[2]
    launch = _plan(
        lengths,
        block_size,
        head_dim,
        float(rope_theta),
        1.0 / math.sqrt(head_dim) if scale is None else float(scale),
        config or default_config(head_dim, interpret=interpret),
        interpret,
        q.device,
    )
    q, k, v = host.unit_stride(q), host.unit_stride(k), host.unit_stride(v)
    if positions is not None:
        positions = positions.contiguous()
    return q, k, v, positions, launch


def block_attention_from_lengths(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: torch.Tensor,
    *,
    block_size: int = 64,
    positions: torch.Tensor | None = None,
    rope_theta: float = 10000.0,
    scale: float | None = None,
    config: BlockAttentionTritonConfig | None = None,
) -> torch.Tensor:
    """Triton block attention from per-sample lengths (CPU lengths: no device sync).

    Same semantics as :func:`gem_kernels.block_attention`; inputs are assumed valid (lengths
    sum to the row count, ``block_size <= MAX_TRITON_BLOCK_SIZE``, D even). Differentiable
    through :class:`BlockAttentionFunction`, with an optional ``config``: the entry point of the
    tests and benchmarks (the public function runs the ``gem_kernels::`` operators, whose
    forward and backward are :func:`forward_from_lengths` and :func:`backward_from_lengths`).
    """
    q, k, v, positions, launch = _prepare(
        q, k, v, lengths, block_size=block_size, positions=positions, rope_theta=rope_theta,
        scale=scale, config=config,
    )  # fmt: skip
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))):
        return _forward(q, k, v, positions, launch)  # inference: no autograd node to build
    return BlockAttentionFunction.apply(q, k, v, positions, launch)


def forward_from_lengths(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: torch.Tensor,
    *,
    block_size: int = 64,
    positions: torch.Tensor | None = None,
    rope_theta: float = 10000.0,
    scale: float | None = None,
    config: BlockAttentionTritonConfig | None = None,
) -> torch.Tensor:
    """The forward kernel without autograd (the operator's forward)."""
    q, k, v, positions, launch = _prepare(
        q, k, v, lengths, block_size=block_size, positions=positions, rope_theta=rope_theta,
        scale=scale, config=config,
    )  # fmt: skip
    return _forward(q, k, v, positions, launch)


def backward_from_lengths(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: torch.Tensor,
    *,
    block_size: int = 64,
    positions: torch.Tensor | None = None,
    rope_theta: float = 10000.0,
    scale: float | None = None,
    config: BlockAttentionTritonConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``(dq, dk, dv)``: the kernel :class:`BlockAttentionFunction` runs in its
    backward, on the same prepared inputs."""
    q, k, v, positions, launch = _prepare(
        q, k, v, lengths, block_size=block_size, positions=positions, rope_theta=rope_theta,
        scale=scale, config=config,
    )  # fmt: skip
    return _backward(grad_out, q, k, v, positions, launch)


def block_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    *,
    block_size: int = 64,
    positions: torch.Tensor | None = None,
    rope_theta: float = 10000.0,
    scale: float | None = None,
    config: BlockAttentionTritonConfig | None = None,
) -> torch.Tensor:
    """Triton block attention from offsets; same semantics as the public function.

    Inputs are assumed valid: call :func:`gem_kernels.block_attention` (with
    ``backend="triton"``) for argument checks. Offsets are read on the host (one device sync
    when they live on the GPU).
    """
    return block_attention_from_lengths(
        q,
        k,
        v,
        host.host_lengths(offsets),
        block_size=block_size,
        positions=positions,
        rope_theta=rope_theta,
        scale=scale,
        config=config,
    )
