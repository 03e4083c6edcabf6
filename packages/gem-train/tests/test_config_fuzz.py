"""Fuzzed ``gem_train.config.apply_overrides`` (issue 27).

Each example applies one to three ``section.field=value`` overrides drawn over every field of
the config tree (and over sections, unknown names and malformed paths), with values that are
valid, out of range, non-finite, of the wrong type, empty, huge or garbage. An independent
spec below says, per field, which parsed values are valid. Every call either returns a config
whose overridden fields hold the parsed values and whose other fields are unchanged (the
input config untouched), or raises a ``ValueError`` / ``TypeError`` naming the override; the
arguments themselves (not a list, not str) must raise ``TypeError`` naming them.
"""

from __future__ import annotations

import dataclasses
import math
import typing

from fuzz_tally import Fault, Tally, fuzz_settings
from gem_train import TrainConfig
from gem_train.config import apply_overrides
from hypothesis import given
from hypothesis import strategies as st

BASE = TrainConfig()


def _fields(config, prefix: str = "") -> dict[str, object]:
    """Every leaf field path -> its annotation (strings: the config modules use
    ``from __future__ import annotations``)."""
    out = {}
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if dataclasses.is_dataclass(value):
            out.update(_fields(value, f"{prefix}{field.name}."))
        else:
            out[f"{prefix}{field.name}"] = field.type
    return out


FIELDS = _fields(BASE)
SECTIONS = sorted({path.rsplit(".", 1)[0] for path in FIELDS if "." in path})


def _kind(annotation) -> str:
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
    if text in ("bool", "int", "float", "str"):
        return text
    return "tuple" if text.startswith("tuple") or typing.get_origin(annotation) is tuple else text


KINDS = {path: _kind(annotation) for path, annotation in FIELDS.items()}

# The spec: constraints of the fields the trainer depends on (None: any parsed value may be
# refused by checks across fields, so either outcome is fine there).
NON_NEGATIVE_INTS = {"seed", "epochs", "max_steps", "checkpoint_every", "data.seed",
                     "optim.warmup_steps"}  # fmt: skip
POSITIVE_INTS = {"batch_size", "eval_batch_size", "log_every", "data.num_train", "data.num_eval",
                 "data.max_seq_len", "data.num_shards", "data.workers", "data.num_items",
                 "data.num_users", "data.num_ads"}  # fmt: skip
NON_NEGATIVE_FLOATS = {"optim.dense_lr", "optim.weight_decay", "optim.sparse_lr",
                       "optim.max_grad_norm", "activation_budget_gib"}  # fmt: skip
CHOICES = {
    "device": ("auto", "cpu", "cuda"),
    "data.profile": ("tiny", "gem"),
    "data.on_bad_row": ("error", "skip"),
    "optim.lr_schedule": ("constant", "linear", "cosine"),
    "precision.mode": ("fp32", "bf16", "fp8"),
}
NON_EMPTY = {"output_dir", "data.directory"}
FREE = {"recipe"}


def _parse(kind: str, text: str):
    """The value an override must produce, or raise ValueError (independent of the product)."""
    if kind == "int":
        return int(text)
    if kind == "float":
        return float(text)
    if kind == "bool":
        lowered = text.lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ValueError(text)
    if kind == "str":
        return text
    if kind == "tuple":
        return tuple(part for part in text.split(",") if part)
    raise ValueError(f"unknown kind {kind}")


def _verdict(path: str, value) -> str:
    """'accept', 'reject' or 'either' for a parsed value of field ``path``."""
    if path in POSITIVE_INTS:
        return "accept" if value >= 1 else "reject"
    if path in NON_NEGATIVE_INTS:
        return "accept" if value >= 0 else "reject"
    if path in NON_NEGATIVE_FLOATS:
        ok = math.isfinite(value) and value >= 0
        if path == "activation_budget_gib":
            return "either" if ok else "reject"
        return "accept" if ok else "reject"
    if path == "optim.min_lr_ratio":
        return "accept" if 0.0 <= value <= 1.0 else "reject"
    if path in CHOICES:
        return "accept" if value in CHOICES[path] else "reject"
    if path in NON_EMPTY:
        return "accept" if value.strip() else "reject"
    if path in FREE or KINDS[path] == "bool":
        return "accept"
    return "either"


