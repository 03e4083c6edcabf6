"""The ``parallel`` config section and what the trainer does with it in one process.

Multi-rank equality (FSDP 2 x 2 + expert parallelism vs one process) and exact resume on four
ranks are in the workspace's tests/test_parallel_training.py."""

import dataclasses

import pytest
import torch
from gem_train import Trainer, apply_overrides, tiny
from gem_train.cli import prepare_data
from gem_train.config import ParallelConfig
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel


def test_parallel_overrides_parse_and_default_to_ddp():
    assert tiny().parallel == ParallelConfig(dense="ddp", shard=0, expert_parallel=1)
    config = apply_overrides(
        tiny(),
        [
            "parallel.dense=fsdp",
            "parallel.shard=2",
            "parallel.expert_parallel=2",
            "parallel.reshard_after_forward=true",
        ],
    )
    assert config.parallel == ParallelConfig(
        dense="fsdp", shard=2, expert_parallel=2, reshard_after_forward=True
    )


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("parallel.dense=zero3", "parallel.dense must be one of"),
        ("parallel.expert_parallel=0", "parallel.expert_parallel must be an int >= 1"),
        ("parallel.shard=-1", "parallel.shard must be an int >= 0"),
        ("parallel.shard=2", "only applies to parallel.dense='fsdp'"),
    ],
)
def test_bad_parallel_values_are_clear_errors(override, message):
    with pytest.raises(ValueError, match=message):
        apply_overrides(tiny(), [override])


def test_world_dependent_sizes_are_checked_when_the_trainer_starts(small_config, tmp_path):
    train_data, _ = prepare_data(small_config.data, progress=False)
    for parallel, message in (
        (ParallelConfig(dense="fsdp", shard=2), "parallel.shard \\(2\\) must divide"),
        (
            ParallelConfig(dense="fsdp", expert_parallel=2),
            r"parallel.expert_parallel \(2\) must divide the shard group \(1\)",
        ),
    ):
        with pytest.raises(ValueError, match=message):
            Trainer(
                dataclasses.replace(small_config, parallel=parallel),
                train_data,
                output_dir=tmp_path / "bad",
            )


def test_one_rank_trains_without_a_ddp_wrapper(small_config, tmp_path):
    # DDP on one rank reduces nothing and makes dynamo split each compiled region at its
    # bucket boundaries, so the dense part stays unwrapped (DDP from two ranks on: the
    # workspace's multi-rank tests, e.g. tests/test_end_to_end.py).
    train_data, _ = prepare_data(small_config.data, progress=False)
    trainer = Trainer(small_config, train_data, output_dir=tmp_path / "run")
    assert not any(isinstance(m, DistributedDataParallel) for m in trainer.model.modules())
    tower = {n: p for n, p in trainer.model.named_parameters() if n.startswith("sequence")}
    before = {n: p.detach().clone() for n, p in tower.items()}
    trainer.train_step(next(iter(trainer.loader)))
    assert tower and all(not torch.equal(before[n], p) for n, p in tower.items())


def test_fsdp_in_one_process_trains_like_ddp_and_resumes_exactly(small_config, tmp_path):
    """FSDP2 at world 1 shards nothing, so it must follow the DDP run up to float rounding;
    its DTensor parameters and AdamW state must round-trip through a DCP checkpoint."""
    train_data, _ = prepare_data(small_config.data, progress=False)
    config = dataclasses.replace(small_config, max_steps=4)
    ddp = Trainer(config, train_data, output_dir=tmp_path / "ddp")
    ddp_losses = ddp.fit(progress=False)

    fsdp_config = dataclasses.replace(config, parallel=ParallelConfig(dense="fsdp"))
    fsdp = Trainer(fsdp_config, train_data, output_dir=tmp_path / "fsdp")
    # Same seed, same dense init; the tables are initialised alike at the same world size.
    assert all(isinstance(p, DTensor) for p in fsdp.dense_parameters)
    fsdp.total_steps = 2
    first = fsdp.fit(progress=False)
    fsdp.save(tmp_path / "fsdp" / "checkpoints")
    fsdp.total_steps = 4
    rest = fsdp.fit(progress=False)
    assert first + rest == pytest.approx(ddp_losses, rel=1e-5)

    resumed = Trainer(fsdp_config, train_data, output_dir=tmp_path / "resumed")
    with torch.no_grad():
        for param in resumed.dense_parameters:
            param.add_(1.0)  # anything not restored would show in the losses
    assert resumed.resume(tmp_path / "fsdp" / "checkpoints")
    assert resumed.step == 2
    assert resumed.fit(progress=False) == rest
