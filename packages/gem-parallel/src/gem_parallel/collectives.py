"""Autograd-aware all-gather and reduce-scatter along dim 0, working on NCCL and gloo.

``all_gather_dim0`` and ``reduce_scatter_dim0`` are each other's adjoint, so each one's backward
is the other. They are written as small ``autograd.Function`` s rather than taken from
``torch.distributed.nn.functional`` because the latter's all-gather backward emulates
reduce-scatter with an all-to-all on non-NCCL backends, and its behaviour has changed between
torch releases; these two behave the same from torch 2.11 on.

Gloo has no native reduce-scatter in some torch releases: when the native call reports that it
is unsupported, ``reduce_scatter_dim0`` falls back to ``all_reduce`` of the whole input followed
by taking this rank's slice (same result, ``group_size`` times the traffic; only used for CPU
tests).

Copy-engine (SM-free) collectives
---------------------------------
``copy_engine_all_gather`` and ``copy_engine_reduce_scatter`` move data with the GPU's copy
engines instead of SM kernels, so they do not take streaming multiprocessors from the GEMMs
they overlap with. They work on buffers in symmetric memory
(``torch.distributed._symmetric_memory``: every rank of the group maps every other rank's
buffer): after a barrier, each rank *pulls* the peers' chunks with ``cudaMemcpyAsync`` from the
peer's mapping (a device-to-device copy between GPUs runs on a copy engine), then a second
barrier tells the peers their source may be reused. The barriers are single-block kernels;
they are the only SM work of an in-place all-gather.

A local copy on one GPU is an SM kernel, so the fast path needs no local copy:

* in place: ``out`` comes from :func:`symmetric_empty` and ``inp`` is this rank's chunk of it
  (``out.chunk(group_size)[rank]``), as FSDP2 lays out its all-gather buffers; nothing is
  staged and the own chunk is already in place;
* ``inp`` alone in symmetric memory: the own chunk is copied locally (SM);
* neither: ``inp`` is first staged into a per-group symmetric workspace (SM copy).

The reduce-scatter pulls, from each peer, the peer's chunk for this rank into a local buffer
(copy engine) and sums with one elementwise kernel, instead of NCCL's reduction kernels that
hold SMs for the whole transfer.

Both run on the caller's current CUDA stream (put them on a side stream to overlap) and are
synchronous with respect to it. One group's calls must be issued on one stream at a time (the
staging workspace is shared). They need CUDA, an NCCL group whose ranks are all on one host and
a torch with symmetric memory; :func:`select_all_gather` / :func:`select_reduce_scatter` pick
them when that holds and fall back to plain NCCL, or to gloo on CPU, logging the choice on the
``gem_parallel`` logger.
"""

from __future__ import annotations

import logging
import os
import socket
import warnings
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = [
    "COLLECTIVE_CHOICES",
    "all_gather_dim0",
    "copy_engine_all_gather",
    "copy_engine_reduce_scatter",
    "copy_engine_status",
    "plain_all_gather",
    "plain_reduce_scatter",
    "reduce_scatter_dim0",
    "select_all_gather",
    "select_reduce_scatter",
    "symmetric_empty",
]

_log = logging.getLogger("gem_parallel")

# torch 2.14 deprecates *_tensor in favour of *_single; 2.11 only has *_tensor.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# Set once a backend reported that it cannot reduce-scatter; then all_reduce + slice is used.
_NATIVE_REDUCE_SCATTER_UNSUPPORTED: set[str] = set()


def _group_size(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group)


