"""GEM training step on 1 GPU vs 2 GPUs: the scaling ratio of the dense + sparse parallelism.

Both runs use the same per-GPU batch and the gem-train ``Trainer``:

* 1 GPU: torchrec DMP (all tables on the one GPU), dense DDP (a no-op at world 1);
* 2 GPUs: tables sharded by torchrec over both GPUs, dense FSDP2 over the 2 ranks
  (``parallel.dense=fsdp``) and the DHEN experts split over both (``parallel.expert_parallel=2``).

Each rank takes ``--batches`` batches from the trainer's own loader onto the GPU first, so the
timing covers the training step only (forward, backward with the fused sparse optimizer,
gradient reductions, clip, AdamW), not Parquet decoding. ``train_step`` ends with ``loss.item()``,
so every step is synchronous. The step time of a run is the slowest rank's.

    scaling ratio = (2-GPU samples/s) / (2 x 1-GPU samples/s)

Usage (from the workspace root; torchrec and fbgemm-gpu must import):
    python benchmarks/bench_train_scaling.py        # writes benchmarks/results/h200x2/train.json
    python benchmarks/bench_train_scaling.py --device cpu --batch-size 64 --max-seq-len 32 \
        --embedding-dim 32 --steps 3 --warmup 1 --output /tmp/train.json   # a CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from _results import ROOT, meta, write_results


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(args: argparse.Namespace) -> None:
    """One rank: build the trainer, preload batches, time ``--steps`` training steps."""
    import torch.distributed as dist
    from gem_data import read_dataset_info
    from gem_model import GemArchitecture
    from gem_train import DataConfig, OptimConfig, TrainConfig, Trainer
    from gem_train.config import ParallelConfig
    from gem_train.trainer import init_distributed

    device = torch.device(args.device)
    rank, world = init_distributed(device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    parallel = (
        ParallelConfig(dense="fsdp", expert_parallel=world) if world > 1 else ParallelConfig()
    )
    config = TrainConfig(
        data=DataConfig(directory=args.data, max_seq_len=args.max_seq_len),
        model=GemArchitecture(
            embedding_dim=args.embedding_dim,
            num_heads=args.num_heads,
            num_sequence_layers=args.sequence_layers,
            dhen_layers=args.dhen_layers,
            expert_hidden_dim=args.expert_hidden_dim,
            dhen_experts=tuple(args.dhen_experts.split(",")),
        ),
        optim=OptimConfig(warmup_steps=1),
        batch_size=args.batch_size,
        device=device.type,
        output_dir=args.workdir,
        parallel=parallel,
        compare_no_sequence=False,
    )
    info = read_dataset_info(Path(args.data) / "train")
    trainer = Trainer(config, info, output_dir=f"{args.workdir}/rank{rank}")
    batches = []
    for batch in trainer.loader:
        batches.append(batch.to(device))
        if len(batches) == args.batches:
            break
    tokens = sum(int(b.sequence_offsets[-1]) for b in batches) / len(batches)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()

    for step in range(args.warmup):  # Triton compilation, allocator and NCCL warm-up
        trainer.train_step(batches[step % len(batches)])
    sync()
    step_seconds = []
    for step in range(args.steps):
        started = time.perf_counter()
        trainer.train_step(batches[step % len(batches)])  # ends with loss.item(): synchronous
        step_seconds.append(time.perf_counter() - started)
    sync()
    total = torch.tensor([sum(step_seconds)], dtype=torch.float64, device=device)
    dist.all_reduce(total, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
    if rank == 0:
        step_seconds.sort()
        Path(args.result).write_text(
            json.dumps(
                {
                    "world": world,
                    "ms_per_step": 1e3 * total.item() / args.steps,
                    "median_ms_rank0": 1e3 * step_seconds[len(step_seconds) // 2],
                    "samples_per_s": world * args.batch_size * args.steps / total.item(),
                    "tokens_per_batch": tokens,
                    "peak_gib_rank0": peak,
                    "layout": trainer.parallel.describe(),
                    "plan": str(trainer.model.plan),
                }
            )
        )
    dist.destroy_process_group()


def _run_world(args: argparse.Namespace, world: int, workdir: Path, timeout: float) -> dict:
    """Runs ``world`` worker processes (torchrun-style environment) and returns rank 0's result."""
    result = workdir / f"result{world}.json"
    port = _free_port()
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--result", str(result)]
    command += [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k in _FORWARD]
    command += ["--data", str(workdir / "data"), "--workdir", str(workdir / f"run{world}")]
    processes = []
    for rank in range(world):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        processes.append(subprocess.Popen(command, env=env))
    deadline = time.monotonic() + timeout
    for process in processes:
        try:
            process.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for other in processes:
                other.kill()
            raise RuntimeError(
                f"the {world}-process run took longer than {timeout:.0f} s"
            ) from None
    if any(p.returncode for p in processes):
        raise RuntimeError(f"the {world}-process run failed: {[p.returncode for p in processes]}")
    return json.loads(result.read_text())


