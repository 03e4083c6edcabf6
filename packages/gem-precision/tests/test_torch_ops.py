"""The ``torch.ops.gem_precision`` operators behind quantize_operand, scaled_mm_nt,
norm_quantize, Fp8Linear (blockwise, tensorwise, MX) and Fp8NormLinear: ``torch.library.opcheck``
on each (CPU: the PyTorch quantisation and the emulated GEMMs; the fused norm linear's Triton
kernels interpreted, in a subprocess), and ``torch.compile`` of a small model with FP8 linears:
no graph break, no recompilation from step to step, and forward and gradients bit-identical to
eager.

opcheck and torch.compile import ``torch._dynamo``, which imports ``triton.language`` for
compilation; the Triton interpreter cannot run after that in the same process (see
gem-kernels' ``test_kernels_errors.py``). So nothing here imports them at module level, and
this file sorts after the interpreter test files.
"""

from __future__ import annotations

import pytest
import torch
from gem_precision import Fp8Linear, Fp8Recipe, quantize_operand, scaled_mm_nt
from torch import nn

E4M3 = torch.float8_e4m3fn


def _randn(*shape, seed=0, dtype=torch.float32, grad=False):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=dtype).requires_grad_(grad)


_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _opcheck(op, args):
    """``torch.library.opcheck`` (schema, autograd registration, fake tensors, AOTAutograd with
    dynamic shapes). Its schema check compares inputs before and after with ``allclose``, which
    CPU torch does not implement for FP8 tensors; for operators taking FP8 inputs the same
    checks (inputs not mutated, outputs not aliasing inputs) are done here on the raw bytes."""
    fp8_inputs = any(isinstance(a, torch.Tensor) and a.dtype in _FP8 for a in args)
    if not fp8_inputs:
        torch.library.opcheck(op, args)
        return
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    before = [t.detach().view(torch.uint8).clone() if t.dtype in _FP8 else t.detach().clone()
              for t in tensors]  # fmt: skip
    outputs = op(*args)
    outputs = [outputs] if isinstance(outputs, torch.Tensor) else list(outputs)
    for t, b in zip(tensors, before, strict=True):
        now = t.detach().view(torch.uint8) if t.dtype in _FP8 else t.detach()
        assert torch.equal(now, b), "the operator mutated an input"
    storages = {t.untyped_storage().data_ptr() for t in tensors if t.numel()}
    assert not any(o.numel() and o.untyped_storage().data_ptr() in storages for o in outputs)
    utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(op, args, test_utils=utils)


QUANTIZE_CASES = {
    "1x128_both_layouts_col_sum": ("1x128", True, True, None, True, False),
    "1x128_col_tiles": ("1x128", True, True, None, False, True),
    "1x128_rows_only": ("1x128", True, False, None, False, False),
    "128x128": ("128x128", True, True, None, False, False),
    "tensorwise": ("tensorwise", True, True, None, True, False),
    "stochastic_cols_only": ("1x128", False, True, 3, False, False),
}


@pytest.mark.parametrize("case", QUANTIZE_CASES)
def test_opcheck_quantize_operand(case):
    kind, rows, cols, seed, col_sum, col_tiles = QUANTIZE_CASES[case]
    x = _randn(130, 200, dtype=torch.bfloat16)  # partial tiles both ways
    args = (x, kind, E4M3, rows, cols, seed, 5, col_sum, col_tiles, "torch")
    _opcheck(torch.ops.gem_precision.quantize_operand.default, args)


def test_quantize_operand_outputs_carry_no_gradient():
    x = _randn(4, 128, grad=True)
    op = quantize_operand(x, "1x128", col_sum=True)
    assert not any(t.requires_grad for t in (op.data, op.scale, op.data_t, op.col_sum))


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("kinds", [("1x128", "128x128"), ("tensorwise", "tensorwise")])
def test_opcheck_scaled_mm_nt(kinds, with_bias):
    a = quantize_operand(_randn(33, 256), kinds[0], cols=False)
    b = quantize_operand(_randn(48, 256, seed=1), kinds[1], cols=False)
    bias = _randn(48, seed=2, grad=True) if with_bias else None
    args = (a.data, a.scale, kinds[0], b.data, b.scale, kinds[1], torch.float32, False, bias)
    _opcheck(torch.ops.gem_precision.scaled_mm_nt.default, args)


