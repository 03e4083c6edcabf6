"""How long ``gem-train`` takes to answer before any training, each in a fresh interpreter.

Cases, wall seconds (median of ``--repeats``):

- ``help``: ``python -m gem_train.cli --help``;
- ``print_config``: ``python -m gem_train.cli --recipe h200 --print-config``;
- ``eager_imports``: ``import`` of the modules the CLI imported at its top until 97cb85b
  (trainer, parallelism, checkpoints, profiling, report): what every answer cost then;
- ``torch``: ``import torch`` alone, the floor of anything that imports it.

Usage (from the workspace root):
    uv run --extra cpu python benchmarks/bench_cli_startup.py   # -> benchmarks/results/cpu/cli_startup.json
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time

from harness import command_line, meta, results_parser, write_results

CASES = {
    "help": ["-m", "gem_train.cli", "--help"],
    "print_config": ["-m", "gem_train.cli", "--recipe", "h200", "--print-config"],
    "eager_imports": [
        "-c",
        "import gem_train.trainer, gem_train.parallel, gem_train.checkpoint, "
        "gem_train.profiling, gem_train.report",
    ],
    "torch": ["-c", "import torch"],
}


def seconds(args: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, *args], check=True, capture_output=True)
    return time.perf_counter() - started


def main() -> None:
    parser = results_parser(__doc__, "cpu/cli_startup.json")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    rows = []
    for case, argv in CASES.items():
        seconds(argv)  # warm the file cache
        median = statistics.median(seconds(argv) for _ in range(args.repeats))
        print(f"{case:14s} {median:6.2f} s")
        rows.append(
            {
                "case": case,
                "provider": "gem-train",
                "mode": "startup",
                "metric": "seconds",
                "value": median,
            }  # fmt: skip
        )
    write_results(
        args.out, meta("cli_startup", command_line("benchmarks/bench_cli_startup.py")), rows
    )


if __name__ == "__main__":
    main()
