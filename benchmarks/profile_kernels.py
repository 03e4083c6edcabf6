"""Hardware-counter profiles (Nsight Compute) of the kernels whose targets are still missed.

The timed benchmarks say *how fast*; this script says *what limits it*: for each target it runs
the benchmark's own inputs once under ``ncu`` and keeps, per kernel, the duration, DRAM and SM
throughput, achieved occupancy and its limiters, the tensor-pipe and issue activity, shared-memory
bank conflicts and the warp stall reasons (cycles per issued instruction by reason).

    python benchmarks/profile_kernels.py                 # every target -> results/h200/kernel_profiles.json
    python benchmarks/profile_kernels.py --targets dy,gdpa_self_L1024

``--run TARGET`` (what ``ncu`` launches) warms the target up (Triton compiles, plans are cached)
and then runs it once between ``cudaProfilerStart`` / ``cudaProfilerStop``; ``ncu`` profiles only
that range (``--profile-from-start off``) and leaves the clocks alone (``--clock-control none``,
as the device notes ask). Targets run one after another: ``ncu`` serialises kernels anyway, and
the warm-up of each target compiles in its own process first (all in parallel) so that the
profiled processes find their kernels in Triton's cache.
"""

from __future__ import annotations

import argparse
import csv
import io
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from harness import ROOT, meta, write_results

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "h200" / "kernel_profiles.json"


def _dy(col_sum: bool, **options):
    """``options``: launch options of the quantise kernels (``OperandKernelConfig`` fields;
    none: the shipped ones)."""
    from gem_precision import OperandKernelConfig, quantize_operand

    config = OperandKernelConfig(**options) if options else None
    x = torch.randn(65536, 4096, device="cuda", dtype=torch.bfloat16)
    return lambda: quantize_operand(x, "1x128", torch.float8_e4m3fn, col_sum=col_sum, config=config)


def _gdpa_self(max_len: int, batch: int, precision: str = "bf16"):
    import bench_gdpa as bg

    case = bg.Case("self", batch, max_len, "cuda")
    return _fresh_grads(*bg.provider_gem(case, precision=precision)[1:])


def _jfa(max_len: int, batch: int, causal: bool, bias: str | None = None, precision="bf16"):
    """``bias``: ``"rel"`` (rel_pos_bias, 512 buckets) or ``"jagged"`` (jagged_bias), with the
    benchmark's bias inputs."""
    import bench_jagged_attention as bj

    case = bj.Case(batch, max_len, causal, None, "cuda")
    extra = {}
    if bias is not None:
        rel, jagged = bj.bias_inputs(case, "cuda", jagged=bias == "jagged")
        extra = {"rel": rel} if bias == "rel" else {"jagged": jagged}
    return _fresh_grads(*bj.provider_gem(case, precision=precision, **extra)[1:])


def _fresh_grads(fwd_bwd, leaves):
    """``fwd_bwd`` with the leaves' gradients dropped first (as the timed benchmarks do), so the
    profile holds no gradient-accumulation adds."""

    def call():
        for leaf in leaves:
            leaf.grad = None
        fwd_bwd()

    return call


#: name -> (issue, what it runs, builder). Each builder returns a no-argument call.
TARGETS = {
    "dy": ("5", "quantize_operand 65536x4096 bf16, both 1x128 layouts + column sums", lambda: _dy(True)),
    "dy_nobias": ("5", "the same without column sums", lambda: _dy(False)),
    "dy_w8": ("5", "dy with 8 warps per tile", lambda: _dy(True, tile_warps_col_sum=8)),
    "gdpa_self_L1024": ("4", "GDPA self B512xL1024 gelu_fast, forward+backward", lambda: _gdpa_self(1024, 512)),
    "gdpa_self_L4096": ("4", "GDPA self B128xL4096 gelu_fast, forward+backward", lambda: _gdpa_self(4096, 128)),
    "jfa_L1024_full": ("3", "JFA B512xL1024 non-causal, forward+backward", lambda: _jfa(1024, 512, False)),
    "jfa_L4096_causal": ("3", "JFA B128xL4096 causal, forward+backward", lambda: _jfa(4096, 128, True)),
    "jfa_L4096_causal_rel": ("3", "the same with rel_pos_bias", lambda: _jfa(4096, 128, True, "rel")),
    "jfa_L4096_causal_jagged": ("3", "the same with jagged_bias", lambda: _jfa(4096, 128, True, "jagged")),
    "gdpa_self_L1024_fp8": ("29", "gdpa_self_L1024 with precision='fp8'", lambda: _gdpa_self(1024, 512, "fp8")),
    "gdpa_self_L4096_fp8": ("29", "gdpa_self_L4096 with precision='fp8'", lambda: _gdpa_self(4096, 128, "fp8")),
    "jfa_L4096_full_fp8": ("29", "JFA B128xL4096 non-causal with precision='fp8', forward+backward", lambda: _jfa(4096, 128, False, precision="fp8")),
    "jfa_L4096_full": ("29", "the same in bf16", lambda: _jfa(4096, 128, False)),
}  # fmt: skip

