"""Shared by the FP8 attention tests: gradients as float64, relative errors, and the bound on
FP8's error as a multiple of the bf16 kernels' error."""

from __future__ import annotations

import math


def run_with_grads(fn, tensors, grad_out):
    """``fn(**leaves)``'s output and the gradients of its inputs, as float64."""
    leaves = {n: t.clone().requires_grad_(True) for n, t in tensors.items()}
    out = fn(**leaves)
    out.backward(grad_out.to(out.dtype))
    return {"out": out.detach().double()} | {n: leaves[n].grad.double() for n in leaves}


def rel_errors(got, oracle):
    """``||got - oracle|| / ||oracle||`` per tensor name."""
    return {n: ((got[n] - oracle[n]).norm() / oracle[n].norm()).item() for n in got}


def check_ratios(fp8, bf16, bounds, label):
    """Every FP8 error is finite and at most ``bounds[name]`` times the bf16 error."""
    for name, err in fp8.items():
        ratio = err / bf16[name]
        assert math.isfinite(err) and ratio <= bounds[name], (
            f"{label}: {name} FP8 error {err:.3e} is {ratio:.1f}x the bf16 error "
            f"{bf16[name]:.3e} (bound {bounds[name]}x)"
        )


def check_fp8_against_bf16(public, tensors, grad_out, oracle, bounds, label, *, backend):
    """FP8 against bf16 on ``backend``: ``public(**call)`` builds the call (``backend`` and
    ``precision`` go in ``call``), ``oracle`` holds the CPU float64 results; the tensors may
    be on a GPU. Prints the FP8 errors and ratios, then bounds them (:func:`check_ratios`)."""

    def errors(**call):
        got = run_with_grads(public(backend=backend, **call), tensors, grad_out)
        return rel_errors({n: t.cpu() for n, t in got.items()}, oracle)

    bf16, fp8 = errors(), errors(precision="fp8")
    print(label, {n: f"{fp8[n]:.2e} ({fp8[n] / bf16[n]:.1f}x)" for n in fp8})
    check_ratios(fp8, bf16, bounds, label)
