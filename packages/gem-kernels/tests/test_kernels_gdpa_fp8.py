"""``gdpa(..., precision="fp8")``: the FP8 emulation and the FP8 Triton kernels.

As in ``test_kernels_jfa_fp8.py``: errors are measured against the naive float64 oracle on the
same bfloat16 inputs, as the relative Frobenius norm of the difference, per output and per
gradient, and FP8 mode is bounded by a ratio to the bf16 path's error on the same call (the
PyTorch reference for the emulation, the bf16 Triton kernels for the FP8 kernels). The bounds
are about 1.5x the largest ratio measured on these shapes (docs/kernel-tuning.md).

A = act(scale * Q K^T) goes to E4M3 with a power-of-two scale per query row and
``reference.FP8_ACT_TILE`` keys (A V), per key and as many queries (dV = A^T dO), from the
tile's maximum; FP8 calls fix the kernels' tile along those reductions at that size, so the
kernels and the emulation round the same values and on float16 inputs agree to float32
summation order whatever the other tiles of the config.

The kernels run under the Triton interpreter with 16-row tiles (lengths 0, 1, 17, 40 cross tile
edges; 130 crosses a 128-token quantisation block).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from fp8_checks import check_fp8_against_bf16, check_ratios, rel_errors, run_with_grads
from gem_kernels import gdpa, gdpa_triton, reference
from gem_kernels.gdpa_triton import GdpaTritonConfig, backward_from_lengths, forward_from_lengths
from kernels_naive import naive_gdpa, offsets_of

H, D = 2, 16
SELF = [0, 1, 17, 40]
CROSS_Q = [0, 3, 9, 40, 6]
CROSS_K = [3, 0, 17, 20, 33]  # Lk = 0 with Lq > 0; Lq > Lk: causal rows that see no key
PMA_Q = 5
PMA_K = [0, 1, 17, 40]
GRADS = ("q", "k", "v")

# name -> (q lengths (None: PMA with PMA_Q shared queries), k lengths or None, options)
CASES = {
    "self_causal_silu": (SELF, None, {"causal": True, "activation": "silu"}),
    "self_identity": (SELF, None, {"activation": "identity"}),
    "cross_window_relu2": (CROSS_Q, CROSS_K, {"window": (6, 2), "activation": "relu2"}),
    "cross_causal_gelu_fast": (CROSS_Q, CROSS_K, {"causal": True, "activation": "gelu_fast"}),
    "pma_normalized_gelu": (None, PMA_K, {"normalize_by_length": True, "activation": "gelu"}),
    "pma_window_gelu_tanh": (None, PMA_K, {"window": (2, 1), "activation": "gelu_tanh"}),
}

#: Largest FP8 / bf16 error ratio allowed, per output and gradient (measured maxima in the
#: comments; see docs/kernel-tuning.md).
#: Against the reference's bf16 path (float32 math, only the output rounded): measured up to
#: 39.9 / 1.9 / 2.0 / 1.5 (out, dq, dk, dv: the backward is the bf16 one, and GDPA's has no
#: forward statistic to inherit the FP8 rounding from).
EMULATION_RATIO = {"out": 60.0, "q": 3.0, "k": 3.0, "v": 3.0}
#: Against the bf16 kernels (A and dS rounded to bf16, under the interpreter truncated):
#: measured up to 9.8 / 1.0 / 1.0 / 1.0.
KERNEL_RATIO = {"out": 15.0, "q": 1.5, "k": 1.5, "v": 1.5}


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _inputs(q_lengths, k_lengths, *, seed, dtype=torch.bfloat16, heads=H, dim=D, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    k_lengths = k_lengths or q_lengths
    rows = PMA_Q if q_lengths is None else sum(q_lengths)
    out_rows = PMA_Q * len(k_lengths) if q_lengths is None else rows
    tensors = {
        "q": torch.randn(rows, heads, dim, generator=gen),
        "k": torch.randn(sum(k_lengths), heads, dim, generator=gen),
        "v": torch.randn(sum(k_lengths), heads, dim, generator=gen),
    }
    grad_out = torch.randn(out_rows, heads, dim, generator=gen).to(device, dtype)
    return {n: t.to(device, dtype) for n, t in tensors.items()}, grad_out


def _oracle(q_lengths, k_lengths, options, tensors, grad_out):
    k_lengths = k_lengths or q_lengths
    pma = q_lengths is None
    q_rows = [PMA_Q] * len(k_lengths) if pma else q_lengths
    scale = tensors["q"].shape[-1] ** -0.5

    def fn(q, k, v):
        return naive_gdpa(q, k, v, q_rows, k_lengths, scale=scale, broadcast=pma, **options)

    return run_with_grads(fn, {n: t.double() for n, t in tensors.items()}, grad_out.double())


def _offsets(q_lengths, k_lengths, device="cpu"):
    return (
        None if q_lengths is None else offsets_of(q_lengths).to(device),
        None if k_lengths is None else offsets_of(k_lengths).to(device),
    )


def _public(q_lengths, k_lengths, options, **call):
    def fn(q, k, v):
        return gdpa(q, k, v, *_offsets(q_lengths, k_lengths, q.device), **options, **call)

    return fn


def _lengths(q_lengths, k_lengths):
    return (
        None if q_lengths is None else torch.tensor(q_lengths),
        None if k_lengths is None else torch.tensor(k_lengths),
    )


# ---------------------------------------------------------------------------------------------
# Argument checks.


def test_precision_is_validated():
    q = torch.randn(5, H, D, dtype=torch.bfloat16)
    offsets = offsets_of([2, 3])
    with pytest.raises(ValueError, match="precision must be one of"):
        gdpa(q, q, q, offsets, precision="fp16")
    with pytest.raises(ValueError, match=r"precision='fp8' takes float16/bfloat16"):
        gdpa(q.float(), q.float(), q.float(), offsets, precision="fp8")
    with pytest.raises(ValueError, match="precision must be one of"):  # the operator itself
        torch.ops.gem_kernels.gdpa(
            q, q, q, offsets, None, None, None, "silu", 0.25, False, None, None, False, "auto",
            "e5",
        )  # fmt: skip


def test_fp8_config_tiles_must_fit_a_quantisation_block(interpret):
    q = torch.randn(5, H, D, dtype=torch.float16)
    config = GdpaTritonConfig(fwd_block_m=256)
    with pytest.raises(ValueError, match="fwd_block_m=256 is larger than the FP8"):
        forward_from_lengths(q, q, q, torch.tensor([5]), config=config, precision="fp8")


def test_fp8_runs_the_phased_loop_of_a_warp_specialized_config(interpret):
    """The warp-specialised loop's stage limit binds where that loop runs: an FP8 call of such
    a config runs the phased loop and takes any depth (bf16 is refused, test_kernels_gdpa_triton)."""
    q = torch.randn(5, H, D, dtype=torch.bfloat16)
    ws3 = GdpaTritonConfig(fwd_loop="warp_specialized", fwd_stages=3)
    out = forward_from_lengths(q, q, q, torch.tensor([5]), config=ws3, precision="fp8")
    want = forward_from_lengths(
        q, q, q, torch.tensor([5]), config=GdpaTritonConfig(), precision="fp8"
    )
    torch.testing.assert_close(out, want, rtol=0, atol=0)


def test_triton_backend_rejects_fp8_of_float32(interpret):
    reason = gdpa_triton.triton_unsupported_reason(torch.zeros(1, 1, 16), precision="fp8")
    assert "float16/bfloat16" in reason


def test_fp8_runs_only_the_converted_kernels():
    """Forward variants without an FP8 mode (one loop, pipelined, warp-specialised, short-KV
    and streamed PMA forwards, gelu packing) are switched off, the tiles along A V's reduction
    are FP8_ACT_TILE, and the (bf16) backward keeps the config's loop and tiles."""
    config = gdpa_triton.GDPA_CONFIGS["d128_long"].config
    fp8 = gdpa_triton._fp8_config(config, False)
    assert (fp8.fwd_loop, fp8.short_kv_max, fp8.pma_stream, fp8.packed_gelu) == (
        "phased", 0, False, False,
    )  # fmt: skip
    tile = reference.FP8_ACT_TILE
    assert (fp8.fwd_block_n, fp8.pma_block_n) == (tile, tile)
    assert fp8.fwd_block_m == config.fwd_block_m
    assert (fp8.bwd_loop, fp8.dkdv_block_m, fp8.dkdv_block_n) == (
        config.bwd_loop, config.dkdv_block_m, config.dkdv_block_n,
    )  # fmt: skip
    assert (fp8.fwd_stages, fp8.fwd_programs_per_sm) == (
        config.fwd_stages, config.fwd_programs_per_sm,
    )  # fmt: skip
    # A default config's launch was tuned for its own loop (d128_short: warp-specialised, one
    # program per SM); the phased FP8 loop takes its own count of programs per SM.
    short = gdpa_triton.GDPA_CONFIGS["d128_short"].config
    tuned = gdpa_triton._fp8_config(gdpa_triton._fp8_default(short), False)
    assert (tuned.fwd_loop, tuned.fwd_programs_per_sm) == (
        "phased", gdpa_triton._FP8_FWD_PROGRAMS_PER_SM,
    )  # fmt: skip
    assert tuned.fwd_programs_per_sm != short.fwd_programs_per_sm
    # PMA: the query tile is Nq padded up to FP8_ACT_TILE, at least 32 rows compiled.
    pma = gdpa_triton._fp8_config(gdpa_triton.GDPA_CONFIGS["d128_masked"].config, True)
    assert gdpa_triton._pma_block_m(5, pma, True) == 32
    assert gdpa_triton._pma_block_m(5, pma, False) == 16
    assert gdpa_triton._pma_block_m(300, pma, True) == tile


