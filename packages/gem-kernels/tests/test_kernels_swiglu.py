"""``gem_kernels.swiglu`` (SwiGLU's gate): the Triton kernels under the interpreter and the
reference against float64 autograd of ``silu(gate) * value`` of ``hidden (+ bias)``, forward and
both gradients, on odd shapes and strided rows.

The file sorts before ``test_kernels_ops.py``, which imports ``torch._dynamo`` (after which the
interpreter cannot run); the operators' opcheck and compile tests live there.
"""

from __future__ import annotations

import pytest
import torch
from gem_kernels import swiglu
from torch.nn import functional as F


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _oracle(hidden: torch.Tensor, grad: torch.Tensor, bias: torch.Tensor | None = None):
    """float64 autograd of the unfused formula: (output, hidden's gradient, bias's gradient)."""
    leaf = hidden.double().requires_grad_(True)
    bias_leaf = None if bias is None else bias.double().requires_grad_(True)
    gate, value = (leaf if bias is None else leaf + bias_leaf).chunk(2, dim=-1)
    out = F.silu(gate) * value
    out.backward(grad.double())
    return out.detach(), leaf.grad, None if bias is None else bias_leaf.grad


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize(
    ("shape", "strided"),
    # Rows and widths off the (8, 512) tile, and rows past one bias-summing program (512 rows);
    # a slice of wider rows; leading dims; empty.
    [
        ((37, 2 * 140), False),
        ((1100, 2 * 520), False),
        ((70, 2 * 24), True),
        ((3, 5, 2 * 9), False),
        ((1, 2), False),
        ((0, 2 * 16), False),
    ],  # fmt: skip
)
def test_forward_and_gradients_match_the_oracle(interpret, backend, shape, strided, with_bias):
    gen = torch.Generator().manual_seed(sum(shape))
    hidden = torch.randn(*shape[:-1], shape[-1] + (6 if strided else 0), generator=gen)
    if strided:
        hidden = hidden[..., 3 : 3 + shape[-1]]
    grad = torch.randn(*shape[:-1], shape[-1] // 2, generator=gen)
    # with strided rows, a strided bias too: every other element of a longer leaf
    step = 2 if strided else 1
    bias_leaf = torch.randn(step * shape[-1], generator=gen).requires_grad_(True)
    bias = bias_leaf[::step] if with_bias else None
    leaf = hidden.detach().clone().requires_grad_(True)
    out = swiglu(leaf, bias, backend=backend)
    out.backward(grad)
    want, want_grad, want_bias_grad = _oracle(hidden, grad, None if bias is None else bias.detach())
    assert out.shape == want.shape and out.dtype == hidden.dtype
    torch.testing.assert_close(out.double(), want, atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(leaf.grad.double(), want_grad, atol=2e-6, rtol=2e-6)
    if with_bias:
        # a sum over up to 1100 rows in float32
        got_bias_grad = bias_leaf.grad[::step].double()
        torch.testing.assert_close(got_bias_grad, want_bias_grad, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_rounds_once(interpret, dtype):
    """The kernels compute in float32 and round once: the output and both gradient halves
    within one ulp of the float64 result of the same (rounded) inputs. (One ulp, not half:
    the interpreter truncates float32 to bfloat16 where the GPU rounds to nearest.)"""
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(45, 2 * 40, generator=gen).to(dtype)
    grad = torch.randn(45, 40, generator=gen).to(dtype)
    want, want_grad, _ = _oracle(hidden, grad)
    got = swiglu(hidden, backend="triton").double()
    got_grad = torch.ops.gem_kernels.swiglu_backward(grad, hidden, None, "triton")[0].double()
    for result, exact in ((got, want), (got_grad, want_grad)):
        ulp = torch.finfo(dtype).eps * exact.abs().clamp(min=torch.finfo(dtype).tiny)
        assert ((result - exact).abs() <= ulp + 1e-6 * exact.abs().max()).all()


def test_triton_and_reference_agree_in_float32(interpret):
    gen = torch.Generator().manual_seed(9)
    hidden = torch.randn(33, 2 * 130, generator=gen) * 4  # saturating sigmoids too
    grad = torch.randn(33, 130, generator=gen)
    bias = torch.randn(2 * 130, generator=gen)
    ops = torch.ops.gem_kernels
    for bias_or_none in (None, bias):
        torch.testing.assert_close(
            ops.swiglu(hidden, bias_or_none, "triton"),
            ops.swiglu(hidden, bias_or_none, "reference"),
            atol=1e-6,
            rtol=1e-6,
        )
        for got, want in zip(
            ops.swiglu_backward(grad, hidden, bias_or_none, "triton"),
            ops.swiglu_backward(grad, hidden, bias_or_none, "reference"),
            strict=True,
        ):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-6)


def test_bias_gradient_is_float32_sums_in_the_bias_dtype(interpret):
    """A float32 bias beside bfloat16 hidden (the up projection's under autocast): the bias's
    gradient is in float32, summed from the unrounded float32 gradient, and the summation
    order is fixed (two calls agree bit for bit)."""
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(700, 2 * 24, generator=gen).bfloat16()
    grad = torch.randn(700, 24, generator=gen).bfloat16()
    bias = torch.randn(2 * 24, generator=gen)
    ops = torch.ops.gem_kernels
    _, grad_bias = ops.swiglu_backward(grad, hidden, bias, "triton")
    _, again = ops.swiglu_backward(grad, hidden, bias, "triton")
    _, _, want = _oracle(hidden, grad, bias)
    assert grad_bias.dtype == torch.float32 and torch.equal(grad_bias, again)
    torch.testing.assert_close(grad_bias.double(), want, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize(
    ("hidden", "error", "match"),
    [
        (torch.randn(4, 7), ValueError, "last dimension must be even"),
        (torch.randn(4, 6).int(), TypeError, "hidden must have dtype"),
        ([1.0, 2.0], TypeError, "hidden must be a torch.Tensor"),
    ],
)
def test_bad_input_names_the_argument(hidden, error, match):
    with pytest.raises(error, match=match):
        swiglu(hidden)


@pytest.mark.parametrize(
    ("bias", "error", "match"),
    [
        (torch.randn(3), ValueError, r"bias must have shape \(6,\)"),
        (torch.randn(2, 6), ValueError, r"bias must have shape \(6,\)"),
        (torch.zeros(6, dtype=torch.int64), TypeError, "bias must have dtype"),
        ([0.0] * 6, TypeError, "bias must be None or a torch.Tensor"),
    ],
)
def test_bad_bias_names_the_argument(bias, error, match):
    with pytest.raises(error, match=match):
        swiglu(torch.randn(4, 6), bias)


def test_bad_backend():
    with pytest.raises(ValueError, match="backend must be one of"):
        swiglu(torch.randn(2, 4), backend="cuda")


def test_triton_backend_on_cpu_without_interpreter_says_why(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        swiglu(torch.randn(2, 4), backend="triton")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_rounds_once_to_nearest(dtype):
    """On the GPU the cast rounds to nearest: within half an ulp of the exact result, plus the
    float32 rounding of the terms (the gate's gradient cancels near gate = -1.28), at a
    training shape (rows past a tile, a width off the 128-column tile)."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    hidden = torch.randn(70_001, 2 * 1376, generator=gen, device="cuda").to(dtype)
    grad = torch.randn(70_001, 1376, generator=gen, device="cuda").to(dtype)
    want, want_grad, _ = _oracle(hidden, grad)
    got = swiglu(hidden).double()
    got_grad = torch.ops.gem_kernels.swiglu_backward(grad, hidden, None, "auto")[0].double()
    gate, value = hidden.double().chunk(2, dim=-1)
    g = grad.double()
    terms = (gate * value).abs(), torch.cat([g * value * (1 + gate.abs()), g * gate], -1).abs()
    for result, exact, size in ((got, want, terms[0]), (got_grad, want_grad, terms[1])):
        half_ulp = 0.5 * torch.finfo(dtype).eps * exact.abs().clamp(min=torch.finfo(dtype).tiny)
        float32_error = 4 * torch.finfo(torch.float32).eps * size
        assert ((result - exact).abs() <= half_ulp + float32_error).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_bias_gradient_matches_float64():
    """The bias path at a training shape (bf16 hidden, float32 bias, as under autocast): the
    output within one bf16 ulp of float64, the bias gradient within float32 summation error of
    the float64 column sums, and bit-identical on a second call."""
    gen = torch.Generator(device="cuda").manual_seed(2)
    hidden = torch.randn(70_001, 2 * 1376, generator=gen, device="cuda").bfloat16()
    grad = torch.randn(70_001, 1376, generator=gen, device="cuda").bfloat16()
    bias = torch.randn(2 * 1376, generator=gen, device="cuda")
    want, _, want_bias = _oracle(hidden, grad, bias)
    got = swiglu(hidden, bias).double()
    ops = torch.ops.gem_kernels
    _, got_bias = ops.swiglu_backward(grad, hidden, bias, "auto")
    _, again = ops.swiglu_backward(grad, hidden, bias, "auto")
    ulp = torch.finfo(torch.bfloat16).eps * want.abs().clamp(min=1e-30)
    assert ((got - want).abs() <= ulp + 1e-5).all()
    assert got_bias.dtype == torch.float32 and torch.equal(got_bias, again)
    torch.testing.assert_close(got_bias.double(), want_bias, rtol=1e-5, atol=1e-2)
