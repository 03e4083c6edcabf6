"""The ``torch.ops.gem_kernels`` operators behind the public attention functions.

``torch.library.opcheck`` on every forward and backward operator (CPU float32, the reference
path; small jagged batches with an empty sample, a length-1 sample and odd lengths), and
``torch.compile(fullgraph=True)`` of the public functions: no graph break, forward and
gradients equal to eager. The Triton backend through the operators is checked under the
interpreter in the ``*_triton.py`` files.

Both opcheck and torch.compile import ``torch._dynamo``, which imports ``triton.language`` for
compilation; the Triton interpreter cannot run after that (see ``test_kernels_errors.py``). So
nothing here imports them at module level (collection would import them before any interpreter
test ran), and this file sorts after the interpreter test files.
"""

from __future__ import annotations

import pytest
import torch
from gem_kernels import (
    block_attention,
    block_attention_triton,
    gdpa,
    gdpa_triton,
    jagged_flash_attention,
    jfa_triton,
    rope,
    rope_qkv,
    rope_tables,
    swiglu,
)
from kernels_naive import offsets_of

H, D = 2, 4
LENGTHS = [3, 0, 1, 5]  # an empty sample, a length-1 sample, odd lengths
CROSS_K = [2, 3, 0, 1]  # Lk != Lq, Lk = 0 with Lq > 0


def _randn(*shape, gen, grad=True):
    return torch.randn(*shape, generator=gen).requires_grad_(grad)


def _opcheck(op, args):
    # Every default test: schema (no mutation, no aliasing), autograd registration, fake
    # tensors against real outputs, and AOTAutograd with dynamic shapes (forward and backward).
    torch.library.opcheck(op, args)


# ---------------------------------------------------------------------------------------------
# opcheck.


JFA_CASES = {
    "self_causal_window_biases": dict(k_lengths=None, causal=True, window=(2, None), rel=7),
    "cross_right_window_jagged_bias": dict(k_lengths=CROSS_K, causal=False, window=(None, 1)),
}


@pytest.mark.parametrize("case", JFA_CASES)
def test_opcheck_jagged_flash_attention(case):
    options = JFA_CASES[case]
    gen = torch.Generator().manual_seed(0)
    q_lengths, k_lengths = LENGTHS, options["k_lengths"] or LENGTHS
    pairs = sum(a * b for a, b in zip(q_lengths, k_lengths, strict=True))
    q = _randn(sum(q_lengths), H, D, gen=gen)
    k, v = (_randn(sum(k_lengths), H, D, gen=gen) for _ in range(2))
    rel = _randn(H, options["rel"], gen=gen) if "rel" in options else None
    jagged = _randn(H, pairs, gen=gen)
    k_offsets = None if options["k_lengths"] is None else offsets_of(k_lengths)
    left, right = options["window"]
    args = (q, k, v, offsets_of(q_lengths), k_offsets, rel, jagged, 5, 5, 0.7,
            options["causal"], left, right, "auto")  # fmt: skip
    _opcheck(torch.ops.gem_kernels.jagged_flash_attention.default, args)

    out, lse = torch.ops.gem_kernels.jagged_flash_attention(*args)
    detached = [None if t is None else t.detach() for t in (q, k, v, rel, jagged)]
    q, k, v, rel, jagged = detached
    backward_args = (torch.randn(out.shape, generator=gen), q, k, v, out.detach(), lse,
                     offsets_of(q_lengths), k_offsets, rel, jagged, 0.7, options["causal"],
                     left, right, "auto")  # fmt: skip
    _opcheck(torch.ops.gem_kernels.jagged_flash_attention_backward.default, backward_args)


@pytest.mark.parametrize("causal", [False, True])
def test_opcheck_jagged_flash_attention_fp8(causal):
    """The ``precision`` argument (the FP8 emulation on CPU, bfloat16 inputs, both biases)."""
    gen = torch.Generator().manual_seed(3)
    pairs = sum(a * b for a, b in zip(LENGTHS, CROSS_K, strict=True))
    q = _randn(sum(LENGTHS), H, D, gen=gen).bfloat16().detach().requires_grad_(True)
    k, v = (
        _randn(sum(CROSS_K), H, D, gen=gen).bfloat16().detach().requires_grad_(True)
        for _ in range(2)
    )
    rel, jagged = _randn(H, 5, gen=gen), _randn(H, pairs, gen=gen)
    offsets = (offsets_of(LENGTHS), offsets_of(CROSS_K))
    args = (q, k, v, *offsets, rel, jagged, None, None, 0.7, causal, 1, None, "auto", "fp8")
    _opcheck(torch.ops.gem_kernels.jagged_flash_attention.default, args)
    out, lse = torch.ops.gem_kernels.jagged_flash_attention(*args)
    q, k, v, rel, jagged = (t.detach() for t in (q, k, v, rel, jagged))
    backward_args = (torch.randn(out.shape, generator=gen).bfloat16(), q, k, v, out.detach(),
                     lse, *offsets, rel, jagged, 0.7, causal, 1, None, "auto", "fp8")  # fmt: skip
    _opcheck(torch.ops.gem_kernels.jagged_flash_attention_backward.default, backward_args)


