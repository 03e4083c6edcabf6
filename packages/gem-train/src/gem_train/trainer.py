"""The training loop: torchrec-sharded GEM model, dense AdamW + fused sparse optimizer, NE/AUC eval."""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import datetime
import itertools
import json
import math
import os
import sys
import tempfile
import time
from collections import deque
from collections.abc import Generator, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from gem_data import Batch, DatasetInfo, DevicePrefetcher, ParquetBatchLoader, ShardedBatchLoader
from gem_model import GemModel, GemModelConfig, model_flops
from gem_precision import load_rounding_state, rounding_state
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from torch import nn
from torch._dynamo.utils import counters as dynamo_counters
from torch.nn import functional as F
from torch.utils.tensorboard import SummaryWriter
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from gem_train.checkpoint import (
    CheckpointMismatchError,
    IncompleteCheckpointError,
    find_resumable,
    load_checkpoint,
    read_trainer_state,
    save_checkpoint,
)
from gem_train.checkpointing import (
    RegionCost,
    checkpoint_module,
    choose_regions,
    measure_regions,
)
from gem_train.config import TrainConfig
from gem_train.metrics import auc, json_ready, normalized_entropy
from gem_train.parallel import DenseParallel, SparseParallel
from gem_train.precision import SavedActivations, apply_precision, autocast
from gem_train.profiling import OPTIMIZER_SCOPE, ProfilePass
from gem_train.throughput import StepClock, measured_matmul_peak, peak_tflops

__all__ = ["Trainer", "init_distributed", "resolve_device"]

_TASK_LABEL_COLUMNS = {"ctr": 0, "cvr": 1}


def resolve_device(name: str) -> torch.device:
    """'auto' -> CUDA when available, else CPU; 'cuda' without a GPU is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was requested but torch sees no CUDA device")
    if name not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {name!r}")
    return torch.device(name)


DIST_TIMEOUT_S = 1800.0
"""Default seconds a collective waits for the other ranks before it fails (``GEM_DIST_TIMEOUT_S``
in the environment overrides it): long enough for rank 0 generating the data or a large
checkpoint while the others wait, short enough that a stuck or dead rank ends the job."""


def dist_timeout_s() -> float:
    """The process-group timeout: ``GEM_DIST_TIMEOUT_S`` when set (seconds > 0), else
    ``DIST_TIMEOUT_S``."""
    value = os.environ.get("GEM_DIST_TIMEOUT_S")
    if value is None:
        return DIST_TIMEOUT_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"GEM_DIST_TIMEOUT_S must be a number of seconds > 0, got {value!r}")
    return seconds


def _end_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def init_distributed(device: torch.device, *, timeout_s: float | None = None) -> tuple[int, int]:
    """Joins the process group torchrun describes, or starts a one-process group.

    torchrec's sharded modules always need a process group, even alone.
    Returns ``(rank, world_size)``.

    Every collective fails after ``timeout_s`` (default: ``dist_timeout_s()``) instead of
    waiting forever for a rank that died or hangs: gloo raises in the waiting call (a peer that
    died also closes its connections, which fails the call at once). NCCL work runs on CUDA
    streams that no Python call can interrupt: ``TORCH_NCCL_ASYNC_ERROR_HANDLING=3`` (unless
    set; torch's default, made explicit since 0 would hang) has the NCCL watchdog end the
    process when a collective times out or fails, without first aborting the communicators
    (mode 1 does, which can itself hang).

    A gloo group started here is ended at the interpreter's exit if it is still open: left to
    the interpreter's teardown, gloo's worker threads can abort the process. Ending a gloo
    group is local to the rank, so this is safe after any error. Ending an NCCL group may wait
    for the other ranks, so its owner ends it after a successful run (the CLI does).
    """
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=dist_timeout_s() if timeout_s is None else timeout_s)
        if backend == "nccl":
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
        else:
            atexit.register(_end_process_group)
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend, timeout=timeout)
        else:
            store = dist.FileStore(os.path.join(tempfile.mkdtemp(prefix="gem-train-"), "store"), 1)
            dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return dist.get_rank(), dist.get_world_size()


def model_config(
    config: TrainConfig, dataset: DatasetInfo, *, use_sequence_tower: bool
) -> GemModelConfig:
    """The model config for ``dataset``'s features and the recipe's model options."""
    return GemModelConfig(
        sequence_features=dict(dataset.sequence_features),
        sparse_features=dict(dataset.sparse_features),
        num_dense_features=dataset.num_dense_features,
        max_seq_len=dataset.max_seq_len,
        use_sequence_tower=use_sequence_tower,
        task_base_rates=tuple(dataset.label_means[task] for task in ("ctr", "cvr"))
        if dataset.label_means
        else None,
        architecture=config.model,
    )


def compile_modules(modules: Iterable[nn.Module], **options: Any) -> None:
    """``module.compile(**options)`` for each of ``modules``, every one of them compiled.

    Compiled modules share one dynamo frame (the wrapper of the module call), whose cache keeps
    an entry per module type and shape class: past ``torch._dynamo.config.recompile_limit``
    (8) entries, the remaining modules run eager, with only a log warning. The limit is raised
    to two entries per module (room for a second shape class, such as a smaller last batch)."""
    modules = list(modules)
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, 2 * len(modules))
    for module in modules:
        module.compile(**options)


class _Pipeline(TrainPipelineSparseDist):
    """torchrec's sparse-dist train pipeline with the trainer's forward, backward and
    optimizer step.

    Each ``progress`` trains batch i while batch i + 1's lookup inputs are distributed (the
    splits all-to-all before the forward, the tensors after it; on CUDA on a side stream) and
    batch i + 2 is copied to the device: the input distribution, which syncs the host with
    the device when it runs inside the forward, overlaps the step before. GemModel computes
    the tables' inputs in a parameter-free module, which the pipeline runs ahead with the
    input distribution (``pipeline_postproc``). Not the semi-sync variant: it looks batch
    i + 1 up before step i updates the tables, which a resumed run could not repeat.
    """

    def __init__(self, trainer: Trainer) -> None:
        super().__init__(
            trainer.model,
            _OptimizerStep(trainer),
            trainer.device,
            execute_all_batches=True,
            pipeline_postproc=True,
            custom_model_fwd=trainer._pipelined_forward,
        )
        self._trainer = trainer

    def _backward(self, losses: torch.Tensor) -> None:
        self._trainer._backward(losses)


class _OptimizerStep:
    """The optimizer as the pipeline calls it (``zero_grad``, then ``step`` after backward):
    the trainer's whole step, with the clip and the 2D sparse sync. torchrec 1.6 (the GPU
    image's) calls ``optimizer.step()`` itself, with no method to override."""

    def __init__(self, trainer: Trainer) -> None:
        self.zero_grad = trainer.optimizer.zero_grad
        self.step = trainer._optimizer_step


