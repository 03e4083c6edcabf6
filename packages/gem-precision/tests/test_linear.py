"""Tests for Fp8Linear, Fp8Recipe, PrecisionPolicy and convert_to_fp8."""

from __future__ import annotations

import copy

import pytest
import torch
from gem_precision import (
    Fp8Linear,
    Fp8Recipe,
    PrecisionPolicy,
    convert_to_fp8,
    fake_quantize_blockwise,
    load_rounding_state,
    rounding_state,
)
from torch import nn

RECIPES = {
    "default": Fp8Recipe(),
    "tensorwise": Fp8Recipe(tensorwise=True),
    "hadamard": Fp8Recipe(hadamard=True),
    "sr": Fp8Recipe(stochastic_rounding_grads=True, seed=3),
    "wgrad_bf16": Fp8Recipe(wgrad_in_bf16=True),
    "e5m2_grads": Fp8Recipe(grad_dtype=torch.float8_e5m2),
}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().norm() / b.detach().norm())


def pair(in_f=256, out_f=192, recipe=None, seed=0):
    torch.manual_seed(seed)
    ref = nn.Linear(in_f, out_f)
    fp8 = Fp8Linear(in_f, out_f, recipe=recipe)
    fp8.load_state_dict(ref.state_dict())
    return ref, fp8


@pytest.mark.parametrize("name", list(RECIPES))
def test_forward_backward_close_to_linear(name):
    ref, fp8 = pair(recipe=RECIPES[name])
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 32, 256, generator=gen)
    x_ref, x_fp8 = x.clone().requires_grad_(), x.clone().requires_grad_()
    grad = torch.randn(2, 32, 192, generator=gen)
    y_ref, y_fp8 = ref(x_ref), fp8(x_fp8)
    y_ref.backward(grad)
    y_fp8.backward(grad)
    assert y_fp8.shape == y_ref.shape
    # E4M3 rounds each operand with relative RMS error ~2**-4/sqrt(3) ~ 3.6%/sqrt(2) per side
    # (measured ~3.6% total); E5M2 grads (2 mantissa bits) about double it.
    tol = 0.10 if name == "e5m2_grads" else 0.06
    assert 0 < rel_err(y_fp8, y_ref) < 0.06
    assert 0 < rel_err(x_fp8.grad, x_ref.grad) < tol
    assert 0 < rel_err(fp8.weight.grad, ref.weight.grad) < tol
    torch.testing.assert_close(fp8.bias.grad, ref.bias.grad)  # bias is never quantized


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_equals_independent_emulation(dtype):
    ref, fp8 = pair(in_f=256, out_f=256)
    fp8.to(dtype)
    x = torch.randn(16, 256).to(dtype)
    weight, bias = fp8.weight.detach().float(), fp8.bias.detach().float()
    want = (
        fake_quantize_blockwise(x.float(), (1, 128)) @ fake_quantize_blockwise(weight, (128, 128)).T
    )
    # The GEMM writes the activation's dtype, the bias added before that single rounding (in
    # cuBLAS's epilogue on a GPU): float32 stays exact, bfloat16 rounds once.
    want = (want + bias).to(dtype)
    torch.testing.assert_close(
        fp8(x), want, rtol=2**-8 if dtype == torch.bfloat16 else 1e-6, atol=1e-5
    )


@pytest.mark.parametrize("x_tiles", [True, False])
def test_wgrad_uses_token_dim_blocks(x_tiles):
    ref, fp8 = pair(in_f=128, out_f=128, recipe=Fp8Recipe(wgrad_x_tiles=x_tiles))
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(256, 128, generator=gen)
    x[0, 0] = 1e6  # in a 128x128 tile of x.T, the other values of that tile become subnormal
    grad = torch.randn(256, 128, generator=gen)
    fp8(x).backward(grad)
    x_block = (128, 128) if x_tiles else (1, 128)
    want = fake_quantize_blockwise(grad.T, (1, 128)) @ fake_quantize_blockwise(x.T, x_block).T
    # float32 weights: the wgrad GEMM writes float32 (no rounding of the result).
    torch.testing.assert_close(fp8.weight.grad, want, rtol=1e-5, atol=1e-4)
    other = (128, 128) if not x_tiles else (1, 128)
    differs = fake_quantize_blockwise(grad.T, (1, 128)) @ fake_quantize_blockwise(x.T, other).T
    assert not torch.allclose(fp8.weight.grad, differs, rtol=2**-7, atol=1e-4)


