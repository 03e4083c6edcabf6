"""Triton jagged flash attention vs the naive float64 oracle (forward and every gradient).

CPU tests run the kernels under the Triton interpreter: the ``interpret`` fixture sets
``TRITON_INTERPRET=1`` through monkeypatch before any kernel is launched (gem_kernels.jfa_triton
loads an interpreted copy of the kernel module at call time, so the variable need not be set
before import) and removes it afterwards, which leaves the rest of the suite untouched.
Interpreter tiles are 16x16 and head_dim 16, so lengths 1, 5, 17, 37 cross tile edges.
GPU tests (``-m gpu``) use the compiled kernels on larger shapes.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from gem_kernels import jagged_flash_attention, jfa_triton
from gem_kernels.jfa_triton import (
    JfaTritonConfig,
    jagged_flash_attention_from_lengths,
    jagged_flash_attention_triton,
)
from gem_kernels.reference import jagged_flash_attention_reference
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from kernels_naive import naive_jfa, offsets_of, plans_built

H, D = 2, 16
SELF_LENGTHS = [0, 1, 5, 37, 16, 0, 17]  # empty, 1, multiple of the tile and not
LONG_SKEWED = [100, 2, 2, 0, 1, 3]  # one sequence much longer than the rest
CROSS_Q = [0, 1, 5, 9, 2, 40, 6, 20]
CROSS_K = [3, 0, 17, 4, 1, 20, 6, 45]  # Lk = 0 with Lq > 0, Lq = 0 with Lk > 0, Lq <> Lk


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _nan_filled(jagged_bias: torch.Tensor) -> torch.Tensor:
    return torch.full_like(jagged_bias, float("nan"))


@pytest.fixture(autouse=True)
def nan_bias_grad_buffer(monkeypatch):
    """The jagged-bias gradient buffer starts as NaN in every test (it is torch.empty in
    production): an element no kernel writes shows up as a non-finite gradient."""
    monkeypatch.setattr(jfa_triton, "_new_bias_grad", _nan_filled)


def _inputs(q_lengths, k_lengths, *, seed, dtype=torch.float32, heads=H, dim=D, rel=None,
            jagged=False):  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    tensors = {
        "q": torch.randn(sum(q_lengths), heads, dim, generator=gen),
        "k": torch.randn(sum(k_lengths), heads, dim, generator=gen),
        "v": torch.randn(sum(k_lengths), heads, dim, generator=gen),
    }
    if rel is not None:
        tensors["rel_pos_bias"] = torch.randn(heads, rel, generator=gen)
    if jagged:
        pairs = sum(a * b for a, b in zip(q_lengths, k_lengths, strict=True))
        tensors["jagged_bias"] = torch.randn(heads, pairs, generator=gen)
    return {name: t.to(dtype) for name, t in tensors.items()}


def _check_grads(q_lengths, k_lengths, tensors, *, tol, config=None, **options):
    """Output and every gradient of the Triton path against the float64 oracle."""
    leaves = {n: t.clone().requires_grad_(True) for n, t in tensors.items()}
    oracle_leaves = {n: t.double().requires_grad_(True) for n, t in tensors.items()}
    biases = {n: leaves[n] for n in ("rel_pos_bias", "jagged_bias") if n in leaves}
    out = jagged_flash_attention_triton(
        leaves["q"],
        leaves["k"],
        leaves["v"],
        offsets_of(q_lengths),
        offsets_of(k_lengths),
        **biases,
        config=config,
        **options,
    )
    expected = naive_jfa(
        oracle_leaves["q"],
        oracle_leaves["k"],
        oracle_leaves["v"],
        q_lengths,
        k_lengths,
        rel_pos_bias=oracle_leaves.get("rel_pos_bias"),
        jagged_bias=oracle_leaves.get("jagged_bias"),
        **options,
    )
    assert out.dtype == tensors["q"].dtype and out.shape == expected.shape
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)
    grad_out = torch.randn(
        out.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64
    )
    (out.double() * grad_out).sum().backward()
    (expected * grad_out).sum().backward()
    for name, leaf in leaves.items():
        reference_grad = oracle_leaves[name].grad
        if reference_grad is None:
            reference_grad = torch.zeros_like(oracle_leaves[name])
        assert leaf.grad is not None and leaf.grad.dtype == leaf.dtype, name
        assert torch.isfinite(leaf.grad).all(), name
        # Scale-aware tolerance: gradients of biases can be ~0 analytically (one bucket).
        scale = max(1.0, float(reference_grad.abs().amax())) if reference_grad.numel() else 1.0
        torch.testing.assert_close(
            leaf.grad.double(), reference_grad, atol=tol * scale, rtol=tol, msg=f"grad of {name}"
        )
    return out


CASES = [
    (False, None),
    (True, None),
    (False, (3, 2)),
    (True, (20, None)),
    (False, (None, 0)),
    (False, (18, 40)),
]


@pytest.mark.parametrize(("causal", "window"), CASES)
def test_self_attention_matches_oracle(interpret, causal, window):
    tensors = _inputs(SELF_LENGTHS, SELF_LENGTHS, seed=1)
    _check_grads(SELF_LENGTHS, SELF_LENGTHS, tensors, tol=2e-5, causal=causal, window=window)


@pytest.mark.parametrize(
    ("causal", "window"), [(False, None), (True, None), (False, (4, 1)), (True, (6, None))]
)
def test_cross_attention_bottom_right_alignment(interpret, causal, window):
    tensors = _inputs(CROSS_Q, CROSS_K, seed=2)
    _check_grads(CROSS_Q, CROSS_K, tensors, tol=2e-5, causal=causal, window=window, scale=0.3)


@pytest.mark.parametrize("window", [None, (40, 0)])
def test_one_long_sequence(interpret, window):
    tensors = _inputs(LONG_SKEWED, LONG_SKEWED, seed=3)
    _check_grads(LONG_SKEWED, LONG_SKEWED, tensors, tol=2e-5, causal=True, window=window)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float16, 3e-3), (torch.bfloat16, 3e-2)])
def test_half_precision_inputs(interpret, dtype, tol):
    tensors = _inputs(CROSS_Q, CROSS_K, seed=4, dtype=dtype, rel=9, jagged=True)
    _check_grads(CROSS_Q, CROSS_K, tensors, tol=tol, causal=True)


@pytest.mark.parametrize(
    ("num_buckets", "causal", "window"),
    [
        (1, False, None),
        (2, True, None),
        (7, True, (5, None)),
        (40, False, (5, 3)),
        (64, False, None),
    ],
)
def test_biases_and_their_gradients(interpret, num_buckets, causal, window):
    tensors = _inputs(CROSS_Q, CROSS_K, seed=5, rel=num_buckets, jagged=True)
    _check_grads(CROSS_Q, CROSS_K, tensors, tol=2e-5, causal=causal, window=window)


def test_each_bias_alone(interpret):
    lengths = [1, 37, 0, 20]
    for rel, jagged in ((33, False), (None, True)):
        tensors = _inputs(lengths, lengths, seed=6, rel=rel, jagged=jagged)
        _check_grads(lengths, lengths, tensors, tol=2e-5, causal=True)


@pytest.mark.parametrize("scale", [0.0, -0.7, 3.0])
def test_biases_with_any_scale(interpret, scale):
    # Bias tiles enter the q.k dot divided by the scale; a zero scale takes another route.
    lengths = [3, 21, 0, 17]
    tensors = _inputs(lengths, lengths, seed=12, rel=9, jagged=True)
    _check_grads(lengths, lengths, tensors, tol=2e-5, causal=True, scale=scale)


def test_fully_masked_rows_are_zero_with_zero_grads(interpret):
    # Causal with Lq > Lk: the first Lq - Lk queries of a sample see no key at all.
    q_lengths, k_lengths = [6, 20], [2, 0]
    tensors = _inputs(q_lengths, k_lengths, seed=8)
    out = _check_grads(q_lengths, k_lengths, tensors, tol=2e-5, causal=True)
    assert (out[:4] == 0).all() and (out[6:] == 0).all()
    assert (out[4:6] != 0).any()


@pytest.mark.parametrize("lengths", [[], [0, 0, 0]])
def test_empty_batches(interpret, lengths):
    tensors = _inputs(lengths, lengths, seed=0)
    q = tensors["q"].requires_grad_(True)
    out = jagged_flash_attention_triton(q, tensors["k"], tensors["v"], offsets_of(lengths))
    assert out.shape == (0, H, D)
    out.sum().backward()
    assert q.grad is not None and q.grad.shape == q.shape


@pytest.mark.parametrize(
    ("q_lengths", "k_lengths", "causal", "window"),
    [
        ([60, 3, 0, 33], [60, 3, 0, 33], True, None),  # causal band: right tiles skipped
        ([60, 21], [60, 21], False, (5, 3)),  # window: tiles skipped on both sides
        ([9, 50, 0, 40], [50, 9, 7, 0], True, (6, None)),  # Q != KV, bottom-right aligned
    ],
)
def test_jagged_bias_grad_written_everywhere(interpret, monkeypatch, q_lengths, k_lengths,
                                             causal, window):  # fmt: skip
    """Every d(jagged_bias) element is written by a kernel, zeros for skipped pairs."""
    buffers = []

    def recording_nan_buffer(jagged_bias):
        buffers.append(_nan_filled(jagged_bias))
        return buffers[-1]

    monkeypatch.setattr(jfa_triton, "_new_bias_grad", recording_nan_buffer)
    tensors = _inputs(q_lengths, k_lengths, seed=13, jagged=True)
    _check_grads(q_lengths, k_lengths, tensors, tol=2e-5, causal=causal, window=window)
    assert len(buffers) == 1 and not buffers[0].isnan().any()
    # Pairs no query sees get exactly zero (independent mask from the oracle's rules).
    visible = []
    for lq, lk in zip(q_lengths, k_lengths, strict=True):
        pos = torch.arange(lq)[:, None] + (lk - lq)
        keys = torch.arange(lk)[None, :]
        seen = torch.ones(lq, lk, dtype=torch.bool)
        if causal:
            seen &= keys <= pos
        if window is not None and window[0] is not None:
            seen &= keys >= pos - window[0]
        if window is not None and window[1] is not None:
            seen &= keys <= pos + window[1]
        visible.append(seen.reshape(-1))
    hidden = ~torch.cat(visible)
    assert hidden.any()
    assert (buffers[0][:, hidden] == 0).all()


def test_backward_is_deterministic(interpret):
    lengths = [40, 3, 0, 17]
    tensors = _inputs(lengths, lengths, seed=9, rel=24, jagged=True)
    grads = []
    for _ in range(2):
        leaves = {n: t.clone().requires_grad_(True) for n, t in tensors.items()}
        out = jagged_flash_attention_from_lengths(
            leaves["q"], leaves["k"], leaves["v"], torch.tensor(lengths), causal=True,
            rel_pos_bias=leaves["rel_pos_bias"], jagged_bias=leaves["jagged_bias"],
        )  # fmt: skip
        out.square().sum().backward()
        grads.append([leaves[n].grad for n in sorted(leaves)])
    for first, second in zip(*grads, strict=True):
        assert torch.equal(first, second)


FUSED = JfaTritonConfig(16, 16, 1, 1, 16, 16, 16, 16, 1, 1, bwd_fused=True)


@pytest.mark.parametrize(("causal", "window"), [(False, None), (True, None), (True, (20, None))])
def test_fused_dq_backward(interpret, causal, window):
    """dQ added by the dK/dV kernel (float32 atomics) matches the oracle, biases included."""
    tensors = _inputs(CROSS_Q, CROSS_K, seed=21, rel=9)
    _check_grads(CROSS_Q, CROSS_K, tensors, tol=2e-5, causal=causal, window=window, config=FUSED)
    # jagged_bias's gradient comes from the dQ kernel: such calls keep it.
    tensors = _inputs(CROSS_Q, CROSS_K, seed=22, jagged=True)
    _check_grads(CROSS_Q, CROSS_K, tensors, tol=2e-5, causal=causal, window=window, config=FUSED)


def test_fused_dq_yields_to_deterministic_mode(interpret, monkeypatch):
    lengths = [40, 3, 0, 17]
    tensors = _inputs(lengths, lengths, seed=23, rel=24)
    launched = []
    kernels = jfa_triton._kernels(True)
    real_dq_kernel = kernels.jfa_bwd_dq_kernel

    class Recording:
        def __getitem__(self, grid):
            launched.append(grid)
            return real_dq_kernel[grid]

    monkeypatch.setattr(kernels, "jfa_bwd_dq_kernel", Recording())

    def grads(config):
        leaves = {n: t.clone().requires_grad_(True) for n, t in tensors.items()}
        out = jagged_flash_attention_from_lengths(
            leaves["q"], leaves["k"], leaves["v"], torch.tensor(lengths), causal=True,
            rel_pos_bias=leaves["rel_pos_bias"], config=config,
        )  # fmt: skip
        out.square().sum().backward()
        return [leaves[n].grad for n in sorted(leaves)]

    grads(FUSED)
    assert not launched  # fused: no dQ kernel
    split = grads(replace(FUSED, bwd_fused=False))
    assert len(launched) == 1
    torch.use_deterministic_algorithms(True)
    try:
        deterministic = grads(FUSED)
    finally:
        torch.use_deterministic_algorithms(False)
    assert len(launched) == 2  # deterministic mode: the split backward, bit for bit
    for first, second in zip(split, deterministic, strict=True):
        assert torch.equal(first, second)


@pytest.mark.parametrize(
    ("causal", "window", "fused"),
    [(False, None, False), (True, None, True), (True, (20, 5), False), (False, (3, 30), True)],
)
def test_forward_one_loop(interpret, causal, window, fused):
    """The forward's one key loop that masks only the tiles needing it (diagonal, window
    edges, partial tiles) matches the oracle; biased calls keep the separate loops."""
    config = JfaTritonConfig(16, 16, 1, 1, 16, 16, 16, 16, 1, 1, fwd_one_loop=True, bwd_fused=fused)
    tensors = _inputs(CROSS_Q, CROSS_K, seed=27)
    _check_grads(CROSS_Q, CROSS_K, tensors, tol=2e-5, causal=causal, window=window, config=config)
    tensors = _inputs(CROSS_Q, CROSS_K, seed=28, rel=9, jagged=True)
    _check_grads(CROSS_Q, CROSS_K, tensors, tol=2e-5, causal=causal, window=window, config=config)


def test_other_tile_shapes(interpret):
    """Rectangular tiles (dK/dV keys 32 x queries 16, forward 16 x 32) give the same result."""
    config = JfaTritonConfig(16, 32, 1, 1, 32, 16, 32, 16, 1, 1, bwd_fused=False)
    tensors = _inputs(CROSS_Q, CROSS_K, seed=10, rel=11, jagged=True)
    _check_grads(CROSS_Q, CROSS_K, tensors, tol=2e-5, causal=True, window=(7, None), config=config)


@pytest.mark.parametrize("dkdv_block_m", [16, 32])
def test_rel_bias_gradient_reductions(interpret, dkdv_block_m):
    """The reductions of dS tiles in one clamped bucket (per key row, summed once per program)
    and of tiles spanning several buckets (diagonal sums) give the oracle's gradient, with
    square and rectangular dK/dV tiles; 5 buckets make most tiles fall in one clamped bucket,
    40 make most span several."""
    config = JfaTritonConfig(16, 16, 1, 1, 32, dkdv_block_m, 16, 16, 1, 1, bwd_fused=False)
    lengths = [70, 3, 0, 45]
    for num_buckets in (5, 40):
        tensors = _inputs(lengths, lengths, seed=13, rel=num_buckets)
        _check_grads(lengths, lengths, tensors, tol=2e-5, config=config)
        _check_grads(lengths, lengths, tensors, tol=2e-5, causal=True, config=config)


def test_default_config_choices():
    long = jfa_triton.default_config(128)
    short = jfa_triton.default_config(128, max_len=jfa_triton.SHORT_SEQUENCE_LEN)
    assert (short.fwd_block_m, short.fwd_block_n, short.fwd_warps) == (64, 32, 4)
    assert (short.dkdv_block_n, short.dq_block_m, short.bwd_warps) == (64, 64, 4)
    medium = jfa_triton.default_config(128, max_len=jfa_triton.SHORT_SEQUENCE_LEN + 1)
    assert medium == jfa_triton.default_config(128, max_len=jfa_triton.MEDIUM_SEQUENCE_LEN)
    assert _fwd(medium) == _fwd(long) and medium.dkdv_block_n == 64
    assert (medium.dq_block_m, medium.dq_warps) == (long.dq_block_m, 8)
    assert jfa_triton.default_config(128, max_len=jfa_triton.MEDIUM_SEQUENCE_LEN + 1) == long
    # Long unmasked calls take the fused backward; masked and shorter ones the split one.
    assert long.bwd_fused and not short.bwd_fused and not medium.bwd_fused
    masked = jfa_triton.default_config(128, masked=True)
    assert masked == replace(long, bwd_fused=False, fwd_one_loop=True)
    assert jfa_triton.default_config(128, max_len=16, masked=True).fwd_one_loop
    assert jfa_triton.default_config(128, max_len=1024, masked=True) == replace(
        short, fwd_one_loop=True
    )
    assert not long.fwd_one_loop and not short.fwd_one_loop
    assert jfa_triton.default_config(128, with_bias=True, max_len=16) == short
    rel = jfa_triton.default_config(128, with_bias=True, max_len=1025)
    assert rel == jfa_triton.default_config(128, with_bias=True)  # every longer batch
    assert _fwd(rel) == (128, 64, 8, 3) and (rel.dkdv_block_n, rel.dkdv_block_m) == (64, 32)
    assert (rel.dq_block_m, rel.dq_block_n, rel.dq_warps) == (128, 64, 8)
    for max_len in (16, None):
        jagged = jfa_triton.default_config(128, with_jagged_bias=True, max_len=max_len)
        assert _fwd(jagged) == (128, 64, 8, 3) and jagged.dq_block_n == 32
        assert (jagged.dkdv_block_n, jagged.dkdv_block_m, jagged.bwd_warps) == (128, 32, 8)
    small = jfa_triton.default_config(64, with_jagged_bias=True)
    assert (small.fwd_block_n, small.dkdv_block_m, small.dq_block_n) == (64, 32, 32)
    assert jfa_triton.default_config(16, interpret=True, max_len=8).fwd_block_m == 16


def _fwd(config):
    return (config.fwd_block_m, config.fwd_block_n, config.fwd_warps, config.fwd_stages)


def test_entry_point_passes_longest_sample_and_biases(interpret, monkeypatch):
    calls = []
    real = jfa_triton.default_config

    def recording(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(jfa_triton, "default_config", recording)
    q_lengths, k_lengths = [3, 0, 9], [2, 11, 1]
    tensors = _inputs(q_lengths, k_lengths, seed=14, jagged=True)
    jagged_flash_attention_triton(
        tensors["q"], tensors["k"], tensors["v"], offsets_of(q_lengths), offsets_of(k_lengths),
        jagged_bias=tensors["jagged_bias"],
    )  # fmt: skip
    assert calls[-1]["max_len"] == 11 and calls[-1]["with_jagged_bias"]
    assert not calls[-1]["with_bias"]
    # A window bounded on both sides caps the keys a row sees (causal: right = 0).
    for causal, window, expected in (
        (True, (4, None), 5),
        (False, (2, 3), 6),
        (False, (4, None), 11),
    ):
        jagged_flash_attention_triton(
            tensors["q"], tensors["k"], tensors["v"], offsets_of(q_lengths),
            offsets_of(k_lengths), causal=causal, window=window,
        )  # fmt: skip
        assert calls[-1]["max_len"] == expected, (causal, window)


def test_plan_has_only_real_tiles_longest_first():
    q_lengths = torch.tensor([0, 1, 16, 17, 100, 0, 5])
    k_lengths = torch.tensor([3, 0, 16, 40, 100, 2, 5])
    config = jfa_triton.default_config(D, interpret=True)
    plan = jfa_triton._plan(q_lengths, k_lengths, None, 0, config, torch.device("cpu"), True)
    expected_q_tiles = sum(-(-int(n) // 16) for n in q_lengths)
    expected_k_tiles = sum(-(-int(n) // 16) for n in k_lengths)
    assert plan.fwd.shape == (expected_q_tiles, 7)
    assert plan.dkdv.shape == (expected_k_tiles, 7)
    # Every (sample, tile) pair appears exactly once.
    pairs = {(int(r[0]), int(r[4])) for r in plan.fwd}
    assert len(pairs) == expected_q_tiles
    # Longest first: the 100-long sample's last (causal: heaviest) tile leads.
    assert int(plan.fwd[0, 1]) == 100 and int(plan.fwd[0, 4]) == 96


def test_plan_deals_tiles_sample_by_sample():
    """Each sample's tiles together (L2 reuse of its keys and values), samples with the
    longest tile first, and inside a sample the longest work first (causal: every tile's work
    differs)."""
    q_lengths = torch.tensor([0, 33, 16, 17, 100, 0, 100, 5])
    k_lengths = torch.tensor([3, 20, 16, 40, 100, 2, 100, 5])
    config = jfa_triton.default_config(D, interpret=True)
    plan = jfa_triton._plan(q_lengths, k_lengths, None, 0, config, torch.device("cpu"), True)
    for table, work_of in (
        (plan.fwd, lambda r: min(int(r[3]), int(r[4]) + 16 + int(r[3]) - int(r[1]))),
        (plan.dkdv, lambda r: int(r[1]) - max(0, int(r[4]) - (int(r[3]) - int(r[1])))),
    ):
        samples = [(int(r[0]), int(r[2])) for r in table]  # (q_start, k_start): the sample
        runs = [samples[0]] + [b for a, b in zip(samples, samples[1:], strict=False) if a != b]
        assert len(runs) == len(set(runs)), "each sample's tiles are contiguous"
        works = [work_of(r) for r in table]
        heads = [max(w for w, s in zip(works, samples, strict=True) if s == run) for run in runs]
        assert heads == sorted(heads, reverse=True), "samples longest first"
        for run in runs:
            mine = [w for w, s in zip(works, samples, strict=True) if s == run]
            assert mine == sorted(mine, reverse=True), "tiles longest work first"


def test_plan_cache_reuses_only_identical_batches():
    config = jfa_triton.default_config(D, interpret=True)
    cpu = torch.device("cpu")
    lengths = torch.tensor([5, 40, 0, 17])
    first = jfa_triton._plan(lengths, lengths, None, 0, config, cpu, True)
    assert jfa_triton._plan(lengths.clone(), lengths.clone(), None, 0, config, cpu, True) is first
    # A different length, mask or tiling gets its own tables.
    other = torch.tensor([5, 40, 0, 18])
    changed = jfa_triton._plan(other, other, None, 0, config, cpu, True)
    assert changed is not first
    assert int(changed.fwd[:, 1].sum()) == sum(-(-n // 16) * n for n in (5, 40, 0, 18))
    assert jfa_triton._plan(lengths, lengths, 3, 0, config, cpu, True) is not first
    assert jfa_triton._plan(lengths, lengths, None, 0, config, cpu, False) is not first
    # The cache is bounded.
    for n in range(3 * jfa_triton._PLAN_CACHE.maxsize):
        jfa_triton._plan(torch.tensor([n + 1]), torch.tensor([n + 1]), None, 0, config, cpu, True)
    assert len(jfa_triton._PLAN_CACHE) <= jfa_triton._PLAN_CACHE.maxsize


def test_public_entry_point_dispatch(interpret, monkeypatch):
    lengths = [3, 0, 20]
    tensors = _inputs(lengths, lengths, seed=11)
    offsets = offsets_of(lengths)
    args = (tensors["q"], tensors["k"], tensors["v"], offsets)
    via_triton = jagged_flash_attention(*args, causal=True, backend="triton")
    via_reference = jagged_flash_attention(*args, causal=True, backend="reference")
    torch.testing.assert_close(via_triton, via_reference, atol=1e-5, rtol=1e-5)

    # "auto" on CPU float32 is the reference even under the interpreter.
    def boom(*_, **__):
        raise AssertionError("auto must not run the Triton path on CPU")

    monkeypatch.setattr(jfa_triton, "forward_from_lengths", boom)
    torch.testing.assert_close(jagged_flash_attention(*args, causal=True), via_reference)


def test_operator_backends_agree(interpret):
    """Through ``torch.ops.gem_kernels.jagged_flash_attention`` (the public function's path) and
    its backward operator: the Triton backend's output, log-sum-exp and every gradient match
    the reference backend's (rows without a visible key: +inf in both)."""
    q_lengths, k_lengths = [0, 1, 5, 17], [3, 0, 17, 4]
    tensors = _inputs(q_lengths, k_lengths, seed=21, rel=5, jagged=True)
    grad_out = torch.randn(sum(q_lengths), H, D, generator=torch.Generator().manual_seed(22))
    results = {}
    for backend in ("triton", "reference"):
        leaves = {n: t.clone().requires_grad_(True) for n, t in tensors.items()}
        out, lse = torch.ops.gem_kernels.jagged_flash_attention(
            leaves["q"], leaves["k"], leaves["v"], offsets_of(q_lengths), offsets_of(k_lengths),
            leaves["rel_pos_bias"], leaves["jagged_bias"], None, None, 0.3, True, 6, None,
            backend,
        )  # fmt: skip
        out.backward(grad_out)
        results[backend] = (out, lse, {n: leaf.grad for n, leaf in leaves.items()})
    (out, lse, grads), (ref_out, ref_lse, ref_grads) = results["triton"], results["reference"]
    assert torch.isinf(ref_lse).any()
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], atol=1e-4, rtol=1e-4, msg=name)


