"""The compiled bf16 training step on CUDA: host synchronisations per step, counted by CUDA's
sync-debug mode (runs under ``nox -s gpu`` on the GPU machine)."""

import dataclasses
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

# Outside torchrec, the trainer's loss read-back is the step's one host synchronisation:
# the kernels plan from the batch's host offsets, and the model never reads device lengths.
# torchrec's own input distribution (its all-to-all splits, even on one rank) is not counted.
MAX_SYNCS_PER_STEP = 1


def test_compiled_step_syncs_only_for_the_loss(small_config):
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
    trainer = Trainer(config, train, output_dir=config.output_dir)
    batches = iter(trainer.loader)
    for _ in range(4):  # compiles (the token count is dynamic from the first batch), warms up
        trainer.train_step(next(batches).to(trainer.device, non_blocking=True))
    torch.cuda.synchronize()
    batch = next(batches)
    # A sync is torchrec's when a torchrec frame is on its stack, wherever the innermost frame
    # is (torchrec calls torch.cuda functions too); the failure message shows the others.
    stacks = host_sync_stacks(
        lambda: trainer.train_step(batch.to(trainer.device, non_blocking=True))
    )
    ours = [stack for stack in stacks if not any("torchrec" in f.filename for f in stack)]
    assert len(ours) <= MAX_SYNCS_PER_STEP, "\n\n".join(
        "".join(traceback.format_list(s[-6:])) for s in ours
    )
