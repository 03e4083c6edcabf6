"""One training step of GEM v1 on one GPU: our stack against the same model in plain PyTorch.

Providers, on the same batches (GEM-like lengths, about half the cap filled) and the same
torchrec tables with their fused row-wise Adagrad:

- ``gem``: ``gem_train.Trainer.train_steps`` of the ``h200`` recipe at the case's shape (our
  kernels as compiled operators, bf16 autocast, compiled regions, torchrec's
  ``TrainPipelineSparseDist``; FP8 linears at the FP8 shape ``B512xL2048xD1024``, as the
  ``h200-large`` recipe);
- ``baseline``: ``benchmarks/baseline_gem.BaselineGem`` (FlexAttention with a document +
  causal + window ``mask_mod``, GDPA as padded matmul + activation, ``nn.Linear``), bf16
  autocast, ``torch.compile`` of everything after the lookups, torchrec's DMP for the tables,
  fused AdamW for the dense parameters, as a capable user writes it;
- ablations: ``gem-eager`` (no compile), ``gem-nopipeline`` (``Trainer.train_step`` per
  batch: the lookups' input distribution inside the forward, and the loss read back after
  each step), ``gem-fp8`` (FP8 linears, as the ``h200-large``
  recipe; at the bf16 shapes); at the FP8 shape ``gem-bf16`` (without FP8),
  ``gem-full-ac`` (every region checkpointed) and ``gem-memory-budget`` (no region
  checkpointed, Inductor's one global budget instead), against the recipe's per-region choice.

The FP8 shape does not fit without activation checkpointing: gem checkpoints per region (the
``h200-large`` recipe: 'auto'), the baseline checkpoints each self-attention layer
(``torch.utils.checkpoint``, ``BaselineGem(checkpoint_layers=True)``), and ``gem-memory-budget``
keeps ``MEMORY_BUDGET`` of its activations (Inductor's ``activation_memory_budget``, one global
budget).

Metrics per case and provider: ``ms`` (mean of the timed steps, run back to back after one
untimed pass over every batch, so that no compile falls in the timed window),
``samples_per_s``, ``mfu`` (model FLOPs of the real lengths, ``gem_model.model_flops``, over
time x the GPU's datasheet bf16 dense peak: 989.4 TFLOP/s on an H200), ``local_mfu`` (the same
on one GPU: the scaling ratio is 1), ``mfu_measured`` (over a bf16 matmul's measured peak, also
in the meta) and ``peak_gib``; ``gem`` also gets its time split (``time_<phase>_ms``); every provider its
dynamo ``graphs``, ``graph_breaks`` and ``graphs_compiled_while_timed`` (0 in a sound timing)
and the CUDA allocator's ``alloc_retries`` while timed; and where its GPU time goes,
``kernel_<kind>_ms`` per step (GEMMs, attention, Inductor's fused kernels, eager ATen, embeddings,
copies, ...) and ``gpu_busy_ms`` from a profiled pass over two of the timed batches, and
``gpu_idle_ms``, the timed step less that busy time.
A provider that fails gets one row, metric ``oom`` or ``failed`` with its ``error``, and the
others still run.
Cases: ``B{batch}xL{max_len}xD{d_model}/{window256|causal}``.

    python benchmarks/bench_train.py [--cases B1024xL1024xD512/window256 ...] [--steps 10]
    # split over several calls (device time limits): the later ones with --append
"""

from __future__ import annotations

import dataclasses
import gc
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
from torch._dynamo.utils import counters
from torch._functorch import config as functorch_config
from torch.autograd import DeviceType

sys.path.insert(0, str(Path(__file__).resolve().parent))

from baseline_gem import BaselineGem  # noqa: E402
from gem_data import ShardedBatchLoader  # noqa: E402
from gem_model import model_flops  # noqa: E402
from gem_train.cli import configure, prepare_data  # noqa: E402
from gem_train.throughput import measured_matmul_peak, peak_tflops  # noqa: E402
from gem_train.trainer import Trainer, init_distributed, model_config  # noqa: E402
from harness import (  # noqa: E402
    earlier_rows,
    gpu_idle,
    kernel_ms_by_kind,
    meta,
    require_cuda,
    results_parser,
    user_args,
    write_results,
)
from torch.nn import functional as F  # noqa: E402
from torchrec import EmbeddingBagCollection, EmbeddingCollection  # noqa: E402
from torchrec.distributed import DistributedModelParallel  # noqa: E402
from torchrec.optim import RowWiseAdagrad  # noqa: E402
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward  # noqa: E402
from torchrec.optim.optimizers import in_backward_optimizer_filter  # noqa: E402

