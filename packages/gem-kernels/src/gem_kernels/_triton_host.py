"""Host-side helpers shared by the Triton wrappers (JFA, GDPA, BlockAttention).

The support check's common part, the compiled-or-interpreted decision, the offsets read-back and
the one packed host-to-device copy of the launch tables. Kernel code lives in ``_*_kernels.py``.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from gem_kernels.jagged import TensorMemo, host_lengths
from gem_kernels.triton_loader import interpret_requested, triton_importable

__all__ = [
    "FlashTileConfig",
    "HostLengths",
    "PlanCache",
    "TRITON_DTYPES",
    "copy_to_device",
    "dot_flags",
    "host_lengths",
    "host_lengths_of",
    "interpret_for",
    "padded_block",
    "tma_ready",
    "unit_stride",
    "unsupported_reason",
]

#: Input dtypes every Triton kernel takes.
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class FlashTileConfig:
    """Tiles and launch parameters of a forward / dK-dV / dQ kernel trio (tiles: powers of two
    >= 16), the fields JFA's and GDPA's configs share, in this order (positional arguments).

    A tile is one program's work (JFA) or one work item of a persistent program (GDPA). The
    defaults are the H200 tiles at D=128, bf16.
    """

    fwd_block_m: int = 128
    """Query rows per forward tile."""
    fwd_block_n: int = 128
    """Keys per inner iteration of the forward."""
    fwd_warps: int = 8
    """Warps per forward program."""
    fwd_stages: int = 3
    """Software-pipelining depth of the forward's key loop."""
    dkdv_block_n: int = 128
    """Keys per dK/dV tile."""
    dkdv_block_m: int = 64
    """Query rows per inner iteration of the dK/dV kernel."""
    dq_block_m: int = 128
    """Query rows per dQ tile."""
    dq_block_n: int = 64
    """Keys per inner iteration of the dQ kernel."""
    bwd_warps: int = 8
    """Warps per backward program."""
    bwd_stages: int = 3
    """Software-pipelining depth of the backward loops."""


class TunedConfig(NamedTuple):
    """An entry of a kernel's configuration table: a complete configuration and why it is the
    one for its (architecture, dtype, head_dim, shape class)."""

    config: Any
    reason: str


def unsupported_reason(
    q: torch.Tensor, max_head_dim: int | None, *kernel_reasons: str | None
) -> str | None:
    """Why a Triton kernel cannot run on ``q`` (T, H, D), or ``None`` when it can.

    Checks, in this order: dtype, head dim up to ``max_head_dim`` (``None``: no head
    dimension, any shape), the kernel's own
    ``kernel_reasons`` (the first that is not ``None`` wins), then the device (CUDA, or any device
    with ``TRITON_INTERPRET=1``) and whether triton imports.
    """
    if q.dtype not in TRITON_DTYPES:
        return f"dtype {q.dtype} is not supported by the Triton kernels (float16/bfloat16/float32)"
    if max_head_dim is not None and q.shape[2] > max_head_dim:
        return f"head_dim {q.shape[2]} is larger than {max_head_dim}"
    for reason in kernel_reasons:
        if reason is not None:
            return reason
    if q.device.type != "cuda" and not interpret_requested():
        return f"tensors on {q.device.type} need TRITON_INTERPRET=1 (Triton runs CUDA tensors)"
    if not triton_importable():
        return "triton is not importable"
    return None


def interpret_for(q: torch.Tensor) -> bool:
    """Whether this call runs under the Triton interpreter (``TRITON_INTERPRET`` set).

    Raises:
        ValueError: ``q`` is not on CUDA and the interpreter was not requested.
        RuntimeError: the interpreter was requested after ``triton.language`` had been imported
            without it (see :func:`_check_triton_library_interpreted`).
    """
    interpret = interpret_requested()
    if not interpret and q.device.type != "cuda":
        raise ValueError(
            f"the Triton path needs CUDA tensors, got {q.device} (set TRITON_INTERPRET=1 to run "
            "CPU tensors under the Triton interpreter)"
        )
    if interpret:
        _check_triton_library_interpreted()
    return interpret


@functools.cache  # a check that passed holds for the process: triton.language loads once
def _check_triton_library_interpreted() -> None:
    """Our attention kernels call Triton's own ``@triton.jit`` library (``tl.max``, ``tl.sum``),
    which Triton decorates once, when ``triton.language`` is first imported. Decorated for
    compilation (``torch._dynamo`` and FSDP2 import it), the interpreter cannot call it and
    fails deep inside a kernel; say what to do instead."""
    import triton.language as tl
    from triton.runtime.jit import JITFunction

    if isinstance(tl.max, JITFunction):
        raise RuntimeError(
            "the Triton interpreter needs TRITON_INTERPRET=1 set before triton is first "
            "imported: triton.language was already imported in compiled mode (torch._dynamo, "
            "FSDP2 and torch.compile import it), so its reductions cannot run interpreted; set "
            "TRITON_INTERPRET=1 in the process environment from the start"
        )


