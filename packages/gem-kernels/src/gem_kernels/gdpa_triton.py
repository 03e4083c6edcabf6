"""Triton implementation of GDPA (``act(scale * Q K^T) V``): work lists, schedules, autograd.

The kernels live in ``_gdpa_kernels.py``. :func:`gdpa_triton` runs them on validated input (the
public, validating entry point is :func:`gem_kernels.gdpa`, which dispatches here).

Jagged scheduling. The host builds one work list per kernel from the sample lengths: one item
per ``(tile, head)`` of every sample that has rows (no item exists for padding) with its
amount of work (key or query tiles it will visit). The kernels are persistent: program ``p`` of
``P`` runs items ``p, p + P, ...``. ``GdpaTritonConfig.schedule`` decides the order:

* ``"zigzag"`` (default): the list is sorted longest-first and dealt in zigzag (round 0 to
  programs ``0..P-1``, round 1 to ``P-1..0``, ...), ``P`` = SMs x ``programs_per_sm``;
* ``"sorted"``: longest-first, one program per item (the hardware hands items to free SMs);
* ``"unsorted"``: sample order, dealt round-robin over ``P`` programs (the baseline).

:func:`schedule_loads` gives the per-program work of a schedule (the benchmark reports its
max/mean). Shapes: self (queries and keys share lengths), cross (own key lengths) and PMA
(``Nq`` shared queries over every sample's keys). Cross/PMA calls whose samples all have at
most ``short_kv_max`` keys use a short-KV forward that loads a sample's whole K and V once and
streams a run of query tiles past them. Backward, without atomics: dK/dV per key tile (loop
over the query tiles that see it), dQ per query tile (loop over key tiles); for PMA each
sample's dQ is written to its own rows and the samples are summed on the host.

CPU tensors run under the Triton interpreter when ``TRITON_INTERPRET=1`` is set at call time.
"""

from __future__ import annotations

import heapq
import importlib.util
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import numpy as np
import torch

__all__ = [
    "GDPA_SCHEDULES",
    "GdpaFunction",
    "GdpaTritonConfig",
    "MAX_TRITON_HEAD_DIM",
    "default_config",
    "gdpa_from_lengths",
    "gdpa_triton",
    "schedule_loads",
    "triton_unsupported_reason",
]

#: Largest head dimension the Triton kernels take (bigger ones go to the reference).
MAX_TRITON_HEAD_DIM = 256
#: Accepted values of ``GdpaTritonConfig.schedule``.
GDPA_SCHEDULES = ("zigzag", "sorted", "unsorted")

_ACTIVATION_CODES = {
    "silu": 0,
    "gelu": 1,
    "gelu_tanh": 2,
    "gelu_fast": 3,
    "relu2": 4,
    "identity": 5,
}
_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_TABLE_WIDTH = 8  # [q_start, q_len, k_start, k_len, tile_start, out_start, head, tile_end]


@dataclass(frozen=True)
class GdpaTritonConfig:
    """Tile sizes, launch parameters and schedule of the kernels (tiles: powers of two >= 16).

    The defaults are those of the H200 run in ``benchmarks/results/h200/gdpa.json`` (D=128,
    bf16): the forward tiles won a short sweep at B128xL4096/B512xL1024, the short-KV and PMA
    fields a sweep of the cross/PMA forward at L4096; the backward tiles were not swept.
    """

    fwd_block_m: int = 128
    """Query rows per forward item."""
    fwd_block_n: int = 128
    """Keys per inner iteration of the forward."""
    fwd_warps: int = 8
    """Warps per forward program."""
    fwd_stages: int = 3
    """Software-pipelining depth of the forward's key loop."""
    dkdv_block_n: int = 128
    """Keys per dK/dV item."""
    dkdv_block_m: int = 64
    """Query rows per inner iteration of the dK/dV kernel."""
    dq_block_m: int = 128
    """Query rows per dQ item."""
    dq_block_n: int = 64
    """Keys per inner iteration of the dQ kernel."""
    bwd_warps: int = 8
    """Warps per backward program."""
    bwd_stages: int = 3
    """Software-pipelining depth of the backward loops."""
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
    pma_programs_per_sm: int = 1
    """PMA: persistent programs per SM of the forward / dQ (memory-bound: several programs
    per SM hide each other's pipeline fill)."""
    short_stages: int = 2
    """Software-pipelining depth of the short-KV forward's query loop."""
    schedule: str = "zigzag"
    """Work order: ``"zigzag"``, ``"sorted"`` or ``"unsorted"`` (see the module docstring)."""
    programs_per_sm: int = 1
    """Persistent programs per SM (``"zigzag"`` and ``"unsorted"``)."""


