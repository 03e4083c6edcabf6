"""Tests for MXFP8 storage of saved activations (mx_saved_activations, MXSavedActivations)."""

from __future__ import annotations

import copy

import pytest
import torch
from gem_precision import (
    MXSavedActivations,
    SavedActivationStats,
    mx_saved_activations,
)
from torch import nn

E4M3_HALF_ULP_REL = 2.0**-4  # 3 mantissa bits, round to nearest
E4M3_HALF_SUBNORMAL = 2.0**-10  # subnormal spacing 2**-9, relative to the block scale


def restore_bound(x: torch.Tensor, block_size: int = 32) -> torch.Tensor:
    """Elementwise bound on |restore(x) - x| for ceil-rounded MX E4M3, derived from the format.

    With ceil rounding the scale is the smallest power of two s with amax / s <= 448, so
    s < 2 * amax / 448 and no element saturates: the error is at most half an ulp of x / s
    (relative 2**-4 for normals, absolute 2**-10 * s in the subnormal range).
    """
    blocks = x.double().reshape(*x.shape[:-1], -1, block_size)
    scale_bound = 2 * blocks.abs().amax(dim=-1, keepdim=True) / 448
    bound = E4M3_HALF_ULP_REL * blocks.abs() + E4M3_HALF_SUBNORMAL * scale_bound
    return bound.reshape(x.shape)


def test_linear_weight_grad_within_format_bound_and_input_grad_exact():
    torch.manual_seed(0)
    ref = nn.Linear(128, 64)
    packed = copy.deepcopy(ref)
    x = torch.randn(48, 128) * torch.logspace(-3, 2, 128)  # widely varying magnitudes
    dy = torch.randn(48, 64)
    x_ref, x_mx = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref(x_ref).backward(dy)
    with mx_saved_activations(min_numel=0) as hooks:
        # Leaf tensors that require grad are never packed (the caller holds them anyway), so
        # feed the layer an intermediate (multiplying by a Python scalar saves nothing).
        y = packed(x_mx * 1.0)
    y.backward(dy)  # backward after the block exits still unpacks
    # The weight (saved as weight.t()) is not packed, so dgrad is bit-exact.
    torch.testing.assert_close(x_mx.grad, x_ref.grad, rtol=0, atol=0)
    # wgrad = dy.T @ x_hat, so |error| <= |dy|.T @ bound(x) elementwise (+ fp32 GEMM rounding).
    bound = dy.abs().double().T @ restore_bound(x)
    err = (packed.weight.grad.double() - ref.weight.grad.double()).abs()
    gemm_slack = 1e-5 * (dy.abs().double().T @ x.abs().double())
    assert (err <= bound + gemm_slack).all()
    assert err.max() > 0  # the activation really was quantized
    assert hooks.stats.packed_tensors == 1 and hooks.stats.skipped_tensors == 1
    assert hooks.stats.unpacked_tensors == 1


