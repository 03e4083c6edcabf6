"""Exploration: SwiGLU's gate at the training shapes, Inductor against ``gem_kernels.swiglu``.

The d_model 512 profile (``results/h200/tuning/train_d512_profile.json``) has Inductor's SwiGLU
backward (``triton_poi_fused_cat_mul_silu_silu_backward_split``) at 3.1 ms per layer on a
(524k, 2752) hidden: it writes the concatenated gradient element by element, so each half loads
the gate and the output gradient again. This script times, on the same bf16 inputs:

- ``inductor``: ``silu(gate) * value`` of ``(hidden + bias).chunk(2, -1)`` under
  ``torch.compile`` (row count dynamic, as the model compiles it), the baseline's code;
- ``gem``: ``gem_kernels.swiglu(hidden, bias)`` (one Triton kernel each way; the backward
  sums the bias gradient too);
- ``gem-sum``: ``gem_kernels.swiglu(hidden)`` with the bias gradient as a separate column sum
  of hidden's gradient: the cost of the bias in the up projection's GEMM, the model's form
  before the bias moved into ``swiglu``.

Each case reports the forward and forward+backward time and the bandwidth of its minimal
traffic (forward: hidden read, output written; backward: hidden and the output gradient read,
hidden's gradient written), and the largest difference of gem's results from Inductor's.

    python benchmarks/tune/swiglu.py   # writes benchmarks/results/h200/tuning/swiglu.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness

import torch  # noqa: E402
from gem_kernels import swiglu  # noqa: E402
from harness import (  # noqa: E402
    command_line,
    median_ms,
    meta,
    require_cuda,
    tuning_path,
    write_results,
)
from torch.nn import functional as F  # noqa: E402

#: (rows, H): the h200 recipe's tokens at d_model 512 (H 1376) and the FP8 shape's (H 2736).
CASES = [(524_288, 1376), (524_288, 2736)]


def unfused(hidden: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    gate, value = (hidden + bias).chunk(2, dim=-1)
    return F.silu(gate) * value


def measure(rows: int, width: int, providers: dict) -> list[dict]:
    """The rows of one (rows, H) case: ms and TB/s per provider and mode, and the difference.
    Every provider computes the gradients of hidden and of the bias; ``gem-sum`` is the
    form before the bias moved into ``swiglu``: the kernel without a bias, and the bias
    gradient as its own column sum of hidden's gradient (what the GEMM's bias costs)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(rows, 2 * width, generator=gen, device="cuda").bfloat16()
    bias = torch.randn(2 * width, generator=gen, device="cuda")
    grad = torch.randn(rows, width, generator=gen, device="cuda").bfloat16()
    leaves = hidden.detach().requires_grad_(True), bias.detach().requires_grad_(True)
    case = f"T{rows}xH{width}"
    gigabytes = {"fwd": 3 * rows * width * 2 / 1e9, "bwd": 5 * rows * width * 2 / 1e9}
    out_rows, results = [], {}

    def fwd_bwd(fn):
        return torch.autograd.grad(fn(*leaves), leaves, grad)

    for name, fn in providers.items():
        results[name] = (fn(*leaves), *fwd_bwd(fn))
        with torch.no_grad():
            fwd = median_ms(lambda fn=fn: fn(hidden, bias), warmup=25, rep=200)
        total = median_ms(lambda fn=fn: fwd_bwd(fn), warmup=25, rep=200)
        bwd = total - fwd
        for mode, ms in (("fwd", fwd), ("fwd_bwd", total), ("bwd", bwd)):
            out_rows.append(dict(case=case, provider=name, mode=mode, metric="ms", value=ms))
        for mode, ms in (("fwd", fwd), ("bwd", bwd)):
            out_rows.append(dict(case=case, provider=name, mode=mode, metric="tb_per_s",
                                 value=gigabytes[mode] / ms))  # fmt: skip
        print(f"{case:16s} {name:9s} fwd {fwd:6.3f} ms ({gigabytes['fwd'] / fwd:4.2f} TB/s)  "
              f"bwd {bwd:6.3f} ms ({gigabytes['bwd'] / bwd:4.2f} TB/s)", flush=True)  # fmt: skip
    for part, index in (("out", 0), ("grad", 1), ("bias_grad", 2)):
        diff = (results["gem"][index].float() - results["inductor"][index].float()).abs().max()
        out_rows.append(dict(case=case, provider="gem", mode=part,
                             metric="max_abs_diff_vs_inductor", value=float(diff)))  # fmt: skip
    return out_rows


class _BiasSum(torch.autograd.Function):
    """Adds nothing in the forward; the backward returns the bias gradient as the column sum
    of hidden's gradient, as an ``nn.Linear`` bias's backward does."""

    @staticmethod
    def forward(ctx, hidden, bias):
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad):
        return grad, grad.sum(0, dtype=torch.float32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(tuning_path("h200", "swiglu.json")))
    args = parser.parse_args()
    require_cuda()
    providers = {
        "inductor": torch.compile(unfused, dynamic=True),
        "gem": swiglu,
        "gem-sum": lambda hidden, bias: swiglu(_BiasSum.apply(hidden, bias)),
    }
    rows = []
    for case in CASES:
        rows += measure(*case, providers)
        torch.cuda.empty_cache()
    device = torch.cuda.get_device_name()
    write_results(args.out, meta("swiglu", command_line("benchmarks/tune/swiglu.py"), device),
                  rows)  # fmt: skip
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
