"""Exploration: the GPU kernels of a Chrome trace (``gem-train --profile``'s ``trace.json``),
summed by name and by kind, so that the glue between the GEMMs has names and milliseconds.

    python benchmarks/tune/trace_kernels.py runs/h200/gem/trace.json --steps 3 [--json out.json]

Kinds, from the kernel names: ``gemm`` (cuBLAS / CUTLASS / nvjet), ``attention`` (our Triton
attention kernels), ``inductor`` (fused Triton kernels that Inductor generated), ``embedding``
(FBGEMM's TBE), ``elementwise`` (ATen's eager kernels), ``copy`` (memcpy / memset),
``communication`` (NCCL) and ``other``.
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

_KINDS = (
    ("communication", ("nccl",)),
    ("copy", ("memcpy", "memset")),
    ("embedding", ("embedding_", "tbe", "fbgemm", "split_embedding")),
    ("attention", ("jfa_", "gdpa_", "block_attention", "attn", "attention")),
    ("gemm", ("gemm", "nvjet", "cutlass", "sm90_xmma", "cublas", "_scaled_mm")),
    ("inductor", ("triton_",)),
    ("elementwise", ("at::native", "elementwise", "reduce_kernel", "vectorized")),
)


def kind(name: str) -> str:
    lowered = name.lower()
    for label, needles in _KINDS:
        if any(needle in lowered for needle in needles):
            return label
    return "other"


def summarise(trace: dict, steps: int, top: int) -> dict:
    """Milliseconds per step by kind and for the ``top`` kernels, and the GPU's busy time."""
    by_name: dict[str, float] = collections.defaultdict(float)
    calls: dict[str, int] = collections.Counter()
    for event in trace.get("traceEvents", []):
        if event.get("ph") == "X" and event.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            by_name[event["name"]] += event["dur"] / 1e3  # microseconds -> ms
            calls[event["name"]] += 1
    by_kind: dict[str, float] = collections.defaultdict(float)
    for name, ms in by_name.items():
        by_kind[kind(name)] += ms
    ranked = sorted(by_name.items(), key=lambda item: -item[1])[:top]
    return {
        "steps": steps,
        "kernel_ms_per_step": sum(by_name.values()) / steps,
        "by_kind_ms_per_step": {
            k: v / steps for k, v in sorted(by_kind.items(), key=lambda i: -i[1])
        },
        "top": [
            {
                "name": name[:160],
                "kind": kind(name),
                "ms_per_step": ms / steps,
                "calls_per_step": calls[name] / steps,
            }
            for name, ms in ranked
        ],  # fmt: skip
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("--steps", type=int, default=3, help="profiled steps in the trace")
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--json", type=Path, help="also write the summary here")
    args = parser.parse_args()
    summary = summarise(json.loads(args.trace.read_text()), args.steps, args.top)
    print(f"kernels: {summary['kernel_ms_per_step']:.1f} ms per step")
    for label, ms in summary["by_kind_ms_per_step"].items():
        print(f"  {label:14s} {ms:8.2f} ms")
    for row in summary["top"]:
        print(f"{row['ms_per_step']:8.2f} ms {row['calls_per_step']:6.0f}x  {row['kind']:12s} "
              f"{row['name'][:110]}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
