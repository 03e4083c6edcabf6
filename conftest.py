"""Workspace-wide test hook: a GPU test marked for a compute capability (``sm89``, ``hopper``:
``tests/support/gpu_capability.py``) skips on a GPU without it, saying what it needs and
what this GPU is, so a run on another GPU type lists what it skipped and why (``-ra``)."""

from __future__ import annotations

import functools

import pytest
from gpu_capability import CAPABILITY_MARKERS, unmet


@functools.cache
def _visible_gpu() -> tuple[tuple[int, int], str] | None:
    """(compute capability, name) of the current CUDA device, or ``None`` without one. Asked
    only when a marked test is about to run (it initialises CUDA in this process)."""
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(), torch.cuda.get_device_name()


def pytest_runtest_setup(item: pytest.Item) -> None:
    markers = [name for name in CAPABILITY_MARKERS if item.get_closest_marker(name)]
    if not markers:
        return
    gpu = _visible_gpu()
    if gpu is None:
        return  # no CUDA device: the test's own skipif ("needs CUDA") says so
    capability, name = gpu
    reasons = [reason for marker in markers if (reason := unmet(marker, capability))]
    if reasons:
        pytest.skip(f"{'; '.join(reasons)} ({name})")
