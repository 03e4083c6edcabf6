"""Atomic checkpoints with ``torch.distributed.checkpoint`` (DCP), checked before they load.

Layout of ``root``::

    step_00000100/          one complete checkpoint: DCP shards, .metadata, trainer_state.json
    latest                  text file naming the newest complete checkpoint

**Saving.** Every rank writes its DCP shards into ``step_N.partial`` (DCP fsyncs each file and
puts ``.metadata`` in place last); then rank 0 writes ``trainer_state.json`` (fsynced), renames
the directory to ``step_N``, fsyncs ``root`` and replaces ``latest`` atomically. A process
killed at any moment therefore leaves ``latest`` naming a whole checkpoint (or, killed before
the first save finished, no ``latest``). Saving a step that already has a checkpoint first
points ``latest`` at the new, whole ``step_N.partial``, so no moment leaves it naming a deleted
directory (a pointer to ``step_N.partial`` that is gone means its rename to ``step_N``
happened; the next save finishes that rename if it did not). After the pointer moved, older checkpoints beyond ``keep_last``, newer ones (of an
abandoned attempt after a resume) and leftover ``.partial`` directories are deleted.

A failed write (full disk, unwritable directory, a rank that died) raises
``CheckpointSaveError`` on every rank: the save is not complete, ``latest`` still names the
previous checkpoint, and the caller must not go on as if it had saved.

**Loading.** ``find_resumable`` returns the checkpoint ``latest`` names, or when that one is
not whole (``IncompleteCheckpointError``: a shard file missing or shorter than ``.metadata``
says, ``.metadata`` or ``trainer_state.json`` missing or unreadable, ``latest`` naming a
directory that is not there), the newest whole one, with what was skipped and why.
``load_checkpoint`` refuses a whole checkpoint of another model (``CheckpointMismatchError``:
tensors missing, extra, or of another shape) instead of letting DCP fail without naming it, or
load a subset silently.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import re
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

__all__ = [
    "CheckpointError",
    "CheckpointMismatchError",
    "CheckpointSaveError",
    "IncompleteCheckpointError",
    "check_fits",
    "checkpoint_candidates",
    "find_resumable",
    "latest_checkpoint",
    "load_checkpoint",
    "read_trainer_state",
    "save_checkpoint",
    "verify_checkpoint",
]

_TRAINER_STATE = "trainer_state.json"
_METADATA = ".metadata"
_POINTER = "latest"
_PARTIAL = ".partial"
_STEP = re.compile(r"step_(\d+)")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used or could not be written; ``path`` is the file or
    directory at fault and the message names it."""

    def __init__(self, message: str, path: str | Path) -> None:
        super().__init__(message)
        self.path = Path(path)


class IncompleteCheckpointError(CheckpointError):
    """Not a whole checkpoint: a file missing, truncated or unreadable, or ``latest`` naming a
    checkpoint that is not there. Resuming skips it for the newest whole one."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """A whole checkpoint that does not fit this job: another model (tensors missing, extra or
    of another shape), or another world size without ``allow_mesh_change``. Never skipped:
    resuming stops, since an older checkpoint would silently discard the newer training."""


class CheckpointSaveError(CheckpointError):
    """A save that did not complete (full disk, unwritable path, a rank that died). Raised on
    every rank; ``latest`` still names the previous checkpoint."""


# ------------------------------------------------------------------------------ helpers
def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _is_writer() -> bool:
    return not _distributed() or dist.get_rank() == 0


def _step_of(path: Path) -> int | None:
    found = _STEP.fullmatch(path.name)
    return int(found.group(1)) if found else None


def _fsync_directory(path: Path) -> None:
    """Makes a rename in ``path`` durable; skipped where directories cannot be fsynced."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except PermissionError:
        return
    try:
        os.fsync(fd)
    except OSError as error:
        if error.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF, errno.EISDIR):
            raise
    finally:
        os.close(fd)


