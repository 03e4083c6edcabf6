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

    ``len()`` is that of ``batches`` when it has one. The loader runs ``depth`` batches ahead
    of the consumer, so its own state counts batches not yet trained on; :meth:`state_dict`
    is the loader's state as it was right after yielding the batch handed out last, the
    position to resume from after training on it.
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
        self._state: dict | None = None

    def __len__(self) -> int:
        return len(self.batches)  # type: ignore[arg-type]

    def state_dict(self) -> dict:
        """The source's ``state_dict()`` after the batch handed out last (before the first,
        its current state)."""
        return self.batches.state_dict() if self._state is None else self._state  # type: ignore[attr-defined]

    def _source_state(self) -> dict | None:
        state_dict = getattr(self.batches, "state_dict", None)
        return None if state_dict is None else state_dict()

    def __iter__(self) -> Iterator[Batch]:
        self._state = None
        if self.device.type != "cuda":
            for batch in self.batches:
                self._state = self._source_state()
                yield batch.to(self.device)
            return
        copy_stream = torch.cuda.Stream(device=self.device)
        in_flight: deque[tuple[Batch, torch.cuda.Event, Batch, dict | None]] = deque()
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
            # host stays alive until handed out
            in_flight.append((moved, copied, host, self._source_state()))
            return True

        while len(in_flight) < self.depth and launch():
            pass
        while in_flight:
            moved, copied, _host, self._state = in_flight.popleft()
            consumer = torch.cuda.current_stream(self.device)
            consumer.wait_event(copied)
            moved.record_stream(consumer)
            launch()
            yield moved