# Metrics kept from ncu's raw page (regular expressions on the metric name).
_KEEP = [
    r"^gpu__time_duration\.sum$",
    r"^dram__bytes_(read|write)\.sum$",
    r"^sm__throughput\.avg\.pct_of_peak_sustained_elapsed$",
    r"^gpu__compute_memory_throughput\.avg\.pct_of_peak_sustained_elapsed$",
    r"^sm__warps_active\.avg\.pct_of_peak_sustained_active$",
    r"^sm__maximum_warps_per_active_cycle_pct$",
    r"^launch__(registers_per_thread|block_size|grid_size|occupancy_limit_\w+|"
    r"shared_mem_per_block\w*|waves_per_multiprocessor)$",
    r"^sm__pipe_tensor_op_\w+cycles_active\.avg\.pct_of_peak_sustained_active$",
    r"^sm__inst_executed_pipe_\w+\.avg\.pct_of_peak_sustained_active$",
    r"^smsp__issue_active\.avg\.pct_of_peak_sustained_active$",
    r"^smsp__inst_executed\.sum$",
    r"^smsp__average_warps_issue_stalled_\w+_per_issue_active\.ratio$",
    r"^smsp__average_warp_latency_per_inst_issued\.ratio$",
    r"^l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_(ld|st)\.sum$",
    r"^l1tex__data_pipe_lsu_wavefronts_mem_shared_op_(ld|st)\.sum$",
    r"^lts__t_sector_hit_rate\.pct$",
    r"^sm__cycles_elapsed\.avg\.per_second$",
]


def run_target(name: str, warmup: int, profile: bool = True) -> None:
    """Warm ``name`` up (Triton compiles, plans are cached), then, with ``profile``, run it once
    inside the profiler range."""
    call = TARGETS[name][2]()
    for _ in range(warmup):
        call()
    torch.cuda.synchronize()
    if profile:
        torch.cuda.profiler.start()
        call()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()


def _number(text: str):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return text


def parse_raw_csv(text: str) -> list[dict]:
    """ncu ``--page raw --csv`` output -> one dict per kernel launch: name, units, kept metrics."""
    start = text.find('"ID"')
    if start < 0:
        return []
    rows = list(csv.reader(io.StringIO(text[start:])))
    header, units, body = rows[0], rows[1], rows[2:]
    keep = [i for i, h in enumerate(header) if any(re.search(p, h) for p in _KEEP)]
    kernels = []
    for row in body:
        if len(row) != len(header):
            continue
        entry = {"kernel": row[header.index("Kernel Name")][:120]}
        for i in keep:
            unit = f" [{units[i]}]" if units[i] else ""
            entry[header[i] + unit] = _number(row[i])
        kernels.append(entry)
    return kernels


def profile(name: str, ncu: str, warmup: int, timeout_s: float) -> dict:
    cmd = [
        ncu, "--clock-control", "none", "--profile-from-start", "off", "--set", "full",
        "--page", "raw", "--csv", sys.executable, __file__, "--run", name,
        "--warmup", str(warmup),
    ]  # fmt: skip
    start = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    out = {
        "issue": TARGETS[name][0],
        "what": TARGETS[name][1],
        "wall_s": round(time.time() - start, 1),
    }
    out["kernels"] = parse_raw_csv(proc.stdout)
    if proc.returncode != 0 or not out["kernels"]:
        out["error"] = (proc.stderr or proc.stdout)[-2000:]
    return out


