"""Tests for gem_precision.mx against an independent float64 / exact-rational model of the spec."""

from __future__ import annotations

import bisect
import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from gem_precision import MXTensor, dequantize_mx, quantize_mx
from hypothesis import given, settings
from hypothesis import strategies as st

ELEM_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2]
ROUNDINGS = ["floor", "ceil"]
INPUT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


# --------------------------------------------------------------------------------------------
# Independent reference model of OCP MX v1.0 (pure Python, exact rationals)
# --------------------------------------------------------------------------------------------


class RefFormat:
    """An FP8 format described only by its bit layout, with every finite value enumerated."""

    def __init__(self, exp_bits: int, man_bits: int, bias: int, finite_codes: range):
        self.man_bits = man_bits
        self.values: list[Fraction] = []
        self.codes: list[int] = []
        for code in finite_codes:
            exp_field, man_field = code >> man_bits, code & ((1 << man_bits) - 1)
            if exp_field == 0:  # subnormal: 0.m * 2**(1 - bias)
                value = Fraction(man_field, 1 << man_bits) * Fraction(2) ** (1 - bias)
            else:
                value = (1 + Fraction(man_field, 1 << man_bits)) * Fraction(2) ** (exp_field - bias)
            self.values.append(value)
            self.codes.append(code)
        assert self.values == sorted(self.values)
        self.max_normal = self.values[-1]
        self.emax = math.frexp(float(self.max_normal))[1] - 1
        self.min_normal = Fraction(2) ** (1 - bias)
        self.subnormal_step = Fraction(2) ** (1 - bias - man_bits)

    def encode(self, v: Fraction, negative: bool) -> int:
        """Round-to-nearest-even onto the grid, saturating to the max normal; returns the byte."""
        mag = abs(v)
        if mag >= self.max_normal:
            code = self.codes[-1]
        else:
            i = bisect.bisect_left(self.values, mag)
            if self.values[i] == mag:
                code = self.codes[i]
            else:
                lo, hi = i - 1, i
                d_lo, d_hi = mag - self.values[lo], self.values[hi] - mag
                if d_lo < d_hi:
                    code = self.codes[lo]
                elif d_hi < d_lo:
                    code = self.codes[hi]
                else:  # tie: the even code has an even last mantissa bit
                    code = self.codes[lo] if self.codes[lo] % 2 == 0 else self.codes[hi]
        return code | (0x80 if negative else 0)

    def decode(self, byte: int) -> Fraction:
        mag = self.values[self.codes.index(byte & 0x7F)]
        return -mag if byte & 0x80 else mag


# E4M3 (fn): bias 7, exponent 1111 is normal except mantissa 111 (NaN); no Inf.
REF_E4M3 = RefFormat(exp_bits=4, man_bits=3, bias=7, finite_codes=range(0, 0x7F))
# E5M2: bias 15, IEEE-like: exponent 11111 is Inf/NaN.
REF_E5M2 = RefFormat(exp_bits=5, man_bits=2, bias=15, finite_codes=range(0, 0x7C))
REF_FORMATS = {torch.float8_e4m3fn: REF_E4M3, torch.float8_e5m2: REF_E5M2}


def ref_shared_exponent(block: list[float], fmt: RefFormat, rounding: str) -> int | None:
    """Unbiased shared exponent of one block, or None for a NaN scale."""
    if any(not math.isfinite(v) for v in block):
        return None
    amax = max(abs(v) for v in block)
    if amax == 0:
        return -127
    mantissa, exp = math.frexp(amax)  # amax = mantissa * 2**exp, mantissa in [0.5, 1)
    shared = (exp - 1) - fmt.emax
    if rounding == "ceil":
        while Fraction(amax) / Fraction(2) ** shared > fmt.max_normal:
            shared += 1
    return max(-127, min(127, shared))


def ref_quantize(values: np.ndarray, block_size: int, fmt: RefFormat, rounding: str):
    """Returns (element bytes, scale bytes) as int arrays for float64 ``values`` of any shape."""
    flat = values.reshape(-1, block_size)
    codes = np.zeros(flat.shape, dtype=np.int64)
    scales = np.zeros(flat.shape[0], dtype=np.int64)
    for b, block in enumerate(flat.tolist()):
        shared = ref_shared_exponent(block, fmt, rounding)
        if shared is None:
            scales[b] = 0xFF
            continue  # elements of a NaN block are stored as +0
        scales[b] = shared + 127
        for j, v in enumerate(block):
            codes[b, j] = fmt.encode(Fraction(v) / Fraction(2) ** shared, math.copysign(1, v) < 0)
    return codes.reshape(values.shape), scales.reshape(*values.shape[:-1], -1)


