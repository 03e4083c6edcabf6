"""Fuzzed calls of Fp8Linear (with its Fp8Recipe) and quantize_mx (issue 27).

Each example builds a valid call and applies up to two faults: feature counts that are zero,
negative, non-int or overflow a weight, parameter dtypes that are not float, recipes that are
not recipes or hold bad fields (a Hadamard block too large to build is one), inputs that are
not tensors, have the wrong dtype, rank, last dim or device, zero rows, NaN / Inf values;
block sizes, element dtypes, roundings, square flags and backends that are wrong. Every call
either works and matches an oracle, or raises a ``ValueError`` / ``TypeError`` naming an
argument the example broke (``tests/support/fuzz_tally.py``).

Oracles: ``Fp8Linear`` against the fake-quantised emulation of its recipe (operands quantised
by ``fake_quantize_blockwise`` / ``quantize_mx``, multiplied in float32, rounded as the layer
documents); ``quantize_mx`` against the exact-rational OCP MX model of ``test_mx``.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch
from fuzz_tally import Fault, Tally, fuzz_settings
from gem_precision import Fp8Linear, Fp8Recipe, fp8_gemm_emulated, quantize_mx
from hypothesis import given
from hypothesis import strategies as st
from test_mx import REF_FORMATS, ref_quantize

LINEAR_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
MX_INPUT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ELEM_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2]


def _faults(draw, table) -> list:
    return draw(st.lists(st.sampled_from(table), max_size=2, unique=True))


def _values(generator, shape, dtype, special) -> torch.Tensor:
    x = torch.randn(*shape, generator=generator, dtype=torch.float64)
    x = x * torch.tensor(2.0) ** torch.randint(-12, 12, shape, generator=generator)
    if special is not None and x.numel():
        hit = torch.rand(*shape, generator=generator) < 0.05
        x[hit] = float(special)
    return x.to(dtype)


def _describe(label: str, values: dict) -> str:
    shown = {}
    for name, value in values.items():
        if isinstance(value, torch.Tensor):
            value = f"{tuple(value.shape)} {value.dtype} {value.device.type}"
        shown[name] = value
    return f"{label} {shown}"


# ---------------------------------------------------------------------------------------------
# Fp8Linear.


@st.composite
def recipes(draw):
    """(recipe keyword arguments, faults): a valid recipe, or one with a bad field."""
    kwargs: dict = {}
    kind = draw(st.sampled_from(["default", "tensorwise", "hadamard", "mx", "wgrad_bf16", "sr"]))
    if kind == "tensorwise":
        kwargs["tensorwise"] = True
    elif kind == "hadamard":
        kwargs.update(hadamard=True, hadamard_block_size=draw(st.sampled_from([1, 16, 32, 64])))
    elif kind == "mx":
        kwargs.update(scaling="mx", mx_scale_rounding=draw(st.sampled_from(["ceil", "floor"])))
    elif kind == "wgrad_bf16":
        kwargs["wgrad_in_bf16"] = True
    elif kind == "sr":
        kwargs.update(stochastic_rounding_grads=True, seed=draw(st.integers(0, 2**62)))
    if draw(st.booleans()):
        kwargs["grad_dtype"] = draw(st.sampled_from(ELEM_DTYPES))
    faults = []
    if draw(st.integers(0, 5)) == 0:
        name, value = draw(
            st.sampled_from(
                [
                    ("hadamard_block_size", 2**20),
                    ("hadamard_block_size", 3),
                    ("hadamard_block_size", 0),
                    ("seed", -1),
                    ("seed", 2**70),
                    ("seed", 1.5),
                    ("scaling", "fp8"),
                    ("scaling", None),
                    ("mx_scale_rounding", "round"),
                    ("fp8_dtype", torch.float16),
                    ("fp8_dtype", [1]),
                    ("grad_dtype", "e5m2"),
                    ("tensorwise", "yes"),
                    ("hadamard", 1),
                ]
            )
        )
        kwargs[name] = value
        faults.append(Fault(f"recipe_{name}", "reject", [name]))
    return kwargs, faults


@st.composite
def linear_cases(draw):
    features = st.sampled_from([1, 3, 4, 32, 64, 96, 128, 130, 160])
    args = {
        "in_features": draw(features),
        "out_features": draw(features),
        "bias": draw(st.booleans()),
        "dtype": draw(st.sampled_from([None, *LINEAR_DTYPES])),
    }
    recipe_kwargs, faults = draw(recipes())
    faults = list(faults)
    x_dtype = draw(st.sampled_from(LINEAR_DTYPES))
    lead = draw(st.lists(st.integers(0, 5), max_size=2))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    special = draw(st.sampled_from([None, None, None, "nan", "inf", "-inf"]))
    x = _values(generator, (*lead, args["in_features"]), x_dtype, special)
    recipe_given = draw(st.booleans()) or bool(recipe_kwargs)
    state = {"args": args, "recipe": recipe_kwargs if recipe_given else None, "x": x}
    for fault in _faults(draw, LINEAR_FAULTS):
        fault(draw, state, faults)
    if (
        state["recipe"] is not None
        and state["recipe"].get("scaling") == "mx"
        and not state["recipe"].get("hadamard")
        and isinstance(args["in_features"], int)
        and isinstance(args["out_features"], int)
        and (args["in_features"] % 32 or args["out_features"] % 32)
    ):
        faults.append(Fault("mx_features", "reject", ["in_features", "out_features"]))
    backward = draw(st.booleans())
    x = state["x"]
    if (
        backward
        and state["recipe"] is not None
        and state["recipe"].get("scaling") == "mx"
        and not state["recipe"].get("hadamard")
        and isinstance(x, torch.Tensor)
        and x.dtype in LINEAR_DTYPES
        and x.device.type == "cpu"
        and x.dim() > 0
        and bool(torch.isfinite(x).all())
        and (x.numel() // max(1, x.shape[-1])) % 32
    ):
        faults.append(Fault("mx_rows", "reject", ["x"]))  # the weight gradient: 32-row blocks
    return state, faults, backward


def fault_features(draw, state, faults):
    name = draw(st.sampled_from(["in_features", "out_features"]))
    value = draw(st.sampled_from([0, -1, 2.5, True, "8", None, np.int64(4)]))
    state["args"][name] = value
    faults.append(Fault(f"{name}_{value!r}", "reject", [name]))


def fault_overflow(draw, state, faults):
    state["args"]["in_features"] = state["args"]["out_features"] = 2**31
    faults.append(Fault("features_overflow", "reject", ["in_features", "out_features"]))


def fault_dtype(draw, state, faults):
    state["args"]["dtype"] = draw(
        st.sampled_from([torch.int32, torch.complex64, "float32", torch.float8_e4m3fn])
    )
    faults.append(Fault("dtype", "reject", ["dtype"]))


def fault_recipe_type(draw, state, faults):
    state["recipe_object"] = draw(st.sampled_from(["fp8", {"tensorwise": True}, 1]))
    faults.append(Fault("recipe_type", "reject", ["recipe"]))


def fault_x(draw, state, faults):
    x = state["x"]
    how = draw(
        st.sampled_from(
            ["list", "int", "fp8", "complex", "rank0", "last_dim", "meta", "strided", "expanded",
             "bool"]
        )
    )  # fmt: skip
    kind = "reject"
    if how == "list":
        x = x.tolist()
    elif how == "int":
        x = (
            x.to(torch.int32)
            if bool(torch.isfinite(x).all())
            else torch.zeros(x.shape, dtype=torch.int32)
        )
    elif how == "fp8":
        x = x.to(torch.float8_e4m3fn)
    elif how == "complex":
        x = x.to(torch.complex64)
    elif how == "bool":
        x = x > 0
    elif how == "rank0":
        x = x.reshape(-1)[:1].reshape(()) if x.numel() else torch.tensor(1.0)
    elif how == "last_dim":
        x = torch.zeros(*x.shape[:-1], x.shape[-1] + 1, dtype=x.dtype)
    elif how == "meta":
        x = x.to("meta")
    elif how == "strided":
        x = torch.stack([x, x], dim=-1)[..., 0]
        kind = "accept"
    else:
        x = x[..., :1, :].expand(x.shape) if x.dim() > 1 and x.shape[-2] else x
        kind = "accept"
    state["x"] = x
    faults.append(Fault(f"x_{how}", kind, ["x"]))


LINEAR_FAULTS = [fault_features, fault_overflow, fault_dtype, fault_recipe_type, fault_x]


def _emulate(layer: Fp8Linear, x: torch.Tensor) -> torch.Tensor:
    """The layer's documented forward, emulated: quantised operands, float32 GEMM, the bias
    added before the output rounding (blockwise) or after it (MX, Hadamard), the GEMM written
    in the input's dtype (float32 / bfloat16; other dtypes get bfloat16) and cast back."""
    recipe = layer.recipe
    x2d = x.reshape(-1, layer.in_features).float()
    weight = layer.weight.detach().float()
    bias = None if layer.bias is None else layer.bias.detach().float()
    gemm_dtype = {torch.float32: torch.float32, torch.float64: torch.float32}.get(
        x.dtype, torch.bfloat16
    )
    if x.dtype == torch.float64 and layer.weight.dtype == torch.float64:
        gemm_dtype = torch.float32
    elif x.dtype == torch.bfloat16:
        gemm_dtype = torch.bfloat16
    if x2d.shape[0] == 0:
        out = torch.zeros(0, layer.out_features)
    elif recipe.scaling == "mx" and not recipe.hadamard:

        def mx(t, square=False):
            return quantize_mx(
                t.contiguous(), elem_dtype=recipe.fp8_dtype, square=square,
                scale_rounding=recipe.mx_scale_rounding,
            ).dequantize(torch.float32)  # fmt: skip

        out = (mx(x2d) @ mx(weight, square=True).T).to(gemm_dtype).float()
        out = out if bias is None else out + bias.to(gemm_dtype).float()
    else:
        out = fp8_gemm_emulated(x2d, weight, (1, 128), (128, 128), recipe)
        if recipe.hadamard:
            out = out.to(gemm_dtype).float()
            out = out if bias is None else out + bias
        else:
            out = (out if bias is None else out + bias).to(gemm_dtype).float()
    return out.to(x.dtype).reshape(*x.shape[:-1], layer.out_features)


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> str | None:
    if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.dtype != want.dtype:
        return f"{what}: got {getattr(got, 'shape', got)} {getattr(got, 'dtype', '')}, want {tuple(want.shape)} {want.dtype}"
    if got.numel() == 0:
        return None
    a, b = got.detach().double(), want.detach().double()
    if not bool(torch.equal(torch.isnan(a), torch.isnan(b))):
        return f"{what}: NaN in different places"
    finite = torch.isfinite(b)
    infinite = torch.isinf(b)
    if not bool(torch.equal(torch.isinf(a), infinite)) or not bool(
        torch.equal(a[infinite], b[infinite])
    ):
        return f"{what}: infinities differ"
    if not bool(torch.isfinite(a[finite]).all()):
        return f"{what}: non-finite where the oracle is finite"
    a, b = a[finite], b[finite]
    if b.numel() == 0:
        return None
    # One rounding of the output dtype, plus float32 summation order.
    ulp = {
        torch.float64: 2**-23,
        torch.float32: 2**-20,
        torch.bfloat16: 2**-7,
        torch.float16: 2**-7,
    }
    tol = ulp[want.dtype] * max(1.0, float(b.abs().max())) * 2
    error = float((a - b).abs().max())
    return None if error <= tol else f"{what}: max error {error:.3g} > {tol:.3g}"


