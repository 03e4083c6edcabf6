"""Exploration (issue 29): in which precision should FP8 JFA's backward run?

FP8 JFA's backward recomputes the scores from E4M3 q and k and runs dV = P^T dO in FP8; on the
H200 its forward+backward is 0.67-0.79x bf16's while its forward alone is 1.01-1.26x. Here the
backward is timed alone, from a saved forward, in three ways:

* ``bf16``: the bf16 forward's out and lse, the bf16 backward kernels (gem's default);
* ``fp8``: the FP8 forward's out and lse, the FP8 backward kernels (``precision="fp8"``);
* ``fp8-bf16bwd``: the FP8 forward's out and lse, the bf16 backward kernels on the bf16 inputs
  (P recomputed in bf16 and normalised by the FP8 forward's lse).

and their gradients' errors against float64 on a smaller shape, as ratios to bf16's error.
Uses the kernels' public split entry points (``forward_from_lengths`` / ``backward_from_lengths``).

    PYTHONPATH=packages/gem-kernels/src:benchmarks python benchmarks/tune/fp8_backward_choice.py \
        --out benchmarks/results/h200/tuning/fp8_backward_choice.json
    # the error check alone, on the CPU (interpreter; small shapes):
    TRITON_INTERPRET=1 ... fp8_backward_choice.py --device cpu --error-shape 4x300 --out ...
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness, the benches

import bench_jagged_attention as bench  # noqa: E402
import torch  # noqa: E402
from gem_kernels.jfa_triton import backward_from_lengths, forward_from_lengths  # noqa: E402
from gem_kernels.reference import jagged_flash_attention_reference  # noqa: E402
from harness import median_ms, meta, rel_error  # noqa: E402

CASES = [(128, 4096, False), (128, 4096, True), (32, 16384, False), (32, 16384, True)]
#: (forward precision, backward precision) per variant.
VARIANTS = {"bf16": ("bf16", "bf16"), "fp8": ("fp8", "fp8"), "fp8-bf16bwd": ("fp8", "bf16")}


def _call(case, fwd: str, bwd: str):
    """(forward, backward) closures of one variant on ``case``'s inputs."""
    options = dict(causal=case.causal)
    lengths = case.lengths

    def forward():
        return forward_from_lengths(
            case.q, case.k, case.v, lengths, precision=fwd, plan_backward=True, **options
        )

    out, lse = forward()

    def backward():
        return backward_from_lengths(
            case.grad, case.q, case.k, case.v, out, lse, lengths, precision=bwd, **options
        )

    return forward, backward


def timings(warmup: float, rep: float) -> list[dict]:
    rows = []
    for batch, max_len, causal in CASES:
        case = bench.Case(batch, max_len, causal, None, "cuda")
        for name, (fwd, bwd) in VARIANTS.items():
            forward, backward = _call(case, fwd, bwd)
            for mode, fn in (("fwd", forward), ("bwd", backward)):
                ms = median_ms(fn, warmup=warmup, rep=rep)
                rows.append(dict(case=case.name, provider=name, mode=mode, metric="ms", value=ms))
                print(f"{case.name:<24} {name:<12} {mode:<4} {ms:8.3f} ms", flush=True)
        del case
        torch.cuda.empty_cache()
    return rows


def errors(batch: int, max_len: int, device: str) -> list[dict]:
    """Relative Frobenius error of out, dq, dk, dv against float64, per variant, and each as a
    ratio to bf16's."""
    rows = []
    for causal in (False, True):
        case = bench.Case(batch, max_len, causal, None, device)
        leaves = [t.double().requires_grad_(True) for t in (case.q, case.k, case.v)]
        want_out = jagged_flash_attention_reference(*leaves, case.offsets_dev, causal=causal)
        want = [want_out, *torch.autograd.grad(want_out, leaves, case.grad.double())]
        got = {}
        for name, (fwd, bwd) in VARIANTS.items():
            forward, backward = _call(case, fwd, bwd)
            out, _ = forward()
            got[name] = [out, *backward()[:3]]
        for name, tensors in got.items():
            for what, g, w, b in zip(
                ("out", "dq", "dk", "dv"), tensors, want, got["bf16"], strict=True
            ):
                err = rel_error(g, w)
                ratio = err / rel_error(b, w)
                for metric, value in (("rel_error", err), ("error_ratio_to_bf16", ratio)):
                    rows.append(dict(case=f"{case.name}/{what}", provider=name, mode="error",
                                     metric=metric, value=value))  # fmt: skip
                print(f"{case.name:<24} {name:<12} {what:<3} {err:.3e} ({ratio:.2f}x bf16)")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--error-shape", default="8x2048", help="BxL of the error check")
    parser.add_argument(
        "--device",
        default="cuda",
        help="cpu: the error check only, on the Triton interpreter (TRITON_INTERPRET=1)",
    )
    args = parser.parse_args()
    batch, max_len = (int(x) for x in args.error_shape.split("x"))
    on_gpu = args.device == "cuda"
    if not on_gpu and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("--device cpu runs the kernels under the interpreter: set TRITON_INTERPRET=1")
    rows = errors(batch, max_len, args.device)
    if on_gpu:
        rows += timings(warmup=25.0, rep=100.0)
    command = "python benchmarks/tune/fp8_backward_choice.py " + " ".join(sys.argv[1:])
    device = {"device": torch.cuda.get_device_name()} if on_gpu else {}
    block = meta(
        "fp8_backward_choice", command, **device, shape={"heads": bench.H, "head_dim": bench.D}
    )
    Path(args.out).write_text(json.dumps({"meta": block, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
