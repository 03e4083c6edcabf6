"""The dense learning-rate schedule (``OptimConfig.lr_schedule``) against torch's own schedulers,
and its resume exactness inside the trainer."""

import dataclasses
import shutil

import pytest
import torch
from gem_train import OptimConfig, Trainer, apply_overrides, tiny
from gem_train.cli import prepare_data


def _torch_schedule(kind: str, base_lr: float, min_ratio: float, steps: int) -> list[float]:
    """The decay part from torch.optim.lr_scheduler: the rate after 0, 1, ... ``steps`` steps."""
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=base_lr)
    if kind == "cosine":
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(
            optimizer, T_max=steps, eta_min=min_ratio * base_lr
        )
    else:
        scheduler = torch.optim.lr_scheduler.LinearLR(
            optimizer, start_factor=1.0, end_factor=min_ratio, total_iters=steps
        )
    rates = [optimizer.param_groups[0]["lr"]]
    for _ in range(steps):
        optimizer.step()
        scheduler.step()
        rates.append(optimizer.param_groups[0]["lr"])
    return rates


@pytest.mark.parametrize("kind", ["cosine", "linear"])
@pytest.mark.parametrize(("warmup", "total", "min_ratio"), [(1, 7, 0.0), (5, 23, 0.1), (3, 4, 0.5)])
def test_decay_matches_torch_schedulers(kind, warmup, total, min_ratio):
    optim = OptimConfig(
        dense_lr=2e-3, warmup_steps=warmup, lr_schedule=kind, min_lr_ratio=min_ratio
    )
    ours = [optim.dense_lr_at(step, total) for step in range(total)]
    # Warm-up: linear ramp up to the full rate at step warmup - 1.
    assert ours[:warmup] == pytest.approx([2e-3 * (s + 1) / warmup for s in range(warmup)])
    # Then torch's decay over the remaining steps, ending at min_ratio * lr on the last step.
    expected = _torch_schedule(kind, 2e-3, min_ratio, total - warmup)
    assert ours[warmup - 1 :] == pytest.approx(expected, rel=1e-6, abs=1e-12)
    assert ours[-1] == pytest.approx(min_ratio * 2e-3, abs=1e-12)


def test_constant_schedule_is_warmup_then_flat():
    optim = OptimConfig(dense_lr=1e-3, warmup_steps=4)
    assert [optim.dense_lr_at(s, 10) for s in range(10)] == pytest.approx(
        [2.5e-4, 5e-4, 7.5e-4] + [1e-3] * 7
    )


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("optim.lr_schedule=step", "optim.lr_schedule must be one of"),
        ("optim.min_lr_ratio=1.5", r"optim.min_lr_ratio must be in \[0, 1\]"),
    ],
)
def test_bad_schedule_is_a_clear_error(override, message):
    with pytest.raises(ValueError, match=message):
        apply_overrides(tiny(), [override])


def test_resume_continues_the_schedule_exactly(small_config, tmp_path):
    """A run that crashes after saving step 4 of 5 resumes on the same learning-rate curve."""
    train_data, _ = prepare_data(small_config.data, progress=False)
    optim = OptimConfig(warmup_steps=2, lr_schedule="cosine", min_lr_ratio=0.1)
    config = dataclasses.replace(small_config, max_steps=5, checkpoint_every=1, optim=optim)
    checkpoints = tmp_path / "a" / "checkpoints"
    full = Trainer(config, train_data, output_dir=tmp_path / "a")
    losses = full.fit(checkpoint_dir=checkpoints, progress=False)
    assert full.dense_optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * optim.dense_lr)
    # The crash: step 5 was never saved, the pointer still names step 4.
    shutil.rmtree(checkpoints / "step_00000005")
    (checkpoints / "latest").write_text("step_00000004")

    torch.manual_seed(1234)  # a different init: everything must come from the checkpoint
    resumed = Trainer(config, train_data, output_dir=tmp_path / "b")
    assert resumed.resume(checkpoints)
    assert resumed.step == 4
    assert resumed.fit(progress=False) == losses[4:]
    assert resumed.dense_optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * optim.dense_lr)
