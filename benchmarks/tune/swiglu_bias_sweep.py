"""Exploration: launch parameters of SwiGLU's backward kernel when it also sums the bias
gradient (``HAS_BIAS``), at the h200 recipe's (524k, 2 x 1376) hidden, against the same kernel
without the bias plus a separate column sum (what the GEMM's bias costs).

Each variant is (BLOCK_R, BLOCK_C, rows per program, warps): a program loops over its rows in
(BLOCK_R, BLOCK_C) tiles and writes one row of float32 partial sums; rows per program equal to
BLOCK_R is one tile per program (more partial sums to reduce afterwards).

    PYTHONPATH=packages/gem-kernels/src:benchmarks python benchmarks/tune/swiglu_bias_sweep.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness

import gem_kernels  # noqa: E402
import torch  # noqa: E402
from gem_kernels.triton_loader import load_kernel_module  # noqa: E402
from harness import (  # noqa: E402
    command_line,
    median_ms,
    meta,
    require_cuda,
    tuning_path,
    write_results,
)

KERNELS = Path(gem_kernels.__file__).with_name("_swiglu_kernels.py")
VARIANTS = [
    (8, 512, 512, 4),
    (8, 256, 256, 4),
    (4, 512, 512, 4),
    (4, 512, 1024, 4),
    (4, 512, 256, 4),
    (4, 512, 512, 8),
    (4, 256, 512, 2),
    (2, 512, 512, 4),
    (2, 1024, 512, 4),
    (2, 512, 1024, 2),
    (1, 1024, 512, 4),
    (1, 512, 512, 2),
]


def backward(kernels, hidden, bias, grad, block_r, block_c, per_program, warps):
    rows, width = hidden.shape[0], hidden.shape[1] // 2
    out = torch.empty_like(hidden)
    programs = -(-rows // per_program)
    partials = None if bias is None else torch.empty(programs, 2 * width, device="cuda")
    kernels.swiglu_bwd_kernel[(programs, -(-width // block_c))](
        hidden, hidden if bias is None else bias, grad, out,
        out if partials is None else partials, rows, width, hidden.stride(0), grad.stride(0),
        out.stride(0), per_program, HAS_BIAS=bias is not None, BLOCK_R=block_r,
        BLOCK_C=block_c, num_warps=warps,
    )  # fmt: skip
    return out, None if partials is None else partials.sum(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(tuning_path("h200", "swiglu_bias_sweep.json")))
    args = parser.parse_args()
    require_cuda()
    kernels = load_kernel_module(KERNELS, False)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, width = 524_288, 1376
    hidden = torch.randn(rows, 2 * width, generator=gen, device="cuda").bfloat16()
    grad = torch.randn(rows, width, generator=gen, device="cuda").bfloat16()
    bias = torch.randn(2 * width, generator=gen, device="cuda")
    want_grad, want_bias = torch.ops.gem_kernels.swiglu_backward(grad, hidden, bias, "reference")
    gigabytes = 5 * rows * width * 2 / 1e9
    results = []

    def record(name, ms, error=None):
        print(f"{name:28s} {ms:6.3f} ms  {gigabytes / ms:4.2f} TB/s  err {error}", flush=True)
        results.append(dict(case=f"T{rows}xH{width}", provider=name, mode="bwd", metric="ms",
                            value=ms))  # fmt: skip

    plain = median_ms(
        lambda: backward(kernels, hidden, None, grad, 8, 512, 8, 4), warmup=25, rep=200
    )
    summed = median_ms(
        lambda: backward(kernels, hidden, None, grad, 8, 512, 8, 4)[0].sum(0, dtype=torch.float32),
        warmup=25,
        rep=200,
    )
    record("no_bias", plain)
    record("no_bias+column_sum", summed)
    for variant in VARIANTS:
        got, got_bias = backward(kernels, hidden, bias, grad, *variant)
        error = float((got_bias - want_bias).abs().max() / want_bias.abs().max())
        assert torch.equal(got, want_grad) or (got.float() - want_grad.float()).abs().max() < 0.1
        ms = median_ms(
            lambda v=variant: backward(kernels, hidden, bias, grad, *v), warmup=25, rep=200
        )
        record("bias_r{}_c{}_rows{}_w{}".format(*variant), ms, f"{error:.1e}")
    device = torch.cuda.get_device_name()
    write_results(args.out, meta("swiglu_bias_sweep", command_line(
        "benchmarks/tune/swiglu_bias_sweep.py"), device), results)  # fmt: skip


if __name__ == "__main__":
    main()
