"""Triton block attention (fused RoPE) vs the naive float64 oracle: output and every gradient.

CPU tests run the kernels under the Triton interpreter: the ``interpret`` fixture sets
``TRITON_INTERPRET=1`` through monkeypatch (gem_kernels.block_attention_triton loads an
interpreted copy of the kernel module at call time) and removes it afterwards. Blocks are the
production 64 tokens; head_dim 16 keeps the interpreter fast. GPU tests (``-m gpu``) use the
compiled kernels at D=128.
"""

from __future__ import annotations

import pytest
import torch
from gem_kernels import block_attention
from gem_kernels.block_attention_triton import (
    BlockAttentionTritonConfig,
    block_attention_from_lengths,
    block_attention_triton,
)
from gem_kernels.reference import block_attention_reference
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from kernels_naive import naive_block_attention, offsets_of

H, D = 2, 16
# empty, length 1, partial block, exactly one block, one over, a long sample, another partial
LENGTHS = [0, 1, 5, 64, 65, 150, 7]


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _inputs(lengths, *, seed, dtype=torch.float32, heads=H, dim=D):
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    return {n: torch.randn(total, heads, dim, generator=gen).to(dtype) for n in ("q", "k", "v")}


def _check(lengths, tensors, *, tol, **options):
    """Output and the gradients of q, k, v of the Triton path against the float64 oracle."""
    leaves = {n: t.clone().requires_grad_(True) for n, t in tensors.items()}
    oracle = {n: t.double().requires_grad_(True) for n, t in tensors.items()}
    out = block_attention_triton(leaves["q"], leaves["k"], leaves["v"], offsets_of(lengths),
                                 **options)  # fmt: skip
    expected = naive_block_attention(oracle["q"], oracle["k"], oracle["v"], lengths, **options)
    assert out.dtype == tensors["q"].dtype and out.shape == expected.shape
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)
    grad_out = torch.randn(expected.shape, generator=torch.Generator().manual_seed(9),
                           dtype=torch.float64)  # fmt: skip
    (out.double() * grad_out).sum().backward()
    (expected * grad_out).sum().backward()
    for name in tensors:
        got, want = leaves[name].grad, oracle[name].grad
        if want is None:  # no tokens: the oracle's output does not depend on the input
            want = torch.zeros_like(oracle[name])
        assert got is not None and got.dtype == tensors[name].dtype, name
        torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol, msg=f"grad of {name}")
    return out


def test_matches_naive_edge_lengths(interpret):
    _check(LENGTHS, _inputs(LENGTHS, seed=0), tol=2e-5)


def test_one_long_sequence_among_short_ones(interpret):
    lengths = [700, 1, 0, 3]  # 11 blocks for the long sample, the last one partial
    _check(lengths, _inputs(lengths, seed=1), tol=2e-5)


def test_custom_positions_theta_and_scale(interpret):
    lengths = [3, 0, 70, 4]
    gen = torch.Generator().manual_seed(3)
    # Large positions: the in-kernel angle is reduced in fixed point, so they stay accurate.
    positions = torch.randint(0, 2_000_000, (sum(lengths),), generator=gen)
    _check(lengths, _inputs(lengths, seed=2), tol=2e-5, positions=positions, rope_theta=500.0,
           scale=0.3)  # fmt: skip
    _check(lengths, _inputs(lengths, seed=4), tol=2e-5, positions=positions.int())


@pytest.mark.parametrize(
    ("block_size", "lengths"), [(1, [0, 1, 6]), (5, [2, 0, 23]), (16, [1, 37]), (128, [0, 130, 1])]
)
def test_other_block_sizes(interpret, block_size, lengths):
    _check(lengths, _inputs(lengths, seed=5), tol=2e-5, block_size=block_size)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float16, 4e-3), (torch.bfloat16, 3e-2)])
def test_half_precision_inputs(interpret, dtype, tol):
    lengths = [1, 64, 90]
    _check(lengths, _inputs(lengths, seed=6, dtype=dtype), tol=tol)


def test_head_dim_not_a_power_of_two(interpret):
    lengths = [5, 66]
    _check(lengths, _inputs(lengths, seed=7, heads=3, dim=24), tol=2e-5)


