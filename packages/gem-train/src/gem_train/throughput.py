"""How fast a run trains: model FLOPs over wall time against the GPU's peak, and where the
step's time goes.

MFU here is GEM's end-to-end figure: ``gem_model.model_flops`` of the batches actually trained
(real history lengths, forward + backward) over the wall time of the steps that trained them,
divided by the accelerator's bf16 dense peak. On N ranks every rank reports its own share, so
the per-rank MFU is already E2E MFU = local MFU x scaling ratio when the ranks are balanced.
"""

from __future__ import annotations

import itertools
import time
import traceback
import warnings
from collections import defaultdict, deque
from collections.abc import Callable

import torch

__all__ = [
    "BF16_DENSE_PEAK_TFLOPS",
    "HOST_PHASES",
    "PHASES",
    "StepClock",
    "host_sync_stacks",
    "measured_matmul_peak",
    "peak_tflops",
]

BF16_DENSE_PEAK_TFLOPS = {
    "H100": 989.4,
    "H100 PCIe": 756.5,
    "H100 NVL": 835.5,
    "H200": 989.4,
    "H200 NVL": 835.5,
    "H800": 989.4,
    "H800 PCIe": 756.5,
    "GH200": 989.4,
    "A100": 312.0,
    "B200": 2250.0,
    "GB200": 2500.0,
}
"""Datasheet bf16 dense (no sparsity) tensor-core peaks, by a part of the name torch reports
(``NVIDIA H200``, ``NVIDIA H100 PCIe``): the longest part found wins, so the PCIe and NVL
forms get their own lower peaks and ``GB200`` is not taken for ``B200``. MFU is quoted against
these."""

PHASES = ("data", "forward", "backward", "optimizer")
"""The parts of a step :class:`StepClock` times: waiting for the batch (host), forward,
backward (with the fused sparse optimizer and the gradient all-reduce it overlaps), and the
rest (gradient clip, 2D table sync, dense optimizer)."""

HOST_PHASES = (*PHASES, "wait")
"""The parts of a step :meth:`StepClock.take_host` reports: the host time spent issuing each
phase of :data:`PHASES`, and ``wait``, the host blocked reading the steps' losses back until
the device finishes them. Steps whose ``wait`` is near 0 are bound by the host."""


def host_sync_stacks(fn: Callable[[], object]) -> list[traceback.StackSummary]:
    """Runs ``fn()`` under CUDA's sync-debug mode and returns the Python stack (outermost
    first) of every host-device synchronisation it made. Attribute a sync by any frame of its
    stack: a library's sync often has a ``torch.cuda`` function as its innermost frame."""
    stacks: list[traceback.StackSummary] = []

    def show(message, *_args, **_kwargs):
        if "synchroniz" in str(message):
            stacks.append(traceback.extract_stack()[:-1])

    torch.cuda.synchronize()
    # Switching the mode on can warn by itself (seen with torch 2.11): not a sync of fn's.
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = show
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return stacks


def speed_line(record: dict) -> str:
    """One console line of a train log record (:meth:`gem_train.trainer.Trainer.fit`'s last):
    step time, throughput, model TFLOP/s, MFU against the datasheet and the measured peak,
    the time split, peak memory and the CUDA allocator's retries (when there were any)."""
    parts = [
        f"{record['step_ms']:.1f} ms/step",
        f"{record['samples_per_s']:,.0f} samples/s",
        f"{record['tokens_per_s']:,.0f} tokens/s",
        f"{record['tflops']:.4g} model TFLOP/s",
    ]
    if record.get("mfu") is not None:
        measured = record.get("mfu_measured")
        parts.append(f"MFU {record['mfu']:.1%}" + (f" ({measured:.1%} of the measured peak)"
                                                    if measured is not None else ""))  # fmt: skip
    else:
        parts.append("MFU n/a (no bf16 peak for this device)")
    split = " / ".join(f"{phase} {record[f'time_{phase}'] * 1e3:.1f}" for phase in PHASES)
    parts.append(f"ms per step: {split}")
    if record.get("peak_mem_gib") is not None:
        parts.append(f"peak {record['peak_mem_gib']:.1f} GiB")
    if record.get("alloc_retries"):
        parts.append(f"{record['alloc_retries']} allocator retries (fragmented cache: each one "
                     "syncs and frees it)")  # fmt: skip
    if record.get("graphs_compiled"):
        parts.append(f"{record['graphs_compiled']} graphs compiled")
    return ", ".join(parts)


