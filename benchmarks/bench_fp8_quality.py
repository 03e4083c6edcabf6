"""Model quality under FP8 GEMMs: eval NE of the GEM model trained with FP8 vs bf16 GEMMs.

Every provider trains the same GEM model (``--recipe``: ``tiny`` by default, ``h200`` for the
GPU recipe's scale) from the same seed on
the same synthetic data in the same order, for the same number of steps, and evaluates NE per
task on the same held-out users. Only the numerics of the dense ``nn.Linear`` GEMMs differ
(``TrainConfig.precision``, applied by gem-train through gem-precision):

* ``bf16``: GEMM operands (forward, dgrad, wgrad) rounded to bfloat16, float32 accumulation and
  float32 master weights (``Bf16GemmLinear``), i.e. a bf16 tensor-core GEMM, emulated;
* ``gem``: gem-train's FP8 policy: ``Fp8Linear`` with the Hopper recipe (E4M3, 1x128
  activations / gradients, 128x128 weights, power-of-two scales; emulated on a CPU with the same
  numerics), the task heads' hidden layers on bf16 GEMMs (``precision.bf16_layers`` default);
* ``gem-all-fp8``: every converted layer in FP8, the heads too;
* ``gem-rht`` / ``gem-sr`` / ``gem-bf16wgrad``: ``gem-all-fp8`` plus one stability option
  (random Hadamard transform along K, stochastic rounding of gradients, bf16 weight-gradient
  GEMM), each measured where there is an NE loss to recover;
* ``gem-all-fp8-emulated``: ``gem-all-fp8`` with ``GEM_PRECISION_GEMM=emulated``: on a GPU the
  same quantised operands (the same Triton kernels), but the GEMMs dequantised and multiplied in
  float32 instead of ``torch._scaled_mm``, which separates the native GEMM's numerics from the
  rest of the GPU path;
* ``bf16-attention`` / ``gem-fp8-attention``: bf16 GEMMs, the attention kernels on bfloat16
  inputs, and in the second every attention module in FP8 (``precision.fp8_attention=*``,
  issue 29; the CPU runs the kernels' emulation); the second's NE difference is taken against
  the first (:func:`reference`);
* ``fp32``: the unchanged model, for reference;
* ``bf16-repeat`` / ``bf16-attention-repeat``: ``bf16`` / ``bf16-attention`` run again, the
  run-to-run noise floor (zero on a deterministic device; on a GPU, atomics in the embedding
  and attention backward make runs differ).

The same layers are converted in every non-fp32 provider: all linears with
``min(in, out) >= 16`` (the 1-wide task-head outputs and the 8-wide dense-feature projection
stay float32). Embeddings are float32 throughout, and the attention kernels too except in the
attention pair.

Usage (from the workspace root; the FP8 emulation is slow: 150 steps of all providers took 37
minutes on a loaded 2-core CPU, 600 steps of bf16 + gem + fp32 about 5 minutes on an idle one):
    .venv/bin/python benchmarks/bench_fp8_quality.py          # writes benchmarks/results/cpu/fp8_quality.json
    .venv/bin/python benchmarks/bench_fp8_quality.py --steps 20 --providers bf16,gem   # quick look
    .venv/bin/python benchmarks/bench_fp8_quality.py --seed 2 --out s2.json   # one seed per run,
    .venv/bin/python benchmarks/bench_fp8_quality.py --merge s0.json s1.json s2.json --out all.json
``--device cuda`` trains on the GPU (native FP8 GEMMs on Hopper; needs torchrec + fbgemm-gpu
there). ``--seeds 0,1,2 --jobs 12`` runs every (seed, provider) pair in its own process, up to
``--jobs`` at once, dealt over the visible GPUs, then merges them into ``--out``:
    python benchmarks/bench_fp8_quality.py --device cuda --steps 2000 --num-train 520000 \
        --num-eval 50000 --seeds 0,1,2,3,4 --jobs 12 --out benchmarks/results/h200/fp8_quality.json
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import subprocess
import sys
import tempfile
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from gem_train import RECIPES, apply_overrides, get_recipe
from gem_train.cli import prepare_data
from gem_train.trainer import Trainer
from harness import ROOT, meta, write_results

_ALL_FP8 = ["precision.mode=fp8", "precision.bf16_layers="]
_BF16_ATTENTION = ["precision.mode=bf16", "model.attention_dtype=bfloat16"]
PROVIDERS: dict[str, list[str]] = {
    "fp32": ["precision.mode=fp32"],
    "bf16": ["precision.mode=bf16"],
    "bf16-repeat": ["precision.mode=bf16"],
    "gem": ["precision.mode=fp8"],
    "gem-all-fp8": _ALL_FP8,
    "gem-rht": [*_ALL_FP8, "precision.hadamard=true"],
    "gem-sr": [*_ALL_FP8, "precision.stochastic_rounding_grads=true"],
    "gem-bf16wgrad": [*_ALL_FP8, "precision.wgrad_in_bf16=true"],
    "gem-all-fp8-emulated": _ALL_FP8,
    # Issue 29: FP8 attention against bf16 attention (bf16 GEMMs in both).
    "bf16-attention": _BF16_ATTENTION,
    "bf16-attention-repeat": _BF16_ATTENTION,
    "gem-fp8-attention": [*_BF16_ATTENTION, "precision.fp8_attention=*"],
}
# Not in the default run: the noise floor and the emulated GEMMs only tell something on a GPU;
# the attention pair is its own comparison (--providers bf16-attention,gem-fp8-attention).
_NOT_DEFAULT = (
    "bf16-repeat",
    "gem-all-fp8-emulated",
    "bf16-attention",
    "bf16-attention-repeat",
    "gem-fp8-attention",
)
# Environment of a provider's run (set around it, restored after).
PROVIDER_ENV: dict[str, dict[str, str]] = {
    "gem-all-fp8-emulated": {"GEM_PRECISION_GEMM": "emulated"}
}
TASKS = ("ctr", "cvr")


def reference(provider: str) -> str:
    """The provider whose NE ``provider``'s ``ne_rel_diff_vs_bf16`` is taken against: the
    attention pair against bf16 attention (bf16 GEMMs in both), every other against bf16."""
    attention = ("bf16-attention", "bf16-attention-repeat", "gem-fp8-attention")
    return "bf16-attention" if provider in attention else "bf16"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--recipe", default="tiny", choices=sorted(RECIPES), help="the model and data recipe"
    )
    parser.add_argument("--steps", type=int, default=150, help="training steps per provider")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--num-train", type=int, default=40_000)
    parser.add_argument("--num-eval", type=int, default=10_000)
    parser.add_argument("--min-features", type=int, default=16)
    parser.add_argument(
        "--lr-schedule",
        default="cosine",
        choices=("constant", "linear", "cosine"),
        help="dense learning rate after warm-up (optim.lr_schedule); annealed runs end at "
        "settled weights, so seeds and precisions compare with far less run-to-run noise",
    )
    parser.add_argument("--seed", type=int, default=0, help="parameter init and data order")
    parser.add_argument(
        "--seeds",
        help="comma-separated seeds: one process per (seed, provider), then --merge into --out",
    )
    parser.add_argument("--jobs", type=int, default=1, help="processes at once with --seeds")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument(  # bf16-repeat and the emulated GEMMs only tell something on a GPU
        "--providers",
        default=",".join(p for p in PROVIDERS if p not in _NOT_DEFAULT),
    )
    parser.add_argument("--data-dir", help="default: data/fp8_quality (tiny) or ..._<recipe>")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/cpu/fp8_quality.json"))
    parser.add_argument(
        "--device", default="cpu", help="cpu (emulated GEMMs) or cuda (native FP8 on Hopper)"
    )
    parser.add_argument(
        "--set",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="more TrainConfig overrides for every provider, as gem-train's --set (e.g. "
        "data.num_items=400000 to run several providers at once on one GPU)",
    )
    parser.add_argument(
        "--rename",
        nargs="+",
        default=[],
        metavar="OLD=NEW",
        help="with --merge: read provider OLD of the input files as NEW (a provider whose "
        "definition changed name, e.g. gem=gem-all-fp8 gem-heads-bf16=gem when the heads-bf16 "
        "policy became gem-train's default)",
    )
    parser.add_argument(
        "--merge",
        nargs="+",
        metavar="JSON",
        help="instead of training: merge per-seed result files of this script (or earlier "
        "merged files) into --out (per-seed rows plus mean and std of each provider's NE "
        "difference vs bf16)",
    )
    args = parser.parse_args()
    if args.data_dir is None:
        suffix = "" if args.recipe == "tiny" else f"_{args.recipe}"
        args.data_dir = str(ROOT / "data" / f"fp8_quality{suffix}")
    if args.merge:
        rename = dict(pair.split("=", 1) for pair in args.rename if "=" in pair)
        if len(rename) != len(args.rename):
            parser.error(f"--rename takes OLD=NEW pairs, got {args.rename}")
        merge_seeds([Path(p) for p in args.merge], Path(args.out), rename)
        return
    providers = [p for p in args.providers.split(",") if p]
    unknown = [p for p in providers if p not in PROVIDERS]
    if unknown:
        parser.error(f"unknown providers {unknown}; known: {sorted(PROVIDERS)}")
    if args.seeds:
        if args.jobs < 1:
            parser.error(f"--jobs must be >= 1, got {args.jobs}")
        try:
            seeds = [int(seed) for seed in args.seeds.split(",") if seed]
        except ValueError:
            parser.error(f"--seeds must be comma-separated integers, got {args.seeds!r}")
        run_seeds(args, seeds, providers)
        return

    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    for name in ("torchrec", None):
        logging.getLogger(name).setLevel(logging.ERROR)
    base = [
        f"data.directory={args.data_dir}",
        f"data.num_train={args.num_train}",
        f"data.num_eval={args.num_eval}",
        f"max_steps={args.steps}",
        f"batch_size={args.batch_size}",
        f"precision.min_features={args.min_features}",
        f"optim.lr_schedule={args.lr_schedule}",
        "checkpoint_every=0",
        "compare_no_sequence=false",
        f"device={args.device}",
        f"seed={args.seed}",
        *args.set,
    ]
    recipe = get_recipe(args.recipe)
    train_data, eval_data = prepare_data(apply_overrides(recipe, base).data, progress=False)
    if not providers:  # --providers "": only generate the data (before parallel runs)
        return
    rows: list[dict] = []
    results: dict[str, dict[str, float]] = {}
    converted: dict[str, int] = {}
    for provider in providers:
        config = apply_overrides(
            get_recipe(args.recipe),
            [
                *base,
                f"output_dir=runs/fp8_quality/seed{args.seed}/{provider}",
                *PROVIDERS[provider],
            ],
        )
        started = time.perf_counter()
        with _environment(PROVIDER_ENV.get(provider, {})):
            trainer = Trainer(config, train_data, output_dir=Path(config.output_dir))
            losses = trainer.fit(progress=False)
            train_s = time.perf_counter() - started
            metrics = trainer.evaluate(eval_data)
        results[provider] = metrics
        converted[provider] = len(trainer.precision_converted)
        for task in TASKS:
            for metric in ("ne", "auc"):
                rows.append(
                    {
                        "case": task,
                        "provider": provider,
                        "mode": "eval",
                        "metric": metric,
                        "value": metrics[f"{metric}_{task}"],
                    }
                )
        rows.append(
            {
                "case": "train",
                "provider": provider,
                "mode": "fwd_bwd",
                "metric": "ms",
                "value": 1000 * train_s / args.steps,
            }
        )
        rows.append(
            {
                "case": "train",
                "provider": provider,
                "mode": "fwd_bwd",
                "metric": "final_loss",
                "value": sum(losses[-20:]) / len(losses[-20:]),
            }
        )
        print(
            f"{provider:>14}: NE ctr {metrics['ne_ctr']:.5f} cvr {metrics['ne_cvr']:.5f} "
            f"({converted[provider]} layers converted, {train_s:.0f} s)",
            flush=True,
        )

    compared = {p: m for p, m in results.items() if reference(p) in results}
    if compared:
        for provider, metrics in compared.items():
            for task in TASKS:
                ref = results[reference(provider)][f"ne_{task}"]
                rows.append(
                    {
                        "case": task,
                        "provider": provider,
                        "mode": "eval",
                        "metric": "ne_rel_diff_vs_bf16",
                        "value": (metrics[f"ne_{task}"] - ref) / ref,
                    }
                )
        print("\nrelative NE difference vs bf16 (target |diff| <= 0.1%):")
        for provider, metrics in compared.items():
            ref = results[reference(provider)]
            diffs = [100 * (metrics[f"ne_{t}"] - ref[f"ne_{t}"]) / ref[f"ne_{t}"] for t in TASKS]
            print(f"{provider:>14}: ctr {diffs[0]:+.3f}%  cvr {diffs[1]:+.3f}%")

    command = "python benchmarks/bench_fp8_quality.py " + " ".join(sys.argv[1:])
    on_gpu = args.device.startswith("cuda")
    block = meta(
        "fp8_quality",
        command.strip(),
        **({"device": torch.cuda.get_device_name()} if on_gpu else {}),
        steps=args.steps,
        seed=args.seed,
        batch_size=args.batch_size,
        lr_schedule=args.lr_schedule,
        num_train=args.num_train,
        num_eval=args.num_eval,
        threads=args.threads,
        recipe=args.recipe,
        overrides=args.set,
        converted_linears=converted,
        emulation=(
            "CPU: FP8 and bf16 GEMMs are emulated (operands quantized/rounded, float32 matmul "
            "and master weights); layers with min(in, out) < min_features stay float32"
        ),
        oracle_ne=eval_data.oracle_ne,
    )
    write_results(Path(args.out), block, rows)
    print(f"wrote {args.out}")


@contextlib.contextmanager
def _environment(values: dict[str, str]):
    """``os.environ`` with ``values`` set, restored on exit."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def run_seeds(args: argparse.Namespace, seeds: list[int], providers: list[str]) -> None:
    """Every (seed, provider) in its own process, ``--jobs`` at once, round-robin over the GPUs;
    then one merged file. The data is generated once, before the runs start."""
    script = str(Path(__file__).resolve())
    common = [
        f"--recipe={args.recipe}",
        f"--steps={args.steps}",
        f"--batch-size={args.batch_size}",
        f"--num-train={args.num_train}",
        f"--num-eval={args.num_eval}",
        f"--min-features={args.min_features}",
        f"--lr-schedule={args.lr_schedule}",
        f"--threads={args.threads}",
        f"--data-dir={args.data_dir}",
        f"--device={args.device}",
        *(["--set", *args.set] if args.set else []),
    ]
    subprocess.run([sys.executable, script, *common, "--providers="], check=True)
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    work = Path(tempfile.mkdtemp(prefix="fp8_quality_"))
    jobs = [(seed, provider) for seed in seeds for provider in providers]

    def run(index: int) -> Path | None:
        seed, provider = jobs[index]
        out = work / f"seed{seed}_{provider}.json"
        env = dict(os.environ)
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = str(index % gpus)
        log = work / f"seed{seed}_{provider}.log"
        with open(log, "w") as f:
            done = subprocess.run(
                [
                    sys.executable,
                    script,
                    *common,
                    f"--seed={seed}",
                    f"--providers={provider}",
                    f"--out={out}",
                ],
                env=env,
                stdout=f,
                stderr=subprocess.STDOUT,
                check=False,
            )
        if done.returncode != 0:
            # Keep the other runs: one diverged or crashed run must not lose a whole sweep.
            print(f"  FAILED: seed {seed} {provider}; {log}:\n{log.read_text()[-3000:]}")
            return None
        print(f"  done: seed {seed} {provider}", flush=True)
        return out

    print(f"per-run results and logs in {work}", flush=True)
    with ThreadPoolExecutor(args.jobs) as pool:
        outputs = [out for out in pool.map(run, range(len(jobs))) if out is not None]
    if not outputs:
        raise SystemExit(f"every run failed; logs in {work}")
    merge_seeds(outputs, Path(args.out))
    if len(outputs) < len(jobs):
        raise SystemExit(f"{len(jobs) - len(outputs)} of {len(jobs)} runs failed (merged the rest)")


