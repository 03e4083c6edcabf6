"""Bad input raises a clear error that names the offending argument."""

import pytest
import torch
from gem_kernels import block_attention, gdpa, jagged_flash_attention

H, D = 2, 4


def _t(rows, heads=H, dim=D, dtype=torch.float32):
    return torch.randn(rows, heads, dim).to(dtype)


def _off(*values):
    return torch.tensor(values, dtype=torch.int64)


Q, K, V = _t(5), _t(5), _t(5)
OFF = _off(0, 2, 5)

JFA_CASES = [
    # offsets
    (dict(q_offsets=_off(1, 2, 5)), ValueError, r"q_offsets must start at 0"),
    (dict(q_offsets=_off(0, 3, 2, 5)), ValueError, r"q_offsets must be non-decreasing"),
    (dict(q_offsets=_off(0, 2, 4)), ValueError, r"q_offsets\[-1\] must equal .*\(5\)"),
    (dict(q_offsets=torch.tensor([0.0, 5.0])), TypeError, r"q_offsets must have dtype int32"),
    (dict(q_offsets=_off(0, 2, 5).view(1, 3)), ValueError, r"q_offsets must be 1-D"),
    (dict(k=_t(6), v=_t(6)), ValueError, r"k_offsets is None, so keys share q_offsets"),
    (dict(k=_t(6), v=_t(6), k_offsets=_off(0, 1, 5)), ValueError, r"k_offsets\[-1\] must equal"),
    (dict(k_offsets=_off(0, 5)), ValueError, r"k_offsets has B=1 samples but q_offsets has B=2"),
    (dict(k_offsets=_off(0, 4, 3)), ValueError, r"k_offsets must be non-decreasing"),
    # declared max lengths
    (dict(max_q=2), ValueError, r"max_q=2 is smaller than a real query length: sample 1 has 3"),
    (dict(max_k=1), ValueError, r"max_k=1 is smaller than a real key length"),
    (dict(max_q=-1), ValueError, r"max_q must be >= 0"),
    (dict(max_k=2.5), TypeError, r"max_k must be an int or None"),
    # shapes and dtypes
    (dict(q=torch.randn(5, 4)), ValueError, r"q must be 3-D \(tokens, heads, head_dim\)"),
    (dict(k=torch.randn(5, H, D, 1)), ValueError, r"k must be 3-D"),
    (dict(k=_t(5, heads=3)), ValueError, r"k has 3 heads but q has 2"),
    (dict(v=_t(5, dim=6)), ValueError, r"v has head_dim 6 but q has head_dim 4"),
    (dict(v=_t(4)), ValueError, r"k and v must have the same number of rows, got 5 and 4"),
    (dict(q=_t(5).to(torch.int32)), TypeError, r"q must have dtype float16, bfloat16, float32"),
    (dict(v=_t(5, dtype=torch.float64)), TypeError, r"q, k and v must share one dtype"),
    (dict(q=[1, 2]), TypeError, r"q must be a torch.Tensor"),
    (dict(q=_t(5, dim=0), k=_t(5, dim=0), v=_t(5, dim=0)), ValueError, r"head_dim >= 1"),
    # options
    (dict(window=(1,)), ValueError, r"window must be None or a pair \(left, right\)"),
    (dict(window=(-1, 2)), ValueError, r"window must be None or a pair"),
    (dict(window=(1.5, 2)), ValueError, r"window must be None or a pair"),
    (dict(window="ab"), ValueError, r"window must be None or a pair"),
    (dict(causal=1), TypeError, r"causal must be a bool"),
    (dict(scale=float("nan")), ValueError, r"scale must be finite"),
    (dict(scale=torch.tensor(0.5)), TypeError, r"scale must be a Python float"),
    # biases
    (dict(rel_pos_bias=torch.randn(3, 8)), ValueError, r"rel_pos_bias has 3 heads"),
    (dict(rel_pos_bias=torch.randn(8)), ValueError, r"rel_pos_bias must be 2-D"),
    (dict(rel_pos_bias=torch.randn(H, 0)), ValueError, r"rel_pos_bias must have at least one"),
    (
        dict(rel_pos_bias=torch.ones(H, 4, dtype=torch.int64)),
        TypeError,
        r"rel_pos_bias must have dtype",
    ),
    (dict(jagged_bias=torch.randn(H, 12)), ValueError, r"jagged_bias must have shape .*\(2, 13\)"),
    (dict(jagged_bias=torch.randn(1, 13)), ValueError, r"jagged_bias has 1 heads"),
]