def _write_durably(path: Path, text: str) -> None:
    """Writes ``path`` and fsyncs it (an OSError such as ENOSPC surfaces here, not later)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        data = text.encode()
        while data:
            data = data[os.write(fd, data) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def _point(root: Path, name: str) -> None:
    """Replaces ``root/latest`` atomically with one naming ``name``."""
    pointer = root / f"{_POINTER}.tmp"
    _write_durably(pointer, name)
    os.replace(pointer, root / _POINTER)
    _fsync_directory(root)


def _agree(error: str | None, *, from_writer: bool) -> str | None:
    """The error of rank 0 (``from_writer``) or of any rank, the same on every rank; also a
    barrier."""
    if not _distributed():
        return error
    if from_writer:
        box = [error]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    errors: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return next((e for e in errors if e), None)


def _describe(error: BaseException) -> str:
    """One line for ``error``; DCP's CheckpointException reduced to its ranks' causes."""
    if isinstance(error, CheckpointException):
        causes = {f"{type(e).__name__}: {e}" for e, _ in error.failures.values()}
        ranks = sorted(error.failures)
        return f"{'; '.join(sorted(causes))} (rank{'s' if len(ranks) > 1 else ''} {ranks})"
    return f"{type(error).__name__}: {error}"


# --------------------------------------------------------------------------------- saving
def save_checkpoint(
    root: str | Path,
    step: int,
    app_state: dict[str, Any],
    trainer_state: dict[str, Any],
    *,
    keep_last: int = 2,
) -> Path:
    """Saves ``app_state`` (model / optimizer state dicts, possibly sharded) and the JSON-able
    ``trainer_state`` of this step (collective); returns the final checkpoint directory.

    Raises ``CheckpointSaveError`` on every rank when any part of the save failed; the
    previous checkpoint stays the ``latest``. Older complete checkpoints beyond the newest
    ``keep_last`` are deleted after the new one is in place."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    root = Path(root)
    final = root / f"step_{step:08d}"
    partial = root / f"step_{step:08d}{_PARTIAL}"

    def fail(what: str, cause: str) -> CheckpointSaveError:
        previous = (root / _POINTER).read_text().strip() if (root / _POINTER).is_file() else None
        kept = f"{root / _POINTER} still names {previous}" if previous else "no checkpoint before"
        return CheckpointSaveError(
            f"could not save the checkpoint of step {step}: {what} failed: {cause}; {kept}",
            partial,
        )

    def on_writer(what: str, action: Callable[[], None]) -> None:
        error = None
        if _is_writer():
            try:
                action()
            except Exception as caught:  # noqa: BLE001 - reported on every rank below
                error = _describe(caught)
        error = _agree(error, from_writer=True)
        if error:
            raise fail(what, error)

    def prepare() -> None:
        _settle_pointer(root)  # never delete below what `latest` names
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)

    on_writer(f"creating {partial}", prepare)
    try:
        dcp.save(app_state, checkpoint_id=str(partial))
        error = None
    except (Exception, CheckpointException) as caught:  # DCP raises the same on every rank
        error = _describe(caught)
    error = _agree(error, from_writer=False)
    if error:
        if _is_writer():
            shutil.rmtree(partial, ignore_errors=True)
        raise fail(f"writing the shards into {partial}", error)

    def publish() -> None:
        _write_durably(partial / _TRAINER_STATE, json.dumps(trainer_state))
        if final.exists():  # this step was saved before: keep `latest` on a whole checkpoint
            _point(root, partial.name)
            shutil.rmtree(final)
        os.replace(partial, final)
        _fsync_directory(root)
        _point(root, final.name)

    try:
        on_writer(f"publishing {final} as {root / _POINTER}", publish)
    except CheckpointSaveError:
        if _is_writer() and _pointer_target_or_none(root) != partial:
            shutil.rmtree(partial, ignore_errors=True)  # on a full disk, give the space back
        raise
    if _is_writer():
        _clean(root, step, keep_last)
    return final