def ref_dequantize(codes: np.ndarray, scales: np.ndarray, block_size: int, fmt: RefFormat):
    flat_codes = codes.reshape(-1, block_size)
    out = np.zeros(flat_codes.shape, dtype=np.float64)
    for b, scale in enumerate(scales.reshape(-1).tolist()):
        for j, byte in enumerate(flat_codes[b].tolist()):
            if scale == 0xFF:
                out[b, j] = math.nan
            else:
                out[b, j] = float(fmt.decode(byte) * Fraction(2) ** (scale - 127))
    return out.reshape(codes.shape)


def check_against_reference(x: torch.Tensor, block_size: int, elem_dtype, rounding: str) -> None:
    fmt = REF_FORMATS[elem_dtype]
    values = x.to(torch.float64).numpy()
    ref_codes, ref_scales = ref_quantize(values, block_size, fmt, rounding)

    mx = quantize_mx(x, block_size=block_size, elem_dtype=elem_dtype, scale_rounding=rounding)
    assert mx.data.dtype == elem_dtype
    assert mx.data.shape == x.shape
    assert mx.scale.dtype == torch.uint8
    assert mx.scale.shape == (*x.shape[:-1], x.shape[-1] // block_size)
    assert mx.block_size == block_size
    assert mx.orig_dtype == x.dtype
    np.testing.assert_array_equal(mx.scale.to(torch.int64).numpy(), ref_scales)
    np.testing.assert_array_equal(mx.data.view(torch.uint8).to(torch.int64).numpy(), ref_codes)

    ref_values = ref_dequantize(ref_codes, ref_scales, block_size, fmt)
    out32 = mx.dequantize(torch.float32)
    # Every dequantized value is exact in float32; compare bit-for-bit (NaN == NaN).
    torch.testing.assert_close(
        out32, torch.from_numpy(ref_values).to(torch.float32), rtol=0, atol=0, equal_nan=True
    )
    out = dequantize_mx(mx)
    assert out.dtype == x.dtype
    torch.testing.assert_close(
        out, torch.from_numpy(ref_values).to(x.dtype), rtol=0, atol=0, equal_nan=True
    )


# --------------------------------------------------------------------------------------------
# Sanity checks of the reference model itself (against facts from the OCP spec tables)
# --------------------------------------------------------------------------------------------


def test_reference_formats_match_spec_constants():
    assert REF_E4M3.max_normal == 448 and REF_E4M3.emax == 8
    assert REF_E5M2.max_normal == 57344 and REF_E5M2.emax == 15
    assert REF_E4M3.values[1] == Fraction(1, 2**9)  # smallest E4M3 subnormal
    assert REF_E5M2.values[1] == Fraction(1, 2**16)  # smallest E5M2 subnormal
    assert REF_E4M3.min_normal == Fraction(1, 2**6)
    assert REF_E5M2.min_normal == Fraction(1, 2**14)
    # the reference grid agrees with torch's own FP8 decoding of every finite byte
    for dtype, fmt in REF_FORMATS.items():
        decoded = torch.tensor(fmt.codes, dtype=torch.uint8).view(dtype).to(torch.float64)
        assert decoded.tolist() == [float(v) for v in fmt.values]


# --------------------------------------------------------------------------------------------
# Hand-picked edge cases
# --------------------------------------------------------------------------------------------


def _blocks(*blocks: list[float], block_size: int, dtype=torch.float32) -> torch.Tensor:
    rows = []
    for block in blocks:
        padded = list(block) + [0.0] * (block_size - len(block))
        rows.extend(padded)
    return torch.tensor(rows, dtype=torch.float64).to(dtype).reshape(1, -1)


@pytest.mark.parametrize("elem_dtype", ELEM_DTYPES)
@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_edge_blocks_bit_exact(elem_dtype, rounding):
    fmt = REF_FORMATS[elem_dtype]
    max_normal = float(fmt.max_normal)
    top = 2.0**fmt.emax
    step = float(fmt.subnormal_step)
    tiny32 = 2.0**-149  # smallest float32 subnormal
    x = _blocks(
        [0.0] * 8,  # all-zero block
        [-0.0, 0.0, -0.0],  # signed zeros
        [tiny32, -tiny32 * 3, 2.0**-130, -(2.0**-127), 2.0**-126],  # float32 subnormals
        [1.0, 2.0**-7, 2.0**-10, 2.0**-12, 3 * 2.0**-13],  # element subnormals / underflow
        [max_normal, -max_normal, 1.0],  # amax exactly at max normal
        [max_normal * 1.01, 479.99, -500.0],  # amax just above max normal
        [top * 1.75, top * 1.7500001, top * 1.999],  # around the ceil threshold
        [3.4028234663852886e38, -1e38, 1.0],  # float32 max
        [1.0, 1.0625, 1.1875, -1.0625, 2.0 + 0.125, 256.0],  # E4M3 ties (scale 0)
        [1.0, 1.125, 1.375, 1.625, 2.0**15],  # E5M2 ties (scale 0)
        [step * 0.5, step * 1.5, step * 2.5, step * 0.25],  # subnormal ties (tiny scale)
        [1.0, float("nan"), 2.0],  # NaN block
        [1.0, float("inf")],  # +Inf block
        [-float("inf"), 0.0],  # -Inf block
        [5.0, -7.25, 0.001, 1e-20],  # mixed magnitudes
        block_size=8,
    )
    check_against_reference(x, 8, elem_dtype, rounding)


@pytest.mark.parametrize("elem_dtype", ELEM_DTYPES)
@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs_bit_exact(elem_dtype, rounding, in_dtype):
    info = torch.finfo(in_dtype)
    smallest_sub = info.smallest_normal * info.eps  # smallest subnormal of the input dtype
    x = _blocks(
        [smallest_sub, -smallest_sub * 3, info.smallest_normal],  # input subnormals
        [info.max, -info.max, 1.0],
        [info.tiny * 0.5, 1e-3, -2.5],
        [0.0, -0.0],
        [float("nan"), 1.0],
        block_size=4,
        dtype=in_dtype,
    )
    check_against_reference(x, 4, elem_dtype, rounding)


def test_nan_and_inf_blocks_are_nan_and_do_not_leak():
    x = torch.ones(3, 64)
    x[0, 5] = float("nan")
    x[1, 40] = float("inf")
    x[2, 0] = -float("inf")
    mx = quantize_mx(x)
    assert mx.scale.tolist() == [[0xFF, 127 - 8], [127 - 8, 0xFF], [0xFF, 127 - 8]]
    out = mx.dequantize()
    assert torch.isnan(out[0, :32]).all() and torch.equal(out[0, 32:], x[0, 32:])
    assert torch.isnan(out[1, 32:]).all() and torch.equal(out[1, :32], x[1, :32])
    assert torch.isnan(out[2, :32]).all() and torch.equal(out[2, 32:], x[2, 32:])


def test_all_zero_block_gets_smallest_scale():
    mx = quantize_mx(torch.zeros(2, 32, dtype=torch.bfloat16))
    assert mx.scale.tolist() == [[0], [0]]
    assert (mx.data.view(torch.uint8) == 0).all()
    assert torch.equal(mx.dequantize(), torch.zeros(2, 32, dtype=torch.bfloat16))


# --------------------------------------------------------------------------------------------
# Property tests (hypothesis)
# --------------------------------------------------------------------------------------------

float32_values = st.floats(width=32, allow_nan=True, allow_infinity=True)


@st.composite
def edge_tensors(draw):
    """Small tensors of arbitrary float32 bit patterns (heavy on edge values)."""
    block_size = draw(st.sampled_from([1, 2, 8, 32]))
    lead = draw(st.lists(st.integers(1, 3), min_size=0, max_size=2))
    n_blocks = draw(st.integers(1, 3))
    shape = (*lead, n_blocks * block_size)
    n = math.prod(shape)
    # Mostly finite values so that most blocks are not NaN blocks.
    finite = st.floats(width=32, allow_nan=False, allow_infinity=False)
    values = draw(
        st.lists(st.one_of(finite, finite, finite, finite, float32_values), min_size=n, max_size=n)
    )
    return torch.tensor(values, dtype=torch.float32).reshape(shape), block_size


@settings(max_examples=30, deadline=None)
@given(
    case=edge_tensors(),
    elem_dtype=st.sampled_from(ELEM_DTYPES),
    rounding=st.sampled_from(ROUNDINGS),
)
def test_hypothesis_edge_values_bit_exact(case, elem_dtype, rounding):
    x, block_size = case
    check_against_reference(x, block_size, elem_dtype, rounding)


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    shape=st.sampled_from([(32,), (3, 64), (2, 3, 32), (1, 96), (4, 2, 16)]),
    block_size=st.sampled_from([16, 32]),
    in_dtype=st.sampled_from(INPUT_DTYPES),
    elem_dtype=st.sampled_from(ELEM_DTYPES),
    rounding=st.sampled_from(ROUNDINGS),
)
def test_hypothesis_random_tensors_bit_exact(
    seed, shape, block_size, in_dtype, elem_dtype, rounding
):
    if shape[-1] % block_size:
        shape = (*shape[:-1], shape[-1] * block_size)
    gen = torch.Generator().manual_seed(seed)
    # Gaussian data with a different magnitude per block (2**-40 .. 2**40), plus outliers.
    x = torch.randn(shape, generator=gen)
    blocks = x.reshape(-1, block_size)
    exps = torch.randint(-40, 41, (blocks.shape[0], 1), generator=gen).to(torch.float32)
    blocks *= torch.exp2(exps)
    outliers = torch.rand(blocks.shape, generator=gen) < 0.02
    blocks[outliers] *= 1000.0
    x = blocks.reshape(shape).to(in_dtype)
    check_against_reference(x, block_size, elem_dtype, rounding)