def test_stochastic_rounding_changes_between_steps_but_is_reproducible():
    recipe = Fp8Recipe(stochastic_rounding_grads=True, seed=5)
    _, a = pair(recipe=recipe)
    b = copy.deepcopy(a)
    x, grad = torch.randn(8, 256), torch.randn(8, 192)
    grads = []
    for layer in (a, a, b):
        layer.zero_grad()
        layer(x).backward(grad)
        grads.append(layer.weight.grad.clone())
    assert not torch.equal(grads[0], grads[1])  # new Philox offsets each step
    assert torch.equal(grads[0], grads[2])  # same seed and step -> same bits


def test_gradients_flow_through_stack_and_bf16_inputs():
    model = nn.Sequential(Fp8Linear(128, 256), nn.GELU(), Fp8Linear(256, 128))
    x = torch.randn(4, 128, dtype=torch.bfloat16, requires_grad=True)
    model.to(torch.bfloat16)
    y = model(x)
    assert y.dtype == torch.bfloat16
    y.float().pow(2).mean().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    for p in model.parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0


class SmallMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(16, 256)
        self.blocks = nn.ModuleList([nn.Linear(256, 256), nn.Linear(256, 512)])
        self.proj = nn.Linear(512, 256)
        self.gate = nn.Linear(256, 8)
        self.head = nn.Linear(256, 256)


def test_policy_selects_expected_layers():
    model = SmallMLP()
    weight = model.proj.weight
    report = convert_to_fp8(
        model,
        PrecisionPolicy(exclude=("blocks.0",), min_features=64, keep_high_precision=("head",)),
    )
    assert sorted(report.converted) == ["blocks.1", "proj"]
    assert report.kept == {
        "embed": "min(in, out) < 64",
        "blocks.0": "excluded",
        "gate": "min(in, out) < 64",
        "head": "keep_high_precision",
    }
    assert isinstance(model.proj, Fp8Linear) and isinstance(model.blocks[1], Fp8Linear)
    assert type(model.blocks[0]) is nn.Linear and type(model.head) is nn.Linear
    assert model.proj.weight is weight  # parameters shared, optimizers stay valid
    assert report.converted_fraction == pytest.approx(2 / 6)
    # Idempotent: a second pass converts nothing new and does not wrap Fp8Linear again.
    again = convert_to_fp8(model, PrecisionPolicy(min_features=64, keep_high_precision=("head",)))
    assert again.converted == ["blocks.0"]


def test_policy_include_patterns_and_default():
    model = SmallMLP()
    report = convert_to_fp8(model, PrecisionPolicy(include=("blocks.*",), min_features=0))
    assert sorted(report.converted) == ["blocks.0", "blocks.1"]
    assert report.kept["proj"] == "not included"
    # Default min_features=1024: FP8 only where it is faster than bf16 (H200 benchmark).
    report = convert_to_fp8(SmallMLP())
    assert report.converted == [] and set(report.kept.values()) == {"min(in, out) < 1024"}
    big = nn.Sequential(nn.Linear(1024, 2048), nn.Linear(2048, 512))
    report = convert_to_fp8(big)
    assert report.converted == ["0"] and report.kept == {"1": "min(in, out) < 1024"}