def default_config(
    head_dim: int, *, interpret: bool = False, dtype: torch.dtype = torch.bfloat16
) -> GdpaTritonConfig:
    """Tile configuration for a head dimension and input dtype (16-row tiles under the
    interpreter). float32 tiles take twice the shared memory, so they are halved."""
    if interpret:
        return GdpaTritonConfig(16, 16, 1, 1, 16, 16, 16, 16, 1, 1, 256, 16, 32, 1, 16, 1, 1)
    if head_dim <= 64:
        return GdpaTritonConfig(128, 64, 4, 3, 128, 64, 128, 64, 8, 2)
    if head_dim <= 128 and dtype != torch.float32:
        return GdpaTritonConfig()
    if head_dim <= 128:
        return GdpaTritonConfig(64, 64, 4, 2, 64, 32, 64, 32, 4, 2, 128, 32, 256, 4, 32, 4, 2)
    return GdpaTritonConfig(64, 32, 4, 2, 64, 32, 64, 32, 4, 2, 128, 16, 256, 4, 32, 4, 2)


# ---------------------------------------------------------------------------------------------
# Kernel module loading (compiled or interpreted).

_KERNEL_MODULES: dict[bool, ModuleType] = {}


def _interpret_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:  # pragma: no cover - depends on the environment
        return False
    return True


def _kernels(interpret: bool) -> ModuleType:
    """The kernel module decorated for this mode (``triton.jit`` reads the mode at decoration)."""
    module = _KERNEL_MODULES.get(interpret)
    if module is not None:
        return module
    name = f"gem_kernels._gdpa_kernels_{'interpreted' if interpret else 'compiled'}"
    path = Path(__file__).with_name("_gdpa_kernels.py")
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    try:
        sys.modules[name] = module
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    finally:
        if previous is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = previous
    _KERNEL_MODULES[interpret] = module
    return module


def triton_unsupported_reason(q: torch.Tensor) -> str | None:
    """Why the Triton path cannot run this call, or ``None`` when it can.

    The Triton path takes float16/bfloat16/float32 on CUDA (float32 with IEEE-exact dot
    products), or CPU tensors when ``TRITON_INTERPRET=1`` is set; head_dim up to
    ``MAX_TRITON_HEAD_DIM`` (128 for float32).
    """
    if q.dtype not in _TRITON_DTYPES:
        return f"dtype {q.dtype} is not supported by the Triton kernels (float16/bfloat16/float32)"
    if q.shape[2] > MAX_TRITON_HEAD_DIM:
        return f"head_dim {q.shape[2]} is larger than {MAX_TRITON_HEAD_DIM}"
    if q.dtype == torch.float32 and q.shape[2] > 128:
        return f"float32 with head_dim {q.shape[2]} > 128 needs more shared memory than a GPU has"
    if q.device.type != "cuda" and not _interpret_requested():
        return f"tensors on {q.device.type} need TRITON_INTERPRET=1 (Triton runs CUDA tensors)"
    if not _triton_importable():
        return "triton is not importable"
    return None


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
    return _Samples(q_len, k_len, q_start, k_start, out_start)


