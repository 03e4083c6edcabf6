"""gem-kernels: jagged attention kernels (PyTorch reference today, Triton later) and helpers."""

from gem_kernels.attention import block_attention, gdpa, jagged_flash_attention
from gem_kernels.jagged import lengths_to_offsets, offsets_to_lengths, validate_offsets

__all__ = [
    "block_attention",
    "gdpa",
    "jagged_flash_attention",
    "lengths_to_offsets",
    "offsets_to_lengths",
    "validate_offsets",
]