def _all_gather(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    tensor = tensor.contiguous()
    size = _group_size(group)
    if size == 1:
        return tensor.clone()
    out = tensor.new_empty((size * tensor.shape[0], *tensor.shape[1:]))
    _all_gather_single(out, tensor, group=group)
    return out


def _reduce_scatter(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    tensor = tensor.contiguous()
    size = _group_size(group)
    if size == 1:
        return tensor.clone()
    rows = tensor.shape[0] // size
    backend = str(dist.get_backend(group))
    if backend not in _NATIVE_REDUCE_SCATTER_UNSUPPORTED:
        out = tensor.new_empty((rows, *tensor.shape[1:]))
        try:
            _reduce_scatter_single(out, tensor, group=group)
            return out
        except RuntimeError as err:
            # Raised locally before any communication, so every rank takes the same branch.
            if "support" not in str(err).lower():
                raise
            _NATIVE_REDUCE_SCATTER_UNSUPPORTED.add(backend)
    total = tensor.clone()
    dist.all_reduce(total, group=group)
    rank = dist.get_rank(group)
    return total[rank * rows : (rank + 1) * rows].clone()


class _AllGatherDim0(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return _all_gather(tensor, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _reduce_scatter(grad, ctx.group), None


class _ReduceScatterDim0(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return _reduce_scatter(tensor, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_gather(grad, ctx.group), None


def all_gather_dim0(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along dim 0, in group-rank order (differentiable).

    Every rank must pass the same shape. Backward reduce-scatters (sums) the gradient, so each
    rank receives the sum over ranks of the gradient of its own rows.
    """
    if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0:
        raise ValueError("tensor must be a torch.Tensor with at least one dimension")
    return _AllGatherDim0.apply(tensor, group)


def reduce_scatter_dim0(
    tensor: torch.Tensor, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Sum ``tensor`` over ranks and return this rank's slice of dim 0 (differentiable).

    ``tensor.shape[0]`` must be a multiple of the group size; rank ``r`` of the group gets rows
    ``[r * n, (r + 1) * n)`` of the sum with ``n = tensor.shape[0] // group_size``. Backward
    all-gathers the gradient.
    """
    if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0:
        raise ValueError("tensor must be a torch.Tensor with at least one dimension")
    size = _group_size(group)
    if tensor.shape[0] % size != 0:
        raise ValueError(
            f"tensor.shape[0] ({tensor.shape[0]}) must be a multiple of the group size ({size})"
        )
    return _ReduceScatterDim0.apply(tensor, group)


# --------------------------------------------------------------------------------------------
# Copy-engine (SM-free) collectives over symmetric memory, and the choice among providers.
# --------------------------------------------------------------------------------------------

COLLECTIVE_CHOICES = ("auto", "copy_engine", "nccl")
"""Values of ``prefer`` in :func:`select_all_gather` / :func:`select_reduce_scatter`: ``auto``
takes the copy engine where it works, ``copy_engine`` asks for it (falling back with a
warning), ``nccl`` the group's own backend (gloo on CPU)."""

CollectiveFn = Callable[[torch.Tensor, torch.Tensor, "dist.ProcessGroup | None"], torch.Tensor]

_WORKSPACE_MIN_BYTES = 1 << 20


def _symm_mem_module():
    """``torch.distributed._symmetric_memory`` if this torch has the parts used here."""
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError:
        return None
    if not all(hasattr(symm_mem, name) for name in ("empty", "rendezvous")):
        return None
    return symm_mem


def _group_name(group: dist.ProcessGroup | None) -> str:
    return (dist.group.WORLD if group is None else group).group_name


@dataclass
class _SymmetricBuffer:
    """One symmetric allocation: the local tensor and its rendezvous handle."""

    base: torch.Tensor
    handle: object
    group_name: str

    @property
    def ptr(self) -> int:
        return self.base.data_ptr()

    @property
    def nbytes(self) -> int:
        return self.base.numel() * self.base.element_size()

    def peer_view(
        self, peer: int, byte_offset: int, shape: torch.Size, dtype: torch.dtype
    ) -> torch.Tensor:
        """``peer``'s buffer at ``byte_offset`` as a tensor mapped into this process."""
        itemsize = dtype.itemsize
        return self.handle.get_buffer(peer, list(shape), dtype, byte_offset // itemsize)


# Allocations from symmetric_empty (kept alive: peers hold mappings of them) and the per-group
# staging workspaces.
_BUFFERS: list[_SymmetricBuffer] = []
_WORKSPACES: dict[tuple[str, str], _SymmetricBuffer] = {}
_STATUS: dict[str, tuple[bool, str]] = {}


def _enable_symm_mem(symm_mem, group_name: str) -> None:
    # Needed before rendezvous up to torch ~2.9; deprecated (a no-op with a warning) later.
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    is_enabled = getattr(symm_mem, "is_symm_mem_enabled_for_group", None)
    if enable is None or (is_enabled is not None and is_enabled(group_name)):
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        enable(group_name)


def _allocate_symmetric(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, group_name: str
) -> _SymmetricBuffer:
    symm_mem = _symm_mem_module()
    if symm_mem is None:
        raise RuntimeError(
            f"torch {torch.__version__} has no usable torch.distributed._symmetric_memory"
        )
    _enable_symm_mem(symm_mem, group_name)
    base = symm_mem.empty(shape, dtype=dtype, device=device)
    handle = symm_mem.rendezvous(base, group_name)
    return _SymmetricBuffer(base, handle, group_name)


def symmetric_empty(
    shape: tuple[int, ...] | list[int] | torch.Size,
    dtype: torch.dtype,
    group: dist.ProcessGroup | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """An uninitialised CUDA tensor in symmetric memory, mapped by every rank of ``group``.

    Collective: every rank of ``group`` must call it with the same shape and dtype, in the same
    order. The buffer stays allocated for the rest of the process (peers map it). An all-gather
    whose ``out`` comes from here and whose ``inp`` is this rank's chunk of ``out`` runs without
    any SM copy (module doc).
    """
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
    shape = tuple(int(s) for s in shape)
    if any(s < 0 for s in shape):
        raise ValueError(f"shape must have non-negative sizes, got {shape}")
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else device
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"device must be a CUDA device, got {device}")
    buffer = _allocate_symmetric(shape, dtype, device, _group_name(group))
    _BUFFERS.append(buffer)
    return buffer.base


def _find_symmetric(tensor: torch.Tensor, group_name: str) -> tuple[_SymmetricBuffer, int] | None:
    """The symmetric allocation holding all of ``tensor``'s bytes, and its byte offset in it."""
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    for buffer in _BUFFERS:
        if (
            buffer.group_name == group_name
            and buffer.base.device == tensor.device
            and buffer.ptr <= start
            and end <= buffer.ptr + buffer.nbytes
        ):
            return buffer, start - buffer.ptr
    return None


def _workspace(group_name: str, device: torch.device, nbytes: int) -> _SymmetricBuffer:
    """The group's staging buffer, grown (collectively, on every rank alike) to ``nbytes``."""
    key = (group_name, str(device))
    current = _WORKSPACES.get(key)
    if current is None or current.nbytes < nbytes:
        size = max(_WORKSPACE_MIN_BYTES, 1 << max(0, nbytes - 1).bit_length())
        _WORKSPACES[key] = _allocate_symmetric((size,), torch.uint8, device, group_name)
    return _WORKSPACES[key]


def _check_cuda(tensor: object, name: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cuda":
        raise ValueError(
            f"{name} must be a CUDA tensor (copy-engine collectives need GPUs), got "
            f"{tensor.device}; select_all_gather / select_reduce_scatter fall back on CPU"
        )


def _check_gather_shapes(out: torch.Tensor, inp: torch.Tensor, size: int, what: str) -> None:
    """``out`` (the larger one) = ``size`` chunks of ``inp``'s shape along dim 0."""
    for tensor, name in ((out, "out"), (inp, "inp")):
        if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0:
            raise ValueError(f"{name} must be a torch.Tensor with at least one dimension")
    big, small = ("out", "inp") if what == "all_gather" else ("inp", "out")
    big_t, small_t = (out, inp) if what == "all_gather" else (inp, out)
    if big_t.shape[0] != size * small_t.shape[0] or big_t.shape[1:] != small_t.shape[1:]:
        raise ValueError(
            f"{big}.shape must be (group size {size} * {small}.shape[0], *{small}.shape[1:]) = "
            f"{(size * small_t.shape[0], *small_t.shape[1:])}, got {tuple(big_t.shape)} for "
            f"{small}.shape {tuple(small_t.shape)}"
        )
    if out.dtype != inp.dtype or out.device != inp.device:
        raise ValueError(
            f"out and inp must share dtype and device, got {out.dtype}/{out.device} and "
            f"{inp.dtype}/{inp.device}"
        )
    if not out.is_contiguous():
        raise ValueError("out must be contiguous")


def copy_engine_all_gather(
    out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """All-gather ``inp`` of every rank into ``out`` (rank order along dim 0) by copy engine.

    ``out.shape == (group_size * inp.shape[0], *inp.shape[1:])``, same dtype, CUDA, an NCCL
    group on one host. Collective over ``group``; runs on the current stream and returns
    ``out``. With ``out`` from :func:`symmetric_empty` and ``inp`` its own chunk (in place) no SM
    copy runs; otherwise ``inp`` is staged into symmetric memory first (module doc).
    """
    _check_cuda(out, "out")
    _check_cuda(inp, "inp")
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    _check_gather_shapes(out, inp, size, "all_gather")
    chunk_shape = inp.shape
    chunk_bytes = inp.numel() * inp.element_size()
    chunks = out.view(size, *chunk_shape)
    if size == 1 or chunk_bytes == 0:
        if inp.data_ptr() != out.data_ptr():
            chunks[0].copy_(inp)
        return out
    name = _group_name(group)
    found_out = _find_symmetric(out, name)
    in_place = (
        found_out is not None
        and inp.is_contiguous()
        and inp.data_ptr() == out.data_ptr() + rank * chunk_bytes
    )
    if in_place:
        source, out_offset = found_out

        def offset_of(peer: int) -> int:
            return out_offset + peer * chunk_bytes
    else:
        found_in = _find_symmetric(inp, name) if inp.is_contiguous() else None
        if found_in is not None:
            source, in_offset = found_in
        else:  # stage (an SM copy) into the workspace
            source, in_offset = _workspace(name, out.device, chunk_bytes), 0
            source.peer_view(rank, 0, chunk_shape, inp.dtype).copy_(inp)

        def offset_of(peer: int) -> int:
            return in_offset

        chunks[rank].copy_(inp)
    source.handle.barrier()  # every rank's source is ready
    for step in range(1, size):
        peer = (rank + step) % size  # staggered so that ranks do not all read one peer at once
        chunks[peer].copy_(source.peer_view(peer, offset_of(peer), chunk_shape, inp.dtype))
    source.handle.barrier()  # every rank is done reading: sources may be overwritten
    return out


def copy_engine_reduce_scatter(
    out: torch.Tensor,
    inp: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    op: str = "sum",
) -> torch.Tensor:
    """Reduce-scatter: ``out`` = sum (``op="avg"``: mean) over ranks of chunk ``rank`` of ``inp``.

    ``inp.shape == (group_size * out.shape[0], *out.shape[1:])``. The peers' chunks are pulled
    by copy engine into a local buffer, then summed with one elementwise kernel. If ``inp`` is
    not in symmetric memory (:func:`symmetric_empty`) it is staged there first (an SM copy).
    Collective; runs on the current stream and returns ``out``.
    """
    _check_cuda(out, "out")
    _check_cuda(inp, "inp")
    if op not in ("sum", "avg"):
        raise ValueError(f"op must be 'sum' or 'avg', got {op!r}")
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    _check_gather_shapes(out, inp, size, "reduce_scatter")
    inp = inp.contiguous()
    own = inp.view(size, *out.shape)[rank]
    chunk_bytes = own.numel() * own.element_size()
    if size == 1 or chunk_bytes == 0:
        out.copy_(own)
        return out
    name = _group_name(group)
    found = _find_symmetric(inp, name)
    if found is not None:
        source, offset = found
    else:
        source, offset = _workspace(name, out.device, size * chunk_bytes), 0
        source.peer_view(rank, 0, inp.shape, inp.dtype).copy_(inp)
    received = torch.empty((size - 1, *out.shape), dtype=out.dtype, device=out.device)
    source.handle.barrier()
    for step in range(1, size):
        peer = (rank + step) % size
        view = source.peer_view(peer, offset + rank * chunk_bytes, out.shape, out.dtype)
        received[step - 1].copy_(view)
    source.handle.barrier()
    if size == 2:
        torch.add(own, received[0], out=out)
    else:
        torch.sum(received, dim=0, out=out)
        out.add_(own)
    if op == "avg":
        out.div_(size)
    return out


def plain_all_gather(
    out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """All-gather ``inp`` into ``out`` with the group's own backend (NCCL, gloo); returns ``out``."""
    size = dist.get_world_size(group)
    _check_gather_shapes(out, inp, size, "all_gather")
    _all_gather_single(out, inp.contiguous(), group=group)
    return out


def plain_reduce_scatter(
    out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Sum-reduce-scatter ``inp`` into ``out`` with the group's own backend; returns ``out``.

    On a gloo without native reduce-scatter: all-reduce plus a slice (module doc).
    """
    size = dist.get_world_size(group)
    _check_gather_shapes(out, inp, size, "reduce_scatter")
    out.copy_(_reduce_scatter(inp, group))
    return out


def copy_engine_status(group: dist.ProcessGroup | None = None) -> tuple[bool, str]:
    """Whether the copy-engine collectives work on ``group``, and why (not).

    Collective on an NCCL group (ranks agree through an all-reduce, then allocate a small
    symmetric workspace as a probe); cached per group. ``GEM_DISABLE_COPY_ENGINE=1`` turns the
    copy engine off.
    """
    name = _group_name(group)
    if name in _STATUS:
        return _STATUS[name]
    backend = str(dist.get_backend(group))
    if "nccl" not in backend:
        status = (False, f"the group's backend is {backend}, not NCCL")
    elif os.environ.get("GEM_DISABLE_COPY_ENGINE", "0") not in ("", "0"):
        status = (False, "disabled by GEM_DISABLE_COPY_ENGINE")
    else:
        status = _probe_copy_engine(group, name)
    _STATUS[name] = status
    return status


def _probe_copy_engine(group: dist.ProcessGroup | None, name: str) -> tuple[bool, str]:
    device = torch.device("cuda", torch.cuda.current_device())
    local_reason = ""
    if _symm_mem_module() is None:
        local_reason = f"torch {torch.__version__} lacks torch.distributed._symmetric_memory"
    host = zlib.crc32(socket.gethostname().encode())
    flags = torch.tensor([0 if local_reason else 1, host, -host], device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=group)
    if flags[0].item() == 0:
        return False, local_reason or "a peer lacks torch.distributed._symmetric_memory"
    if flags[1].item() != host or -flags[2].item() != host:
        return False, "the group spans more than one host (symmetric memory needs one host)"
    try:
        _workspace(name, device, _WORKSPACE_MIN_BYTES)
        ok, reason = 1, "symmetric memory rendezvous succeeded on every rank"
    except RuntimeError as err:
        ok, reason = 0, f"symmetric memory rendezvous failed: {err}"
    agreed = torch.tensor([ok], device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
    if agreed.item() == 0 and ok:
        reason = "symmetric memory rendezvous failed on a peer"
    return bool(agreed.item()), reason


def _select(
    kind: str,
    group: dist.ProcessGroup | None,
    prefer: str,
    copy_engine_fn: CollectiveFn,
    plain_fn: CollectiveFn,
) -> tuple[CollectiveFn, str]:
    if prefer not in COLLECTIVE_CHOICES:
        raise ValueError(f"prefer must be one of {COLLECTIVE_CHOICES}, got {prefer!r}")
    backend = str(dist.get_backend(group))
    plain_name = "nccl" if "nccl" in backend else backend
    level = logging.INFO
    if prefer == "nccl":
        fn, reason = plain_fn, f"{plain_name}: requested the group's own backend"
    else:
        ok, why = copy_engine_status(group)
        if ok:
            fn, reason = copy_engine_fn, f"copy_engine: {why}"
        else:
            fn, reason = plain_fn, f"{plain_name}: copy engine unavailable ({why})"
            if prefer == "copy_engine":
                level = logging.WARNING
    _log.log(
        level,
        "%s over group %s (size %d, backend %s) uses %s",
        kind,
        _group_name(group),
        dist.get_world_size(group),
        backend,
        reason,
    )
    return fn, reason


def select_all_gather(
    group: dist.ProcessGroup | None = None, prefer: str = "auto"
) -> tuple[CollectiveFn, str]:
    """Choose an all-gather ``fn(out, inp, group) -> out`` for ``group`` and say why.

    Order: :func:`copy_engine_all_gather` (``prefer`` ``"auto"`` / ``"copy_engine"`` and
    :func:`copy_engine_status` true), else :func:`plain_all_gather` on the group's backend
    (NCCL, or gloo on CPU). The reason starts with the choice (``"copy_engine"``, ``"nccl"``,
    ``"gloo"``) and is logged on the ``gem_parallel`` logger (a warning when ``"copy_engine"``
    was asked for and is unavailable). Collective (the status probe) on first use per group.
    """
    return _select("all-gather", group, prefer, copy_engine_all_gather, plain_all_gather)


def select_reduce_scatter(
    group: dist.ProcessGroup | None = None, prefer: str = "auto"
) -> tuple[CollectiveFn, str]:
    """Choose a sum reduce-scatter ``fn(out, inp, group) -> out``, like :func:`select_all_gather`."""
    return _select(
        "reduce-scatter", group, prefer, copy_engine_reduce_scatter, plain_reduce_scatter
    )
