"""GEM v0 against v1 and its ablations on the tiny task: eval NE per task and seed, mean, sem.

Each (variant, seed) is one ``gem-train --recipe tiny`` run (the recipe's data, schedule and
budget; ``seed`` sets the parameter init and the data order, the dataset stays the same) in a
process of its own, ``--jobs`` at a time. Variants are ``--set`` overrides of the recipe's
architecture, so every row can be rerun by hand:

    python benchmarks/bench_model_ablation.py --seeds 0,1,2 --jobs 3
    uv run --extra cpu gem-train --recipe tiny --set compare_no_sequence=false --set seed=1 \\
        --set model.history_cross=false          # the v1-no-gem-cross row of seed 1

Runs that do not fit one sitting go by ``--variants`` subsets into separate files, joined by
``--merge a.json b.json --out model_ablation.json``.

Rows: case ``<task>/seed<N>``, provider the variant, metric ``ne``; per variant and task the
case ``<task>`` with ``ne_mean`` and ``ne_sem`` (standard error of the mean over seeds).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from harness import ROOT, meta, results_parser, user_args, write_results

V0 = {
    "model.attention_window": "0",
    "model.position": "none",
    "model.ffn": "gelu",
    "model.history_cross": "false",
    "model.target_attention": "true",
    "model.dhen_experts": "attention,mlp,cross",
}
V1 = {
    "model.attention_window": "32",
    "model.position": "rope",
    "model.ffn": "swiglu",
    "model.history_cross": "true",
    "model.target_attention": "true",
    "model.dhen_experts": "attention,mlp,cross,dot",
}
VARIANTS = {
    "v0": V0,
    "v1": V1,
    "v1-no-window": {**V1, "model.attention_window": "0"},
    "v1-no-gem-cross": {**V1, "model.history_cross": "false"},
    "v1-no-target": {**V1, "model.target_attention": "false"},
    "v1-rel-pos": {**V1, "model.position": "rel_pos_bias"},
    "v1-no-position": {**V1, "model.position": "none"},
}
TASKS = ("ctr", "cvr")


def _run(variant: str, seed: int, args, env: dict[str, str]) -> dict:
    out = Path(args.work_dir) / f"{variant}_seed{seed}"
    overrides = {
        **VARIANTS[variant],
        "seed": str(seed),
        "compare_no_sequence": "false",
        "checkpoint_every": "0",
        "output_dir": str(out),
        "data.directory": args.data_dir,
        "device": args.device,
    }
    command = [sys.executable, "-m", "gem_train.cli", "--recipe", "tiny"]
    for key, value in overrides.items():
        command += ["--set", f"{key}={value}"]
    started = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{variant} seed {seed} failed:\n{done.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    print(f"{variant} seed {seed}: {time.perf_counter() - started:.0f} s", flush=True)
    return summary


def main() -> None:
    parser = results_parser(__doc__, "cpu/model_ablation.json")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated training seeds")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--jobs", type=int, default=1, help="runs at once")
    parser.add_argument("--threads", type=int, default=2, help="torch threads per run")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--data-dir", default=str(ROOT / "data" / "tiny"))
    parser.add_argument("--work-dir", default=str(ROOT / "runs" / "model_ablation"))
    parser.add_argument("--merge", nargs="+", help="join result files of disjoint variants")
    args = parser.parse_args()
    if args.merge:
        parts = [json.loads(Path(path).read_text()) for path in args.merge]
        merged = {**parts[0]["meta"], "merged_from": [part["meta"] for part in parts]}
        merged["variants"] = {k: v for part in parts for k, v in part["meta"]["variants"].items()}
        write_results(Path(args.out), merged, [row for part in parts for row in part["rows"]])
        return
    seeds = [int(s) for s in args.seeds.split(",")]
    variants = args.variants.split(",")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"--variants: unknown {unknown}; known: {sorted(VARIANTS)}")

    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    # Generate the shared dataset once, before the runs race to write it.
    subprocess.run(
        [
            sys.executable,
            "-c",
            "from gem_train.cli import prepare_data; from gem_train import "
            "apply_overrides, tiny; prepare_data(apply_overrides(tiny(), "
            f"['data.directory={args.data_dir}']).data, progress=False)",
        ],
        env=env,
        check=True,
    )
    jobs = [(v, s) for v in variants for s in seeds]
    with ThreadPoolExecutor(args.jobs) as pool:
        summaries = list(pool.map(lambda job: _run(*job, args, env), jobs))

    rows, oracle = [], None
    values: dict[tuple[str, str], list[float]] = {}
    for (variant, seed), summary in zip(jobs, summaries, strict=True):
        oracle = summary["oracle_ne"]
        result = summary["results"]["gem"]
        for task in TASKS:
            ne = result[f"ne_{task}"]
            values.setdefault((variant, task), []).append(ne)
            rows.append(
                {"case": f"{task}/seed{seed}", "provider": variant, "metric": "ne", "value": ne}
            )
    for (variant, task), nes in values.items():
        mean = sum(nes) / len(nes)
        sem = (
            math.sqrt(sum((x - mean) ** 2 for x in nes) / (len(nes) - 1) / len(nes))
            if len(nes) > 1
            else math.nan
        )
        rows.append({"case": task, "provider": variant, "metric": "ne_mean", "value": mean})
        rows.append({"case": task, "provider": variant, "metric": "ne_sem", "value": sem})
        print(f"{variant:16s} {task}: NE {mean:.4f} +- {sem:.4f} (n={len(nes)})")
    command = "python benchmarks/bench_model_ablation.py " + " ".join(user_args())
    write_results(
        Path(args.out),
        meta(
            "model_ablation",
            command,
            variants={v: VARIANTS[v] for v in variants},
            oracle_ne=oracle,
            recipe="tiny",
        ),
        rows,
    )


if __name__ == "__main__":
    main()
