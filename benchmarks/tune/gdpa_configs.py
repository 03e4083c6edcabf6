"""Tuning: time GDPA configurations against the shipped default on the protocol shapes.

Exploration, not a benchmark: it writes under ``benchmarks/results/<machine>/tuning/``. Each
variant is a ``GDPA_CONFIGS`` entry (``--base``) with field overrides, named on the command
line, checked against the fp32 reference (``bench_gdpa.check``) before it is timed; the row of
a variant that fails its check says so and is not timed.

    PYTHONPATH=benchmarks:packages/gem-kernels/src python benchmarks/tune/gdpa_configs.py \\
        --base d128_long --variant stages3:fwd_stages=3 \\
        --variant one_loop:fwd_loop=one_loop,fwd_programs_per_sm=1 --shapes self/128x4096

The ``default`` variant (the public entry point, whatever ``default_config`` picks per call)
is always timed in the same run. What was measured and why the defaults are what they are:
``packages/gem-kernels/docs/kernel-tuning.md``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_gdpa as bench  # noqa: E402
from harness import Run, config_variant, require_cuda, tuning_path  # noqa: E402

gt = bench.gt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", default="d128_long", choices=sorted(gt.GDPA_CONFIGS))
    parser.add_argument("--variant", action="append", default=[], help="NAME:FIELD=VALUE,...")
    parser.add_argument(
        "--shapes", default="self/128x4096", help="comma-separated KIND/BxL (self, cross, pma)"
    )
    parser.add_argument("--modes", default="fwd,fwd_bwd")
    parser.add_argument("--machine", default="h200")
    parser.add_argument("--out", default="", help="default: <machine>/tuning/gdpa_configs.json")
    args = parser.parse_args()
    base = gt.GDPA_CONFIGS[args.base].config
    try:
        variants = dict(config_variant(text, base) for text in args.variant)
    except ValueError as error:
        parser.error(str(error))
    require_cuda()
    device = torch.device("cuda")
    out = args.out or tuning_path(args.machine, "gdpa_configs.json")
    run = Run("gdpa_configs", out, script="benchmarks/tune/gdpa_configs.py",
              timing={"warmup": 10.0, "rep": 40.0},
              extra={"base": args.base, "variants": {n: str(c) for n, c in variants.items()}})  # fmt: skip
    providers = {"default": bench.provider_gem}
    for name, config in variants.items():
        errors = bench.check(device, config)
        run.checks[name] = errors
        worst = [max(e.values()) for e in errors.values() if isinstance(e, dict)]
        if len(worst) < len(errors) or max(worst, default=0.0) > 2e-2:
            run.error(f"{name}: failed its check, not timed: {errors}")
            continue
        providers[name] = lambda case, c=config: bench.provider_gem(case, c)
    for shape in args.shapes.split(","):
        kind, _, size = shape.partition("/")
        batch, max_len = (int(x) for x in size.split("x"))
        case = bench.Case(kind, batch, max_len, device)
        run.measure(case, providers, flops=bench.flops_of(case), modes=args.modes.split(","))
        del case
        torch.cuda.empty_cache()
    run.write()
    run.table()


if __name__ == "__main__":
    main()