_FORWARD = (
    "device",
    "batch_size",
    "max_seq_len",
    "embedding_dim",
    "num_heads",
    "sequence_layers",
    "dhen_layers",
    "expert_hidden_dim",
    "dhen_experts",
    "batches",
    "warmup",
    "steps",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--batch-size", type=int, default=2048, help="samples per GPU per step")
    parser.add_argument("--max-seq-len", type=int, default=512)
    parser.add_argument("--embedding-dim", type=int, default=256)
    parser.add_argument("--num-heads", type=int, default=2)
    parser.add_argument("--sequence-layers", type=int, default=2)
    parser.add_argument("--dhen-layers", type=int, default=3)
    parser.add_argument("--expert-hidden-dim", type=int, default=1024)
    parser.add_argument(
        "--dhen-experts",
        default="attention,mlp,cross,attention,mlp,cross",
        help="experts per DHEN layer; contiguous halves go to the two GPUs, so the default "
        "(the model's three kinds, twice) gives both the same expert work",
    )
    parser.add_argument("--batches", type=int, default=4, help="distinct batches cycled over")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--timeout", type=float, default=150.0, help="seconds per run")
    parser.add_argument("--output", default=str(ROOT / "benchmarks/results/h200x2/train.json"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args)
        return

    from gem_data import SyntheticConfig, write_synthetic_dataset

    worlds = (1, 2)
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        raise SystemExit(f"needs 2 GPUs, torch sees {torch.cuda.device_count()}")
    workdir = Path(tempfile.mkdtemp(prefix="gem-bench-train-"))
    started = time.perf_counter()
    # Enough samples for `batches` batches on each of the two ranks.
    samples = max(worlds) * args.batch_size * (args.batches + 1)
    write_synthetic_dataset(
        SyntheticConfig(seed=0, max_seq_len=args.max_seq_len),
        workdir / "data" / "train",
        num_samples=samples,
        num_shards=4,
        workers=min(8, os.cpu_count() or 1),
        progress=False,
    )
    print(f"data: {samples} samples in {time.perf_counter() - started:.1f} s", flush=True)
    results = {}
    for world in worlds:
        results[world] = _run_world(args, world, workdir, args.timeout)
        r = results[world]
        print(
            f"{world} GPU(s): {r['ms_per_step']:.2f} ms/step, {r['samples_per_s']:.0f} samples/s"
            f" ({r['layout']}, peak {r['peak_gib_rank0']:.1f} GiB)",
            flush=True,
        )
    ratio = results[2]["samples_per_s"] / (2 * results[1]["samples_per_s"])
    case = (
        f"B{args.batch_size}/gpu xL{args.max_seq_len} d{args.embedding_dim} "
        f"seq{args.sequence_layers} dhen{args.dhen_layers}x{len(args.dhen_experts.split(','))}"
    )
    rows = [
        {
            "case": case,
            "provider": "gem",
            "mode": "fwd_bwd",
            "metric": "scaling_ratio",
            "value": ratio,
        }
    ]
    for world, r in results.items():
        label = f"{case}/{world}gpu"
        rows.append(
            {
                "case": label,
                "provider": "gem",
                "mode": "fwd_bwd",
                "metric": "ms",
                "value": r["ms_per_step"],
            }
        )
        rows.append(
            {
                "case": label,
                "provider": "gem",
                "mode": "fwd_bwd",
                "metric": "samples_per_s",
                "value": r["samples_per_s"],
            }
        )
    device = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    block = meta(
        "train_scaling",
        "python benchmarks/bench_train_scaling.py " + " ".join(sys.argv[1:]),
        device=f"{max(worlds)}x {device}",
        layouts={str(w): r["layout"] for w, r in results.items()},
        tokens_per_batch=results[1]["tokens_per_batch"],
        peak_gib_rank0={str(w): r["peak_gib_rank0"] for w, r in results.items()},
        plan_2gpu=results[2]["plan"],
    )
    write_results(Path(args.output), block, rows)
    print(f"scaling ratio {ratio:.3f} -> {args.output}")


if __name__ == "__main__":
    main()
