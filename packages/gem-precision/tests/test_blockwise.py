"""Tests for power-of-two block-scaled FP8 quantization of 2-D tensors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from gem_precision import dequantize_blockwise, fake_quantize_blockwise, quantize_blockwise

MAX_NORMAL = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def ref_tile_scales(x: np.ndarray, rows: int, cols: int, max_normal: float) -> np.ndarray:
    """Per-tile smallest power of two s with amax / s <= max_normal, by explicit loops."""
    n_r, n_c = math.ceil(x.shape[0] / rows), math.ceil(x.shape[1] / cols)
    out = np.ones((n_r, n_c))
    for i in range(n_r):
        for j in range(n_c):
            amax = np.abs(x[i * rows : (i + 1) * rows, j * cols : (j + 1) * cols]).max()
            if amax > 0:
                e = math.ceil(math.log2(amax / max_normal))
                while amax / 2.0**e > max_normal:
                    e += 1
                while amax / 2.0 ** (e - 1) <= max_normal:
                    e -= 1
                out[i, j] = 2.0**e
    return out


@pytest.mark.parametrize("dtype", list(MAX_NORMAL))
@pytest.mark.parametrize(("shape", "block"), [((5, 300), (1, 128)), ((200, 260), (128, 128))])
def test_scales_and_elements_match_reference(dtype, shape, block):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=gen) * torch.exp2(
        torch.randint(-20, 20, (shape[0], 1), generator=gen).float()
    )
    x[0, :7] = 448.0 * 2.0**3  # exact power-of-two boundary: amax / s == max_normal
    data, scale = quantize_blockwise(x, block, dtype)
    want_scale = ref_tile_scales(x.double().numpy(), *block, MAX_NORMAL[dtype])
    np.testing.assert_array_equal(scale.double().numpy(), want_scale)
    expanded = np.kron(want_scale, np.ones(block))[: shape[0], : shape[1]]
    want = (x.double() / torch.from_numpy(expanded)).float().to(dtype)
    assert torch.equal(data.view(torch.uint8), want.view(torch.uint8))
    assert not torch.isnan(data.float()).any()  # never saturates to NaN
    deq = dequantize_blockwise(data, scale, block)
    assert torch.equal(deq, data.float() * torch.from_numpy(expanded).float())


def test_tensorwise_and_zero_tiles():
    x = torch.zeros(4, 256)
    x[1, 5] = 3.0
    data, scale = quantize_blockwise(x, None)
    assert scale.shape == (1, 1) and scale.item() == 2.0**-7  # 3 / 2**-7 = 384 <= 448 < 768
    data, scale = quantize_blockwise(x, (1, 128))
    assert scale[0].tolist() == [1.0, 1.0] and torch.equal(fake_quantize_blockwise(x), x)


def test_relative_error_bound():
    x = torch.randn(64, 512, generator=torch.Generator().manual_seed(1))
    y = fake_quantize_blockwise(x, (1, 128))
    # E4M3 with 3 mantissa bits: relative error <= 2**-4 for normals; scales keep values normal
    # except near zero, bounded by the subnormal step 2**-9 times the tile scale.
    scale = quantize_blockwise(x, (1, 128))[1].repeat_interleave(128, dim=1)
    bound = torch.maximum(x.abs() * 2.0**-4, scale * 2.0**-10)
    assert ((y - x).abs() <= bound).all()


def test_stochastic_option_is_unbiased_in_mean():
    x = torch.full((500, 128), 0.3)
    x[:, 0] = 448.0  # fixes the scale to 1
    y = fake_quantize_blockwise(x, (1, 128), stochastic_seed=3)
    # 0.3 lies between 0.28125 and 0.3125: p = 0.6, sigma of the mean ~ 0.03125*0.49/sqrt(n).
    n = 500 * 127
    assert abs(float(y[:, 1:].double().mean()) - 0.3) < 5 * 0.03125 * math.sqrt(0.24 / n)
    assert torch.equal(y, fake_quantize_blockwise(x, (1, 128), stochastic_seed=3))


def test_nan_propagates_and_bad_input():
    x = torch.ones(2, 128)
    x[0, 3] = float("nan")
    y = fake_quantize_blockwise(x)
    assert torch.isnan(y[0, 3]) and torch.equal(y[1], x[1])
    with pytest.raises(ValueError, match="x must be 2-D"):
        quantize_blockwise(torch.ones(128))
    with pytest.raises(ValueError, match="block_shape must be"):
        quantize_blockwise(x, (0, 128))
    with pytest.raises(TypeError, match="dtype must be"):
        quantize_blockwise(x, (1, 128), torch.float16)
    with pytest.raises(TypeError, match="x must be a floating point"):
        quantize_blockwise(torch.ones(2, 128, dtype=torch.int32))


@pytest.mark.parametrize("dtype", list(MAX_NORMAL))
def test_scales_exact_over_wide_exponent_range(dtype):
    gen = torch.Generator().manual_seed(2)
    exps = torch.arange(-100, 101, dtype=torch.float32)
    x = torch.rand(len(exps), 128, generator=gen) * torch.exp2(exps)[:, None]
    x[::3, 5] = torch.exp2(exps[::3]) * MAX_NORMAL[dtype] / 2 ** exps[::3].abs().clamp(max=20)
    _, scale = quantize_blockwise(x, (1, 128), dtype)
    want = ref_tile_scales(x.double().numpy(), 1, 128, MAX_NORMAL[dtype])
    np.testing.assert_array_equal(scale.double().numpy(), want)


def test_dequantize_checks_the_scale_against_the_block_shape():
    x = torch.randn(3, 256)
    data, scale = quantize_blockwise(x, (1, 128))
    assert dequantize_blockwise(data, scale, (1, 128)).shape == (3, 256)
    for block_shape in ((128, 128), (2, 128), None):
        with pytest.raises(ValueError, match=r"scale must hold one scale per .* got \(3, 2\)"):
            dequantize_blockwise(data, scale, block_shape)