# Row metrics (BENCHMARKS.md schema: case = target, provider = kernel, mode "profile").
_SUMMARY = {
    "us": ("gpu__time_duration.sum", 1e-3),  # ncu reports ns
    "memory_sol_pct": ("gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed", 1.0),
    "tensor_pipe_pct": (
        "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
        1.0,
    ),
    "warps_active_pct": ("sm__warps_active.avg.pct_of_peak_sustained_active", 1.0),
    "issue_active_pct": ("smsp__issue_active.avg.pct_of_peak_sustained_active", 1.0),
    "registers": ("launch__registers_per_thread", 1.0),
}


def summary_rows(target: str, kernels: list[dict]) -> list[dict]:
    """The headline numbers of each profiled kernel as result rows."""
    rows = []
    for k in kernels:
        provider = k["kernel"].split("(")[0][:60]
        values = {m.split(" [")[0]: v for m, v in k.items()}
        for metric, (name, factor) in _SUMMARY.items():
            value = values.get(name)
            if isinstance(value, float):
                rows.append(dict(case=target, provider=provider, mode="profile", metric=metric,
                                 value=round(value * factor, 3)))  # fmt: skip
        moved = values.get("dram__bytes_read.sum", 0.0) + values.get("dram__bytes_write.sum", 0.0)
        ns = values.get("gpu__time_duration.sum")
        if moved and isinstance(ns, float) and ns > 0:
            rows.append(dict(case=target, provider=provider, mode="profile", metric="dram_gbps",
                             value=round(moved / ns, 1)))  # fmt: skip
    return rows


def _warm(name: str, warmup: int) -> str:
    cmd = [sys.executable, __file__, "--run", name, "--warmup", str(warmup), "--no-range"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    return "" if proc.returncode == 0 else proc.stderr[-1500:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--targets", default=",".join(TARGETS), help="comma list of " + ", ".join(TARGETS)
    )
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--timeout-s", type=float, default=240.0, help="per profiled target")
    parser.add_argument("--run", help=argparse.SUPPRESS)  # the process ncu profiles
    parser.add_argument("--no-range", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        run_target(args.run, args.warmup, profile=not args.no_range)
        return
    names = [n for n in args.targets.split(",") if n]
    unknown = sorted(set(names) - set(TARGETS))
    if unknown:
        raise SystemExit(f"--targets: unknown {unknown}; choose from {sorted(TARGETS)}")
    ncu = shutil.which("ncu") or next(
        iter(sorted(Path("/opt/nvidia").glob("nsight-compute/*/ncu"))), None
    )
    if ncu is None:
        raise SystemExit("ncu (Nsight Compute) not found on PATH or under /opt/nvidia")
    start = time.time()
    with ThreadPoolExecutor(len(names)) as pool:
        warm_errors = dict(
            zip(names, pool.map(lambda n: _warm(n, args.warmup), names), strict=True)
        )
    print(
        f"warmed up in {time.time() - start:.0f} s: {[n for n, e in warm_errors.items() if e]} failed"
    )
    results = {}
    for name in names:
        results[name] = profile(name, str(ncu), args.warmup, args.timeout_s)
        if warm_errors[name]:
            results[name]["warm_error"] = warm_errors[name]
        for k in results[name]["kernels"]:
            print(
                name,
                k["kernel"][:60],
                {m: v for m, v in k.items() if "time_duration" in m or "compute_memory" in m},
            )
        if "error" in results[name]:
            print(name, "ERROR", results[name]["error"][-600:])
        command = "python benchmarks/profile_kernels.py --targets " + ",".join(names)
        block = meta("kernel_profiles", command, device=torch.cuda.get_device_name(), ncu=str(ncu),
                     targets=results)  # fmt: skip
        rows = [r for n, t in results.items() for r in summary_rows(n, t["kernels"])]
        write_results(Path(args.out), block, rows)
    print(f"done in {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
