"""GEMM backend dispatch and the native Hopper / Blackwell code paths of Fp8Linear, run on the
CPU against a stand-in ``torch._scaled_mm`` that checks the layouts torch demands and computes
the scaled product exactly."""

from __future__ import annotations

import copy

import pytest
import torch
from gem_precision import Fp8Linear, Fp8Recipe, dequantize_mx, quantize_mx
from gem_precision import linear as linear_mod
from gem_precision.scaled_gemm import (
    backend_for_capability,
    gemm_backend,
    mx_scaled_mm_nt,
    swizzle_mx_scales,
    unswizzle_mx_scales,
)


def test_backend_for_capability():
    assert backend_for_capability("cpu", None) == "emulated"
    assert backend_for_capability("cuda", (9, 0)) == "sm90"
    assert backend_for_capability("cuda", (10, 0)) == "sm100"
    assert backend_for_capability("cuda", (8, 9)) == "emulated"
    assert backend_for_capability("cuda", (12, 0)) == "emulated"
    assert gemm_backend("cpu") == "emulated"


def test_recipe_paths_per_backend(monkeypatch):
    cpu = torch.device("cpu")
    for backend, recipe, expected in [
        ("sm90", Fp8Recipe(), ("blockwise", True)),
        ("sm90", Fp8Recipe(tensorwise=True), ("blockwise", True)),
        ("sm90", Fp8Recipe(scaling="mx"), ("mx", False)),
        ("sm100", Fp8Recipe(), ("mx", True)),
        ("sm100", Fp8Recipe(scaling="blockwise"), ("blockwise", True)),
        ("sm100", Fp8Recipe(tensorwise=True), ("blockwise", True)),
        ("emulated", Fp8Recipe(), ("blockwise", False)),
        ("sm90", Fp8Recipe(hadamard=True), ("hadamard", True)),
        ("emulated", Fp8Recipe(hadamard=True), ("hadamard", False)),
    ]:
        monkeypatch.setattr(linear_mod, "gemm_backend", lambda device, b=backend: b)
        assert linear_mod._path(recipe, cpu) == expected, (backend, recipe)


