"""Fused RMSNorm / LayerNorm -> FP8 quantise (Triton, interpreted on CPU) and Fp8NormLinear."""

from __future__ import annotations

import pytest
import torch
from gem_precision import fused_norm
from gem_precision.blockwise import dequantize_operand, quantize_blockwise
from gem_precision.fused_norm import Fp8NormLinear, norm_forward_reference, norm_quantize
from torch import nn


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _inputs(kind, rows=48, cols=256, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen) * 3 + 0.5
    x[3] *= 1e3  # one row with a much larger scale
    w = torch.rand(cols, generator=gen) + 0.5
    b = torch.randn(cols, generator=gen) if kind == "layer" else None
    return x, w, b


@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_reference_norm_matches_torch_modules(kind):
    x, w, b = _inputs(kind)
    y, mean, rstd = norm_forward_reference(x, w, b, kind, 1e-6)
    if kind == "rms":
        mod = nn.RMSNorm(x.shape[1], eps=1e-6)
        assert mean is None
    else:
        mod = nn.LayerNorm(x.shape[1], eps=1e-6)
        mod.bias.data.copy_(b)
        torch.testing.assert_close(mean, x.mean(1))
    mod.weight.data.copy_(w)
    torch.testing.assert_close(y, mod(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["rms", "layer"])
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16])
def test_fused_kernel_matches_norm_then_quantise(kind, in_dtype):
    x, w, b = _inputs(kind)
    x = x.to(in_dtype)
    op, mean, rstd = norm_quantize(x, w, b, kind=kind, backend="triton")
    y, mean_ref, rstd_ref = norm_forward_reference(x, w, b, kind, 1e-6)
    torch.testing.assert_close(rstd, rstd_ref, rtol=1e-6, atol=0)
    if kind == "layer":
        torch.testing.assert_close(mean, mean_ref, rtol=1e-6, atol=1e-6)
    data, scale = quantize_blockwise(y, (1, 128))
    # rstd may differ in the last bit (sqrt vs rsqrt), which can flip a rounding: allow a few
    # elements one FP8 step apart, scales must agree.
    assert torch.equal(op.scale, scale) and op.scale.stride() == (1, x.shape[0])
    differ = op.data.view(torch.uint8) != data.view(torch.uint8)
    assert differ.float().mean() < 1e-3
    step = (op.data.view(torch.uint8).int() - data.view(torch.uint8).int()).abs()
    assert int(step.max()) <= 1
    back = dequantize_operand(op.data, op.scale, "1x128")
    assert float((back - y).norm() / y.norm()) < 0.05


@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_fused_module_matches_unfused_composition(monkeypatch, kind):
    torch.manual_seed(0)
    fused = Fp8NormLinear(256, 128, norm=kind)
    with torch.no_grad():
        fused.norm_weight.uniform_(0.5, 1.5)
        if kind == "layer":
            fused.norm_bias.normal_()
    x, grad = torch.randn(64, 256) * 2 + 1, torch.randn(64, 128)

    def run():
        xi = x.clone().requires_grad_(True)
        fused.zero_grad()
        fused(xi).backward(grad)
        return [xi.grad] + [p.grad.clone() for p in fused.parameters()]

    assert fused._fused(x)[0]
    got = run()
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # now the PyTorch composition
    assert not fused._fused(x)[0]
    want = run()
    for g, w in zip(got, want, strict=True):
        # Both are the same math; a last-bit difference of the normalised x can move an FP8
        # value or a bf16-rounded GEMM output by one step.
        assert float((g - w).norm() / w.norm()) < 4e-3