SHAPES = [(1024, 1024, 512), (256, 4096, 512), (2048, 512, 256), (512, 2048, 1024)]
FP8_SHAPE = (512, 2048, 1024)
# The FP8 shape's activations do not fit on one H200 (every provider ran out of memory at
# 56fcaa6). gem checkpoints per region ('auto' in the h200-large recipe, ``gem-full-ac``: every
# region, ``gem-memory-budget``: Inductor's partitioner given one global budget, the fraction of
# the activations to keep). The baseline checkpoints its self-attention layers, as a user
# would: with the global budget instead, torch 2.11's Inductor failed to lower the recomputed
# FlexAttention ("convert FlexibleLayout to FixedLayout first", ff002a3).
MEMORY_BUDGET = 0.5
DEFAULT_PROVIDERS = ["gem", "baseline", "gem-eager", "gem-nopipeline"]
FP8_SHAPE_ABLATIONS = ["gem-bf16", "gem-full-ac", "gem-memory-budget"]
MASKS = {"window256": 256, "causal": 0}


def _cases() -> list[str]:
    return [f"B{b}xL{n}xD{d}/{mask}" for b, n, d in SHAPES for mask in MASKS]


def _parse(case: str) -> tuple[int, int, int, int]:
    shape, mask = case.split("/")
    b, n, d = (int(part[1:]) for part in shape.split("x"))
    return b, n, d, MASKS[mask]


def _config(case: str, steps: int, data_root: Path, **changes):
    batch, max_len, dim, window = _parse(case)
    fp8 = (batch, max_len, dim) == FP8_SHAPE
    config = configure(
        "h200-large" if fp8 else "h200",
        [
            f"batch_size={batch}",
            f"data.max_seq_len={max_len}",
            f"data.num_train={batch * steps}",
            "data.num_eval=128",
            f"data.directory={data_root / f'B{batch}xL{max_len}'}",
            f"model.embedding_dim={dim}",
            f"model.num_heads={dim // 128}",
            f"model.attention_window={window}",
            "checkpoint_every=0",
        ],
    )
    return dataclasses.replace(config, **changes)


def _time_steps(run, batches, device) -> tuple[float, float, int]:
    """Mean milliseconds per step of ``run(batches)`` (one step per batch, back to back: the
    host may run ahead into the next step, as in training), the peak GiB allocated and the
    CUDA allocator's retries (a fragmented cache freed to retry an allocation: each one
    syncs)."""
    torch.cuda.reset_peak_memory_stats(device)
    torch.cuda.synchronize(device)
    retries = torch.cuda.memory_stats(device).get("num_alloc_retries", 0)
    started = time.perf_counter()
    run(batches)
    torch.cuda.synchronize(device)
    ms = (time.perf_counter() - started) * 1e3 / len(batches)
    retries = torch.cuda.memory_stats(device).get("num_alloc_retries", 0) - retries
    return ms, torch.cuda.max_memory_allocated(device) / 2**30, retries


def _kernel_split(run, batches, device, step_ms: float) -> dict[str, float]:
    """GPU kernel milliseconds per step by kind (``harness.kernel_kind``) over ``batches``, and
    the GPU's busy milliseconds per step (kernels and copies, streams merged), from a profiler
    pass after the timed one; ``gpu_idle_ms`` is the timed ``step_ms`` less that busy time,
    what the timed steps waited for the host. (The profiled pass's own gaps would count the
    profiler's host overhead and, over two batches, the train pipeline's fill.)"""
    torch.cuda.synchronize(device)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profiler:
        run(batches)
        torch.cuda.synchronize(device)
    events = [
        event
        for event in profiler.events()
        if event.device_type == DeviceType.CUDA and not event.is_user_annotation
    ]
    kernels = [(event.name, event.time_range.elapsed_us()) for event in events]
    intervals = [(event.time_range.start, event.time_range.end) for event in events]
    span_us = max(end for _, end in intervals) - min(start for start, _ in intervals)
    busy_ms = (span_us - sum(end - start for start, end in gpu_idle(intervals))) / 1e3
    busy_ms /= len(batches)
    return {
        **{
            f"kernel_{kind}_ms": ms for kind, ms in kernel_ms_by_kind(kernels, len(batches)).items()
        },
        "gpu_busy_ms": busy_ms,
        "gpu_idle_ms": max(step_ms - busy_ms, 0.0),
    }


def _per_batch(step, device):
    """Runs ``step`` on each batch, copied to ``device`` just before."""
    return lambda batches: [step(batch.to(device, non_blocking=True)) for batch in batches]