@pytest.mark.parametrize(("override", "error", "match"), JFA_CASES)
def test_jagged_flash_attention_rejects(override, error, match):
    args = dict(q=Q, k=K, v=V, q_offsets=OFF) | override
    with pytest.raises(error, match=match):
        jagged_flash_attention(**args)


GDPA_CASES = [
    (dict(activation="softmax"), ValueError, r"activation must be one of .*'silu'.*got 'softmax'"),
    (dict(activation=None), ValueError, r"activation must be one of"),
    (dict(q_offsets=None), ValueError, r"gdpa needs q_offsets .* or k_offsets"),
    (dict(normalize_by_length="yes"), TypeError, r"normalize_by_length must be a bool"),
    (dict(q_offsets=_off(0, 5), max_q=4), ValueError, r"max_q=4 is smaller"),
    (dict(q=_t(3), q_offsets=None, k_offsets=_off(0, 2, 5), max_q=2), ValueError, r"max_q=2"),
    (dict(q=_t(3), q_offsets=None, k_offsets=_off(0, 2, 4)), ValueError, r"k_offsets\[-1\]"),
    (dict(q=_t(3), q_offsets=None, k_offsets=_off(0, 4, 5), max_k=3), ValueError, r"max_k=3"),
    (dict(k_offsets=_off(0, 5)), ValueError, r"k_offsets has B=1 samples"),
    (dict(window=(0, -2)), ValueError, r"window must be None or a pair"),
    (dict(k=_t(5, heads=1)), ValueError, r"k has 1 heads but q has 2"),
]


@pytest.mark.parametrize(("override", "error", "match"), GDPA_CASES)
def test_gdpa_rejects(override, error, match):
    args = dict(q=Q, k=K, v=V, q_offsets=OFF) | override
    with pytest.raises(error, match=match):
        gdpa(**args)


BLOCK_CASES = [
    (dict(q=_t(5, dim=3), k=_t(5, dim=3), v=_t(5, dim=3)), ValueError, r"head_dim must be even"),
    (dict(block_size=0), ValueError, r"block_size must be >= 1, got 0"),
    (dict(block_size=2.0), TypeError, r"block_size must be an int"),
    (dict(positions=torch.arange(4)), ValueError, r"positions must have shape \(T,\) = \(5,\)"),
    (dict(positions=torch.arange(5.0)), TypeError, r"positions must have dtype int64"),
    (dict(rope_theta=0.0), ValueError, r"rope_theta must be finite and > 0"),
    (dict(max_len=2), ValueError, r"max_len=2 is smaller than a real sample length"),
    (dict(offsets=_off(0, 6)), ValueError, r"offsets\[-1\] must equal"),
    (dict(k=_t(4), v=_t(4)), ValueError, r"k and v must have as many rows as q \(5\)"),
    (dict(v=_t(5, dtype=torch.bfloat16)), TypeError, r"share one dtype"),
]


@pytest.mark.parametrize(("override", "error", "match"), BLOCK_CASES)
def test_block_attention_rejects(override, error, match):
    args = dict(q=Q, k=K, v=V, offsets=OFF) | override
    with pytest.raises(error, match=match):
        block_attention(**args)


def test_valid_baseline_calls_succeed():
    """The error cases above fail only because of their one override."""
    assert jagged_flash_attention(Q, K, V, OFF, max_q=3, max_k=3).shape == (5, H, D)
    assert gdpa(Q, K, V, OFF, max_q=3).shape == (5, H, D)
    assert gdpa(_t(3), K, V, None, OFF, max_q=3).shape == (6, H, D)
    assert block_attention(Q, K, V, OFF, max_len=3).shape == (5, H, D)


def test_interpreter_after_compiled_triton_import_gets_a_clear_error():
    """Triton decorates its own library once, at first import; the interpreter cannot run it
    if that happened without TRITON_INTERPRET=1 (as after importing torch._dynamo)."""
    import os
    import subprocess
    import sys

    script = (
        "import os, torch, triton.language\n"
        "os.environ['TRITON_INTERPRET'] = '1'\n"
        "from gem_kernels import block_attention, lengths_to_offsets\n"
        "q = torch.randn(5, 1, 4, dtype=torch.bfloat16)\n"
        "try:\n"
        "    block_attention(q, q, q, lengths_to_offsets(torch.tensor([5])), 5, backend='triton')\n"
        "except RuntimeError as e:\n"
        "    print('ERROR', e)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert "ERROR the Triton interpreter needs TRITON_INTERPRET=1" in out.stdout, out.stderr
