"""The compiled bf16 training step on CUDA: host synchronisations per step, counted by CUDA's
sync-debug mode (runs under ``nox -s gpu`` on the GPU machine)."""

import dataclasses
import itertools
import traceback

import pytest
import torch
from gem_train.cli import prepare_data
from gem_train.config import PrecisionConfig
from gem_train.throughput import host_sync_stacks
from gem_train.trainer import Trainer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# Outside torchrec, the loss read-back is a plain step's one host synchronisation:
# the kernels plan from the batch's host offsets, and the model never reads device lengths.
# torchrec's own input distribution (its all-to-all splits, even on one rank) is not counted.
MAX_SYNCS_PER_STEP = 1


def _compiled_trainer(small_config) -> Trainer:
    config = dataclasses.replace(
        small_config,
        device="cuda",
        compile=True,
        precision=PrecisionConfig(mode="bf16"),
        model=dataclasses.replace(
            small_config.model, attention_window=8, position="rope", ffn="swiglu",
            history_cross=True, target_attention=True,
        ),
    )  # fmt: skip
    train, _ = prepare_data(config.data, progress=False)
    return Trainer(config, train, output_dir=config.output_dir)


def _ours(stacks: list[traceback.StackSummary]) -> list[traceback.StackSummary]:
    """The syncs that are not torchrec's: a sync is torchrec's when a torchrec frame is on its
    stack, wherever the innermost frame is (torchrec calls torch.cuda functions too)."""
    return [stack for stack in stacks if not any("torchrec" in f.filename for f in stack)]


def _shown(stacks: list[traceback.StackSummary]) -> str:
    return "\n\n".join("".join(traceback.format_list(s[-6:])) for s in stacks)


def test_compiled_step_syncs_only_for_the_loss(small_config):
    trainer = _compiled_trainer(small_config)
    batches = iter(trainer.loader)
    for _ in range(4):  # compiles (the token count is dynamic from the first batch), warms up
        trainer.train_step(next(batches).to(trainer.device, non_blocking=True))
    torch.cuda.synchronize()
    batch = next(batches)
    stacks = host_sync_stacks(
        lambda: trainer.train_step(batch.to(trainer.device, non_blocking=True))
    )
    ours = _ours(stacks)
    assert len(ours) <= MAX_SYNCS_PER_STEP, _shown(ours)


def test_pipelined_steps_sync_only_for_the_losses(small_config):
    """Through torchrec's train pipeline (``train_steps``, as ``fit``) the steps do not sync:
    their losses are read back once, at the end (``fit``: at log lines and checkpoints), and
    torchrec's input distribution runs on its side streams a step ahead."""
    trainer = _compiled_trainer(small_config)
    batches = [batch.pin_memory() for batch in itertools.islice(trainer.loader, 8)]
    trainer.train_steps(batches[:4])  # compiles, warms up
    stacks = host_sync_stacks(lambda: trainer.train_steps(batches[4:]))
    ours = _ours(stacks)
    assert len(ours) <= MAX_SYNCS_PER_STEP, _shown(ours)
