"""Triton GDPA vs the naive float64 oracle (forward and every gradient), the work dealing, errors.

CPU tests run the kernels under the Triton interpreter: the ``interpret`` fixture sets
``TRITON_INTERPRET=1`` through monkeypatch before any kernel is launched (gem_kernels.gdpa_triton
loads an interpreted copy of the kernel module at call time) and removes it afterwards.
Interpreter tiles are 16 rows and head_dim is 16, so lengths 1, 5, 17, 37 cross tile edges;
the interpreter runs 3 persistent programs, so every kernel's work loop runs several rounds.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from gem_kernels import GDPA_BACKENDS, gdpa, gdpa_triton
from gem_kernels.gdpa_triton import (
    GELU_FAST_F16_MAX_ABS_ERROR,
    SHORT_SEQUENCE_LEN,
    GdpaTritonConfig,
    default_config,
    gdpa_from_lengths,
    schedule_loads,
)
from gem_kernels.reference import _GELU_FAST_COEFFS
from kernels_naive import naive_gdpa, offsets_of, plans_built

H, D = 2, 16
ACTIVATIONS = ["silu", "gelu", "gelu_tanh", "gelu_fast", "relu2", "identity"]
SELF_LENGTHS = [0, 1, 5, 37, 16]  # empty, 1, multiple of the tile and not
LONG_SKEWED = [70, 2, 0, 1, 3]  # one sequence much longer than the rest
CROSS_Q = [0, 1, 5, 40, 6, 20]
CROSS_K = [3, 0, 17, 4, 1, 45]  # Lk = 0 with Lq > 0, Lq = 0 with Lk > 0, Lq <> Lk
SHORT_K = [3, 0, 9, 4, 1, 15]  # every KV shorter than one 16-row tile
PMA_K = [0, 1, 2, 7, 40, 3]


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _config(**changes) -> GdpaTritonConfig:
    return replace(default_config(D, interpret=True), **changes)


def _check(q_lengths, k_lengths, *, num_queries=None, tol=3e-5, dtype=torch.float32,
           config=None, seed=0, **options):  # fmt: skip
    """Output and every gradient of the Triton path against the float64 oracle.

    ``q_lengths=None``: PMA with ``num_queries`` shared queries; ``k_lengths=None``: self.
    """
    gen = torch.Generator().manual_seed(seed)
    keys = q_lengths if k_lengths is None else k_lengths
    q_rows = num_queries if q_lengths is None else sum(q_lengths)
    tensors = [
        torch.randn(rows, H, D, generator=gen).to(dtype) for rows in (q_rows, sum(keys), sum(keys))
    ]
    leaves = [t.clone().requires_grad_(True) for t in tensors]
    oracle = [t.double().requires_grad_(True) for t in tensors]
    out = gdpa_from_lengths(
        *leaves,
        None if q_lengths is None else torch.tensor(q_lengths, dtype=torch.int64),
        None if k_lengths is None else torch.tensor(k_lengths, dtype=torch.int64),
        config=config,
        **options,
    )
    broadcast = q_lengths is None
    expected = naive_gdpa(
        *oracle,
        [num_queries] * len(keys) if broadcast else q_lengths,
        keys,
        broadcast=broadcast,
        **options,
    )
    assert out.dtype == dtype and out.shape == expected.shape
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)
    grad_out = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    (out.double() * grad_out).sum().backward()
    (expected * grad_out).sum().backward()
    for name, leaf, ref in zip("qkv", leaves, oracle, strict=True):
        ref_grad = torch.zeros_like(ref) if ref.grad is None else ref.grad
        assert leaf.grad is not None and leaf.grad.dtype == dtype, name
        scale = max(1.0, float(ref_grad.abs().amax())) if ref_grad.numel() else 1.0
        torch.testing.assert_close(
            leaf.grad.double(), ref_grad, atol=tol * scale, rtol=tol, msg=f"grad of {name}"
        )
    return out


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_self_attention_every_activation(interpret, activation):
    # gelu_fast: the float32 polynomial at |x| ~ 4 loses ~1e-5 to cancellation.
    tol = 1e-4 if activation in ("gelu_fast", "relu2") else 3e-5
    _check(SELF_LENGTHS, None, activation=activation, tol=tol, causal=activation == "silu")


@pytest.mark.parametrize(
    ("causal", "window", "normalize"),
    [(False, (3, 5), True), (True, (20, None), False), (False, (None, 0), True)],
)
def test_self_attention_masks_and_normalisation(interpret, causal, window, normalize):
    _check(
        SELF_LENGTHS, None, activation="gelu", causal=causal, window=window,
        normalize_by_length=normalize, scale=0.3,
    )  # fmt: skip


def test_one_long_sequence(interpret):
    _check(LONG_SKEWED, None, activation="gelu_tanh", causal=True, window=(40, None))


@pytest.mark.parametrize("short_kv", [True, False], ids=["short_kv", "generic"])
@pytest.mark.parametrize(("causal", "window"), [(True, None), (False, (4, 1))])
def test_cross_attention(interpret, short_kv, causal, window):
    config = _config(short_kv_max=256 if short_kv else 0)
    _check(
        CROSS_Q, CROSS_K, activation="silu", causal=causal, window=window,
        normalize_by_length=True, config=config,
    )  # fmt: skip


def test_cross_kv_shorter_than_a_tile(interpret):
    _check(CROSS_Q, SHORT_K, activation="relu2", causal=True, tol=1e-4)


@pytest.mark.parametrize(
    ("num_queries", "short_kv", "causal", "normalize"),
    [(1, True, True, False), (5, True, False, True), (20, False, False, True), (3, False, True, False)],
)  # fmt: skip
def test_pma_broadcast(interpret, num_queries, short_kv, causal, normalize):
    # short_kv=False forces the generic kernels (KV of 40 > short_kv_max=16).
    config = _config(short_kv_max=256 if short_kv else 16)
    _check(
        None, PMA_K, num_queries=num_queries, activation="gelu_fast", causal=causal,
        normalize_by_length=normalize, config=config, tol=1e-4,
    )  # fmt: skip


def test_split_partials_pma_and_cross(interpret):
    # Chunks of 16 keys (PMA) / 16 query rows (cross dK/dV): 3 partials for the 40-long
    # samples, 1 (direct write) for the short ones; the plan must really use the partials.
    gt = gdpa_triton
    config = _config(short_kv_max=0, pma_kv_chunk=16, dkdv_q_chunk=16, pma_stream=False)
    pma = gt._samples(None, torch.tensor(PMA_K), 3)
    plan = gt._plan(pma, H, None, None, config, torch.device("cpu"), True, True, 16)
    assert plan.fwd_partial_rows > len(PMA_K) and plan.fwd_combine.shape[0] == 1
    assert plan.dq_partial_blocks == plan.fwd_partial_rows
    cross = gt._samples(torch.tensor(CROSS_Q), torch.tensor(CROSS_K), None)
    plan = gt._plan(cross, H, None, None, config, torch.device("cpu"), True, True)
    assert plan.dkdv_partial_rows > 0 and plan.dkdv_combine.shape[0] > 0
    # A band of 30 rows: masked and full tiles, and chunks the band skips entirely.
    options = dict(activation="gelu_fast", window=(30, 6), tol=1e-4)
    _check(None, PMA_K, num_queries=3, normalize_by_length=True, config=config, **options)
    _check(CROSS_Q, CROSS_K, config=config, **options)


@pytest.mark.parametrize("programs", [1, 2, 7, 40])
def test_pma_stream_segments_split_over_programs(interpret, monkeypatch, programs):
    # The streamed PMA forward deals 22 (sample, head, key tile) steps over `programs`
    # programs: with 2 and 7 a segment spans two or three programs (float32 partials summed
    # by the combine kernel), with 40 every program gets at most one step.
    gt = gdpa_triton
    lengths = [0, 1, 70, 5, 33]
    monkeypatch.setattr(gt.host, "num_programs", lambda device, per_sm, interpret: programs)
    config = _config(short_kv_max=0, pma_stream=True, pma_programs_per_sm=programs)
    samples = gt._samples(None, torch.tensor(lengths), 3)
    plan = gt._plan(samples, H, None, None, config, torch.device("cpu"), False, True, 16)
    steps = sum(max(1, -(-n // 16)) for n in lengths) * H
    assert plan.stream_bounds is not None and plan.fwd_grid == min(programs, steps)
    assert (plan.fwd_combine.shape[0] > 0) == (programs > 1)
    assert plan.stream_slots >= 2 * plan.fwd_combine.shape[0]
    for activation, normalize in (("gelu", True), ("silu", False)):
        _check(
            None, lengths, num_queries=3, activation=activation, normalize_by_length=normalize,
            config=config, tol=1e-4,
        )  # fmt: skip


def test_pma_stream_needs_no_mask_and_one_query_tile(interpret):
    # Windows, causal masks and more queries than one tile take the split-KV items instead.
    gt = gdpa_triton
    config = _config(short_kv_max=0, pma_stream=True)
    device = torch.device("cpu")
    for num_queries, left, right in ((3, None, None), (3, 5, None), (3, None, 0), (17, None, None)):
        samples = gt._samples(None, torch.tensor(PMA_K), num_queries)
        pma_m = gt._pma_block_m(num_queries, config)
        plan = gt._plan(samples, H, left, right, config, device, False, True, pma_m)
        streamed = num_queries <= 16 and left is None and right is None
        assert (plan.stream_bounds is not None) == streamed
    _check(None, PMA_K, num_queries=17, activation="silu", config=config, tol=1e-4)


def test_gelu_fast_past_its_clamp(interpret):
    # scale 2: scores reach |s| ~ 10, across the clamp edge (3.42) into the exact tails.
    _check(SELF_LENGTHS, None, activation="gelu_fast", scale=2.0, tol=1e-4)


def test_plans_are_cached(interpret):
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(sum(SELF_LENGTHS), H, D, generator=gen) for _ in range(3))
    lengths = torch.tensor(SELF_LENGTHS)
    gdpa_triton._PLAN_CACHE.clear()
    first = gdpa_from_lengths(q, k, v, lengths, activation="relu2")
    second = gdpa_from_lengths(q, k, v, lengths.clone(), activation="relu2")
    assert len(gdpa_triton._PLAN_CACHE) == 1  # same lengths, same config: one plan
    torch.testing.assert_close(first, second, atol=0.0, rtol=0.0)
    other = [5, 1, 16, 37, 0]  # same total, other lengths: a new plan and other output rows
    third = gdpa_from_lengths(q, k, v, torch.tensor(other), activation="relu2")
    assert len(gdpa_triton._PLAN_CACHE) == 2
    expected = naive_gdpa(q.double(), k.double(), v.double(), other, other, activation="relu2")
    torch.testing.assert_close(third.double(), expected, atol=1e-4, rtol=1e-4)


def test_bfloat16_inputs(interpret):
    _check(CROSS_Q, CROSS_K, activation="silu", dtype=torch.bfloat16, tol=3e-2, causal=True)


@pytest.mark.parametrize("kind", ["self", "cross", "pma"])
def test_packed_gelu_fast_bfloat16(interpret, kind):
    # The f16x2 gelu_fast (tl emulation of the inline-PTX math under the interpreter), forward
    # and backward, masks included; PMA keeps the float32 activation (same result either way).
    q_lengths, k_lengths = {"self": (SELF_LENGTHS, None), "cross": (CROSS_Q, CROSS_K),
                            "pma": (None, PMA_K)}[kind]  # fmt: skip
    options = dict(activation="gelu_fast", dtype=torch.bfloat16, tol=3e-2, window=(20, 3))
    options["num_queries"] = 3 if kind == "pma" else None
    packed = _check(q_lengths, k_lengths, config=_config(packed_gelu=True), **options)
    plain = _check(q_lengths, k_lengths, config=_config(packed_gelu=False), **options)
    if kind == "pma":
        torch.testing.assert_close(packed, plain, atol=0.0, rtol=0.0)
    else:  # the packed path really ran: float16 roundings move some bfloat16 outputs
        assert not torch.equal(packed, plain)
        torch.testing.assert_close(packed.float(), plain.float(), atol=3e-2, rtol=3e-2)


def _gelu_fast_f16(x: torch.Tensor) -> torch.Tensor:
    """The packed path's math, re-derived with torch: float16 Horner with fused multiply-adds
    (products and sums in float64, rounded once), saturating clamp, times x in float32."""
    coeffs = [torch.tensor(c, dtype=torch.float64).half().double() for c in _GELU_FAST_COEFFS]

    def f16(value):
        return value.half().double()

    h = f16(x)
    h2 = f16(h * h)
    poly = coeffs[-1]
    for coeff in reversed(coeffs[:-1]):
        poly = f16(poly * h2 + coeff)
    cdf = f16(h * poly + 0.5).clamp(0.0, 1.0)
    return (x.float() * cdf.float()).double()


def test_packed_gelu_fast_error_bound():
    x = torch.cat([torch.linspace(-12, 12, 480_001), torch.linspace(-1e4, 1e4, 20_001)])
    x = x.double()
    exact = 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))
    error = (_gelu_fast_f16(x) - exact).abs()
    worst = float(error.max())
    assert worst < GELU_FAST_F16_MAX_ABS_ERROR, f"{worst:.3e} at {float(x[error.argmax()])}"
    assert worst > 0.8 * GELU_FAST_F16_MAX_ABS_ERROR  # the documented bound is tight
    tails = x.abs() > 3.43
    assert torch.equal(_gelu_fast_f16(x)[tails], torch.where(x > 0, x, 0.0)[tails])


cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _gpu_inputs(kind, q_lengths, gen, heads=4, dim=128):
    """(k_lengths or None for self, [q, k, v] on the GPU, output gradient) for a GPU check;
    cross keys are short (< 257 per sample)."""
    k_lengths = None if kind == "self" else [int(n) % 257 for n in q_lengths]
    keys = q_lengths if k_lengths is None else k_lengths
    tensors = [
        torch.randn(rows, heads, dim, generator=gen).cuda()
        for rows in (sum(q_lengths), sum(keys), sum(keys))
    ]
    grad = torch.randn(sum(q_lengths), heads, dim, generator=gen).cuda()
    return k_lengths, tensors, grad


@pytest.mark.gpu
@cuda_only
@pytest.mark.parametrize("kind", ["self", "cross"])
def test_gpu_packed_gelu_fast_matches_reference(kind, monkeypatch):
    # The inline-PTX f16x2 path (D=128, production tiles) against the float32 reference, and
    # against the float32-activation kernels: same accuracy class, different roundings.
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    gen = torch.Generator().manual_seed(0)
    q_lengths = torch.randint(1, 700, (12,), generator=gen).tolist() + [0, 1, 1500]
    k_lengths, tensors, grad = _gpu_inputs(kind, q_lengths, gen)
    results = {}
    for name, config in (("ref", None), ("packed", True), ("plain", False)):
        if config is None:
            leaves = [t.clone().requires_grad_(True) for t in tensors]
            out = gdpa(*leaves, offsets_of(q_lengths).cuda(),
                       None if k_lengths is None else offsets_of(k_lengths).cuda(),
                       activation="gelu_fast", causal=True, backend="reference")  # fmt: skip
        else:
            leaves = [t.bfloat16().requires_grad_(True) for t in tensors]
            cfg = replace(default_config(128), packed_gelu=config)
            out = gdpa_from_lengths(
                *leaves, torch.tensor(q_lengths),
                None if k_lengths is None else torch.tensor(k_lengths),
                activation="gelu_fast", causal=True, config=cfg,
            )  # fmt: skip
        out.float().mul(grad).sum().backward()
        results[name] = [out.float()] + [leaf.grad.float() for leaf in leaves]
    for label, ref, packed, plain in zip("oqkv", *results.values(), strict=True):
        error = float((packed - ref).norm() / ref.norm())
        baseline = float((plain - ref).norm() / ref.norm())
        assert error < 1e-2 and error < 1.5 * baseline + 1e-3, (label, error, baseline)
        assert not torch.equal(packed, plain), label


def test_schedule_loads_deal_longest_first_in_zigzag():
    # Sorted 9 7 5 3 2 1: round 0 gives programs 0, 1 the 9 and 7, round 1 (reversed) gives
    # program 1 the 5 and program 0 the 3, round 2 program 0 the 2 and program 1 the 1.
    loads = gdpa_triton.schedule_loads([2, 9, 5, 1, 7, 3], 2)
    assert loads.tolist() == [14.0, 13.0]
    assert gdpa_triton.schedule_loads([4.0], 3).tolist() == [4.0, 0.0, 0.0]


def test_public_entry_point_dispatch(interpret):
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(sum(CROSS_Q), H, D, generator=gen)
    k = torch.randn(sum(CROSS_K), H, D, generator=gen)
    v = torch.randn(sum(CROSS_K), H, D, generator=gen)
    q_off, k_off = offsets_of(CROSS_Q), offsets_of(CROSS_K)
    options = dict(activation="gelu", causal=True, normalize_by_length=True)
    calls = {
        "self": lambda backend: gdpa(q, q, q, q_off, backend=backend, **options),
        "cross": lambda backend: gdpa(q, k, v, q_off, k_off, backend=backend, **options),
        "pma": lambda backend: gdpa(q[:4], k, v, None, k_off, backend=backend, **options),
    }
    for name, call in calls.items():
        got, want = call("triton"), call("reference")
        torch.testing.assert_close(got, want, atol=3e-5, rtol=3e-5, msg=name)
    assert GDPA_BACKENDS == ("auto", "triton", "reference")


def test_operator_gradients_match_reference(interpret):
    """The public function through ``torch.ops.gem_kernels.gdpa`` and ``gdpa_backward``:
    output and every gradient of the Triton backend match the reference backend's (cross
    attention over short key lists, PMA broadcast)."""
    gen = torch.Generator().manual_seed(4)
    k = torch.randn(sum(SHORT_K), H, D, generator=gen)
    v = torch.randn(sum(SHORT_K), H, D, generator=gen)
    calls = {
        "cross": (torch.randn(sum(CROSS_Q), H, D, generator=gen), offsets_of(CROSS_Q),
                  dict(activation="gelu", window=(None, 2), normalize_by_length=True)),
        "pma": (torch.randn(3, H, D, generator=gen), None,
                dict(activation="silu", causal=True, normalize_by_length=True)),
    }  # fmt: skip
    for name, (q, q_offsets, options) in calls.items():
        results = {}
        for backend in ("triton", "reference"):
            leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
            out = gdpa(*leaves, q_offsets, offsets_of(SHORT_K), backend=backend, **options)
            out.backward(torch.ones_like(out))
            results[backend] = (out, [leaf.grad for leaf in leaves])
        (out, grads), (ref_out, ref_grads) = results["triton"], results["reference"]
        torch.testing.assert_close(out, ref_out, atol=3e-5, rtol=3e-5, msg=name)
        for which, grad, ref in zip("qkv", grads, ref_grads, strict=True):
            torch.testing.assert_close(grad, ref, atol=1e-4, rtol=1e-4, msg=f"{name} d{which}")


def test_schedule_loads_zigzag_balances_skewed_work():
    # Power-law work (one huge item plus a long tail): the zigzag dealing over a longest-first
    # list must not be worse than plain round-robin in sample order, and every unit of work is
    # assigned.
    gen = torch.Generator().manual_seed(0)
    work = (torch.rand(500, generator=gen) ** (-1 / 0.7)).floor().clamp(max=400)
    zigzag = schedule_loads(work, 16)
    assert zigzag.shape == (16,)
    assert float(zigzag.sum()) == pytest.approx(float(work.sum()))
    round_robin = torch.nn.functional.pad(work.double(), (0, 12)).reshape(-1, 16).sum(0)
    assert zigzag.max() / zigzag.mean() <= round_robin.max() / round_robin.mean()
    # Zigzag of 2P equal-rank pairs is perfectly balanced on a linear ramp.
    ramp = torch.arange(32, dtype=torch.float64)
    assert torch.equal(schedule_loads(ramp, 16), torch.full((16,), 31.0))


def test_errors(interpret, monkeypatch):
    q = torch.randn(5, H, D)
    off = offsets_of([5])
    with pytest.raises(ValueError, match="backend must be one of"):
        gdpa(q, q, q, off, backend="cuda")
    with pytest.raises(ValueError, match="backend='triton' cannot run this call: dtype"):
        gdpa(q.double(), q.double(), q.double(), off, backend="triton")
    with pytest.raises(ValueError, match="config.fwd_loop must be one of"):
        gdpa_from_lengths(q, q, q, torch.tensor([5]), config=_config(fwd_loop="random"))
    with pytest.raises(ValueError, match="config.bwd_loop must be one of"):
        gdpa_from_lengths(q, q, q, torch.tensor([5]), config=_config(bwd_loop="one_loop"))
    with pytest.raises(ValueError, match="PMA broadcast"):
        gdpa_from_lengths(q, q, q, None, None)
    with pytest.raises(ValueError, match="warp_specialized.* needs fwd_stages <= 2"):
        ws3 = _config(fwd_loop="warp_specialized", fwd_stages=3)
        gdpa_from_lengths(q, q, q, torch.tensor([5]), config=ws3)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="need TRITON_INTERPRET=1"):
        gdpa(q, q, q, off, backend="triton")
    assert gdpa_triton.triton_unsupported_reason(q) is not None
    # auto on CPU runs the reference without touching Triton.
    torch.testing.assert_close(gdpa(q, q, q, off), gdpa(q, q, q, off, backend="reference"))


@pytest.mark.parametrize(
    "changes",
    [
        # (The production tables on interpreter tiles: test_default_unmasked_kernels.)
        dict(fwd_loop="pipelined", bwd_loop="fused"),
        dict(fwd_loop="one_loop", fwd_programs_per_sm=2),
    ],
)
def test_one_loop_and_short_kv_variants(interpret, changes):
    # Mask-free single loops (keys past a sample's end load as zeros; pointer loads under the
    # interpreter), the hand-pipelined loop, the mask-free short-KV forward; windows keep the
    # three phases.
    config = _config(**changes)
    generic = replace(config, short_kv_max=0)
    _check(LONG_SKEWED, None, activation="gelu_fast", tol=1e-4, config=config)
    _check(CROSS_Q, CROSS_K, activation="silu", normalize_by_length=True, config=generic)
    _check(CROSS_Q, SHORT_K, activation="relu2", tol=1e-4, config=config)
    _check(CROSS_Q, CROSS_K, activation="gelu_tanh", config=config)  # mask-free short KV
    _check(SELF_LENGTHS, None, activation="silu", window=(3, None), config=config)


def test_warp_specialized_forward_matches_the_plain_loop(interpret):
    # Warp specialisation (whole-tensor descriptors, P masked past a sample's keys) must equal
    # the one-loop TMA forward bit for bit under the interpreter (which ignores the loop flag),
    # self with q, k, v split from one packed (T, 3, H, D) tensor (rows of 3 H D) and cross
    # (generic path), and match the oracle with normalisation and gradients.
    base = _config(fwd_loop="one_loop", short_kv_max=0)
    special = replace(base, fwd_loop="warp_specialized")
    gen = torch.Generator().manual_seed(3)
    for q_lengths, k_lengths in ((LONG_SKEWED, None), (CROSS_Q, CROSS_K)):
        keys = q_lengths if k_lengths is None else k_lengths
        if k_lengths is None:
            q, k, v = torch.randn(sum(q_lengths), 3, H, D, generator=gen).unbind(1)
        else:
            q, k, v = (
                torch.randn(n, H, D, generator=gen) for n in (sum(q_lengths), *[sum(keys)] * 2)
            )
        q_len = torch.tensor(q_lengths)
        k_len = None if k_lengths is None else torch.tensor(k_lengths)
        outs = [
            gdpa_from_lengths(q, k, v, q_len, k_len, activation="gelu_fast", config=cfg)
            for cfg in (base, special)
        ]
        assert torch.equal(outs[0], outs[1])
    _check(LONG_SKEWED, None, activation="silu", normalize_by_length=True, config=special)
    _check(CROSS_Q, CROSS_K, activation="gelu_tanh", config=special)


def test_fused_backward(interpret):
    # dQ added by float32 atomics inside the dK/dV kernel (no dQ kernel): self, cross with
    # split query ranges (partial dK/dV), lengths 0/1/odd, normalisation, a window (the
    # three phases inside the fused kernel); PMA keeps its dQ kernel under the same config.
    config = _config(bwd_loop="fused", short_kv_max=0)
    _check(LONG_SKEWED, None, activation="gelu_fast", tol=1e-4, config=config)
    _check(CROSS_Q, CROSS_K, activation="silu", normalize_by_length=True, config=config)
    _check(SELF_LENGTHS, None, activation="relu2", window=(3, 1), config=config)
    _check(None, PMA_K, num_queries=3, activation="silu", config=config, tol=1e-4)


def test_deterministic_mode_takes_the_dq_kernel(interpret, monkeypatch):
    # The fused backward's float32 atomics have no fixed order: with
    # torch.use_deterministic_algorithms(True) the same config launches the dQ kernel instead.
    kernels = gdpa_triton._kernels(True)
    real, launches = kernels.gdpa_bwd_dq_kernel, []

    class Spy:
        def __getitem__(self, grid):
            launches.append(grid)
            return real[grid]

    monkeypatch.setattr(kernels, "gdpa_bwd_dq_kernel", Spy())
    config = _config(bwd_loop="fused", short_kv_max=0)
    _check(CROSS_Q, CROSS_K, activation="silu", config=config)
    assert launches == []
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        _check(CROSS_Q, CROSS_K, activation="silu", config=config)
    finally:
        torch.use_deterministic_algorithms(was)
    assert launches


# The fields the production default sets for unmasked calls (tiles differ under the interpreter).
_DEFAULT_FLAGS = ("fwd_loop", "bwd_loop", "dkdv_q_chunk", "short_kv_max")


@pytest.mark.parametrize("max_len", [SHORT_SEQUENCE_LEN, None], ids=["short", "long"])
def test_default_unmasked_kernels(interpret, max_len):
    # The H200 default for unmasked D=128 bf16 calls, on interpreter tiles: its kernel paths
    # (one loop, TMA, pipelined forward; one-loop backward; mask-free short KV) vs the oracle.
    production = default_config(128, max_len=max_len)
    assert production.fwd_loop in ("warp_specialized", "pipelined")
    assert production.bwd_loop == "fused"
    config = _config(**{name: getattr(production, name) for name in _DEFAULT_FLAGS})
    _check(LONG_SKEWED, None, activation="gelu_fast", tol=1e-4, config=config)
    _check(CROSS_Q, CROSS_K, activation="gelu_fast", tol=1e-4, config=config)
    _check(CROSS_Q, CROSS_K, activation="silu", config=replace(config, short_kv_max=0))


def test_config_hash_is_cached_and_not_pickled():
    # Configs are hashed on every call (plan and config caches): once per instance, equal
    # configs hash equal, and a pickled copy (worker processes) recomputes its own hash.
    import pickle

    config = default_config(128, max_len=4096)
    twin = replace(config, fwd_block_m=config.fwd_block_m)
    assert config is not twin and config == twin and hash(config) == hash(twin)
    assert config.__dict__["_hash"] == hash(config)
    copy = pickle.loads(pickle.dumps(config))
    assert "_hash" not in copy.__dict__ and copy == config and hash(copy) == hash(config)
    assert replace(config, fwd_block_m=64) != config
    # The kernel module is looked up once per mode (no path resolution per launch).
    assert gdpa_triton._kernels(True) is gdpa_triton._kernels(True)


def test_default_config_choice():
    short = default_config(128, max_len=SHORT_SEQUENCE_LEN)
    long = default_config(128, max_len=SHORT_SEQUENCE_LEN + 1)
    # Up to 1024 keys (cross attention included: no short-KV kernel) the warp-specialised
    # 128x128 forward, 4 warps, one program per SM; beyond, the hand-pipelined 128x64.
    assert (short.fwd_block_m, short.fwd_block_n, short.fwd_stages) == (128, 128, 2)
    assert (short.fwd_warps, short.fwd_programs_per_sm) == (4, 1)
    assert short.fwd_loop == "warp_specialized" and short.short_kv_max == 0
    assert long.fwd_loop == "pipelined" and long.short_kv_max == 256
    assert default_config(128) == long  # unknown length: the long-sequence tiles
    masked = default_config(128, max_len=100, masked=True)
    assert masked.fwd_loop == masked.bwd_loop == "phased"
    assert short.bwd_loop == long.bwd_loop == "fused"
    assert short.dkdv_q_chunk == long.dkdv_q_chunk == 0 and masked.dkdv_q_chunk > 0
    # Cross (short KV): 4096 query rows per item.
    assert short.short_rows_per_item == long.short_rows_per_item == 4096
    assert masked == default_config(128, masked=True)
    # Unmeasured head dims and dtypes keep their tiles whatever the length.
    for kwargs in (dict(dtype=torch.float32), dict(dtype=torch.float16), dict()):
        dim = 128 if kwargs else 64
        assert default_config(dim, max_len=10, **kwargs) == default_config(dim, **kwargs)
        assert default_config(dim, max_len=10, **kwargs).fwd_loop == "phased"
    # Inputs the descriptors cannot read keep the 64x32 forward (and cross's short-KV kernel).
    strided = default_config(128, max_len=SHORT_SEQUENCE_LEN, descriptor_layout=False)
    assert strided.fwd_loop == "one_loop" and strided.short_kv_max == 256
    assert (strided.fwd_block_m, strided.fwd_block_n, strided.fwd_programs_per_sm) == (64, 32, 3)
    assert default_config(128, descriptor_layout=False) == long


def test_descriptor_layout_of_the_inputs(interpret, monkeypatch):
    packed = torch.randn(10, 4, 128)
    assert gdpa_triton.descriptor_layout(packed, packed, packed, interpret=True)
    heads_apart = torch.randn(4, 10, 128).transpose(0, 1)  # (T, H, D), head stride T * D
    assert not gdpa_triton.descriptor_layout(heads_apart, packed, packed, interpret=True)
    odd_dim = torch.randn(10, 4, 96)
    assert not gdpa_triton.descriptor_layout(odd_dim, odd_dim, odd_dim, interpret=True)
    # The entry point asks for the layout of the tensors it launches with.
    seen = []
    real = gdpa_triton.default_config

    def recording(*args, **kwargs):
        seen.append(kwargs["descriptor_layout"])
        return real(*args, **kwargs)

    monkeypatch.setattr(gdpa_triton, "default_config", recording)
    lengths = torch.tensor([3, 7])
    gdpa_from_lengths(packed, packed, packed, lengths)
    gdpa_from_lengths(heads_apart, packed, packed, lengths)
    assert seen == [True, False]


@pytest.mark.gpu
@cuda_only
@pytest.mark.parametrize("activation", ["gelu_fast", "silu", "gelu_tanh"])
@pytest.mark.parametrize(("kind", "max_len"), [("self", 1024), ("self", 3000), ("cross", 2000)])
def test_gpu_default_unmasked_matches_reference(kind, max_len, activation, monkeypatch):
    # The default unmasked kernels (one loop, TMA, pipelined or 64x32 forward; one-loop
    # backward; mask-free short KV) against the float32 reference and the masked-call config.
    # silu (the GEM model's) and gelu_tanh: the compiled kernels' approximate sigmoid, which
    # the interpreter does not run.
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    gen = torch.Generator().manual_seed(1)
    q_lengths = torch.randint(1, max_len, (10,), generator=gen).tolist() + [0, 1, max_len]
    k_lengths, tensors, grad = _gpu_inputs(kind, q_lengths, gen)
    results = {}
    for name in ("ref", "default", "masked-config"):
        if name == "ref":
            leaves = [t.clone().requires_grad_(True) for t in tensors]
            out = gdpa(*leaves, offsets_of(q_lengths).cuda(),
                       None if k_lengths is None else offsets_of(k_lengths).cuda(),
                       activation=activation, backend="reference")  # fmt: skip
        else:
            leaves = [t.bfloat16().requires_grad_(True) for t in tensors]
            cfg = default_config(128, masked=True) if name == "masked-config" else None
            out = gdpa_from_lengths(
                *leaves, torch.tensor(q_lengths),
                None if k_lengths is None else torch.tensor(k_lengths),
                activation=activation, config=cfg,
            )  # fmt: skip
        out.float().mul(grad).sum().backward()
        results[name] = [out.float()] + [leaf.grad.float() for leaf in leaves]
    for label, ref, new, old in zip("oqkv", *results.values(), strict=True):
        error = float((new - ref).norm() / ref.norm())
        baseline = float((old - ref).norm() / ref.norm())
        assert error < 1e-2 and error < 1.2 * baseline + 1e-3, (label, error, baseline)


@pytest.mark.parametrize("training", [True, False])
def test_a_training_call_plans_its_backward_once_in_the_forward(interpret, monkeypatch, training):
    """As JFA's: one plan per lengths, with the backward's work lists when the inputs need
    gradients, built by the forward and reused by the backward."""
    built = plans_built(monkeypatch, gdpa_triton, "_plan")
    # Lengths no other test (nor the other parameter) plans.
    q_lengths, k_lengths = torch.tensor([9, 0, 21, 2 + training]), torch.tensor([4, 3, 0, 17])
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(int(q_lengths.sum()), 2, 16, generator=gen)
    k, v = (torch.randn(int(k_lengths.sum()), 2, 16, generator=gen) for _ in range(2))
    q_offsets, k_offsets = offsets_of(q_lengths), offsets_of(k_lengths)
    if training:
        leaves = [t.requires_grad_(True) for t in (q, k, v)]
        gdpa(*leaves, q_offsets, k_offsets, backend="triton").sum().backward()
        assert built == [True]
    else:
        with torch.no_grad():
            gdpa(q, k, v, q_offsets, k_offsets, backend="triton")
        assert built == [False]