def _baseline(config, info, device, checkpoint_layers: bool):
    """The plain-PyTorch steps: DMP tables with the fused sparse optimizer, compiled dense."""
    with device:
        model = BaselineGem(
            model_config(config, info, use_sequence_tower=True),
            torch.device("meta"),
            checkpoint_layers=checkpoint_layers,
        )
    tables = [
        p
        for m in model.modules()
        if isinstance(m, EmbeddingBagCollection | EmbeddingCollection)
        for p in m.parameters()
    ]
    apply_optimizer_in_backward(RowWiseAdagrad, tables, {"lr": config.optim.sparse_lr})
    # Inductor's mix-order reduction (fusing the row and column reductions of a norm's
    # backward) mis-sizes its workspace when the token count is dynamic in torch 2.11 ("shape
    # '[4120, 512]' is invalid for input of size 1" in the backward on the H200); a user hits
    # it and turns that one fusion off.
    model.compile(options={"triton.mix_order_reduction": False})
    # One GPU: no data-parallel wrapper (as gem's trainer); DDP would reduce nothing.
    dmp = DistributedModelParallel(model, device=device, init_data_parallel=False)
    dense = dict(in_backward_optimizer_filter(dmp.named_parameters()))
    optimizer = torch.optim.AdamW(dense.values(), lr=config.optim.dense_lr, fused=True)

    def step(batch) -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = dmp(batch.sequence_features, batch.sparse_features, batch.dense_features)
            loss = F.binary_cross_entropy_with_logits(logits, batch.labels, reduction="none")
        optimizer.zero_grad(set_to_none=True)
        loss.mean(0).sum().backward()
        torch.nn.utils.clip_grad_norm_(dense.values(), config.optim.max_grad_norm, foreach=True)
        optimizer.step()

    return _per_batch(step, device)


def _rows(case, provider, ms, peak, flops, batch_size, peaks, extra=None) -> list[dict]:
    """``peaks``: (datasheet, measured) bf16 dense peaks in TFLOP/s."""
    tflops = flops / (ms / 1e3) / 1e12
    mfu = tflops / peaks[0]
    metrics = {
        "ms": ms,
        "samples_per_s": batch_size / ms * 1e3,
        "mfu": mfu,
        "local_mfu": mfu,
        "mfu_measured": tflops / peaks[1],
        "peak_gib": peak,
        **(extra or {}),
    }
    return [
        {"case": case, "provider": provider, "mode": "fwd_bwd_step", "metric": k, "value": v}
        for k, v in metrics.items()
    ]


