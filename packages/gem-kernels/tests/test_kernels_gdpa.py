"""gdpa vs the naive per-sample float64 oracle: self, cross and PMA broadcast; all gradients."""

import pytest
import torch
from gem_kernels import gdpa
from gem_kernels.reference import GDPA_ACTIVATIONS, gdpa_reference
from hypothesis import given, settings
from hypothesis import strategies as st
from kernels_naive import check_forward_and_grads, make_jagged, naive_gdpa, offsets_of

H, D = 2, 4
ACTIVATIONS = ["silu", "gelu", "gelu_tanh", "gelu_fast", "relu2", "identity"]
SELF_LENGTHS = [0, 1, 5, 70, 3]
CROSS_Q = [0, 1, 5, 9, 2, 66]
CROSS_K = [3, 0, 17, 4, 1, 20]


def test_activation_list_is_complete():
    assert sorted(GDPA_ACTIVATIONS) == sorted(ACTIVATIONS)


def _inputs(q_rows, k_rows, seed=0):
    return {
        "q": make_jagged(q_rows, H, D, seed=seed),
        "k": make_jagged(k_rows, H, D, seed=seed + 1),
        "v": make_jagged(k_rows, H, D, seed=seed + 2),
    }


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize(("causal", "window"), [(False, None), (True, None), (False, (2, 3))])
def test_self_attention(activation, causal, window):
    lengths = SELF_LENGTHS
    offsets = offsets_of(lengths)
    check_forward_and_grads(
        lambda q, k, v: gdpa(q, k, v, offsets, activation=activation, causal=causal, window=window),
        lambda q, k, v: naive_gdpa(
            q, k, v, lengths, lengths, activation=activation, causal=causal, window=window
        ),
        _inputs(sum(lengths), sum(lengths)),
    )


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_cross_attention(activation, normalize, causal):
    q_off, k_off = offsets_of(CROSS_Q), offsets_of(CROSS_K)
    check_forward_and_grads(
        lambda q, k, v: gdpa(
            q,
            k,
            v,
            q_off,
            k_off,
            max_q=66,
            max_k=20,
            activation=activation,
            causal=causal,
            normalize_by_length=normalize,
            scale=0.3,
        ),
        lambda q, k, v: naive_gdpa(
            q,
            k,
            v,
            CROSS_Q,
            CROSS_K,
            activation=activation,
            causal=causal,
            normalize_by_length=normalize,
            scale=0.3,
        ),
        _inputs(sum(CROSS_Q), sum(CROSS_K), seed=7),
    )


# KV lengths include 0, 1, and fewer keys than the number of queries.
PMA_K = [0, 1, 2, 7, 40, 3]


@pytest.mark.parametrize("num_queries", [1, 4])
@pytest.mark.parametrize("activation", ["silu", "gelu_fast", "identity"])
@pytest.mark.parametrize(("causal", "normalize"), [(False, False), (False, True), (True, False)])
def test_pma_broadcast(num_queries, activation, causal, normalize):
    k_off = offsets_of(PMA_K)
    tensors = _inputs(num_queries, sum(PMA_K), seed=13)
    out = gdpa(tensors["q"], tensors["k"], tensors["v"], None, k_off, activation=activation)
    assert out.shape == (len(PMA_K) * num_queries, H, D)
    check_forward_and_grads(
        lambda q, k, v: gdpa(
            q,
            k,
            v,
            None,
            k_off,
            max_q=num_queries,
            activation=activation,
            causal=causal,
            normalize_by_length=normalize,
        ),
        lambda q, k, v: naive_gdpa(
            q,
            k,
            v,
            [num_queries] * len(PMA_K),
            PMA_K,
            activation=activation,
            causal=causal,
            normalize_by_length=normalize,
            broadcast=True,
        ),
        tensors,
    )


def test_pma_equals_explicitly_repeated_queries():
    """Broadcast mode is the same as cross attention with the queries copied per sample."""
    k_off = offsets_of(PMA_K)
    t = _inputs(3, sum(PMA_K), seed=2)
    broadcast = gdpa(t["q"], t["k"], t["v"], None, k_off)
    repeated = t["q"].repeat(len(PMA_K), 1, 1)
    cross = gdpa(repeated, t["k"], t["v"], offsets_of([3] * len(PMA_K)), k_off)
    torch.testing.assert_close(broadcast, cross)


