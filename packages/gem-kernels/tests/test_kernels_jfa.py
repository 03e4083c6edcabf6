"""jagged_flash_attention vs the naive per-sample float64 oracle: outputs and all gradients."""

import pytest
import torch
from gem_kernels import jagged_flash_attention
from gem_kernels.reference import jagged_flash_attention_reference
from hypothesis import given, settings
from hypothesis import strategies as st
from kernels_naive import check_forward_and_grads, make_jagged, naive_jfa, offsets_of

H, D = 2, 8
SELF_LENGTHS = [0, 1, 5, 70, 3, 0, 17]  # empty, length 1, > 64 and not a power of two
LONG_SKEWED = [150] + [2] * 12 + [0, 1]  # one sequence much longer than the rest


def _self_inputs(lengths, seed=0):
    total = sum(lengths)
    return {
        "q": make_jagged(total, H, D, seed=seed),
        "k": make_jagged(total, H, D, seed=seed + 1),
        "v": make_jagged(total, H, D, seed=seed + 2),
    }


def _cross_inputs(q_lengths, k_lengths, seed=0):
    return {
        "q": make_jagged(sum(q_lengths), H, D, seed=seed),
        "k": make_jagged(sum(k_lengths), H, D, seed=seed + 1),
        "v": make_jagged(sum(k_lengths), H, D, seed=seed + 2),
    }


WINDOWS = [None, (3, 2), (None, 0), (4, None), (0, 0)]


@pytest.mark.parametrize("lengths", [SELF_LENGTHS, LONG_SKEWED])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", WINDOWS)
def test_self_attention_matches_naive(lengths, causal, window):
    offsets = offsets_of(lengths)
    check_forward_and_grads(
        lambda q, k, v: jagged_flash_attention(q, k, v, offsets, causal=causal, window=window),
        lambda q, k, v: naive_jfa(q, k, v, lengths, causal=causal, window=window),
        _self_inputs(lengths),
    )


# Lq > Lk (KV shorter than queries), Lk = 0 with Lq > 0, Lq = 0 with Lk > 0, Lq < Lk.
CROSS_Q = [0, 1, 5, 9, 2, 4, 66]
CROSS_K = [3, 0, 17, 4, 1, 4, 20]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [None, (2, 1), (0, None)])
def test_cross_attention_bottom_right_alignment(causal, window):
    q_off, k_off = offsets_of(CROSS_Q), offsets_of(CROSS_K)
    check_forward_and_grads(
        lambda q, k, v: jagged_flash_attention(
            q, k, v, q_off, k_off, max_q=66, max_k=20, causal=causal, window=window
        ),
        lambda q, k, v: naive_jfa(q, k, v, CROSS_Q, CROSS_K, causal=causal, window=window),
        _cross_inputs(CROSS_Q, CROSS_K),
    )


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("num_buckets", [1, 7, 16])
def test_biases_get_gradients(causal, num_buckets):
    q_off, k_off = offsets_of(CROSS_Q), offsets_of(CROSS_K)
    bias_len = sum(a * b for a, b in zip(CROSS_Q, CROSS_K, strict=True))
    gen = torch.Generator().manual_seed(5)
    tensors = _cross_inputs(CROSS_Q, CROSS_K, seed=3)
    tensors["rel_pos_bias"] = torch.randn(H, num_buckets, generator=gen, dtype=torch.float64)
    tensors["jagged_bias"] = torch.randn(H, bias_len, generator=gen, dtype=torch.float64)
    check_forward_and_grads(
        lambda q, k, v, rel_pos_bias, jagged_bias: jagged_flash_attention(
            q,
            k,
            v,
            q_off,
            k_off,
            causal=causal,
            window=(5, 3),
            rel_pos_bias=rel_pos_bias,
            jagged_bias=jagged_bias,
        ),
        lambda q, k, v, rel_pos_bias, jagged_bias: naive_jfa(
            q,
            k,
            v,
            CROSS_Q,
            CROSS_K,
            causal=causal,
            window=(5, 3),
            rel_pos_bias=rel_pos_bias,
            jagged_bias=jagged_bias,
        ),
        tensors,
    )


def test_custom_scale_and_self_attention_bias():
    lengths = LONG_SKEWED
    offsets = offsets_of(lengths)
    gen = torch.Generator().manual_seed(9)
    tensors = _self_inputs(lengths, seed=11)
    tensors["jagged_bias"] = torch.randn(
        H, sum(n * n for n in lengths), generator=gen, dtype=torch.float64
    )
    check_forward_and_grads(
        lambda q, k, v, jagged_bias: jagged_flash_attention(
            q, k, v, offsets, scale=0.7, causal=True, jagged_bias=jagged_bias
        ),
        lambda q, k, v, jagged_bias: naive_jfa(
            q, k, v, lengths, scale=0.7, causal=True, jagged_bias=jagged_bias
        ),
        tensors,
    )


@pytest.mark.parametrize("budget", [1, 37, 500, 5000])
def test_chunking_under_tiny_score_budget(budget):
    """Row- and sample-chunking (forced by a tiny budget) must not change the result."""
    q_off, k_off = offsets_of(CROSS_Q), offsets_of(CROSS_K)
    bias_len = sum(a * b for a, b in zip(CROSS_Q, CROSS_K, strict=True))
    tensors = _cross_inputs(CROSS_Q, CROSS_K, seed=21)
    gen = torch.Generator().manual_seed(2)
    tensors["rel_pos_bias"] = torch.randn(H, 9, generator=gen, dtype=torch.float64)
    tensors["jagged_bias"] = torch.randn(H, bias_len, generator=gen, dtype=torch.float64)
    check_forward_and_grads(
        lambda q, k, v, rel_pos_bias, jagged_bias: jagged_flash_attention_reference(
            q,
            k,
            v,
            q_off,
            k_off,
            causal=True,
            rel_pos_bias=rel_pos_bias,
            jagged_bias=jagged_bias,
            score_budget=budget,
        ),
        lambda q, k, v, rel_pos_bias, jagged_bias: naive_jfa(
            q,
            k,
            v,
            CROSS_Q,
            CROSS_K,
            causal=True,
            rel_pos_bias=rel_pos_bias,
            jagged_bias=jagged_bias,
        ),
        tensors,
    )


