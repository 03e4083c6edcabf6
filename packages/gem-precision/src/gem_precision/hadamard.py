"""Random Hadamard transform (RHT) along the last dim, block by block.

Each block of ``b`` consecutive last-dim elements is mapped to ``x_blk @ D_blk @ H_b / sqrt(b)``
where ``H_b`` is the Sylvester Hadamard matrix (``b`` a power of two) and ``D`` a random +-1
diagonal drawn per last-dim position from Philox (:func:`gem_precision.philox_uint32`, counter =
position) with ``seed``. The transform is orthogonal, so applying it with the same seed to both
operands of ``A @ B.T`` (along their shared K dim) leaves the product unchanged, while spreading
outliers over the block, which shrinks the block amax relative to its RMS before quantization.
"""

from __future__ import annotations

import functools
import math

import torch

from gem_precision.rounding import philox_uint32

__all__ = [
    "hadamard_matrix",
    "inverse_random_hadamard_transform",
    "random_hadamard_signs",
    "random_hadamard_transform",
]

_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_block_size(block_size: int) -> None:
    if (
        isinstance(block_size, bool)
        or not isinstance(block_size, int)
        or block_size <= 0
        or block_size & (block_size - 1)
    ):
        raise ValueError(f"block_size must be a positive power of two int, got {block_size!r}")


def hadamard_matrix(size: int, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """Unnormalized Sylvester Hadamard matrix of order ``size`` (a power of two), entries +-1."""
    _check_block_size(size)
    h = torch.ones(1, 1, dtype=dtype, device=device)
    while h.shape[0] < size:
        h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)], dim=0)
    return h


def random_hadamard_signs(length: int, *, seed: int, device=None) -> torch.Tensor:
    """The +-1 float32 diagonal ``D`` for ``length`` last-dim positions (bit 31 of Philox)."""
    bits = philox_uint32(length, seed=seed, device=device)
    return 1.0 - 2.0 * (bits >> 31).to(torch.float32)


@functools.lru_cache(maxsize=256)
def _signs_and_matrix(
    k: int, block_size: int, seed: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sign blocks and the normalised Hadamard matrix, built once per (K, block, seed,
    device): every GEMM of a layer reuses them, and building them costs ~100 small kernels
    (Philox in PyTorch ops), which made a GPU training step with RHT host-bound."""
    signs = random_hadamard_signs(k, seed=seed, device=device).reshape(-1, block_size)
    return signs, hadamard_matrix(block_size, device=device) / math.sqrt(block_size)


def _transform(x: torch.Tensor, block_size: int, seed: int, inverse: bool) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _INPUT_DTYPES:
        raise TypeError(f"x must have dtype float32, bfloat16 or float16, got {x.dtype}")
    _check_block_size(block_size)
    if x.dim() == 0 or x.shape[-1] % block_size:
        raise ValueError(
            f"the last dim of x must be divisible by block_size={block_size}, "
            f"got shape {tuple(x.shape)}"
        )
    k = x.shape[-1]
    signs, h = _signs_and_matrix(k, block_size, seed, x.device)
    blocks = x.to(torch.float32).reshape(*x.shape[:-1], k // block_size, block_size)
    # H is symmetric, so the inverse of (D H / sqrt(b)) is (H D / sqrt(b)).
    out = (blocks @ h) * signs if inverse else (blocks * signs) @ h
    return out.reshape(x.shape).to(x.dtype)


def random_hadamard_transform(x: torch.Tensor, *, block_size: int = 32, seed: int) -> torch.Tensor:
    """Apply ``(D H) / sqrt(block_size)`` to each ``block_size`` block of the last dim of ``x``.

    Computed in float32 and returned in ``x.dtype``. Use the same ``seed`` (and block size) for
    both GEMM operands so that ``T(A) @ T(B).T == A @ B.T`` up to rounding.
    """
    return _transform(x, block_size, seed, inverse=False)


def inverse_random_hadamard_transform(
    y: torch.Tensor, *, block_size: int = 32, seed: int
) -> torch.Tensor:
    """Undo :func:`random_hadamard_transform` with the same ``block_size`` and ``seed``."""
    return _transform(y, block_size, seed, inverse=True)
