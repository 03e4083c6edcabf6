"""block_attention vs a naive per-sample oracle (complex-number RoPE, explicit block mask)."""

import pytest
import torch
from gem_kernels import block_attention
from gem_kernels.reference import apply_rope, block_attention_reference
from hypothesis import given, settings
from hypothesis import strategies as st
from kernels_naive import check_forward_and_grads, make_jagged, naive_block_attention, offsets_of

H, D = 2, 6
# empty, length 1, exactly one block, one over, a long sample with a partial last block
LENGTHS = [0, 1, 5, 64, 65, 150, 7]


def _inputs(total, seed=0, dim=D):
    return {
        "q": make_jagged(total, H, dim, seed=seed),
        "k": make_jagged(total, H, dim, seed=seed + 1),
        "v": make_jagged(total, H, dim, seed=seed + 2),
    }


@pytest.mark.parametrize("block_size", [64, 5, 1, 1000])
def test_matches_naive(block_size):
    offsets = offsets_of(LENGTHS)
    check_forward_and_grads(
        lambda q, k, v: block_attention(q, k, v, offsets, max_len=150, block_size=block_size),
        lambda q, k, v: naive_block_attention(q, k, v, LENGTHS, block_size=block_size),
        _inputs(sum(LENGTHS)),
    )


def test_custom_positions_theta_and_scale():
    lengths = [3, 0, 10, 4]
    offsets = offsets_of(lengths)
    positions = torch.randint(0, 5000, (sum(lengths),), generator=torch.Generator().manual_seed(3))
    check_forward_and_grads(
        lambda q, k, v: block_attention(
            q, k, v, offsets, block_size=4, positions=positions, rope_theta=500.0, scale=0.25
        ),
        lambda q, k, v: naive_block_attention(
            q, k, v, lengths, block_size=4, positions=positions, rope_theta=500.0, scale=0.25
        ),
        _inputs(sum(lengths), seed=8, dim=8),
    )


def test_rope_is_a_rotation_with_relative_scores():
    """q.k after RoPE depends only on the position difference (checks the convention)."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(1, 1, 8, generator=gen, dtype=torch.float64)

    def score(pq, pk):
        rq = apply_rope(q, torch.tensor([pq]))
        rk = apply_rope(k, torch.tensor([pk]))
        return float((rq * rk).sum())

    assert score(7, 3) == pytest.approx(score(104, 100), rel=1e-9)
    torch.testing.assert_close(apply_rope(q, torch.tensor([0])), q)
    rotated = apply_rope(q, torch.tensor([123]))
    torch.testing.assert_close(rotated.norm(), q.norm())
    # rotate-half pairs: the first pair (x0, x4) is rotated by angle 123 * theta^0 = 123 rad
    angle = torch.tensor(123.0, dtype=torch.float64)
    expected0 = q[0, 0, 0] * torch.cos(angle) - q[0, 0, 4] * torch.sin(angle)
    torch.testing.assert_close(rotated[0, 0, 0], expected0)


def test_blocks_do_not_cross_samples():
    """Changing one sample's tokens leaves every other sample's output unchanged."""
    lengths = [3, 5]
    offsets = offsets_of(lengths)
    t = _inputs(8, seed=1)
    base = block_attention(t["q"], t["k"], t["v"], offsets, block_size=64)
    v2 = t["v"].clone()
    v2[3:] += 1.0
    changed = block_attention(t["q"], t["k"], v2, offsets, block_size=64)
    torch.testing.assert_close(changed[:3], base[:3])
    assert not torch.allclose(changed[3:], base[3:])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_low_precision_inputs_return_input_dtype(dtype):
    offsets = offsets_of(LENGTHS)
    t = {n: x.to(dtype) for n, x in _inputs(sum(LENGTHS), seed=2).items()}
    out = block_attention(t["q"], t["k"], t["v"], offsets, block_size=16)
    assert out.dtype == dtype
    expected = naive_block_attention(t["q"], t["k"], t["v"], LENGTHS, block_size=16)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)


@settings(max_examples=25, deadline=None)
@given(
    data=st.data(),
    lengths=st.lists(st.integers(0, 14), max_size=4),
    block_size=st.integers(1, 6),
    heads=st.integers(1, 2),
    half_dim=st.integers(1, 3),
    use_positions=st.booleans(),
)
def test_random_jagged_shapes(data, lengths, block_size, heads, half_dim, use_positions):
    dim = 2 * half_dim
    total = sum(lengths)
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    tensors = {
        name: torch.randn(total, heads, dim, generator=gen, dtype=torch.float64)
        for name in ("q", "k", "v")
    }
    positions = torch.randint(0, 100, (total,), generator=gen) if use_positions else None
    offsets = offsets_of(lengths)
    budget = data.draw(st.sampled_from([3, 50, 1 << 22]))
    check_forward_and_grads(
        lambda q, k, v: block_attention_reference(
            q, k, v, offsets, block_size=block_size, positions=positions, score_budget=budget
        ),
        lambda q, k, v: naive_block_attention(
            q, k, v, lengths, block_size=block_size, positions=positions
        ),
        tensors,
    )


def test_rope_tables_give_apply_ropes_float32_result_exactly():
    from gem_kernels.reference import rope_tables

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(37, 3, 10, generator=generator)
    positions = torch.tensor([0, 1, 2, 35, 36, 5, 1000, 4095] + list(range(29)))
    tables = rope_tables(4096, 10, theta=500.0)
    assert tables[0].shape == (4096, 5) and tables[0].dtype == torch.float32
    expected = apply_rope(x, positions, 500.0)
    assert torch.equal(apply_rope(x, positions, tables=tables), expected)
