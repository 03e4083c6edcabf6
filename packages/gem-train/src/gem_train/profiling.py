"""The per-region profile of training steps: time and MFU of each part of the GEM model.

A profiler pass (``torch.profiler``) over a few steps. The model names its forward regions
with profiler ranges (``gem_model/<region>``, see ``GemModel.regions``); a backward node
belongs to the region whose forward recorded its operator (autograd's sequence numbers link
the two). Times are the kernels' GPU time on CUDA and the operators' CPU time elsewhere.
The self-attention kernels (JFA, BlockAttention, forward and backward) are split out of the
sequence region as ``sequence_attention``; ``other`` is the step's remaining wall time (glue
between regions, the loss, host waits, idle GPU).

On a GPU the pass also measures the step's exposed communication: the time NCCL kernels and
copy-engine peer copies (``gem_parallel``'s collectives) run while no compute kernel does.
Without it the step would take what one GPU takes for the same work, so GEM's split of the
end-to-end MFU follows: ``local_mfu`` = model FLOPs / (step - exposed communication) / peak,
``scaling_ratio`` = (step - exposed communication) / step, and ``mfu`` = local x scaling. An
estimate from inside the run (a slower rank shows up as the others' exposed waiting); a 1-GPU
run measures the local MFU directly.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from gem_model import REGION_SCOPE_PREFIX, ModelFlops
from rich.table import Table
from torch.autograd import DeviceType
from torch.autograd.profiler_util import FunctionEvent

__all__ = [
    "OPTIMIZER_SCOPE",
    "PROFILE_REGIONS",
    "ProfilePass",
    "exposed_seconds",
    "profile_table",
    "region_profile",
]

OPTIMIZER_SCOPE = "gem_train/optimizer"
"""Profiler range of the dense optimizer step (gradient finishing, clipping, AdamW)."""

PROFILE_REGIONS = (
    "embeddings",
    "sequence_attention",
    "sequence_dense",
    "cross",
    "pma",
    "dhen",
    "heads",
    "optimizer",
)
"""Rows of the table, in step order; each but ``optimizer`` is a field of ``ModelFlops``."""

_ATTENTION_OPS = ("gem_kernels::jagged_flash_attention", "gem_kernels::block_attention")
_BACKWARD_NODE = "autograd::engine::evaluate_function"
# Device activities that move data between GPUs, and those that are neither compute nor that.
_COMMUNICATION = ("nccl", "Memcpy PtoP")
_NOT_COMPUTE = ("Memcpy", "Memset")


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def exposed_seconds(
    communication: list[tuple[float, float]], compute: list[tuple[float, float]]
) -> float:
    """How long (in the intervals' unit) some ``communication`` interval runs while no
    ``compute`` interval does; intervals are ``(start, end)`` and may overlap each other."""
    busy = _union(compute)
    exposed, i = 0.0, 0
    for start, end in _union(communication):
        covered = 0.0
        while i < len(busy) and busy[i][1] <= start:
            i += 1
        j = i
        while j < len(busy) and busy[j][0] < end:
            covered += min(end, busy[j][1]) - max(start, busy[j][0])
            j += 1
        exposed += (end - start) - covered
    return exposed


def _exposed_communication_seconds(events: list[FunctionEvent]) -> float:
    """Exposed communication of the device activities among ``events`` (0 without any)."""
    communication, compute = [], []
    for event in events:
        if event.device_type == DeviceType.CPU or event.is_user_annotation:
            continue  # host events, and the ranges' spans on the GPU timeline (not kernels)
        interval = (event.time_range.start / 1e6, event.time_range.end / 1e6)
        if any(mark in event.name for mark in _COMMUNICATION):
            communication.append(interval)
        elif not event.name.startswith(_NOT_COMPUTE):
            compute.append(interval)
    return exposed_seconds(communication, compute)


def _descendants(event: FunctionEvent):
    stack = list(event.cpu_children)
    while stack:
        child = stack.pop()
        stack.extend(child.cpu_children)
        yield child


def _seconds(event: FunctionEvent, on_gpu: bool) -> float:
    return (event.device_time_total if on_gpu else event.cpu_time_total) / 1e6


def region_profile(
    events: list[FunctionEvent],
    *,
    steps: int,
    wall_seconds: float,
    flops: ModelFlops,
    peak_tflops: float | None,
    on_gpu: bool,
) -> dict:
    """The per-region table of ``steps`` profiled training steps (``events``: the profiler's
    ``events()``), as written to ``profile.json``: ``step_ms`` (wall) and ``regions``, rows of
    ``region``, ``forward_ms``, ``backward_ms``, ``ms`` (per step), ``model_tflop`` (per step,
    ``flops`` summed over the steps) and ``mfu`` (of ``peak_tflops``; None without one); then
    the step's ``exposed_communication_ms``, ``mfu``, ``local_mfu`` and ``scaling_ratio``
    (see the module docstring; the MFUs are None without a peak)."""
    forward = dict.fromkeys(PROFILE_REGIONS, 0.0)
    backward = dict.fromkeys(PROFILE_REGIONS, 0.0)
    owner: dict[int, str] = {}  # forward sequence number -> region
    for event in events:
        if event.device_type != DeviceType.CPU:
            # The GPU timeline repeats each range as an annotation whose "device time" is its
            # span, idle gaps included: only the host range and the kernels below it count.
            continue
        if event.name.startswith(REGION_SCOPE_PREFIX):
            region = event.name.removeprefix(REGION_SCOPE_PREFIX)
            if region == "sequence":
                region = "sequence_dense"  # the attention kernels move out below
            forward[region] += _seconds(event, on_gpu)
            for child in _descendants(event):
                if child.sequence_nr >= 0:
                    owner[child.sequence_nr] = region
                if region == "sequence_dense" and child.name in _ATTENTION_OPS:
                    forward["sequence_attention"] += _seconds(child, on_gpu)
                    forward["sequence_dense"] -= _seconds(child, on_gpu)
        elif event.name == OPTIMIZER_SCOPE:
            forward["optimizer"] += _seconds(event, on_gpu)
    for event in events:
        if event.name.startswith(_BACKWARD_NODE) and event.sequence_nr in owner:
            region = owner[event.sequence_nr]
            seconds = _seconds(event, on_gpu)
            attention = sum(
                _seconds(child, on_gpu)
                for child in _descendants(event)
                if child.name.removesuffix("_backward") in _ATTENTION_OPS
            )
            if region == "sequence_dense" and attention:
                backward["sequence_attention"] += attention
                seconds -= attention
            backward[region] += seconds
    rows = []
    for region in PROFILE_REGIONS:
        seconds = (forward[region] + backward[region]) / steps
        tflop = getattr(flops, region) / steps / 1e12 if region != "optimizer" else 0.0
        rows.append(
            {
                "region": region,
                "forward_ms": forward[region] / steps * 1e3,
                "backward_ms": backward[region] / steps * 1e3,
                "ms": seconds * 1e3,
                "model_tflop": tflop,
                "mfu": tflop / seconds / peak_tflops if peak_tflops and seconds > 0 else None,
            }
        )
    step_ms = wall_seconds / steps * 1e3
    other = step_ms - sum(row["ms"] for row in rows)
    rows.append({"region": "other", "forward_ms": None, "backward_ms": None, "ms": other,
                 "model_tflop": 0.0, "mfu": None})  # fmt: skip
    exposed_ms = _exposed_communication_seconds(events) / steps * 1e3
    local_ms = step_ms - exposed_ms
    tflop = flops.total / steps / 1e12

    def mfu(ms: float) -> float | None:
        return tflop / (ms / 1e3) / peak_tflops if peak_tflops and ms > 0 else None

    return {
        "step_ms": step_ms,
        "steps": steps,
        "regions": rows,
        "exposed_communication_ms": exposed_ms,
        "mfu": mfu(step_ms),
        "local_mfu": mfu(local_ms),
        "scaling_ratio": local_ms / step_ms if step_ms > 0 else None,
    }


def write_profile(output_dir: Path, profile: dict, trace_name: str) -> Path:
    """Writes ``profile.json`` (the table and the trace's file name) into ``output_dir``."""
    path = output_dir / "profile.json"
    path.write_text(json.dumps({**profile, "trace": trace_name}, indent=2) + "\n")
    return path


def profile_table(profile: dict, title: str) -> Table:
    """The per-region table for the terminal; its caption splits the end-to-end MFU."""
    table = Table(title=title)
    if profile.get("mfu") is not None:
        table.caption = (
            f"MFU {profile['mfu']:.1%} = local {profile['local_mfu']:.1%} x scaling "
            f"{profile['scaling_ratio']:.3f} (exposed communication "
            f"{profile['exposed_communication_ms']:.2f} ms of {profile['step_ms']:.2f} ms)"
        )
    for column in ("region", "forward ms", "backward ms", "ms / step", "share", "TFLOP", "MFU"):
        table.add_column(column, justify="left" if column == "region" else "right")

    def number(value: float | None, form: str) -> str:
        return "-" if value is None else format(value, form)

    for row in profile["regions"]:
        table.add_row(
            row["region"],
            number(row["forward_ms"], ".2f"),
            number(row["backward_ms"], ".2f"),
            number(row["ms"], ".2f"),
            number(row["ms"] / profile["step_ms"] if profile["step_ms"] else None, ".0%"),
            number(row["model_tflop"], ".3f"),
            number(row["mfu"], ".1%"),
        )
    return table


class ProfilePass:
    """Profiles ``steps`` consecutive training steps: ``begin()`` before the first, then
    ``after_step(flops)`` after each (the step's ``ModelFlops``); after the last it keeps the
    table in ``result`` and, with ``write``, writes the Chrome trace (``trace.json``) and
    ``profile.json`` into ``output_dir``."""

    def __init__(
        self,
        output_dir: Path,
        device: torch.device,
        peak_tflops: float | None,
        *,
        steps: int = 3,
        write: bool = True,
    ) -> None:
        self.output_dir = output_dir
        self.write = write
        self.on_gpu = device.type == "cuda"
        self.device = device
        self.peak_tflops = peak_tflops
        self.steps = steps
        self.result: dict | None = None
        self._profiler: torch.profiler.profile | None = None
        self._flops: ModelFlops | None = None
        self._done = 0
        self._started = 0.0

    @property
    def active(self) -> bool:
        return self._profiler is not None

    def begin(self) -> None:
        """Starts the pass; a no-op once it has started (a second call at an epoch boundary)."""
        if self._profiler is not None or self.result is not None:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.on_gpu:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.synchronize(self.device)
        self._profiler = torch.profiler.profile(activities=activities)
        self._profiler.__enter__()
        self._started = time.perf_counter()

    def after_step(self, flops: ModelFlops) -> None:
        self._flops = flops if self._flops is None else self._flops + flops
        self._done += 1
        if self._done < self.steps:
            return
        if self.on_gpu:
            torch.cuda.synchronize(self.device)
        wall = time.perf_counter() - self._started
        profiler, self._profiler = self._profiler, None
        profiler.__exit__(None, None, None)
        self.result = region_profile(
            profiler.events(), steps=self._done, wall_seconds=wall, flops=self._flops,
            peak_tflops=self.peak_tflops, on_gpu=self.on_gpu,
        )  # fmt: skip
        if not self.write:
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(self.output_dir / "trace.json"))
        write_profile(self.output_dir, self.result, "trace.json")
