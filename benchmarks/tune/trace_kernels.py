"""Exploration: the GPU kernels of a Chrome trace (``gem-train --profile``'s ``trace.json``),
summed by name and by kind (``harness.kernel_kind``), so that the glue between the GEMMs has
names and milliseconds.

    python benchmarks/tune/trace_kernels.py runs/h200/gem/trace.json --steps 3 [--json out.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness

from harness import gpu_idle, kernel_kind, kernel_ms_by_kind  # noqa: E402

#: Trace categories of the GPU's own work.
_DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def summarise(trace: dict, steps: int, top: int) -> dict:
    """Milliseconds per step by kind and for the ``top`` kernels (by name)."""
    kernels = [
        (event["name"], event["dur"])
        for event in trace.get("traceEvents", [])
        if event.get("ph") == "X" and event.get("cat") in _DEVICE_CATS
    ]
    by_name: dict[str, float] = collections.defaultdict(float)
    calls: dict[str, int] = collections.Counter()
    for name, microseconds in kernels:
        by_name[name] += microseconds / 1e3
        calls[name] += 1
    ranked = sorted(by_name.items(), key=lambda item: -item[1])[:top]
    return {
        "steps": steps,
        "kernel_ms_per_step": sum(by_name.values()) / steps,
        "by_kind_ms_per_step": kernel_ms_by_kind(kernels, steps),
        "idle": idle_gaps(trace, steps, top=25),
        "top": [
            {
                "name": name[:160],
                "kind": kernel_kind(name),
                "ms_per_step": ms / steps,
                "calls_per_step": calls[name] / steps,
            }
            for name, ms in ranked
        ],
    }


def idle_gaps(trace: dict, steps: int, top: int, min_us: float = 20.0) -> dict:
    """Where the GPU waits: the gaps between its busy intervals (kernels, copies, sets, merged
    over streams) from the first to the last, in ms per step, and the ``top`` longest with what
    the host ran over them (the shortest host operators that cover most of the gap) and the
    kernel that ended them."""
    events = trace.get("traceEvents", [])
    device = sorted(
        (e["ts"], e["ts"] + e["dur"], e["name"])
        for e in events
        if e.get("ph") == "X" and e.get("cat") in _DEVICE_CATS
    )
    host = [
        (e["ts"], e["ts"] + e["dur"], e["name"])
        for e in events
        if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "cuda_runtime", "user_annotation")
    ]
    next_kernel = {start: name for start, _, name in reversed(device)}
    gaps = sorted(
        ((stop - start, start, stop, next_kernel[stop]) for start, stop in
         gpu_idle(((a, b) for a, b, _ in device), min_us)),
        reverse=True,
    )  # fmt: skip
    end = max((stop for _, stop, _ in device), default=0.0)
    rows = []
    for length, start, stop, after in gaps[:top]:
        covering = sorted(
            (h_stop - h_start, name)
            for h_start, h_stop, name in host
            if min(h_stop, stop) - max(h_start, start) >= 0.5 * length
        )
        rows.append(
            {
                "ms": length / 1e3,
                "host": [name[:80] for _, name in covering[:4]],
                "next_kernel": after[:100],
            }
        )
    return {
        "idle_ms_per_step": sum(g[0] for g in gaps) / 1e3 / steps,
        "gaps_per_step": len(gaps) / steps,
        "span_ms_per_step": (end - device[0][0]) / 1e3 / steps if device else 0.0,
        "longest": rows,
    }


def print_gaps(gaps: dict) -> None:
    print(
        f"GPU idle {gaps['idle_ms_per_step']:.2f} ms per step in {gaps['gaps_per_step']:.0f} gaps "
        f"(busy span {gaps['span_ms_per_step']:.1f} ms)"
    )
    for row in gaps["longest"]:
        print(f"{row['ms']:7.3f} ms before {row['next_kernel'][:60]}  host: {row['host']}")


def print_summary(summary: dict) -> None:
    """The kernel milliseconds per step: the total, by kind, and the top kernels by name."""
    print(f"kernels: {summary['kernel_ms_per_step']:.1f} ms per step")
    for label, ms in summary["by_kind_ms_per_step"].items():
        print(f"  {label:14s} {ms:8.2f} ms")
    for row in summary["top"]:
        print(f"{row['ms_per_step']:8.2f} ms {row['calls_per_step']:6.0f}x  {row['kind']:12s} "
              f"{row['name'][:110]}")  # fmt: skip
    print_gaps(summary["idle"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("--steps", type=int, default=3, help="profiled steps in the trace")
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--json", type=Path, help="also write the summary here")
    args = parser.parse_args()
    summary = summarise(json.loads(args.trace.read_text()), args.steps, args.top)
    print_summary(summary)
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