def test_scaled_mm_nt_bias_gradient_is_the_column_sum():
    a = quantize_operand(_randn(5, 128), cols=False)
    b = quantize_operand(_randn(16, 128, seed=1), "128x128", cols=False)
    bias = _randn(16, seed=2, grad=True)
    out = scaled_mm_nt(a.data, a.scale, "1x128", b.data, b.scale, "128x128", bias=bias)
    grad = _randn(*out.shape, seed=3, dtype=out.dtype)
    out.backward(grad)
    torch.testing.assert_close(bias.grad, grad.float().sum(0))


LINEAR_CASES = {
    "default": (Fp8Recipe(), torch.bfloat16, True, True),
    "tensorwise": (Fp8Recipe(tensorwise=True), torch.float32, True, True),
    "wgrad_bf16_no_bias": (Fp8Recipe(wgrad_in_bf16=True), torch.float32, True, False),
    "stochastic_e5m2": (
        Fp8Recipe(stochastic_rounding_grads=True, grad_dtype=torch.float8_e5m2, seed=4),
        torch.bfloat16,
        True,
        True,
    ),
    "frozen_input": (Fp8Recipe(wgrad_x_tiles=False), torch.float32, False, True),
    # The layouts of the native GEMMs (rows padded for cuBLAS; torch._scaled_mm, if the CPU
    # refuses it, falls back to the emulation on the same padded operands).
    "native_tiles": (Fp8Recipe(), torch.bfloat16, True, True),
    "native_x_rows": (Fp8Recipe(wgrad_x_tiles=False), torch.float32, True, False),
}


def _linear_args(case):
    recipe, dtype, x_grad, with_bias = LINEAR_CASES[case]
    x = _randn(70, 256, dtype=dtype, grad=x_grad)  # a partial 128-row tile
    weight = _randn(160, 256, seed=1, dtype=dtype, grad=True)
    bias = _randn(160, seed=2, dtype=dtype, grad=True) if with_bias else None
    sr = recipe.stochastic_rounding_grads
    return (
        x, weight, bias, recipe.fp8_dtype, recipe.grad_dtype, recipe.tensorwise,
        recipe.wgrad_in_bf16, recipe.wgrad_x_tiles, recipe.seed if sr else None,
        torch.tensor(11) if sr else None, x_grad, True, case.startswith("native"),
    )  # fmt: skip


@pytest.mark.parametrize("case", LINEAR_CASES)
def test_opcheck_fp8_linear(case):
    args = _linear_args(case)
    _opcheck(torch.ops.gem_precision.fp8_linear.default, args)


@pytest.mark.parametrize("case", LINEAR_CASES)
def test_opcheck_fp8_linear_backward(case):
    recipe, dtype, x_grad, with_bias = LINEAR_CASES[case]
    args = _linear_args(case)
    x, weight, bias = args[:3]
    _, x_t, x_t_scale, w_t, w_t_scale = torch.ops.gem_precision.fp8_linear(*args)
    sr = recipe.stochastic_rounding_grads
    saved_x = x.detach() if recipe.wgrad_in_bf16 else None
    backward_args = (
        _randn(70, 160, seed=3, dtype=dtype), x_t, x_t_scale, saved_x, w_t, w_t_scale,
        torch.tensor(11) if sr else None, recipe.fp8_dtype, recipe.grad_dtype, recipe.tensorwise,
        recipe.wgrad_x_tiles and not recipe.tensorwise,
        recipe.seed if sr else None, 256, weight.dtype,
        None if bias is None else bias.dtype, x_grad, True, with_bias, case.startswith("native"),
    )  # fmt: skip
    _opcheck(torch.ops.gem_precision.fp8_linear_backward.default, backward_args)


@pytest.mark.parametrize("x_grad", [True, False])
def test_opcheck_mx_linear(x_grad):
    x = _randn(64, 96, dtype=torch.bfloat16, grad=x_grad)
    weight = _randn(160, 96, seed=1, dtype=torch.bfloat16, grad=True)
    bias = _randn(160, seed=2, dtype=torch.bfloat16, grad=True)
    args = (x, weight, bias, E4M3, torch.float8_e5m2, "ceil", x_grad, False)
    _opcheck(torch.ops.gem_precision.mx_linear.default, args)
    _, w_data, w_scale = torch.ops.gem_precision.mx_linear(*args)
    backward_args = (
        _randn(64, 160, seed=3, dtype=torch.bfloat16), x.detach(), w_data, w_scale, E4M3,
        torch.float8_e5m2, "ceil", torch.bfloat16, torch.bfloat16, x_grad, True, True, False,
    )  # fmt: skip
    _opcheck(torch.ops.gem_precision.mx_linear_backward.default, backward_args)


HADAMARD_RECIPES = {
    "default": Fp8Recipe(hadamard=True),
    "tensorwise_bf16_wgrad_sr": Fp8Recipe(
        hadamard=True, tensorwise=True, wgrad_in_bf16=True, stochastic_rounding_grads=True, seed=5
    ),
}