def test_fully_masked_rows_are_zero_not_nan():
    # Causal with Lq > Lk: the first Lq - Lk queries see no key at all.
    q_lengths, k_lengths = [6], [2]
    tensors = _cross_inputs(q_lengths, k_lengths)
    out = jagged_flash_attention(
        tensors["q"],
        tensors["k"],
        tensors["v"],
        offsets_of(q_lengths),
        offsets_of(k_lengths),
        causal=True,
    )
    assert torch.isfinite(out).all()
    assert (out[:4] == 0).all()
    assert (out[4:] != 0).any()


@pytest.mark.parametrize("lengths", [[], [0, 0, 0]])
def test_empty_batches(lengths):
    tensors = _self_inputs(lengths)
    q = tensors["q"].requires_grad_(True)
    out = jagged_flash_attention(q, tensors["k"], tensors["v"], offsets_of(lengths))
    assert out.shape == (0, H, D)
    out.sum().backward()  # stays attached to the graph
    assert q.grad is not None and q.grad.shape == q.shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_low_precision_inputs_return_input_dtype(dtype):
    lengths = SELF_LENGTHS
    offsets = offsets_of(lengths)
    t = {name: x.to(dtype).requires_grad_(True) for name, x in _self_inputs(lengths, 4).items()}
    bias = torch.randn(H, 16, dtype=dtype, requires_grad=True)
    out = jagged_flash_attention(t["q"], t["k"], t["v"], offsets, causal=True, rel_pos_bias=bias)
    assert out.dtype == dtype
    expected = naive_jfa(t["q"], t["k"], t["v"], lengths, causal=True, rel_pos_bias=bias)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)
    out.float().square().sum().backward()
    for leaf in (*t.values(), bias):
        assert leaf.grad.dtype == dtype and torch.isfinite(leaf.grad).all()


def test_gradcheck_small():
    lengths_q, lengths_k = [2, 0, 3], [3, 2, 1]
    q_off, k_off = offsets_of(lengths_q), offsets_of(lengths_k)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(5, 1, 2, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(6, 1, 2, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(6, 1, 2, generator=gen, dtype=torch.float64, requires_grad=True)
    rel = torch.randn(1, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(
        lambda q, k, v, rel: jagged_flash_attention(
            q, k, v, q_off, k_off, causal=True, rel_pos_bias=rel
        ),
        (q, k, v, rel),
    )


@settings(max_examples=25, deadline=None)
@given(
    data=st.data(),
    batch=st.integers(0, 4),
    heads=st.integers(1, 2),
    dim=st.sampled_from([1, 3, 4]),
    causal=st.booleans(),
    window=st.one_of(
        st.none(),
        st.tuples(st.one_of(st.none(), st.integers(0, 4)), st.one_of(st.none(), st.integers(0, 4))),
    ),
    use_rel=st.booleans(),
    use_jagged=st.booleans(),
    cross=st.booleans(),
)
def test_random_jagged_shapes(data, batch, heads, dim, causal, window, use_rel, use_jagged, cross):
    q_lengths = data.draw(st.lists(st.integers(0, 12), min_size=batch, max_size=batch))
    k_lengths = (
        data.draw(st.lists(st.integers(0, 12), min_size=batch, max_size=batch))
        if cross
        else q_lengths
    )
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    tensors = {
        "q": torch.randn(sum(q_lengths), heads, dim, generator=gen, dtype=torch.float64),
        "k": torch.randn(sum(k_lengths), heads, dim, generator=gen, dtype=torch.float64),
        "v": torch.randn(sum(k_lengths), heads, dim, generator=gen, dtype=torch.float64),
    }
    num_buckets = data.draw(st.integers(1, 10))
    bias_len = sum(a * b for a, b in zip(q_lengths, k_lengths, strict=True))
    tensors["rel"] = torch.randn(heads, num_buckets, generator=gen, dtype=torch.float64)
    tensors["jb"] = torch.randn(heads, bias_len, generator=gen, dtype=torch.float64)
    q_off = offsets_of(q_lengths)
    k_off = offsets_of(k_lengths) if cross else None
    budget = data.draw(st.sampled_from([7, 64, 1 << 22]))

    def under_test(q, k, v, rel, jb):
        return jagged_flash_attention_reference(
            q,
            k,
            v,
            q_off,
            k_off,
            causal=causal,
            window=window,
            rel_pos_bias=rel if use_rel else None,
            jagged_bias=jb if use_jagged else None,
            score_budget=budget,
        )

    def oracle(q, k, v, rel, jb):
        return naive_jfa(
            q,
            k,
            v,
            q_lengths,
            k_lengths,
            causal=causal,
            window=window,
            rel_pos_bias=rel if use_rel else None,
            jagged_bias=jb if use_jagged else None,
        )

    check_forward_and_grads(under_test, oracle, tensors)
    # The public entry point agrees with the reference it wraps.
    public = jagged_flash_attention(
        tensors["q"],
        tensors["k"],
        tensors["v"],
        q_off,
        k_off,
        causal=causal,
        window=window,
        rel_pos_bias=tensors["rel"] if use_rel else None,
        jagged_bias=tensors["jb"] if use_jagged else None,
    )
    torch.testing.assert_close(public, under_test(**tensors))