GDPA_CASES = {
    # jagged queries over a fixed number of keys per sample (features), normalised
    "cross_fixed_kv_normalized": dict(q=LENGTHS, k=[2, 2, 2, 2], act="gelu_fast", norm=True),
    "self_causal_window": dict(q=LENGTHS, k=None, act="silu", causal=True, window=(1, None)),
    "pma_broadcast_normalized": dict(q=None, k=[0, 1, 4], act="relu2", norm=True),
}


@pytest.mark.parametrize("case", GDPA_CASES)
def test_opcheck_gdpa(case):
    options = GDPA_CASES[case]
    gen = torch.Generator().manual_seed(1)
    q_lengths, k_lengths = options["q"], options["k"]
    keys = k_lengths or q_lengths
    q = _randn(3 if q_lengths is None else sum(q_lengths), H, D, gen=gen)
    k, v = (_randn(sum(keys), H, D, gen=gen) for _ in range(2))
    q_offsets = None if q_lengths is None else offsets_of(q_lengths)
    k_offsets = None if k_lengths is None else offsets_of(k_lengths)
    left, right = options.get("window", (None, None))
    rest = (options["act"], 0.6, options.get("causal", False), left, right,
            options.get("norm", False), "auto")  # fmt: skip
    _opcheck(torch.ops.gem_kernels.gdpa.default, (q, k, v, q_offsets, k_offsets, 5, 5, *rest))

    out = torch.ops.gem_kernels.gdpa(q, k, v, q_offsets, k_offsets, None, None, *rest)
    grad_out = torch.randn(out.shape, generator=gen)
    backward_args = (grad_out, q.detach(), k.detach(), v.detach(), q_offsets, k_offsets, *rest)
    _opcheck(torch.ops.gem_kernels.gdpa_backward.default, backward_args)


@pytest.mark.parametrize("case", ["self_causal_relu2", "cross_window_silu", "pma_gelu"])
def test_opcheck_gdpa_fp8(case):
    """The ``precision`` argument (the FP8 emulation on CPU, bfloat16 inputs)."""
    q_lengths, k_lengths, act, causal, (left, right) = {
        "self_causal_relu2": (LENGTHS, None, "relu2", True, (None, None)),
        "cross_window_silu": (LENGTHS, CROSS_K, "silu", False, (1, 0)),
        "pma_gelu": (None, CROSS_K, "gelu", False, (None, None)),
    }[case]
    gen = torch.Generator().manual_seed(5)
    keys = k_lengths or q_lengths
    q = _randn(3 if q_lengths is None else sum(q_lengths), H, D, gen=gen)
    q = q.bfloat16().detach().requires_grad_(True)
    k, v = (_randn(sum(keys), H, D, gen=gen).bfloat16().detach().requires_grad_(True)
            for _ in range(2))  # fmt: skip
    q_offsets = None if q_lengths is None else offsets_of(q_lengths)
    k_offsets = None if k_lengths is None else offsets_of(k_lengths)
    rest = (act, 0.6, causal, left, right, case == "pma_gelu", "auto", "fp8")
    _opcheck(torch.ops.gem_kernels.gdpa.default, (q, k, v, q_offsets, k_offsets, 5, 5, *rest))
    out = torch.ops.gem_kernels.gdpa(q, k, v, q_offsets, k_offsets, None, None, *rest)
    grad_out = torch.randn(out.shape, generator=gen).bfloat16()
    backward_args = (grad_out, q.detach(), k.detach(), v.detach(), q_offsets, k_offsets, *rest)
    _opcheck(torch.ops.gem_kernels.gdpa_backward.default, backward_args)