def test_backend_errors(monkeypatch):
    lengths = [3, 4]
    tensors = _inputs(lengths, lengths, seed=12)
    args = (tensors["q"], tensors["k"], tensors["v"], offsets_of(lengths))
    with pytest.raises(ValueError, match="backend must be one of"):
        jagged_flash_attention(*args, backend="cuda")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        jagged_flash_attention(*args, backend="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    doubles = [t.double() for t in args[:3]]
    with pytest.raises(ValueError, match="float64"):
        jagged_flash_attention(*doubles, args[3], backend="triton")
    with pytest.raises(ValueError, match="head_dim 320"):
        wide = torch.zeros(7, 1, 320)
        jagged_flash_attention(wide, wide, wide, args[3], backend="triton")


# No shrinking phase: one interpreted example takes ~1 s, shrinking could take minutes.
@settings(max_examples=6, deadline=None, phases=(Phase.explicit, Phase.reuse, Phase.generate))
@given(
    data=st.data(),
    batch=st.integers(0, 3),
    causal=st.booleans(),
    window=st.one_of(
        st.none(),
        st.tuples(
            st.one_of(st.none(), st.integers(0, 20)), st.one_of(st.none(), st.integers(0, 20))
        ),
    ),
    use_rel=st.booleans(),
    use_jagged=st.booleans(),
    cross=st.booleans(),
)
def test_random_jagged_shapes(data, batch, causal, window, use_rel, use_jagged, cross):
    q_lengths = data.draw(st.lists(st.integers(0, 40), min_size=batch, max_size=batch))
    k_lengths = (
        data.draw(st.lists(st.integers(0, 40), min_size=batch, max_size=batch))
        if cross
        else q_lengths
    )
    rel = data.draw(st.integers(1, 40)) if use_rel else None
    tensors = _inputs(q_lengths, k_lengths, seed=data.draw(st.integers(0, 2**16)), heads=1,
                      rel=rel, jagged=use_jagged)  # fmt: skip
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "1")
        _check_grads(q_lengths, k_lengths, tensors, tol=2e-5, causal=causal, window=window)