def _values(kind: str):
    garbage = st.sampled_from(["", "abc", "1.5", "1e3", "nan", "-inf", " 7 ", "+3", "0x10",
                               "9" * 5000, "１２", "true", "none", "a,b", "=", "1=2"])  # fmt: skip
    if kind == "int":
        typed = st.integers(-(2**70), 2**70).map(str) | st.integers(-3, 300).map(str)
    elif kind == "float":
        typed = st.floats(allow_nan=True, allow_infinity=True).map(repr) | st.sampled_from(
            ["0", "1e-3", "3e-3", "0.5", "1", "1e999", "-0.0"]
        )
    elif kind == "bool":
        typed = st.sampled_from(["1", "true", "Yes", "on", "0", "False", "no", "OFF", "maybe"])
    elif kind == "tuple":
        typed = st.sampled_from(["heads.*", "a,b", ",", "attention,mlp", "mlp", "cross,,mlp"])
    else:
        typed = st.sampled_from(
            ["auto", "cpu", "cuda", "tiny", "gem", "error", "skip", "fp8", "bf16", "fp32",
             "linear", "cosine", "constant", "jagged_flash", "block", "rope", "none", "full",
             "ddp", "fsdp", "1d", "2d", "runs/x", "  ", "GEM"]
        )  # fmt: skip
    return typed | garbage


@st.composite
def overrides(draw):
    """(list of overrides, expected {path: value}, faults)."""
    items, expected, faults = [], {}, []
    for _ in range(draw(st.integers(1, 3))):
        shape = draw(st.integers(0, 9))
        if shape == 0:  # not a field
            path = draw(st.sampled_from([*SECTIONS, "nonexistent", "data.nope", "", ".",
                                         "data..seed", "optim.dense_lr.x"]))  # fmt: skip
            text = draw(_values("int"))
            items.append(f"{path}={text}")
            faults.append(Fault(f"path {path!r}", "reject", [path.strip(), items[-1]]))
            continue
        if shape == 1:  # no '='
            item = draw(st.sampled_from(["seed", "batch_size 4", "data.seed:1", ""]))
            items.append(item)
            faults.append(Fault(f"no '=' in {item!r}", "reject", [item]))
            continue
        path = draw(st.sampled_from(sorted(FIELDS)))
        text = draw(_values(KINDS[path]))
        spaced = draw(st.booleans())
        items.append(f" {path} ={text}" if spaced else f"{path}={text}")
        try:
            value = _parse(KINDS[path], text)
        except ValueError:
            faults.append(Fault(f"{path}={text[:20]!r} does not parse", "reject", [path]))
            continue
        verdict = _verdict(path, value)
        faults.append(Fault(f"{path}={text[:20]!r}", verdict, [path]))
        expected[path] = value
    return items, expected, faults


def _get(config, path: str):
    for part in path.split("."):
        config = getattr(config, part)
    return config


def _same(a, b) -> bool:
    return (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)) or (
        a == b and type(a) is type(b)
    )


def test_fuzz_apply_overrides():
    tally = Tally("apply_overrides")
    before = dataclasses.asdict(BASE)

    @fuzz_settings(300)
    @given(case=overrides())
    def run(case):
        items, expected, faults = case

        def oracle(config) -> str | None:
            if dataclasses.asdict(BASE) != before:
                return "the input config was modified"
            if not isinstance(config, TrainConfig):
                return f"returned a {type(config).__name__}"
            for path in FIELDS:
                want = expected.get(path, _get(BASE, path))
                if not _same(_get(config, path), want):
                    return f"{path} = {_get(config, path)!r}, want {want!r}"
            return None

        tally.check(lambda: apply_overrides(BASE, items), faults, oracle, describe=repr(items))

    run()
    tally.finish()


def test_fuzz_apply_overrides_arguments():
    """The arguments themselves: ``TypeError`` naming ``config`` / ``overrides``."""
    tally = Tally("apply_overrides")
    calls = [
        (lambda: apply_overrides(BASE, None), "overrides"),
        (lambda: apply_overrides(BASE, "seed=1"), "overrides"),
        (lambda: apply_overrides(BASE, [1]), "overrides"),
        (lambda: apply_overrides(BASE, [b"seed=1"]), "overrides"),
        (lambda: apply_overrides(BASE, [None]), "overrides"),
        (lambda: apply_overrides(None, ["seed=1"]), "config"),
        (lambda: apply_overrides(dataclasses.asdict(BASE), ["seed=1"]), "config"),
    ]
    for call, name in calls:
        tally.check(call, [Fault(name, "reject", [name])], lambda _: None, describe=name)
    tally.check(
        lambda: apply_overrides(BASE, ("seed=3",)), [], lambda c: None if c.seed == 3 else "seed"
    )
    tally.finish()
