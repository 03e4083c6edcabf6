"""Faults (issue 27), short forms: a crash at any file operation of a save, damaged or foreign
checkpoints under resume, and write errors (full disk, unwritable path) during a save.

The kill-anywhere runs with real SIGKILLs on 1 and 2 ranks, and the dead-rank timeout, are in
``tests/test_faults_short.py`` and ``benchmarks/bench_faults.py``."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint.filesystem as dcp_filesystem
from gem_train import Trainer
from gem_train.checkpoint import (
    CheckpointMismatchError,
    CheckpointSaveError,
    IncompleteCheckpointError,
    find_resumable,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from gem_train.cli import UsageError, prepare_data, validate

from conftest import small_train_config


# ------------------------------------------------------------ a crash at any file operation
class _Crash(BaseException):
    """The process died here (a BaseException, so no ``except Exception`` recovers from it)."""


class _CrashAt:
    """Audit hook (installed once, inert unless armed): raises ``_Crash`` at the ``at``-th
    file operation under ``root`` and at every one after it, so nothing the dead process
    would not have done reaches the disk."""

    EVENTS = ("open", "os.mkdir", "os.rename", "os.remove", "os.rmdir", "shutil.rmtree")

    def __init__(self) -> None:
        self.root: str | None = None
        self.at = 0
        self.seen = 0

    def arm(self, root: Path, at: int) -> None:
        self.root, self.at, self.seen = str(root), at, 0

    def disarm(self) -> int:
        self.root = None
        return self.seen

    def __call__(self, event: str, args: tuple) -> None:
        if self.root is None or event not in self.EVENTS or not args:
            return
        path = args[0]
        if not isinstance(path, str | bytes | os.PathLike) or not os.fsdecode(path).startswith(
            self.root
        ):
            return
        self.seen += 1
        if self.at and self.seen >= self.at:
            raise _Crash(f"crash at {event} {os.fsdecode(path)}")


_CRASH = _CrashAt()
sys.addaudithook(_CRASH)


def _state(step: int) -> dict:
    return {"model": {"w": torch.full((64, 8), float(step)), "b": torch.arange(8.0) + step}}


def _save(root: Path, step: int) -> None:
    save_checkpoint(root, step, _state(step), {"step": step, "world_size": 1})


def _setup(root: Path, scenario: str) -> int:
    """The checkpoints before the crashing save; returns the step that save writes."""
    if scenario == "first":
        return 1
    _save(root, 1)
    _save(root, 2)
    if scenario == "next":
        return 3
    if scenario == "same step again":  # resumed at the last step and saved it once more
        return 2
    if scenario == "same step after a crash in its save":  # `latest` names the whole .partial
        os.replace(root / "step_00000002", root / "step_00000002.partial")
        (root / "latest").write_text("step_00000002.partial")
        return 2
    # "after resuming earlier": latest went back to step 1 (a crash between the rename of
    # step 2 and the pointer), and this attempt saves step 2 over the orphan
    (root / "latest").write_text("step_00000001")
    return 2


@pytest.mark.parametrize(
    "scenario",
    [
        "first",
        "next",
        "same step again",
        "same step after a crash in its save",
        "after resuming earlier",
    ],
)
def test_a_crash_at_any_file_operation_of_a_save_leaves_a_whole_checkpoint(tmp_path, scenario):
    """Every prefix of a save's file operations (what a SIGKILL leaves): resume finds a whole
    checkpoint (the previous or the new one) without skipping anything, it loads with the values
    of its step, and the next save cleans up."""
    probe = tmp_path / "probe"
    step = _setup(probe, scenario)
    _CRASH.arm(probe, 0)
    _save(probe, step)
    operations = _CRASH.disarm()
    assert operations > 8
    before = {"first": None, "next": 2, "after resuming earlier": 1}.get(scenario, 2)
    for at in range(1, operations + 1):
        root = tmp_path / f"crash{at}"
        _setup(root, scenario)
        _CRASH.arm(root, at)
        with pytest.raises(_Crash):
            _save(root, step)
        _CRASH.disarm()
        path, skipped = find_resumable(root)
        assert skipped == [], (at, skipped)
        if path is None:
            assert before is None, f"crash at operation {at} lost the checkpoint of {before}"
            continue
        loaded = _state(-1)
        trainer_state = load_checkpoint(path, loaded)
        assert trainer_state["step"] in {before, step}, (at, path)
        assert torch.equal(loaded["model"]["w"], _state(trainer_state["step"])["model"]["w"])
        _save(root, step)  # the resumed run saves again: whole, and nothing left over
        assert latest_checkpoint(root).name == f"step_{step:08d}"
        assert not [p.name for p in root.iterdir() if p.name.endswith((".partial", ".tmp"))]
        assert len(list(root.glob("step_*"))) <= 2


# ------------------------------------------------------------- damaged and foreign checkpoints
@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """3 steps of the small config with a checkpoint after each (step_2 and step_3 kept), and
    the losses of an uninterrupted run."""
    root = tmp_path_factory.mktemp("faults")
    config = dataclasses.replace(small_train_config(root), max_steps=3, checkpoint_every=1)
    train_data, _ = prepare_data(config.data, progress=False)
    trainer = Trainer(config, train_data, output_dir=root / "run")
    losses = trainer.fit(progress=False)
    checkpoints = root / "run" / "checkpoints"
    assert latest_checkpoint(checkpoints).name == "step_00000003"
    return {"config": config, "data": train_data, "checkpoints": checkpoints, "losses": losses}


def _copy(trained, tmp_path) -> Path:
    target = tmp_path / "checkpoints"
    shutil.copytree(trained["checkpoints"], target)
    return target


def _truncate(path: Path, keep: float) -> None:
    with path.open("r+b") as handle:
        handle.truncate(int(path.stat().st_size * keep))


DAMAGES = {
    "truncated shard": (lambda c: _truncate(c / "step_00000003" / "__0_0.distcp", 0.5), ".distcp"),
    "missing metadata": (lambda c: (c / "step_00000003" / ".metadata").unlink(), ".metadata"),
    "truncated metadata": (
        lambda c: _truncate(c / "step_00000003" / ".metadata", 0.3),
        ".metadata",
    ),
    "truncated trainer state": (
        lambda c: _truncate(c / "step_00000003" / "trainer_state.json", 0.5),
        "trainer_state.json",
    ),
    "latest names a deleted step": (
        lambda c: shutil.rmtree(c / "step_00000003"),
        "latest names",
    ),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_checkpoint_is_named_and_resume_falls_back_to_the_newest_whole_one(
    trained, tmp_path, capfd, damage
):
    damage_it, named_file = DAMAGES[damage]
    checkpoints = _copy(trained, tmp_path)
    damage_it(checkpoints)
    trainer = Trainer(trained["config"], trained["data"], output_dir=tmp_path / "run")
    assert trainer.resume(checkpoints)
    assert trainer.step == 2 and trainer.resumed_from.name == "step_00000002"
    [(skipped, error)] = trainer.skipped_checkpoints
    assert isinstance(error, IncompleteCheckpointError) and named_file in str(error)
    err = capfd.readouterr().err
    assert f"skipping checkpoint {skipped}: IncompleteCheckpointError: " in err
    assert "falling back to checkpoint" in err and "step_00000002 (step 2)" in err
    # and training continues exactly as if nothing had happened
    assert trainer.fit(progress=False) == trained["losses"][2:]


def test_resume_refuses_when_no_checkpoint_is_whole(trained, tmp_path):
    checkpoints = _copy(trained, tmp_path)
    for step in (2, 3):
        (checkpoints / f"step_{step:08d}" / ".metadata").unlink()
    trainer = Trainer(trained["config"], trained["data"], output_dir=tmp_path / "run")
    with pytest.raises(IncompleteCheckpointError, match="no whole checkpoint under"):
        trainer.resume(checkpoints)


def test_cli_resume_accepts_a_damaged_newest_and_names_the_one_with_none_whole(trained, tmp_path):
    config = dataclasses.replace(
        trained["config"], output_dir=str(tmp_path / "out"), compare_no_sequence=False
    )
    checkpoints = tmp_path / "out" / "gem" / "checkpoints"
    shutil.copytree(trained["checkpoints"], checkpoints)
    shutil.rmtree(checkpoints / "step_00000003")
    validate(config, resume=True)  # falls back to step 2: no usage error
    (checkpoints / "step_00000002" / "trainer_state.json").write_text("{")
    with pytest.raises(UsageError, match=r"--resume: no whole checkpoint under .*trainer_state"):
        validate(config, resume=True)


@pytest.mark.parametrize(
    "model",
    [{"dhen_layers": 2}, {"embedding_dim": 32}],
    ids=["more layers (DCP alone loads a subset silently)", "wider (DCP fails unnamed)"],
)
def test_a_checkpoint_of_another_model_is_refused_by_name(trained, tmp_path, model):
    config = trained["config"]
    other = dataclasses.replace(config, model=dataclasses.replace(config.model, **model))
    other_root = tmp_path / "other"
    trainer = Trainer(other, trained["data"], output_dir=other_root)
    trainer.save(other_root / "checkpoints")
    resumed = Trainer(config, trained["data"], output_dir=tmp_path / "run")
    with pytest.raises(CheckpointMismatchError, match="written by another model") as caught:
        resumed.resume(other_root / "checkpoints")
    assert ".metadata" in str(caught.value) and resumed.step == 0
    ((field, value),) = model.items()
    assert f"architecture.{field}: {value} -> {getattr(config.model, field)}" in str(caught.value)


def test_a_checkpoint_of_another_world_size_needs_allow_mesh_change(trained, tmp_path):
    checkpoints = _copy(trained, tmp_path)
    state_file = checkpoints / "step_00000003" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    state_file.write_text(json.dumps({**state, "world_size": 2}))
    trainer = Trainer(trained["config"], trained["data"], output_dir=tmp_path / "run")
    with pytest.raises(CheckpointMismatchError, match="written by 2 ranks") as caught:
        trainer.resume(checkpoints)
    assert str(state_file) in str(caught.value) and isinstance(caught.value, ValueError)
    assert trainer.resume(checkpoints, allow_mesh_change=True) and trainer.step == 3


# ------------------------------------------------------------------- write errors in a save
def _enospc_in_dcp_writer(monkeypatch):
    """DCP's file writer runs out of space half-way through its second checkpoint's shard."""
    write_item = dcp_filesystem._write_item
    calls = {"saves": set()}

    def full_disk(transforms, stream, data, write_item_, storage_key, *args, **kwargs):
        calls["saves"].add(os.path.dirname(stream.name))
        if len(calls["saves"]) >= 2:
            stream.write(b"\0" * 100)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), stream.name)
        return write_item(transforms, stream, data, write_item_, storage_key, *args, **kwargs)

    monkeypatch.setattr(dcp_filesystem, "_write_item", full_disk)
    return "No space left on device"


def _enospc_in_os_write(name):
    def inject(monkeypatch):
        """os.write of the second ``name`` fails: the disk filled up after the shards."""
        write = os.write
        seen = []

        def full_disk(fd, data):
            target = os.readlink(f"/proc/self/fd/{fd}") if os.path.exists("/proc/self") else ""
            if os.path.basename(target) == name:
                seen.append(target)
                if len(seen) >= 2:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return write(fd, data)

        monkeypatch.setattr(os, "write", full_disk)
        return "No space left on device"

    return inject


def _unwritable_directory(monkeypatch):
    """The checkpoint directory turned read-only before the second save (chmod does not stop
    root, so the refusal is injected at os.mkdir)."""
    mkdir = os.mkdir
    seen = set()

    def refuse(path, *args, **kwargs):
        if os.fsdecode(path).endswith(".partial"):
            seen.add(os.fsdecode(path))
            if len(seen) >= 2:
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fsdecode(path))
        return mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", refuse)
    return "Permission denied"


WRITE_ERRORS = {
    "full disk in the shard writer": _enospc_in_dcp_writer,
    "full disk writing trainer_state.json": _enospc_in_os_write("trainer_state.json"),
    "full disk writing the latest pointer": _enospc_in_os_write("latest.tmp"),
    "unwritable directory": _unwritable_directory,
}


@pytest.mark.parametrize("fault", WRITE_ERRORS)
def test_a_failed_save_stops_training_and_keeps_the_previous_checkpoint(
    trained, tmp_path, monkeypatch, fault
):
    config = dataclasses.replace(trained["config"], output_dir=str(tmp_path / "run"))
    trainer = Trainer(config, trained["data"], output_dir=tmp_path / "run")
    checkpoints = tmp_path / "run" / "checkpoints"
    cause = WRITE_ERRORS[fault](monkeypatch)
    with pytest.raises(CheckpointSaveError) as caught:
        trainer.fit(progress=False)  # saves after step 1, fails saving step 2
    message = str(caught.value)
    assert "could not save the checkpoint of step 2" in message and cause in message
    assert f"{checkpoints / 'latest'} still names step_00000001" in message
    assert trainer.step == 2, "training went on after the save failed"
    monkeypatch.undo()
    assert latest_checkpoint(checkpoints).name == "step_00000001"
    assert not list(checkpoints.glob("*.partial")), "the failed save's files were left behind"
    path, skipped = find_resumable(checkpoints)
    assert path.name == "step_00000001" and not skipped
    if fault == "full disk in the shard writer":  # and it resumes exactly
        resumed = Trainer(config, trained["data"], output_dir=tmp_path / "again")
        assert resumed.resume(checkpoints) and resumed.step == 1
        assert resumed.fit(progress=False) == trained["losses"][1:]
