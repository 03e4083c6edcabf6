"""E4M3 copies of jagged attention operands for ``precision="fp8"``, on the device.

One Triton launch per operand, no host sync: the block table comes from the host lengths the
attention call already has (cached per lengths, uploaded through pinned memory). The values and
scales are bit-identical to :func:`gem_kernels.reference.quantize_fp8_blocks`, the emulation's
PyTorch version.
"""

from __future__ import annotations

from pathlib import Path

import torch

from gem_kernels import _triton_host as host
from gem_kernels.reference import FP8_BLOCK
from gem_kernels.triton_loader import load_kernel_module

__all__ = ["padded_starts", "quantize_fp8_blocks"]

_KERNEL_FILE = Path(__file__).with_name("_fp8_kernels.py")
#: (start, count) rows of every 128-token block, per (lengths, device): the operands of one
#: call (and of every layer's call on the same batch) share it.
_BLOCK_TABLES = host.PlanCache(maxsize=16)


def _block_table(lengths: torch.Tensor, device: torch.device) -> torch.Tensor:
    # The copy and key bytes the attention call's own plans already made for these lengths.
    info = host.host_lengths_of(lengths)
    lengths = info.values

    def build() -> torch.Tensor:
        per_sample = (lengths + FP8_BLOCK - 1) // FP8_BLOCK
        sample = torch.repeat_interleave(torch.arange(lengths.numel()), per_sample)
        index = (
            torch.arange(int(per_sample.sum())) - (torch.cumsum(per_sample, 0) - per_sample)[sample]
        )
        start = (torch.cumsum(lengths, 0) - lengths)[sample] + index * FP8_BLOCK
        count = torch.clamp(lengths[sample] - index * FP8_BLOCK, max=FP8_BLOCK)
        return host.copy_to_device(torch.stack([start, count], 1).to(torch.int32), device)

    return _BLOCK_TABLES.get((info.key, str(device)), build)


def quantize_fp8_blocks(
    x: torch.Tensor, lengths: torch.Tensor, *, interpret: bool, tokens_contiguous: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 copy of jagged ``x`` ``(T, H, D)`` and its per-token scales ``(T, H)`` float32
    (``lengths``: host ``(B,)``, summing to ``T``), as
    :func:`gem_kernels.reference.quantize_fp8_blocks` computes them.

    ``tokens_contiguous``: the copy is stored ``(H, D, slots)``, token stride 1 (the K-major
    operand Hopper's FP8 MMA needs where it is reduced over tokens), each sample's 128-token
    blocks in whole ``FP8_BLOCK``-slot blocks with zeros after its last token, and returned as
    its ``(slots, H, D)`` view: token ``i`` of a sample sits at slot :func:`padded_starts`
    ``[sample] + i``. Kernel tiles inside a block then load aligned, unmasked rows."""
    rows, heads, dim = x.shape
    table = _block_table(lengths, x.device)
    if tokens_contiguous:
        slots = table.shape[0] * FP8_BLOCK
        x8 = torch.empty((heads, dim, slots), dtype=torch.float8_e4m3fn, device=x.device)
        x8 = x8.permute(2, 0, 1)
    else:
        x8 = torch.empty((rows, heads, dim), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((rows, heads), dtype=torch.float32, device=x.device)
    if table.shape[0] == 0 or heads == 0:
        return x8, scale
    x = host.unit_stride(x)
    kernels = load_kernel_module(_KERNEL_FILE, interpret)
    kernels.fp8_blocks_kernel[(table.shape[0], heads)](
        x, x8, scale, table, x.stride(0), x.stride(1), x8.stride(0), x8.stride(1), x8.stride(2),
        heads, HEAD_DIM=dim, BLOCK_D=host.padded_block(dim), BLOCK_T=FP8_BLOCK,
        PADDED=tokens_contiguous, INTERPRETED=interpret, num_warps=4,
    )  # fmt: skip
    return x8, scale


def padded_starts(lengths: torch.Tensor) -> torch.Tensor:
    """First slot of each sample in a ``tokens_contiguous`` copy (host ``(B,)`` lengths in,
    int64 out): ``FP8_BLOCK`` times the number of blocks of the samples before it."""
    blocks = (lengths.to(torch.int64) + FP8_BLOCK - 1) // FP8_BLOCK
    return (torch.cumsum(blocks, 0) - blocks) * FP8_BLOCK
