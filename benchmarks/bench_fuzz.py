"""Faults, measured (fuzz and bad data): malformed calls of the public APIs and bad training data.

**Fuzz** (rows ``fuzz/<api>``, metrics ``examples``, ``unexpected``, ``wrong``; both must be
0): the hypothesis suites of the package tests run with ``--scale`` times their example
budget, drawing fresh examples from ``--seed`` (the tests' own short runs are derandomized):

================================================  =============================================
``packages/gem-kernels/tests/test_kernels_fuzz``  ``jagged_flash_attention``, ``gdpa``,
                                                  ``block_attention`` (reference backend), and
                                                  ``.../triton`` (Triton under the interpreter)
``packages/gem-precision/tests/test_precision_fuzz``  ``Fp8Linear``, ``quantize_mx`` (and
                                                  ``quantize_mx/triton``)
``packages/gem-data/tests/test_data_fuzz``        ``ParquetBatchLoader``, ``ShardedBatchLoader``
                                                  (constructor arguments), ``bad_rows`` (random
                                                  bad cells, ``on_bad_row`` error and skip)
``packages/gem-train/tests/test_config_fuzz``     ``apply_overrides``
================================================  =============================================

An example counts as ``unexpected`` when the call raised anything but a ``ValueError`` /
``TypeError`` naming an argument the example broke (or hung), and as ``wrong`` when an invalid
call was accepted or a result differs from the oracle (see ``tests/support/fuzz_tally.py``).

**Bad data** (rows ``data/<case>``): the cases of ``packages/gem-data/tests/data_faults.py``
(NaN / Inf dense features, ids outside the tables of dataset.json, an empty or zero-byte
shard, a shard whose schema, row groups or rows change on disk in the middle of a run or
between epochs): metric ``named_error`` (1: ``DatasetFormatError`` naming the file, and the
row group where there is one); the ``*_skip`` cases (``on_bad_row="skip"``) metric ``skipped``
(1: exactly the bad rows left out and counted) and ``skipped_rows``; ``data/nan_dense_training``
is a ``gem-train`` run on a dataset with NaN features (1: it stopped with the named error
before any step, never a NaN loss).

Rows go into ``benchmarks/results/cpu/faults.json``, replacing only the ``fuzz/`` and
``data/`` rows (``benchmarks/bench_faults.py`` writes the ``kill/`` and ``checkpoint/`` ones).

    uv run --extra cpu python benchmarks/bench_fuzz.py            # --scale 20 --seed 0
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import ROOT, meta, results_parser, user_args, write_results

SUITES = {
    "gem-kernels": "packages/gem-kernels/tests/test_kernels_fuzz.py",
    "gem-precision": "packages/gem-precision/tests/test_precision_fuzz.py",
    "gem-data": "packages/gem-data/tests/test_data_fuzz.py",
    "gem-train": "packages/gem-train/tests/test_config_fuzz.py",
}


def run_suite(package: str, path: str, scale: float, seed: int, report: Path) -> dict:
    """One fuzz suite under pytest; returns its exit code and seconds."""
    env = dict(os.environ, GEM_FUZZ_SCALE=str(scale), GEM_FUZZ_SEED=str(seed))
    env["GEM_FUZZ_REPORT_DIR"] = str(report)
    env.pop("TRITON_INTERPRET", None)  # the Triton tests set it themselves
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", path,
               f"--hypothesis-seed={seed}"]  # fmt: skip
    started = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    print(f"{package}: pytest exit {done.returncode} in {seconds:.0f} s", flush=True)
    if done.returncode not in (0, 1):
        print(done.stdout[-3000:], done.stderr[-3000:], sep="\n")
    return {"exit": done.returncode, "seconds": seconds}


def fuzz_rows(report: Path, suites: dict, scale: float, seed: int) -> list[dict]:
    rows = []
    for path in sorted(report.glob("*.json")):
        counts = json.loads(path.read_text())
        api = counts["api"]
        mode = f"hypothesis, {scale:g}x the test budget, seed {seed}"
        for failure in counts.get("failures", [])[:3]:
            print(f"  {api}: {failure}")
        for metric in ("examples", "unexpected", "wrong"):
            rows.append({"case": f"fuzz/{api}", "provider": suites.get(api, "pytest"),
                         "mode": mode, "metric": metric, "value": counts[metric]})  # fmt: skip
    return rows


def _api_suites() -> dict:
    names = {
        "jagged_flash_attention": "gem-kernels", "gdpa": "gem-kernels",
        "block_attention": "gem-kernels", "Fp8Linear": "gem-precision",
        "quantize_mx": "gem-precision", "ParquetBatchLoader": "gem-data",
        "ShardedBatchLoader": "gem-data", "bad_rows": "gem-data", "apply_overrides": "gem-train",
    }  # fmt: skip
    out = {}
    for api, package in names.items():
        out[api] = out[f"{api}/triton"] = SUITES[package]
    return out


def data_rows() -> list[dict]:
    sys.path.insert(0, str(ROOT / "packages" / "gem-data" / "tests"))
    from data_faults import CASES, run_case

    rows = []
    for name in CASES:
        with tempfile.TemporaryDirectory() as scratch:
            result = run_case(name, Path(scratch) / "dataset")
        skip = "skip" in name
        metrics = ("skipped", "skipped_rows") if skip else ("named_error",)
        mode = "on_bad_row='skip'" if skip else "on_bad_row='error' (default)"
        print(
            f"data/{name}: {', '.join(f'{m}={result[m]}' for m in metrics)}  {result['detail'][:160]}"
        )
        for metric in metrics:
            rows.append({"case": f"data/{name}", "provider": "gem_data loaders", "mode": mode,
                         "metric": metric, "value": result[metric]})  # fmt: skip
    return rows


def training_row() -> dict:
    """gem-train on NaN features: the test passes when the run stops with the named error."""
    test = "packages/gem-train/tests/test_bad_data_training.py"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test, "-k", "nan"],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    named = int(done.returncode == 0)
    print(f"data/nan_dense_training: named_error={named}")
    return {"case": "data/nan_dense_training", "provider": "gem-train Trainer.fit",
            "mode": "NaN dense feature in every train shard, on_bad_row='error'",
            "metric": "named_error", "value": named}  # fmt: skip


def merge_rows(path: Path, rows: list[dict], meta_block: dict) -> None:
    """Replaces this script's rows (case fuzz/... and data/...) in ``path``, keeping the
    other rows and meta entries (bench_faults.py adds kill/ and checkpoint/ rows)."""
    old: dict = {"meta": {}, "rows": []}
    if path.exists():
        old = json.loads(path.read_text())
    kept = [r for r in old["rows"] if not r["case"].startswith(("fuzz/", "data/"))]
    merged = {**old["meta"], **meta_block}
    for key, value in meta_block["fuzz"].items():  # a new file: this run's meta at the top
        merged.setdefault(key, value)
    write_results(path, merged, kept + rows)


def main() -> None:
    parser = results_parser(__doc__, "cpu/faults.json")
    parser.add_argument("--scale", type=float, default=20.0, help="x the tests' example budget")
    parser.add_argument("--seed", type=int, default=0, help="hypothesis seed of the examples")
    parser.add_argument("--suites", default=",".join(SUITES), help="packages to fuzz")
    parser.add_argument("--no-data", action="store_true", help="skip the bad-data cases")
    args = parser.parse_args()
    started = time.perf_counter()
    rows, runs = [], {}
    with tempfile.TemporaryDirectory() as report:
        for package in args.suites.split(","):
            runs[package] = run_suite(package, SUITES[package], args.scale, args.seed, Path(report))
        rows += fuzz_rows(Path(report), _api_suites(), args.scale, args.seed)
    if not args.no_data:
        rows += data_rows()
        rows.append(training_row())
    seconds = time.perf_counter() - started
    bad = [r for r in rows if r["metric"] in ("unexpected", "wrong") and r["value"]]
    bad += [r for r in rows if r["metric"] in ("named_error", "skipped") and r["value"] != 1]
    command = "python benchmarks/bench_fuzz.py " + " ".join(user_args())
    block = {"fuzz": meta("bench_fuzz", command.strip(), seconds=round(seconds),
                          suites={k: round(v["seconds"]) for k, v in runs.items()})}  # fmt: skip
    merge_rows(Path(args.out), rows, block)
    print(f"{len(rows)} rows -> {args.out} in {seconds:.0f} s; {len(bad)} failing")
    for row in bad:
        print("  FAIL", row)


if __name__ == "__main__":
    main()
