"""Tests for Philox random bits and stochastic rounding to FP8."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from gem_precision import philox_uint32, philox_uniform, stochastic_round_to_fp8
from gem_precision.rounding import _philox4x32

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
MAX_NORMAL = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def fp8_grid(dtype: torch.dtype) -> np.ndarray:
    """All finite non-negative values of an FP8 format, sorted, by decoding every byte."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    values = codes.view(dtype).to(torch.float64).numpy()
    return np.unique(values[np.isfinite(values) & (values >= 0)])


def py_philox4x32(counter: list[int], key: list[int]) -> list[int]:
    """Plain-Python Philox-4x32-10 with unbounded ints (independent of the tensor version)."""
    c, k = list(counter), list(key)
    for r in range(10):
        if r:
            k = [(k[0] + 0x9E3779B9) % 2**32, (k[1] + 0xBB67AE85) % 2**32]
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [(p1 >> 32) ^ c[1] ^ k[0], p1 % 2**32, (p0 >> 32) ^ c[3] ^ k[1], p0 % 2**32]
    return c


# Known-answer vectors of Random123 (kat_vectors, philox4x32 with 10 rounds).
KAT = [
    ([0, 0, 0, 0], [0, 0], [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]),
    ([0xFFFFFFFF] * 4, [0xFFFFFFFF] * 2, [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]),
    (
        [0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344],
        [0xA4093822, 0x299F31D0],
        [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1],
    ),
]


@pytest.mark.parametrize(("counter", "key", "expected"), KAT)
def test_philox_known_answers(counter, key, expected):
    words = _philox4x32(tuple(torch.tensor([c], dtype=torch.int64) for c in counter), tuple(key))
    assert [int(w.item()) for w in words] == expected
    assert py_philox4x32(counter, key) == expected


def test_philox_stream_matches_python_reference_and_offsets():
    seed, offset, n = 2**40 + 12345, 2**33 - 5, 64  # crosses the 32-bit counter boundary
    got = philox_uint32(n, seed=seed, offset=offset).tolist()
    key = [seed % 2**32, seed >> 32]
    want = [
        py_philox4x32([(offset + i) % 2**32, (offset + i) >> 32, 0, 0], key)[0] for i in range(n)
    ]
    assert got == want
    # Skipping ahead with offset gives the tail of the longer stream.
    assert torch.equal(
        philox_uint32(10, seed=seed, offset=offset + 5),
        philox_uint32(15, seed=seed, offset=offset)[5:],
    )


def test_philox_uniform_range_and_moments():
    u = philox_uniform((200, 500), seed=7)
    assert u.dtype == torch.float32 and u.shape == (200, 500)
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    n = u.numel()
    # Mean 1/2 and variance 1/12 within 5 standard errors.
    assert abs(float(u.double().mean()) - 0.5) < 5 * math.sqrt(1 / 12 / n)
    assert abs(float(u.double().var()) - 1 / 12) < 5 * math.sqrt(1 / 180 / n)
    assert not torch.equal(u, philox_uniform((200, 500), seed=8))


@pytest.mark.parametrize("dtype", FP8)
def test_outputs_are_neighbouring_grid_values(dtype):
    grid = fp8_grid(dtype)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=gen) * torch.exp2(
        torch.randint(-12, 12, (4096,), generator=gen).float()
    )
    q = stochastic_round_to_fp8(x, dtype, seed=1).to(torch.float64).numpy()
    mag = np.minimum(np.abs(x.double().numpy()), grid[-1])
    hi_idx = np.searchsorted(grid, mag, side="left")
    lo = grid[np.where(grid[hi_idx] == mag, hi_idx, hi_idx - 1)]
    hi = grid[hi_idx]
    sign = np.sign(x.double().numpy())
    qa = np.abs(q)
    assert np.all((qa == lo) | (qa == hi))
    assert np.all(np.sign(q)[q != 0] == sign[q != 0])
    # Both neighbours are actually used (it is not deterministic rounding in disguise).
    inexact = lo != hi
    assert np.any(qa[inexact] == lo[inexact]) and np.any(qa[inexact] == hi[inexact])


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_unbiased_within_five_sigma(dtype, in_dtype):
    grid = fp8_grid(dtype)
    values = torch.tensor([0.3, -1.1, 3.3, 100.7, 0.0123, -0.00091]).to(in_dtype)
    draws = 4000
    x = values.repeat(draws, 1)
    q = stochastic_round_to_fp8(x, dtype, seed=123, offset=99).to(torch.float64)
    for j, v in enumerate(values.double().tolist()):
        mag = abs(v)
        hi = grid[np.searchsorted(grid, mag)]
        lo = grid[np.searchsorted(grid, mag) - 1]
        p = (mag - lo) / (hi - lo)
        sigma = (hi - lo) * math.sqrt(p * (1 - p) / draws)
        assert 0 < p < 1
        assert abs(float(q[:, j].mean()) - v) < 5 * sigma, (v, float(q[:, j].mean()), sigma)


@pytest.mark.parametrize("dtype", FP8)
def test_representable_values_are_exact(dtype):
    grid = torch.from_numpy(fp8_grid(dtype)).float()
    x = torch.cat([grid, -grid])
    q = stochastic_round_to_fp8(x, dtype, seed=5).float()
    assert torch.equal(q, x)