def run_linear(tally: Tally, state: dict, faults: list, backward: bool) -> None:
    args = dict(state["args"])
    x = state["x"]

    def call():
        if "recipe_object" in state:
            recipe = state["recipe_object"]
        else:
            recipe = None if state["recipe"] is None else Fp8Recipe(**state["recipe"])
        torch.manual_seed(0)
        layer = Fp8Linear(**args, recipe=recipe)
        inputs = x
        finite = (
            isinstance(x, torch.Tensor)
            and x.dtype in LINEAR_DTYPES
            and x.device.type == "cpu"
            and bool(torch.isfinite(x).all())
        )
        if backward and finite:
            inputs = x.detach().clone().requires_grad_(True)
        out = layer(inputs)
        grads = None
        if inputs is not x:
            weights = torch.linspace(-1.0, 1.0, out.numel()).reshape(out.shape).to(out.dtype)
            (out * weights).sum().backward()
            grads = (
                inputs.grad,
                layer.weight.grad,
                None if layer.bias is None else layer.bias.grad,
            )
        return layer, out, grads

    def oracle(result) -> str | None:
        layer, out, grads = result
        problem = _close(out, _emulate(layer, x), "output")
        if problem or grads is None:
            return problem
        for name, grad, like in zip(
            ("x", "weight", "bias"), grads, (x, layer.weight, layer.bias), strict=True
        ):
            if like is None:
                continue
            if grad is None or grad.shape != like.shape or grad.dtype != like.dtype:
                return f"grad of {name}: {None if grad is None else (grad.shape, grad.dtype)}"
            if not bool(torch.isfinite(grad).all()):
                return f"grad of {name} is not finite for finite inputs"
        return None

    shown = dict(args, recipe=state.get("recipe_object", state["recipe"]), x=x)
    tally.check(call, faults, oracle, describe=_describe("Fp8Linear", shown))