@pytest.mark.parametrize("name", HADAMARD_RECIPES)
def test_opcheck_fp8_hadamard_linear(name):
    recipe = HADAMARD_RECIPES[name]
    x = _randn(70, 96, dtype=torch.bfloat16, grad=True)
    weight = _randn(48, 96, seed=1, dtype=torch.bfloat16, grad=True)
    offset = torch.tensor(9) if recipe.stochastic_rounding_grads else None
    fields = (
        recipe.fp8_dtype, recipe.grad_dtype, recipe.tensorwise, recipe.wgrad_in_bf16,
        recipe.wgrad_x_tiles, recipe.stochastic_rounding_grads, recipe.hadamard_block_size,
        recipe.seed,
    )  # fmt: skip
    args = (x, weight, offset, *fields, False)
    _opcheck(torch.ops.gem_precision.fp8_hadamard_linear.default, args)
    grad_out = _randn(70, 48, seed=2)
    backward_args = (grad_out, x.detach(), weight.detach(), offset, *fields, True, True, False)
    _opcheck(torch.ops.gem_precision.fp8_hadamard_linear_backward.default, backward_args)


def test_backward_operator_is_once_differentiable():
    layer = Fp8Linear(128, 64)
    x = _randn(8, 128, grad=True)
    (grad,) = torch.autograd.grad(layer(x).square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match=r"fp8_linear_backward is not differentiable"):
        grad.sum().backward()


# ---------------------------------------------------------------------------------------------
# torch.compile.


class _Mlp(nn.Module):
    def __init__(self, recipe: Fp8Recipe):
        super().__init__()
        torch.manual_seed(0)
        self.up = Fp8Linear(128, 256, recipe=recipe)
        self.down = Fp8Linear(256, 128, bias=False, recipe=recipe)

    def forward(self, x):
        return self.down(torch.relu(self.up(x))) + x


