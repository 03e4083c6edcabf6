"""Helpers for the jagged layout: the rows of all samples concatenated plus an offsets vector.

Sample ``i`` owns rows ``offsets[i]:offsets[i + 1]`` of the values tensor, so ``offsets`` has
``B + 1`` entries, starts at 0, never decreases and ends at the number of rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

__all__ = [
    "host_lengths",
    "host_offsets",
    "lengths_to_offsets",
    "offsets_to_lengths",
    "validate_offsets",
]


class TensorMemo:
    """Values derived from tensors, one per tensor object and version (``tensor._version``,
    bumped by in-place changes), dropped when the tensor dies.

    Keyed by the object itself, not by its data address (which the caching allocator reuses).
    Inference tensors have no version counter: their values are derived again at every call.
    """

    def __init__(self) -> None:
        self._entries = WeakIdKeyDictionary()

    def get(self, tensor: torch.Tensor, derive: Callable[[torch.Tensor], Any]) -> Any:
        """The value remembered for this version of ``tensor``, else ``derive(tensor)``
        (remembered)."""
        if tensor.is_inference():
            return derive(tensor)
        found = self._entries.get(tensor)
        if found is not None and found[0] == tensor._version:
            return found[1]
        value = derive(tensor)
        self._entries[tensor] = (tensor._version, value)
        return value

    def __len__(self) -> int:
        return len(self._entries)


# Offsets tensor -> _HostCopy.
_HOST_COPIES = TensorMemo()


@dataclass
class _HostCopy:
    """What the host knows about one version of an offsets tensor."""

    offsets: torch.Tensor  # CPU int64
    lengths: torch.Tensor  # CPU int64, offsets[1:] - offsets[:-1]
    longest: int  # lengths.max(), 0 without samples
    validated: set = field(default_factory=set)  # (num_rows, max_len) checks that passed


def _read_offsets(offsets: torch.Tensor) -> _HostCopy:
    # A copy even of CPU int64 offsets: the cache is keyed on the tensor's version, which
    # writes through .data or .numpy() do not bump.
    host = offsets.detach().to("cpu", torch.int64, copy=True)
    lengths = host[1:] - host[:-1]
    longest = int(lengths.max()) if lengths.numel() > 0 else 0
    return _HostCopy(host, lengths, longest)


def _host_copy(offsets: torch.Tensor) -> _HostCopy:
    return _HOST_COPIES.get(offsets, _read_offsets)


_INDEX_DTYPES = (torch.int32, torch.int64)


def host_offsets(offsets: torch.Tensor) -> torch.Tensor:
    """``offsets`` as a CPU int64 tensor (treat it as read-only).

    A GPU tensor is copied to the host once and remembered until it is modified in place or
    freed: every attention layer of a model (forward and backward) receives the same offsets
    tensor, and each copy would otherwise stall the host until the GPU drained its queue.
    """
    return _host_copy(offsets).offsets


def host_lengths(offsets: torch.Tensor) -> torch.Tensor:
    """Per-sample lengths of ``offsets`` as a CPU int64 tensor (treat it as read-only), from
    the same cached host copy as :func:`host_offsets`."""
    return _host_copy(offsets).lengths


def _check_index_vector(tensor: object, name: str) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in _INDEX_DTYPES:
        raise TypeError(f"{name} must have dtype int32 or int64, got {tensor.dtype}")
    if tensor.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(tensor.shape)}")
    return tensor


def _check_offsets_layout(offsets: object, name: str) -> torch.Tensor:
    """The checks of :func:`validate_offsets` that read no values: type, dtype, rank, not empty
    (safe inside a ``torch.compile`` trace, where the values are not known)."""
    _check_index_vector(offsets, name)
    if offsets.numel() == 0:
        raise ValueError(f"{name} must have at least one entry (shape (B + 1,)), got none")
    return offsets


def validate_offsets(
    offsets: torch.Tensor,
    name: str = "offsets",
    *,
    num_rows: int | None = None,
    max_len: int | None = None,
) -> None:
    """Check that ``offsets`` is a valid jagged offsets vector; raise otherwise.

    Args:
        offsets: 1-D int32/int64 tensor of shape ``(B + 1,)``.
        name: argument name used in error messages.
        num_rows: if given, ``offsets[-1]`` must equal it (the number of rows of the values).
        max_len: if given, every sample length ``offsets[i + 1] - offsets[i]`` must be
            ``<= max_len``.

    Raises:
        TypeError: not a tensor or not an integer dtype.
        ValueError: wrong rank, empty, ``offsets[0] != 0``, decreasing, last entry not
            ``num_rows``, or a length above ``max_len``. The message names ``name``.
    """
    _check_offsets_layout(offsets, name)
    if max_len is not None and (isinstance(max_len, bool) or not isinstance(max_len, int)):
        raise TypeError(f"max length for {name} must be an int or None, got {max_len!r}")
    if max_len is not None and max_len < 0:
        raise ValueError(f"max length for {name} must be >= 0, got {max_len}")
    _validated(offsets, name, num_rows, max_len)


def validated_lengths(
    offsets: torch.Tensor, name: str, *, num_rows: int | None = None
) -> tuple[torch.Tensor, int]:
    """:func:`validate_offsets` (without ``max_len``), then the :func:`host_lengths` of
    ``offsets`` and the longest of them (0 without samples), from one cache lookup."""
    _check_offsets_layout(offsets, name)
    entry = _validated(offsets, name, num_rows, None)
    return entry.lengths, entry.longest


def _validated(offsets: torch.Tensor, name: str, num_rows, max_len) -> _HostCopy:
    # The checks depend only on the values (tracked by the tensor's version) and on these two
    # arguments: every attention layer of a model validates the same offsets once.
    entry = _host_copy(offsets)
    if (num_rows, max_len) in entry.validated:
        return entry
    host, lengths = entry.offsets, entry.lengths
    first = int(host[0])
    if first != 0:
        raise ValueError(f"{name} must start at 0, got {name}[0] = {first}")
    if lengths.numel() > 0 and bool((lengths < 0).any()):
        bad = int(torch.nonzero(lengths < 0)[0, 0])
        raise ValueError(
            f"{name} must be non-decreasing, got {name}[{bad}] = {int(host[bad])} > "
            f"{name}[{bad + 1}] = {int(host[bad + 1])}"
        )
    last = int(host[-1])
    if num_rows is not None and last != num_rows:
        raise ValueError(
            f"{name}[-1] must equal the number of rows ({num_rows}), got {name}[-1] = {last}"
        )
    if max_len is not None and entry.longest > max_len:
        bad = int(torch.argmax(lengths))
        raise ValueError(
            f"{name} has a sample of length {entry.longest} (sample {bad}), above the declared "
            f"max length {max_len}"
        )
    entry.validated.add((num_rows, max_len))
    return entry


def offsets_to_lengths(offsets: torch.Tensor) -> torch.Tensor:
    """Per-sample lengths ``offsets[1:] - offsets[:-1]`` (shape ``(B,)``, same dtype/device)."""
    _check_index_vector(offsets, "offsets")
    if offsets.numel() == 0:
        raise ValueError("offsets must have at least one entry (shape (B + 1,)), got none")
    return offsets[1:] - offsets[:-1]


def lengths_to_offsets(lengths: torch.Tensor, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Offsets ``[0, cumsum(lengths)...]`` of shape ``(B + 1,)`` from per-sample lengths.

    Args:
        lengths: 1-D int32/int64 tensor of non-negative lengths.
        dtype: dtype of the result (int32 or int64); defaults to ``lengths.dtype``.
    """
    _check_index_vector(lengths, "lengths")
    out_dtype = lengths.dtype if dtype is None else dtype
    if out_dtype not in _INDEX_DTYPES:
        raise TypeError(f"dtype must be torch.int32 or torch.int64, got {out_dtype}")
    if lengths.numel() > 0 and bool((lengths < 0).any()):
        raise ValueError("lengths must be non-negative")
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    offsets[1:] = torch.cumsum(lengths.to(torch.int64), dim=0)
    limit = torch.iinfo(out_dtype).max
    if lengths.numel() > 0 and int(offsets[-1]) > limit:
        raise ValueError(
            f"lengths sum to {int(offsets[-1])}, above the largest {out_dtype} offset ({limit}): "
            "pass dtype=torch.int64"
        )
    return offsets.to(out_dtype)