# ---------------------------------------------------------------------------------------------
# A's quantisation.


def test_act_scale_is_the_power_of_two_below_the_maximum():
    amax = torch.tensor([0.0, 1e-45, 1e-40, 2.0**-120, 1.0, 1.5, 255.9, 256.0, 3e38])
    scale = reference._pow2_floor_scale(amax)
    exponent = torch.log2(scale.double())
    assert torch.equal(exponent, exponent.round())
    normal = amax >= 2.0**-119
    ratio = amax[normal] / scale[normal]
    assert torch.all((ratio >= 128) & (ratio < 256))
    assert torch.all(scale[~normal] == 2.0**-126)  # zero and tiny rows: any scale is exact
    assert scale[-1] == 2.0**120


@pytest.mark.parametrize("activation", ["relu2", "silu"])
def test_act_scaled_per_row_and_tile_never_overflows(activation):
    """A from a large token (x64: relu2's A grows 4096x) through E4M3: finite, and each entry
    within E4M3's relative rounding of its exact value or below the tile's subnormal range."""
    gen = torch.Generator().manual_seed(12)
    q, k = torch.randn(70, 1, D, generator=gen), torch.randn(150, 1, D, generator=gen)
    k[3] *= 64.0
    s = torch.einsum("ihd,jhd->hij", q, k) * D**-0.5
    a = reference.gdpa_act_and_grad(s, activation)[0]
    a8 = reference._quantize_act(a)
    assert torch.isfinite(a8).all()
    tile_max = F.pad(a.abs(), (0, 42)).unflatten(-1, (3, 64)).amax(-1)
    floor = tile_max.repeat_interleave(64, -1)[..., :150] * 2.0**-15
    assert torch.all((a8 - a).abs() <= torch.maximum(a.abs() * 2.0**-4, floor))


