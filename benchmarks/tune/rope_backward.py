"""Exploration: RoPE forward + backward as Inductor compiles it, at the h200 recipe's shape.

The h200 profile (``results/h200/tuning/train_profile.json``) has Inductor's fused RoPE
backward (``..._slice_backward_stack_...``) at 4.0-4.3 ms per layer: 159 registers a thread,
19% occupancy, against 0.68 ms for its forward. Its inputs and output are about 3.2 GB, which
is 0.8 ms at the H200's bandwidth. This script times, compiled the way the model compiles
them (token count dynamic):

- ``cat``: ``gem_kernels.reference.apply_rope`` (halves sliced, rotated, concatenated);
- ``flip``: ``x * C + x.flip(-2) * S`` on ``x`` viewed as ``(T, H, 2, D/2)``, with
  ``C = (cos, cos)`` and ``S = (-sin, sin)``: the same numbers, with no slice or cat for
  autograd to undo;
- ``flip_qk``: the same on q and k together, one slice of the qkv output;
- ``inverse``: the ``cat`` form in an autograd.Function whose backward is the inverse
  rotation (``sin`` negated), a copy of the forward kernel instead of undoing slices and cat;
- ``kernel``: ``gem_kernels.rope``, our Triton kernel (its backward: the same kernel, inverse).

Both rotate q and k of one qkv projection output and hand back the gradient of that output,
as a sequence layer's backward does.

    python benchmarks/tune/rope_backward.py [--tokens 520186] [--variants cat kernel] [--json F]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from gem_kernels import rope
from gem_kernels.reference import apply_rope, rope_tables


def rope_cat(qkv, positions, cos, sin, heads):
    q, k, v = qkv.view(qkv.shape[0], 3, heads, -1).unbind(1)
    tables = (cos, sin)
    return apply_rope(q, positions, tables=tables), apply_rope(k, positions, tables=tables), v


def rope_flip(qkv, positions, cos, sin, heads):
    q, k, v = qkv.view(qkv.shape[0], 3, heads, -1).unbind(1)
    c, s = cos[positions].to(qkv.dtype), sin[positions].to(qkv.dtype)
    big_c = torch.stack([c, c], dim=1)[:, None]  # (T, 1, 2, D/2)
    big_s = torch.stack([-s, s], dim=1)[:, None]

    def rotate(x):
        halves = x.unflatten(-1, (2, -1))
        return (halves * big_c + halves.flip(-2) * big_s).flatten(-2)

    return rotate(q), rotate(k), v


def rope_flip_qk(qkv, positions, cos, sin, heads):
    """``flip`` on q and k together: one rotation of the (T, 2, H, 2, D/2) slice of qkv."""
    parts = qkv.view(qkv.shape[0], 3, heads, 2, -1)
    c, s = cos[positions].to(qkv.dtype), sin[positions].to(qkv.dtype)
    big_c = torch.stack([c, c], dim=1)[:, None, None]  # (T, 1, 1, 2, D/2)
    big_s = torch.stack([-s, s], dim=1)[:, None, None]
    qk = parts[:, :2]
    rotated = (qk * big_c + qk.flip(-2) * big_s).flatten(-2)
    return rotated[:, 0], rotated[:, 1], parts[:, 2].flatten(-2)


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class _Rotate(torch.autograd.Function):
    """A rotation's gradient is the opposite rotation of the output's gradient."""

    @staticmethod
    def forward(x, cos, sin):
        return _rotate(x, cos, sin)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[1], inputs[2])

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return _rotate(grad, cos, -sin), None, None


def rope_inverse(qkv, positions, cos, sin, heads):
    q, k, v = qkv.view(qkv.shape[0], 3, heads, -1).unbind(1)
    c = cos[positions].to(qkv.dtype)[:, None, :]
    s = sin[positions].to(qkv.dtype)[:, None, :]
    return _Rotate.apply(q, c, s), _Rotate.apply(k, c, s), v


def rope_kernel(qkv, positions, cos, sin, heads):
    q, k, v = qkv.view(qkv.shape[0], 3, heads, -1).unbind(1)
    return rope(q, positions, cos, sin), rope(k, positions, cos, sin), v


VARIANTS = {
    "cat": rope_cat,
    "flip": rope_flip,
    "flip_qk": rope_flip_qk,
    "inverse": rope_inverse,
    "kernel": rope_kernel,
}


def run(fn, qkv, positions, cos, sin, heads, grads):
    out = fn(qkv, positions, cos, sin, heads)
    return torch.autograd.grad(out, qkv, grads)[0], out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=520_186)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16
    gen = torch.Generator(device="cpu").manual_seed(0)
    tokens, dim, heads = args.tokens, args.dim, args.heads
    qkv = torch.randn(tokens, 3 * dim, generator=gen).to(device, dtype).requires_grad_()
    positions = torch.randint(0, args.max_len, (tokens,), generator=gen).to(device)
    cos, sin = (t.to(device) for t in rope_tables(args.max_len, dim // heads))
    grads = [torch.randn(tokens, heads, dim // heads, generator=gen).to(device, dtype)
             for _ in range(3)]  # fmt: skip
    results, reference = {}, None
    for name in args.variants:
        fn = VARIANTS[name]
        compiled = torch.compile(lambda *a, fn=fn: run(fn, *a), dynamic=True)
        grad, out = compiled(qkv, positions, cos, sin, heads, grads)
        if reference is None:
            reference = (grad, out)
        # Inductor computes in float32 and rounds once, so FMA contraction may differ between
        # the two: equal up to bf16 rounding, not bit for bit.
        diff = max(
            (a.float() - b.float()).abs().max().item()
            for a, b in zip((grad, *out), (reference[0], *reference[1]), strict=True)
        )
        ms = float("nan")
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            for _ in range(3):
                compiled(qkv, positions, cos, sin, heads, grads)
            start.record()
            for _ in range(args.reps):
                compiled(qkv, positions, cos, sin, heads, grads)
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end) / args.reps
        results[name] = {"fwd_bwd_ms": ms, "max_abs_diff_to_cat": diff}
        print(f"{name:7s} fwd+bwd {ms:7.3f} ms  max |diff| to cat: {diff:.3g}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"tokens": tokens, "dim": dim, "heads": heads,
                                         "variants": results}, indent=1) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
