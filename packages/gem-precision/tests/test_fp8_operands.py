"""The one-pass FP8 operand kernel (Triton, interpreted on CPU) against the PyTorch reference,
the exactness of the power-of-two scale rule, and the scaled_mm layouts."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from gem_precision import blockwise
from gem_precision.blockwise import (
    OperandKernelConfig,
    _pow2_scale_exponent,
    dequantize_operand,
    quantize_blockwise,
    quantize_operand,
)

ELEM = [torch.float8_e4m3fn, torch.float8_e5m2]
KINDS = ["1x128", "128x128", "tensorwise"]
FIELDS = ("data", "scale", "data_t", "scale_t")


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def special_input(rows=200, cols=300, dtype=torch.bfloat16, seed=0, finite=False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen)
    x = x * torch.exp2(torch.randint(-30, 30, (rows, cols), generator=gen).float())
    x[0, :5] = 0.0
    x[4, 130:] = 0.0  # an all-zero block
    x[9, :] = 1e-39  # subnormal rows
    x[:, 17] = -3e-42  # a subnormal column (amax / max_normal underflows for E5M2)
    if not finite:
        x[5, 3] = float("nan")
        x[7, 150] = float("inf")
    return x.to(dtype)


def same(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if a.shape != b.shape:
        return False
    if a.dtype.itemsize == 1:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a, b)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("elem", ELEM)
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float32])
def test_triton_bit_exact_with_torch(kind, elem, in_dtype):
    x = special_input(dtype=in_dtype, finite=kind == "tensorwise")
    ref = quantize_operand(x, kind, elem, backend="torch")
    got = quantize_operand(x, kind, elem, backend="triton")
    for field in FIELDS:
        assert same(getattr(ref, field), getattr(got, field)), field


@pytest.mark.parametrize(
    "options",
    [
        {},  # the defaults
        {"num_warps": 2, "rows_only_block_r": 16},
        {"tile_warps": 8, "rows_only_block_r": 64},
    ],
)
def test_kernel_configs_agree(options):
    config = OperandKernelConfig(**options)
    x = special_input()
    ref = quantize_operand(x, "1x128", backend="torch")
    for rows, cols in ((True, True), (True, False), (False, True)):
        got = quantize_operand(x, "1x128", rows=rows, cols=cols, backend="triton", config=config)
        assert same(ref.data if rows else None, got.data)
        assert same(ref.scale if rows else None, got.scale)
        assert same(ref.data_t if cols else None, got.data_t)
        assert same(ref.scale_t if cols else None, got.scale_t)


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        ("tile_warps", 3, ValueError),
        ("num_warps", True, ValueError),
        ("rows_only_block_r", 256, ValueError),
        ("t_run", 2, ValueError),
        ("prefetch_per_sm", -1.0, ValueError),
        ("run_asm_col_sum", 1, TypeError),
    ],
)
def test_kernel_config_rejects_bad_values(field, value, error):
    with pytest.raises(error, match=field):
        OperandKernelConfig(**{field: value})
    with pytest.raises(TypeError, match="config must be an OperandKernelConfig"):
        quantize_operand(torch.ones(2, 2), config={"tile_warps": 4})


@pytest.mark.parametrize(
    "options",
    [
        {},  # the defaults
        {"t_run": 8, "t_run_col_sum": 8, "t_run_col_tiles": 8},
        {"t_run": 4, "t_run_col_sum": 16, "t_run_col_tiles": 4},
        {"t_run": 0, "t_run_col_sum": 0},
    ],
)
@pytest.mark.parametrize("elem", ELEM)
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float32])
def test_packed_transpose(options, elem, in_dtype):
    # x.T stored as packed runs of rows: the reference bits on whole tiles (the packed path)
    # and on partial ones (the fallback); column sums as x.sum(0). float32 inputs are what a
    # float32 model's layers quantize (the GEM quality runs). 300 and 301 rows: whole row
    # tiles launched with the runs, the ragged last one masked in a launch of its own (301:
    # x.T's rows are no whole int32 words, so no runs); 300 columns: the ragged last column of
    # tiles in a launch of its own too.
    config = OperandKernelConfig(**options)
    for shape in ((384, 256), (200, 300), (300, 256), (301, 256), (384, 300)):
        x = special_input(*shape, seed=7, dtype=in_dtype)
        finite = torch.nan_to_num(x.float(), nan=0.0, posinf=0.0, neginf=0.0).to(x.dtype)
        for col_tiles in (False, True):
            for src, col_sum in ((x, False), (finite, True)):
                ref = quantize_operand(src, "1x128", elem, backend="torch", col_tiles=col_tiles)
                got = quantize_operand(
                    src, "1x128", elem, backend="triton", col_sum=col_sum, col_tiles=col_tiles,
                    config=config,
                )  # fmt: skip
                for field in FIELDS:
                    assert same(getattr(ref, field), getattr(got, field)), (shape, field)
                if col_sum:
                    want = src.double().sum(0)
                    bound = 1e-6 * src.double().abs().sum(0) + 1e-3
                    assert bool(((got.col_sum.double() - want).abs() <= bound).all())


@pytest.mark.parametrize("shape", [(1, 1), (3, 17), (300, 40), (512, 128)])
def test_partial_sums_reduced_in_triton(shape):
    # The per-tile column sums summed by column_sum_kernel (fixed row order): float64 bound.
    gen = torch.Generator().manual_seed(shape[0])
    partials = torch.randn(shape, generator=gen) * 100
    got = blockwise._column_sums_triton(partials)
    want = partials.double().sum(0)
    bound = 1e-6 * partials.double().abs().sum(0) + 1e-6
    assert got.dtype == torch.float32 and got.shape == (shape[1],)
    assert bool(((got.double() - want).abs() <= bound).all())


@pytest.mark.parametrize("elem", ELEM)
def test_even_shapes_without_masks(elem):
    # 256 x 256 divides into whole tiles: the tile kernel's unmasked (EVEN) path.
    for kind in ("1x128", "tensorwise"):
        x = special_input(rows=256, cols=256, seed=3, finite=kind == "tensorwise")
        ref = quantize_operand(x, kind, elem, backend="torch")
        for rows, cols in ((True, True), (True, False), (False, True)):
            got = quantize_operand(x, kind, elem, rows=rows, cols=cols, backend="triton")
            assert same(ref.data if rows else None, got.data)
            assert same(ref.scale if rows else None, got.scale)
            assert same(ref.data_t if cols else None, got.data_t)
            assert same(ref.scale_t if cols else None, got.scale_t)


@pytest.mark.parametrize("shape", [(200, 300), (256, 256)])
@pytest.mark.parametrize("elem", ELEM)
def test_col_tiles_layout(shape, elem):
    # x.T with one scale per 128x128 tile: the same bits as quantize_blockwise on x.T, from the
    # Triton kernel (masked and unmasked shapes) and the PyTorch path alike.
    x = special_input(*shape, seed=5)
    want_t, want_st = quantize_blockwise(x.t().contiguous(), (128, 128), elem)
    want_rows = quantize_operand(x, "1x128", elem, backend="torch", cols=False)
    for backend in ("torch", "triton"):
        got = quantize_operand(x, "1x128", elem, backend=backend, col_tiles=True, col_sum=True)
        assert got.kind_t == "128x128"
        assert same(got.data_t, want_t) and same(got.scale_t, want_st)
        assert same(got.data, want_rows.data) and same(got.scale, want_rows.scale)
        torch.testing.assert_close(
            got.col_sum, x.float().sum(0), rtol=1e-4, atol=1e-3, equal_nan=True
        )
    only_t = quantize_operand(x, "1x128", elem, backend="triton", rows=False, col_tiles=True)
    assert only_t.data is None and same(only_t.data_t, want_t)
    with pytest.raises(ValueError, match="col_tiles"):
        quantize_operand(x, "128x128", col_tiles=True)


def test_values_and_layouts_match_quantize_blockwise():
    x = special_input(finite=True, dtype=torch.float32)
    op = quantize_operand(x, "1x128", backend="triton")
    data, scale = quantize_blockwise(x, (1, 128))
    assert same(op.data, data) and torch.equal(op.scale, scale)
    data_t, scale_t = quantize_blockwise(x.T.contiguous(), (1, 128))
    assert same(op.data_t, data_t) and torch.equal(op.scale_t, scale_t)
    # The layouts torch._scaled_mm wants: 1x128 scales outer-dim-major (stride(0) == 1).
    assert op.scale.stride() == (1, x.shape[0]) and op.scale_t.stride() == (1, x.shape[1])
    tiles = quantize_operand(x, "128x128", backend="triton")
    data, scale = quantize_blockwise(x, (128, 128))
    assert same(tiles.data, data) and torch.equal(tiles.scale, scale)
    assert same(tiles.data_t, data.T.contiguous()) and torch.equal(tiles.scale_t, scale.T)
    back = dequantize_operand(op.data, op.scale, "1x128")
    assert float((back - x).norm() / x.norm()) < 0.05


@pytest.mark.parametrize("shape", [(0, 5), (1, 1), (3, 70), (64, 64), (130, 65)])
def test_fp8_transpose_kernel(shape):
    # The tensorwise kind's x.T: a byte transpose, partial tiles included, both FP8 formats.
    gen = torch.Generator().manual_seed(shape[1])
    for elem in ELEM:
        data = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8).view(elem)
        assert same(blockwise._transpose_fp8(data), data.t().contiguous())


def test_col_sum_in_the_same_pass():
    x = torch.randn(300, 256, dtype=torch.float32)
    for backend in ("triton", "torch"):
        op = quantize_operand(x, "1x128", backend=backend, col_sum=True)
        torch.testing.assert_close(op.col_sum, x.sum(0), rtol=1e-5, atol=1e-4)


def test_scale_exponent_is_the_smallest_that_avoids_saturation():
    # float64 check of the defining property on normal, subnormal and boundary amax values.
    values = [1e-45, 3e-42, 1e-39, 1.1754942e-38, 1e-20, 0.5, 1.0, 1.75, 1.7500001, 3.5, 448.0]
    values += [449.0, 57344.0, 1e30, 3.4e38]
    for max_normal in (448.0, 57344.0):
        amax = torch.tensor(values, dtype=torch.float32)
        exps = _pow2_scale_exponent(amax, max_normal)
        for a, e in zip(amax.tolist(), exps.tolist(), strict=True):
            assert a / 2.0**e <= max_normal
            if e > -120:  # not clamped: one power of two less would saturate
                assert a / 2.0 ** (e - 1) > max_normal, (a, e)
            else:
                assert a / 2.0 ** (e - 1) <= max_normal or math.isclose(e, -120)
    special = torch.tensor([0.0, float("nan"), float("inf")])
    assert _pow2_scale_exponent(special, 448.0).tolist() == [0, 0, 0]


def test_bad_arguments():
    x = torch.randn(8, 128)
    with pytest.raises(ValueError, match="kind must be"):
        quantize_operand(x, "1x32")
    with pytest.raises(TypeError, match="2-D floating point"):
        quantize_operand(torch.randn(8))
    with pytest.raises(ValueError, match="backend must be"):
        quantize_operand(x, backend="cuda")
    with pytest.raises(ValueError, match="stochastic rounding is only available"):
        quantize_operand(x, backend="triton", stochastic_seed=1)
    with pytest.raises(TypeError, match="dtype must be"):
        quantize_operand(x, dtype=torch.float16)


def test_stochastic_rounding_offsets_of_the_two_layouts():
    x = torch.randn(64, 256)
    op = quantize_operand(x, "1x128", stochastic_seed=3, offset=10)
    data, _ = quantize_blockwise(x, (1, 128), stochastic_seed=3, offset=10)
    data_t, _ = quantize_blockwise(
        x.T.contiguous(), (1, 128), stochastic_seed=3, offset=10 + 64 * 256
    )
    assert same(op.data, data) and same(op.data_t, data_t)


@pytest.mark.gpu
@pytest.mark.sm89
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("per_sm", [None, 0.01, 0.1], ids=["default", "one_ahead", "tenth"])
def test_cuda_l2_prefetch_bit_exact(per_sm):
    """The tile kernel's L2 prefetch (bfloat16, whole tiles) on a grid long enough that
    programs prefetch, including tiles of the next column of tiles: the same bits as the
    reference, with the default distances and with short ones (1 and 13 programs ahead on
    132 SMs)."""
    config = None
    if per_sm is not None:
        names = ("prefetch_per_sm", "prefetch_per_sm_col_sum", "prefetch_per_sm_col_tiles")
        config = OperandKernelConfig(**dict.fromkeys(names, per_sm))
    # 77 rows past the whole tiles: the tail launch, whose programs prefetch nothing.
    x = special_input(rows=128 * 300 + 77, cols=384, finite=True)
    for col_sum, col_tiles in ((True, False), (False, False), (False, True)):
        if col_tiles and per_sm is None:
            continue  # no prefetch by default for x with tiles of x.T
        ref = quantize_operand(x, "1x128", backend="torch", col_tiles=col_tiles)
        got = quantize_operand(
            x.cuda(), "1x128", backend="triton", col_sum=col_sum, col_tiles=col_tiles,
            config=config,
        )  # fmt: skip
        for field in FIELDS:
            assert same(getattr(ref, field), getattr(got, field).cpu()), (col_sum, field)
        if col_sum:
            want = x.double().sum(0)
            bound = 1e-6 * x.double().abs().sum(0) + 1e-3
            assert bool(((got.col_sum.cpu().double() - want).abs() <= bound).all())


@pytest.mark.gpu
@pytest.mark.sm89
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float32])
def test_cuda_kernel_bit_exact(in_dtype):
    """The compiled kernels against the torch reference, bit for bit, for bfloat16 and float32
    inputs (a float32 model's layers quantize float32 activations and gradients)."""
    x = special_input(rows=384, cols=512, dtype=in_dtype)
    for kind in KINDS:
        src = torch.nan_to_num(x) if kind == "tensorwise" else x
        ref = quantize_operand(src, kind, backend="torch")
        got = quantize_operand(src.cuda(), kind, backend="triton")
        for field in FIELDS:
            assert same(getattr(ref, field), getattr(got, field).cpu()), (kind, field)
    # The output gradient's kernel: both 1x128 layouts and the bias-gradient column sums.
    finite = torch.nan_to_num(x.float(), nan=0.0, posinf=0.0, neginf=0.0).to(x.dtype)
    # The activation's kernel of the default recipe: rows 1x128 and x.T in 128x128 tiles.
    for elem, col_tiles in itertools.product(ELEM, (False, True)):
        ref = quantize_operand(finite, "1x128", elem, backend="torch", col_tiles=col_tiles)
        got = quantize_operand(
            finite.cuda(), "1x128", elem, backend="triton", col_sum=True, col_tiles=col_tiles
        )
        for field in FIELDS:
            assert same(getattr(ref, field), getattr(got, field).cpu()), (col_tiles, field)
        want = finite.double().sum(0)
        bound = 1e-6 * finite.double().abs().sum(0) + 1e-3
        assert bool(((got.col_sum.cpu().double() - want).abs() <= bound).all())


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("rows,cols", [(37, 256), (301, 336), (640, 512)])
@pytest.mark.parametrize("layouts", ["rows", "both", "col_tiles"])
def test_gemm_padded_layouts(backend, rows, cols, layouts):
    """``gemm_padded`` (what the linear operators quantise activations with for cuBLAS):
    ``data`` (rows to a multiple of 4, columns to a GEMM K) and ``data_t`` (columns to a
    multiple of 512) hold the unpadded layouts' bits, zeros in the pad and unit scales for the
    pad blocks; the pad rows of ``data`` are left unwritten."""
    from gem_precision.blockwise import _quantize_operand

    x = special_input(rows, cols, finite=True)
    t, tiles = layouts != "rows", layouts == "col_tiles"
    args = (x, "1x128", torch.float8_e4m3fn, True, t, None, 0, False, tiles, backend)
    ref = _quantize_operand(*args)
    got = _quantize_operand(*args, gemm_padded=True)
    rq, rt, cq = -(-rows // 4) * 4, -(-rows // 512) * 512, 512
    nc, nr = -(-cols // 128), -(-rows // 128)
    assert got.data.shape == (rq, cq) and got.scale.shape == (rq, cq // 128)
    assert got.scale.stride() == (1, rq)  # outer-dim-major, as _scaled_mm reads it
    assert same(got.data[:rows, :cols], ref.data)
    assert not got.data[:rows, cols:].view(torch.uint8).any()
    assert torch.equal(got.scale[:rows, :nc], ref.scale)
    assert bool((got.scale[:rows, nc:] == 1).all())
    if not t:
        assert got.data_t is None
        return
    assert got.data_t.shape == (cols, rt)
    assert same(got.data_t[:, :rows], ref.data_t)
    assert not got.data_t[:, rows:].view(torch.uint8).any()
    assert torch.equal(got.scale_t[:, :nr], ref.scale_t)
    assert bool((got.scale_t[:, nr:] == 1).all())
    if tiles:
        assert got.scale_t.shape == (nc, rt // 128) and got.scale_t.is_contiguous()
    else:
        assert got.scale_t.shape == (cols, rt // 128) and got.scale_t.stride() == (1, cols)