# --------------------------------------------------------------------------------------------
# Round-trip error bounds
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("elem_dtype", ELEM_DTYPES)
@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("in_dtype", INPUT_DTYPES)
def test_round_trip_error_bound(elem_dtype, rounding, in_dtype):
    fmt = REF_FORMATS[elem_dtype]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(16, 128, generator=gen) * torch.exp2(
        torch.randint(-10, 11, (16, 1), generator=gen).float()
    )
    x = x.to(in_dtype)
    mx = quantize_mx(x, elem_dtype=elem_dtype, scale_rounding=rounding)
    out = mx.dequantize(torch.float32).double()
    xd = x.double()
    scale = torch.exp2(mx.scale.double() - 127).repeat_interleave(32, dim=-1)
    scaled = xd.abs() / scale
    err = (out - xd).abs()
    half_ulp_rel = 2.0 ** -(fmt.man_bits + 1)
    normal = (scaled >= float(fmt.min_normal)) & (scaled <= float(fmt.max_normal))
    subnormal = scaled < float(fmt.min_normal)
    saturated = scaled > float(fmt.max_normal)
    assert normal.any()
    # normal range: relative error at most half an ulp
    assert (err[normal] <= half_ulp_rel * xd.abs()[normal]).all()
    # subnormal range: absolute error at most half the subnormal step (times the block scale)
    assert (err[subnormal] <= float(fmt.subnormal_step) / 2 * scale[subnormal]).all()
    # beyond the max normal: saturates to +-max_normal * scale (only possible with floor scales)
    expected_sat = torch.sign(xd[saturated]) * float(fmt.max_normal) * scale[saturated]
    assert torch.equal(out[saturated], expected_sat)
    if rounding == "ceil":
        assert not saturated.any()
    # Where each block's amax lands relative to its scale (no block here hits the E8M0 clamp).
    ratio = xd.reshape(16, -1, 32).abs().amax(-1) / torch.exp2(mx.scale.double() - 127)
    if rounding == "floor":
        assert ((ratio >= 2.0**fmt.emax) & (ratio < 2.0 ** (fmt.emax + 1))).all()
    else:
        assert ((ratio > float(fmt.max_normal) / 2) & (ratio <= float(fmt.max_normal))).all()


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