# ---------------------------------------------------------------------------------------------
# GPU (compiled kernels, larger shapes).

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _gpu_case(q_lengths, k_lengths, dtype, *, seed, heads=4, dim=128, rel=None, jagged=False,
              config=None, **options):  # fmt: skip
    tensors = {
        n: t.cuda()
        for n, t in _inputs(
            q_lengths,
            k_lengths,
            seed=seed,
            dtype=dtype,
            heads=heads,
            dim=dim,
            rel=rel,
            jagged=jagged,
        ).items()  # fmt: skip
    }
    leaves = {n: t.clone().requires_grad_(True) for n, t in tensors.items()}
    ref_leaves = {n: t.float().requires_grad_(True) for n, t in tensors.items()}
    biases = {n: leaves[n] for n in ("rel_pos_bias", "jagged_bias") if n in leaves}
    ref_biases = {n: ref_leaves[n] for n in biases}
    q_off, k_off = offsets_of(q_lengths), offsets_of(k_lengths)
    if config is None:
        out = jagged_flash_attention(
            leaves["q"], leaves["k"], leaves["v"], q_off, k_off, backend="triton", **biases,
            **options,
        )  # fmt: skip
    else:
        out = jagged_flash_attention_from_lengths(
            leaves["q"], leaves["k"], leaves["v"], torch.tensor(q_lengths),
            torch.tensor(k_lengths), config=config, **biases, **options,
        )  # fmt: skip
    expected = jagged_flash_attention_reference(
        ref_leaves["q"], ref_leaves["k"], ref_leaves["v"], q_off, k_off, **ref_biases, **options
    )
    grad_out = torch.randn_like(expected)
    (out.float() * grad_out).sum().backward()
    (expected * grad_out).sum().backward()
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    pairs = [("out", out.float(), expected)]
    pairs += [(n, leaves[n].grad.float(), ref_leaves[n].grad) for n in leaves]
    for name, got, want in pairs:
        error = (got - want).norm() / want.norm().clamp(min=1e-6)
        assert torch.isfinite(got).all(), name
        assert error < tol, (name, float(error))