def test_bad_policy_and_recipe_input():
    with pytest.raises(TypeError, match="include must be a tuple of str"):
        PrecisionPolicy(include="blocks.*")
    with pytest.raises(ValueError, match="min_features must be a non-negative int"):
        PrecisionPolicy(min_features=-1)
    with pytest.raises(TypeError, match="recipe must be an Fp8Recipe"):
        PrecisionPolicy(recipe={"hadamard": True})
    with pytest.raises(ValueError, match=r"keep_high_precision names \['output'\]"):
        convert_to_fp8(SmallMLP(), PrecisionPolicy(keep_high_precision=("output",)))
    with pytest.raises(TypeError, match="policy must be a PrecisionPolicy"):
        convert_to_fp8(SmallMLP(), {"min_features": 3})
    with pytest.raises(TypeError, match="module must be an nn.Module"):
        convert_to_fp8("model")
    with pytest.raises(ValueError, match="module itself is an nn.Linear"):
        convert_to_fp8(nn.Linear(256, 256), PrecisionPolicy(min_features=0))
    with pytest.raises(TypeError, match="fp8_dtype must be"):
        Fp8Recipe(fp8_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="hadamard_block_size must be"):
        Fp8Recipe(hadamard_block_size=48)
    with pytest.raises(TypeError, match="tensorwise must be a bool"):
        Fp8Recipe(tensorwise=1)
    with pytest.raises(TypeError, match="recipe must be an Fp8Recipe"):
        Fp8Linear(4, 4, recipe="e4m3")
    with pytest.raises(ValueError, match="in_features=8"):
        Fp8Linear(8, 4)(torch.ones(2, 6))


def train_regression(model: nn.Module, steps: int = 200) -> float:
    gen = torch.Generator().manual_seed(0)
    teacher = torch.randn(128, 1, generator=gen) / 128**0.5
    x = torch.randn(512, 128, generator=gen)
    y = torch.tanh(x @ teacher * 3) + 0.1 * torch.sin(x[:, :1] * 3)
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    for step in range(steps):
        batch = slice((step * 64) % 512, (step * 64) % 512 + 64)
        loss = nn.functional.mse_loss(model(x[batch]), y[batch])
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        return float(nn.functional.mse_loss(model(x), y))


def test_tiny_training_run_matches_fp32():
    torch.manual_seed(0)
    fp32 = nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 1))
    fp8 = copy.deepcopy(fp32)
    # Only the hidden layer in FP8; the 1-wide output layer stays fp32 (below min_features).
    report = convert_to_fp8(fp8, PrecisionPolicy(min_features=128))
    assert report.converted == ["0"]
    initial = train_regression(copy.deepcopy(fp32), steps=0)
    loss_fp32 = train_regression(fp32)
    loss_fp8 = train_regression(fp8)
    assert loss_fp32 < 0.2 * initial  # the task is actually learned
    # FP8 operand noise (~4% per GEMM) costs a little accuracy (measured: fp32 ~3e-8, FP8 ~3e-5,
    # initial ~0.94): the FP8 loss must end within 1% of the initial loss of the fp32 one.
    assert loss_fp8 < loss_fp32 + 0.01 * initial, (loss_fp8, loss_fp32, initial)


@pytest.mark.gpu
@pytest.mark.sm89
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu_emulation():
    """The Hadamard recipe on a GPU: rotated operands, native GEMMs on Hopper / Blackwell (a
    bfloat16 result, so equal to the emulation up to its rounding), else the emulation."""
    ref, fp8 = pair(recipe=Fp8Recipe(hadamard=True))
    x = torch.randn(64, 256)
    cpu = fp8(x)
    gpu = fp8.cuda()(x.cuda()).cpu()
    assert float((gpu - cpu).norm() / cpu.norm()) < 4e-3


