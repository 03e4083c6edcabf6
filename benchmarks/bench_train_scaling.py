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

The 2-GPU run times several layouts (``--variants``), each in its own pair of processes (with
``--same-process`` one after the other in one pair, which is faster to run but biased: later
trainers in a process ran slower, 207 -> 220 -> 263 ms). Each variant is
``name:key=value,...`` with keys

* ``ep``: ``uniform`` (the trainer's default, ``ExpertParallelDHENLayer.uniform_train_batch``:
  equal per-rank training batches, no exchange) or ``exchange`` (per-rank batch sizes
  all-gathered, with a host sync, in every DHEN layer call);
* ``plan``: ``parallel.sparse_plan``, ``auto`` (torchrec's planner) or ``row_wise``
  (``gem_train.parallel.row_wise_plan``: sequence tables and tables of >= 100k rows row-wise
  over all ranks, the other tables table-wise round-robin). Measured on 2 H200s in fresh
  processes, ``row_wise`` is slower (255 ms per step against 168 ms on 1 GPU, ratio 0.66);
* ``ag``: ``parallel.fsdp_all_gather_collective``, ``auto`` (copy engine where it works) or
  ``nccl``;
* ``reshard``: ``parallel.reshard_after_forward`` (``0``, the trainer's default, or ``1``: one
  more all-gather per block in backward; 94.8 against 86.7 ms per step on 2 H200s).

Only the trainer's public config and attributes are used. The phase split of a step comes from
the trainer's ``StepClock`` (``trainer.clock``): ``host_phase_ms`` is the host time spent
issuing forward, backward and optimizer (clip, gradient reductions, AdamW), ``wait`` the final
``loss.item()`` waiting for the GPU (near 0: the step is bound by the host) and ``rest`` what
the timed step spent outside them; ``device_phase_ms`` is the same split on the GPU stream
(CUDA events; host time on a CPU).

Rows of the variant named ``gem`` (the trainer's defaults) have provider ``gem``; the others
``gem-<name>``.
With ``--profile DIR`` every run also records ``--profile-steps`` steps with torch.profiler and
writes per-rank summaries (kernel table by self CUDA time, GPU idle, NCCL time, host syncs)
to ``DIR/profile_w<world>_r<rank>.txt`` and rank 0's Chrome traces as ``.json.gz``.

Usage (from the workspace root; torchrec and fbgemm-gpu must import):
    python benchmarks/bench_train_scaling.py        # writes benchmarks/results/h200x2/train.json
    python benchmarks/bench_train_scaling.py --device cpu --batch-size 64 --max-seq-len 32 \
        --embedding-dim 32 --steps 3 --warmup 1 --output /tmp/train.json   # a CPU smoke run
"""

from __future__ import annotations

import argparse
import gc
import gzip
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from gem_train.config import FSDP_ALL_GATHER_COLLECTIVES, SPARSE_PLANS
from harness import ROOT, meta, write_results


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


DEFAULT_VARIANTS = (
    "gem:ep=uniform,plan=auto,ag=auto,reshard=0",
    "reshard:ep=uniform,plan=auto,ag=auto,reshard=1",
)
_VARIANT_KEYS = {
    "ep": ("uniform", "exchange"),
    "plan": SPARSE_PLANS,
    "ag": FSDP_ALL_GATHER_COLLECTIVES,
    "reshard": ("1", "0"),
}
_VARIANT_DEFAULTS = {"ep": "uniform", "plan": "auto", "ag": "auto", "reshard": "0"}


def parse_variants(text: str) -> list[tuple[str, dict[str, str]]]:
    """``name:key=value,...;name2:...`` -> [(name, options)], unknown keys/values rejected."""
    variants = []
    for item in filter(None, (part.strip() for part in text.split(";"))):
        name, _, spec = item.partition(":")
        options = dict(_VARIANT_DEFAULTS)
        for pair in filter(None, spec.split(",")):
            key, _, value = pair.partition("=")
            if key not in _VARIANT_KEYS or value not in _VARIANT_KEYS[key]:
                raise ValueError(f"--variants: bad option {pair!r} in {item!r} ({_VARIANT_KEYS})")
            options[key] = value
        variants.append((name, options))
    if not variants:
        raise ValueError("--variants names no variant")
    return variants


def _build_trainer(args, config, info, rank, name, options):
    """A Trainer for one variant (its layout is all in ``config``)."""
    from gem_train import Trainer

    trainer = Trainer(config, info, output_dir=f"{args.workdir}/{name}/rank{rank}")
    for layer in trainer.parallel.expert_layers:
        layer.uniform_train_batch = options["ep"] == "uniform"
    return trainer


def _trace_summary(trace_path: Path, device_index: int, steps: int) -> tuple[str, dict]:
    """GPU idle, NCCL, copies and host syncs per step from a Chrome trace (one rank)."""
    with gzip.open(trace_path, "rt") as f:
        events = json.load(f)["traceEvents"]
    spans = [
        e for e in events if e.get("name") == "bench_step" and e.get("cat") == "user_annotation"
    ]
    if not spans:
        return "no bench_step spans in the trace\n", {}
    t0 = min(e["ts"] for e in spans)
    t1 = max(e["ts"] + e["dur"] for e in spans)
    gpu = []
    for e in events:
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e:
            if int(e.get("args", {}).get("device", device_index)) != device_index:
                continue
            if e["ts"] + e["dur"] < t0 or e["ts"] > t1:
                continue
            gpu.append(e)
    gpu.sort(key=lambda e: e["ts"])
    busy, cur_s, cur_e, gaps = 0.0, None, None, []
    for e in gpu:
        s, d = max(e["ts"], t0), min(e["ts"] + e["dur"], t1)
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
                gaps.append((s - cur_e, cur_e - t0, e["name"][:60]))
            cur_s, cur_e = s, d
        else:
            cur_e = max(cur_e, d)
    if cur_e is not None:
        busy += cur_e - cur_s
    wall = t1 - t0
    by_name: dict[str, list[float]] = {}
    for e in gpu:
        by_name.setdefault(e["name"][:90], []).append(e["dur"])
    nccl = sum(e["dur"] for e in gpu if "nccl" in e["name"].lower())
    copies = sum(e["dur"] for e in gpu if e.get("cat") == "gpu_memcpy")
    runtime = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver") and "dur" in e]
    runtime = [e for e in runtime if t0 <= e["ts"] <= t1]
    sync_names = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
    syncs = [e for e in runtime if e["name"] in sync_names]
    scalars = [
        e
        for e in events
        if e.get("cat") == "cpu_op"
        and e.get("name") == "aten::_local_scalar_dense"
        and t0 <= e["ts"] <= t1
    ]
    stats = {
        "wall_ms": wall / 1e3 / steps,
        "gpu_busy_ms": busy / 1e3 / steps,
        "gpu_idle_ms": (wall - busy) / 1e3 / steps,
        "nccl_kernel_ms": nccl / 1e3 / steps,
        "memcpy_ms": copies / 1e3 / steps,
        "host_sync_ms": sum(e["dur"] for e in syncs) / 1e3 / steps,
        "host_syncs": len(syncs) / steps,
        "item_calls": len(scalars) / steps,
        "item_ms": sum(e["dur"] for e in scalars) / 1e3 / steps,
    }
    lines = ["per step: " + ", ".join(f"{k} {v:.2f}" for k, v in stats.items())]
    lines.append("top GPU ops (total ms per step, calls per step):")
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:25]
    for name, durs in top:
        lines.append(f"  {sum(durs) / 1e3 / steps:8.3f} ms {len(durs) / steps:7.1f}x  {name}")
    lines.append("largest GPU idle gaps (ms, at ms into the window, next GPU op):")
    for gap, at, name in sorted(gaps, reverse=True)[:15]:
        lines.append(f"  {gap / 1e3:7.3f} ms at {at / 1e3:8.2f}  {name}")
    return "\n".join(lines) + "\n", stats


def _sync_sites(prof, steps: int, limit: int = 25) -> str:
    """Where the host waits for the GPU: scalar reads and stream syncs grouped by Python stack."""
    names = ("aten::_local_scalar_dense", "cudaStreamSynchronize", "cudaMemcpyAsync")
    rows = [
        e
        for e in prof.key_averages(group_by_stack_n=8)
        if e.key in names and (e.key != "cudaMemcpyAsync" or e.cpu_time_total > 50 * e.count)
    ]
    rows.sort(key=lambda e: -e.count)
    lines = []
    for e in rows[:limit]:
        stack = " <- ".join(
            frame.split("/")[-1] for frame in e.stack if "torch/" not in frame
        ) or " <- ".join(frame.split("/")[-1] for frame in e.stack[:3])
        lines.append(f"  {e.count / steps:6.1f}x {e.key:28s} {stack[:300]}")
    return "\n".join(lines)


def _profile(trainer, batches, steps: int, out_dir: Path, tag: str, rank: int, device) -> dict:
    """Profiles ``steps`` training steps; writes the summary (and rank 0's trace)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    from torch._C._profiler import _ExperimentalConfig

    # verbose: Python stacks on the ops, to find the call sites of host syncs
    stacks = _ExperimentalConfig(verbose=True)
    with profile(activities=activities, with_stack=True, experimental_config=stacks) as prof:
        for step in range(steps):
            with record_function("bench_step"):
                trainer.train_step(batches[step % len(batches)])
    out_dir.mkdir(parents=True, exist_ok=True)
    raw = out_dir / f".trace_{tag}_r{rank}.json"
    prof.export_chrome_trace(str(raw))
    trace = out_dir / f"trace_{tag}_r{rank}.json.gz"
    with open(raw, "rb") as src, gzip.open(trace, "wb", compresslevel=6) as dst:
        dst.write(src.read())
    raw.unlink()
    device_index = device.index or 0
    summary, stats = _trace_summary(trace, device_index, steps)
    if rank != 0:
        trace.unlink()  # keep few traces: the file count that comes back is limited
    averages = prof.key_averages()
    table = ""
    for key in ("self_cuda_time_total", "self_device_time_total"):
        try:
            table = averages.table(sort_by=key, row_limit=30, max_name_column_width=70)
            break
        except (AttributeError, KeyError, ValueError):
            continue
    cpu_table = averages.table(
        sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=70
    )
    with open(out_dir / f"profile_w{trainer.world_size}_r{rank}.txt", "a") as f:
        f.write(f"===== {tag} rank {rank}: {steps} profiled steps =====\n{summary}\n")
        f.write(f"--- host syncs by call site (count per step) ---\n{_sync_sites(prof, steps)}\n")
        f.write(f"--- key_averages by self CUDA time ---\n{table}\n")
        f.write(f"--- key_averages by self CPU time ---\n{cpu_table}\n\n")
    return stats


def _worker(args: argparse.Namespace) -> None:
    """One rank: build the trainer per variant, preload batches, time ``--steps`` steps."""
    import torch.distributed as dist
    from gem_data import read_dataset_info
    from gem_model import GemArchitecture
    from gem_train import DataConfig, OptimConfig, TrainConfig
    from gem_train.config import ParallelConfig
    from gem_train.trainer import init_distributed

    device = torch.device(args.device)
    rank, world = init_distributed(device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    variants = parse_variants(args.variants) if world > 1 else [("gem", dict(_VARIANT_DEFAULTS))]
    info = read_dataset_info(Path(args.data) / "train")

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()

    batches: list = []
    results = {}
    for name, options in variants:
        parallel = (
            ParallelConfig(
                dense="fsdp",
                expert_parallel=world,
                reshard_after_forward=options["reshard"] == "1",
                fsdp_all_gather_collective=options["ag"],
                sparse_plan=options["plan"],
            )
            if world > 1
            else ParallelConfig()
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
                attention_dtype=args.attention_dtype,
            ),
            optim=OptimConfig(warmup_steps=1),
            batch_size=args.batch_size,
            device=device.type,
            output_dir=args.workdir,
            parallel=parallel,
            compare_no_sequence=False,
        )
        trainer = _build_trainer(args, config, info, rank, name, options)
        if not batches:  # the same batches for every variant
            for batch in trainer.loader:
                batches.append(batch.to(device))
                if len(batches) == args.batches:
                    break
        tokens = [int(b.sequence_offsets[-1]) for b in batches]

        for step in range(args.warmup):  # Triton compilation, allocator and NCCL warm-up
            trainer.train_step(batches[step % len(batches)])
        sync()
        step_seconds = []
        trainer.clock.take()  # drop the warm-up steps' phase times
        trainer.clock.take_host()
        for step in range(args.steps):
            started = time.perf_counter()
            trainer.train_step(batches[step % len(batches)])  # ends with loss.item(): synced
            step_seconds.append(time.perf_counter() - started)
        # The loop feeds preloaded batches, so the clock's data phase is 0: left out.
        phase_ms = {
            k: 1e3 * v / args.steps for k, v in trainer.clock.take_host().items() if k != "data"
        }
        phase_ms["rest"] = 1e3 * sum(step_seconds) / args.steps - sum(phase_ms.values())
        device_ms = {
            k: 1e3 * v / args.steps for k, v in trainer.clock.take().items() if k != "data"
        }
        all_phase_ms = [None] * world
        dist.all_gather_object(all_phase_ms, phase_ms)
        all_device_ms = [None] * world
        dist.all_gather_object(all_device_ms, device_ms)
        sync()
        mine = torch.tensor([sum(step_seconds)], dtype=torch.float64, device=device)
        per_rank = [torch.zeros_like(mine) for _ in range(world)]
        dist.all_gather(per_rank, mine)
        rank_ms = [1e3 * t.item() / args.steps for t in per_rank]
        all_tokens = [None] * world
        dist.all_gather_object(all_tokens, tokens)
        stats = {}
        if args.profile and (world == 1 or name in args.profile_variants.split(",")):
            tag = f"w{world}" if world == 1 else f"w{world}_{name}"
            stats = _profile(
                trainer, batches, args.profile_steps, Path(args.profile), tag, rank, device
            )
            all_stats = [None] * world
            dist.all_gather_object(all_stats, stats)
            stats = {"per_rank": all_stats}
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
        step_seconds.sort()
        results[name] = {
            "world": world,
            "options": options,
            "ms_per_step": max(rank_ms),  # the slowest rank sets the pace
            "rank_ms_per_step": rank_ms,
            "median_ms_rank0": 1e3 * step_seconds[len(step_seconds) // 2],
            "samples_per_s": world
            * args.batch_size
            * args.steps
            / (max(rank_ms) / 1e3 * args.steps),
            "tokens_per_batch": sum(tokens) / len(tokens),
            "rank_tokens": all_tokens,
            "peak_gib_rank0": peak,
            "host_phase_ms": all_phase_ms,
            "device_phase_ms": all_device_ms,
            "layout": trainer.parallel.describe(),
            "plan": str(trainer.model.plan),
            "profile": stats,
        }
        if rank == 0:
            r = results[name]
            print(
                f"  world {world} {name} {options}: {r['ms_per_step']:.2f} ms/step"
                f" (ranks {', '.join(f'{t:.1f}' for t in rank_ms)})",
                flush=True,
            )
            for r, (ms, dev) in enumerate(zip(all_phase_ms, all_device_ms, strict=True)):
                print(f"    rank {r} host ms: " + ", ".join(f"{k} {v:.1f}" for k, v in ms.items()))
                print(
                    f"    rank {r} device ms: " + ", ".join(f"{k} {v:.1f}" for k, v in dev.items())
                )
        del trainer
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        sync()
    if rank == 0:
        Path(args.result).write_text(json.dumps(results))
    dist.destroy_process_group()


def _run_world(
    args: argparse.Namespace, world: int, workdir: Path, timeout: float, tag: str = ""
) -> dict:
    """Runs ``world`` worker processes (torchrun-style environment) and returns rank 0's result."""
    result = workdir / f"result{world}{tag}.json"
    port = _free_port()
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--result", str(result)]
    command += [
        f"--{k.replace('_', '-')}={v}"
        for k, v in vars(args).items()
        if k in _FORWARD and v is not None
    ]
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
    "attention_dtype",
    "batches",
    "warmup",
    "steps",
    "variants",
    "profile",
    "profile_steps",
    "profile_variants",
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
    parser.add_argument(
        "--attention-dtype",
        default="bfloat16",
        choices=["float32", "bfloat16"],
        help="q/k/v dtype of the sequence tower's attention: bfloat16 runs the Triton kernels, "
        "float32 the PyTorch reference (host-synchronising, CPU-bound on a GPU)",
    )
    parser.add_argument("--batches", type=int, default=4, help="distinct batches cycled over")
    parser.add_argument(
        "--warmup",
        type=int,
        default=4,
        help="untimed steps; >= --batches, so that every batch "
        "shape is seen (and compiled for) before timing",
    )
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument(
        "--variants",
        default=";".join(DEFAULT_VARIANTS),
        help="2-GPU layouts to time, ';'-separated 'name:key=value,...' (see the module doc)",
    )
    parser.add_argument(
        "--same-process",
        action="store_true",
        help="time all 2-GPU variants in one set of processes (faster, but later variants "
        "run slower than in a fresh process)",
    )
    parser.add_argument("--profile", help="folder for torch.profiler summaries and traces")
    parser.add_argument("--profile-steps", type=int, default=2)
    parser.add_argument(
        "--profile-variants", default="before,gem", help="2-GPU variants to profile (comma list)"
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
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
        if world == 1 or not args.same_process:
            # One set of processes per variant: building several trainers in one process slows
            # the later ones down (measured: 207 -> 220 -> 263 ms for three similar layouts).
            results[world] = {}
            for name, options in parse_variants(args.variants) if world > 1 else [("gem", {})]:
                spec = ",".join(f"{k}={v}" for k, v in options.items())
                single = argparse.Namespace(**{**vars(args), "variants": f"{name}:{spec}"})
                results[world].update(
                    _run_world(single, world, workdir, args.timeout, tag=f"_{name}")
                )
        else:
            results[world] = _run_world(args, world, workdir, args.timeout)
        for name, r in results[world].items():
            print(
                f"{world} GPU(s) {name}: {r['ms_per_step']:.2f} ms/step, "
                f"{r['samples_per_s']:.0f} samples/s ({r['layout']}, "
                f"peak {r['peak_gib_rank0']:.1f} GiB)",
                flush=True,
            )
    single = results[1]["gem"]
    case = (
        f"B{args.batch_size}/gpu xL{args.max_seq_len} d{args.embedding_dim} "
        f"seq{args.sequence_layers} dhen{args.dhen_layers}x{len(args.dhen_experts.split(','))}"
    )

    def row(case_name: str, provider: str, metric: str, value: float) -> dict:
        return {
            "case": case_name,
            "provider": provider,
            "mode": "fwd_bwd",
            "metric": metric,
            "value": value,
        }

    rows = []
    ratios = {}
    for name, r in results[2].items():
        provider = "gem" if name == "gem" else f"gem-{name}"
        ratios[name] = r["samples_per_s"] / (2 * single["samples_per_s"])
        rows.append(row(case, provider, "scaling_ratio", ratios[name]))
    rows.append(row(f"{case}/1gpu", "gem", "ms", single["ms_per_step"]))
    rows.append(row(f"{case}/1gpu", "gem", "samples_per_s", single["samples_per_s"]))
    for name, r in results[2].items():
        provider = "gem" if name == "gem" else f"gem-{name}"
        rows.append(row(f"{case}/2gpu", provider, "ms", r["ms_per_step"]))
        rows.append(row(f"{case}/2gpu", provider, "samples_per_s", r["samples_per_s"]))
    main_2gpu = results[2].get("gem") or next(iter(results[2].values()))
    device = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    block = meta(
        "train_scaling",
        "python benchmarks/bench_train_scaling.py " + " ".join(sys.argv[1:]),
        device=f"{max(worlds)}x {device}",
        layouts={"1": single["layout"], "2": main_2gpu["layout"]},
        variants={name: r["options"] for name, r in results[2].items()},
        tokens_per_batch=single["tokens_per_batch"],
        rank_tokens_2gpu=main_2gpu["rank_tokens"],
        rank_ms_2gpu={name: r["rank_ms_per_step"] for name, r in results[2].items()},
        host_phase_ms={"1": single["host_phase_ms"]}
        | {f"2/{name}": r["host_phase_ms"] for name, r in results[2].items()},
        device_phase_ms={"1": single["device_phase_ms"]}
        | {f"2/{name}": r["device_phase_ms"] for name, r in results[2].items()},
        peak_gib_rank0={"1": single["peak_gib_rank0"]}
        | {f"2/{name}": r["peak_gib_rank0"] for name, r in results[2].items()},
        profile={"1": single["profile"]}
        | {f"2/{name}": r["profile"] for name, r in results[2].items()},
        plan_2gpu=main_2gpu["plan"],
    )
    write_results(Path(args.output), block, rows)
    for name, ratio in ratios.items():
        print(f"scaling ratio {name}: {ratio:.3f}")
    print(f"-> {args.output}")


if __name__ == "__main__":
    main()