def test_dynamic_act_scale_beats_a_row_bound_on_outliers():
    """The measured reason for per-tile scales (docs/kernel-tuning.md): with relu2, causal, and
    one query and one key token 128x larger, a per-row scale from the Cauchy-Schwarz bound
    (|s_ij| <= scale |q_i| max_j |k_j|, squared) is far above the rows' real maxima where the
    large key is masked or orthogonal, and leaves their A in E4M3's subnormals; the tile
    maximum does not (A V error measured 0.29-0.92x the bound's over seeds 0-3, 0.29 here)."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(512, 64, generator=gen).bfloat16().double() for _ in range(3))
    k[7] *= 128.0
    q[3] *= 128.0
    hidden = torch.ones(512, 512, dtype=torch.bool).triu(1)
    a = torch.relu(q @ k.T * 64**-0.5).square().masked_fill(hidden, 0.0)
    exact = a @ v
    bound = (64**-0.5 * q.norm(dim=1) * k.norm(dim=1).max()).square()
    row_scale = reference._pow2_scale(bound.float()).double()[:, None]
    by_bound = (a / row_scale).float().to(torch.float8_e4m3fn).double() * row_scale
    dynamic = reference._quantize_act(a.float()).double()

    def error(a8):
        return ((a8 @ v - exact).norm() / exact.norm()).item()

    assert error(dynamic) < 0.5 * error(by_bound)


def test_act_and_grad_match_the_activations():
    s = torch.linspace(-6.0, 6.0, 2001, dtype=torch.float64)
    for name, act in reference.GDPA_ACTIVATIONS.items():
        leaf = s.clone().requires_grad_(True)
        act(leaf).sum().backward()
        a, g = reference.gdpa_act_and_grad(s, name)
        torch.testing.assert_close(a, act(s), msg=name)
        torch.testing.assert_close(g, leaf.grad, rtol=1e-6, atol=1e-6, msg=name)


# ---------------------------------------------------------------------------------------------
# The emulation (reference backend) against the float64 oracle.


@pytest.mark.parametrize("case", CASES)
def test_emulation_error_ratio_to_bf16(case):
    q_lengths, k_lengths, options = CASES[case]
    tensors, grad_out = _inputs(q_lengths, k_lengths, seed=1)
    oracle = _oracle(q_lengths, k_lengths, options, tensors, grad_out)
    public = functools.partial(_public, q_lengths, k_lengths, options)
    check_fp8_against_bf16(public, tensors, grad_out, oracle, EMULATION_RATIO, case,
                           backend="reference")  # fmt: skip


def test_emulation_long_sample_crosses_quantisation_blocks():
    lengths, options = [300, 1, 0, 129], {"causal": True, "activation": "relu2"}
    tensors, grad_out = _inputs(lengths, None, seed=2)
    oracle = _oracle(lengths, None, options, tensors, grad_out)
    public = functools.partial(_public, lengths, None, options)
    check_fp8_against_bf16(public, tensors, grad_out, oracle, EMULATION_RATIO, "long",
                           backend="reference")  # fmt: skip


def test_emulation_rows_without_keys_are_zero():
    q_lengths, k_lengths = [4, 5, 2], [0, 2, 2]  # sample 0 has no keys; causal hides more
    tensors, grad_out = _inputs(q_lengths, k_lengths, seed=3)
    fn = _public(q_lengths, k_lengths, {"causal": True}, precision="fp8")
    got = run_with_grads(fn, tensors, grad_out)
    no_key = torch.tensor([1] * 4 + [1, 1, 1, 0, 0] + [0, 0], dtype=torch.bool)
    assert torch.equal(got["out"][no_key], torch.zeros_like(got["out"][no_key]))
    assert torch.equal(got["q"][no_key], torch.zeros_like(got["q"][no_key]))
    assert all(torch.isfinite(g).all() for g in got.values())


def test_emulation_is_deterministic():
    tensors, grad_out = _inputs(None, PMA_K, seed=4)
    fn = _public(None, PMA_K, {"activation": "relu2"}, precision="fp8")
    first, second = run_with_grads(fn, tensors, grad_out), run_with_grads(fn, tensors, grad_out)
    for name in first:
        assert torch.equal(first[name], second[name])


# ---------------------------------------------------------------------------------------------
# The FP8 Triton kernels (interpreter).


@pytest.mark.parametrize("case", CASES)
def test_kernels_error_ratio_to_bf16_kernels(interpret, case):
    q_lengths, k_lengths, options = CASES[case]
    tensors, grad_out = _inputs(q_lengths, k_lengths, seed=5)
    oracle = _oracle(q_lengths, k_lengths, options, tensors, grad_out)
    public = functools.partial(_public, q_lengths, k_lengths, options)
    check_fp8_against_bf16(public, tensors, grad_out, oracle, KERNEL_RATIO, case,
                           backend="triton")  # fmt: skip


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("tiles", [16, 32])
def test_kernels_match_emulation(interpret, case, tiles):
    """The same roundings as the emulation for any tile config: forward and gradients equal up
    to float32 summation order (float16 inputs: the interpreter truncates float32 -> bfloat16
    casts, which the dS rounding would otherwise add)."""
    q_lengths, k_lengths, options = CASES[case]
    tensors, grad_out = _inputs(q_lengths, k_lengths, seed=6, dtype=torch.float16)
    q, k, v = tensors["q"], tensors["k"], tensors["v"]
    config = GdpaTritonConfig(
        fwd_block_m=tiles, fwd_block_n=16, dkdv_block_n=tiles, dkdv_block_m=16,
        dq_block_m=16, dq_block_n=tiles, pma_block_n=tiles, pma_kv_chunk=32,
        pma_dq_block_n=16, dkdv_q_chunk=32, fwd_warps=1, bwd_warps=1, pma_warps=1,
    )  # fmt: skip
    call = dict(scale=D**-0.5, precision="fp8", **options)
    lengths = _lengths(q_lengths, k_lengths)
    out = forward_from_lengths(q, k, v, *lengths, config=config, **call)
    want = reference.gdpa_reference(q, k, v, *_offsets(q_lengths, k_lengths), **call)
    torch.testing.assert_close(out, want, rtol=1e-3, atol=1e-3)
    grads = backward_from_lengths(grad_out, q, k, v, *lengths, config=config, **call)
    backward = {n: value for n, value in call.items() if n != "precision"}
    ref_grads = reference.gdpa_fp8_backward(
        grad_out, q, k, v, *_offsets(q_lengths, k_lengths), **backward
    )
    for name, got, ref in zip(GRADS, grads, ref_grads, strict=True):
        torch.testing.assert_close(got, ref, rtol=2e-3, atol=2e-3, msg=name)


@pytest.mark.parametrize("pma", [False, True])
def test_kernels_match_emulation_across_act_tiles(interpret, pma):
    """Rows over several FP8_ACT_TILE-key tiles (A V) and keys over several query tiles (dV),
    a quantisation-block edge at 128, a large token; PMA with Nq > FP8_ACT_TILE."""
    gen = torch.Generator().manual_seed(13)
    k_lengths = [130, 1, 0, 70]
    q_rows = 70 if pma else sum(k_lengths)
    q, k, v = (torch.randn(rows, H, D, generator=gen).half() for rows in (q_rows, 201, 201))
    k[40] *= 8.0
    out_rows = 70 * len(k_lengths) if pma else q_rows
    grad_out = torch.randn(out_rows, H, D, generator=gen).half()
    q_lengths = None if pma else k_lengths
    call = dict(activation="relu2", causal=not pma, precision="fp8")
    lengths = _lengths(q_lengths, None if not pma else k_lengths)
    offsets = _offsets(q_lengths, None if not pma else k_lengths)
    out = forward_from_lengths(q, k, v, *lengths, **call)
    want = reference.gdpa_reference(q, k, v, *offsets, **call)
    torch.testing.assert_close(out, want, rtol=1e-3, atol=1e-3)
    grads = backward_from_lengths(grad_out, q, k, v, *lengths, **call)
    backward = {n: value for n, value in call.items() if n != "precision"}
    ref_grads = reference.gdpa_fp8_backward(grad_out, q, k, v, *offsets, **backward)
    for name, got, ref in zip(GRADS, grads, ref_grads, strict=True):
        torch.testing.assert_close(got, ref, rtol=2e-3, atol=2e-3, msg=name)


def test_kernels_long_sample_and_rows_without_keys(interpret):
    q_lengths, k_lengths = [130, 5, 3], [140, 0, 2]
    tensors, grad_out = _inputs(q_lengths, k_lengths, seed=8)
    options = {"causal": True, "activation": "silu"}
    oracle = _oracle(q_lengths, k_lengths, options, tensors, grad_out)
    got = run_with_grads(_public(q_lengths, k_lengths, options, backend="triton", precision="fp8"),
               tensors, grad_out)  # fmt: skip
    bf16 = rel_errors(run_with_grads(_public(q_lengths, k_lengths, options, backend="triton"), tensors,
                        grad_out), oracle)  # fmt: skip
    check_ratios(rel_errors(got, oracle), bf16, KERNEL_RATIO, "long")
    no_key = torch.zeros(138, dtype=torch.bool)
    no_key[130:136] = True  # sample 1 (no keys) and row 0 of sample 2 (causal, Lq > Lk)
    assert torch.equal(got["out"][no_key], torch.zeros_like(got["out"][no_key]))
    assert torch.equal(got["q"][no_key], torch.zeros_like(got["q"][no_key]))


def test_kernels_backward_is_deterministic(interpret):
    tensors, grad_out = _inputs(CROSS_Q, CROSS_K, seed=9)
    fn = _public(CROSS_Q, CROSS_K, {"window": (4, None)}, backend="triton", precision="fp8")
    first, second = run_with_grads(fn, tensors, grad_out), run_with_grads(fn, tensors, grad_out)
    for name in first:
        assert torch.equal(first[name], second[name]), name


# ---------------------------------------------------------------------------------------------
# The compiled FP8 kernels on a GPU, at the model's head size.

GPU_SELF = [1, 130, 0, 257, 700, 129]
GPU_CASES = {
    "self_causal_silu": (GPU_SELF, None, {"causal": True, "activation": "silu"}),
    "self_window_gelu_fast": (
        GPU_SELF,
        None,
        {"causal": True, "window": (256, 0), "activation": "gelu_fast"},
    ),
    "cross_relu2": ([5, 300, 0, 64], [130, 200, 7, 0], {"activation": "relu2"}),
    "pma_normalized_gelu": (
        None,
        [130, 0, 700, 3],
        {"normalize_by_length": True, "activation": "gelu"},
    ),
}
#: Against the bf16 kernels on the GPU (E4M3's 3 mantissa bits against bfloat16's 7: about
#: 2^4 expected where the quantised GEMMs dominate). Measured on the H200 (d96dc76): up to
#: 24.8 / 15.9 / 16.8 / 24.9 (out, dq, dk, dv).
GPU_KERNEL_RATIO = dict.fromkeys(("out", "q", "k", "v"), 32.0)


@pytest.mark.gpu
@pytest.mark.sm89
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("case", GPU_CASES)
def test_gpu_kernels_error_ratio_to_bf16_kernels(case):
    q_lengths, k_lengths, options = GPU_CASES[case]
    tensors, grad_out = _inputs(q_lengths, k_lengths, seed=11, heads=4, dim=128, device="cuda")
    cpu = {n: t.cpu() for n, t in tensors.items()}
    oracle = _oracle(q_lengths, k_lengths, options, cpu, grad_out.cpu())
    public = functools.partial(_public, q_lengths, k_lengths, options)
    check_fp8_against_bf16(public, tensors, grad_out, oracle, GPU_KERNEL_RATIO, case,
                           backend="triton")  # fmt: skip
