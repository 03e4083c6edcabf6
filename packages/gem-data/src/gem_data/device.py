"""Move batches to the accelerator ahead of use: pinned host memory, copies on a side stream."""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Iterable, Iterator

import torch

from gem_data._columns import check_bool
from gem_data.batch import Batch

__all__ = ["DevicePrefetcher"]


class DevicePrefetcher:
    """Iterate ``batches`` already on ``device``, produced and copied ``depth`` batches ahead.

    A background thread draws the host batches from ``batches`` (the loader's collate, and on
    CUDA pinning unless a batch already is, or ``pin_memory=False``), up to ``depth`` ahead: the
    consumer's host time goes to launching its step, not to assembling the next batch while
    the device waits. On CUDA each batch is copied with ``non_blocking=True`` on a dedicated
    copy stream, so the copy of batch ``i + depth`` overlaps the compute on batch ``i``. Before
    a batch is handed out, the consumer's current stream waits for its copy (an event, no host
    synchronisation) and every tensor is recorded on the consumer stream, so the allocator does
    not recycle its memory while the consumer's kernels still read it. Elsewhere (CPU) batches
    are moved with a plain ``to(device)``. An error of ``batches`` is raised to the consumer.

    ``len()`` is that of ``batches`` when it has one. The loader runs ahead of the consumer, so
    its own state counts batches not yet trained on; :meth:`state_dict` is the loader's state
    as it was right after yielding the batch handed out last, the position to resume from after
    training on it. A new iteration after one stopped early starts from there (the loader, if
    nothing moved it since, is put back with ``load_state_dict``): no batch read ahead is
    skipped.
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
        if pin_memory is None:
            self.pin_memory = self.device.type == "cuda"
        else:
            self.pin_memory = check_bool("pin_memory", pin_memory)
        if self.pin_memory and not torch.cuda.is_available():
            raise ValueError("pin_memory=True needs CUDA (pinned memory is for device copies)")
        # Pinning touches CUDA: on the consumer's device (host batches pinned for a copy made
        # later are pinned on the device current here), not a new context on cuda:0, which
        # every rank of a multi-GPU process would otherwise hold.
        self._pin_device: torch.device | None = None
        if self.device.type == "cuda":
            self._pin_device = self.device
        elif self.pin_memory and torch.cuda.is_available():
            self._pin_device = torch.device("cuda", torch.cuda.current_device())
        self._state: dict | None = None
        self._left_at: dict | None = None  # the source's state when the producer last stopped

    def __len__(self) -> int:
        return len(self.batches)  # type: ignore[arg-type]

    def state_dict(self) -> dict:
        """The source's ``state_dict()`` after the batch handed out last (before the first,
        its current state)."""
        return self.batches.state_dict() if self._state is None else self._state  # type: ignore[attr-defined]

    def _source_state(self) -> dict | None:
        state_dict = getattr(self.batches, "state_dict", None)
        return None if state_dict is None else state_dict()

    def _host_batches(self) -> Iterator[tuple[Batch, dict | None]]:
        """``(batch, source state after it)``, drawn and pinned by a background thread."""
        ready: queue.Queue = queue.Queue(maxsize=self.depth)
        stop = threading.Event()

        def put(item) -> bool:
            while not stop.is_set():
                try:
                    ready.put(item, timeout=0.05)
                    return True
                except queue.Full:
                    continue
            return False

        def produce() -> None:
            if self._pin_device is not None:
                torch.cuda.set_device(self._pin_device)
            source = iter(self.batches)
            try:
                for batch in source:
                    if self.pin_memory and not batch.is_pinned():
                        batch = batch.pin_memory()
                    if not put((batch, self._source_state())):
                        return
                put(_END)
            except BaseException as error:  # handed to the consumer, raised there
                put(error)
            finally:
                close = getattr(source, "close", None)
                if close is not None:
                    close()

        thread = threading.Thread(target=produce, name="gem-data-prefetch", daemon=True)
        thread.start()
        try:
            while (item := ready.get()) is not _END:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            stop.set()
            thread.join()
            self._left_at = self._source_state()

    def __iter__(self) -> Iterator[Batch]:
        read_ahead = self._state is not None and self._left_at != self._state
        if read_ahead and self._source_state() == self._left_at:
            # Stopped early with batches read ahead, and the source not moved since.
            self.batches.load_state_dict(self._state)  # type: ignore[attr-defined]
        self._state = self._source_state()
        host_batches = self._host_batches()
        try:
            yield from self._on_device(host_batches)
        finally:
            host_batches.close()

    def _on_device(self, host_batches: Iterator[tuple[Batch, dict | None]]) -> Iterator[Batch]:
        if self.device.type != "cuda":
            for batch, self._state in host_batches:
                yield batch.to(self.device)
            return
        copy_stream = torch.cuda.Stream(device=self.device)
        in_flight: deque[tuple[Batch, torch.cuda.Event, Batch, dict | None]] = deque()

        def launch() -> bool:
            host, state = next(host_batches, (None, None))
            if host is None:
                return False
            # The copy stream must not start before the consumer's earlier work that produced
            # or freed memory it reuses; waiting on it is cheap (no host synchronisation).
            copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(copy_stream):
                moved = host.to(self.device, non_blocking=True)
                copied = torch.cuda.Event()
                copied.record(copy_stream)
            # host stays alive until handed out
            in_flight.append((moved, copied, host, state))
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


_END = object()
"""The producer thread's end-of-batches mark."""
