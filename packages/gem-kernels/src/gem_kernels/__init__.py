"""gem-kernels: jagged attention for recommendation models.

``jagged_flash_attention`` runs Triton kernels for CUDA fp16/bf16 inputs and the PyTorch
reference everywhere else; ``gdpa`` and ``block_attention`` do the same with their own Triton
kernels. ``gem_kernels.reference`` is the test oracle and the CPU path (with an emulation of
the FP8 kernels for ``jagged_flash_attention(..., precision="fp8")`` and
``gdpa(..., precision="fp8")``).
"""

from gem_kernels.attention import (
    BLOCK_ATTENTION_BACKENDS,
    GDPA_BACKENDS,
    GDPA_PRECISIONS,
    JFA_BACKENDS,
    JFA_PRECISIONS,
    block_attention,
    gdpa,
    jagged_flash_attention,
    rope,
    rope_qkv,
    swiglu,
)
from gem_kernels.jagged import (
    host_offsets,
    lengths_to_offsets,
    offsets_to_lengths,
    validate_offsets,
)
from gem_kernels.reference import rope_tables

__all__ = [
    "BLOCK_ATTENTION_BACKENDS",
    "GDPA_BACKENDS",
    "GDPA_PRECISIONS",
    "JFA_BACKENDS",
    "JFA_PRECISIONS",
    "block_attention",
    "gdpa",
    "host_offsets",
    "jagged_flash_attention",
    "lengths_to_offsets",
    "offsets_to_lengths",
    "rope",
    "rope_qkv",
    "rope_tables",
    "swiglu",
    "validate_offsets",
]