def merge_seeds(paths: list[Path], out: Path, rename: dict[str, str] | None = None) -> None:
    """One file from several single-seed runs: each run's rows with ``/seed<k>`` appended to the
    case, and per provider and task the mean and sample std over seeds of NE and of the relative
    NE difference vs bf16 (case ``<task>``, metrics ``ne_mean``, ``ne_rel_diff_vs_bf16_mean``,
    ``..._std``, ``..._sem`` (standard error of the mean), ``seeds``, ``runs``).

    A provider run more than once at a seed (files of separate sweeps: on a GPU runs differ)
    keeps every run, the repeats as ``/seed<k>/run<r>``; its NE at that seed is the mean over
    the runs, which is what the difference vs bf16 (itself averaged the same way) uses."""
    import json
    import re
    import statistics

    rename = rename or {}

    rows: list[dict] = []
    runs = []
    history: list[dict] = []  # commands of the merges this one builds on
    devices: set[str] = set()  # where the merged runs trained
    seen: dict[tuple, int] = {}  # row key -> runs of it so far
    ne: dict[tuple[str, str, object], list[float]] = {}  # (task, provider, seed) -> eval NEs
    for path in paths:
        data = json.loads(path.read_text())
        devices.update(data["meta"].get("device", "unknown").split(" | "))
        if "runs" in data["meta"]:  # an earlier merge: its per-seed rows, aggregates dropped
            runs.extend(data["meta"]["runs"])
            earlier = data["meta"].get("earlier_merges", [])
            history.extend(
                [
                    *earlier,
                    {key: data["meta"].get(key) for key in ("command", "commit", "date")}
                    | {"file": path.name},
                ]
            )
            per_seed = []
            for row in data["rows"]:
                match = re.fullmatch(r"(.+)/seed(\d+)(?:/run\d+)?", row["case"])
                if match:
                    per_seed.append(({**row, "case": match[1]}, int(match[2])))
        else:
            seed = data["meta"].get("seed")
            runs.append(
                {
                    "file": path.name,
                    "seed": seed,
                    "steps": data["meta"].get("steps"),
                    "lr_schedule": data["meta"].get("lr_schedule", "constant"),
                    "commit": data["meta"].get("commit"),
                    "overrides": data["meta"].get("overrides", []),
                }
            )
            per_seed = [(row, seed) for row in data["rows"]]
        for row, seed in per_seed:
            if row["metric"] == "ne_rel_diff_vs_bf16":
                continue  # recomputed below, also across files of the same seed
            row = {**row, "provider": rename.get(row["provider"], row["provider"])}
            key = (row["case"], row["provider"], row["mode"], row["metric"], seed)
            run = seen.get(key, 0) + 1  # the same provider and seed in several files
            seen[key] = run
            suffix = f"/seed{seed}" + (f"/run{run}" if run > 1 else "")
            rows.append({**row, "case": row["case"] + suffix})
            if row["mode"] == "eval" and row["metric"] == "ne":
                ne.setdefault((row["case"], row["provider"], seed), []).append(row["value"])
    per: dict[tuple[str, str, str], list[float]] = {}
    run_counts: dict[tuple[str, str], int] = {}
    for (task, provider, seed), values in sorted(ne.items(), key=str):
        value = statistics.fmean(values)
        per.setdefault((task, provider, "ne"), []).append(value)
        run_counts[(task, provider)] = run_counts.get((task, provider), 0) + len(values)
        ref = ne.get((task, reference(provider), seed))
        if ref is None:
            continue
        diff = (value - statistics.fmean(ref)) / statistics.fmean(ref)
        per.setdefault((task, provider, "ne_rel_diff_vs_bf16"), []).append(diff)
        rows.append(
            {
                "case": f"{task}/seed{seed}",
                "provider": provider,
                "mode": "eval",
                "metric": "ne_rel_diff_vs_bf16",
                "value": diff,
            }
        )
    print(f"{'provider':>14} {'task':>4} {'seeds':>5} runs  NE diff vs bf16 (mean +- std, sem)")
    for (task, provider, metric), values in sorted(per.items()):
        mean = statistics.fmean(values)
        std = statistics.stdev(values) if len(values) > 1 else float("nan")
        # Standard error of the mean: what the seed count can resolve (a 0.1% target needs it
        # well below 0.1%).
        sem = std / len(values) ** 0.5
        for name, value in (("mean", mean), ("std", std), ("sem", sem)):
            rows.append(
                {
                    "case": task,
                    "provider": provider,
                    "mode": "eval",
                    "metric": f"{metric}_{name}",
                    "value": value,
                }
            )
        if metric == "ne":
            for name, count in (("seeds", len(values)), ("runs", run_counts[(task, provider)])):
                rows.append(
                    {
                        "case": task,
                        "provider": provider,
                        "mode": "eval",
                        "metric": name,
                        "value": float(count),
                    }
                )
        else:
            print(
                f"{provider:>14} {task:>4} {len(values):5d} {run_counts[(task, provider)]:4d}  "
                f"{100 * mean:+.3f}% +- {100 * std:.3f}%, sem {100 * sem:.3f}%"
            )
    command = "python benchmarks/bench_fp8_quality.py " + " ".join(sys.argv[1:])
    write_results(
        out,
        meta(
            "fp8_quality",
            command.strip(),
            device=" | ".join(sorted(devices)),
            runs=runs,
            renamed=rename,
            earlier_merges=history,
        ),
        rows,
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
