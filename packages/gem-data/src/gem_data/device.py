"""Move batches to the accelerator ahead of use: pinned host memory, copies on a side stream."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator

import torch

from gem_data.batch import Batch

__all__ = ["DevicePrefetcher"]


class DevicePrefetcher:
    """Iterate ``batches`` already on ``device``, copied ``depth`` batches ahead.

    On CUDA each host batch is pinned (unless it already is, or ``pin_memory=False``) and copied
    with ``non_blocking=True`` on a dedicated copy stream, so the copy of batch ``i + depth``
    overlaps the compute on batch ``i``. Before a batch is handed out, the consumer's current
    stream waits for its copy (an event, no host synchronisation) and every tensor is recorded
    on the consumer stream, so the allocator does not recycle its memory while the consumer's
    kernels still read it. Elsewhere (CPU) batches are moved with a plain ``to(device)``.

    ``len()`` is that of ``batches`` when it has one; loader state stays with the loader (the
    batches in flight were already counted by it: save the loader's state at a step boundary
    after the prefetcher is drained, or accept that up to ``depth`` batches are skipped).
    """

    def __init__(
        self,
        batches: Iterable[Batch],
        device: torch.device | str,
        *,
        depth: int = 1,
        pin_memory: bool | None = None,
    ) -> None:
        if not isinstance(depth, int) or isinstance(depth, bool) or depth < 1:
            raise ValueError(f"depth must be an int >= 1, got {depth!r}")
        self.batches = batches
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.depth = depth
        self.pin_memory = self.device.type == "cuda" if pin_memory is None else bool(pin_memory)

    def __len__(self) -> int:
        return len(self.batches)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Batch]:
        if self.device.type != "cuda":
            for batch in self.batches:
                yield batch.to(self.device)
            return
        copy_stream = torch.cuda.Stream(device=self.device)
        in_flight: deque[tuple[Batch, torch.cuda.Event, Batch]] = deque()
        source = iter(self.batches)

        def launch() -> bool:
            host = next(source, None)
            if host is None:
                return False
            if self.pin_memory and not host.is_pinned():
                host = host.pin_memory()
            # The copy stream must not start before the consumer's earlier work that produced
            # or freed memory it reuses; waiting on it is cheap (no host synchronisation).
            copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(copy_stream):
                moved = host.to(self.device, non_blocking=True)
                copied = torch.cuda.Event()
                copied.record(copy_stream)
            in_flight.append((moved, copied, host))  # host stays alive until handed out
            return True

        while len(in_flight) < self.depth and launch():
            pass
        while in_flight:
            moved, copied, _host = in_flight.popleft()
            consumer = torch.cuda.current_stream(self.device)
            consumer.wait_event(copied)
            moved.record_stream(consumer)
            launch()
            yield moved
