"""Exploration: forward tiles and launch of the FP8 JFA and GDPA kernels (``precision="fp8"``;
the backward runs in bf16), timed against the FP8 defaults and the bf16 kernels.

FP8 mode took the bf16 call's configuration: JFA its tiles (64x32 in 4 warps below 1025
visible keys), GDPA its launch (for keys <= 1024 that of the warp-specialised 128x128 loop: one
program per SM) around the phased 128x64 loop. The sweep at 0cf030f
(``results/h200/tuning/fp8_attention_tiles_0cf030f.json``) set the FP8 defaults that replace
them (``jfa_triton._FP8_MIN_FWD_BLOCK_N``, ``gdpa_triton._FP8_FWD_PROGRAMS_PER_SM``); the
variants are changes to the bf16 configuration, the ``gem-fp8`` row is the FP8 default. Each
variant is checked against the FP8 default (same quantisation of q, k and v; P's rounding
follows the key tiles' running maximum, so tilings differ by a fraction of the FP8 error).

    PYTHONPATH=packages/gem-kernels/src:benchmarks python benchmarks/tune/fp8_attention_tiles.py \
        --out benchmarks/results/<machine>/tuning/fp8_attention_tiles_<commit>.json
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness, the benches

import bench_gdpa  # noqa: E402
import bench_jagged_attention as bench_jfa  # noqa: E402
import torch  # noqa: E402
from gem_kernels import gdpa_triton, jfa_triton  # noqa: E402
from harness import Run, require_cuda  # noqa: E402

#: JFA FP8 forward variants: (name, changes to the call's default configuration). Below 1025
#: visible keys (the GEM model's lengths, a window of 256) the FP8 forward inherits the bf16
#: short tiles, 64x32 in 4 warps: 32-key FP8 MMAs.
JFA_VARIANTS = {
    "64x64w4": dict(fwd_block_m=64, fwd_block_n=64, fwd_warps=4),
    "128x64w8": dict(fwd_block_m=128, fwd_block_n=64, fwd_warps=8),
    "128x128w8": dict(fwd_block_m=128, fwd_block_n=128, fwd_warps=8),
    "64x128w4": dict(fwd_block_m=64, fwd_block_n=128, fwd_warps=4),
    "128x64w4": dict(fwd_block_m=128, fwd_block_n=64, fwd_warps=4),
}
#: GDPA FP8 forward launch variants (the backward runs in bf16). At keys <= 1024 the FP8
#: forward inherits d128_short's launch (1 program per SM, 2 stages: the warp-specialised
#: 128x128 loop's) for its phased 128x64 loop; d128_long's is 2 programs, 4 stages.
GDPA_VARIANTS = {
    "s4p2": dict(fwd_stages=4, fwd_programs_per_sm=2),
    "s3p2": dict(fwd_stages=3, fwd_programs_per_sm=2),
    "s2p2": dict(fwd_stages=2, fwd_programs_per_sm=2),
    "s4p1": dict(fwd_stages=4, fwd_programs_per_sm=1),
    "s3p1w8": dict(fwd_stages=3, fwd_programs_per_sm=1, fwd_warps=8),
    "m64s4p3": dict(fwd_block_m=64, fwd_stages=4, fwd_programs_per_sm=3),
}
#: (batch, max_len, causal, left window)
JFA_CASES = [(32, 16384, True, 256), (512, 1024, True, 256), (512, 1024, False, None)]
GDPA_CASES = [("self", 512, 1024), ("self", 128, 4096)]


def _providers(bench, base, variants: dict) -> dict:
    """bf16 and FP8 at the call's default configuration, then FP8 at each variant of it."""
    providers = {
        "gem": bench.provider_gem,
        "gem-fp8": lambda c: bench.provider_gem(c, precision="fp8"),
    }
    for name, changes in variants.items():
        config = dataclasses.replace(base, **changes)
        providers[f"gem-fp8-{name}"] = lambda c, cfg=config: bench.provider_gem(
            c, config=cfg, precision="fp8"
        )
    return providers


def _measure(run: Run, case, providers: dict, flops, modes=("fwd", "fwd_bwd")) -> None:
    run.measure(case, providers, flops=flops, reference=providers["gem-fp8"], rounds=2, modes=modes)
    run.write()
    torch.cuda.empty_cache()


def _jfa(run: Run, device) -> None:
    for batch, max_len, causal, window in JFA_CASES:
        case = bench_jfa.Case(batch, max_len, causal, window, device)
        visible = max_len if window is None else min(max_len, window + 1)
        base = jfa_triton.default_config(bench_jfa.D, max_len=visible, masked=causal)
        providers = _providers(bench_jfa, base, JFA_VARIANTS)
        _measure(run, case, providers, {"fwd": case.flops["fwd"]}, modes=("fwd",))


def _gdpa(run: Run, device) -> None:
    for kind, batch, max_len in GDPA_CASES:
        case = bench_gdpa.Case(kind, batch, max_len, device)
        base = gdpa_triton.default_config(bench_gdpa.D, max_len=max_len)
        flops = {"fwd": case.fwd_flops}
        _measure(run, case, _providers(bench_gdpa, base, GDPA_VARIANTS), flops, modes=("fwd",))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--kernels", default="jfa,gdpa", help="comma list of jfa, gdpa")
    args = parser.parse_args()
    require_cuda()
    device = torch.device("cuda")
    run = Run("fp8_attention_tiles", args.out, script="benchmarks/tune/fp8_attention_tiles.py",
              timing={"warmup": 10.0, "rep": 40.0})  # fmt: skip
    if "jfa" in args.kernels:
        _jfa(run, device)
    if "gdpa" in args.kernels:
        _gdpa(run, device)
    run.write()
    run.table(title="FP8 attention tiles")


if __name__ == "__main__":
    main()
