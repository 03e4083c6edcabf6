"""Registers, spills and shared memory of the JFA kernels, compiled for sm_90 without a GPU.

Triton compiles each kernel of ``default_config``'s tile regimes (short / medium / long, D=128,
bf16, causal and not) for a Hopper target with the ptxas bundled in its wheel;
``cuobjdump -res-usage`` reads the cubin. No device is needed, so register pressure can be
checked on the CPU box before spending device time. The numbers are those of the Triton
installed here (the H200 machine runs another version: a guide, not a measurement of its
binaries).

    python benchmarks/probe_jfa_resources.py --out benchmarks/results/cpu/jfa_kernel_resources.json

Rows: case ``<kernel>/<regime>/<causal|noncausal>`` (``dkdv_fused``: the fused backward), provider ``gem``, metrics ``registers``,
``stack_bytes`` (spills: Triton inlines every call) and ``shared_bytes``.
"""

import inspect
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from _results import ROOT, meta, results_parser, write_results

sys.path.insert(0, str(ROOT / "packages" / "gem-kernels" / "src"))

import triton  # noqa: E402
from gem_kernels.jfa_triton import _KERNEL_FILE, default_config  # noqa: E402
from gem_kernels.triton_loader import load_kernel_module  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

TARGET = GPUTarget("cuda", 90, 128)
FLOAT32_POINTERS = {"lse_ptr", "delta_ptr", "rel_ptr", "rel_partial_ptr", "dq_ptr"}
REGIMES = {"short": 1024, "medium": 2048, "long": None}


def _signature(fn, constexprs: dict) -> dict[str, str]:
    """Argument types of a JFA kernel: bf16 tensors, float32 statistics, int64 tile tables."""
    types = {}
    for name in inspect.signature(fn.fn).parameters:
        if name in constexprs:
            types[name] = "constexpr"
        elif name == "tiles_ptr":
            types[name] = "*i64"
        elif name.endswith("_ptr"):
            types[name] = "*fp32" if name in FLOAT32_POINTERS else "*bf16"
        elif name in ("qk_scale", "scale"):
            types[name] = "fp32"
        else:
            types[name] = "i32"
    return types


def _usage(fn, constexprs: dict, num_warps: int, num_stages: int) -> dict[str, int]:
    source = triton.compiler.ASTSource(
        fn=fn, signature=_signature(fn, constexprs), constexprs=constexprs
    )
    compiled = triton.compile(
        source, target=TARGET, options={"num_warps": num_warps, "num_stages": num_stages}
    )
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        report = subprocess.run(
            [str(cuobjdump), "-res-usage", cubin.name], capture_output=True, text=True, check=True
        ).stdout
    fields = dict(re.findall(r"(REG|STACK):(\d+)", report))
    return {
        "registers": int(fields["REG"]),
        "stack_bytes": int(fields["STACK"]),
        "shared_bytes": int(compiled.metadata.shared),
    }


def _probe_rows(kernel, regime, causal, fn, block_m, block_n, extra, warps, stages, fused):
    constexprs = {
        "HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_M": block_m, "BLOCK_N": block_n,
        "HAS_LEFT": False, "HAS_RIGHT": causal, "HAS_REL": False,
        "HAS_JAGGED": False, "DOT_PRECISION": "tf32", "UPCAST": False,
        "STRIP_P": 0, "STRIP_W": 1, **extra,
    }  # fmt: skip
    usage = _usage(fn, constexprs, warps, stages)
    case = f"{kernel}{'_fused' if fused else ''}/{regime}/{'causal' if causal else 'noncausal'}"
    print(f"{case:32s} M{block_m} N{block_n} w{warps} s{stages} {usage}", flush=True)
    tiles = f"BLOCK_M={block_m} BLOCK_N={block_n} w{warps} s{stages}"
    return [
        {"case": case, "provider": "gem", "mode": kernel, "metric": metric, "value": value,
         "tiles": tiles}
        for metric, value in usage.items()
    ]  # fmt: skip


def main() -> None:
    parser = results_parser(__doc__, "cpu/jfa_kernel_resources.json")
    args = parser.parse_args()
    kernels = load_kernel_module(_KERNEL_FILE, interpret=False)
    rows = []
    for regime, max_len in REGIMES.items():
        for causal in (True, False):
            cfg = default_config(128, max_len=max_len, masked=causal)
            fused = {"FUSED_DQ": cfg.bwd_fused, "DQ_TMA": cfg.bwd_fused}
            launches = {
                "fwd": (kernels.jfa_fwd_kernel, cfg.fwd_block_m, cfg.fwd_block_n,
                        {"ONE_LOOP": cfg.fwd_one_loop}, cfg.fwd_warps, cfg.fwd_stages),
                "dkdv": (kernels.jfa_bwd_dkdv_kernel, cfg.dkdv_block_m, cfg.dkdv_block_n,
                         {"DIAG_W": 1 << (cfg.dkdv_block_m + cfg.dkdv_block_n - 2).bit_length(),
                          "BUCKETS_PAD": 16, **fused}, cfg.bwd_warps, cfg.bwd_stages),
                "dq": (kernels.jfa_bwd_dq_kernel, cfg.dq_block_m, cfg.dq_block_n, {},
                       cfg.dq_warps or cfg.bwd_warps, cfg.dq_stages or cfg.bwd_stages),
            }  # fmt: skip
            if cfg.bwd_fused:  # the dK/dV kernel adds dQ: no dQ kernel runs
                del launches["dq"]
            for kernel, (fn, block_m, block_n, extra, warps, stages) in launches.items():
                rows += _probe_rows(kernel, regime, causal, fn, block_m, block_n, extra, warps,
                                    stages, cfg.bwd_fused and kernel == "dkdv")  # fmt: skip
    command = "python benchmarks/probe_jfa_resources.py"
    write_results(
        Path(args.out),
        meta(
            "jfa_kernel_resources",
            command,
            target="sm_90 (offline compile)",
            triton=triton.__version__,
        ),  # fmt: skip
        rows,
    )


if __name__ == "__main__":
    main()
