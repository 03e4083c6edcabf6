"""``gem_kernels.swiglu`` (SwiGLU's gate): the Triton kernels under the interpreter and the
reference against float64 autograd of ``silu(gate) * value``, forward and gradient, on odd
shapes and strided rows.

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


def _oracle(hidden: torch.Tensor, grad: torch.Tensor):
    """float64 autograd of the unfused formula: (output, hidden's gradient)."""
    leaf = hidden.double().requires_grad_(True)
    gate, value = leaf.chunk(2, dim=-1)
    out = F.silu(gate) * value
    out.backward(grad.double())
    return out.detach(), leaf.grad


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize(
    ("shape", "strided"),
    # Rows and widths off the (32, 128) tile; a slice of wider rows; leading dims; empty.
    [
        ((37, 2 * 140), False),
        ((70, 2 * 24), True),
        ((3, 5, 2 * 9), False),
        ((1, 2), False),
        ((0, 2 * 16), False),
    ],  # fmt: skip
)
def test_forward_and_gradient_match_the_oracle(interpret, backend, shape, strided):
    gen = torch.Generator().manual_seed(sum(shape))
    hidden = torch.randn(*shape[:-1], shape[-1] + (6 if strided else 0), generator=gen)
    if strided:
        hidden = hidden[..., 3 : 3 + shape[-1]]
    grad = torch.randn(*shape[:-1], shape[-1] // 2, generator=gen)
    leaf = hidden.detach().clone().requires_grad_(True)
    out = swiglu(leaf, backend=backend)
    out.backward(grad)
    want, want_grad = _oracle(hidden, grad)
    assert out.shape == want.shape and out.dtype == hidden.dtype
    torch.testing.assert_close(out.double(), want, atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(leaf.grad.double(), want_grad, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_rounds_once(interpret, dtype):
    """The kernels compute in float32 and round once: the output and both gradient halves
    within one ulp of the float64 result of the same (rounded) inputs. (One ulp, not half:
    the interpreter truncates float32 to bfloat16 where the GPU rounds to nearest.)"""
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(45, 2 * 40, generator=gen).to(dtype)
    grad = torch.randn(45, 40, generator=gen).to(dtype)
    want, want_grad = _oracle(hidden, grad)
    got = swiglu(hidden, backend="triton").double()
    got_grad = torch.ops.gem_kernels.swiglu_backward(grad, hidden, "triton").double()
    for result, exact in ((got, want), (got_grad, want_grad)):
        ulp = torch.finfo(dtype).eps * exact.abs().clamp(min=torch.finfo(dtype).tiny)
        assert ((result - exact).abs() <= ulp + 1e-6 * exact.abs().max()).all()


def test_triton_and_reference_agree_in_float32(interpret):
    gen = torch.Generator().manual_seed(9)
    hidden = torch.randn(33, 2 * 130, generator=gen) * 4  # saturating sigmoids too
    grad = torch.randn(33, 130, generator=gen)
    ops = torch.ops.gem_kernels
    for op, args in ((ops.swiglu, (hidden,)), (ops.swiglu_backward, (grad, hidden))):
        torch.testing.assert_close(
            op(*args, "triton"), op(*args, "reference"), atol=1e-6, rtol=1e-6
        )


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
    want, want_grad = _oracle(hidden, grad)
    got = swiglu(hidden).double()
    got_grad = torch.ops.gem_kernels.swiglu_backward(grad, hidden, "auto").double()
    gate, value = hidden.double().chunk(2, dim=-1)
    g = grad.double()
    terms = (gate * value).abs(), torch.cat([g * value * (1 + gate.abs()), g * gate], -1).abs()
    for result, exact, size in ((got, want, terms[0]), (got_grad, want_grad, terms[1])):
        half_ulp = 0.5 * torch.finfo(dtype).eps * exact.abs().clamp(min=torch.finfo(dtype).tiny)
        float32_error = 4 * torch.finfo(torch.float32).eps * size
        assert ((result - exact).abs() <= half_ulp + float32_error).all()