def test_normalize_by_length_zero_keys_gives_zeros():
    t = _inputs(4, 0)
    out = gdpa(t["q"], t["k"], t["v"], offsets_of([4]), offsets_of([0]), normalize_by_length=True)
    assert torch.isfinite(out).all() and (out == 0).all()


@pytest.mark.parametrize("budget", [1, 40, 999])
def test_chunking_under_tiny_score_budget(budget):
    q_off, k_off = offsets_of(CROSS_Q), offsets_of(CROSS_K)
    check_forward_and_grads(
        lambda q, k, v: gdpa_reference(
            q, k, v, q_off, k_off, activation="gelu", window=(3, 1), score_budget=budget
        ),
        lambda q, k, v: naive_gdpa(q, k, v, CROSS_Q, CROSS_K, activation="gelu", window=(3, 1)),
        _inputs(sum(CROSS_Q), sum(CROSS_K), seed=3),
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_low_precision_inputs_return_input_dtype(dtype):
    q_off, k_off = offsets_of(CROSS_Q), offsets_of(CROSS_K)
    t = {name: x.to(dtype) for name, x in _inputs(sum(CROSS_Q), sum(CROSS_K), seed=5).items()}
    out = gdpa(t["q"], t["k"], t["v"], q_off, k_off, activation="silu", normalize_by_length=True)
    assert out.dtype == dtype
    expected = naive_gdpa(
        t["q"], t["k"], t["v"], CROSS_Q, CROSS_K, activation="silu", normalize_by_length=True
    )
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)


@settings(max_examples=25, deadline=None)
@given(
    data=st.data(),
    batch=st.integers(0, 4),
    mode=st.sampled_from(["self", "cross", "pma"]),
    activation=st.sampled_from(ACTIVATIONS),
    causal=st.booleans(),
    window=st.one_of(
        st.none(), st.tuples(st.integers(0, 3), st.one_of(st.none(), st.integers(0, 3)))
    ),
    normalize=st.booleans(),
    heads=st.integers(1, 2),
    dim=st.sampled_from([1, 2, 5]),
)
def test_random_jagged_shapes(data, batch, mode, activation, causal, window, normalize, heads, dim):
    k_lengths = data.draw(st.lists(st.integers(0, 10), min_size=batch, max_size=batch))
    if mode == "self":
        q_lengths = k_lengths
    elif mode == "cross":
        q_lengths = data.draw(st.lists(st.integers(0, 10), min_size=batch, max_size=batch))
    else:
        num_queries = data.draw(st.integers(1, 4))
        q_lengths = [num_queries] * batch
    q_rows = num_queries if mode == "pma" else sum(q_lengths)
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    tensors = {
        "q": torch.randn(q_rows, heads, dim, generator=gen, dtype=torch.float64),
        "k": torch.randn(sum(k_lengths), heads, dim, generator=gen, dtype=torch.float64),
        "v": torch.randn(sum(k_lengths), heads, dim, generator=gen, dtype=torch.float64),
    }
    q_off = None if mode == "pma" else offsets_of(q_lengths)
    k_off = None if mode == "self" else offsets_of(k_lengths)
    if mode == "pma" and batch == 0:
        k_off = offsets_of([])
    budget = data.draw(st.sampled_from([5, 64, 1 << 22]))
    check_forward_and_grads(
        lambda q, k, v: gdpa_reference(
            q,
            k,
            v,
            q_off,
            k_off,
            activation=activation,
            causal=causal,
            window=window,
            normalize_by_length=normalize,
            score_budget=budget,
        ),
        lambda q, k, v: naive_gdpa(
            q,
            k,
            v,
            q_lengths,
            k_lengths,
            activation=activation,
            causal=causal,
            window=window,
            normalize_by_length=normalize,
            broadcast=mode == "pma",
        ),
        tensors,
    )
    public = gdpa(
        tensors["q"],
        tensors["k"],
        tensors["v"],
        q_off,
        k_off,
        activation=activation,
        causal=causal,
        window=window,
        normalize_by_length=normalize,
    )
    torch.testing.assert_close(
        public,
        gdpa_reference(
            tensors["q"],
            tensors["k"],
            tensors["v"],
            q_off,
            k_off,
            activation=activation,
            causal=causal,
            window=window,
            normalize_by_length=normalize,
        ),
    )
