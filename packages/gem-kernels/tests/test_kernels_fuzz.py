"""Fuzzed calls of jagged_flash_attention, gdpa and block_attention (issue 27).

Each example is a small valid jagged problem with up to two faults applied: offsets that go
down, are negative, overrun or hold huge values, the wrong dtype / rank / device / container,
tensors with the wrong rank, dtype, device, head count or head_dim, zero heads, NaN / Inf
values, zero-size batches, huge or too small ``max_*`` lengths, malformed windows, scales,
biases, block sizes, positions and RoPE bases. Every call either works and matches the naive
float64 oracle of ``kernels_naive`` (non-finite inputs: rows the oracle gets finite must match,
rows it gets non-finite must not come back finite), or raises a ``ValueError`` / ``TypeError``
naming an argument the example broke (see ``tests/support/fuzz_tally.py``). The reference backend runs
on the CPU; a few examples run the Triton kernels under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from fuzz_tally import Fault, Tally, fuzz_settings
from gem_kernels import block_attention, gdpa, jagged_flash_attention
from hypothesis import given
from hypothesis import strategies as st
from kernels_naive import naive_block_attention, naive_gdpa, naive_jfa, offsets_of

FLOAT_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
TRITON_DTYPES = [torch.float32, torch.bfloat16]
ACTIVATIONS = ["silu", "gelu", "gelu_tanh", "gelu_fast", "relu2", "identity"]
HUGE_INTS = [2**48, 2**62, 2**63, 2**100]
TOLERANCE = {torch.float64: 1e-9, torch.float32: 2e-4, torch.bfloat16: 3e-2, torch.float16: 4e-3}


# ---------------------------------------------------------------------------------------------
# The problem: lengths, tensors and options of one valid call.


class Case:
    """One call under construction: ``args`` (keyword arguments of the API), the lengths that
    the oracle uses, the faults applied so far and a short description."""

    def __init__(self, api: str, args: dict, q_lengths, k_lengths, pma: bool) -> None:
        self.api, self.args = api, args
        self.q_lengths, self.k_lengths, self.pma = q_lengths, k_lengths, pma
        self.faults: list[Fault] = []
        self.nonfinite = False
        self.origin = ""

    def fault(self, label: str, kind: str, *names: str) -> None:
        self.faults.append(Fault(label, kind, names))

    def describe(self) -> str:
        shown = {}
        for name, value in self.args.items():
            if isinstance(value, torch.Tensor):
                shown[name] = f"{tuple(value.shape)} {value.dtype} {value.device.type}"
                small = value.numel() < 12 and value.device.type == "cpu"
                if small and value.dtype in (torch.int32, torch.int64):
                    shown[name] += f" {value.tolist()}"
            else:
                shown[name] = value if not isinstance(value, list) else f"list({len(value)})"
        return (
            f"{self.api} {self.origin} q_lengths={self.q_lengths} k_lengths={self.k_lengths} "
            f"{shown}"
        )


def _values(generator, shape, dtype, special: str | None = None, row: int = 0) -> torch.Tensor:
    """Standard normal values; ``special`` (``"nan"``, ``"inf"``, ``"-inf"``) goes into some
    entries of row ``row`` (dim 0), so the other samples stay finite."""
    x = torch.randn(*shape, generator=generator, dtype=torch.float64)
    if special is not None and x.numel():
        hit = torch.rand(*shape[1:], generator=generator, dtype=torch.float64) < 0.5
        x[row % shape[0]][hit] = float(special)
    return x.to(dtype)


@st.composite
def problems(draw, api: str, triton: bool = False) -> Case:
    batch = draw(st.integers(0, 4))
    longest = 20 if triton else 9
    q_lengths = draw(st.lists(st.integers(0, longest), min_size=batch, max_size=batch))
    k_lengths = q_lengths
    pma = api == "gdpa" and draw(st.integers(0, 3)) == 0
    if pma:
        q_lengths = [draw(st.integers(0, 4))] * batch
    elif api != "block" and draw(st.booleans()):
        k_lengths = draw(st.lists(st.integers(0, longest), min_size=batch, max_size=batch))
    heads = draw(st.integers(1, 3))
    dims = [2, 4, 8, 16] if api == "block" else [1, 2, 3, 4, 8, 16]
    head_dim = draw(st.sampled_from(dims))
    dtype = draw(st.sampled_from(TRITON_DTYPES if triton else FLOAT_DTYPES))
    seed = draw(st.integers(0, 2**31 - 1))
    generator = torch.Generator().manual_seed(seed)
    special, target, row = None, None, 0
    if draw(st.integers(0, 2)) == 0:
        special = draw(st.sampled_from(["nan", "inf", "-inf"]))
        target = draw(st.sampled_from(["q", "k", "v", "bias"]))
        row = draw(st.integers(0, 100))
    q_rows = q_lengths[0] if pma and batch else (0 if pma else sum(q_lengths))
    k_rows = sum(k_lengths)
    tensors = {}
    for name, rows in (("q", q_rows), ("k", k_rows), ("v", k_rows)):
        hit = special if target == name else None
        tensors[name] = _values(generator, (rows, heads, head_dim), dtype, hit, row)
    args: dict = dict(tensors)
    if api == "block":
        args["offsets"] = offsets_of(q_lengths)
    elif pma:
        args["q_offsets"], args["k_offsets"] = None, offsets_of(k_lengths)
    else:
        args["q_offsets"] = offsets_of(q_lengths)
        args["k_offsets"] = offsets_of(k_lengths) if k_lengths is not q_lengths else None
    case = Case(api, args, q_lengths, k_lengths, pma)
    case.origin = f"seed={seed} special={special} in {target} row {row}"
    case.nonfinite = any(not bool(torch.isfinite(t).all()) for t in tensors.values())
    # Valid options.
    if draw(st.booleans()):
        args["scale"] = draw(st.floats(-3.0, 3.0, allow_nan=False))
    if api == "block":
        args["block_size"] = draw(st.sampled_from([1, 2, 3, 4, 8, 64]))
        if draw(st.booleans()):
            args["rope_theta"] = draw(st.sampled_from([10000.0, 2.0, 500, 1e6]))
        if draw(st.integers(0, 2)) == 0:
            args["positions"] = torch.randint(
                -(2**12), 2**12, (q_rows,), generator=generator, dtype=torch.int64
            )
        return case
    args["causal"] = draw(st.booleans())
    if draw(st.booleans()):
        side = st.one_of(st.none(), st.integers(0, 6))
        args["window"] = (draw(side), draw(side))
    if api == "gdpa":
        args["activation"] = draw(st.sampled_from(ACTIVATIONS))
        args["normalize_by_length"] = draw(st.booleans())
        return case
    if draw(st.integers(0, 2)) == 0:
        hit = special if target == "bias" and draw(st.booleans()) else None
        rel = _values(generator, (draw(st.integers(1, 9)), heads), dtype, hit, row).T
        args["rel_pos_bias"] = rel = rel.contiguous() if draw(st.booleans()) else rel
        case.nonfinite |= not bool(torch.isfinite(rel).all())
    if draw(st.integers(0, 2)) == 0:
        pairs = sum(a * b for a, b in zip(q_lengths, k_lengths, strict=True))
        hit = special if target == "bias" else None
        args["jagged_bias"] = jagged = _values(generator, (pairs, heads), dtype, hit, row).T
        case.nonfinite |= not bool(torch.isfinite(jagged).all())
    return case


# ---------------------------------------------------------------------------------------------
# Faults. Each draws what to break and records what the call must then do.


def _offsets_names(case: Case) -> list[str]:
    """The offsets arguments that are still plain 1-D CPU integer tensors (faults compose)."""
    return [
        n
        for n in ("q_offsets", "k_offsets", "offsets")
        if isinstance(case.args.get(n), torch.Tensor)
        and case.args[n].dim() == 1
        and case.args[n].numel() > 0
        and case.args[n].device.type == "cpu"
        and case.args[n].dtype in (torch.int32, torch.int64)
    ]


def _qkv_intact(case: Case) -> bool:
    return all(
        isinstance(case.args[n], torch.Tensor) and case.args[n].dim() == 3 for n in ("q", "k", "v")
    )


def _spec_offsets_ok(values: list[int], rows: int) -> bool:
    """The offsets contract, written independently: starts at 0, never decreases, ends at rows."""
    return (
        len(values) >= 1
        and values[0] == 0
        and values[-1] == rows
        and all(a <= b for a, b in zip(values, values[1:], strict=False))
    )


def _rows_of(case: Case, name: str) -> int:
    if name == "k_offsets":
        return sum(case.k_lengths)
    return sum(case.q_lengths)


def fault_offsets_values(draw, case: Case) -> None:
    names = _offsets_names(case)
    if not names:
        return
    name = draw(st.sampled_from(names))
    values = case.args[name].tolist()
    how = draw(st.sampled_from(["down", "negative", "overrun", "first", "huge", "shuffle"]))
    position = draw(st.integers(0, len(values) - 1))
    if how == "down" and len(values) > 1:
        position = draw(st.integers(0, len(values) - 2))
        values[position] = values[position + 1] + draw(st.integers(1, 3))
    elif how == "negative":
        values[position] = -draw(st.sampled_from([1, 2, 7, 2**40]))
    elif how == "overrun":
        values[position] = _rows_of(case, name) + draw(st.integers(1, 5))
    elif how == "first":
        values[0] = draw(st.sampled_from([1, -1, 3]))
    elif how == "huge":
        values[position] = draw(st.sampled_from([2**31, 2**62, 2**63 - 1]))
    else:
        values = draw(st.permutations(values))
    dtype = case.args[name].dtype
    if any(not -(2**31) <= value < 2**31 for value in values):
        dtype = torch.int64
    case.args[name] = torch.tensor(values, dtype=dtype)
    ok = _spec_offsets_ok(values, _rows_of(case, name))
    case.fault(f"offsets_{how}", "accept" if ok else "reject", name)


def fault_offsets_container(draw, case: Case) -> None:
    names = _offsets_names(case)
    if not names:
        return
    name = draw(st.sampled_from(names))
    offsets = case.args[name]
    how = draw(
        st.sampled_from(
            ["int32", "float", "int16", "uint8", "bool", "rank2", "rank0", "empty", "meta",
             "list", "numpy", "strided"]
        )
    )  # fmt: skip
    replaced = {
        "int32": lambda: offsets.to(torch.int32),
        "float": lambda: offsets.to(torch.float32),
        "int16": lambda: offsets.to(torch.int16),
        "uint8": lambda: offsets.to(torch.uint8),
        "bool": lambda: offsets.to(torch.bool),
        "rank2": lambda: offsets.view(1, -1),
        "rank0": lambda: offsets[0],
        "empty": lambda: offsets[:0],
        "meta": lambda: offsets.to("meta"),
        "list": lambda: offsets.tolist(),
        "numpy": lambda: offsets.numpy(),
        "strided": lambda: torch.stack([offsets, offsets], 1)[:, 0],
    }[how]()
    case.args[name] = replaced
    case.fault(f"offsets_{how}", "accept" if how in ("int32", "strided") else "reject", name)


def fault_batch_mismatch(draw, case: Case) -> None:
    if case.api == "block" or case.pma or "q_offsets" not in _offsets_names(case):
        return
    k_offsets = case.args.get("k_offsets")
    if k_offsets is None:
        k_offsets = case.args["q_offsets"]
    if case.args.get("k_offsets") is not None and "k_offsets" not in _offsets_names(case):
        return
    extra = torch.tensor([k_offsets[-1].item()], dtype=k_offsets.dtype)
    case.args["k_offsets"] = torch.cat([k_offsets, extra])
    case.fault("batch_mismatch", "reject", "k_offsets", "q_offsets")


def fault_tensor(draw, case: Case) -> None:
    if not _qkv_intact(case):
        return
    name = draw(st.sampled_from(["q", "k", "v"]))
    tensor = case.args[name]
    rows, heads, dim = tensor.shape
    how = draw(
        st.sampled_from(
            ["int", "complex", "fp8", "other_float", "rank2", "rank4", "heads", "head_dim",
             "rows", "meta", "list", "strided", "expanded"]
        )
    )  # fmt: skip
    dtype = tensor.dtype
    other = torch.float64 if dtype != torch.float64 else torch.float32
    names = [name, "q"] if name != "q" else ["q", "k", "v"]
    kind = "reject"
    if how == "int":
        new = tensor.to(torch.int32)
    elif how == "complex":
        new = tensor.to(torch.complex64)
    elif how == "fp8":
        new = tensor.to(torch.float8_e4m3fn)
    elif how == "other_float":
        new = tensor.to(other)
    elif how == "rank2":
        new = tensor.reshape(rows, heads * dim)
    elif how == "rank4":
        new = tensor.unsqueeze(-1)
    elif how == "heads":
        new = torch.zeros(rows, heads + 1, dim, dtype=dtype)
    elif how == "head_dim":
        new = torch.zeros(rows, heads, dim + 1, dtype=dtype)
    elif how == "rows":
        new = torch.zeros(rows + 1, heads, dim, dtype=dtype)
        names += ["k_offsets", "q_offsets", "offsets"]
        if name == "q" and case.pma:
            kind = "either"  # PMA: q holds the Nq shared queries, any count
    elif how == "meta":
        new = tensor.to("meta")
    elif how == "list":
        new = tensor.tolist()
    elif how == "strided":
        new = torch.stack([tensor, tensor], dim=-1)[..., 0]  # same values, non-unit stride
        kind = "accept"
    else:  # expanded: one row repeated, stride 0 along the tokens
        new = tensor[:1].expand(rows, heads, dim) if rows else tensor
        kind = "accept"
    if how in ("heads", "head_dim", "rows") and name == "q" and how != "rows":
        names += ["k", "v"]
    case.args[name] = new
    case.fault(f"{name}_{how}", kind, *names)


def fault_shape_everywhere(draw, case: Case) -> None:
    """Zero heads or a zero head_dim on q, k and v together."""
    if not _qkv_intact(case):
        return
    how = draw(st.sampled_from(["zero_heads", "zero_dim"]))
    for name in ("q", "k", "v"):
        rows, heads, dim = case.args[name].shape
        shape = (rows, 0, dim) if how == "zero_heads" else (rows, heads, 0)
        case.args[name] = torch.zeros(shape, dtype=case.args[name].dtype)
    case.fault(how, "reject", "q", "head_dim")
    case.nonfinite = False


def fault_max_len(draw, case: Case) -> None:
    if case.api == "block":
        name, lengths = "max_len", case.q_lengths
    else:
        name = draw(st.sampled_from(["max_q", "max_k"]))
        lengths = case.k_lengths if name == "max_k" else case.q_lengths
    longest = max(lengths, default=0)
    how = draw(st.sampled_from(["exact", "above", "huge", "below", "negative", "float", "numpy"]))
    if how == "exact":
        value, kind = longest, "accept"
    elif how == "above":
        value, kind = longest + draw(st.integers(1, 100)), "accept"
    elif how == "huge":
        value, kind = draw(st.sampled_from(HUGE_INTS)), "accept"
    elif how == "below" and longest > 0:
        value, kind = draw(st.integers(0, longest - 1)), "reject"
    elif how in ("below", "negative"):
        value, kind = -draw(st.sampled_from([1, 5, 2**70])), "reject"
    elif how == "float":
        value, kind = float(longest), "reject"
    else:
        value, kind = np.int64(longest), "reject"
    if case.pma and name == "max_q":
        kind = "either" if kind == "accept" else kind  # Nq is checked against max_q
        if how in ("exact", "above") and value < case.args["q"].shape[0]:
            kind = "reject"
    case.args[name] = value
    case.fault(f"{name}_{how}", kind, name)


def fault_window(draw, case: Case) -> None:
    if case.api == "block":
        return
    how = draw(st.sampled_from(["huge", "short", "long", "negative", "float", "bool", "str"]))
    if how == "huge":
        value, kind = (
            (draw(st.sampled_from([None, *HUGE_INTS])), draw(st.sampled_from(HUGE_INTS))),
            "accept",
        )
    elif how == "short":
        value, kind = (1,), "reject"
    elif how == "long":
        value, kind = (1, 2, 3), "reject"
    elif how == "negative":
        value, kind = (draw(st.integers(-(2**40), -1)), 0), "reject"
    elif how == "float":
        value, kind = (1.5, None), "reject"
    elif how == "bool":
        value, kind = (True, 1), "reject"
    else:
        value, kind = "ab", "reject"
    case.args["window"] = value
    case.fault(f"window_{how}", kind, "window")


def fault_scalar_options(draw, case: Case) -> None:
    choices = ["scale", "backend"]
    if case.api != "block":
        choices.append("causal")
    if case.api == "gdpa":
        choices += ["activation", "normalize_by_length", "no_offsets"]
    if case.api == "block":
        choices += ["block_size", "rope_theta", "positions"]
    what = draw(st.sampled_from(choices))
    if what == "scale":
        value = draw(st.sampled_from([math.nan, math.inf, -math.inf, 10**400, "1", None, 0.0]))
        if value is None or value == 0.0:
            case.args["scale"] = value
            case.fault("scale_ok", "accept", "scale")
            return
        if value == "1":
            value = draw(st.sampled_from(["1", torch.tensor(0.5), True]))
        case.args["scale"] = value
    elif what == "backend":
        case.args["backend"] = draw(st.sampled_from(["cuda", None, "Triton", ["auto"], ""]))
    elif what == "causal":
        case.args["causal"] = draw(st.sampled_from([1, "yes", None, np.bool_(True)]))
    elif what == "activation":
        case.args["activation"] = draw(st.sampled_from(["softmax", None, "SILU", 3, ""]))
    elif what == "normalize_by_length":
        case.args["normalize_by_length"] = draw(st.sampled_from([1, "no", None]))
    elif what == "no_offsets":
        case.args["q_offsets"] = case.args["k_offsets"] = None
        case.fault("no_offsets", "reject", "q_offsets", "k_offsets")
        return
    elif what == "block_size":
        value = draw(st.sampled_from([0, -1, 2.0, True, "64", None, *HUGE_INTS]))
        case.args["block_size"] = value
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            case.fault("block_size_huge", "accept", "block_size")
            return
    elif what == "rope_theta":
        value = draw(st.sampled_from([0.0, -1.0, math.nan, math.inf, 10**400, "1e4", 0.5]))
        case.args["rope_theta"] = value
        if value == 0.5:
            case.fault("rope_theta_small", "accept", "rope_theta")
            return
    else:  # positions
        rows = sum(case.q_lengths)
        how = draw(st.sampled_from(["float", "short", "rank2", "meta", "list", "huge", "int32"]))
        value = {
            "float": lambda: torch.zeros(rows),
            "short": lambda: torch.zeros(rows + 1, dtype=torch.int64),
            "rank2": lambda: torch.zeros(rows, 1, dtype=torch.int64),
            "meta": lambda: torch.zeros(rows, dtype=torch.int64, device="meta"),
            "list": lambda: list(range(rows)),
            "huge": lambda: torch.randint(-(2**20), 2**20, (rows,)),
            "int32": lambda: torch.arange(rows, dtype=torch.int32),
        }[how]()
        case.args["positions"] = value
        case.fault(f"positions_{how}", "accept" if how in ("huge", "int32") else "reject", what)
        return
    case.fault(what, "reject", what)


def fault_bias(draw, case: Case) -> None:
    if case.api != "jfa":
        return
    name = draw(st.sampled_from(["rel_pos_bias", "jagged_bias"]))
    q = case.args["q"]
    heads = q.shape[1] if isinstance(q, torch.Tensor) and q.dim() > 1 else 1
    pairs = sum(a * b for a, b in zip(case.q_lengths, case.k_lengths, strict=True))
    width = pairs if name == "jagged_bias" else 5
    how = draw(st.sampled_from(["heads", "rank1", "width", "int", "meta", "other_float", "list"]))
    dtype = torch.float32
    kind = "reject"
    if how == "heads":
        bias = torch.zeros(heads + 1, width)
    elif how == "rank1":
        bias = torch.zeros(width)
    elif how == "width":
        bias = torch.zeros(heads, pairs + 1 if name == "jagged_bias" else 0)
    elif how == "int":
        bias = torch.zeros(heads, width, dtype=torch.int64)
    elif how == "meta":
        bias = torch.zeros(heads, width, device="meta")
    elif how == "list":
        bias = [[0.0] * width] * heads
    else:
        bias = torch.randn(heads, width, dtype=torch.float64).to(dtype)
        kind = "accept"
    case.args[name] = bias
    case.fault(f"{name}_{how}", kind, name)


FAULTS = [
    fault_offsets_values,
    fault_offsets_container,
    fault_batch_mismatch,
    fault_tensor,
    fault_shape_everywhere,
    fault_max_len,
    fault_window,
    fault_scalar_options,
    fault_bias,
]


@st.composite
def cases(draw, api: str, triton: bool = False) -> Case:
    case = draw(problems(api, triton))
    for fault in draw(st.lists(st.sampled_from(FAULTS), max_size=2, unique=True)):
        fault(draw, case)
    if triton:
        case.args.setdefault("backend", "triton")
    return case


# ---------------------------------------------------------------------------------------------
# Oracles.


def _oracle_output(case: Case) -> torch.Tensor:
    a = case.args
    options = {}
    if a.get("scale") is not None:
        options["scale"] = a["scale"]
    if case.api == "block":
        if a.get("positions") is not None:
            options["positions"] = a["positions"]
        return naive_block_attention(
            a["q"], a["k"], a["v"], case.q_lengths, block_size=a.get("block_size", 64),
            rope_theta=a.get("rope_theta", 10000.0), **options,
        )  # fmt: skip
    options["causal"] = a.get("causal", False)
    options["window"] = a.get("window")
    if case.api == "gdpa":
        q_lengths = [a["q"].shape[0]] * len(case.k_lengths) if case.pma else case.q_lengths
        return naive_gdpa(
            a["q"], a["k"], a["v"], q_lengths, case.k_lengths,
            activation=a.get("activation", "silu"),
            normalize_by_length=a.get("normalize_by_length", False), broadcast=case.pma,
            **options,
        )  # fmt: skip
    return naive_jfa(
        a["q"], a["k"], a["v"], case.q_lengths, case.k_lengths,
        rel_pos_bias=a.get("rel_pos_bias"), jagged_bias=a.get("jagged_bias"), **options,
    )  # fmt: skip


def _finite_rows(tensor, lengths: list[int]) -> list[bool]:
    """Per sample: are its rows of ``tensor`` (consecutive, ``lengths``) all finite?"""
    flags, start = [], 0
    for length in lengths:
        flags.append(bool(torch.isfinite(tensor[start : start + length]).all()))
        start += length
    return flags


def clean_output_rows(case: Case) -> torch.Tensor:
    """Output rows of the samples whose inputs are all finite (bool per output row).

    The contract for NaN / Inf inputs: the samples holding them get unspecified values (which
    masked-out entries reach a row depends on the backend's tiling), every other sample's rows
    are exact. A shared input (PMA queries, ``rel_pos_bias``) with a non-finite value taints all.
    """
    a = case.args
    batch = len(case.k_lengths)
    clean = [True] * batch
    for name in ("k", "v"):
        clean = [c and f for c, f in zip(clean, _finite_rows(a[name], case.k_lengths), strict=True)]
    if case.pma:
        out_lengths = [a["q"].shape[0]] * batch
        shared_ok = bool(torch.isfinite(a["q"]).all())
        clean = [c and shared_ok for c in clean]
    else:
        out_lengths = case.q_lengths
        clean = [c and f for c, f in zip(clean, _finite_rows(a["q"], case.q_lengths), strict=True)]
    rel = a.get("rel_pos_bias")
    if rel is not None and not bool(torch.isfinite(rel).all()):
        clean = [False] * batch
    jagged = a.get("jagged_bias")
    if jagged is not None:
        pairs = [lq * lk for lq, lk in zip(case.q_lengths, case.k_lengths, strict=True)]
        clean = [c and f for c, f in zip(clean, _finite_rows(jagged.T, pairs), strict=True)]
    return torch.tensor(
        [c for c, length in zip(clean, out_lengths, strict=True) for _ in range(length)],
        dtype=torch.bool,
    )


def _compare(
    got: torch.Tensor,
    want: torch.Tensor,
    dtype: torch.dtype,
    what: str,
    rows: torch.Tensor | None = None,
) -> str | None:
    """``got`` against the float64 ``want`` on ``rows`` (dim 0; default all): finite where
    ``want`` is finite and within the dtype's tolerance of it."""
    if not isinstance(got, torch.Tensor):
        return f"{what}: got a {type(got).__name__}"
    if got.shape != want.shape:
        return f"{what}: shape {tuple(got.shape)}, want {tuple(want.shape)}"
    if want.numel() == 0:
        return None
    got64 = got.detach().double()
    if rows is not None:
        got64, want = got64[rows], want[rows]
        if want.numel() == 0:
            return None
    finite_want = torch.isfinite(want)
    if not bool(torch.equal(torch.isfinite(got64), finite_want)):
        lost = int((finite_want & ~torch.isfinite(got64)).sum())
        return f"{what}: {lost} non-finite values where the oracle's are finite (or vice versa)"
    a, b = got64[finite_want], want[finite_want]
    tol = TOLERANCE[dtype]
    scale = max(1.0, float(b.abs().max())) if b.numel() else 1.0
    error = float((a - b).abs().max()) if b.numel() else 0.0
    if error > tol * scale:
        return f"{what}: max error {error:.3g} > {tol * scale:.3g}"
    return None


def _call(fn, case: Case):
    return lambda: fn(**case.args)


FUNCTIONS = {"jfa": jagged_flash_attention, "gdpa": gdpa, "block": block_attention}


def run_case(tally: Tally, case: Case, *, grads: bool) -> None:
    """One example: the call, classified against the oracle (and, for valid finite float
    calls with ``grads``, its gradients against the oracle's)."""
    fn = FUNCTIONS[case.api]
    dtype = case.args["q"].dtype if isinstance(case.args["q"], torch.Tensor) else None
    differentiable = [
        n
        for n in ("q", "k", "v", "rel_pos_bias", "jagged_bias")
        if isinstance(case.args.get(n), torch.Tensor)
    ]
    check_grads = (
        grads
        and not case.nonfinite
        and dtype in (torch.float32, torch.float64)
        and all(case.args[n].dtype == dtype for n in differentiable)
        and all(case.args[n].device.type == "cpu" for n in differentiable)
    )

    def call():
        if not check_grads:
            return fn(**case.args)
        leaves = {n: case.args[n].detach().clone().requires_grad_(True) for n in differentiable}
        out = fn(**(case.args | leaves))
        weights = torch.linspace(-1.0, 1.0, out.numel(), dtype=out.dtype).reshape(out.shape)
        got = torch.autograd.grad((out * weights).sum(), list(leaves.values()), allow_unused=True)
        return out, weights, got

    def oracle(result) -> str | None:
        if dtype not in TOLERANCE:
            return f"accepted q of dtype {dtype}"
        if not check_grads:
            return _compare(result, _oracle_output(case), dtype, "output", clean_output_rows(case))
        out, weights, got = result
        problem = _compare(out, _oracle_output(case), dtype, "output")
        if problem:
            return problem
        leaves = {n: case.args[n].detach().double().requires_grad_(True) for n in differentiable}
        saved = {n: case.args[n] for n in differentiable}
        case.args.update(leaves)
        try:
            want_out = _oracle_output(case)
            want = torch.autograd.grad(
                (want_out * weights.double()).sum(), list(leaves.values()), allow_unused=True
            ) if want_out.requires_grad else [None] * len(leaves)  # fmt: skip
        finally:
            case.args.update(saved)
        for name, g, w in zip(differentiable, got, want, strict=True):
            g = torch.zeros_like(saved[name]) if g is None else g
            w = torch.zeros_like(leaves[name]) if w is None else w
            problem = _compare(g, w, dtype, f"grad of {name}")
            if problem:
                return problem
        return None

    also = ("backend",) if case.args.get("backend") == "triton" else ()
    tally.check(call, case.faults, oracle, describe=case.describe(), also_names=also)


# ---------------------------------------------------------------------------------------------
# The tests: reference backend (CPU) and the Triton kernels under the interpreter.


@pytest.mark.parametrize(
    ("api", "name", "examples"),
    [
        ("jfa", "jagged_flash_attention", 150),
        ("gdpa", "gdpa", 120),
        ("block", "block_attention", 100),
    ],
)
def test_fuzz_reference(api, name, examples):
    tally = Tally(name)

    @fuzz_settings(examples)
    @given(case=cases(api), grads=st.booleans())
    def run(case, grads):
        run_case(tally, case, grads=grads)

    run()
    tally.finish()


@pytest.mark.parametrize(
    ("api", "name", "examples"),
    [("jfa", "jagged_flash_attention", 8), ("gdpa", "gdpa", 6), ("block", "block_attention", 6)],
)
def test_fuzz_triton_interpreter(monkeypatch, api, name, examples):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    tally = Tally(f"{name}/triton", time_limit=120.0)

    @fuzz_settings(examples)
    @given(case=cases(api, triton=True))
    def run(case):
        run_case(tally, case, grads=True)

    run()
    tally.finish()


# ---------------------------------------------------------------------------------------------
# The failures the fuzzing found, pinned.


def test_nan_of_one_sample_stays_out_of_the_others():
    """The reference's padded key slots read the next sample's values (0 * NaN = NaN)."""
    off = offsets_of([3, 4])
    q, k, v = (torch.randn(7, 1, 4) for _ in range(3))
    v[3] = float("nan")  # first key of sample 1
    assert torch.isfinite(jagged_flash_attention(q, k, v, off)[:3]).all()
    assert torch.isfinite(gdpa(q, k, v, off)[:3]).all()
    q[5] = float("nan")  # a query row of sample 1; causal rows of sample 0 see no key of it
    out = jagged_flash_attention(q, k, v, off, offsets_of([3, 4]), causal=True, window=(0, 0))
    assert torch.isfinite(out[:3]).all()


def test_huge_bounds_mean_unbounded():
    """Ints beyond int64 reached the operator schema (RuntimeError)."""
    off = offsets_of([2, 3])
    q, k, v = (torch.randn(5, 2, 4) for _ in range(3))
    want = jagged_flash_attention(q, k, v, off)
    for huge in (2**48, 2**63, 2**100):
        got = jagged_flash_attention(q, k, v, off, max_q=huge, max_k=huge, window=(huge, huge))
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(gdpa(q, k, v, off, max_q=huge), gdpa(q, k, v, off))
        torch.testing.assert_close(
            block_attention(q, k, v, off, huge, block_size=huge),
            block_attention(q, k, v, off, block_size=5),
        )


@pytest.mark.parametrize("name", ["scale", "rope_theta"])
def test_int_beyond_float_range_is_a_value_error(name):
    off = offsets_of([5])
    q = torch.randn(5, 1, 4)
    with pytest.raises(ValueError, match=f"{name} must be finite"):
        block_attention(q, q, q, off, **{name: 10**400})


def test_triton_refuses_what_it_cannot_compute(monkeypatch):
    """Tiny rope_theta overflowed the fixed-point RoPE table (a ValueError naming nothing); a
    bias with a tiny scale overflowed bias / scale (wrong values). Both run the reference."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    off = offsets_of([3, 2])
    q, k, v = (torch.randn(5, 1, 16) for _ in range(3))
    with pytest.raises(ValueError, match="backend='triton' cannot run this call: rope_theta"):
        block_attention(q, k, v, off, rope_theta=1e-30, backend="triton")
    rel = torch.randn(1, 3)
    with pytest.raises(ValueError, match="backend='triton' cannot run this call: scale"):
        jagged_flash_attention(q, k, v, off, scale=1e-30, rel_pos_bias=rel, backend="triton")
    want = naive_jfa(q, k, v, [3, 2], scale=1e-30, rel_pos_bias=rel)
    got = jagged_flash_attention(q, k, v, off, scale=1e-30, rel_pos_bias=rel)
    torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=1e-5)