def test_swizzle_layout_and_round_trip():
    rows, cols = 200, 6  # padded to 256 x 8: two row tiles, two column tiles
    scale = torch.randint(0, 255, (rows, cols), dtype=torch.uint8)
    swz = swizzle_mx_scales(scale)
    assert swz.dtype == torch.float8_e8m0fnu and swz.numel() == 256 * 8
    flat = swz.view(torch.uint8)
    for r, c in [(0, 0), (31, 3), (32, 0), (127, 2), (128, 5), (199, 4)]:
        tile = (r // 128) * 2 + c // 4  # tiles of 128x4, row of tiles by row of tiles
        rr, cc = r % 128, c % 4
        assert flat[tile * 512 + (rr % 32) * 16 + (rr // 32) * 4 + cc] == scale[r, c]
    assert torch.equal(unswizzle_mx_scales(swz, rows, cols), scale)


def _expand_1x128(scale, rows, cols):
    return scale.repeat_interleave(128, 1)[:rows, :cols]


def _dequant_a(data, scale):
    m, k = data.shape
    if scale.numel() == 1:
        return data.float() * scale.float()
    assert scale.shape == (m, -(-k // 128)), "scale_a must be (M, ceil(K/128))"
    assert m == 1 or scale.stride(0) == 1, "1x128 scale_a must be outer-dim-major"
    return data.float() * _expand_1x128(scale, m, k)


def _dequant_b(b, scale_b):
    bt = b.t()  # (N, K) row-major view
    n, k = bt.shape
    if scale_b.numel() == 1:
        return bt.float() * scale_b.float()
    st = scale_b.t()
    if st.shape == (n, -(-k // 128)):  # 1x128 along K
        assert n == 1 or st.stride(0) == 1, "1x128 scale_b.t() must be outer-dim-major"
        return bt.float() * _expand_1x128(st, n, k)
    assert st.shape == (-(-n // 128), -(-k // 128)), "128x128 scale_b.t() shape"
    assert st.is_contiguous(), "128x128 scale_b.t() must be contiguous"
    full = st.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
    return bt.float() * full


class FakeScaledMM:
    """Stand-in for ``torch._scaled_mm`` (Hopper semantics): checks layouts, exact product."""

    def __init__(self):
        self.calls = []

    def __call__(self, a, b, scale_a, scale_b, bias=None, out_dtype=None, **_):
        assert a.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) and b.dtype == a.dtype
        assert a.stride(1) == 1, "a must be row-major"
        assert b.stride(0) == 1, "b must be column-major"
        assert a.shape[1] % 16 == 0 and b.shape[1] % 16 == 0, "K and N must divide by 16"
        if scale_a.dtype == torch.float8_e8m0fnu:
            return self.mx(a, b, scale_a, scale_b, out_dtype)
        if scale_a.numel() > 1 or scale_b.numel() > 1:
            # cuBLAS reads block scales with the K-block count rounded up to a multiple of 4
            # (garbage on the H200 otherwise): scaled_mm_nt must pad K.
            assert (-(-a.shape[1] // 128)) % 4 == 0, "block-scaled K/128 must be a multiple of 4"
        if scale_a.numel() > 1:
            # The H200's cuBLAS rejects 1x128 scale_a unless M is a multiple of 4.
            assert a.shape[0] % 4 == 0, "1x128-scaled M must be a multiple of 4"
        self.calls.append((tuple(scale_a.shape), tuple(scale_b.shape)))
        out = _dequant_a(a, scale_a) @ _dequant_b(b, scale_b).T
        if bias is not None:
            out = out + bias.float()
        return out.to(out_dtype)

    def mx(self, a, b, scale_a, scale_b, out_dtype):
        m, k = a.shape
        n = b.shape[1]
        assert scale_a.numel() == -(-m // 128) * 128 * -(-(k // 32) // 4) * 4
        sa = unswizzle_mx_scales(scale_a, m, k // 32)
        sb = unswizzle_mx_scales(scale_b, n, k // 32)
        self.calls.append(("mx", (m, k), (n, k)))

        def deq(data, s):
            exp = s.to(torch.int32).repeat_interleave(32, 1) - 127
            return data.float() * torch.exp2(exp.double()).float()

        return (deq(a, sa) @ deq(b.t(), sb).T).to(out_dtype)


@pytest.fixture
def fake_native(monkeypatch):
    fake = FakeScaledMM()
    monkeypatch.setattr(torch, "_scaled_mm", fake)
    return fake


def _run(layer, x, grad):
    x = x.clone().requires_grad_(True)
    out = layer(x)
    out.backward(grad)
    return out.detach(), x.grad, layer.weight.grad, layer.bias.grad


@pytest.mark.parametrize(
    "tensorwise,x_tiles", [(False, True), (False, False), (True, True)], ids=str
)
def test_sm90_native_path_matches_emulation(monkeypatch, fake_native, tensorwise, x_tiles):
    torch.manual_seed(0)
    recipe = Fp8Recipe(tensorwise=tensorwise, wgrad_x_tiles=x_tiles)
    emulated = Fp8Linear(256, 384, recipe=recipe)
    native = Fp8Linear(256, 384, recipe=recipe)
    native.load_state_dict(emulated.state_dict())
    x, grad = torch.randn(160, 256), torch.randn(160, 384)
    want = _run(emulated, x, grad)
    monkeypatch.setattr(linear_mod, "gemm_backend", lambda device: "sm90")
    got = _run(native, x, grad)
    assert len(fake_native.calls) == 3  # forward, dgrad, wgrad all went to _scaled_mm
    if not tensorwise:  # K padded to 4 blocks of 128 (K = 256, 384 and 160 tokens here)
        assert fake_native.calls[0] == ((160, 4), (4, 3))  # 1x128 x 128x128
        assert fake_native.calls[1] == ((160, 4), (4, 2))  # dgrad: 1x128 x 128x128
        if x_tiles:  # dy.T 1x128 along tokens x x.T in 128x128 tiles
            assert fake_native.calls[2] == ((384, 4), (4, 2))
        else:  # 1x128 x 1x128 along tokens
            assert fake_native.calls[2] == ((384, 4), (4, 256))
    for g, w in zip(got, want, strict=True):
        # native results come back in bf16: equal up to its rounding
        assert float((g.float() - w).norm() / w.norm()) < 4e-3


@pytest.mark.parametrize("tokens", [100, 301, 1000, 1002])
def test_sm90_any_token_count_runs_all_three_gemms_natively(monkeypatch, fake_native, tokens):
    """The wgrad GEMM's K is the token count: 100 (one partial block) and 1000 (8 blocks, not
    a multiple of 16) are padded; so is the M of forward and dgrad when it is not a multiple
    of 4 (301, 1002). No GEMM falls back to the emulation."""
    torch.manual_seed(4)
    emulated = Fp8Linear(256, 384)
    native = Fp8Linear(256, 384)
    native.load_state_dict(emulated.state_dict())
    x, grad = torch.randn(tokens, 256), torch.randn(tokens, 384)
    want = _run(emulated, x, grad)
    monkeypatch.setattr(linear_mod, "gemm_backend", lambda device: "sm90")
    got = _run(native, x, grad)
    assert len(fake_native.calls) == 3
    for g, w in zip(got, want, strict=True):
        assert float((g.float() - w).norm() / w.norm()) < 4e-3


@pytest.mark.parametrize("tokens", [301, 1000])
@pytest.mark.parametrize(
    "fused_norm,features",
    [(False, (512, 1024)), (False, (336, 688)), (True, (512, 1024)), (True, (384, 688))],
    ids=["linear", "linear_ragged", "norm_linear", "norm_linear_ragged"],
)
def test_sm90_activations_are_quantised_into_the_gemm_layouts(
    monkeypatch, fake_native, fused_norm, features, tokens
):
    """The activation operands (x, normed x, dy, and their transposes along the tokens) are
    written by the quantise kernels with the rows and columns cuBLAS takes (M a multiple of 4,
    K of 4 blocks of 128: the wgrad's token count, and 336 / 384 / 688 features), so no GEMM copies
    one to pad it; only a weight whose K needs it is copied. The results equal the
    emulation's."""
    from gem_precision import Fp8NormLinear
    from gem_precision import scaled_gemm as gemm_mod

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the fused norm's kernels
    torch.manual_seed(5)
    n_in, n_out = features
    emulated = Fp8NormLinear(n_in, n_out, norm="layer") if fused_norm else Fp8Linear(n_in, n_out)
    native = copy.deepcopy(emulated)
    x, grad = torch.randn(tokens, n_in), torch.randn(tokens, n_out)

    def run(layer):
        xi = x.clone().requires_grad_(True)
        layer(xi).backward(grad)
        return [xi.grad] + [p.grad for p in layer.parameters()]

    want = run(emulated)
    pads = []
    pad_data = gemm_mod._pad_data
    monkeypatch.setattr(
        gemm_mod,
        "_pad_data",
        lambda data, *shape: pads.append(data.shape) or pad_data(data, *shape),
    )
    monkeypatch.setattr(linear_mod, "gemm_backend", lambda device: "sm90")
    got = run(native)
    assert native._fused(x)[0] if fused_norm else True
    assert len(fake_native.calls) == 3
    assert all(shape in ((n_out, n_in), (n_in, n_out)) for shape in pads), pads  # weights only
    for g, w in zip(got, want, strict=True):
        assert float((g.float() - w).norm() / w.norm()) < 4e-3


@pytest.mark.parametrize(
    "recipe",
    [
        Fp8Recipe(hadamard=True),
        Fp8Recipe(hadamard=True, hadamard_block_size=16, stochastic_rounding_grads=True),
        Fp8Recipe(hadamard=True, wgrad_x_tiles=False),
        Fp8Recipe(hadamard=True, tensorwise=True),
    ],
    ids=["rht", "rht16_sr", "rht_x_rows", "rht_tensorwise"],
)
def test_sm90_hadamard_runs_natively_with_the_emulated_numerics(monkeypatch, fake_native, recipe):
    """With RHT each GEMM's operands are rotated along its reduction dim, then quantised and
    multiplied natively: the same quantised values as the emulated path (K = 208 and 150
    tokens are padded to the Hadamard block and to 4 blocks of 128)."""
    torch.manual_seed(6)
    emulated = Fp8Linear(208, 96, recipe=recipe)
    native = Fp8Linear(208, 96, recipe=recipe)
    native.load_state_dict(emulated.state_dict())
    x, grad = torch.randn(150, 208), torch.randn(150, 96)
    x[:, 7] *= 50  # an outlier channel, what the rotation is for
    want = _run(emulated, x, grad)
    monkeypatch.setattr(linear_mod, "gemm_backend", lambda device: "sm90")
    got = _run(native, x, grad)
    assert len(fake_native.calls) == 3  # forward, dgrad and wgrad on _scaled_mm
    for g, w in zip(got, want, strict=True):
        assert float((g.float() - w).norm() / w.norm()) < 4e-3  # the native result is bf16


def test_sm90_wgrad_in_bf16_and_unsupported_shape_fallback(monkeypatch, fake_native):
    torch.manual_seed(1)
    monkeypatch.setattr(linear_mod, "gemm_backend", lambda device: "sm90")
    layer = Fp8Linear(128, 128, recipe=Fp8Recipe(wgrad_in_bf16=True))
    x, grad = torch.randn(64, 128), torch.randn(64, 128)
    out, gx, gw, gb = _run(layer, x, grad)
    assert len(fake_native.calls) == 2  # no FP8 wgrad
    want = grad.bfloat16().float().T @ x.bfloat16().float()
    assert float((gw.float() - want).norm() / want.norm()) < 4e-3  # a bf16 GEMM
    torch.testing.assert_close(gb, grad.sum(0))
    # K=100: block-scaled operands are padded to 4 blocks of 128 along K, so it runs natively.
    calls = len(fake_native.calls)
    Fp8Linear(100, 128)(torch.randn(64, 100))
    assert len(fake_native.calls) == calls + 1
    # N=100 is not a multiple of 16: _scaled_mm is not called, the emulation is, with a warning.
    with pytest.warns(RuntimeWarning, match="not a multiple of 16"):
        Fp8Linear(128, 100)(torch.randn(64, 128))
    assert len(fake_native.calls) == calls + 1


def test_sm100_mxfp8_path_matches_independent_emulation(monkeypatch, fake_native):
    torch.manual_seed(2)
    monkeypatch.setattr(linear_mod, "gemm_backend", lambda device: "sm100")
    layer = Fp8Linear(256, 128)
    x, grad = torch.randn(96, 256), torch.randn(96, 128)
    out, gx, gw, gb = _run(layer, x, grad)
    assert [c[0] for c in fake_native.calls] == ["mx", "mx", "mx"]

    def mx(t, square=False):
        q = quantize_mx(t.contiguous(), scale_rounding="ceil", square=square)
        return dequantize_mx(q, torch.float32)

    w = layer.weight.detach()
    w_q = mx(w, square=True)  # 32x32 squares: the same values serve W and W.T
    want_out = mx(x) @ w_q.T + layer.bias.detach()
    want_gx = mx(grad) @ w_q
    want_gw = mx(grad.T) @ mx(x.T).T
    for g, w_ in ((out, want_out), (gx, want_gx), (gw, want_gw)):
        assert float((g.float() - w_).norm() / w_.norm()) < 4e-3
    torch.testing.assert_close(gb, grad.sum(0))


def test_mx_recipe_on_cpu_is_the_same_numerics_emulated():
    torch.manual_seed(3)
    layer = Fp8Linear(128, 64, recipe=Fp8Recipe(scaling="mx", mx_scale_rounding="floor"))
    x = torch.randn(32, 128)
    q = lambda t, sq=False: dequantize_mx(quantize_mx(t, square=sq), torch.float32)  # noqa: E731
    # A float32 layer's GEMM writes float32, like a native one: no rounding of the result.
    want = q(x) @ q(layer.weight.detach(), True).T + layer.bias.detach()
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)


def test_mx_scaled_mm_rejects_other_block_sizes():
    a = quantize_mx(torch.randn(4, 64), block_size=16)
    with pytest.raises(ValueError, match="block_size=32"):
        mx_scaled_mm_nt(a, a)


def test_recipe_validation():
    with pytest.raises(ValueError, match="scaling must be"):
        Fp8Recipe(scaling="nvfp4")
    with pytest.raises(ValueError, match="mx_scale_rounding"):
        Fp8Recipe(mx_scale_rounding="up")


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "m,k,n", [(256, 256, 512), (208, 384, 320), (128, 640, 256), (512, 512, 384)]
)
def test_cuda_native_gemms_match_emulation(m, k, n):
    """The three GEMMs of a linear layer through torch._scaled_mm against the emulation, on
    shapes whose K is not a multiple of 4 blocks of 128 (padded) and ragged M / N."""
    from gem_precision.blockwise import quantize_operand
    from gem_precision.scaled_gemm import scaled_mm_nt

    if gemm_backend("cuda") != "sm90":
        pytest.skip("needs Hopper")
    gen = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(m, k, generator=gen, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, generator=gen, device="cuda", dtype=torch.bfloat16) * 0.05
    dy = torch.randn(m, n, generator=gen, device="cuda", dtype=torch.bfloat16)
    xq = quantize_operand(x, "1x128", col_tiles=True)
    xq_rows = quantize_operand(x, "1x128")
    wq = quantize_operand(w, "128x128")
    gq = quantize_operand(dy, "1x128")
    for name, args in (
        ("fwd", (xq.data, xq.scale, "1x128", wq.data, wq.scale, "128x128")),
        ("dgrad", (gq.data, gq.scale, "1x128", wq.data_t, wq.scale_t, "128x128")),
        ("wgrad_tiles", (gq.data_t, gq.scale_t, "1x128", xq.data_t, xq.scale_t, "128x128")),
        ("wgrad_1x128", (gq.data_t, gq.scale_t, "1x128", xq_rows.data_t, xq_rows.scale_t, "1x128")),
    ):
        want = scaled_mm_nt(*args, out_dtype=torch.float32, native=False)
        got = scaled_mm_nt(*args, out_dtype=torch.bfloat16, native=True).float()
        err = float((got - want).norm() / want.norm())
        assert err < 1e-2, (name, err)


def test_padding_for_native_block_scaled_gemms_keeps_the_product():
    """The zero rows / columns and unit scales added for cuBLAS change nothing: the emulated
    product of the padded operands equals the unpadded one (up to summation order) in its
    first M rows and is zero in the padded ones."""
    from gem_precision.blockwise import dequantize_operand, quantize_operand
    from gem_precision.scaled_gemm import _pad_for_block_scales

    gen = torch.Generator().manual_seed(3)
    m, k, n = 301, 300, 144  # ragged M, K of 3 partial-ish blocks (padded to 4)
    a = quantize_operand(torch.randn(m, k, generator=gen), "1x128", cols=False, backend="torch")
    b = quantize_operand(torch.randn(n, k, generator=gen), "128x128", backend="torch")
    want = (
        dequantize_operand(a.data, a.scale, "1x128")
        @ dequantize_operand(b.data, b.scale, "128x128").T
    )
    a_data, a_scale, b_data, b_scale = _pad_for_block_scales(
        a.data, a.scale, "1x128", b.data, b.scale, "128x128"
    )
    assert a_data.shape == (304, 512) and b_data.shape == (n, 512)  # M to a multiple of 4
    assert a_scale.shape == (304, 4) and a_scale.stride() == (1, 304)  # outer-dim-major kept
    assert b_scale.shape == (2, 4) and b_scale.is_contiguous()
    got = (
        dequantize_operand(a_data, a_scale, "1x128")
        @ dequantize_operand(b_data, b_scale, "128x128").T
    )
    torch.testing.assert_close(got[:m], want, rtol=1e-6, atol=1e-5)
    assert not got[m:].any()


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", [301, 1000, 4099])
def test_cuda_ragged_rows_match_emulation(m, monkeypatch):
    """Token counts that are not multiples of 4 or 16 (any batch of jagged histories): the
    forward, dgrad and wgrad (whose K is the token count) run natively and match the
    emulation."""
    if gemm_backend("cuda") != "sm90":
        pytest.skip("needs Hopper")
    calls = []
    native = torch._scaled_mm

    def counted(*args, **kwargs):
        out = native(*args, **kwargs)  # a rejected call raises and is not counted
        calls.append(args[0].shape)
        return out

    monkeypatch.setattr(torch, "_scaled_mm", counted)
    torch.manual_seed(5)
    layer = torch.nn.Linear(256, 384)
    x = torch.randn(m, 256)
    x[: m // 5] = 0  # all-zero blocks
    dy = torch.randn(m, 384)
    results = []
    for device in ("cpu", "cuda"):
        fp8 = Fp8Linear.from_linear(torch.nn.Linear(256, 384), recipe=Fp8Recipe()).to(device)
        with torch.no_grad():
            fp8.weight.copy_(layer.weight)
            fp8.bias.copy_(layer.bias)
        xi = x.clone().to(device).requires_grad_(True)
        y = fp8(xi)
        y.backward(dy.to(device))
        results.append([t.detach().float().cpu() for t in (y, xi.grad, fp8.weight.grad)])
    assert len(calls) >= 3, "forward, dgrad and wgrad must run natively"
    for name, cpu, gpu in zip(("y", "dx", "dw"), *results, strict=True):
        err = float((gpu - cpu).norm() / cpu.norm())
        assert err < 2e-2, (name, m, err)


def test_bias_epilogue_refusal_is_remembered_per_output_dtype(monkeypatch, fake_native):
    """A refused bias epilogue for float32 outputs falls back to a separate add, and later
    bfloat16 GEMMs of the same scaling still get the bias fused (it was keyed by scaling only,
    which cost bfloat16 layers a pass over their output after any float32 layer ran)."""
    from gem_precision import scaled_gemm
    from gem_precision.blockwise import quantize_operand

    monkeypatch.setattr(scaled_gemm, "_NO_BIAS_EPILOGUE", set())
    with_bias = []

    def refuse_float32_bias(a, b, scale_a, scale_b, bias=None, out_dtype=None, **kw):
        with_bias.append((out_dtype, bias is not None))
        if bias is not None and out_dtype == torch.float32:
            raise RuntimeError("bias is not supported with float32 output")  # as cuBLAS may
        return fake_native(a, b, scale_a, scale_b, bias=bias, out_dtype=out_dtype, **kw)

    monkeypatch.setattr(torch, "_scaled_mm", refuse_float32_bias)
    torch.manual_seed(7)
    x, w = torch.randn(64, 512), torch.randn(256, 512)
    xq, wq = quantize_operand(x, "1x128"), quantize_operand(w, "128x128")
    args = (xq.data, xq.scale, "1x128", wq.data, wq.scale, "128x128")
    want = scaled_gemm.scaled_mm_nt(*args, out_dtype=torch.float32)  # the emulation
    for dtype in (torch.float32, torch.bfloat16, torch.float32):
        bias = torch.randn(256).to(dtype)
        got = scaled_gemm.scaled_mm_nt(*args, out_dtype=dtype, native=True, bias=bias)
        expect = want + bias.float()
        assert float((got.float() - expect).norm() / expect.norm()) < 4e-3
    assert with_bias == [
        (torch.float32, True),  # refused ...
        (torch.float32, False),  # ... so the bias is added after the GEMM
        (torch.bfloat16, True),  # bfloat16 keeps its fused bias
        (torch.float32, False),  # the float32 refusal is remembered
    ]
