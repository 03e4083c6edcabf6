"""Exploration: where the time of one ``h200`` training step goes (torch.profiler tables).

Not a benchmark: prints the top operators by device and host time and writes a Chrome trace
under ``$OUT`` (or ``--out``). Uses only public APIs: the recipe, ``Trainer.train_step``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import time
from pathlib import Path

import torch
from gem_train.cli import configure, prepare_data
from gem_train.trainer import Trainer
from torch.profiler import ProfilerActivity, profile
from trace_kernels import print_summary, summarise


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipe", default="h200")
    parser.add_argument("--set", action="append", default=[], dest="overrides")
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", default=os.environ.get("OUT", "runs/profile"))
    parser.add_argument(
        "--pipeline",
        action="store_true",
        help="steps through Trainer.train_steps (torchrec's train pipeline, as gem-train and "
        "bench_train.py's gem run) instead of Trainer.train_step per batch",
    )
    parser.add_argument("--no-trace", action="store_true", help="summarise, keep no trace.json")
    parser.add_argument(
        "--kernel-shapes",
        default="",
        help="also sum the kernels whose name holds this by the op that launched them and its "
        "input shapes (records shapes)",
    )
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    overrides = [
        "data.num_train=40000",
        "data.num_eval=1000",
        "max_steps=40",
        "data.directory=/tmp/h200data",
        *args.overrides,
    ]
    config = configure(args.recipe, overrides)
    started = time.perf_counter()
    train, _ = prepare_data(config.data, progress=False)
    print(f"data {time.perf_counter() - started:.1f} s", flush=True)
    trainer = Trainer(config, train, output_dir=out / "run")
    batches = iter(trainer.loader)

    def run(host_batches) -> None:
        if args.pipeline:
            trainer.train_steps(host_batches)
            return
        for b in host_batches:
            trainer.train_step(b.to(trainer.device, non_blocking=True))

    run([next(batches) for _ in range(args.warmup)])
    torch.cuda.synchronize()
    host = [next(batches) for _ in range(args.steps)]
    t0 = time.perf_counter()
    run(host)
    torch.cuda.synchronize()
    step = (time.perf_counter() - t0) / args.steps
    print(f"step (no data wait) {step * 1e3:.1f} ms; split {trainer.clock.take()}", flush=True)
    # Each step alone: the host's time to queue it (train_step returning) and its time to the
    # GPU's end, so that host-bound steps and one-off stalls (a Triton compile) show.
    host = [] if args.pipeline else [next(batches) for _ in range(args.steps)]
    for b in host:
        t0 = time.perf_counter()
        trainer.train_step(b.to(trainer.device, non_blocking=True))
        queued = time.perf_counter() - t0
        torch.cuda.synchronize()
        total = time.perf_counter() - t0
        print(f"step alone: host {queued * 1e3:.1f} ms, total {total * 1e3:.1f} ms", flush=True)
    # The pipeline's first and last steps fill and drain it: profile more steps there.
    host = [next(batches) for _ in range(6 if args.pipeline else 3)]
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    shapes = bool(args.kernel_shapes)
    with profile(activities=activities, record_shapes=shapes) as prof:
        run(host)
        torch.cuda.synchronize()
    prof.export_chrome_trace(str(out / "trace.json"))
    summary = summarise(json.loads((out / "trace.json").read_text()), len(host), top=60)
    if args.no_trace:
        (out / "trace.json").unlink()
    print_summary(summary)
    (out / "kernels.json").write_text(json.dumps(summary, indent=1) + "\n")
    if shapes:
        launched: dict[tuple[str, str], list[float]] = collections.defaultdict(lambda: [0.0, 0])
        for event in prof.events():
            for kernel in event.kernels:
                if args.kernel_shapes in kernel.name:
                    total = launched[(event.name, str(event.input_shapes[:2]))]
                    total[0] += kernel.duration / 1e3 / len(host)
                    total[1] += 1 / len(host)
        print(f"{args.kernel_shapes} by launching op and its first two input shapes, per step:")
        for (op, shape), (ms, calls) in sorted(launched.items(), key=lambda i: -i[1][0])[:40]:
            print(f"{ms:8.2f} ms {calls:5.1f}x  {op[:50]:50s} {shape[:90]}")
    averages = prof.key_averages()
    print(averages.table(sort_by="self_device_time_total", row_limit=40, max_name_column_width=70))
    print(averages.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=70))
    (out / "summary.json").write_text(json.dumps({"step_ms": step * 1e3}))


if __name__ == "__main__":
    main()
