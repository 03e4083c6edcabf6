"""Run a function in several real processes that share a ``torch.distributed`` world.

Meant for tests: every process joins a process group (gloo by default) through a ``FileStore``
in a temporary directory, runs ``worker(rank, *args)`` and tears the group down. A child's
exception or non-zero exit code is raised in the caller, and children still running after
``timeout`` seconds (say, a collective some rank never joins) are killed and reported.

When one rank fails, its peers usually fail soon after (their collectives lose a connection),
so the error raised lists every rank's traceback in the order they failed: the first is the
root cause.

Processes start from a ``forkserver`` that imports torch (and FSDP2, and ``torch._dynamo`` which
FSDP2's first ``fully_shard`` pulls in) once, so each rank starts in well under a second instead
of paying those multi-second imports; the forkserver itself is a clean,
single-threaded process, which plain ``fork`` of a test runner is not.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import multiprocessing.forkserver
import os
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp

__all__ = ["fresh_forkserver", "run_in_processes"]

# FSDP2's first fully_shard imports torch._dynamo: ~5 s per process unless the forkserver has it.
_PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.device_mesh",
    "torch.distributed.fsdp",
    "torch._dynamo",
    "gem_parallel",
)


@contextlib.contextmanager
def fresh_forkserver() -> Iterator[None]:
    """Restarts the forkserver on entry and on exit.

    The forkserver's preload list is fixed when it starts, so a test module whose ranks import
    more than torch (torchrec, gem_train) wraps itself in this: the forkserver then preloads them
    once instead of every child paying ~10 s of imports, and an earlier module's forkserver
    started without them is not reused.
    """
    server = multiprocessing.forkserver._forkserver
    stop = getattr(server, "_stop", None)
    if stop is not None:
        stop()
    try:
        yield
    finally:
        if stop is not None:
            stop()


def _entry(
    rank: int,
    world_size: int,
    backend: str,
    work_dir: str,
    collective_timeout_s: float,
    worker: Callable[..., None],
    args: tuple,
) -> None:
    torch.set_num_threads(1)  # many ranks share few cores
    dist.init_process_group(
        backend,
        init_method=f"file://{Path(work_dir) / 'store'}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=collective_timeout_s),
    )
    try:
        worker(rank, *args)
    except BaseException:
        # Written before the process group is torn down (which is what makes peers fail), so
        # the root cause always has the earliest timestamp.
        record = {"time_ns": time.time_ns(), "rank": rank, "pid": os.getpid()}
        record["traceback"] = traceback.format_exc()
        partial = Path(work_dir, f"failure_rank{rank}.partial")
        partial.write_text(json.dumps(record))
        os.replace(partial, Path(work_dir, f"failure_rank{rank}.json"))  # never read half-written
        raise
    finally:
        dist.destroy_process_group()


def _failure_report(work_dir: str, err: torch_mp.ProcessRaisedException) -> Exception:
    records = [json.loads(p.read_text()) for p in Path(work_dir).glob("failure_rank*.json")]
    if not records:
        return err
    records.sort(key=lambda r: r["time_ns"])
    parts = [f"rank {records[0]['rank']} failed first:\n{records[0]['traceback']}"]
    parts += [f"rank {r['rank']} failed later:\n{r['traceback']}" for r in records[1:]]
    first = records[0]
    return torch_mp.ProcessRaisedException("\n".join(parts), first["rank"], first["pid"])


def run_in_processes(
    worker: Callable[..., None],
    world_size: int,
    *args: object,
    backend: str = "gloo",
    timeout: float = 120.0,
    store_dir: str | Path | None = None,
    preload: Sequence[str] = (),
) -> None:
    """Run ``worker(rank, *args)`` on ranks ``0..world_size-1`` in separate processes.

    Args:
        worker: a module-level (picklable) function; it runs after ``init_process_group``.
        world_size: number of processes.
        *args: picklable arguments passed to every rank after ``rank``.
        backend: process group backend (``"gloo"`` runs anywhere).
        timeout: seconds before still-running children are killed and ``TimeoutError`` raised.
        store_dir: where to create the temporary directory holding the ``FileStore`` file and
            failure reports (default: the system temporary directory).
        preload: extra modules the forkserver imports once for all children (the worker's
            module is added automatically). Only honoured when this call starts the forkserver.

    Raises:
        torch.multiprocessing.ProcessRaisedException: a child raised; the message holds the
            tracebacks of every rank that raised, the earliest (the root cause) first.
        torch.multiprocessing.ProcessExitedException: a child exited with a non-zero code.
        TimeoutError: children were still running after ``timeout`` seconds.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size <= 0:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if timeout <= 0:
        raise ValueError(f"timeout must be positive, got {timeout!r}")
    modules = [*_PRELOAD, *preload]
    if worker.__module__ != "__main__":
        modules.append(worker.__module__)
    multiprocessing.set_forkserver_preload(modules)

    with tempfile.TemporaryDirectory(dir=store_dir) as work_dir:
        context = torch_mp.start_processes(
            _entry,
            args=(world_size, backend, work_dir, timeout, worker, args),
            nprocs=world_size,
            join=False,
            start_method="forkserver",
        )
        deadline = time.monotonic() + timeout
        while True:
            try:
                if context.join(timeout=max(0.05, deadline - time.monotonic())):
                    return
            except torch_mp.ProcessRaisedException as err:
                # join() has already stopped the other ranks; report all of them, first first.
                raise _failure_report(work_dir, err) from err
            if time.monotonic() >= deadline:
                for process in context.processes:
                    if process.is_alive():
                        process.kill()
                for process in context.processes:
                    process.join()
                raise TimeoutError(f"{world_size} worker processes still running after {timeout} s")