def _settle_pointer(root: Path) -> None:
    """Finishes a save of an already saved step that was interrupted while ``latest`` named
    its whole ``step_N.partial``: that directory becomes ``step_N`` (replacing what is left
    of the old one) and ``latest`` names it."""
    target = _pointer_target_or_none(root)
    if target is None or not target.name.endswith(_PARTIAL) or not target.is_dir():
        return
    final = target.with_name(target.name[: -len(_PARTIAL)])
    shutil.rmtree(final, ignore_errors=True)
    os.replace(target, final)
    _fsync_directory(root)
    _point(root, final.name)


def _clean(root: Path, step: int, keep_last: int) -> None:
    """After ``latest`` names step ``step``: deletes leftover ``.partial`` directories,
    checkpoints of later steps (an attempt abandoned when the job resumed from an earlier one)
    and all but the newest ``keep_last`` up to ``step``. Best effort: a failure here loses
    nothing."""
    complete = []
    for path in root.glob("step_*"):
        number = _step_of(path)
        if number is None:
            if path.name.endswith(_PARTIAL):  # a save that was killed
                shutil.rmtree(path, ignore_errors=True)
        elif number > step:  # an attempt abandoned by resuming from an earlier step
            shutil.rmtree(path, ignore_errors=True)
        else:
            complete.append((number, path))
    for _, old in sorted(complete)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


# -------------------------------------------------------------------------------- loading
def latest_checkpoint(root: str | Path) -> Path | None:
    """The checkpoint ``root/latest`` names, or None when there is no ``latest``.

    Raises ``IncompleteCheckpointError`` when it names a directory without
    ``trainer_state.json`` (``verify_checkpoint`` checks every file)."""
    root = Path(root)
    pointer = root / _POINTER
    if not pointer.is_file():
        return None
    path = _pointer_target(root)
    if not (path / _TRAINER_STATE).is_file():
        state = "does not exist" if not path.exists() else f"has no {_TRAINER_STATE}"
        raise IncompleteCheckpointError(
            f"checkpoint pointer {pointer} names {path}, which {state}", pointer
        )
    return path


def _pointer_target_or_none(root: Path) -> Path | None:
    try:
        return root / (root / _POINTER).read_text().strip()
    except OSError:
        return None


def _pointer_target(root: Path) -> Path:
    name = (root / _POINTER).read_text().strip()
    path = root / name
    if name.endswith(_PARTIAL) and not path.exists():  # renamed to step_N since
        path = root / name[: -len(_PARTIAL)]
    return path


def checkpoint_candidates(root: str | Path) -> list[Path]:
    """Where a resume looks, in order: the checkpoint ``latest`` names (even if it is not
    there), then every ``step_N`` directory, newest first."""
    root = Path(root)
    found = sorted(
        (p for p in root.glob("step_*") if _step_of(p) is not None and p.is_dir()),
        key=lambda p: _step_of(p) or 0,
        reverse=True,
    )
    if (root / _POINTER).is_file():
        target = _pointer_target(root)
        found = [target] + [p for p in found if p != target]
    return found