@pytest.mark.parametrize("dtype", FP8)
def test_saturation_zeros_and_nan(dtype):
    m = MAX_NORMAL[dtype]
    x = torch.tensor(
        [m, m * 1.01, 1e30, float("inf"), -m * 3, float("-inf"), 0.0, -0.0, float("nan")]
    )
    q = stochastic_round_to_fp8(x, dtype, seed=9).float()
    assert q[:6].tolist() == [m, m, m, m, -m, -m]
    assert q[6].item() == 0.0 and math.copysign(1, q[6].item()) == 1
    assert q[7].item() == 0.0 and math.copysign(1, q[7].item()) == -1
    assert math.isnan(q[8].item())
    assert q.shape == x.shape


def test_deterministic_in_seed_and_offset():
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(3))
    a = stochastic_round_to_fp8(x, seed=11, offset=7)
    b = stochastic_round_to_fp8(x, seed=11, offset=7)
    c = stochastic_round_to_fp8(x, seed=12, offset=7)
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert not torch.equal(a.view(torch.uint8), c.view(torch.uint8))


def test_a_tensor_offset_gives_the_stream_of_its_value():
    """A counter kept in a one-element int64 tensor (Fp8Linear's) draws what the int would."""
    x = torch.randn(40, 70, generator=torch.Generator().manual_seed(5))
    offset = 2**40 + 3
    for tensor in (torch.tensor(offset), torch.tensor([offset])):
        assert torch.equal(
            philox_uint32(100, seed=7, offset=tensor), philox_uint32(100, seed=7, offset=offset)
        )
        got = stochastic_round_to_fp8(x, seed=7, offset=tensor)
        want = stochastic_round_to_fp8(x, seed=7, offset=offset)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_rejects_bad_arguments():
    x = torch.ones(4)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        stochastic_round_to_fp8([1.0], seed=0)
    with pytest.raises(TypeError, match="x must have dtype"):
        stochastic_round_to_fp8(x.double(), seed=0)
    with pytest.raises(TypeError, match="dtype must be"):
        stochastic_round_to_fp8(x, torch.float16, seed=0)
    with pytest.raises(ValueError, match="seed must be in"):
        stochastic_round_to_fp8(x, seed=-1)
    with pytest.raises(TypeError, match="offset must be an int"):
        stochastic_round_to_fp8(x, seed=0, offset=1.5)
    for offset in (torch.tensor(1, dtype=torch.int32), torch.tensor([1, 2])):
        with pytest.raises(ValueError, match="a tensor offset must be one int64 element"):
            stochastic_round_to_fp8(x, seed=0, offset=offset)
    with pytest.raises(ValueError, match="numel must be"):
        philox_uint32(-1, seed=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    x = torch.randn(256, 256, generator=torch.Generator().manual_seed(4))
    cpu = stochastic_round_to_fp8(x, seed=1, offset=3)
    gpu = stochastic_round_to_fp8(x.cuda(), seed=1, offset=3)
    assert torch.equal(cpu.view(torch.uint8), gpu.view(torch.uint8).cpu())


@pytest.mark.parametrize(
    "numel,seed,offset",
    [
        (3000, 0, 0),  # several programs, a partial last block
        (517, 2**40 + 12345, 2**32 - 200),  # seed with a high word; counters cross 2**32
        (64, 2**63 - 1, 2**50 + 7),  # the largest seed, a large offset
        (1, 2**31 + 5, 2**31),  # words that are uint32 but not int32
        (0, 3, 0),
        (10, 2**32 + 1, 1),  # arguments equal to 1 (Triton may specialise them)
    ],
)
def test_triton_philox_equals_the_torch_stream(monkeypatch, numel, seed, offset):
    """The one-launch Triton Philox (used for CUDA tensors) gives the PyTorch stream bit for
    bit; run here under the Triton interpreter."""
    from gem_precision.rounding import _philox_uint32_triton

    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    want = philox_uint32(numel, seed=seed, offset=offset)  # CPU: the PyTorch implementation
    got = _philox_uint32_triton(numel, seed, offset, torch.device("cpu"))
    assert got.dtype == torch.int64 and got.shape == (numel,)
    assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_philox_and_stochastic_rounding_equal_the_cpu_stream():
    """On CUDA philox_uint32 runs the Triton kernel: same bits as the CPU implementation, so
    stochastic rounding gives the same FP8 values on every device."""
    for seed, offset in ((0, 0), (2**40 + 3, 2**32 - 100), (2**63 - 1, 2**50)):
        got = philox_uint32(70_001, seed=seed, offset=offset, device="cuda").cpu()
        assert torch.equal(got, philox_uint32(70_001, seed=seed, offset=offset))
    x = torch.randn(300, 257) * 10
    cpu = stochastic_round_to_fp8(x, seed=11, offset=5)
    gpu = stochastic_round_to_fp8(x.cuda(), seed=11, offset=5).cpu()
    assert torch.equal(gpu.view(torch.uint8), cpu.view(torch.uint8))