@pytest.mark.parametrize("with_positions", [True, False])
def test_opcheck_block_attention(with_positions):
    gen = torch.Generator().manual_seed(2)
    lengths = [0, 1, 4, 7]  # block_size 3: a partial block, one block, blocks plus a remainder
    q, k, v = (_randn(sum(lengths), H, D, gen=gen) for _ in range(3))
    positions = torch.randint(0, 50, (sum(lengths),), generator=gen) if with_positions else None
    rest = (3, 500.0, 0.4, "auto")
    offsets = offsets_of(lengths)
    _opcheck(torch.ops.gem_kernels.block_attention.default, (q, k, v, offsets, positions, 7, *rest))

    grad_out = torch.randn(q.shape, generator=gen)
    backward_args = (grad_out, q.detach(), k.detach(), v.detach(), offsets, positions, *rest)
    _opcheck(torch.ops.gem_kernels.block_attention_backward.default, backward_args)


@pytest.mark.parametrize("inverse", [False, True])
def test_opcheck_rope(inverse):
    gen = torch.Generator().manual_seed(4)
    x = _randn(9, 3, 3, 6, gen=gen).detach()[:, 1].requires_grad_(True)  # a strided slice
    positions = torch.randint(0, 11, (9,), generator=gen)
    cos, sin = rope_tables(11, 6, 300.0)
    _opcheck(torch.ops.gem_kernels.rope.default, (x, positions, cos, sin, inverse, "auto"))


def test_opcheck_rope_qkv():
    gen = torch.Generator().manual_seed(5)
    qkv = _randn(9, 3, 2, 8, gen=gen).detach()[..., 1:-1].requires_grad_(True)  # strided rows
    positions = torch.randint(0, 11, (9,), generator=gen)
    cos, sin = rope_tables(11, 6, 300.0)
    _opcheck(torch.ops.gem_kernels.rope_qkv.default, (qkv, positions, cos, sin, "auto"))
    grads = tuple(torch.randn(9, 2, 6, generator=gen) for _ in range(3))
    _opcheck(torch.ops.gem_kernels.rope_qkv_backward.default, (*grads, positions, cos, sin, "auto"))


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("shape", [(9, 14), (2, 3, 10)])
def test_opcheck_swiglu(shape, with_bias):
    gen = torch.Generator().manual_seed(6)
    hidden = _randn(*shape[:-1], shape[-1] + 4, gen=gen).detach()[..., 2:-2]  # strided rows
    hidden = hidden.reshape(-1, shape[-1]).requires_grad_(True)
    bias = _randn(shape[-1], gen=gen) if with_bias else None
    _opcheck(torch.ops.gem_kernels.swiglu.default, (hidden, bias, "auto"))
    grad_out = torch.randn(hidden.shape[0], shape[-1] // 2, generator=gen)
    detached = None if bias is None else bias.detach()
    _opcheck(
        torch.ops.gem_kernels.swiglu_backward.default,
        (grad_out, hidden.detach(), detached, "auto"),
    )


def test_compile_swiglu_fullgraph_matches_eager():
    """SwiGLU after an up projection without a GEMM bias, its bias handed to swiglu, as the FFN
    calls it: one graph for any row count, the forward and both gradients equal to eager."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    gen = torch.Generator().manual_seed(8)
    weight = torch.randn(12, 6, generator=gen)

    def ffn(tokens, bias):
        return swiglu(tokens @ weight.T, bias).square().sum()

    compiled = torch.compile(ffn, backend="aot_eager", fullgraph=True, dynamic=True)
    bias = torch.randn(12, generator=gen)
    for rows in (13, 21):
        tokens = torch.randn(rows, 6, generator=gen)
        results = []
        for fn in (ffn, compiled):
            leaf, bias_leaf = tokens.clone().requires_grad_(True), bias.clone().requires_grad_(True)
            loss = fn(leaf, bias_leaf)
            loss.backward()
            results.append((loss.detach(), leaf.grad, bias_leaf.grad))
        torch.testing.assert_close(results[1], results[0], rtol=0, atol=0)
    assert counters["stats"]["unique_graphs"] == 1


def test_compile_rope_fullgraph_matches_eager():
    """RoPE of a fused projection's q and k slices, by rope and by rope_qkv (as the model
    calls it): one graph each, the forward and the gradient equal to eager rope (the gradient
    is the inverse rotation)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    gen = torch.Generator().manual_seed(5)
    cos, sin = rope_tables(16, 8, 300.0)

    def rotate_qk(qkv, positions):
        q, k, v = qkv.unbind(1)
        return (rope(q, positions, cos, sin) * rope(k, positions, cos, sin) * v).sum()

    def rotate_qkv(qkv, positions):  # the fused form: one (T, 3, H, D) gradient
        q, k, v = rope_qkv(qkv, positions, cos, sin)
        return (q * k * v).sum()

    compiled = torch.compile(rotate_qk, backend="aot_eager", fullgraph=True)
    fused = torch.compile(rotate_qkv, backend="aot_eager", fullgraph=True)
    for tokens in (13, 21):
        qkv = torch.randn(tokens, 3, 2, 8, generator=gen)
        positions = torch.randint(0, 16, (tokens,), generator=gen)
        results = []
        for fn in (rotate_qk, compiled, rotate_qkv, fused):
            leaf = qkv.clone().requires_grad_(True)
            loss = fn(leaf, positions)
            loss.backward()
            results.append((loss.detach(), leaf.grad))
        for result in results[1:]:
            torch.testing.assert_close(result[0], results[0][0])
            torch.testing.assert_close(result[1], results[0][1])
    assert dict(counters["graph_break"]) == {}