def _step(model, x, grad):
    x = x.clone().requires_grad_(True)
    out = model(x)
    out.backward(grad)
    grads = [x.grad] + [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return out.detach(), grads


COMPILE_RECIPES = {
    "default": Fp8Recipe(),
    "tensorwise_bf16_wgrad": Fp8Recipe(tensorwise=True, wgrad_in_bf16=True),
    "stochastic": Fp8Recipe(stochastic_rounding_grads=True, seed=7),
    "mx": Fp8Recipe(scaling="mx"),
    "hadamard": Fp8Recipe(hadamard=True, stochastic_rounding_grads=True, hadamard_block_size=64),
}


@pytest.mark.parametrize("name", COMPILE_RECIPES)
def test_compile_has_no_graph_break_and_matches_eager(name):
    from torch._dynamo.testing import CompileCounter
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    eager, compiled_model = _Mlp(COMPILE_RECIPES[name]), _Mlp(COMPILE_RECIPES[name])
    counter = CompileCounter()
    compiled = torch.compile(compiled_model, backend=counter, fullgraph=True)
    for step in range(3):  # training steps: the stochastic rounding offset moves each step
        x = _randn(2, 32, 128, seed=10 + step)  # 64 rows: MX blocks along the tokens
        grad = _randn(2, 32, 128, seed=20 + step)
        want = _step(eager, x, grad)
        got = _step(compiled, x, grad)
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
        for a, b in zip(got[1], want[1], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert dict(counters["graph_break"]) == {}
    # One graph, compiled once (stochastic rounding moves its Philox offset in a tensor).
    assert counter.frame_count == 1


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("hadamard", [False, True], ids=["blockwise", "hadamard"])
def test_compiled_stochastic_rounding_compiles_once_and_matches_eager(hadamard, backend):
    """A compiled training loop with stochastic rounding: one graph for every step (the Philox
    offset moves in a tensor, not in an int torch.compile would specialise on), new random
    bits each step, and the gradients of the eager layer over the same steps, bit for bit
    (inductor too: its partitioner must not hand the backward the advanced counter)."""
    import copy
    from itertools import pairwise

    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    recipe = Fp8Recipe(stochastic_rounding_grads=True, seed=3, hadamard=hadamard)
    torch.manual_seed(0)
    # No bias: the Hadamard path sums its gradient with PyTorch, which inductor may reorder.
    eager = Fp8Linear(128, 64, bias=False, recipe=recipe)
    compiled = torch.compile(copy.deepcopy(eager), backend=backend, fullgraph=True)
    # The same input and output gradient every step: only the stochastic rounding changes.
    x, grad = _randn(48, 128), _randn(48, 64, seed=1)
    steps = []
    for _ in range(4):
        want, got = _step(eager, x, grad), _step(compiled, x, grad)
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
        for a, b in zip(got[1], want[1], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        steps.append(got[1])
    for before, after in pairwise(steps):
        assert not torch.equal(before[0], after[0])  # dgrad: dy rounded with new bits
        assert not torch.equal(before[1], after[1])  # wgrad: dy.T rounded with new bits
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["recompiles"]
    assert dict(counters["graph_break"]) == {}


@pytest.mark.slow
def test_compile_inductor_matches_eager():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = _Mlp(Fp8Recipe())
    compiled = torch.compile(model, backend="inductor", fullgraph=True)
    x, grad = _randn(40, 128), _randn(40, 128, seed=1)
    want, got = _step(model, x, grad), _step(compiled, x, grad)
    # Inductor may fuse the ReLU and the residual add differently: close, not bit-equal.
    torch.testing.assert_close(got[0], want[0])
    for a, b in zip(got[1], want[1], strict=True):
        torch.testing.assert_close(a, b)
    assert dict(counters["graph_break"]) == {}


def test_compile_aot_eager_no_graph_break():
    """``torch._dynamo.explain`` of the module (forward) and aot_eager with backward."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = _Mlp(Fp8Recipe())
    x = _randn(40, 128)
    explanation = torch._dynamo.explain(model)(x)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")
    want = _step(model, x, torch.ones(40, 128))
    got = _step(compiled, x, torch.ones(40, 128))
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    assert dict(counters["graph_break"]) == {}


# ---------------------------------------------------------------------------------------------
# The fused norm -> FP8 linear (Triton only: on CPU under the interpreter).


@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_opcheck_norm_quantize(kind):
    x = _randn(70, 256, dtype=torch.bfloat16)
    weight = _randn(256, seed=1)
    bias = _randn(256, seed=2) if kind == "layer" else None
    args = (x, weight, bias, kind, 1e-5, E4M3, "torch", None, None)
    _opcheck(torch.ops.gem_precision.norm_quantize.default, args)


_FUSED_NORM_SCRIPT = """
import torch
from torch._dynamo.utils import counters
from gem_precision import Fp8NormLinear, Fp8Recipe

def randn(*shape, seed, grad=True):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).requires_grad_(grad)

# opcheck of the fused operators (the Triton kernels, interpreted).
x, norm_w, norm_b = randn(64, 128, seed=0), randn(128, seed=1), randn(128, seed=2)
weight, bias = randn(128, 128, seed=3), randn(128, seed=4)
args = (x, norm_w, norm_b, weight, bias, "layer", 1e-5, torch.float8_e4m3fn,
        torch.float8_e5m2, True, True, False)
torch.library.opcheck(torch.ops.gem_precision.fp8_norm_linear.default, args)
_, mean, rstd, w_t, w_t_scale = torch.ops.gem_precision.fp8_norm_linear(*args)
backward_args = (randn(64, 128, seed=5, grad=False), x.detach(), norm_w.detach(),
                 norm_b.detach(), mean, rstd, w_t, w_t_scale, "layer", torch.float8_e4m3fn,
                 torch.float8_e5m2, False, torch.float32, torch.float32, True, True, True,
                 True, True, False)
torch.library.opcheck(torch.ops.gem_precision.fp8_norm_linear_backward.default, backward_args)

# torch.compile of a model with the fused layer: no graph break, the same bits as eager.
torch.manual_seed(0)
layer = Fp8NormLinear(128, 128, norm="layer", recipe=Fp8Recipe(wgrad_x_tiles=False))
compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
results = []
for model in (layer, compiled):
    x = randn(2, 32, 128, seed=6)
    model(x).square().sum().backward()
    results.append([x.grad] + [p.grad.clone() for p in layer.parameters()])
    layer.zero_grad(set_to_none=True)
for a, b in zip(*results, strict=True):
    torch.testing.assert_close(a, b, rtol=0, atol=0)
assert dict(counters["graph_break"]) == {}, dict(counters["graph_break"])
print("OK")
"""


def test_fused_norm_linear_operators_under_the_interpreter():
    """opcheck of ``fp8_norm_linear`` and its backward, and torch.compile of an
    ``Fp8NormLinear`` on its fused path, in a process started with ``TRITON_INTERPRET=1`` (the
    interpreter runs there after ``torch._dynamo`` is imported, unlike in this one)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run(
        [sys.executable, "-c", _FUSED_NORM_SCRIPT],
        capture_output=True,
        text=True,
        env=env,
        timeout=1200,
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.stderr[-3000:]