def test_fuzz_fp8_linear():
    tally = Tally("Fp8Linear")

    @fuzz_settings(100)
    @given(case=linear_cases())
    def run(case):
        state, faults, backward = case
        run_linear(tally, state, faults, backward)

    run()
    tally.finish()


# ---------------------------------------------------------------------------------------------
# quantize_mx.


@st.composite
def mx_cases(draw, triton: bool = False):
    block = draw(st.sampled_from([2, 4, 8, 32] if triton else [1, 2, 3, 4, 8, 32]))
    square = draw(st.booleans())
    rank = draw(st.integers(2 if square else 1, 3))
    shape = [draw(st.integers(0, 3)) for _ in range(rank)]
    shape[-1] *= block
    if square:
        shape[-2] *= block
    dtype = draw(st.sampled_from(MX_INPUT_DTYPES))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    special = draw(st.sampled_from([None, None, "nan", "inf", "-inf", 0.0, 1e-40]))
    kwargs = {
        "x": _values(generator, tuple(shape), dtype, special),
        "block_size": block,
        "elem_dtype": draw(st.sampled_from(ELEM_DTYPES)),
        "scale_rounding": draw(st.sampled_from(["floor", "ceil"])),
        "square": square,
        "backend": "triton" if triton else draw(st.sampled_from(["auto", "torch"])),
    }
    faults: list[Fault] = []
    for fault in _faults(draw, MX_FAULTS):
        fault(draw, kwargs, faults)
    return kwargs, faults