@pytest.mark.parametrize("lengths", [[], [0, 0]])
def test_no_tokens(interpret, lengths):
    tensors = {n: t.requires_grad_(True) for n, t in _inputs(lengths, seed=0).items()}
    out = block_attention_triton(tensors["q"], tensors["k"], tensors["v"], offsets_of(lengths))
    assert out.shape == (0, H, D)
    out.sum().backward()
    assert all(t.grad.shape == (0, H, D) for t in tensors.values())


def test_non_contiguous_inputs(interpret):
    lengths = [9, 70]
    gen = torch.Generator().manual_seed(8)
    wide = torch.randn(sum(lengths), H, 3 * D, generator=gen)
    q, k, v = wide[..., :D], wide[..., D : 2 * D], wide[..., 2 * D :]
    got = block_attention_triton(q, k, v.transpose(0, 1).contiguous().transpose(0, 1),
                                 offsets_of(lengths))  # fmt: skip
    want = naive_block_attention(q.double(), k.double(), v.double(), lengths)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)


def test_heads_per_program_and_from_lengths(interpret):
    lengths = [3, 66]
    tensors = _inputs(lengths, seed=9, heads=4)
    want = naive_block_attention(*(tensors[n].double() for n in "qkv"), lengths)
    for per_program in (1, 3, 4):  # 3 does not divide H=4: reduced to gcd = 1
        config = BlockAttentionTritonConfig(per_program, 1, 1, per_program, 1, 1)
        got = block_attention_from_lengths(*(tensors[n] for n in "qkv"), torch.tensor(lengths),
                                           config=config)  # fmt: skip
        torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("per_program", [1, 2, 4])
def test_forward_with_positions(interpret, per_program):
    # Explicit positions with 1, 2 and 4 heads per forward program (the per-block table).
    tensors = _inputs(LENGTHS, seed=4, heads=4)
    positions = torch.randint(0, 1 << 20, (sum(LENGTHS),), generator=torch.Generator())
    want = naive_block_attention(*(tensors[n].double() for n in "qkv"), LENGTHS,
                                 positions=positions)  # fmt: skip
    config = BlockAttentionTritonConfig(per_program, 1, 2, 2, 1, 1)
    got = block_attention_from_lengths(*(tensors[n] for n in "qkv"), torch.tensor(LENGTHS),
                                       positions=positions, config=config)  # fmt: skip
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)


@settings(max_examples=10, deadline=None, phases=[Phase.explicit, Phase.generate])
@given(
    lengths=st.lists(st.integers(0, 140), max_size=3),
    block_size=st.sampled_from([16, 64, 100]),
    heads=st.integers(1, 2),
    half_dim=st.sampled_from([1, 3, 8]),
    use_positions=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_random_jagged_shapes(lengths, block_size, heads, half_dim, use_positions, seed):
    dim = 2 * half_dim
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    tensors = {n: torch.randn(total, heads, dim, generator=gen) for n in ("q", "k", "v")}
    positions = torch.randint(0, 5000, (total,), generator=gen) if use_positions else None
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "1")
        _check(lengths, tensors, tol=2e-5, block_size=block_size, positions=positions)


# ---------------------------------------------------------------------------------------------
# Dispatch and errors.