def main() -> None:
    parser = results_parser(__doc__, "h200/train.json")
    parser.add_argument("--cases", nargs="+", default=_cases(), choices=_cases())
    parser.add_argument("--steps", type=int, default=10, help="timed steps per provider")
    parser.add_argument(
        "--warmup",
        type=int,
        default=4,
        help="untimed batches (compiles); the timed batches also run once untimed first",
    )
    parser.add_argument(
        "--providers",
        nargs="+",
        choices=[*DEFAULT_PROVIDERS, "gem-fp8", *FP8_SHAPE_ABLATIONS],
        help=f"default: {' '.join(DEFAULT_PROVIDERS)}, and {' '.join(FP8_SHAPE_ABLATIONS)} "
        "instead of gem-eager at the FP8 shape",
    )
    parser.add_argument(
        "--append",
        action="store_true",
        help="keep the rows already in --out (same commit) that this invocation does not redo "
        "(its cases; with --providers, only those providers of them): one file from several "
        "invocations",
    )
    args = parser.parse_args()
    require_cuda()
    device = torch.device("cuda")
    init_distributed(device)  # torchrec's DMP needs a group, also for the baseline alone
    rows: list[dict] = []
    command = "python benchmarks/bench_train.py " + " ".join(user_args())
    # MFU against this GPU's datasheet bf16 dense peak, and beside it a measured matmul peak.
    peaks = (peak_tflops(device), measured_matmul_peak(device))
    if peaks[0] is None:
        raise SystemExit(f"no datasheet bf16 peak for {torch.cuda.get_device_name()}: no MFU")
    run_meta = meta(
        "train", command, device=torch.cuda.get_device_name(), peak_tflops=peaks[0],
        measured_peak_tflops=peaks[1],
    )  # fmt: skip
    earlier: list[dict] = []
    if args.append:
        run_meta, earlier = earlier_rows(Path(args.out), run_meta, args.cases, args.providers)
    data_root = Path(tempfile.mkdtemp(prefix="bench-train-"))
    for case in args.cases:
        total = args.warmup + args.steps
        config = _config(case, total, data_root)
        info, _ = prepare_data(config.data, progress=False)
        # Pinned, as the trainer's loader gives them: the copies are asynchronous.
        loader = ShardedBatchLoader(info.directory, config.batch_size, seed=0)
        batches = [batch.pin_memory() for batch in list(loader)[:total]]
        flops = statistics.mean(
            model_flops(model_config(config, info, use_sequence_tower=True),
                        b.sequence_offsets.diff()).total
            for b in batches[args.warmup:]
        )  # fmt: skip
        fp8_shape = _parse(case)[:3] == FP8_SHAPE
        providers = args.providers or (
            [*DEFAULT_PROVIDERS[:2], *FP8_SHAPE_ABLATIONS] if fp8_shape else DEFAULT_PROVIDERS
        )
        for provider in providers:
            changes = {"compile": False} if provider == "gem-eager" else {}
            if provider in ("gem-bf16", "gem-fp8"):
                mode = provider.removeprefix("gem-")
                changes["precision"] = dataclasses.replace(config.precision, mode=mode)
            if provider == "gem-full-ac":
                changes["activation_checkpointing"] = "full"
            global_budget = provider == "gem-memory-budget"
            if global_budget:
                changes["activation_checkpointing"] = "none"
            memory_budget = MEMORY_BUDGET if fp8_shape and global_budget else 1.0
            functorch_config.activation_memory_budget = memory_budget
            extra, run, trainer = {}, None, None
            counters.clear()
            try:
                if provider == "baseline":
                    run = _baseline(config, info, device, checkpoint_layers=fp8_shape)
                else:
                    trainer = Trainer(
                        dataclasses.replace(config, **changes),
                        info,
                        output_dir=data_root / "runs" / provider,
                    )
                    run = (
                        _per_batch(trainer.train_step, device)
                        if provider == "gem-nopipeline"
                        else trainer.train_steps
                    )
                # Untimed: the warm-up batches, then the timed ones, so that no compile falls in
                # the timed window (Triton compiles a kernel again for each new divisibility of
                # a batch-dependent int argument, such as the token count).
                _time_steps(run, batches, device)
                if provider != "baseline":
                    trainer.clock.take()
                graphs = counters["stats"]["unique_graphs"]
                ms, peak, retries = _time_steps(run, batches[args.warmup :], device)
                # What makes a timing suspect: graphs compiled while timed, graph breaks,
                # allocator retries.
                extra = {
                    "alloc_retries": retries,
                    "graphs": counters["stats"]["unique_graphs"],
                    "graphs_compiled_while_timed": counters["stats"]["unique_graphs"] - graphs,
                    "graph_breaks": sum(counters["graph_break"].values()),
                }
                if global_budget:
                    extra["activation_memory_budget"] = memory_budget
                if provider == "baseline":
                    layers = config.model.num_sequence_layers if fp8_shape else 0
                    extra["checkpointed_layers"] = layers
                else:
                    extra["checkpointed_regions"] = len(trainer.checkpointed)
                    split = trainer.clock.take()
                    extra |= {f"time_{k}_ms": v / args.steps * 1e3 for k, v in split.items()}
                extra |= _kernel_split(run, batches[args.warmup :][:2], device, ms)
            except Exception as error:
                # Out of memory, or a compile error: the row says which; the others still run.
                metric = "oom" if isinstance(error, torch.OutOfMemoryError) else "failed"
                traceback.print_exc()
                rows.append({"case": case, "provider": provider, "mode": "fwd_bwd_step",
                             "metric": metric, "value": 1.0,
                             "error": f"{type(error).__name__}: {str(error)[:400]}"})  # fmt: skip
                write_results(Path(args.out), run_meta, earlier + rows)
                continue
            finally:
                run = trainer = None
                torch.compiler.reset()  # the next provider compiles from scratch, as alone
                # A failed step's frames and the trainer's module cycles hold device memory
                # until collected: without this the next provider starts with it in use.
                gc.collect()
                torch.cuda.empty_cache()
            new = _rows(case, provider, ms, peak, flops, config.batch_size, peaks, extra)
            rows += new
            write_results(Path(args.out), run_meta, earlier + rows)  # a crash keeps these
            values = {r["metric"]: r["value"] for r in new}
            print(f"{case:28s} {provider:10s} {values['ms']:8.1f} ms "
                  f"{values['samples_per_s']:9.0f} samples/s  MFU {values['mfu']:.3f}  "
                  f"peak {values['peak_gib']:.1f} GiB {extra}", flush=True)  # fmt: skip
    write_results(Path(args.out), run_meta, earlier + rows)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