@pytest.mark.parametrize(
    "options,kind",
    [({}, "rms"), ({}, "layer"), ({"xt_warps": 4}, "rms")],
)
def test_normed_transposed_tiles_match_reference(monkeypatch, options, kind):
    # The wgrad operand of the fused backward: norm(x).T in 128x128 tiles, recomputed from x and
    # the saved statistics, bit for bit the quantised PyTorch norm (ragged rows and columns).
    monkeypatch.setattr(fused_norm, "_NORM_OPTIONS", {**fused_norm._NORM_OPTIONS, **options})
    x, w, b = _inputs(kind, rows=200, cols=384)
    y, mean, rstd = norm_forward_reference(x, w, b, kind, 1e-6)
    got = fused_norm._normed_transposed_operand(x, w, b, mean, rstd, torch.float8_e4m3fn, True)
    data, scale = quantize_blockwise(y.t().contiguous(), (128, 128))
    assert got.kind_t == "128x128"
    assert torch.equal(got.scale_t, scale)
    # y here is computed in PyTorch and the kernel recomputes it: a last-bit difference can
    # move an element by one FP8 step, never more.
    step = (got.data_t.view(torch.uint8).int() - data.view(torch.uint8).int()).abs()
    assert int(step.max()) <= 1 and float((step > 0).float().mean()) < 1e-3


def test_module_close_to_high_precision_and_options():
    torch.manual_seed(1)
    m = Fp8NormLinear(256, 64, norm="layer", eps=1e-5)
    ref = nn.Sequential(nn.LayerNorm(256, eps=1e-5), nn.Linear(256, 64))
    ref[1].load_state_dict(m.linear.state_dict())
    x = torch.randn(2, 16, 256)
    out = m(x).detach()
    assert out.shape == (2, 16, 64)
    want = ref(x).detach()
    assert float((out - want).norm() / want.norm()) < 0.08
    plain = Fp8NormLinear(256, 64, elementwise_affine=False, bias=False)
    assert plain.norm_weight is None and plain.norm_bias is None and plain.linear.bias is None
    plain(torch.randn(8, 256)).sum().backward()


def test_bad_arguments():
    with pytest.raises(ValueError, match="norm must be"):
        Fp8NormLinear(128, 128, norm="batch")
    with pytest.raises(ValueError, match="eps must be"):
        Fp8NormLinear(128, 128, eps=0)
    m = Fp8NormLinear(128, 128)
    with pytest.raises(ValueError, match="in_features=128"):
        m(torch.randn(4, 64))
    x = torch.randn(4, 128)
    with pytest.raises(ValueError, match="bias is only supported"):
        norm_quantize(x, None, torch.zeros(128), kind="rms")
    with pytest.raises(ValueError, match="weight must have shape"):
        norm_quantize(x, torch.ones(64))
    with pytest.raises(ValueError, match="multiple of 128"):
        norm_quantize(torch.randn(4, 96), backend="triton")


def _cuda_module_input_grad_error(dtype=torch.float32) -> float:
    # K=512 in, 256 out: the dgrad GEMM reduces over 2 blocks of 128 (padded to 4 for cuBLAS).
    torch.manual_seed(2)
    m = Fp8NormLinear(512, 256)
    x, grad = torch.randn(256, 512), torch.randn(256, 256)
    xc = x.clone().requires_grad_(True)
    m(xc).backward(grad)
    g = Fp8NormLinear(512, 256).cuda().to(dtype)
    g.load_state_dict(m.state_dict())
    xg = x.cuda().to(dtype).requires_grad_(True)
    g(xg).backward(grad.cuda().to(dtype))
    return float((xg.grad.float().cpu() - xc.grad).norm() / xc.grad.norm())


@pytest.mark.gpu
@pytest.mark.sm89
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_unfused_module_matches_cpu(monkeypatch):
    """Norm in PyTorch + Fp8Linear on CUDA against the CPU emulation."""
    monkeypatch.setattr(fused_norm, "FUSED_ON_CUDA", False)
    assert _cuda_module_input_grad_error() < 5e-3


@pytest.mark.gpu
@pytest.mark.sm89
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_fused_path_matches_cpu(dtype):
    """The fused autograd path as shipped on CUDA against the CPU (interpreted) fused path."""
    assert fused_norm.FUSED_ON_CUDA
    # bfloat16 input and parameters on the GPU against float32 on the CPU: bf16 rounding.
    assert _cuda_module_input_grad_error(dtype) < (5e-3 if dtype == torch.float32 else 5e-2)