def test_public_backends_agree(interpret):
    tensors = _inputs(LENGTHS, seed=11)
    offsets = offsets_of(LENGTHS)
    via_triton = block_attention(*tensors.values(), offsets, backend="triton")
    via_reference = block_attention(*tensors.values(), offsets, backend="reference")
    via_auto = block_attention(*tensors.values(), offsets)  # CPU float32: the reference
    torch.testing.assert_close(via_triton, via_reference, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(via_auto, via_reference, atol=0, rtol=0)
    direct = block_attention_reference(*tensors.values(), offsets)
    torch.testing.assert_close(via_reference, direct, atol=0, rtol=0)


def test_operator_gradients_match_reference(interpret):
    """The public function through ``torch.ops.gem_kernels.block_attention`` and its backward
    operator, with RoPE positions: output and every gradient of the Triton backend match the
    reference backend's."""
    lengths = [0, 1, 9, 20]
    tensors = _inputs(lengths, seed=12)
    positions = torch.randint(0, 100, (sum(lengths),), generator=torch.Generator().manual_seed(1))
    results = {}
    for backend in ("triton", "reference"):
        leaves = [t.clone().requires_grad_(True) for t in tensors.values()]
        out = block_attention(*leaves, offsets_of(lengths), block_size=8, positions=positions,
                              rope_theta=500.0, backend=backend)  # fmt: skip
        out.backward(torch.ones_like(out))
        results[backend] = (out, [leaf.grad for leaf in leaves])
    (out, grads), (ref_out, ref_grads) = results["triton"], results["reference"]
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    for name, grad, ref in zip("qkv", grads, ref_grads, strict=True):
        torch.testing.assert_close(grad, ref, atol=1e-4, rtol=1e-4, msg=f"grad of {name}")


def test_triton_backend_refusals(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    tensors = _inputs([4], seed=0)
    offsets = offsets_of([4])
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        block_attention(*tensors.values(), offsets, backend="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    doubles = [t.double() for t in tensors.values()]
    with pytest.raises(ValueError, match="backend='triton'.*float64"):
        block_attention(*doubles, offsets, backend="triton")
    with pytest.raises(ValueError, match="block_size 200 is larger than 128"):
        block_attention(*tensors.values(), offsets, block_size=200, backend="triton")
    # auto falls back to the reference for what the kernels do not take
    out = block_attention(*doubles, offsets, block_size=200)
    assert out.dtype == torch.float64


@pytest.mark.parametrize("backend", ["cuda", "", None, "Triton"])
def test_bad_backend_is_rejected(backend):
    tensors = _inputs([4], seed=0)
    with pytest.raises(ValueError, match="backend must be one of"):
        block_attention(*tensors.values(), offsets_of([4]), backend=backend)


# ---------------------------------------------------------------------------------------------
# GPU (compiled kernels, production shapes).

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@cuda_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_positions", [False, True])
def test_gpu_matches_reference(dtype, with_positions, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 1025, (24,), generator=gen).tolist() + [0, 1, 64, 4097]
    tensors = {n: t.cuda() for n, t in _inputs(lengths, seed=1, dtype=dtype, heads=4,
                                                   dim=128).items()}  # fmt: skip
    positions = None
    if with_positions:
        positions = torch.randint(0, 100_000, (sum(lengths),), generator=gen).cuda()
    leaves = {n: t.clone().requires_grad_(True) for n, t in tensors.items()}
    ref = {n: t.float().requires_grad_(True) for n, t in tensors.items()}
    offsets = offsets_of(lengths)
    out = block_attention(*leaves.values(), offsets, positions=positions)  # auto: Triton
    expected = block_attention_reference(*ref.values(), offsets, positions=positions)
    grad_out = torch.randn_like(expected)
    (out.float() * grad_out).sum().backward()
    (expected * grad_out).sum().backward()
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    pairs = [("out", out.float(), expected)]
    pairs += [(n, leaves[n].grad.float(), ref[n].grad) for n in leaves]
    for name, got, want in pairs:
        error = (got - want).norm() / want.norm().clamp(min=1e-6)
        assert torch.isfinite(got).all(), name
        assert error < tol, (name, float(error))


def test_plan_is_cached_per_lengths_and_options(interpret):
    from gem_kernels import block_attention_triton as bat

    config = bat.default_config(D, interpret=True)
    cpu = torch.device("cpu")
    lengths = torch.tensor([5, 0, 70, 64])
    first = bat._plan(lengths, 64, D, 10000.0, 0.25, config, True, cpu)
    assert bat._plan(lengths.clone(), 64, D, 10000.0, 0.25, config, True, cpu) is first
    assert (
        bat._plan(torch.tensor([5, 0, 70, 65]), 64, D, 10000.0, 0.25, config, True, cpu)
        is not first
    )
    assert bat._plan(lengths, 32, D, 10000.0, 0.25, config, True, cpu) is not first
    assert bat._plan(lengths, 64, D, 500.0, 0.25, config, True, cpu) is not first
    for n in range(3 * bat._PLAN_CACHE.maxsize):
        bat._plan(torch.tensor([n + 1]), 64, D, 10000.0, 0.25, config, True, cpu)
    assert len(bat._PLAN_CACHE) <= bat._PLAN_CACHE.maxsize
