"""No kernel result depends on memory it never wrote.

The Triton wrappers allocate outputs, gradients, partial sums and scratch with ``torch.empty``
(and ``empty_like`` / ``new_empty``): each kernel must write every element it or a later
kernel reads. Here every such allocation starts as NaN (integers at their maximum), under the
Triton interpreter, and the forward and every gradient must equal a run on ordinary
allocations bit for bit (the interpreter is deterministic, atomics included). A kernel that
reads a padding row, a skipped tile or an unwritten partial turns it into NaN or a wrong value
here, where on a GPU it would read whatever the caching allocator left there.

The kernels' loop variants are covered (JFA's split and fused dQ and one-loop forward;
GDPA's phased, one-loop, pipelined, warp-specialised forwards and fused backward), in bf16
and FP8 mode, self, cross and PMA, on odd jagged shapes (empty samples, lengths that cross
the interpreter's 16-row tiles).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from gem_kernels import gdpa_triton, jfa_triton, rope_qkv, rope_tables, swiglu

H, D = 2, 16
SELF = [0, 1, 5, 37, 16, 0, 17]
CROSS_Q = [0, 1, 5, 9, 2, 40]
CROSS_K = [3, 0, 17, 4, 1, 45]
PMA_QUERIES = 5


def _poison(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.is_floating_point():
        return tensor.fill_(float("nan"))
    if tensor.dtype in (torch.int8, torch.int16, torch.int32, torch.int64):
        return tensor.fill_(torch.iinfo(tensor.dtype).max)
    return tensor


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _run(call, inputs, monkeypatch, *, poisoned: bool):
    """``call``'s output and every input's gradient, with allocations poisoned or not."""
    leaves = [t.clone().requires_grad_(t.is_floating_point()) for t in inputs]
    with monkeypatch.context() as patch:
        if poisoned:
            empty, empty_like, new_empty = torch.empty, torch.empty_like, torch.Tensor.new_empty
            patch.setattr(torch, "empty", lambda *a, **k: _poison(empty(*a, **k)))
            patch.setattr(torch, "empty_like", lambda *a, **k: _poison(empty_like(*a, **k)))
            patch.setattr(
                torch.Tensor, "new_empty", lambda self, *a, **k: _poison(new_empty(self, *a, **k))
            )
        outs = call(*leaves)
        outs = outs if isinstance(outs, tuple) else (outs,)
        gen = torch.Generator().manual_seed(1)
        grads = [torch.randn(o.shape, generator=gen).to(o.dtype) for o in outs]
        torch.autograd.backward(outs, grads)
    return [o.detach() for o in outs] + [t.grad for t in leaves if t.grad is not None]


def _assert_independent_of_uninitialized(call, inputs, monkeypatch):
    clean = _run(call, inputs, monkeypatch, poisoned=False)
    poisoned = _run(call, inputs, monkeypatch, poisoned=True)
    assert len(clean) == len(poisoned)
    for index, (want, got) in enumerate(zip(clean, poisoned, strict=True)):
        assert torch.isfinite(want).all(), f"result {index} of the clean run is not finite"
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"result {index}")


def _tensors(*rows, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, H, D, generator=gen).to(dtype) for n in rows]


JFA_VARIANTS = {
    "split-dq": {},
    "fused-dq": dict(bwd_fused=True),
    "one-loop": dict(fwd_one_loop=True),
}
GDPA_VARIANTS = {
    "phased": {},
    "fused-dq": dict(bwd_loop="fused", short_kv_max=0),
    "one-loop": dict(fwd_loop="one_loop", fwd_programs_per_sm=2),
    "pipelined": dict(fwd_loop="pipelined", bwd_loop="fused"),
    "warp-specialized": dict(fwd_loop="warp_specialized", short_kv_max=0),
}


@pytest.mark.parametrize("variant", JFA_VARIANTS)
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_jfa(interpret, monkeypatch, variant, precision):
    config = replace(jfa_triton.default_config(D, interpret=True), **JFA_VARIANTS[variant])
    dtype = torch.bfloat16 if precision == "fp8" else torch.float32
    options = dict(config=config, precision=precision)
    lengths, q_lengths, k_lengths = (torch.tensor(x) for x in (SELF, CROSS_Q, CROSS_K))
    cases = [
        (
            lambda q, k, v: jfa_triton.jagged_flash_attention_from_lengths(
                q, k, v, lengths, causal=True, window=(9, None), **options
            ),
            (sum(SELF), sum(SELF), sum(SELF)),
        ),
        (
            lambda q, k, v: jfa_triton.jagged_flash_attention_from_lengths(
                q, k, v, q_lengths, k_lengths, **options
            ),
            (sum(CROSS_Q), sum(CROSS_K), sum(CROSS_K)),
        ),
    ]
    for seed, (call, rows) in enumerate(cases):
        inputs = _tensors(*rows, dtype=dtype, seed=seed)
        _assert_independent_of_uninitialized(call, inputs, monkeypatch)


# FP8 calls run the phased kernels whatever the config says.
@pytest.mark.parametrize(
    ("precision", "variant"), [*(("bf16", v) for v in GDPA_VARIANTS), ("fp8", "phased")]
)
def test_gdpa(interpret, monkeypatch, variant, precision):
    config = replace(gdpa_triton.default_config(D, interpret=True), **GDPA_VARIANTS[variant])
    dtype = torch.bfloat16 if precision == "fp8" else torch.float32
    options = dict(activation="gelu_fast", config=config, precision=precision)
    lengths, q_lengths, k_lengths = (torch.tensor(x) for x in (SELF, CROSS_Q, CROSS_K))
    cases = [
        (
            lambda q, k, v: gdpa_triton.gdpa_from_lengths(q, k, v, lengths, causal=True, **options),
            (sum(SELF), sum(SELF), sum(SELF)),
        ),
        (
            lambda q, k, v: gdpa_triton.gdpa_from_lengths(q, k, v, q_lengths, k_lengths, **options),
            (sum(CROSS_Q), sum(CROSS_K), sum(CROSS_K)),
        ),
        (
            lambda q, k, v: gdpa_triton.gdpa_from_lengths(
                q, k, v, None, k_lengths, normalize_by_length=True, **options
            ),
            (PMA_QUERIES, sum(CROSS_K), sum(CROSS_K)),
        ),
    ]
    for seed, (call, rows) in enumerate(cases):
        inputs = _tensors(*rows, dtype=dtype, seed=seed)
        _assert_independent_of_uninitialized(call, inputs, monkeypatch)


def test_rope_qkv_and_swiglu(interpret, monkeypatch):
    tokens = 37
    positions = torch.tensor([i % 11 for i in range(tokens)])
    cos, sin = rope_tables(16, D)
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(tokens, 3, H, D, generator=gen)
    _assert_independent_of_uninitialized(
        lambda x: rope_qkv(x, positions, cos, sin, backend="triton"), [qkv], monkeypatch
    )
    hidden, bias = torch.randn(tokens, 2 * 24, generator=gen), torch.randn(2 * 24, generator=gen)
    _assert_independent_of_uninitialized(
        lambda x, b: swiglu(x, b, backend="triton"), [hidden, bias], monkeypatch
    )