# ---------------------------------------------------------------------------------------------
# What the operators return and check.


def test_reference_lse_is_the_log2_sum_exp_of_visible_scores():
    gen = torch.Generator().manual_seed(3)
    lengths = [4, 0, 1, 3]
    q, k, v = (torch.randn(sum(lengths), H, D, generator=gen, dtype=torch.float64) for _ in "qkv")
    rel = torch.randn(H, 5, generator=gen, dtype=torch.float64)
    scale, left = 0.8, 1
    out, lse = torch.ops.gem_kernels.jagged_flash_attention(
        q, k, v, offsets_of(lengths), None, rel, None, None, None, scale, True, left, None,
        "reference",
    )  # fmt: skip
    assert lse.shape == (H, sum(lengths)) and lse.dtype == torch.float32
    expected = torch.full((H, sum(lengths)), float("inf"), dtype=torch.float64)
    start = 0
    for n in lengths:
        i = torch.arange(n)[:, None]
        j = torch.arange(n)[None, :]
        bucket = (i - j + rel.shape[1] // 2).clamp(0, rel.shape[1] - 1)
        scores = scale * torch.einsum("ihd,jhd->hij", q[start : start + n], k[start : start + n])
        scores = (scores + rel[:, bucket]).masked_fill(~((j <= i) & (j >= i - left)), -torch.inf)
        expected[:, start : start + n] = torch.logsumexp(scores, -1) / torch.log(torch.tensor(2.0))
        start += n
    torch.testing.assert_close(lse.double(), expected)
    public = jagged_flash_attention(q, k, v, offsets_of(lengths), scale=scale, causal=True,
                                    window=(left, None), rel_pos_bias=rel)  # fmt: skip
    torch.testing.assert_close(out, public)


def test_operators_check_offsets_values():
    """Direct operator calls get the public functions' value checks (the functions leave those
    to the operators, which run them at call time, compiled or not)."""
    q = torch.randn(5, H, D)
    bad = torch.tensor([0, 3, 2, 5])
    with pytest.raises(ValueError, match=r"q_offsets must be non-decreasing"):
        torch.ops.gem_kernels.jagged_flash_attention(
            q, q, q, bad, None, None, None, None, None, 0.5, False, None, None, "auto"
        )
    with pytest.raises(ValueError, match=r"max_k=1 is smaller than a real key length"):
        torch.ops.gem_kernels.gdpa(
            q[:2], q, q, None, offsets_of([2, 3]), None, 1, "silu", 0.5, False, None, None,
            False, "auto",
        )  # fmt: skip
    with pytest.raises(ValueError, match=r"offsets\[-1\] must equal the number of rows \(5\)"):
        torch.ops.gem_kernels.block_attention(
            q, q, q, offsets_of([2, 2]), None, None, 64, 1e4, 0.5, "auto"
        )
    with pytest.raises(ValueError, match=r"backend must be one of"):
        torch.ops.gem_kernels.block_attention(
            q, q, q, offsets_of([5]), None, None, 64, 1e4, 0.5, "cuda"
        )


def test_backward_operators_are_once_differentiable():
    q = torch.randn(4, H, D, requires_grad=True)
    out = gdpa(q, q, q, offsets_of([1, 3]), activation="silu")
    (grad,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match=r"gem_kernels::gdpa_backward is not differentiable"):
        grad.sum().backward()


# ---------------------------------------------------------------------------------------------
# torch.compile.


def _model_inputs(lengths, seed):
    gen = torch.Generator().manual_seed(seed)
    total, pairs = sum(lengths), sum(n * n for n in lengths)
    tensors = (
        *(torch.randn(total, H, D, generator=gen) for _ in "qkv"),
        torch.randn(H, 7, generator=gen),  # rel_pos_bias
        torch.randn(H, pairs, generator=gen),  # jagged_bias
        torch.randn(3, H, D, generator=gen),  # PMA seeds
        torch.randn(2 * len(lengths), H, D, generator=gen),  # 2 features per sample
    )
    return tensors, offsets_of(lengths), offsets_of([2] * len(lengths))


def _sequence_tower(q, k, v, rel, jagged, seeds, features, offsets, feature_offsets, max_len):
    """Each public entry point once, chained like the model's sequence tower."""
    x = jagged_flash_attention(q, k, v, offsets, max_q=max_len, causal=True, window=(2, None),
                               rel_pos_bias=rel, jagged_bias=jagged)  # fmt: skip
    x = block_attention(x, k, v, offsets, max_len, block_size=2)
    x = x + gdpa(x, k, v, offsets, activation="gelu", window=(None, 1), normalize_by_length=True)
    x = gdpa(x, features, features, offsets, feature_offsets, max_q=max_len, max_k=2,
             activation="silu")  # fmt: skip
    pooled = gdpa(seeds, x, x, None, offsets, max_q=3, max_k=max_len, normalize_by_length=True)
    return (x * x).sum() + pooled.sum()


GRAD_NAMES = ("q", "k", "v", "rel_pos_bias", "jagged_bias", "seeds", "features")


def _forward_backward(fn, tensors, offsets, feature_offsets, max_len):
    leaves = [t.clone().requires_grad_(True) for t in tensors]
    loss = fn(*leaves, offsets, feature_offsets, max_len)
    loss.backward()
    return loss.detach(), [leaf.grad for leaf in leaves]


def _compile_and_compare(backend, batches):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(_sequence_tower, backend=backend, fullgraph=True)
    for lengths, seed in batches:
        tensors, offsets, feature_offsets = _model_inputs(lengths, seed)
        max_len = max(lengths)
        want = _forward_backward(_sequence_tower, tensors, offsets, feature_offsets, max_len)
        got = _forward_backward(compiled, tensors, offsets, feature_offsets, max_len)
        torch.testing.assert_close(got[0], want[0])
        for name, a, b in zip(GRAD_NAMES, got[1], want[1], strict=True):
            torch.testing.assert_close(a, b, msg=f"grad of {name}")
    assert dict(counters["graph_break"]) == {}


def test_compile_fullgraph_matches_eager():
    # The second batch (other lengths, other max_len) recompiles with dynamic shapes and a
    # symbolic max_len.
    _compile_and_compare("aot_eager", [(LENGTHS, 0), ([2, 6, 0, 1, 3], 1)])


@pytest.mark.slow
def test_compile_inductor_matches_eager():
    _compile_and_compare("inductor", [(LENGTHS, 0)])


def test_compile_fullgraph_fp8_matches_eager():
    """``precision="fp8"`` compiles without a graph break; forward and gradients equal eager."""
    from torch._dynamo.utils import counters

    def attention(q, k, v, offsets):
        return jagged_flash_attention(q, k, v, offsets, causal=True, precision="fp8")

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(attention, backend="aot_eager", fullgraph=True)
    gen = torch.Generator().manual_seed(4)
    offsets = offsets_of(LENGTHS)
    results = []
    for fn in (attention, compiled):
        leaves = [
            torch.randn(sum(LENGTHS), H, D, generator=gen.manual_seed(4 + i))
            .bfloat16()
            .requires_grad_(True)
            for i in range(3)
        ]
        out = fn(*leaves, offsets)
        out.float().square().sum().backward()
        results.append([out, *(t.grad for t in leaves)])
    for got, want in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert dict(counters["graph_break"]) == {}


def test_compile_fullgraph_gdpa_fp8_matches_eager():
    """``gdpa(..., precision="fp8")`` compiles without a graph break (self and PMA calls);
    forward and gradients equal eager."""
    from torch._dynamo.utils import counters

    def tower(q, k, v, pma_q, offsets):
        x = gdpa(q, k, v, offsets, causal=True, activation="relu2", precision="fp8")
        pooled = gdpa(pma_q, x, x, None, offsets, activation="silu", precision="fp8")
        return pooled

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(tower, backend="aot_eager", fullgraph=True)
    offsets = offsets_of(LENGTHS)
    results = []
    for fn in (tower, compiled):
        gen = torch.Generator().manual_seed(6)
        leaves = [
            torch.randn(rows, H, D, generator=gen).bfloat16().requires_grad_(True)
            for rows in (sum(LENGTHS),) * 3 + (2,)
        ]
        out = fn(*leaves, offsets)
        out.float().square().sum().backward()
        results.append([out, *(t.grad for t in leaves)])
    for got, want in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert dict(counters["graph_break"]) == {}


def test_compiled_call_still_checks_offsets_values():
    """The value checks are not traced, and not skipped either: they run inside the operator."""
    compiled = torch.compile(
        lambda q, offsets: jagged_flash_attention(q, q, q, offsets, max_q=2),
        backend="aot_eager",
        fullgraph=True,
    )
    q = torch.randn(5, H, D)
    torch.testing.assert_close(compiled(q, offsets_of([2, 1, 2])),
                               jagged_flash_attention(q, q, q, offsets_of([2, 1, 2])))  # fmt: skip
    with pytest.raises(ValueError, match=r"max_q=2 is smaller than a real query length"):
        compiled(q, offsets_of([1, 4, 0]))
    with pytest.raises(ValueError, match=r"q_offsets must start at 0"):
        compiled(q, torch.tensor([1, 3, 5]))


# ---------------------------------------------------------------------------------------------
# GPU: the Triton kernels through the compiled operators.

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _each_entry_point(q, k, v, rel, jagged, seeds, features, offsets, feature_offsets, max_len,
                      weights):  # fmt: skip
    """Each public entry point on the leaves themselves, in a linear loss: compiled and eager
    calls then run the same kernels on the same inputs and output gradients (``weights``)."""
    outs = (
        jagged_flash_attention(q, k, v, offsets, max_q=max_len, causal=True, window=(2, None),
                               rel_pos_bias=rel, jagged_bias=jagged),
        block_attention(q, k, v, offsets, max_len),
        gdpa(q, k, v, offsets, activation="gelu", window=(None, 1), normalize_by_length=True),
        gdpa(q, features, features, offsets, feature_offsets, max_q=max_len, max_k=2,
             activation="silu"),
        gdpa(seeds, k, v, None, offsets, max_k=max_len, normalize_by_length=True),
    )  # fmt: skip
    return sum((out.float() * w).sum() for out, w in zip(outs, weights, strict=True))


@pytest.mark.gpu
@cuda_only
def test_gpu_compile_fullgraph_matches_eager():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    gen = torch.Generator().manual_seed(5)
    lengths = [300, 1, 0, 77, 128]
    heads, dim = 4, 64
    total, pairs, batch = sum(lengths), sum(n * n for n in lengths), len(lengths)

    def make(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=gen).to("cuda", dtype)

    tensors = (*(make(total, heads, dim) for _ in "qkv"), make(heads, 7), make(heads, pairs),
               make(3, heads, dim), make(2 * batch, heads, dim))  # fmt: skip
    weights = [make(total, heads, dim, dtype=torch.float32) for _ in range(4)]
    weights.append(make(3 * batch, heads, dim, dtype=torch.float32))
    offsets = offsets_of(lengths).cuda()
    feature_offsets = offsets_of([2] * batch).cuda()
    modules = (jfa_triton, gdpa_triton, block_attention_triton)
    results = []
    for fn in (_each_entry_point, torch.compile(_each_entry_point, fullgraph=True)):
        for module in modules:
            module._PLAN_CACHE.clear()
        leaves = [t.clone().requires_grad_(True) for t in tensors]
        loss = fn(*leaves, offsets, feature_offsets, max(lengths), weights)
        loss.backward()
        results.append([loss.detach()] + [leaf.grad.float() for leaf in leaves])
        # The operators ran the Triton kernels (bf16 CUDA calls within their limits).
        assert all(len(module._PLAN_CACHE) > 0 for module in modules)
    assert dict(counters["graph_break"]) == {}
    for name, got, want in zip(("loss", *GRAD_NAMES), *results, strict=True):
        # Gradients of a leaf used by several calls are summed in another order (and rounding)
        # by the compiled backward: compare as the GPU tests of the kernels do.
        error = float((got - want).norm() / want.norm().clamp(min=1e-6))
        assert error < 1e-2, (name, error)