def read_trainer_state(path: str | Path) -> dict[str, Any]:
    """The JSON trainer state (step, data position, ...) of a complete checkpoint."""
    state_file = Path(path) / _TRAINER_STATE
    if not state_file.is_file():
        raise IncompleteCheckpointError(
            f"checkpoint {path} has no {_TRAINER_STATE}; it is not a complete checkpoint",
            state_file,
        )
    try:
        state = json.loads(state_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise IncompleteCheckpointError(
            f"{state_file} is not readable JSON ({error}); the checkpoint is damaged", state_file
        ) from None
    if not isinstance(state, dict) or "step" not in state:
        raise IncompleteCheckpointError(f"{state_file} holds no trainer state", state_file)
    return state


def _read_metadata(path: Path) -> Metadata:
    file = path / _METADATA
    if not file.is_file():
        raise IncompleteCheckpointError(
            f"checkpoint {path} has no DCP metadata file {file}; it is not a complete checkpoint",
            file,
        )
    try:
        with file.open("rb") as handle:
            metadata = pickle.load(handle)
    except Exception as error:  # noqa: BLE001 - any unpickling failure means a damaged file
        raise IncompleteCheckpointError(
            f"DCP metadata {file} is unreadable ({type(error).__name__}: {error}); "
            "the checkpoint is damaged",
            file,
        ) from None
    if not isinstance(metadata, Metadata):
        raise IncompleteCheckpointError(f"{file} holds no DCP metadata", file)
    return metadata


def verify_checkpoint(path: str | Path) -> dict[str, Any]:
    """Checks that ``path`` is a whole checkpoint and returns its trainer state: the trainer
    state reads, DCP's ``.metadata`` reads, and every shard file it lists is there and at least
    as long as the bytes it records in it. Raises ``IncompleteCheckpointError`` naming the
    first file that is not."""
    path = Path(path)
    if not path.is_dir():
        raise IncompleteCheckpointError(f"checkpoint {path} does not exist", path)
    trainer_state = read_trainer_state(path)
    metadata = _read_metadata(path)
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        end = int(info.offset) + int(info.length)
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, end in sorted(needed.items()):
        file = path / name
        try:
            size = file.stat().st_size
        except FileNotFoundError:
            raise IncompleteCheckpointError(
                f"shard file {file} listed in {path / _METADATA} is missing", file
            ) from None
        if size < end:
            raise IncompleteCheckpointError(
                f"shard file {file} is truncated: {size} bytes, {path / _METADATA} records "
                f"data up to byte {end}",
                file,
            )
    return trainer_state


def find_resumable(
    root: str | Path, *, exclude: tuple[Path, ...] | list[Path] = ()
) -> tuple[Path | None, list[tuple[Path, IncompleteCheckpointError]]]:
    """The checkpoint to resume from: the one ``latest`` names when it is whole, else the
    newest whole one (``None`` when there is none), and the ones skipped with why;
    ``exclude``: checkpoints already found damaged (e.g. by a load that failed).

    In a process group every rank checks and the ranks agree (a checkpoint any rank finds
    damaged is skipped on all), so they all pick the same one."""
    skipped: list[tuple[Path, IncompleteCheckpointError]] = []
    root = Path(root)
    pointer = root / _POINTER
    for path in checkpoint_candidates(root):
        if path in exclude:
            continue
        error: IncompleteCheckpointError | None = None
        try:
            verify_checkpoint(path)
        except IncompleteCheckpointError as caught:
            error = caught
            if not path.exists() and path == _pointer_target(root):
                error = IncompleteCheckpointError(
                    f"checkpoint pointer {pointer} names {path}, which does not exist", pointer
                )
        message = _agree(str(error) if error else None, from_writer=False)
        if message is None:
            return path, skipped
        skipped.append((path, error or IncompleteCheckpointError(message, path)))
    return None, skipped


def _flat_keys(state: dict[str, Any]) -> set[str]:
    """DCP's flat names of the entries of ``state`` (empty where DCP does not say)."""
    try:
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    except ImportError:  # pragma: no cover - a DCP without it: only the model is checked
        return set()
    return set(flatten_state_dict(state)[0])


def _flat_model_keys(app_state: dict[str, Any]) -> dict[str, tuple[int, ...] | None]:
    """DCP's names of ``app_state["model"]``'s entries with their global shapes."""
    shapes: dict[str, tuple[int, ...] | None] = {}
    with warnings.catch_warnings():
        # torchrec's sharded tables are ShardedTensors, whose size() warns at every call that
        # the type is deprecated: a notice for torchrec, printed at every resume.
        warnings.simplefilter("ignore", FutureWarning)
        for name, value in app_state.get("model", {}).items():
            size = getattr(value, "size", None)
            shapes[f"model.{name}"] = tuple(size()) if callable(size) else None
    return shapes


def _differences(saved: Any, current: Any, prefix: str = "") -> list[str]:
    """``field: saved -> current`` for every leaf where two JSON-like configs differ."""
    if isinstance(saved, dict) and isinstance(current, dict):
        return [
            line
            for key in sorted(set(saved) | set(current), key=str)
            for line in _differences(saved.get(key), current.get(key), f"{prefix}{key}.")
        ]
    return [] if saved == current else [f"{prefix.rstrip('.')}: {saved!r} -> {current!r}"]


def check_fits(
    path: str | Path, app_state: dict[str, Any], *, model_config: dict[str, Any] | None = None
) -> None:
    """Raises ``CheckpointMismatchError`` (on every rank: collective in a process group) unless
    the checkpoint's model tensors are exactly those of ``app_state["model"]`` on all ranks
    together (same names, same global shapes; with expert parallelism each rank holds only
    some) and it holds every other entry of ``app_state`` (the optimizer state). DCP alone
    would fail on a missing or resized tensor without naming the cause, and load a checkpoint
    with more tensors (e.g. more layers) partially, without a word. With ``model_config``
    (this job's, JSON-like) the message lists where the ``model_config`` the checkpoint's
    trainer state recorded differs from it."""
    path = Path(path)
    entries = _read_metadata(path).state_dict_metadata
    saved = {
        name: tuple(meta.size) if isinstance(meta, TensorStorageMetadata) else None
        for name, meta in entries.items()
        if name.startswith("model.")
    }
    wanted = _flat_model_keys(app_state)
    everyone = set(wanted)
    if _distributed():
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, sorted(wanted))
        everyone = {name for names in gathered for name in names}
    missing = sorted(set(wanted) - set(saved))
    extra = sorted(set(saved) - everyone)
    resized = sorted(
        name
        for name in set(wanted) & set(saved)
        if None not in (wanted[name], saved[name]) and wanted[name] != saved[name]
    )
    # The rest (optimizer state, ...) must be there too; entries it has beyond them are left
    # unread, as DCP does (e.g. another sparse layout's optimizer slices after a mesh change).
    others = _flat_keys({key: value for key, value in app_state.items() if key != "model"})
    missing_others = sorted(others - set(entries))
    parts = []
    if missing:
        parts.append(f"{len(missing)} model tensors missing from it (e.g. {missing[0]})")
    if missing_others:
        parts.append(f"{len(missing_others)} other entries missing (e.g. {missing_others[0]})")
    if extra:
        parts.append(f"{len(extra)} it has that this model lacks (e.g. {extra[0]})")
    if resized:
        name = resized[0]
        parts.append(
            f"{len(resized)} of another shape (e.g. {name}: saved {list(saved[name] or ())}, "
            f"this model {list(wanted[name] or ())})"
        )
    problem = _agree("; ".join(parts) or None, from_writer=False)
    if problem is None:
        return
    config = ""
    saved_config = read_trainer_state(path).get("model_config")
    if model_config is not None and saved_config is not None:
        changed = _differences(saved_config, json.loads(json.dumps(model_config, default=str)))
        if changed:
            more = f" and {len(changed) - 4} more" if len(changed) > 4 else ""
            config = f"; model config (checkpoint -> this job): {', '.join(changed[:4])}{more}"
    raise CheckpointMismatchError(
        f"checkpoint {path} was written by another model: {problem} "
        f"(from {path / _METADATA}){config}",
        path / _METADATA,
    )


def load_checkpoint(
    path: str | Path, app_state: dict[str, Any], *, model_config: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Loads a checkpoint in place into ``app_state`` (whose tensors give the target layout,
    which may be sharded differently from the saved one) and returns its trainer state.

    Raises ``IncompleteCheckpointError`` for a checkpoint that is not whole (checked before
    anything loads, and for a read that fails), ``CheckpointMismatchError`` for one of another
    model (``model_config``: see ``check_fits``)."""
    path = Path(path)
    trainer_state = verify_checkpoint(path)
    if "model" in app_state:
        check_fits(path, app_state, model_config=model_config)
    try:
        dcp.load(app_state, checkpoint_id=str(path))
    except (Exception, CheckpointException) as error:  # DCP raises the same on every rank
        raise IncompleteCheckpointError(
            f"checkpoint {path} did not load: {_describe(error)}", path
        ) from None
    return trainer_state