def test_rounding_state_round_trips_and_names_a_mismatch():
    model = torch.nn.Sequential(
        Fp8Linear(32, 32, recipe=Fp8Recipe(stochastic_rounding_grads=True)), torch.nn.ReLU()
    )
    model(torch.randn(4, 32)).sum().backward()  # a training forward advances the counter
    state = rounding_state(model)
    assert list(state) == ["0"] and state["0"] > 0
    fresh = torch.nn.Sequential(Fp8Linear(32, 32), torch.nn.ReLU())
    load_rounding_state(fresh, state)
    assert rounding_state(fresh) == state
    with pytest.raises(ValueError, match=r"missing \['0'\], unknown \['1'\]"):
        load_rounding_state(fresh, {"1": 0})
    with pytest.raises(ValueError, match=r"state\['0'\] must be an int >= 0"):
        load_rounding_state(fresh, {"0": -1})


def test_autocast_runs_the_layer_in_the_autocast_dtype():
    """Under bf16 autocast an Fp8Linear reads its input and writes its output in bf16, as
    autocast runs the nn.Linear it replaces: the same numbers as the layer on ``x.bfloat16()``
    with a bf16 bias, and float32 gradients for the float32 input and parameters."""
    _, fp8 = pair()
    twin = copy.deepcopy(fp8)
    twin.bias.data = twin.bias.data.bfloat16()
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 33, 256, generator=gen)
    grad = torch.randn(2, 33, 192, generator=gen).bfloat16()
    leaf = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fp8(leaf)
    out.backward(grad)
    twin_leaf = x.bfloat16().requires_grad_()
    want = twin(twin_leaf)
    want.backward(grad)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, want)
    assert leaf.grad.dtype == fp8.weight.grad.dtype == fp8.bias.grad.dtype == torch.float32
    assert torch.equal(leaf.grad, twin_leaf.grad.float())
    assert torch.equal(fp8.weight.grad, twin.weight.grad)


def test_autocast_compiles_without_graph_breaks():
    from torch._dynamo.utils import counters

    _, fp8 = pair()
    x = torch.randn(40, 256, generator=torch.Generator().manual_seed(3))

    def step(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return fp8(x)

    torch._dynamo.reset()
    counters.clear()
    out = torch.compile(step, backend="aot_eager", fullgraph=True)(x)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, step(x))
    assert dict(counters["graph_break"]) == {}


def test_conversion_keeps_train_mode_and_leaves_attention_out_projections():
    """An eval-mode layer stayed in eval mode only through some paths; nn.MultiheadAttention
    reads out_proj's weight itself, so an Fp8Linear there would be reported and never run."""
    model = nn.TransformerEncoderLayer(64, 2, dim_feedforward=128, batch_first=True).eval()
    report = convert_to_fp8(model, PrecisionPolicy(min_features=16))
    assert report.converted == ["linear1", "linear2"]
    assert "never calls its forward" in report.kept["self_attn.out_proj"]
    assert type(model.self_attn.out_proj) is nn.modules.linear.NonDynamicallyQuantizableLinear
    assert not model.linear1.training and not model.training
    assert Fp8Linear.from_linear(nn.Linear(32, 32).eval()).training is False


@pytest.mark.parametrize("hadamard", [False, True])
def test_stochastic_rounding_draws_disjoint_counters_across_gemms_and_steps(monkeypatch, hadamard):
    """dgrad, wgrad and the next step each draw their own Philox counters. With the Hadamard
    rotation the operands are padded to the block, so they need more than 2 * M * N counters
    a step (the ranges overlapped: correlated rounding noise)."""
    import gem_precision.rounding as rounding

    drawn, uniform = [], rounding.philox_uniform

    def spy(shape, *, seed, offset=0, device=None):
        count = int(torch.Size(shape).numel())
        drawn.append((int(offset), int(offset) + count))
        return uniform(shape, seed=seed, offset=offset, device=device)

    monkeypatch.setattr(rounding, "philox_uniform", spy)
    layer = Fp8Linear(64, 17, recipe=Fp8Recipe(stochastic_rounding_grads=True, hadamard=hadamard))
    for _ in range(2):
        layer(torch.randn(3, 64, requires_grad=True)).sum().backward()
    assert len(drawn) == 4
    drawn.sort()
    assert all(end <= start for (_, end), (start, _) in zip(drawn, drawn[1:], strict=False))