def _tiles_of(lengths: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """(sample index, first row within the sample) of every block-sized tile of every sample."""
    per_sample = (lengths + block - 1) // block
    sample = np.repeat(np.arange(lengths.size, dtype=np.int64), per_sample)
    first = np.cumsum(per_sample) - per_sample
    start = (np.arange(sample.size, dtype=np.int64) - first[sample]) * block
    return sample, start


def _ceil_div(a: np.ndarray, b: int) -> np.ndarray:
    return (a + b - 1) // b


def _query_tile_items(s: _Samples, block_m: int, block_n: int, left, right):
    """Query tiles: table columns and work (key tiles visited, + 1 for the tile itself)."""
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
    work = _ceil_div(key_hi, block_n) - key_lo // block_n + 1
    columns = [s.q_start[sample], lq, s.k_start[sample], lk, start, s.out_start[sample]]
    return columns, work


def _key_tile_items(s: _Samples, block_n: int, block_m: int, left, right):
    """Key tiles: table columns and work (query tiles visited, + 1)."""
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
    work = _ceil_div(row_hi, block_m) - row_lo // block_m + 1
    columns = [s.q_start[sample], lq, s.k_start[sample], lk, start, s.out_start[sample]]
    return columns, work


def _short_kv_items(s: _Samples, rows_per_item: int, block_m: int):
    """Runs of query rows of one sample for the short-KV forward; work = query tiles + 1."""
    sample, start = _tiles_of(s.q_len, rows_per_item)
    lq = s.q_len[sample]
    end = np.minimum(start + rows_per_item, lq)
    work = _ceil_div(end - start, block_m) + 1
    columns = [s.q_start[sample], lq, s.k_start[sample], s.k_len[sample], start]
    columns += [s.out_start[sample], end]
    return columns, work


def schedule_loads(work, num_programs: int, schedule: str) -> torch.Tensor:
    """Total work of each of ``num_programs`` programs under a schedule (float64 CPU tensor).

    ``work`` (tensor or array) is in list order (sample order). ``"zigzag"`` / ``"unsorted"``
    are the static dealings the kernels use; ``"sorted"`` models the hardware handing
    longest-first items to whichever of ``num_programs`` slots frees up first (greedy list
    scheduling).
    """
    work = np.asarray(work, dtype=np.float64)
    if schedule == "sorted":
        loads = [0.0] * num_programs
        heap = [(0.0, p) for p in range(num_programs)]
        for value in np.sort(work, kind="stable")[::-1].tolist():
            load, p = heapq.heappop(heap)
            loads[p] = load + value
            heapq.heappush(heap, (loads[p], p))
        return torch.tensor(loads, dtype=torch.float64)
    order = _schedule_order(work, num_programs, schedule)
    padded = np.zeros(order.size, dtype=np.float64)
    valid = order >= 0
    padded[valid] = work[order[valid]]
    return torch.from_numpy(padded.reshape(-1, num_programs).sum(0))


def _longest_first(work: np.ndarray) -> np.ndarray:
    return np.argsort(-work, kind="stable")


def _schedule_order(work: np.ndarray, num_programs: int, schedule: str) -> np.ndarray:
    """Item index at each table position (``-1`` = empty padding) for a persistent dealing."""
    count = work.size
    order = np.arange(count) if schedule == "unsorted" else _longest_first(work)
    rounds = -(-count // num_programs)
    padded = np.full(rounds * num_programs, -1, dtype=np.int64)
    padded[:count] = order
    if schedule == "zigzag":
        grid = padded.reshape(rounds, num_programs)
        grid[1::2] = grid[1::2, ::-1].copy()  # odd rounds run from the last program to the first
    return padded


def _item_table(columns, work, heads: int, num_programs: int, schedule: str):
    """Expand tiles to (tile, head) items, order them, return (table, grid size).

    The heads of a tile have the same work, so tiles are ordered first (a sort of #tiles, not
    #items) and expanded to their heads afterwards, head fastest.
    """
    zeros = np.zeros_like(work)
    tile_end = columns[6] if len(columns) > 6 else zeros
    base = np.stack([*columns[:6], zeros, tile_end], axis=1)
    if schedule != "unsorted":
        base = base[_longest_first(work)]
    table = np.repeat(base, heads, axis=0)
    table[:, 6] = np.tile(np.arange(heads, dtype=np.int64), base.shape[0])
    count = table.shape[0]
    if count == 0 or schedule == "sorted":
        return table, count
    rounds = -(-count // num_programs)
    # Empty slots (all zeros: q_len = k_len = 0) have nothing to do.
    out = np.zeros((rounds * num_programs, _TABLE_WIDTH), dtype=np.int64)
    out[:count] = table
    if schedule == "zigzag":
        grid = out.reshape(rounds, num_programs, _TABLE_WIDTH)
        grid[1::2] = grid[1::2, ::-1].copy()  # odd rounds run from the last program to the first
    return out, min(num_programs, out.shape[0])


@dataclass(frozen=True)
class _Plan:
    """Item tables (device int64) and grid sizes of each kernel."""

    fwd: torch.Tensor
    fwd_grid: int
    short_kv_block: int  # 0: generic forward; else BLOCK_KV of the short-KV forward
    dkdv: torch.Tensor | None
    dkdv_grid: int
    dq: torch.Tensor | None
    dq_grid: int


_SM_COUNTS: dict[int, int] = {}


def _num_programs(device: torch.device, per_sm: int, interpret: bool) -> int:
    if interpret:
        return 3  # small, so that the persistent loops run several rounds in the tests
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index] * per_sm


def _pma_block_m(num_queries: int, config: GdpaTritonConfig) -> int:
    return min(config.fwd_block_m, max(16, 1 << max(0, num_queries - 1).bit_length()))


def _plan(s: _Samples, heads, left, right, config, device, with_backward, interpret, pma_m=0):
    """Work lists of every kernel; ``pma_m`` > 0: PMA query tile (rows) of the forward/dQ."""
    programs = _num_programs(device, config.programs_per_sm, interpret)
    pma_programs = _num_programs(device, config.pma_programs_per_sm, interpret)
    fwd_m, fwd_n = (
        (pma_m, config.pma_block_n) if pma_m else (config.fwd_block_m, config.fwd_block_n)
    )
    dq_m, dq_n = (pma_m, config.pma_block_n) if pma_m else (config.dq_block_m, config.dq_block_n)
    dkdv_m = pma_m or config.dkdv_block_m
    q_programs = pma_programs if pma_m else programs
    max_k = int(s.k_len.max()) if s.k_len.size else 0
    short = 0
    tables = []
    if config.short_kv_max > 0 and max_k <= config.short_kv_max:
        short = max(16, 1 << max(0, max_k - 1).bit_length())
        columns, work = _short_kv_items(s, config.short_rows_per_item, config.short_block_m)
        tables.append(_item_table(columns, work, heads, programs, config.schedule))
    else:
        columns, work = _query_tile_items(s, fwd_m, fwd_n, left, right)
        tables.append(_item_table(columns, work, heads, q_programs, config.schedule))
    if with_backward:
        columns, work = _key_tile_items(s, config.dkdv_block_n, dkdv_m, left, right)
        tables.append(_item_table(columns, work, heads, programs, config.schedule))
        columns, work = _query_tile_items(s, dq_m, dq_n, left, right)
        tables.append(_item_table(columns, work, heads, q_programs, config.schedule))
    grids = [grid for _, grid in tables]
    sizes = [table.shape[0] for table, _ in tables]
    packed = torch.from_numpy(np.concatenate([table for table, _ in tables]))
    if device.type == "cuda":
        # Pinned + non_blocking: the copy is queued behind running kernels, no host sync.
        packed = packed.pin_memory().to(device, non_blocking=True)
    else:
        packed = packed.to(device)
    parts = list(torch.split(packed, sizes))
    if with_backward:
        return _Plan(parts[0], grids[0], short, parts[1], grids[1], parts[2], grids[2])
    return _Plan(parts[0], grids[0], short, None, 0, None, 0)


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


def _unit_stride(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()


def _flags(q: torch.Tensor, launch: _Launch) -> dict:
    head_dim = q.shape[2]
    return {
        "HEAD_DIM": head_dim,
        "BLOCK_D": max(16, 1 << (head_dim - 1).bit_length()),
        "ACT": launch.activation,
        "HAS_LEFT": launch.left is not None,
        "HAS_RIGHT": launch.right is not None,
        "NORMALIZE": launch.normalize,
        "DOT_PRECISION": "ieee" if q.dtype == torch.float32 else "tf32",
        "UPCAST": launch.interpret and q.dtype == torch.bfloat16,
    }


def _forward(q, k, v, plan: _Plan, launch: _Launch, out_rows: int) -> torch.Tensor:
    heads = q.shape[1]
    out = torch.empty((out_rows, heads, q.shape[2]), dtype=q.dtype, device=q.device)
    if plan.fwd_grid == 0:
        return out
    cfg = launch.config
    kernels = _kernels(launch.interpret)
    common = (
        q, k, v, out, plan.fwd, plan.fwd.shape[0],
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), launch.left or 0, launch.right or 0, launch.scale,
    )  # fmt: skip
    if plan.short_kv_block:
        kernels.gdpa_fwd_short_kv_kernel[(plan.fwd_grid,)](
            *common, BLOCK_M=cfg.short_block_m, BLOCK_KV=plan.short_kv_block,
            num_warps=cfg.short_warps, num_stages=cfg.short_stages, **_flags(q, launch),
        )  # fmt: skip
    elif launch.num_queries is not None:
        kernels.gdpa_fwd_kernel[(plan.fwd_grid,)](
            *common, BLOCK_M=_pma_block_m(launch.num_queries, cfg), BLOCK_N=cfg.pma_block_n,
            num_warps=cfg.pma_warps, num_stages=cfg.pma_stages, **_flags(q, launch),
        )  # fmt: skip
    else:
        kernels.gdpa_fwd_kernel[(plan.fwd_grid,)](
            *common, BLOCK_M=cfg.fwd_block_m, BLOCK_N=cfg.fwd_block_n,
            num_warps=cfg.fwd_warps, num_stages=cfg.fwd_stages, **_flags(q, launch),
        )  # fmt: skip
    return out


def _backward(grad_out, q, k, v, plan: _Plan, launch: _Launch):
    cfg = launch.config
    kernels = _kernels(launch.interpret)
    grad_out = _unit_stride(grad_out)
    flags = _flags(q, launch)
    pma_m = 0 if launch.num_queries is None else _pma_block_m(launch.num_queries, cfg)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if launch.num_queries is None:
        dq_rows = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    else:  # PMA: one dQ row block per sample (float32), summed over samples below
        dq_rows = torch.empty(grad_out.shape, dtype=torch.float32, device=q.device)
    if plan.dkdv_grid > 0:
        kernels.gdpa_bwd_dkdv_kernel[(plan.dkdv_grid,)](
            q, k, v, grad_out, dk, dv, plan.dkdv, plan.dkdv.shape[0],
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            grad_out.stride(0), grad_out.stride(1), dk.stride(0), dk.stride(1),
            dv.stride(0), dv.stride(1), launch.left or 0, launch.right or 0, launch.scale,
            BLOCK_M=pma_m or cfg.dkdv_block_m, BLOCK_N=cfg.dkdv_block_n,
            num_warps=cfg.bwd_warps, num_stages=cfg.bwd_stages, **flags,
        )  # fmt: skip
    if plan.dq_grid > 0:
        kernels.gdpa_bwd_dq_kernel[(plan.dq_grid,)](
            q, k, v, grad_out, dq_rows, plan.dq, plan.dq.shape[0],
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            grad_out.stride(0), grad_out.stride(1), dq_rows.stride(0), dq_rows.stride(1),
            launch.left or 0, launch.right or 0, launch.scale,
            BLOCK_M=pma_m or cfg.dq_block_m, BLOCK_N=cfg.pma_block_n if pma_m else cfg.dq_block_n,
            num_warps=cfg.pma_warps if pma_m else cfg.bwd_warps,
            num_stages=cfg.bwd_stages, **flags,
        )  # fmt: skip
    if launch.num_queries is None:
        dq = dq_rows
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
) -> torch.Tensor:
    """Triton GDPA from per-sample lengths (CPU tensors: no device sync needed).

    ``q_lengths=None`` is PMA broadcast (``k_lengths`` required): the ``Nq`` rows of q attend
    over every sample's keys; ``k_lengths=None`` is self-attention. Same semantics as
    :func:`gem_kernels.gdpa`; inputs are assumed valid.
    """
    interpret = _interpret_requested()
    if not interpret and q.device.type != "cuda":
        raise ValueError(
            f"the Triton path needs CUDA tensors, got {q.device} (set TRITON_INTERPRET=1 to run "
            "CPU tensors under the Triton interpreter)"
        )
    if activation not in _ACTIVATION_CODES:
        raise ValueError(
            f"activation must be one of {sorted(_ACTIVATION_CODES)}, got {activation!r}"
        )
    config = config or default_config(q.shape[2], interpret=interpret, dtype=q.dtype)
    if config.schedule not in GDPA_SCHEDULES:
        raise ValueError(
            f"config.schedule must be one of {GDPA_SCHEDULES}, got {config.schedule!r}"
        )
    pma = q_lengths is None
    if pma and k_lengths is None:
        raise ValueError("PMA broadcast (q_lengths=None) needs k_lengths")
    self_attention = k_lengths is None
    samples = _samples(
        q_lengths, q_lengths if self_attention else k_lengths, q.shape[0] if pma else None
    )
    if self_attention:
        # Self-attention never takes the short-KV forward (its KV is as long as its queries).
        config = _without_short_kv(config)
    left, right = _resolve_window(causal, window)
    launch = _Launch(
        scale=1.0 / math.sqrt(q.shape[2]) if scale is None else float(scale),
        left=left,
        right=right,
        activation=_ACTIVATION_CODES[activation],
        normalize=normalize_by_length,
        num_queries=q.shape[0] if pma else None,
        config=config,
        interpret=interpret,
    )
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    pma_m = _pma_block_m(q.shape[0], config) if pma else 0
    plan = _plan(samples, q.shape[1], left, right, config, q.device, needs_grad, interpret, pma_m)
    out_rows = samples.q_len.size * q.shape[0] if pma else q.shape[0]
    q, k, v = _unit_stride(q), _unit_stride(k), _unit_stride(v)
    return GdpaFunction.apply(q, k, v, plan, launch, out_rows)


def _without_short_kv(config: GdpaTritonConfig) -> GdpaTritonConfig:
    from dataclasses import replace

    return replace(config, short_kv_max=0)


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
) -> torch.Tensor:
    """Triton GDPA from offsets; same semantics as :func:`gem_kernels.gdpa`.

    Inputs are assumed valid: call :func:`gem_kernels.gdpa` (with ``backend="triton"``) for
    argument checks. Offsets are read on the host (one device sync when they live on the GPU).
    """

    def lengths(offsets):
        if offsets is None:
            return None
        host = offsets.detach().to("cpu", torch.int64)
        return host[1:] - host[:-1]

    return gdpa_from_lengths(
        q,
        k,
        v,
        lengths(q_offsets),
        lengths(k_offsets),
        activation=activation,
        scale=scale,
        causal=causal,
        window=window,
        normalize_by_length=normalize_by_length,
        config=config,
    )