def mlp(dim=64, hidden=256, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(dim, hidden), nn.GELU(), nn.LayerNorm(hidden), nn.Linear(hidden, dim)
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mlp_gradients_close_and_memory_reduced(dtype):
    model = mlp().to(dtype)
    wrapped = MXSavedActivations(copy.deepcopy(model), min_numel=0)
    x = torch.randn(64, 64, dtype=dtype)
    dy = torch.randn(64, 64, dtype=dtype)
    model(x).backward(dy)
    out = wrapped(x)
    out.backward(dy)
    torch.testing.assert_close(out, model(x))  # the forward itself is unchanged
    for (name, p_ref), p_mx in zip(
        model.named_parameters(), wrapped.module.parameters(), strict=True
    ):
        rel = float((p_mx.grad - p_ref.grad).float().norm() / p_ref.grad.float().norm())
        # Each restored element is off by <= 2**-4 relative (half an ulp; random rounding
        # errors add up to ~2**-4 / sqrt(3) RMS); bf16 gradients carry their own 2**-8 noise.
        assert rel < 0.06, (name, rel)
    stats = wrapped.stats
    assert stats.packed_tensors >= 4 and stats.unpacked_tensors == stats.packed_tensors
    # Independent count: each packed tensor of n elements takes n + n / 32 bytes.
    element_size = torch.tensor([], dtype=dtype).element_size()
    packed_elements = stats.bytes_before // element_size
    assert stats.bytes_after == packed_elements + packed_elements // 32
    assert stats.bytes_saved > 0
    expected_ratio = (1 + 1 / 32) / element_size
    assert stats.compression == pytest.approx(expected_ratio)


def test_gradients_match_explicit_quantize_dequantize_of_saved_tensors():
    """Same numerics as doing the fake quantization of the saved activation by hand."""
    from gem_precision import quantize_mx

    torch.manual_seed(1)
    w = torch.randn(96, 64, requires_grad=True)
    x = torch.randn(16, 64)
    dy = torch.randn(16, 96)
    with mx_saved_activations(min_numel=0):
        y = torch.nn.functional.linear(x, w)
    y.backward(dy)
    x_hat = quantize_mx(x, scale_rounding="ceil").dequantize()
    torch.testing.assert_close(w.grad, dy.T @ x_hat, rtol=1e-6, atol=1e-6)


def test_skips_small_unaligned_and_integer_tensors():
    stats = SavedActivationStats()
    a = torch.randn(8, 30, requires_grad=True)  # last dim not a multiple of 32
    b = torch.randn(4, 32, requires_grad=True)  # below min_numel
    idx = torch.tensor([0, 2])
    with mx_saved_activations(min_numel=512, stats=stats):
        out = (a * a).sum() + (b * b).sum() + a.index_select(0, idx).sum()
    out.backward()
    torch.testing.assert_close(a.grad, 2 * a + torch.zeros_like(a).index_fill(0, idx, 1.0))
    torch.testing.assert_close(b.grad, 2 * b)
    assert stats.packed_tensors == 0 and stats.skipped_tensors > 0
    assert stats.compression != stats.compression  # NaN: nothing packed


def test_large_intermediate_is_packed_with_threshold():
    stats = SavedActivationStats()
    x = torch.randn(64, 64, requires_grad=True)
    with mx_saved_activations(min_numel=1024, stats=stats):
        h = x * 2.0  # mul by a Python scalar saves nothing
        y = torch.sin(h)  # saves h (4096 elements) -> packed
    y.sum().backward()
    assert stats.packed_tensors == 1
    assert stats.bytes_before == 64 * 64 * 4
    assert stats.bytes_after == 64 * 64 + 64 * 2
    bound = 2 * restore_bound(2 * x.detach())  # d/dx sin(2x) = 2 cos(h_hat), |cos'| <= 1
    assert ((x.grad - 2 * torch.cos(2 * x.detach())).abs() <= bound + 1e-6).all()


def test_module_agnostic_attention_block_and_stats_accumulate():
    torch.manual_seed(2)
    block = nn.TransformerEncoderLayer(d_model=64, nhead=4, dim_feedforward=128, dropout=0.0)
    ref = copy.deepcopy(block)
    wrapped = MXSavedActivations(block, min_numel=256)
    x = torch.randn(16, 4, 64)
    # A random output gradient: with .sum() the gradient through the final LayerNorm is ~0
    # and any perturbation would look like an infinite relative error.
    dy = torch.randn(16, 4, 64)
    for _ in range(2):
        wrapped(x).backward(dy)
        ref(x).backward(dy)
    for (name, p_ref), p in zip(ref.named_parameters(), block.parameters(), strict=True):
        rel = float((p.grad - p_ref.grad).norm() / p_ref.grad.norm().clamp_min(1e-12))
        assert rel < 0.08, (name, rel)
    first = wrapped.stats.packed_tensors
    assert first > 0 and first % 2 == 0  # two identical forwards
    wrapped.stats.reset()
    assert wrapped.stats.packed_tensors == 0 and wrapped.stats.bytes_before == 0


def test_non_finite_activation_stays_non_finite():
    x = torch.randn(4, 32)
    x[1, 3] = float("inf")
    w = torch.randn(8, 32, requires_grad=True)
    with mx_saved_activations(min_numel=0):
        y = torch.nn.functional.linear(x, w)
    y.sum().backward()
    assert not torch.isfinite(w.grad).all()


def test_bad_arguments():
    with pytest.raises(TypeError, match="elem_dtype"):
        mx_saved_activations(elem_dtype=torch.float16)
    with pytest.raises(ValueError, match="block_size"):
        mx_saved_activations(block_size=0)
    with pytest.raises(ValueError, match="scale_rounding"):
        mx_saved_activations(scale_rounding="up")
    with pytest.raises(ValueError, match="min_numel"):
        mx_saved_activations(min_numel=-1)
    with pytest.raises(TypeError, match="stats"):
        mx_saved_activations(stats={})
    with pytest.raises(TypeError, match="module"):
        MXSavedActivations("not a module")
    with pytest.raises(ValueError, match="scale_rounding"):
        MXSavedActivations(nn.Linear(2, 2), scale_rounding="up")


@pytest.mark.gpu
@pytest.mark.sm89
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_allocator_sees_the_saving():
    """The memory held between forward and backward drops by about the counted bytes."""
    torch.manual_seed(0)
    model = mlp(dim=1024, hidden=4096).cuda()
    x = torch.randn(4096, 1024, device="cuda")

    def held_after_forward(wrap: bool) -> tuple[int, SavedActivationStats]:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        stats = SavedActivationStats()
        # An intermediate input (held only by the graph), so packing it really frees it.
        if wrap:
            with mx_saved_activations(stats=stats, parameters=list(model.parameters())):
                out = model(x * 1.0)
        else:
            out = model(x * 1.0)
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - before
        out.sum().backward()
        model.zero_grad(set_to_none=True)
        return held, stats

    plain, _ = held_after_forward(False)
    packed, stats = held_after_forward(True)
    assert stats.bytes_saved > 0
    # The allocator rounds blocks up to 512 bytes; allow 1% slack on the counted saving.
    assert plain - packed == pytest.approx(stats.bytes_saved, rel=0.01)