@dataclasses.dataclass
class _Window:
    """What the steps since the last train log line did on this rank."""

    started: float = dataclasses.field(default_factory=time.perf_counter)
    losses: list[float] = dataclasses.field(default_factory=list)
    """Read at the log line: the steps' losses stay on the device until then."""
    paused: float = 0.0
    """Seconds spent saving checkpoints, left out of the throughput."""
    flops: float = 0.0
    tokens: int = 0


class Trainer:
    """Trains one GEM model variant and evaluates it.

    Embedding tables are sharded by torchrec's ``DistributedModelParallel`` and
    updated by a fused row-wise Adagrad inside the backward pass; dense
    parameters use AdamW. ``output_dir`` receives ``metrics.jsonl`` and ``checkpoints/``.
    """

    def __init__(
        self,
        config: TrainConfig,
        train_data: DatasetInfo,
        *,
        use_sequence_tower: bool = True,
        output_dir: str | Path,
    ) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self.rank, self.world_size = init_distributed(self.device)
        self.output_dir = Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.use_sequence_tower = use_sequence_tower

        torch.manual_seed(config.seed)
        self.model_config = model_config(config, train_data, use_sequence_tower=use_sequence_tower)
        # Dense layers are created on the training device; tables stay on "meta" until
        # DistributedModelParallel materialises each shard where the plan puts it.
        with self.device:
            model = GemModel(self.model_config, device=torch.device("meta"))
        # FP8 / bf16 GEMMs for the dense linears (shares parameters, so order vs DMP is free).
        self.precision_converted = apply_precision(model, config.precision, self.device)
        # Dense part: DDP (torchrec's default) or FSDP2, plus expert parallelism for DHEN.
        self.parallel = DenseParallel(config.parallel, self.device)
        model = self.parallel.prepare(model)
        # Tables (row-wise Adagrad): 1D torchrec DMP, 2D or fully sharded 2D (parallel.sparse).
        self.sparse_parallel = SparseParallel(config.parallel, self.device)
        self.model: DistributedModelParallel = self.sparse_parallel.shard(
            model, self.parallel, config.optim.sparse_lr
        )
        # MXFP8 storage of the dense activations saved for backward (precision.saved_activations).
        self.saved_activations = SavedActivations(self.model, config.precision)
        dense_parameters = {
            name: p
            for name, p in in_backward_optimizer_filter(self.model.named_parameters())
            if not self.sparse_parallel.is_table(p)
        }
        self.dense_parameters = list(dense_parameters.values())
        self.dense_optimizer = KeyedOptimizerWrapper(
            dense_parameters,
            lambda params: torch.optim.AdamW(
                self.parallel.param_groups(params),
                lr=config.optim.dense_lr,
                weight_decay=config.optim.weight_decay,
                # One fused kernel per group on CUDA: the foreach path dispatches a dozen ops
                # per step, each through DTensor for the FSDP-sharded parameters.
                fused=self.device.type == "cuda",
            ),
        )
        self.optimizer = CombinedOptimizer(
            [("dense", self.dense_optimizer), self.model.fused_optimizer]
        )

        # Streams row groups, merges 128-sample sub-batches with Base Batch Shuffling so ranks
        # get balanced attention cost, and resumes exactly from its state.
        self.loader = ShardedBatchLoader(
            train_data.directory,
            config.batch_size,
            shuffle=True,
            seed=config.seed,
            rank=self.rank,
            world_size=self.world_size,
            drop_last=True,
            on_bad_row=config.data.on_bad_row,
        )
        steps_per_epoch = len(self.loader)
        if steps_per_epoch == 0:
            raise ValueError(
                f"batch_size={config.batch_size} leaves no full batch per rank in {train_data.directory}"
            )
        # A background thread collates the next batches (pinned on CUDA) while steps run;
        # torchrec's train pipeline (``_Pipeline``) then copies each to the device on a side
        # stream and distributes its lookups' inputs during the step before its own.
        self._batches = DevicePrefetcher(
            self.loader, "cpu", depth=2, pin_memory=self.device.type == "cuda"
        )
        # Per batch drawn by the pipeline and not yet trained on: the loader state after it
        # (None for batches given to train_steps). The pipeline reads two batches ahead.
        self._queued: deque[dict | None] = deque()
        self._position: dict | None = None  # the loader state after the last trained batch
        self._step_lengths: torch.Tensor | None = None  # host history lengths of the last step
        self._unread: list[torch.Tensor] = []  # the losses of the steps issued, still on device
        self._losses: list[float] = []  # the losses read since the last _take_losses
        self.total_steps = config.max_steps or config.epochs * steps_per_epoch
        self.step = 0
        self._metrics_file = self.output_dir / "metrics.jsonl"
        self._tensorboard: SummaryWriter | None = None  # rank 0, opened by the first log line
        # Phase times of every step; MFU against the datasheet and the measured bf16 peak.
        self.clock = StepClock(self.device)
        self.peak_tflops = peak_tflops(self.device)
        self.measured_peak_tflops: float | None = None
        self.profile: dict | None = None
        """The per-region table of ``fit(profile=True)`` (see ``gem_train.profiling``)."""
        #: The last train log record of :meth:`fit` (throughput, MFU, time split).
        self.last_speed: dict | None = None
        self.last_window_steps = 0  # the number of steps last_speed covers
        self._alloc_retries = 0  # the CUDA allocator's count at the last train log line
        self._graphs = dynamo_counters["stats"]["unique_graphs"]  # at the last train log line
        self._regions_ready = False
        self.checkpointed: list[str] = []
        """Qualified names of the modules that recompute their forward in backward."""
        self.region_costs: list[RegionCost] = []
        """'auto' activation checkpointing: what each region module costs and frees."""

    # ------------------------------------------------------------------ training
    def _forward(self, batch: Batch) -> torch.Tensor:
        with autocast(self.config.precision, self.device):
            return self.model(batch)

    def _dense_region_modules(self) -> dict[str, nn.Module]:
        """The dense regions' modules by qualified name (torchrec's lookups excluded)."""
        inner = self.model.module  # the GemModel inside DMP (and DDP / FSDP)
        names = {id(module): name for name, module in inner.named_modules()}
        return {
            names[id(module)]: module
            for region, modules in inner.regions().items()
            if region != "embeddings"
            for module in modules
        }

    def _prepare_regions(self, batch: Batch) -> None:
        """Before the first step: activation checkpointing (measured on ``batch`` for
        'auto'), then ``torch.compile`` of each dense region module."""
        config = self.config
        modules = self._dense_region_modules()
        if config.activation_checkpointing == "full":
            self.checkpointed = list(modules)
        elif config.activation_checkpointing == "auto":
            # A forward without backward: no weight moves (the sparse optimizer runs in
            # backward); the RNG is restored so the step after it draws what it would have.
            rng = torch.random.get_rng_state()
            cuda_rng = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
            costs = measure_regions(self.model, modules, lambda: self._forward(batch))
            torch.random.set_rng_state(rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state(cuda_rng, self.device)
            self.region_costs = costs
            self.checkpointed = choose_regions(costs, int(config.activation_budget_gib * 2**30))
        for name in self.checkpointed:
            checkpoint_module(modules[name])
        if config.compile:
            compile_modules(modules.values())
        self._regions_ready = True

    def _set_lr(self) -> None:
        lr = self.config.optim.dense_lr_at(self.step, self.total_steps)
        for group in self.dense_optimizer.param_groups:
            group["lr"] = lr

    def _loss(self, batch: Batch) -> torch.Tensor:
        """The step's forward: the summed CTR + CVR log loss of ``batch``."""
        with self.saved_activations.step():
            logits = self._forward(batch)
            loss = (
                F.binary_cross_entropy_with_logits(logits, batch.labels, reduction="none")
                .mean(0)
                .sum()
            )
        self.clock.mark("forward")
        return loss

    def _backward(self, loss: torch.Tensor) -> None:
        loss.backward()  # the fused sparse optimizer updates embedding rows here
        self.clock.mark("backward")

    def _optimizer_step(self) -> None:
        with torch.profiler.record_function(OPTIMIZER_SCOPE):
            # Expert gradients averaged over their replicas, then the global-norm clip.
            self.parallel.finish_gradients(self.dense_parameters, self.config.optim.max_grad_norm)
            self.sparse_parallel.step()  # 2D replica sync / fully sharded 2D table update
            self.dense_optimizer.step()
        self.clock.mark("optimizer")

    def _finish_step(self, loss: torch.Tensor) -> None:
        # The loss stays on the device until it is read (at a log line, a checkpoint or the end
        # of the steps): a read per step would leave the GPU idle while the host issues the
        # next step, and checking before backward would also stall it while backward is issued.
        self.clock.finish()
        self._unread.append(loss.detach())
        self.step += 1

    def _read_losses(self) -> None:
        """Reads the losses of the steps not read yet (one host sync) into ``self._losses``.

        A non-finite loss has updated the weights by now (and so have the steps issued after
        it): training stops here, before any checkpoint holds them, and resumes from the last
        (atomic) checkpoint. ``self.step`` then counts the steps before it."""
        if not self._unread:
            return
        waiting = time.perf_counter()
        values = torch.stack(self._unread).tolist()
        self.clock.wait(time.perf_counter() - waiting)
        first = self.step - len(self._unread)
        self._unread.clear()
        for offset, value in enumerate(values):
            if not math.isfinite(value):
                self.step = first + offset
                raise FloatingPointError(
                    f"loss became {value} at step {first + offset}; resume from the last "
                    "checkpoint before it, if one was saved"
                )
        self._losses += values

    def _take_losses(self) -> list[float]:
        """The losses of the steps since the last call, read."""
        self._read_losses()
        losses, self._losses = self._losses, []
        return losses

    def train_step(self, batch: Batch) -> float:
        """One optimizer step on ``batch`` (on the device) without the train pipeline: the
        lookups' input distribution runs inside the forward, and on a GPU it waits for the
        device there. :meth:`fit` and :meth:`train_steps` pipeline it. Returns the summed CTR
        + CVR log loss of the batch."""
        if not self._regions_ready:
            self._prepare_regions(batch)
        self.model.train()
        self._set_lr()
        self.clock.start()
        loss = self._loss(batch)
        self.optimizer.zero_grad()
        self._backward(loss)
        self._optimizer_step()
        self._finish_step(loss)
        return self._take_losses()[-1]

    def _pipelined_forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """The train pipeline's forward of the batch it trains on (``custom_model_fwd``)."""
        state = self._queued.popleft()
        if state is not None:
            self._position = state
        self._step_lengths = batch.sequence_offsets.diff()  # host offsets: no device sync
        loss = self._loss(batch)
        return loss, loss.detach()

    def _timed(self, batches: Iterator[tuple[Batch, dict | None]]) -> Iterator[Batch]:
        """The pipeline's feed: ``batches`` with each one's loader state queued (None: not
        the loader's) and the wait for it timed as the step's data phase. The pipeline draws
        batch i + 2 early in step i, after its zero_grad and the start of batch i + 1's input
        distribution: that part counts as the forward."""
        while True:
            self.clock.mark("forward")
            item = next(batches, None)
            self.clock.mark("data")
            if item is None:
                return
            batch, state = item
            self._queued.append(state)
            yield batch

    def _loader_batches(self) -> Iterator[tuple[Batch, dict | None]]:
        self._position = self.loader.state_dict()  # before the prefetch thread reads on
        for batch in self._batches:
            yield batch, self._batches.state_dict()

    def _steps(self, feed: Generator[Batch, None, None]) -> Iterator[None]:
        """Trains on ``feed``'s batches through a train pipeline, yielding once each step is
        issued (its loss left unread), until ``feed`` is spent or the caller stops (``close()``).

        Then the batches read ahead are dropped and the loader goes back to the position after
        the last batch trained on: the next call reads them again. (Taking the model back
        from torchrec's pipeline with batches in flight and giving it again later starts their
        input distribution twice, which does not match across ranks.) The model is its own
        again: ``self.model`` can be called, and evaluated, directly."""
        first = next(feed, None)
        if first is None:
            return
        if not self._regions_ready:  # compile and checkpoint before torchrec traces the model
            self._prepare_regions(first.to(self.device))
        source = itertools.chain([first], feed)
        pipeline = _Pipeline(self)
        self.model.train()
        try:
            while True:
                self._set_lr()
                self.clock.start()
                try:
                    loss = pipeline.progress(source)
                except StopIteration:
                    return
                self._finish_step(loss)
                yield
        finally:
            pipeline.detach()
            feed.close()  # and with it the loader's prefetch thread
            self._queued.clear()
            if self._position is not None:
                self.loader.load_state_dict(self._position)

    def train_steps(self, batches: Iterable[Batch]) -> list[float]:
        """One optimizer step per batch of ``batches`` (on the host; pinned on CUDA, so that
        their copies overlap the steps), through torchrec's train pipeline as in :meth:`fit`;
        returns the losses. The loader's position does not move. The host reads the losses
        back once, at the end, and may run ahead of the device until then."""
        for _ in self._steps(self._timed((batch, None) for batch in batches)):
            pass
        return self._take_losses()

    def fit(
        self,
        *,
        checkpoint_dir: str | Path | None = None,
        progress: bool | None = None,
        profile: bool = False,
    ) -> list[float]:
        """Trains until ``total_steps``; returns the per-step losses of this call.

        ``profile``: a profiler pass over 3 steps, after the first 5 of this call (compiles
        and allocator warm-up) or the last 3 of a shorter run: ``profile.json`` (the
        per-region table, also in :attr:`profile`) and the Chrome trace ``trace.json`` in
        ``output_dir``. Training is unchanged: the profiler only observes."""
        config = self.config
        checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir else self.output_dir / "checkpoints"
        show = sys.stdout.isatty() if progress is None else progress
        losses: list[float] = []
        if self.measured_peak_tflops is None:
            self.measured_peak_tflops = measured_matmul_peak(self.device)
        self.clock.take()
        window = _Window()  # the steps since the last train log line, on this rank
        profile_from = max(self.step, min(self.step + 5, self.total_steps - 3))
        # Fewer than 3 steps left: the pass covers those it has (none: no pass).
        profile_steps = min(3, self.total_steps - profile_from)
        profiled = (
            ProfilePass(
                self.output_dir,
                self.device,
                self.peak_tflops,
                steps=profile_steps,
                write=self.rank == 0,
            )  # fmt: skip
            if profile and profile_steps > 0
            else None
        )
        label = "GEM" if self.use_sequence_tower else "GEM without sequence"
        with Progress(
            TextColumn(f"[bold]{label}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]:.4f}"),
            TimeRemainingColumn(),
            disable=not show or self.rank != 0,
        ) as bar:
            task = bar.add_task(
                "train", total=self.total_steps, completed=self.step, loss=float("nan")
            )
            while self.step < self.total_steps:  # an epoch per pass
                if profiled is not None and self.step == profile_from:
                    profiled.begin()
                with contextlib.closing(self._steps(self._timed(self._loader_batches()))) as steps:
                    for _ in steps:
                        lengths = self._step_lengths
                        flops = model_flops(self.model_config, lengths)
                        window.flops += flops.total
                        window.tokens += int(lengths.sum())
                        if profiled is not None and profiled.active:
                            profiled.after_step(flops)
                            self.profile = profiled.result
                        bar.update(task, advance=1)
                        if self.step % config.log_every == 0 or self.step == self.total_steps:
                            window.losses = self._take_losses()
                            losses += window.losses
                            bar.update(task, loss=window.losses[-1])
                            ended = time.perf_counter()
                            self.last_speed = self._speed(window, ended)
                            self.last_window_steps = len(window.losses)
                            self.log(split="train", step=self.step, **self.last_speed)
                            # The next window starts where this one ended: the log line's own
                            # time (a gather, a file and TensorBoard write) is training time.
                            window = _Window(started=ended)
                        if config.checkpoint_every and self.step % config.checkpoint_every == 0:
                            # The queued steps finish first, inside the window: training time.
                            self._read_losses()
                            saving = time.perf_counter()
                            self.save(checkpoint_dir)
                            window.paused += time.perf_counter() - saving  # not training time
                        if self.step >= self.total_steps:
                            break
                        if profiled is not None and self.step == profile_from:
                            profiled.begin()
        return losses + self._take_losses()

    def _speed(self, window: _Window, ended: float) -> dict[str, float | None]:
        """The train log line of ``window`` (which ``ended`` then, ``time.perf_counter()``):
        loss, throughput, MFU, time split, memory.

        ``model_tflop`` is a GPU's model TFLOP per step (``gem_model.model_flops``: forward +
        backward from the real history lengths; on several ranks the mean over them); ``mfu``
        divides the achieved model TFLOP/s per GPU by its bf16 dense datasheet peak
        (``mfu_measured``: by a bf16 matmul measured on it); both None on a CPU.
        ``time_<phase>`` are seconds per step."""
        seconds = ended - window.started - window.paused
        steps = len(window.losses)
        achieved = window.flops / seconds / 1e12
        record: dict[str, float | None] = {
            "loss": sum(window.losses) / steps,
            "lr": self.dense_optimizer.param_groups[0]["lr"],
            "samples_per_s": steps * self.config.batch_size * self.world_size / seconds,
            "tokens_per_s": window.tokens * self.world_size / seconds,
            "model_tflop": window.flops / steps / 1e12,
            "tflops": achieved,
            "mfu": achieved / self.peak_tflops if self.peak_tflops else None,
            "mfu_measured": (
                achieved / self.measured_peak_tflops if self.measured_peak_tflops else None
            ),
            "step_ms": seconds / steps * 1e3,
            "skipped_rows": self.loader.skipped_rows,  # data.on_bad_row="skip", since start
            **{f"time_{phase}": t / steps for phase, t in self.clock.take().items()},
            **self.saved_activations.metrics(),
        }
        # Graphs dynamo compiled in the window: expected in the first; later ones are
        # recompiles (a guard failed on a new batch), each seconds long, and past the
        # recompile limit the module runs eager.
        graphs = dynamo_counters["stats"]["unique_graphs"]
        record["graphs_compiled"] = graphs - self._graphs
        self._graphs = graphs
        if self.device.type == "cuda":
            record["peak_mem_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
            record["reserved_gib"] = torch.cuda.max_memory_reserved(self.device) / 2**30
            # Allocations that found no cached block and freed the cache to retry (each a
            # device sync and cudaFree/cudaMalloc): fragmentation, a silent slowdown.
            retries = torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0)
            record["alloc_retries"] = retries - self._alloc_retries
            self._alloc_retries = retries
        if self.world_size > 1:
            # Every rank's tokens and model FLOPs: the throughput and MFU of the whole job (a
            # GPU's mean), not rank 0's batches scaled, and the history tokens of the busiest
            # rank over the mean (1.0: balanced; BBS's target).
            mine = torch.tensor([float(window.tokens), window.flops], device=self.device)
            everyone = [torch.empty_like(mine) for _ in range(self.world_size)]
            dist.all_gather(everyone, mine)  # collective: every rank computes its log line
            counts, flops = torch.stack(everyone).cpu().double().unbind(1)
            record["token_balance"] = float(counts.max() / counts.mean().clamp_min(1.0))
            record["tokens_per_s"] = float(counts.sum()) / seconds
            mean_flops = float(flops.mean())
            achieved = mean_flops / seconds / 1e12
            record["model_tflop"] = mean_flops / steps / 1e12
            record["tflops"] = achieved
            if self.peak_tflops:
                record["mfu"] = achieved / self.peak_tflops
            if self.measured_peak_tflops:
                record["mfu_measured"] = achieved / self.measured_peak_tflops
        return record

    # ---------------------------------------------------------------- evaluation
    @torch.no_grad()
    def evaluate(self, eval_data: DatasetInfo) -> dict[str, float]:
        """NE and AUC per task over all of ``eval_data`` (gathered from every rank)."""
        self.model.eval()
        loader = ParquetBatchLoader(
            eval_data.directory,
            self.config.eval_batch_size,
            shuffle=False,
            rank=self.rank,
            world_size=self.world_size,
        )
        # The sharded lookups are collectives: every rank runs as many forwards as the rank
        # with the most batches, a rank with fewer repeating its last batch and dropping the
        # result (one more batch on some ranks hung the others until the timeout).
        batches = len(loader)
        if batches == 0:
            raise ValueError(
                f"rank {self.rank} has no evaluation sample: eval_data needs at least one per "
                f"rank ({self.world_size})"
            )
        most = batches
        if self.world_size > 1:
            counts = torch.tensor([batches], device=self.device)
            dist.all_reduce(counts, op=dist.ReduceOp.MAX)
            most = int(counts)
        probabilities, labels = [], []
        for batch in loader:
            batch = batch.to(self.device)
            # The heads' logits are bf16 under autocast: the sigmoid in float32 keeps the
            # scores distinct (bf16 probabilities tie by the thousand, which moves the AUC).
            probabilities.append(torch.sigmoid(self._forward(batch).float()).cpu())
            labels.append(batch.labels.cpu())
        for _ in range(most - batches):
            self._forward(batch)
        local = (torch.cat(probabilities), torch.cat(labels))
        if self.world_size > 1:
            gathered: list[Any] = [None] * self.world_size
            dist.all_gather_object(gathered, local)
            local = (torch.cat([g[0] for g in gathered]), torch.cat([g[1] for g in gathered]))
        all_probabilities, all_labels = local
        results: dict[str, float] = {}
        for task_index, task in enumerate(self.model_config.tasks):
            column = _TASK_LABEL_COLUMNS[task]
            results[f"ne_{task}"] = normalized_entropy(
                all_probabilities[:, task_index], all_labels[:, column]
            )
            results[f"auc_{task}"] = auc(all_probabilities[:, task_index], all_labels[:, column])
        self.log(split="eval", step=self.step, **results)
        return results

    # ------------------------------------------------------------- checkpointing
    def _app_state(self) -> dict[str, Any]:
        return {
            "model": self.sparse_parallel.model_state_dict(self.model),
            "optimizer": self.optimizer.state_dict(),
            **self.sparse_parallel.extra_state(),
        }

    def save(self, checkpoint_dir: str | Path) -> Path:
        """Atomically saves model, both optimizers, data position, step and model config.

        Raises ``gem_train.checkpoint.CheckpointSaveError`` on every rank when the save did
        not complete (full disk, unwritable path): the previous checkpoint stays the newest
        one and training must not go on as if it had saved."""
        self._read_losses()  # no checkpoint of weights trained past a non-finite loss
        trainer_state = {
            "step": self.step,
            "world_size": self.world_size,
            "loader": self.loader.state_dict() if self._position is None else self._position,
            "torch_rng": torch.get_rng_state().tolist(),
            # Dropout draws on the device; FP8 stochastic rounding has counters of its own.
            "cuda_rng": (
                torch.cuda.get_rng_state(self.device).tolist()
                if self.device.type == "cuda"
                else None
            ),
            "rounding": rounding_state(self.model.module),
            "model_config": json.loads(
                json.dumps(dataclasses.asdict(self.model_config), default=str)
            ),
        }
        return save_checkpoint(checkpoint_dir, self.step, self._app_state(), trainer_state)

    def resume(self, checkpoint_dir: str | Path, *, allow_mesh_change: bool = False) -> bool:
        """Restores the newest whole checkpoint under ``checkpoint_dir``; False when there is
        none at all.

        The one ``latest`` names is used when it is whole. One that is not (a truncated or
        missing shard, missing or unreadable ``.metadata`` or ``trainer_state.json``, ``latest``
        naming a deleted step, a load that fails) is skipped for the newest whole one, and
        rank 0 says so on stderr (``self.skipped_checkpoints`` lists them with their
        ``IncompleteCheckpointError``, ``self.resumed_from`` is the one loaded). When
        checkpoints exist but none is whole, ``IncompleteCheckpointError`` is raised.

        A whole checkpoint of another model, or of another world size without
        ``allow_mesh_change``, raises ``CheckpointMismatchError`` (no fallback: that would
        drop the newer training). The model and optimizer reshard onto any number of ranks
        (DCP reads each shard's slice of the saved tensors). The data position is exact only
        for the same number of ranks: with ``allow_mesh_change=True`` a checkpoint from
        another world size is accepted and this job's data order starts from its own
        beginning.
        """
        self.skipped_checkpoints: list[tuple[Path, IncompleteCheckpointError]] = []
        self.resumed_from: Path | None = None

        def say(line: str) -> None:
            if self.rank == 0:
                print(f"gem-train: {line}", file=sys.stderr, flush=True)

        failed: list[Path] = []  # whole on disk, but their load failed
        while True:
            path, skipped = find_resumable(checkpoint_dir, exclude=failed)
            for bad, error in skipped:
                say(f"skipping checkpoint {bad}: {type(error).__name__}: {error}")
            self.skipped_checkpoints += skipped
            if path is None:
                if self.skipped_checkpoints:
                    raise IncompleteCheckpointError(
                        f"no whole checkpoint under {checkpoint_dir}: "
                        + "; ".join(f"{p.name}: {e}" for p, e in self.skipped_checkpoints),
                        Path(checkpoint_dir),
                    )
                return False
            trainer_state = read_trainer_state(path)
            saved_world = int(trainer_state.get("world_size", self.world_size))
            if saved_world != self.world_size and not allow_mesh_change:
                raise CheckpointMismatchError(
                    f"checkpoint {path} was written by {saved_world} ranks (its "
                    f"{path / 'trainer_state.json'} says so) but this job has "
                    f"{self.world_size}; pass allow_mesh_change=True to reshard the model and "
                    "optimizer (the data position cannot carry over exactly)",
                    path / "trainer_state.json",
                )
            self.dense_optimizer.init_state()  # AdamW state is lazy; DCP loads in place
            app_state = self._app_state()
            try:
                load_checkpoint(path, app_state, model_config=dataclasses.asdict(self.model_config))
            except IncompleteCheckpointError as error:
                say(f"skipping checkpoint {path}: {type(error).__name__}: {error}")
                self.skipped_checkpoints.append((path, error))
                failed.append(path)
                continue
            break
        if self.skipped_checkpoints:
            say(
                f"falling back to checkpoint {path} (step {trainer_state['step']}), the newest "
                f"whole one; skipped: {', '.join(p.name for p, _ in self.skipped_checkpoints)}"
            )
        self.resumed_from = path
        self.model.load_state_dict(app_state["model"])
        self.optimizer.load_state_dict(app_state["optimizer"])
        self.step = int(trainer_state["step"])
        self.sparse_parallel.finish_load(app_state, self.step)
        if saved_world == self.world_size:
            try:
                self.loader.load_state_dict(trainer_state["loader"])
            except ValueError as error:  # another batch size, seed or dataset than the run's
                raise CheckpointMismatchError(
                    f"checkpoint {path}'s data position does not fit this run's loader: {error}",
                    path / "trainer_state.json",
                ) from error
        self._position = None
        torch.set_rng_state(torch.tensor(trainer_state["torch_rng"], dtype=torch.uint8))
        if trainer_state.get("cuda_rng") is not None and self.device.type == "cuda":
            cuda_rng = torch.tensor(trainer_state["cuda_rng"], dtype=torch.uint8)
            torch.cuda.set_rng_state(cuda_rng, self.device)
        # Layers that were not FP8 when saved (a precision change between runs) start at 0.
        saved = trainer_state.get("rounding", {})
        layers = rounding_state(self.model.module)
        load_rounding_state(self.model.module, {name: saved.get(name, 0) for name in layers})
        return True

    def log(self, **record: Any) -> None:
        """Appends one JSON line to metrics.jsonl and writes its numbers as TensorBoard scalars
        (``<split>/<name>`` at ``step``, in ``output_dir``) (rank 0 only)."""
        if self.rank != 0:
            return
        record = {
            "time": time.time(),
            "variant": "gem" if self.use_sequence_tower else "no_sequence",
            **record,
        }
        with self._metrics_file.open("a") as handle:
            handle.write(json.dumps(json_ready(record), allow_nan=False) + "\n")
        if self._tensorboard is None:
            self._tensorboard = SummaryWriter(self.output_dir)
        for name, value in record.items():
            if (
                isinstance(value, int | float)
                and math.isfinite(value)
                and name not in ("time", "step")
            ):
                self._tensorboard.add_scalar(f"{record['split']}/{name}", value, record["step"])
        self._tensorboard.flush()
