"""The result schema every benchmark writes (see BENCHMARKS.md): ``{"meta": ..., "rows": [...]}``."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def meta(benchmark: str, command: str, device: str = "cpu (2 cores)", **extra: object) -> dict:
    """The ``meta`` block: what ran, where, on which commit and versions.

    ``GEM_COMMIT`` overrides the commit (the GPU machine gets a copy of the tree without git).
    """
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    commit = os.environ.get("GEM_COMMIT", commit)
    return {
        "benchmark": benchmark,
        "device": device,
        "torch": torch.__version__,
        "commit": commit,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        **extra,
    }


def write_results(path: Path, meta_block: dict, rows: list[dict]) -> None:
    """Writes one run's results, creating the machine folder if needed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta_block, "rows": rows}, indent=2) + "\n")


def user_args() -> list[str]:
    """This run's command-line arguments without ``--out`` (the result path is the default one)."""
    argv, skip = [], False
    for arg in sys.argv[1:]:
        if skip:
            skip = False
        elif arg == "--out":
            skip = True
        elif not arg.startswith("--out="):
            argv.append(arg)
    return argv


def results_parser(doc: str, default_out: str) -> argparse.ArgumentParser:
    """An argument parser described by ``doc``'s first line, with ``--out`` (the result JSON,
    by default ``benchmarks/results/<default_out>``)."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / default_out))
    return parser


def require_cuda() -> None:
    """Exits with a message when no CUDA device is visible (the GPU benchmarks need one)."""
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