def peak_tflops(device: torch.device | str) -> float | None:
    """The datasheet bf16 dense peak in TFLOP/s of ``device`` (or of a GPU by the name torch
    gives it); None for a CPU or an unknown GPU."""
    if isinstance(device, str):
        name = device
    elif device.type != "cuda":
        return None
    else:
        name = torch.cuda.get_device_name(device)
    # Longest key first: "GH200" before "H200".
    for key in sorted(BF16_DENSE_PEAK_TFLOPS, key=len, reverse=True):
        if key in name:
            return BF16_DENSE_PEAK_TFLOPS[key]
    return None


def measured_matmul_peak(device: torch.device, size: int = 8192, iters: int = 20) -> float | None:
    """bf16 ``size``^3 matmul TFLOP/s measured on ``device`` (None on a CPU): what the GPU
    delivers under its power and clock limits, beside the datasheet figure."""
    if device.type != "cuda":
        return None
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        a @ b
    end.record()
    end.synchronize()
    return 2 * size**3 * iters / (start.elapsed_time(end) * 1e-3) / 1e12


class StepClock:
    """Times the phases of each step without adding host-device syncs.

    ``mark(phase)`` ends ``phase`` at the current point of the stream: a CUDA event on GPUs,
    the host clock on CPUs. A phase marked more than once in a step (the forward around the
    data wait) adds up. ``finish()`` closes the step once it is issued; its CUDA events are
    read when the device has passed them (polled, or at ``take()``, which waits for them), so
    the host may run steps ahead. ``take()`` returns and resets the seconds per phase.

    Every mark also notes the host clock, so :meth:`take_host` tells how long the host took to
    issue each phase, and ``wait(seconds)`` adds the time it then sat blocked reading results
    back: on a GPU the two splits differ where the host runs ahead of (or behind) the stream;
    on a CPU they are the same.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._seconds: dict[str, float] = defaultdict(float)
        self._host_seconds: dict[str, float] = defaultdict(float)
        self._marks: list[tuple[str, object, float]] = []
        self._issued: deque[list[tuple[str, object, float]]] = deque()  # finished, not yet read

    def _now(self) -> tuple[object, float]:
        host = time.perf_counter()
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event, host
        return host, host

    def start(self) -> None:
        """The step's work begins (its batch is in hand)."""
        self._marks = [("", *self._now())]

    def mark(self, phase: str) -> None:
        """``phase`` ended now."""
        self._marks.append((phase, *self._now()))

    def finish(self) -> None:
        """The step is issued. Its phases are read once the device has run them: here for the
        steps already done (an event query, not a sync), the rest at :meth:`take`."""
        if self._marks:
            self._issued.append(self._marks)
        self._marks = []
        while self._issued and (not self.cuda or self._issued[0][-1][1].query()):
            self._read(self._issued.popleft())

    def wait(self, seconds: float) -> None:
        """The host sat ``seconds`` blocked on the device (reading the losses back)."""
        self._host_seconds["wait"] += seconds

    def _read(self, marks: list[tuple[str, object, float]]) -> None:
        for (_, begin, host_begin), (phase, end, host_end) in itertools.pairwise(marks):
            if self.cuda:
                self._seconds[phase] += begin.elapsed_time(end) * 1e-3
            else:
                self._seconds[phase] += end - begin
            self._host_seconds[phase] += host_end - host_begin

    def _read_issued(self) -> None:
        if self.cuda and self._issued:
            self._issued[-1][-1][1].synchronize()  # a no-op after the caller's own sync
        while self._issued:
            self._read(self._issued.popleft())

    def take(self) -> dict[str, float]:
        """Seconds per phase since the last ``take`` (every phase of :data:`PHASES` present)."""
        self._read_issued()
        seconds = {phase: self._seconds.get(phase, 0.0) for phase in PHASES}
        self._seconds = defaultdict(float)
        return seconds

    def take_host(self) -> dict[str, float]:
        """Host seconds per phase since the last ``take_host`` (every phase of
        :data:`HOST_PHASES` present). Independent of :meth:`take`: each resets only its own."""
        self._read_issued()
        seconds = {phase: self._host_seconds.get(phase, 0.0) for phase in HOST_PHASES}
        self._host_seconds = defaultdict(float)
        return seconds
