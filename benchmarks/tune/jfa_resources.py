"""Exploration: registers, spills and shared memory of the JFA kernels (sm_90, no GPU needed).

Each kernel of ``default_config``'s tile regimes (short / medium / long, D=128, bf16, causal
and not) goes through :func:`compile_offline.compile_sm90`, which marks pointers and strides
16-divisible as the launches do. No device is needed. The numbers are those of the Triton that
runs the script: with Triton 3.6 first on the path (a spare ``pip install triton==3.6.0``
target, as on the H200 machine) they match the H200's binaries, for example the long causal
dQ kernel's 178 registers.

    PYTHONPATH=<triton 3.6 site-packages> python benchmarks/tune/jfa_resources.py
    # writes benchmarks/results/cpu/tuning/jfa_kernel_resources.json

Rows: case ``<kernel>/<regime>/<causal|noncausal>`` (``dkdv_fused``: the fused backward),
provider ``gem``, metrics ``registers``, ``stack_bytes`` (spills: Triton inlines every call),
``shared_bytes`` and ``spills_in_innermost_loops`` (spill instructions inside an innermost
loop, which cost every iteration).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness

from compile_offline import compile_sm90  # noqa: E402
from harness import ROOT, command_line, meta, results_parser, write_results  # noqa: E402

sys.path.insert(0, str(ROOT / "packages" / "gem-kernels" / "src"))

import triton  # noqa: E402
from gem_kernels.jfa_triton import default_config  # noqa: E402

KERNEL_FILE = "packages/gem-kernels/src/gem_kernels/_jfa_kernels.py"
# Argument types of the JFA kernels: bf16 tensors, float32 statistics, int64 tile tables.
POINTER_TYPES = {
    "*": "bf16",
    "tiles_ptr": "i64",
    **{name: "fp32" for name in ("lse_ptr", "delta_ptr", "rel_ptr", "rel_partial_ptr", "dq_ptr")},
}
REGIMES = {"short": 1024, "medium": 2048, "long": None}
METRICS = ("registers", "stack_bytes", "shared_bytes", "spills_in_innermost_loops")


def _probe_rows(kernel, regime, causal, name, block_m, block_n, extra, warps, stages, fused):
    constexprs = {
        "HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_M": block_m, "BLOCK_N": block_n,
        "HAS_LEFT": False, "HAS_RIGHT": causal, "HAS_REL": False,
        "HAS_JAGGED": False, "DOT_PRECISION": "tf32", "UPCAST": False,
        "STRIP_P": 0, "STRIP_W": 1, **extra,
    }  # fmt: skip
    got = compile_sm90(KERNEL_FILE, name, constexprs, POINTER_TYPES, warps, stages)
    usage = {metric: got[metric] for metric in METRICS}
    case = f"{kernel}{'_fused' if fused else ''}/{regime}/{'causal' if causal else 'noncausal'}"
    print(f"{case:32s} M{block_m} N{block_n} w{warps} s{stages} {usage}", flush=True)
    tiles = f"BLOCK_M={block_m} BLOCK_N={block_n} w{warps} s{stages}"
    return [
        {"case": case, "provider": "gem", "mode": kernel, "metric": metric, "value": value,
         "tiles": tiles}
        for metric, value in usage.items()
    ]  # fmt: skip


def main() -> None:
    parser = results_parser(__doc__, "cpu/tuning/jfa_kernel_resources.json")
    args = parser.parse_args()
    rows = []
    for regime, max_len in REGIMES.items():
        for causal in (True, False):
            cfg = default_config(128, max_len=max_len, masked=causal)
            fused = {"FUSED_DQ": cfg.bwd_fused, "DQ_TMA": cfg.bwd_fused}
            launches = {
                "fwd": ("jfa_fwd_kernel", cfg.fwd_block_m, cfg.fwd_block_n,
                        {"ONE_LOOP": cfg.fwd_one_loop}, cfg.fwd_warps, cfg.fwd_stages),
                "dkdv": ("jfa_bwd_dkdv_kernel", cfg.dkdv_block_m, cfg.dkdv_block_n,
                         {"DIAG_W": 1 << (cfg.dkdv_block_m + cfg.dkdv_block_n - 2).bit_length(),
                          "BUCKETS_PAD": 16, **fused}, cfg.bwd_warps, cfg.bwd_stages),
                "dq": ("jfa_bwd_dq_kernel", cfg.dq_block_m, cfg.dq_block_n, {},
                       cfg.dq_warps or cfg.bwd_warps, cfg.dq_stages or cfg.bwd_stages),
            }  # fmt: skip
            if cfg.bwd_fused:  # the dK/dV kernel adds dQ: no dQ kernel runs
                del launches["dq"]
            for kernel, (name, block_m, block_n, extra, warps, stages) in launches.items():
                rows += _probe_rows(kernel, regime, causal, name, block_m, block_n, extra, warps,
                                    stages, cfg.bwd_fused and kernel == "dkdv")  # fmt: skip
    write_results(
        Path(args.out),
        meta(
            "jfa_kernel_resources",
            command_line("benchmarks/tune/jfa_resources.py"),
            target="sm_90 (offline compile, the launches' divisibility hints)",
            triton=triton.__version__,
        ),  # fmt: skip
        rows,
    )


if __name__ == "__main__":
    main()