class HostLengths(NamedTuple):
    """Per-sample lengths as the host planning reads them (:func:`host_lengths_of`)."""

    values: torch.Tensor
    """CPU int64 copy (the tensor itself when it is one already)."""
    key: bytes
    """The values' bytes: the plan caches key on them, so equal lengths share a plan."""
    longest: int
    """The largest length, 0 without samples."""


_HOST_LENGTHS = TensorMemo()


def host_lengths_of(lengths: torch.Tensor) -> HostLengths:
    """:class:`HostLengths` of a lengths tensor, remembered per tensor and version: the
    forward, the backward and every layer of a model pass the same host lengths (those of
    their offsets), so the copy, the key bytes and the maximum are made once."""
    return _HOST_LENGTHS.get(lengths, _read_lengths)


def _read_lengths(lengths: torch.Tensor) -> HostLengths:
    values = lengths.detach().to("cpu", torch.int64)
    longest = int(values.max()) if values.numel() > 0 else 0
    return HostLengths(values, values.numpy().tobytes(), longest)


def copy_to_device(packed: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``packed`` (a host tensor) on ``device``; to CUDA through pinned memory, asynchronously."""
    if device.type == "cuda":
        # Pinned + non_blocking: the copy is queued behind running kernels, no host sync.
        return packed.pin_memory().to(device, non_blocking=True)
    return packed.to(device)


def unit_stride(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself when its last dimension is contiguous, else a contiguous copy."""
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()


@functools.lru_cache(maxsize=16)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_programs(device: torch.device, per_sm: int, interpret: bool) -> int:
    """Programs of a persistent launch: ``per_sm`` per SM of ``device``; 3 under the
    interpreter, so that the tests' persistent loops run several rounds."""
    if interpret:
        return 3
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _sm_count(index) * per_sm


def padded_block(size: int) -> int:
    """The power-of-two tile (at least 16) that covers ``size`` elements."""
    return max(16, 1 << (size - 1).bit_length())


def dot_flags(q: torch.Tensor, interpret: bool) -> dict[str, object]:
    """The kernels' ``DOT_PRECISION`` and ``UPCAST`` constexprs for ``q``'s dtype.

    float32 inputs take IEEE-exact dot products; bfloat16 operands are upcast to float32 under
    the interpreter (it multiplies bfloat16 operands wrongly, see ``_dot`` in the kernels).
    """
    return {
        "DOT_PRECISION": "ieee" if q.dtype == torch.float32 else "tf32",
        "UPCAST": interpret and q.dtype == torch.bfloat16,
    }


class PlanCache:
    """Host plans of recent calls, least recently used dropped first.

    Every attention layer of a model (and its backward) sees the same batch lengths, so only the
    first call per batch pays for building and uploading its tables.
    """

    def __init__(self, maxsize: int) -> None:
        self.maxsize = maxsize
        self._plans: OrderedDict[Hashable, object] = OrderedDict()

    def __len__(self) -> int:
        return len(self._plans)

    def clear(self) -> None:
        """Drop every stored plan."""
        self._plans.clear()

    def get(self, key: Hashable, build: Callable[[], object]):
        """The plan stored under ``key``, built with ``build()`` on a miss."""
        plan = self._plans.get(key)
        if plan is not None:
            self._plans.move_to_end(key)
            return plan
        plan = build()
        self._plans[key] = plan
        if len(self._plans) > self.maxsize:
            self._plans.popitem(last=False)
        return plan


def _tma_workspace(size: int, alignment: int, stream) -> torch.Tensor:
    """Global scratch for the TMA descriptors the kernels build on the device."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


@functools.lru_cache(maxsize=16)
def _has_tma(device_index: int) -> bool:
    """TMA (and the bulk reduces built on it) exist from Hopper (sm_90) on."""
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def tma_ready(*tensors: torch.Tensor, interpret: bool) -> bool:
    """Whether ``tensors`` can go through TMA descriptors (a Hopper or newer GPU, 16-byte
    aligned base and row strides); installs a Triton scratch allocator on CUDA when none is
    set."""
    if not interpret and not _has_tma(tensors[0].device.index or 0):
        return False
    for t in tensors:
        size = t.element_size()
        if t.data_ptr() % 16 or (t.stride(0) * size) % 16 or (t.stride(1) * size) % 16:
            return False
    if not interpret:
        triton, allocation = _triton_allocation()
        current = getattr(allocation, "_allocator", None)
        current = current.get() if hasattr(current, "get") else current
        if current is None or isinstance(current, allocation.NullAllocator):
            triton.set_allocator(_tma_workspace)
    return True


@functools.cache
def _triton_allocation() -> tuple[Any, Any]:
    """``triton`` and ``triton.runtime._allocation``, imported on first use (not at every
    call: an import statement costs about a microsecond even for a loaded module)."""
    import triton
    from triton.runtime import _allocation

    return triton, _allocation