def test_rejects_last_dim_not_divisible():
    with pytest.raises(ValueError, match="divisible by block_size=32"):
        quantize_mx(torch.zeros(4, 48))


def test_rejects_zero_dim_tensor():
    with pytest.raises(ValueError, match="at least one dimension"):
        quantize_mx(torch.tensor(1.0), block_size=1)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.float8_e4m3fn, torch.bool])
def test_rejects_bad_input_dtype(dtype):
    with pytest.raises(TypeError, match="x must have dtype float32, bfloat16 or float16"):
        quantize_mx(torch.zeros(2, 32).to(dtype))


def test_rejects_non_tensor():
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        quantize_mx([1.0] * 32)


@pytest.mark.parametrize("block_size", [0, -32, 2.0, True, "32"])
def test_rejects_bad_block_size(block_size):
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        quantize_mx(torch.zeros(2, 32), block_size=block_size)


@pytest.mark.parametrize("elem_dtype", [torch.float16, torch.float8_e4m3fnuz, torch.uint8])
def test_rejects_bad_elem_dtype(elem_dtype):
    with pytest.raises(TypeError, match="elem_dtype must be"):
        quantize_mx(torch.zeros(2, 32), elem_dtype=elem_dtype)


def test_rejects_bad_scale_rounding():
    with pytest.raises(ValueError, match="scale_rounding must be 'floor' or 'ceil'"):
        quantize_mx(torch.zeros(2, 32), scale_rounding="nearest")