@pytest.mark.gpu
@cuda_only
@pytest.mark.parametrize(
    ("dtype", "causal", "window", "longest"),
    [
        (torch.bfloat16, False, None, 2048),
        (torch.bfloat16, True, None, 2048),
        (torch.bfloat16, True, (256, None), 2048),
        (torch.float16, True, None, 2048),
        (torch.bfloat16, True, None, 1000),  # the short tiles
        (torch.bfloat16, True, (256, None), 1000),  # the GEM model's window, short tiles
        (torch.bfloat16, False, None, 4100),  # the long tiles
    ],
)
def test_gpu_matches_reference(dtype, causal, window, longest, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, min(longest, 1024) + 1, (24,), generator=gen).tolist()
    lengths += [0, 1, longest]
    _gpu_case(lengths, lengths, dtype, seed=1, causal=causal, window=window)


@pytest.mark.gpu
@cuda_only
def test_gpu_cross_attention_with_biases(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q_lengths = [0, 1, 300, 77, 513, 64]
    k_lengths = [5, 0, 129, 600, 513, 1]
    _gpu_case(q_lengths, k_lengths, torch.bfloat16, seed=2, rel=257, jagged=True, causal=True,
              window=(200, None))  # fmt: skip


@pytest.mark.gpu
@cuda_only
@pytest.mark.parametrize("regime", [1024, None])
@pytest.mark.parametrize(
    "variant",
    [{"bwd_fused": True}, {"fwd_one_loop": True}, {"fwd_one_loop": True, "bwd_fused": True}],
    ids=["fused", "fwd_one_loop", "fwd_one_loop_fused"],
)
@pytest.mark.parametrize(("causal", "window"), [(False, None), (True, (100, None))])
def test_gpu_variants(regime, variant, causal, window, monkeypatch):
    """The fused backward (dQ by TMA bulk reduces; rows past a sample add zeros to the next
    one) and the forward's one key loop, with the short and long tiles, cross attention."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    config = replace(jfa_triton.default_config(128, max_len=regime), **variant)
    q_lengths = [0, 1, 300, 77, 1000, 64, 257, 130]
    k_lengths = [5, 0, 129, 600, 1000, 1, 257, 700]
    rel = 33 if regime else None  # the long forward tiles have no rel_pos_bias variant
    _gpu_case(q_lengths, k_lengths, torch.bfloat16, seed=3, config=config, causal=causal,
              window=window, rel=rel)  # fmt: skip
    if rel:  # biased calls keep the separate loops: the one-loop kernels unbiased as well
        _gpu_case(q_lengths, k_lengths, torch.bfloat16, seed=4, config=config, causal=causal,
                  window=window)  # fmt: skip


@pytest.mark.parametrize("training", [True, False])
def test_a_training_call_plans_its_backward_once_in_the_forward(interpret, monkeypatch, training):
    """The forward of a call whose inputs need gradients plans the backward's work lists too,
    and the backward reuses that plan: one plan per lengths, none built mid-backward. Under
    no_grad only the forward's is built."""
    built = plans_built(monkeypatch, jfa_triton, "_build_plan")
    lengths = torch.tensor([7, 0, 23, 41, 3 + training])  # lengths no other test plans
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(int(lengths.sum()), 2, 16, generator=gen) for _ in range(3))
    offsets = offsets_of(lengths)
    if training:
        leaves = [t.requires_grad_(True) for t in (q, k, v)]
        jagged_flash_attention(*leaves, offsets, causal=True, backend="triton").sum().backward()
        assert built == [True]
    else:
        with torch.no_grad():
            jagged_flash_attention(q, k, v, offsets, causal=True, backend="triton")
        assert built == [False]
