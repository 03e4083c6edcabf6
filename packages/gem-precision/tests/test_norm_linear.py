"""NormLinear (high-precision norm -> linear) and its conversion to Fp8NormLinear."""

from __future__ import annotations

import copy

import pytest
import torch
from gem_precision import (
    Bf16GemmLinear,
    Fp8Linear,
    Fp8NormLinear,
    Fp8Recipe,
    NormLinear,
    PrecisionPolicy,
    convert_to_bf16_gemms,
    convert_to_fp8,
)
from gem_precision.fused_norm import norm_forward_reference
from torch import nn


def _randomise(module: nn.Module, seed: int = 0) -> nn.Module:
    """Non-trivial norm scale and shift (the defaults 1 and 0 would hide a swapped parameter)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm_weight"):
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            elif name.endswith("norm_bias"):
                p.copy_(torch.randn(p.shape, generator=gen))
    return module


def _unfused_twin(m: NormLinear) -> nn.Sequential:
    """nn.LayerNorm / nn.RMSNorm + nn.Linear holding copies of ``m``'s parameters."""
    in_f = m.linear.in_features
    affine = m.norm_weight is not None
    if m.norm == "layer":
        norm = nn.LayerNorm(in_f, eps=m.eps, elementwise_affine=affine)
    else:
        norm = nn.RMSNorm(in_f, eps=m.eps, elementwise_affine=affine)
    if affine:
        norm.weight.data.copy_(m.norm_weight)
    if m.norm_bias is not None:
        norm.bias.data.copy_(m.norm_bias)
    return nn.Sequential(norm, copy.deepcopy(m.linear))


