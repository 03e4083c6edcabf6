"""Exploration: SwiGLU's gate at the training shapes, Inductor against ``gem_kernels.swiglu``.

The d_model 512 profile (``results/h200/tuning/train_d512_profile.json``) has Inductor's SwiGLU
backward (``triton_poi_fused_cat_mul_silu_silu_backward_split``) at 3.1 ms per layer on a
(524k, 2752) hidden: it writes the concatenated gradient element by element, so each half loads
the gate and the output gradient again. This script times, on the same bf16 inputs:

- ``inductor``: ``silu(gate) * value`` of ``hidden.chunk(2, -1)`` under ``torch.compile``
  (row count dynamic, as the model compiles it), the model's code before ``gem_kernels.swiglu``;
- ``gem``: ``gem_kernels.swiglu`` (one Triton kernel each way).

Each case reports the forward and forward+backward time and the bandwidth of its minimal
traffic (forward: hidden read, output written; backward: hidden and the output gradient read,
hidden's gradient written), and the largest difference of the two providers' results.

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


def unfused(hidden: torch.Tensor) -> torch.Tensor:
    gate, value = hidden.chunk(2, dim=-1)
    return F.silu(gate) * value


def measure(rows: int, width: int, providers: dict) -> list[dict]:
    """The rows of one (rows, H) case: ms and TB/s per provider and mode, and the difference."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(rows, 2 * width, generator=gen, device="cuda").bfloat16()
    grad = torch.randn(rows, width, generator=gen, device="cuda").bfloat16()
    leaf = hidden.detach().requires_grad_(True)
    case = f"T{rows}xH{width}"
    gigabytes = {"fwd": 3 * rows * width * 2 / 1e9, "bwd": 5 * rows * width * 2 / 1e9}
    out_rows, results = [], {}
    for name, fn in providers.items():
        out = fn(leaf)
        results[name] = (out, torch.autograd.grad(out, leaf, grad)[0])
        with torch.no_grad():
            fwd = median_ms(lambda fn=fn: fn(hidden), warmup=25, rep=200)
        fwd_bwd = median_ms(
            lambda fn=fn: torch.autograd.grad(fn(leaf), leaf, grad), warmup=25, rep=200
        )
        bwd = fwd_bwd - fwd
        for mode, ms in (("fwd", fwd), ("fwd_bwd", fwd_bwd), ("bwd", bwd)):
            out_rows.append(dict(case=case, provider=name, mode=mode, metric="ms", value=ms))
        for mode, ms in (("fwd", fwd), ("bwd", bwd)):
            out_rows.append(dict(case=case, provider=name, mode=mode, metric="tb_per_s",
                                 value=gigabytes[mode] / ms))  # fmt: skip
        print(f"{case:16s} {name:9s} fwd {fwd:6.3f} ms ({gigabytes['fwd'] / fwd:4.2f} TB/s)  "
              f"bwd {bwd:6.3f} ms ({gigabytes['bwd'] / bwd:4.2f} TB/s)", flush=True)  # fmt: skip
    for part, index in (("out", 0), ("grad", 1)):
        diff = (results["gem"][index].float() - results["inductor"][index].float()).abs().max()
        out_rows.append(dict(case=case, provider="gem", mode=part,
                             metric="max_abs_diff_vs_inductor", value=float(diff)))  # fmt: skip
    return out_rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(tuning_path("h200", "swiglu.json")))
    args = parser.parse_args()
    require_cuda()
    providers = {"inductor": torch.compile(unfused, dynamic=True), "gem": swiglu}
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
