"""Exploration: does the order in which providers are timed bias the result?

The same kernels, timed in a row.

After 3 s idle, times gem (public entry point), flash varlen, gem, gem with an explicit long-tile
config, flash varlen and gem again, forward and forward+backward, on B32xL16384 non-causal and
B128xL4096 causal, and reads the SM clock (``nvidia-smi``) before and after each sequence. This
is why ``bench_jagged_attention.py`` times providers in rounds with alternating order.

    PYTHONPATH=packages/gem-kernels/src:benchmarks python benchmarks/tune/timing_drift.py
    # writes benchmarks/results/h200/tuning/jagged_attention_timing_drift.json
"""

import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness, the bench

import torch  # noqa: E402
from bench_jagged_attention import Case, provider_flash_varlen, provider_gem  # noqa: E402
from gem_kernels.jfa_triton import default_config  # noqa: E402
from harness import (  # noqa: E402
    command_line,
    median_ms,
    meta,
    require_cuda,
    results_parser,
    write_results,
)

TIMING = {"warmup": 10, "rep": 40}


def _clocks() -> str:
    query = "--query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu"
    return subprocess.run(
        ["nvidia-smi", query, "--format=csv,noheader"], capture_output=True, text=True
    ).stdout.strip()


def main() -> None:
    parser = results_parser(__doc__, "h200/tuning/jagged_attention_timing_drift.json")
    args = parser.parse_args()
    require_cuda()
    device = torch.device("cuda")
    rows, clocks = [], {}
    for batch, max_len, causal in [(32, 16384, False), (128, 4096, True)]:
        case = Case(batch, max_len, causal, None, device)
        long_tiles = default_config(128)
        sequence = [
            ("gem", lambda c=case: provider_gem(c)),
            ("flash_varlen", lambda c=case: provider_flash_varlen(c)),
            ("gem", lambda c=case: provider_gem(c)),
            ("gem-long", lambda c=case, t=long_tiles: provider_gem(c, config=t)),
            ("flash_varlen", lambda c=case: provider_flash_varlen(c)),
            ("gem", lambda c=case: provider_gem(c)),
        ]
        for mode in ("fwd", "fwd_bwd"):
            torch.cuda.synchronize()
            time.sleep(3)
            before = _clocks()
            for position, (provider, make) in enumerate(sequence):
                timed = make()
                fn = timed.fwd if mode == "fwd" else timed.fwd_bwd
                leaves = timed.leaves if mode == "fwd_bwd" else None
                ms = median_ms(fn, grad_to_none=leaves, **TIMING)
                rows.append({"case": case.name, "provider": provider, "mode": mode,
                             "metric": "tflops", "value": round(case.flops[mode] / ms / 1e9, 1),
                             "position": position})  # fmt: skip
            clocks[f"{case.name}/{mode}"] = {"before": before, "after": _clocks()}
            print(case.name, mode, [r["value"] for r in rows[-len(sequence) :]], clocks)
    block = meta(
        "jagged_attention_timing_drift",
        command_line("benchmarks/tune/timing_drift.py"),
        device=torch.cuda.get_device_name(),
        clocks=clocks,
    )
    write_results(Path(args.out), block, rows)


if __name__ == "__main__":
    main()
