"""Atomic checkpoints with ``torch.distributed.checkpoint`` (DCP).

Layout of ``root``::

    step_00000100/          one complete checkpoint (DCP shards + trainer_state.json)
    latest                  text file naming the newest complete checkpoint

A checkpoint is written into ``step_N.partial`` and renamed only after every
rank finished, then ``latest`` is replaced atomically, so a crash at any moment
leaves the previous checkpoint intact and never a half-written one that looks complete.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint", "read_trainer_state"]

_TRAINER_STATE = "trainer_state.json"


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _is_writer() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def save_checkpoint(
    root: str | Path,
    step: int,
    app_state: dict[str, Any],
    trainer_state: dict[str, Any],
    *,
    keep_last: int = 2,
) -> Path:
    """Saves ``app_state`` (model / optimizer state dicts, possibly sharded) and the JSON-able
    ``trainer_state`` of this step; returns the final checkpoint directory.

    Older complete checkpoints beyond the newest ``keep_last`` are deleted after the new one
    is in place."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    root = Path(root)
    final = root / f"step_{step:08d}"
    partial = root / f"step_{step:08d}.partial"
    if _is_writer():
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    _barrier()
    dcp.save(app_state, checkpoint_id=str(partial))
    _barrier()
    if _is_writer():
        (partial / _TRAINER_STATE).write_text(json.dumps(trainer_state))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)
        pointer = root / "latest.tmp"
        pointer.write_text(final.name)
        os.replace(pointer, root / "latest")
        complete = sorted(p for p in root.glob("step_*") if p.suffix != ".partial")
        for old in complete[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint under ``root``, or None when there is none."""
    pointer = Path(root) / "latest"
    if not pointer.is_file():
        return None
    path = Path(root) / pointer.read_text().strip()
    if not (path / _TRAINER_STATE).is_file():
        raise FileNotFoundError(f"checkpoint pointer {pointer} names {path}, which is incomplete")
    return path


def read_trainer_state(path: str | Path) -> dict[str, Any]:
    """The JSON trainer state (step, data position, ...) of a complete checkpoint."""
    state_file = Path(path) / _TRAINER_STATE
    if not state_file.is_file():
        raise FileNotFoundError(
            f"checkpoint {path} has no {_TRAINER_STATE}; it is not a complete checkpoint"
        )
    return json.loads(state_file.read_text())


def load_checkpoint(path: str | Path, app_state: dict[str, Any]) -> dict[str, Any]:
    """Loads a checkpoint in place into ``app_state`` (whose tensors give the target layout,
    which may be sharded differently from the saved one) and returns its trainer state."""
    trainer_state = read_trainer_state(path)
    dcp.load(app_state, checkpoint_id=str(path))
    return trainer_state
