"""Exploration: where the time of one public attention call goes, forward+backward.

For JFA and GDPA cases of the canonical benchmarks, bf16 and FP8: the host syncs of one
forward+backward (CUDA sync-debug mode, with the innermost project frame), the host time to
issue it (no sync), its device time (CUDA events, host ahead), and the kernels with the most
device time (torch.profiler). Written to find why small fwd+bwd cases can be host-bound and
where FP8 mode loses its time.

    PYTHONPATH=packages/gem-kernels/src:packages/gem-precision/src:benchmarks \\
        python benchmarks/tune/attention_host.py   # results/h200/tuning/attention_host.json
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness, benches

import bench_gdpa  # noqa: E402
import bench_jagged_attention as bench_jfa  # noqa: E402
import torch  # noqa: E402
from gem_train.throughput import host_sync_stacks  # noqa: E402
from harness import command_line, meta, require_cuda, results_parser, write_results  # noqa: E402

CASES = [
    ("jfa", "B512xL1024/causal", lambda d: bench_jfa.Case(512, 1024, True, None, d)),
    ("jfa", "B32xL16384/full", lambda d: bench_jfa.Case(32, 16384, False, None, d)),
    ("gdpa", "pma/B128xL4096", lambda d: bench_gdpa.Case("pma", 128, 4096, d)),
    ("gdpa", "cross/B512xL1024", lambda d: bench_gdpa.Case("cross", 512, 1024, d)),
    ("gdpa", "self/B128xL4096", lambda d: bench_gdpa.Case("self", 128, 4096, d)),
]


def _syncs(fn) -> list[str]:
    """Innermost gem frame of every host sync that ``fn()`` makes."""
    found = []
    for stack in host_sync_stacks(fn):
        frames = [f for f in stack if "gem_" in f.filename] or list(stack)
        where = frames[-1]
        found.append(f"{Path(where.filename).name}:{where.lineno} {where.name}")
    torch.cuda.synchronize()
    return found


def _times(fn, reps=20) -> tuple[float, float]:
    """(host ms to issue one call, device ms per call) over ``reps`` calls back to back."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    host = time.perf_counter()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    host_ms = (time.perf_counter() - host) * 1e3 / reps
    end.synchronize()
    return host_ms, start.elapsed_time(end) / reps


def _top_kernels(fn, n=8) -> list[tuple[str, float]]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
    return [(e.key[:70], round(e.device_time_total / 1e3, 4)) for e in events[:n]]


def main() -> None:
    parser = results_parser(__doc__, "h200/tuning/attention_host.json")
    args = parser.parse_args()
    require_cuda()
    device = torch.device("cuda")
    rows = []
    for kernel, name, build in CASES:
        case = build(device)
        for precision in ("bf16", "fp8"):
            _, fwd_bwd, leaves = (bench_jfa if kernel == "jfa" else bench_gdpa).provider_gem(
                case, precision=precision
            )

            def step(fwd_bwd=fwd_bwd, leaves=leaves):
                for leaf in leaves:
                    leaf.grad = None
                fwd_bwd()

            host_ms, device_ms = _times(step)
            syncs = _syncs(step)
            top = _top_kernels(step)
            provider = "gem" if precision == "bf16" else "gem-fp8"
            print(f"{name:24s} {provider:8s} host {host_ms:7.3f} ms  device {device_ms:7.3f} ms"
                  f"  syncs {len(syncs)} {sorted(set(syncs))}", flush=True)  # fmt: skip
            for key, ms in top:
                print(f"    {ms:8.3f} ms  {key}", flush=True)
            case_name = f"{kernel}/{name}"
            base = {"case": case_name, "provider": provider, "mode": "fwd_bwd"}
            rows += [
                {**base, "metric": "host_ms", "value": host_ms},
                {**base, "metric": "device_ms", "value": device_ms},
                {**base, "metric": "syncs", "value": len(syncs), "where": sorted(set(syncs))},
                {**base, "metric": "top_kernels_ms", "value": top},
            ]
    write_results(Path(args.out), meta("attention_host", command_line("benchmarks/tune/attention_host.py"),
                                       device=torch.cuda.get_device_name()), rows)  # fmt: skip


if __name__ == "__main__":
    main()
