"""Naive dense oracles for the tests: one Python loop per sample, float64, explicit masks.

Written independently of gem_kernels.reference (no bucketing, no chunking, masks built
element by element) so that agreement means something.
"""

from __future__ import annotations

import functools
import math

import torch

__all__ = [
    "check_forward_and_grads",
    "make_jagged",
    "naive_block_attention",
    "naive_gdpa",
    "naive_jfa",
    "offsets_of",
    "plans_built",
]


def plans_built(monkeypatch, module, name: str) -> list[bool]:
    """The ``with_backward`` flag (seventh argument) of every plan ``module.<name>`` builds from
    now on: JFA's ``_build_plan`` and GDPA's ``_plan``."""
    built: list[bool] = []
    original = getattr(module, name)

    def counting(*args, **kwargs):
        built.append(args[6])
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counting)
    return built


def offsets_of(lengths: list[int]) -> torch.Tensor:
    out = [0]
    for length in lengths:
        out.append(out[-1] + length)
    return torch.tensor(out, dtype=torch.int64)


def make_jagged(total: int, heads: int, dim: int, *, seed: int, dtype=torch.float64):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(total, heads, dim, generator=generator, dtype=torch.float64).to(dtype)


@functools.lru_cache(maxsize=4096)
def _visible(lq: int, lk: int, causal: bool, window: tuple | None) -> torch.Tensor:
    rows = []
    for i in range(lq):
        p = i + lk - lq  # bottom-right aligned position of query i
        row = []
        for j in range(lk):
            ok = True
            if causal and j > p:
                ok = False
            if window is not None:
                left, right = window
                if left is not None and j < p - left:
                    ok = False
                if right is not None and j > p + right:
                    ok = False
            row.append(ok)
        rows.append(row)
    return torch.tensor(rows, dtype=torch.bool).reshape(lq, lk)