def _run(module: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> list[torch.Tensor]:
    """Output, input gradient and parameter gradients (in parameter order)."""
    xi = x.clone().requires_grad_(True)
    module.zero_grad()
    out = module(xi)
    out.backward(grad)
    return [out.detach(), xi.grad] + [p.grad for p in module.parameters()]


@pytest.mark.parametrize(
    "norm,eps,affine,bias",
    [("layer", 1e-5, True, True), ("rms", 1e-6, True, True), ("layer", 1e-5, False, False)],
)
def test_bit_exact_against_torch_norm_and_linear(norm, eps, affine, bias):
    torch.manual_seed(0)
    m = _randomise(NormLinear(96, 40, bias=bias, norm=norm, eps=eps, elementwise_affine=affine))
    ref = _unfused_twin(m)
    gen = torch.Generator().manual_seed(1)
    x, grad = torch.randn(2, 7, 96, generator=gen) * 3 + 1, torch.randn(2, 7, 40, generator=gen)
    got, want = _run(m, x, grad), _run(ref, x, grad)
    assert got[0].shape == (2, 7, 40)
    # Same parameter order too: norm scale, norm shift, linear weight, linear bias.
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def test_rms_matches_reference_norm():
    m = _randomise(NormLinear(128, 32, norm="rms", eps=1e-6))
    x = torch.randn(16, 128) * 5
    y, _, _ = norm_forward_reference(x, m.norm_weight, None, "rms", 1e-6)
    torch.testing.assert_close(m(x), m.linear(y), rtol=1e-5, atol=1e-5)
    assert m.norm_bias is None and [n for n, _ in m.named_parameters()] == [
        "norm_weight",
        "linear.weight",
        "linear.bias",
    ]


def test_no_extra_ops_and_compiles():
    # No overhead against nn.LayerNorm + nn.Linear: the same torch functions, nothing else.
    m = _randomise(NormLinear(64, 32))
    ref = _unfused_twin(m)
    x = torch.randn(4, 64)

    class Log(torch.overrides.TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.calls.append(func)
            return func(*args, **(kwargs or {}))

    with Log() as got:
        m(x)
    with Log() as want:
        ref(x)
    assert got.calls == want.calls
    # One graph, forward and backward (aot_eager: traced like inductor, without the C++ build).
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    grad = torch.randn(4, 32)
    for g, w in zip(_run(compiled, x, grad), _run(m, x, grad), strict=True):
        assert torch.equal(g, w)


class Tower(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([NormLinear(256, 256), NormLinear(256, 256, norm="rms")])
        self.mid = nn.Linear(256, 256)
        self.small = NormLinear(256, 16)
        self.head = NormLinear(256, 256, eps=1e-6)


def test_convert_fuses_selected_pairs_sharing_parameters():
    model = _randomise(Tower()).eval()
    params = dict(model.named_parameters())
    keys = list(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # built before the conversion
    recipe = Fp8Recipe(wgrad_in_bf16=True)
    policy = PrecisionPolicy(
        exclude=("blocks.1.*",),
        min_features=64,
        keep_high_precision=("head.linear",),
        recipe=recipe,
    )
    report = convert_to_fp8(model, policy)
    assert sorted(report.converted) == ["blocks.0.linear", "mid"]
    assert report.kept == {
        "blocks.1.linear": "excluded",
        "small.linear": "min(in, out) < 64",
        "head.linear": "keep_high_precision",
    }
    fused = model.blocks[0]
    assert type(fused) is Fp8NormLinear and type(fused.linear) is Fp8Linear
    assert fused.linear.recipe is recipe and (fused.norm, fused.eps) == ("layer", 1e-5)
    assert not fused.training and not fused.linear.training
    assert type(model.mid) is Fp8Linear
    for name in ("blocks.1", "small", "head"):
        kept = model.get_submodule(name)
        assert type(kept) is NormLinear and type(kept.linear) is nn.Linear
    assert list(model.state_dict()) == keys
    new_params = dict(model.named_parameters())
    assert new_params.keys() == params.keys()
    assert all(new_params[n] is p for n, p in params.items())
    # The optimizer built before the conversion updates what the converted model uses.
    before = fused.norm_bias.detach().clone()
    model.train()
    model.blocks[0](torch.randn(8, 256)).sum().backward()
    opt.step()
    assert not torch.equal(fused.norm_bias, before)
    assert all(p.grad is not None for p in fused.parameters())
    # Idempotent: the fused module's linear is an Fp8Linear, so nothing is converted again.
    again = convert_to_fp8(model, PrecisionPolicy(min_features=64))
    assert sorted(again.converted) == ["blocks.1.linear", "head.linear"]
    assert type(model.blocks[1]) is Fp8NormLinear and model.blocks[1].norm == "rms"
    assert model.head.eps == 1e-6


@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_converted_matches_unfused_fp8_path(monkeypatch, norm):
    # Under the Triton interpreter the converted module runs the fused kernels; the reference is
    # the unfused path: the torch norm, then Fp8Linear (CPU emulation of the FP8 GEMMs).
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch.manual_seed(0)
    model = _randomise(nn.Sequential(NormLinear(256, 128, norm=norm)))
    twin = _unfused_twin(model[0])
    twin[1] = Fp8Linear.from_linear(twin[1])
    convert_to_fp8(model, PrecisionPolicy(min_features=0))
    gen = torch.Generator().manual_seed(1)
    x, grad = torch.randn(64, 256, generator=gen) * 2 + 1, torch.randn(64, 128, generator=gen)
    assert model[0]._fused(x)[0]
    got, want = _run(model, x, grad), _run(twin, x, grad)
    for g, w in zip(got, want, strict=True):
        # Same math (tolerance as for Fp8NormLinear's fused vs unfused test): a last-bit
        # difference of the normalised x can move an FP8 value or a GEMM output by one step.
        assert float((g - w).norm() / w.norm()) < 4e-3


def test_state_dict_round_trip():
    torch.manual_seed(0)
    model = _randomise(nn.Sequential(NormLinear(256, 128), NormLinear(128, 8)))
    state = copy.deepcopy(model.state_dict())
    convert_to_fp8(model, PrecisionPolicy(min_features=64))
    assert type(model[0]) is Fp8NormLinear and type(model[1]) is NormLinear
    fresh = nn.Sequential(NormLinear(256, 128), NormLinear(128, 8))
    fresh.load_state_dict(model.state_dict())  # converted -> plain
    convert_to_fp8(fresh, PrecisionPolicy(min_features=64))
    fresh.load_state_dict(state)  # plain -> converted
    x = torch.randn(4, 256)
    assert torch.equal(fresh(x), model(x))


def test_bf16_gemms_swap_the_inner_linear():
    model = _randomise(nn.Sequential(NormLinear(64, 32)))
    twin = _unfused_twin(model[0])
    twin[1] = Bf16GemmLinear.from_linear(twin[1])
    assert convert_to_bf16_gemms(model, PrecisionPolicy(min_features=0)) == ["0.linear"]
    assert type(model[0]) is NormLinear and type(model[0].linear) is Bf16GemmLinear
    x = torch.randn(2, 3, 64)
    assert torch.equal(model(x), twin(x))
    # An FP8 pass afterwards fuses it like any other NormLinear.
    assert convert_to_fp8(model, PrecisionPolicy(min_features=0)).converted == ["0.linear"]
    assert type(model[0]) is Fp8NormLinear


def test_bad_arguments():
    with pytest.raises(ValueError, match="norm must be 'rms' or 'layer'"):
        NormLinear(64, 64, norm="batch")
    for eps in (0.0, 1, -1e-5):
        with pytest.raises(ValueError, match="eps must be a positive float"):
            NormLinear(64, 64, eps=eps)
    with pytest.raises(ValueError, match="in_features must be a positive int"):
        NormLinear(0, 64)
    with pytest.raises(ValueError, match="out_features must be a positive int"):
        NormLinear(64, 64.0)
    with pytest.raises(ValueError, match="module itself is a NormLinear"):
        convert_to_fp8(NormLinear(64, 64), PrecisionPolicy(min_features=0))
    # Policies name the linear, not the NormLinear.
    with pytest.raises(ValueError, match=r"names \['head'\].*'head.linear'"):
        convert_to_fp8(Tower(), PrecisionPolicy(keep_high_precision=("head",)))


@pytest.mark.parametrize("interpret", [False, True])
def test_autocast_output_dtype_fused_and_unfused(monkeypatch, interpret):
    """Under bf16 autocast the FP8 norm -> linear writes bf16 (float32 outside it), fused
    (Triton interpreter) or not, and its float32 input gets a float32 gradient."""
    if interpret:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    torch.manual_seed(0)
    model = _randomise(nn.Sequential(NormLinear(256, 128, norm="layer")))
    convert_to_fp8(model, PrecisionPolicy(min_features=0))
    x = torch.randn(48, 256).requires_grad_()
    assert model[0]._fused(x)[0] == interpret
    assert model(x).dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    assert out.dtype == torch.bfloat16
    out.float().square().sum().backward()
    assert x.grad.dtype == torch.float32 and torch.isfinite(x.grad).all()
    assert model[0].linear.bias.grad.dtype == torch.float32


def test_fp8_norm_linear_checks_its_input_as_fp8_linear_does():
    """An int64 input used to come back as int64 zeros."""
    layer = Fp8NormLinear(32, 4)
    with pytest.raises(TypeError, match="x must have dtype float16, bfloat16, float32"):
        layer(torch.ones(2, 32, dtype=torch.int64))
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        layer([[0.0] * 32])
    with pytest.raises(ValueError, match="in_features=32"):
        layer(torch.ones(2, 31))