def fault_mx_x(draw, kwargs, faults):
    x = kwargs["x"]
    how = draw(
        st.sampled_from(
            ["float64", "int", "fp8", "bool", "list", "rank0", "last_dim", "square_rows",
             "strided", "meta"]
        )
    )  # fmt: skip
    kind, names = "reject", ["x"]
    if how == "float64":
        x = x.double()
    elif how == "int":
        x = torch.zeros(x.shape, dtype=torch.int32)
    elif how == "fp8":
        x = x.to(torch.float8_e4m3fn)
    elif how == "bool":
        x = x > 0
    elif how == "list":
        x = x.tolist()
    elif how == "rank0":
        x = torch.tensor(1.0)
    elif how == "last_dim":
        x = torch.zeros(*x.shape[:-1], x.shape[-1] + 1, dtype=x.dtype)
        names = ["x", "block_size"]
        kind = "either" if kwargs["block_size"] == 1 else "reject"
    elif how == "square_rows":
        if x.dim() < 2:
            return
        x = torch.zeros(*x.shape[:-2], x.shape[-2] + 1, x.shape[-1], dtype=x.dtype)
        names = ["x", "block_size", "square"]
        kind = "reject" if kwargs["square"] is True and kwargs["block_size"] != 1 else "accept"
    elif how == "strided":
        x = torch.stack([x, x], dim=-1)[..., 0]
        kind = "accept"
    else:
        x = x.to("meta")
        kind = "either"
    kwargs["x"] = x
    faults.append(Fault(f"x_{how}", kind, names))