@functools.lru_cache(maxsize=4096)
def _rel_bucket_table(lq: int, lk: int, num_buckets: int) -> torch.Tensor:
    table = [
        [min(max(i + lk - lq - j + num_buckets // 2, 0), num_buckets - 1) for j in range(lk)]
        for i in range(lq)
    ]
    return torch.tensor(table, dtype=torch.int64).reshape(lq, lk)


def _dense_softmax_rows(scores, vb, mask):
    """Softmax over the visible keys of each row; rows with no visible key give zeros."""
    row_has_key = mask.any(dim=-1, keepdim=True)  # (Lq, 1)
    masked = scores.masked_fill(~mask, float("-inf"))
    # Empty rows get dummy zero scores (finite softmax, finite grads) and are zeroed after.
    safe = torch.where(row_has_key, masked, torch.zeros_like(masked))
    weights = torch.softmax(safe, dim=-1) * row_has_key
    return torch.einsum("hij,jhd->ihd", weights, vb)


def _dense_activation_rows(scores, vb, mask, act):
    weights = torch.where(mask, act(scores), torch.zeros_like(scores))
    return torch.einsum("hij,jhd->ihd", weights, vb)


def naive_jfa(
    q,
    k,
    v,
    q_lengths,
    k_lengths=None,
    *,
    scale=None,
    causal=False,
    window=None,
    rel_pos_bias=None,
    jagged_bias=None,
):
    k_lengths = q_lengths if k_lengths is None else k_lengths
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    q, k, v = q.double(), k.double(), v.double()
    outs, q0, k0, b0 = [], 0, 0, 0
    for lq, lk in zip(q_lengths, k_lengths, strict=True):
        qb, kb, vb = q[q0 : q0 + lq], k[k0 : k0 + lk], v[k0 : k0 + lk]
        scores = torch.einsum("ihd,jhd->hij", qb, kb) * scale
        if rel_pos_bias is not None:
            table = _rel_bucket_table(lq, lk, rel_pos_bias.shape[1])
            scores = scores + rel_pos_bias.double()[:, table]
        if jagged_bias is not None:
            block = jagged_bias.double()[:, b0 : b0 + lq * lk].reshape(
                -1 if lq * lk else scores.shape[0], lq, lk
            )
            scores = scores + block
        mask = _visible(lq, lk, causal, None if window is None else tuple(window))
        outs.append(_dense_softmax_rows(scores, vb, mask))
        q0, k0, b0 = q0 + lq, k0 + lk, b0 + lq * lk
    return torch.cat(outs) if outs else q[:0]


def _naive_activation(name):
    if name == "silu":
        return lambda x: x / (1.0 + torch.exp(-x))
    if name == "gelu":
        return lambda x: 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))
    if name == "gelu_tanh":
        c = math.sqrt(2.0 / math.pi)
        return lambda x: 0.5 * x * (1.0 + torch.tanh(c * (x + 0.044715 * x**3)))
    if name == "gelu_fast":
        # The polynomial itself is checked against exact GELU in test_kernels_gelu_fast.py.
        from gem_kernels.reference import gelu_fast

        return gelu_fast
    if name == "relu2":
        return lambda x: torch.clamp(x, min=0.0) ** 2
    if name == "identity":
        return lambda x: x
    raise AssertionError(name)


def naive_gdpa(
    q,
    k,
    v,
    q_lengths,
    k_lengths,
    *,
    activation="silu",
    scale=None,
    causal=False,
    window=None,
    normalize_by_length=False,
    broadcast=False,
):
    """broadcast=True: q is (Nq, H, D) shared by every sample (PMA)."""
    act = _naive_activation(activation)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    q, k, v = q.double(), k.double(), v.double()
    outs, q0, k0 = [], 0, 0
    for lq, lk in zip(q_lengths, k_lengths, strict=True):
        qb = q if broadcast else q[q0 : q0 + lq]
        kb, vb = k[k0 : k0 + lk], v[k0 : k0 + lk]
        scores = torch.einsum("ihd,jhd->hij", qb, kb) * scale
        mask = _visible(lq, lk, causal, None if window is None else tuple(window))
        out = _dense_activation_rows(scores, vb, mask, act)
        if normalize_by_length and lk > 0:
            out = out / lk
        outs.append(out)
        q0, k0 = q0 + (0 if broadcast else lq), k0 + lk
    return torch.cat(outs) if outs else q[:0]


def _rope_complex(x, positions, theta):
    """Rotate-half RoPE written as a complex multiply: (x_i + i x_{i+D/2}) * e^{i pos w_i}."""
    half = x.shape[-1] // 2
    z = torch.complex(x[..., :half], x[..., half:])
    freqs = torch.tensor(
        [theta ** (-2.0 * i / x.shape[-1]) for i in range(half)], dtype=torch.float64
    )
    angle = positions.double()[:, None, None] * freqs.double()[None, None, :]
    rotated = z * torch.polar(torch.ones_like(angle), angle)
    return torch.cat([rotated.real, rotated.imag], dim=-1)


def naive_block_attention(
    q, k, v, lengths, *, block_size=64, positions=None, rope_theta=10000.0, scale=None
):
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    q, k, v = q.double(), k.double(), v.double()
    if positions is None:
        positions = torch.tensor([i for length in lengths for i in range(length)], dtype=torch.long)
    q = _rope_complex(q, positions, rope_theta)
    k = _rope_complex(k, positions, rope_theta)
    outs, start = [], 0
    for length in lengths:
        qb, kb, vb = q[start : start + length], k[start : start + length], v[start : start + length]
        scores = torch.einsum("ihd,jhd->hij", qb, kb) * scale
        mask = torch.tensor(
            [[i // block_size == j // block_size for j in range(length)] for i in range(length)],
            dtype=torch.bool,
        ).reshape(length, length)
        outs.append(_dense_softmax_rows(scores, vb, mask))
        start += length
    return torch.cat(outs) if outs else q[:0]


def check_forward_and_grads(fn_under_test, fn_naive, tensors: dict, *, atol=1e-9, rtol=1e-7):
    """Run both on float64 leaf copies; compare outputs and the gradient of every tensor."""
    leaves_a = {name: t.detach().clone().requires_grad_(True) for name, t in tensors.items()}
    leaves_b = {name: t.detach().clone().requires_grad_(True) for name, t in tensors.items()}
    out_a = fn_under_test(**leaves_a)
    out_b = fn_naive(**leaves_b)
    assert out_a.shape == out_b.shape, (out_a.shape, out_b.shape)
    assert torch.isfinite(out_a).all()
    torch.testing.assert_close(out_a, out_b.to(out_a.dtype), atol=atol, rtol=rtol)
    generator = torch.Generator().manual_seed(1234)
    grad_out = torch.randn(out_a.shape, generator=generator, dtype=torch.float64)
    if out_a.requires_grad:
        (out_a * grad_out.to(out_a.dtype)).sum().backward()
    if out_b.requires_grad:
        (out_b * grad_out).sum().backward()
    for name in tensors:
        grad_a, grad_b = leaves_a[name].grad, leaves_b[name].grad
        if grad_b is None:
            grad_b = torch.zeros_like(leaves_b[name])
        if grad_a is None:
            grad_a = torch.zeros_like(leaves_a[name])
        assert torch.isfinite(grad_a).all(), name
        torch.testing.assert_close(
            grad_a, grad_b.to(grad_a.dtype), atol=atol, rtol=rtol, msg=f"grad of {name}"
        )