def test_mx_tensor_validates_its_fields():
    data = torch.zeros(2, 64, dtype=torch.float8_e4m3fn)
    MXTensor(data=data, scale=torch.zeros(2, 2, dtype=torch.uint8))  # valid
    with pytest.raises(ValueError, match="scale must have shape"):
        MXTensor(data=data, scale=torch.zeros(2, 3, dtype=torch.uint8))
    with pytest.raises(TypeError, match="scale must have dtype uint8"):
        MXTensor(data=data, scale=torch.zeros(2, 2, dtype=torch.int32))
    with pytest.raises(TypeError, match="data must have dtype"):
        MXTensor(data=torch.zeros(2, 64), scale=torch.zeros(2, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="divisible by block_size=48"):
        MXTensor(data=data, scale=torch.zeros(2, 1, dtype=torch.uint8), block_size=48)


def test_dequantize_rejects_bad_arguments():
    mx = quantize_mx(torch.ones(1, 32))
    with pytest.raises(TypeError, match="mx must be an MXTensor"):
        dequantize_mx(torch.ones(1, 32))
    with pytest.raises(TypeError, match="dtype must be a floating point torch.dtype"):
        dequantize_mx(mx, dtype=torch.int32)


def test_empty_tensor():
    mx = quantize_mx(torch.zeros(0, 64))
    assert mx.scale.shape == (0, 2)
    assert mx.dequantize().shape == (0, 64)


# --------------------------------------------------------------------------------------------
# Accelerator agreement
# --------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.sm89
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("elem_dtype", ELEM_DTYPES)
@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_cuda_matches_cpu_bit_exact(elem_dtype, rounding):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, 256, generator=gen) * torch.exp2(
        torch.randint(-130, 120, (64, 1), generator=gen).float()
    )
    x[0, 3] = float("nan")
    x[1, 40] = float("inf")
    x[2, :32] = 0.0
    x[3, :] = 2.0**-140  # float32 subnormals
    cpu = quantize_mx(x, elem_dtype=elem_dtype, scale_rounding=rounding)
    gpu = quantize_mx(x.cuda(), elem_dtype=elem_dtype, scale_rounding=rounding)
    assert torch.equal(cpu.scale, gpu.scale.cpu())
    assert torch.equal(cpu.data.view(torch.uint8), gpu.data.view(torch.uint8).cpu())
    torch.testing.assert_close(
        cpu.dequantize(), gpu.dequantize().cpu(), rtol=0, atol=0, equal_nan=True
    )


def test_float64_dequantization_does_not_overflow_float32():
    """A valid block with the largest finite scale (2^127) times 448 is past float32's range."""
    data = torch.tensor([[1.0, 2.0, 448.0] + [0.0] * 29]).to(torch.float8_e4m3fn)
    mx = MXTensor(data, torch.tensor([[254]], dtype=torch.uint8), 32, torch.float32)
    out = dequantize_mx(mx, torch.float64, backend="reference")
    assert out[0, :3].tolist() == [2.0**127, 2.0**128, 448 * 2.0**127]
    with pytest.raises(TypeError, match="dtype must be a floating point torch.dtype"):
        dequantize_mx(mx, "float32")  # type: ignore[arg-type]