def fault_mx_option(draw, kwargs, faults):
    name, value = draw(
        st.sampled_from(
            [
                ("block_size", 0),
                ("block_size", -3),
                ("block_size", 32.0),
                ("block_size", True),
                ("block_size", np.int64(32)),
                ("block_size", "32"),
                ("block_size", None),
                ("block_size", 2**70),
                ("elem_dtype", "e4m3"),
                ("elem_dtype", torch.float16),
                ("elem_dtype", [1]),
                ("elem_dtype", None),
                ("scale_rounding", "round"),
                ("scale_rounding", None),
                ("scale_rounding", ["floor"]),
                ("square", "yes"),
                ("square", 1),
                ("square", None),
                ("backend", "cuda"),
                ("backend", None),
                ("backend", "triton"),
            ]
        )
    )
    kwargs[name] = value
    names = [name, "x"] if name == "block_size" else [name]
    # backend="triton" runs on the CPU under the interpreter (the Triton test sets it).
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    kind = "either" if (name, value) == ("backend", "triton") and interpreted else "reject"
    faults.append(Fault(f"{name}_{value!r}", kind, names))


MX_FAULTS = [fault_mx_x, fault_mx_option]


def _mx_oracle(kwargs: dict, mx) -> str | None:
    x = kwargs["x"]
    block, square, elem = kwargs["block_size"], kwargs["square"], kwargs["elem_dtype"]
    if x.device.type == "meta" or x.numel() == 0:
        if square:
            expected = tuple(x.shape[:-2]) + (x.shape[-2] // block, x.shape[-1] // block)
        else:
            expected = tuple(x.shape[:-1]) + (x.shape[-1] // block,)
        if mx.data.shape != x.shape or tuple(mx.scale.shape) != expected:
            return f"shapes {tuple(mx.data.shape)} / {tuple(mx.scale.shape)}, want {expected}"
        return None
    if mx.data.dtype != elem or mx.data.shape != x.shape or mx.orig_dtype != x.dtype:
        return f"data {mx.data.dtype} {tuple(mx.data.shape)} orig {mx.orig_dtype}"
    values = x.to(torch.float64).numpy()
    if square:
        *batch, rows, cols = values.shape
        values = values.reshape(*batch, rows // block, block, cols // block, block)
        values = np.swapaxes(values, -3, -2).reshape(*batch, rows // block, cols // block, -1)
    codes, scales = ref_quantize(values, block * block if square else block, REF_FORMATS[elem],
                                 kwargs["scale_rounding"])  # fmt: skip
    if square:
        scales = scales.reshape(*scales.shape[:-1])
        codes = codes.reshape(*batch, rows // block, cols // block, block, block)
        codes = np.swapaxes(codes, -3, -2).reshape(x.shape)
    if mx.scale.shape != scales.shape or not np.array_equal(mx.scale.numpy(), scales):
        return f"scales differ from the OCP model ({tuple(mx.scale.shape)} vs {scales.shape})"
    got = mx.data.view(torch.uint8).to(torch.int64).numpy()
    if not np.array_equal(got, codes):
        return f"{int((got != codes).sum())} element codes differ from the OCP model"
    return None


def run_mx(tally: Tally, kwargs: dict, faults: list, also=()) -> None:
    tally.check(
        lambda: quantize_mx(**kwargs),
        faults,
        lambda mx: _mx_oracle(kwargs, mx),
        describe=_describe("quantize_mx", kwargs),
        also_names=also,
    )


def test_fuzz_quantize_mx():
    tally = Tally("quantize_mx")

    @fuzz_settings(150)
    @given(case=mx_cases())
    def run(case):
        run_mx(tally, *case)

    run()
    tally.finish()


def test_fuzz_quantize_mx_triton_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    tally = Tally("quantize_mx/triton", time_limit=120.0)

    @fuzz_settings(10)
    @given(case=mx_cases(triton=True))
    def run(case):
        kwargs, faults = case
        run_mx(tally, kwargs, faults, also=("backend",) if kwargs["backend"] == "triton" else ())

    run()
    tally.finish()


@pytest.mark.parametrize("value", [math.nan, 2**20])
def test_recipe_rejects_what_would_hang_or_exhaust_memory(value):
    """A Hadamard block of 2**20 built a 2**20 x 2**20 matrix (the process was killed)."""
    with pytest.raises((ValueError, TypeError), match="hadamard_block_size"):
        Fp8Recipe(hadamard=True, hadamard_block_size=value)
