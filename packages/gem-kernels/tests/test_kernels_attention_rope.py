"""``gem_kernels.rope`` (rotary embedding of q / k rows): the Triton kernel under the
interpreter and the reference against a float64 complex-multiply oracle, forward and gradient,
on odd shapes and strided inputs.

The file sorts before ``test_kernels_ops.py``, which imports ``torch._dynamo`` (after which the
interpreter cannot run); the operator's opcheck and compile tests live there.
"""

from __future__ import annotations

import pytest
import torch
from gem_kernels import rope, rope_qkv, rope_tables
from gem_kernels.reference import apply_rope
from kernels_naive import _rope_complex

THETA = 500.0  # a small base: high frequencies wrap many turns at the test's positions


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _inputs(tokens, heads, head_dim, *, seed, max_len=50, strided=False):
    gen = torch.Generator().manual_seed(seed)
    if strided:  # q of a fused (T, 3, H, D) projection, as the model passes it
        x = torch.randn(tokens, 3, heads, head_dim, generator=gen)[:, 1]
    else:
        x = torch.randn(tokens, heads, head_dim, generator=gen)
    positions = torch.randint(0, max_len, (tokens,), generator=gen)
    return x, positions, rope_tables(max_len, head_dim, THETA)


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize(
    ("tokens", "heads", "head_dim", "strided"),
    [(37, 3, 10, False), (70, 2, 16, True), (1, 1, 2, False), (0, 2, 8, False)],
)
def test_forward_and_gradient_match_the_oracle(interpret, backend, tokens, heads, head_dim,
                                               strided):  # fmt: skip
    x, positions, (cos, sin) = _inputs(tokens, heads, head_dim, seed=tokens, strided=strided)
    grad = torch.randn(tokens, heads, head_dim, generator=torch.Generator().manual_seed(1))
    leaf = x.clone().requires_grad_(True)
    out = rope(leaf, positions, cos, sin, backend=backend)
    out.backward(grad)
    oracle_x = x.double().requires_grad_(True)
    want = _rope_complex(oracle_x, positions, THETA)
    want.backward(grad.double())
    assert out.is_contiguous() and out.dtype == x.dtype
    torch.testing.assert_close(out.double(), want, atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(leaf.grad.double(), oracle_x.grad, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize(("tokens", "heads", "head_dim"), [(37, 3, 10), (1, 1, 2), (0, 2, 8)])
def test_rope_qkv_rotates_q_and_k_copies_v_and_packs_the_gradient(interpret, backend, tokens,
                                                                 heads, head_dim):  # fmt: skip
    """rope_qkv is rope of the q and k slices and v as it is, forward and gradient (against
    the float64 oracle); the gradient of outputs left unused is zero."""
    gen = torch.Generator().manual_seed(tokens + 1)
    qkv = torch.randn(tokens, 3, heads, head_dim + 2, generator=gen)[..., 1:-1]  # strided
    positions = torch.randint(0, 50, (tokens,), generator=gen)
    cos, sin = rope_tables(50, head_dim, THETA)
    grads = [torch.randn(tokens, heads, head_dim, generator=gen) for _ in range(3)]
    leaf = qkv.clone().requires_grad_(True)
    outs = rope_qkv(leaf, positions, cos, sin, backend=backend)
    sum((out * grad).sum() for out, grad in zip(outs, grads, strict=True)).backward()
    oracle = qkv.double().requires_grad_(True)
    q, k, v = oracle.unbind(1)
    wants = (_rope_complex(q, positions, THETA), _rope_complex(k, positions, THETA), v)
    sum((w * g.double()).sum() for w, g in zip(wants, grads, strict=True)).backward()
    for out, want in zip(outs, wants, strict=True):
        assert out.is_contiguous() and out.dtype == qkv.dtype and out.shape == want.shape
        torch.testing.assert_close(out.double(), want, atol=2e-6, rtol=2e-6)
    assert torch.equal(outs[2], qkv[:, 2])
    torch.testing.assert_close(leaf.grad.double(), oracle.grad, atol=2e-6, rtol=2e-6)

    leaf.grad = None
    rope_qkv(leaf, positions, cos, sin, backend=backend)[1].backward(grads[1])  # k only
    assert leaf.grad[:, 0].abs().sum() == 0 and leaf.grad[:, 2].abs().sum() == 0
    torch.testing.assert_close(leaf.grad[:, 1].double(), oracle.grad[:, 1], atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_rounds_once(interpret, dtype):
    """The kernel rotates in float32 and rounds once: within half an ulp of the float64 result
    of the same (rounded) inputs, and no further from it than the reference, which rounds
    every product in the input dtype."""
    x, positions, (cos, sin) = _inputs(45, 3, 32, seed=3)
    x = x.to(dtype)
    want = _rope_complex(x.double(), positions, THETA)
    got = rope(x, positions, cos, sin, backend="triton").double()
    reference = apply_rope(x, positions, tables=(cos, sin)).double()
    ulp = torch.finfo(dtype).eps * want.abs().clamp(min=torch.finfo(dtype).tiny)
    assert ((got - want).abs() <= ulp + 1e-6 * want.abs().max()).all()
    assert (got - want).abs().max() <= (reference - want).abs().max()


def test_inverse_rotation_undoes_the_rotation(interpret):
    x, positions, (cos, sin) = _inputs(33, 2, 12, seed=5)
    rotated = rope(x, positions, cos, sin, backend="triton")
    back = torch.ops.gem_kernels.rope(rotated, positions, cos, sin, True, "triton")
    torch.testing.assert_close(back, x, atol=1e-5, rtol=1e-5)


def test_int32_positions(interpret):
    x, positions, (cos, sin) = _inputs(20, 2, 8, seed=7)
    torch.testing.assert_close(
        rope(x, positions.int(), cos, sin, backend="triton"),
        rope(x, positions, cos, sin, backend="reference"),
    )


def test_positions_outside_the_tables_read_nothing(interpret):
    """The kernel's contract where positions go unchecked (CUDA): a row whose position is
    outside [0, L) is zeros, and no table memory outside the tables is read (the operator
    is called directly: the public function refuses such positions on the CPU)."""
    x, positions, (cos, sin) = _inputs(40, 2, 8, seed=11, max_len=16)
    positions[[0, 17, 39]] = torch.tensor([-3, 16, 1_000_000])
    inside = torch.ones(40, dtype=torch.bool)
    inside[[0, 17, 39]] = False
    out = torch.ops.gem_kernels.rope(x, positions, cos, sin, False, "triton")
    assert torch.all(out[~inside] == 0)
    want = rope(x[inside], positions[inside], cos, sin, backend="reference")
    torch.testing.assert_close(out[inside], want)


@pytest.mark.parametrize("api", ["rope", "rope_qkv"])
def test_positions_outside_the_tables_are_refused_on_the_cpu(api):
    x, positions, (cos, sin) = _inputs(6, 2, 8, seed=0, max_len=16)
    for bad, shown in ((-1, "from -1 to"), (16, "to 16")):
        positions[2] = bad
        with pytest.raises(ValueError, match=rf"positions must lie in \[0, 16\).*{shown}"):
            if api == "rope":
                rope(x, positions, cos, sin)
            else:
                rope_qkv(torch.stack([x, x, x], 1), positions, cos, sin)


def test_bad_arguments_name_the_argument():
    x, positions, (cos, sin) = _inputs(6, 2, 8, seed=0)
    with pytest.raises(ValueError, match="head_dim must be even"):
        rope(x[..., :7], positions, cos[:, :3], sin[:, :3])
    with pytest.raises(TypeError, match="positions must have dtype"):
        rope(x, positions.float(), cos, sin)
    with pytest.raises(ValueError, match=r"positions must have shape \(T,\)"):
        rope(x, positions[:5], cos, sin)
    with pytest.raises(ValueError, match="cos must be"):
        rope(x, positions, cos[:, :3], sin)
    with pytest.raises(TypeError, match="sin must have dtype float32"):
        rope(x, positions, cos, sin.double())
    with pytest.raises(ValueError, match="backend must be one of"):
        rope(x, positions, cos, sin, backend="cuda")


def test_rope_qkv_bad_arguments_name_the_argument():
    x, positions, (cos, sin) = _inputs(6, 2, 8, seed=0)
    qkv = torch.stack([x, x, x], dim=1)
    with pytest.raises(ValueError, match=r"qkv must be \(tokens, 3, heads, head_dim\)"):
        rope_qkv(qkv[:, :2], positions, cos, sin)
    with pytest.raises(ValueError, match="qkv must be 4-D"):
        rope_qkv(x, positions, cos, sin)
    with pytest.raises(ValueError, match="qkv's head_dim must be even"):
        rope_qkv(qkv[..., :7], positions, cos[:, :3], sin[:, :3])
    with pytest.raises(ValueError, match=r"positions must have shape \(T,\)"):
        rope_qkv(qkv, positions[:5], cos, sin)
    with pytest.raises(ValueError, match="backend must be one of"):
        rope_qkv(qkv, positions, cos, sin, backend="cuda")


def test_triton_backend_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x, positions, (cos, sin) = _inputs(6, 2, 8, seed=0)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        rope(x, positions, cos, sin, backend="triton")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_kernel_on_cuda():
    """The compiled kernel at the model's shape class (bf16, D = 128, a qkv slice)."""
    x, positions, (cos, sin) = _inputs(4099, 4, 128, seed=9, max_len=1024, strided=True)
    x, positions, cos, sin = (t.cuda() for t in (x.bfloat16(), positions, cos, sin))
    leaf = x.clone().requires_grad_(True)
    out = rope(leaf, positions, cos, sin)
    grad = torch.randn_like(out)
    out.backward(grad)
    oracle = x.double().requires_grad_(True)
    want = _rope_complex(oracle.cpu(), positions.cpu(), THETA).cuda()
    want.backward(grad.double())
    torch.testing.assert_close(out.double(), want, atol=0.02, rtol=0.01)
    torch.testing.assert_close(leaf.grad.double(), oracle.grad, atol=0.02, rtol=0.01)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_rope_qkv_on_cuda():
    """rope_qkv's kernels at the model's shape class (bf16, D = 128), against rope of the
    slices: the same rotations, bit for bit, and the same gradient."""
    gen = torch.Generator().manual_seed(10)
    qkv = torch.randn(4099, 3, 4, 128, generator=gen).bfloat16().cuda()
    positions = torch.randint(0, 1024, (4099,), generator=gen).cuda()
    cos, sin = (t.cuda() for t in rope_tables(1024, 128, THETA))
    grads = [torch.randn(4099, 4, 128, generator=gen).bfloat16().cuda() for _ in range(3)]
    fused, split = qkv.clone().requires_grad_(True), qkv.clone().requires_grad_(True)
    outs = rope_qkv(fused, positions, cos, sin)
    sum((out.float() * grad).sum() for out, grad in zip(outs, grads, strict=True)).backward()
    q, k, v = split.unbind(1)
    wants = (rope(q, positions, cos, sin), rope(k, positions, cos, sin), v)
    sum((want.float() * grad).sum() for want, grad in zip(wants, grads, strict=True)).backward()
    for out, want in zip(outs, wants, strict=True):
        assert torch.equal(out, want)
    assert torch.equal(fused.grad, split.grad)
