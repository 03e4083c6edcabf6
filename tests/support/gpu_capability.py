"""The GPU tests' compute-capability markers, and the GPU types of ``nox -s "gpu(<arch>)"``.

``gpu`` marks every test that needs a CUDA device. The markers here narrow it to the GPUs
whose compute capability runs the test; the root ``conftest.py`` skips a marked test on any
other GPU, with the reason, and ``noxfile.py``'s ``gpu(<arch>)`` sessions select tests by them
and say beforehand what a GPU of another type deselects or skips. Plain Python, no torch or
pytest import: the noxfile loads it as well.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["CAPABILITY_MARKERS", "GPU_ARCHS", "needs", "sm", "unmet"]

Capability = tuple[int, int]


class Requirement(NamedTuple):
    lowest: Capability
    """The lowest compute capability that runs the test."""
    below: Capability | None
    """The first capability past the range (``None``: every newer GPU runs it too)."""
    why: str


CAPABILITY_MARKERS: dict[str, Requirement] = {
    "sm89": Requirement(
        (8, 9),
        None,
        "FP8 E4M3 in compiled Triton kernels, which Triton allows from sm_89 on",
    ),
    "hopper": Requirement(
        (9, 0),
        (10, 0),
        "blockwise-scaled FP8 torch._scaled_mm, gem-precision's sm90 GEMM backend; "
        "Blackwell has the MXFP8 one, other GPUs the emulation",
    ),
}
"""Marker -> the compute capabilities that run its tests, and why."""


class Arch(NamedTuple):
    capability: Capability
    deselect: tuple[str, ...] = ()
    """Markers of tests that this GPU type cannot run (left out by the ``-m`` expression)."""

    @property
    def marker_expression(self) -> str:
        """The ``pytest -m`` expression of the session: the tests this GPU type runs."""
        return " and not ".join(("gpu", *self.deselect))


GPU_ARCHS: dict[str, Arch] = {
    "hopper": Arch((9, 0)),
    "blackwell": Arch((10, 0), deselect=("hopper",)),
}
"""The ``gpu(<arch>)`` nox sessions (H100 / H200: sm_90; B200: sm_100). No Triton kernel of
ours is Hopper-only in its code (the TMA and warp-specialised paths are taken from sm_90 on,
the others below; nothing is gated on sm_90 exactly), so Blackwell leaves out only the
blockwise-scaled FP8 GEMM tests. Nothing has run on a Blackwell GPU yet."""


def sm(capability: Capability) -> str:
    return f"sm_{capability[0]}{capability[1]}"


def needs(marker: str) -> str:
    """The compute capability a test marked ``marker`` needs, in words."""
    lowest, below, _ = CAPABILITY_MARKERS[marker]
    if below is None:
        span = f">= {lowest[0]}.{lowest[1]}"
    elif lowest[1] == 0 and below == (lowest[0] + 1, 0):
        span = f"{lowest[0]}.x"
    else:
        span = f"{lowest[0]}.{lowest[1]} to {below[0]}.{below[1]} (exclusive)"
    return f"compute capability {span}"


def unmet(marker: str, capability: Capability) -> str | None:
    """Why a GPU of ``capability`` cannot run a test marked ``marker``; ``None`` if it can."""
    lowest, below, why = CAPABILITY_MARKERS[marker]
    if capability >= lowest and (below is None or capability < below):
        return None
    return f"needs {needs(marker)} ({marker!r}: {why}), this GPU is {sm(capability)}"
