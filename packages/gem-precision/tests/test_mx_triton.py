"""Triton MX kernels (run under TRITON_INTERPRET=1 on CPU) against the PyTorch reference."""

from __future__ import annotations

import pytest
import torch
from gem_precision import quantize_mx
from gem_precision.mx import dequantize_mx
from gem_precision.mx_triton import MxKernelConfig, dequantize_mx_triton, quantize_mx_triton

ELEM = [torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def special_input(rows=64, cols=256, dtype=torch.bfloat16, seed=0):
    """Random magnitudes over 2**-40..2**40 plus zeros, NaN, Inf and subnormals."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen)
    x = x * torch.exp2(torch.randint(-40, 40, (rows, cols), generator=gen).float())
    x[0, :32] = 0.0  # an all-zero block
    x[1, 3] = float("nan")
    x[2, 40] = float("inf")
    x[3, 70] = -float("inf")
    x[5, :] = 1e-39  # bf16 / fp32 subnormals
    x[:, 9] = -3e-42
    x[6, :32] = 448.0 * 1.75  # above max normal after floor rounding: saturates
    return x.to(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality, any NaN equal to any NaN."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.itemsize == 1:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    nan = torch.isnan(a)
    if not torch.equal(nan, torch.isnan(b)):
        return False
    bits = {2: torch.int16, 4: torch.int32}[a.dtype.itemsize]
    return torch.equal(a.view(bits)[~nan], b.view(bits)[~nan])


@pytest.mark.parametrize("square", [False, True])
@pytest.mark.parametrize("rounding", ["floor", "ceil"])
@pytest.mark.parametrize("elem_dtype", ELEM)
def test_quantize_bit_exact_with_reference(square, rounding, elem_dtype):
    x = special_input()
    ref = quantize_mx(x, elem_dtype=elem_dtype, scale_rounding=rounding, square=square)
    got = quantize_mx_triton(x, elem_dtype=elem_dtype, scale_rounding=rounding, square=square)
    assert got.square == square and got.orig_dtype == x.dtype
    assert same_bits(ref.data, got.data)
    assert torch.equal(ref.scale, got.scale)
    # and the dequantisation kernel, from the same MX tensor, to bf16 and float32
    for dtype in (None, torch.float32):
        assert same_bits(dequantize_mx(ref, dtype), dequantize_mx_triton(ref, dtype))


@pytest.mark.parametrize("in_dtype", [torch.float32, torch.float16])
def test_other_input_dtypes_and_leading_dims(in_dtype):
    x = special_input(dtype=torch.float32)
    x = torch.nan_to_num(x, nan=0.0, posinf=1.0, neginf=-1.0).to(in_dtype).reshape(2, 32, 256)
    for square in (False, True):
        ref = quantize_mx(x, square=square)
        got = quantize_mx_triton(x, square=square)
        assert same_bits(ref.data, got.data) and torch.equal(ref.scale, got.scale)
        assert got.scale.shape == ((2, 1, 8) if square else (2, 32, 8))


def test_tile_configs_and_partial_tiles_agree():
    # 48 rows x 96 columns: partial row and column tiles for every config below.
    x = special_input(rows=48, cols=96)
    ref = quantize_mx(x)
    for config in (MxKernelConfig(16, 64, 2), MxKernelConfig(32, 128, 4), MxKernelConfig(8, 32, 1)):
        got = quantize_mx_triton(x, config=config)
        assert same_bits(ref.data, got.data) and torch.equal(ref.scale, got.scale)


def test_square_blocks_are_transpose_invariant_and_match_flattened_blocks():
    x = special_input(dtype=torch.float32)
    x = torch.nan_to_num(x, nan=0.0, posinf=1.0, neginf=-1.0)
    sq = quantize_mx(x, square=True, scale_rounding="ceil")
    sq_t = quantize_mx(x.T.contiguous(), square=True, scale_rounding="ceil")
    assert torch.equal(sq.scale.T, sq_t.scale)
    assert same_bits(sq.data.T.contiguous(), sq_t.data)
    # Independent of the block reshuffling: each 32x32 square, flattened, is one 1x1024 block.
    for bi, bj in [(0, 0), (1, 3), (0, 7)]:
        block = x[32 * bi : 32 * (bi + 1), 32 * bj : 32 * (bj + 1)].reshape(1, 1024)
        flat = quantize_mx(block, block_size=1024, scale_rounding="ceil")
        assert sq.scale[bi, bj] == flat.scale[0, 0]
        got = sq.data[32 * bi : 32 * (bi + 1), 32 * bj : 32 * (bj + 1)].reshape(1, 1024)
        assert same_bits(got, flat.data)


def test_backend_argument_of_the_reference_functions():
    x = special_input()
    a = quantize_mx(x, backend="triton")
    b = quantize_mx(x, backend="torch")
    assert same_bits(a.data, b.data) and torch.equal(a.scale, b.scale)
    assert same_bits(dequantize_mx(a, backend="triton"), dequantize_mx(a, backend="torch"))
    with pytest.raises(ValueError, match="backend must be"):
        quantize_mx(x, backend="cuda")


def test_bad_arguments():
    x = torch.zeros(4, 64)
    with pytest.raises(ValueError, match="power of two"):
        quantize_mx_triton(x, block_size=24)
    with pytest.raises(TypeError, match="x must have dtype"):
        quantize_mx_triton(x.double())
    with pytest.raises(ValueError, match="scale_rounding"):
        quantize_mx_triton(x, scale_rounding="up")
    with pytest.raises(ValueError, match="second-to-last dim"):
        quantize_mx_triton(torch.zeros(16, 64), square=True)
    with pytest.raises(TypeError, match="mx must be an MXTensor"):
        dequantize_mx_triton(x)


def test_cpu_without_interpreter_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        quantize_mx_triton(torch.zeros(4, 64))


@pytest.mark.gpu
@pytest.mark.sm89
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("square", [False, True])
def test_cuda_kernels_bit_exact(square):
    x = special_input(rows=256, cols=512)
    for rounding in ("floor", "ceil"):
        for elem in ELEM:
            ref = quantize_mx(x, elem_dtype=elem, scale_rounding=rounding, square=square)
            got = quantize_mx(x.cuda(), elem_dtype=elem, scale_rounding=rounding, square=square)
            assert same_bits(ref.data, got.data.cpu()) and torch.equal(ref.scale, got.scale.cpu())
            assert same_bits(dequantize_mx(ref), dequantize_mx_triton(got).cpu())
