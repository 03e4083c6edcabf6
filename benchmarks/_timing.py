"""Timing and checking helpers shared by the GPU benchmarks (``bench_*.py``).

Providers return ``(fwd, fwd_bwd, leaves)``: ``fwd`` runs without autograd, ``fwd_bwd`` runs on
fresh leaf copies of the inputs and back-propagates a fixed gradient, and ``leaves`` are the
tensors whose ``.grad`` the timer resets between repetitions.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

import torch

__all__ = [
    "autograd_provider",
    "fastest",
    "grad_leaves",
    "median_ms",
    "raise_recompile_limits",
    "record_check",
    "rel_error",
]

T = TypeVar("T")


def median_ms(fn: Callable[[], object], *, warmup: float, rep: float, grad_to_none=None) -> float:
    """Median milliseconds of ``fn`` by ``triton.testing.do_bench`` (``warmup``/``rep`` in ms)."""
    import triton.testing

    return triton.testing.do_bench(
        fn, warmup=warmup, rep=rep, grad_to_none=grad_to_none, return_mode="median"
    )


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``||got - want|| / ||want||`` in float32 (the denominator clamped at 1e-12)."""
    got, want = got.detach().float(), want.detach().float()
    return float((got - want).norm() / want.norm().clamp(min=1e-12))


def grad_leaves(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Detached copies of ``tensors`` that require grad (the leaves a backward fills)."""
    return [t.detach().clone().requires_grad_(True) for t in tensors]


def autograd_provider(
    run: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor], grad: torch.Tensor
) -> tuple[Callable[[], torch.Tensor], Callable[[], None], list[torch.Tensor]]:
    """``(fwd, fwd_bwd, leaves)`` of ``run(*inputs) -> out``, back-propagating ``grad``."""

    def fwd():
        with torch.no_grad():
            return run(*inputs)

    leaves = grad_leaves(inputs)

    def fwd_bwd():
        run(*leaves).backward(grad)

    return fwd, fwd_bwd, leaves


def raise_recompile_limits(limit: int) -> None:
    """Lifts dynamo's recompile caps to ``limit`` (past them a compiled fn runs eagerly)."""
    import torch._dynamo as dynamo  # binds only `dynamo`: `torch` stays the module global

    # The names changed across torch versions; set the ones this version has.
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit"):
        if hasattr(dynamo.config, name):
            setattr(dynamo.config, name, limit)


def record_check(checks: dict, name: str, compute: Callable[[], dict[str, float]]) -> None:
    """Stores ``compute()`` (relative errors by label) as ``checks[name]`` and prints it.

    A failure is stored as ``{"error": ...}`` and printed; the benchmark goes on.
    """
    try:
        errors = compute()
        checks[name] = errors
        print(f"check {name}: " + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()))
    except Exception as error:  # noqa: BLE001 - report and keep benchmarking
        checks[name] = {"error": repr(error)[:300]}
        print(f"check {name} failed: {error!r}"[:400])


def fastest(
    candidates: Iterable[T],
    time_ms: Callable[[T], float],
    *,
    default: T,
    deadline: float,
    label: str,
    describe: Callable[[T], str],
) -> T:
    """The candidate with the lowest ``time_ms`` among those started before ``deadline``
    (``time.time()`` seconds); ``default`` when none ran.

    Prints ``describe(candidate)`` with each time; a failing candidate is printed as
    ``sweep <label> <candidate>: <error>`` and skipped.
    """
    best, best_ms = default, math.inf
    for candidate in candidates:
        if time.time() > deadline:
            break
        try:
            ms = time_ms(candidate)
        except Exception as error:  # noqa: BLE001 - a config that fails is not a candidate
            print(f"sweep {label} {candidate}: {error!r}"[:300])
            continue
        print(f"{describe(candidate)}: {ms:.3f} ms")
        if ms < best_ms:
            best, best_ms = candidate, ms
    return best
