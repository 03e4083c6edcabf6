"""Exploration: one forward launch of JFA per precision, for Nsight Compute's stall reasons.

Runs the bf16 and the FP8 forward (``precision="fp8"``) of ``bench_jagged_attention``'s case
twice each (the first call compiles); profile the second launch of each under ncu:

    ncu --clock-control none -k regex:jfa_fwd_kernel --launch-skip 1 --launch-count 1 \
        --section WarpStateStats ... python benchmarks/tune/ncu_jfa.py --precision fp8
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/

import bench_jagged_attention as bench_jfa  # noqa: E402
import torch  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--precision", default="fp8", choices=("bf16", "fp8"))
    parser.add_argument("--shape", default="32x16384", help="BxL")
    parser.add_argument("--causal", action="store_true")
    args = parser.parse_args()
    batch, length = (int(x) for x in args.shape.split("x"))
    case = bench_jfa.Case(batch, length, args.causal, None, torch.device("cuda"))
    timed = bench_jfa.provider_gem(case, precision=args.precision)
    for _ in range(2):
        timed.fwd()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
