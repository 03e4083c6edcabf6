"""The benchmark protocol of BENCHMARKS.md in one module: inputs, peers, timing, checks, the
result schema and the printed table.

A benchmark declares its cases (a shape and its inputs, with a ``name``) and its providers
(name -> callable building a :class:`Timed` from a case: the forward and forward+backward
closures, peers included). :meth:`Run.measure` then checks every provider against the
reference, times it (median ms), derives TFLOP/s and GB/s from the FLOP and byte counts the
benchmark gives, and writes ``{"meta": ..., "rows": [...]}`` after each provider, so a crash
keeps the finished rows. :meth:`Run.table` prints the rows.

Rows are ``{"case", "provider", "mode", "metric", "value"}`` (plus optional fields such as
``rounds_ms``): ``provider`` is ``gem`` (``gem-<variant>``) or a peer's short name, ``mode``
``fwd`` / ``fwd_bwd``, ``metric`` ``ms`` / ``tflops`` / ``gbps`` / ``rel_error`` /
``max_abs_error`` ... with one value per row.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

__all__ = [
    "MODES",
    "ROOT",
    "Run",
    "Timed",
    "autograd_provider",
    "command_line",
    "config_variant",
    "fastest",
    "grad_leaves",
    "kernel_kind",
    "kernel_ms_by_kind",
    "max_abs_error",
    "median_ms",
    "meta",
    "print_table",
    "raise_recompile_limits",
    "record_check",
    "rel_error",
    "require_cuda",
    "results_parser",
    "tuning_path",
    "user_args",
    "write_results",
]

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
MODES = ("fwd", "fwd_bwd")
T = TypeVar("T")


# --- result files -------------------------------------------------------------------------------


def meta(benchmark: str, command: str, device: str = "cpu (2 cores)", **extra: object) -> dict:
    """The ``meta`` block: what ran, where, on which commit and versions.

    ``GEM_COMMIT`` overrides the commit (the GPU machine gets a copy of the tree without git).
    """
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    commit = os.environ.get("GEM_COMMIT", commit)
    return {
        "benchmark": benchmark,
        "device": device,
        "torch": torch.__version__,
        "commit": commit,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        **extra,
    }


def write_results(path: Path, meta_block: dict, rows: list[dict]) -> None:
    """Writes one run's results, creating the machine folder if needed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta_block, "rows": rows}, indent=2) + "\n")


def earlier_rows(
    path: Path, meta_block: dict, cases: list[str], providers: list[str] | None = None
) -> tuple[dict, list[dict]]:
    """For a run split over several invocations (as device time limits ask): the rows already
    at ``path`` from earlier invocations of the same benchmark on the same commit, but those of
    ``cases`` (this invocation redoes them; with ``providers``, only those providers' rows of
    them, so an invocation can add providers to a case), and ``meta_block`` with the commands
    joined by `` ; ``. A file of another benchmark or commit is a ``ValueError``: one file, one
    commit."""
    path = Path(path)
    if not path.exists():
        return meta_block, []
    earlier = json.loads(path.read_text())
    for key in ("benchmark", "commit"):
        if earlier["meta"].get(key) != meta_block.get(key):
            raise ValueError(
                f"{path} holds {key} {earlier['meta'].get(key)!r}, this run's is "
                f"{meta_block.get(key)!r}: one file holds one benchmark at one commit"
            )
    commands = [*earlier["meta"]["command"].split(" ; "), meta_block["command"]]
    kept = [
        row for row in earlier["rows"]
        if row["case"] not in cases or (providers is not None and row["provider"] not in providers)
    ]  # fmt: skip
    return {**meta_block, "command": " ; ".join(dict.fromkeys(commands))}, kept


def user_args() -> list[str]:
    """This run's command-line arguments without ``--out`` (the result path is the default one)."""
    argv, skip = [], False
    for arg in sys.argv[1:]:
        if skip:
            skip = False
        elif arg == "--out":
            skip = True
        elif not arg.startswith("--out="):
            argv.append(arg)
    return argv


def command_line(script: str) -> str:
    """``python <script> <args>`` for the meta block, ``--out`` left out."""
    return " ".join(["python", script, *user_args()])


def results_parser(doc: str, default_out: str) -> argparse.ArgumentParser:
    """An argument parser described by ``doc``'s first line, with ``--out`` (the result JSON,
    by default ``benchmarks/results/<default_out>``)."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--out", default=str(RESULTS / default_out))
    return parser


def tuning_path(machine: str, name: str) -> Path:
    """``benchmarks/results/<machine>/tuning/<name>``: where exploration (``benchmarks/tune/``)
    writes, apart from the benchmarks' results."""
    return RESULTS / machine / "tuning" / name


def config_variant(text: str, base: T) -> tuple[str, T]:
    """``NAME:FIELD=VALUE,...`` (a tuning script's ``--variant``) -> ``(NAME, base with those
    fields)``; ``base`` is a dataclass, values are parsed by the fields' annotations (bool:
    ``1`` / ``true`` / ``yes``). A ``ValueError`` names what is wrong."""
    name, _, changes = text.partition(":")
    if not name or not changes:
        raise ValueError(f"--variant must be NAME:FIELD=VALUE[,...], got {text!r}")
    kinds = {field.name: str(field.type) for field in dataclasses.fields(base)}
    fields: dict[str, object] = {}
    for item in changes.split(","):
        key, _, value = item.partition("=")
        kind = kinds.get(key)
        if kind is None:
            raise ValueError(f"--variant {name}: {key!r} is not a {type(base).__name__} field")
        parse = {"bool": lambda v: v.lower() in ("1", "true", "yes"), "int": int, "float": float}
        fields[key] = parse.get(kind.removeprefix("<class '").removesuffix("'>"), str)(value)
    return name, dataclasses.replace(base, **fields)


def require_cuda() -> None:
    """Exits with a message when no CUDA device is visible (the GPU benchmarks need one)."""
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")


# --- timing and checking ------------------------------------------------------------------------


def median_ms(fn: Callable[[], object], *, warmup: float, rep: float, grad_to_none=None) -> float:
    """Median milliseconds of ``fn`` (``warmup``/``rep`` in ms): ``triton.testing.do_bench`` on a
    GPU; without one, wall-clock time of the calls (a smoke run on CPU tensors)."""
    if not torch.cuda.is_available():
        return _wall_median_ms(fn, warmup=warmup, rep=rep, grad_to_none=grad_to_none)
    import triton.testing

    return triton.testing.do_bench(
        fn, warmup=warmup, rep=rep, grad_to_none=grad_to_none, return_mode="median"
    )


def _wall_median_ms(fn, *, warmup: float, rep: float, grad_to_none) -> float:
    def once() -> float:
        for tensor in grad_to_none or ():
            tensor.grad = None
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    estimate = once()
    for _ in range(min(100, int(warmup / max(estimate, 1e-3)))):
        once()
    return statistics.median(once() for _ in range(max(3, min(1000, int(rep / estimate)))))


# Kinds of GPU kernels, from their names: the first match wins.
_KERNEL_KINDS = (
    ("communication", ("nccl",)),
    ("copy", ("memcpy", "memset")),
    ("embedding", ("embedding_", "tbe", "fbgemm", "split_embedding")),
    # triton_tem_: Inductor's template kernels, FlexAttention's (GEMM templates need max-autotune)
    ("attention", ("jfa_", "gdpa_", "attn", "attention", "sdpa", "flex", "triton_tem_")),
    ("gemm", ("gemm", "nvjet", "cutlass", "sm90_xmma", "cublas", "_scaled_mm")),
    ("inductor", ("triton_",)),
    ("elementwise", ("at::native", "elementwise", "reduce_kernel", "vectorized")),
)


def kernel_kind(name: str) -> str:
    """``gemm`` (cuBLAS / CUTLASS), ``attention`` (our Triton kernels, FlexAttention, SDPA),
    ``inductor`` (fused Triton kernels Inductor generated), ``embedding`` (FBGEMM's TBE),
    ``elementwise`` (ATen's eager kernels), ``copy``, ``communication`` (NCCL) or ``other``."""
    lowered = name.lower()
    for kind, needles in _KERNEL_KINDS:
        if any(needle in lowered for needle in needles):
            return kind
    return "other"


def kernel_ms_by_kind(kernels: Iterable[tuple[str, float]], steps: int) -> dict[str, float]:
    """Milliseconds per step of each :func:`kernel_kind` from ``(name, microseconds)`` pairs
    of ``steps`` steps' GPU kernels, largest first."""
    totals: dict[str, float] = {}
    for name, microseconds in kernels:
        kind = kernel_kind(name)
        totals[kind] = totals.get(kind, 0.0) + microseconds / 1e3 / steps
    return dict(sorted(totals.items(), key=lambda item: -item[1]))


def gpu_idle(
    intervals: Iterable[tuple[float, float]], min_gap: float = 0.0
) -> list[tuple[float, float]]:
    """The ``(start, end)`` gaps of at least ``min_gap`` in which none of the busy
    ``intervals`` (kernels, copies: any units, streams merged) runs, from the first interval's
    start to the last one's end: where the GPU waited for the host."""
    gaps: list[tuple[float, float]] = []
    end = None
    for start, stop in sorted(intervals):
        if end is not None and start - end >= max(min_gap, 1e-12):
            gaps.append((end, start))
        end = stop if end is None else max(end, stop)
    return gaps


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``||got - want|| / ||want||`` in float32 (the denominator clamped at 1e-12)."""
    got, want = got.detach().float(), want.detach().float()
    return float((got - want).norm() / want.norm().clamp(min=1e-12))


def max_abs_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``max |got - want|`` in float32."""
    return float((got.detach().float() - want.detach().float()).abs().max())


def grad_leaves(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Detached copies of ``tensors`` that require grad (the leaves a backward fills)."""
    return [t.detach().clone().requires_grad_(True) for t in tensors]


def autograd_provider(
    run: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor], grad: torch.Tensor
) -> tuple[Callable[[], torch.Tensor], Callable[[], None], list[torch.Tensor]]:
    """``(fwd, fwd_bwd, leaves)`` of ``run(*inputs) -> out``, back-propagating ``grad``."""

    def fwd():
        with torch.no_grad():
            return run(*inputs)

    leaves = grad_leaves(inputs)

    def fwd_bwd():
        run(*leaves).backward(grad)

    return fwd, fwd_bwd, leaves


def raise_recompile_limits(limit: int) -> None:
    """Lifts dynamo's recompile caps to ``limit`` (past them a compiled fn runs eagerly)."""
    import torch._dynamo as dynamo  # binds only `dynamo`: `torch` stays the module global

    # The names changed across torch versions; set the ones this version has.
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit"):
        if hasattr(dynamo.config, name):
            setattr(dynamo.config, name, limit)


def record_check(checks: dict, name: str, compute: Callable[[], dict[str, float]]) -> None:
    """Stores ``compute()`` (relative errors by label) as ``checks[name]`` and prints it.

    A failure is stored as ``{"error": ...}`` and printed; the benchmark goes on.
    """
    try:
        errors = compute()
        checks[name] = errors
        print(f"check {name}: " + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()))
    except Exception as error:  # noqa: BLE001 - report and keep benchmarking
        checks[name] = {"error": repr(error)[:300]}
        print(f"check {name} failed: {error!r}"[:400])


def fastest(
    candidates: Iterable[T],
    time_ms: Callable[[T], float],
    *,
    default: T,
    deadline: float,
    label: str,
    describe: Callable[[T], str],
) -> T:
    """The candidate with the lowest ``time_ms`` among those started before ``deadline``
    (``time.time()`` seconds); ``default`` when none ran.

    Prints ``describe(candidate)`` with each time; a failing candidate is printed as
    ``sweep <label> <candidate>: <error>`` and skipped.
    """
    best, best_ms = default, math.inf
    for candidate in candidates:
        if time.time() > deadline:
            break
        try:
            ms = time_ms(candidate)
        except Exception as error:  # noqa: BLE001 - a config that fails is not a candidate
            print(f"sweep {label} {candidate}: {error!r}"[:300])
            continue
        print(f"{describe(candidate)}: {ms:.3f} ms")
        if ms < best_ms:
            best, best_ms = candidate, ms
    return best


# --- the runner ---------------------------------------------------------------------------------


@dataclasses.dataclass
class Timed:
    """What a provider builds for one case: the closures the harness times and checks.

    ``fwd`` runs the forward without autograd and returns the output. ``fwd_bwd`` runs forward
    and backward: it fills the ``.grad`` of ``leaves`` (reset between repetitions) or, when
    ``leaves`` is None, returns the input gradients. ``to_ref`` maps an output or gradient in
    the provider's layout to the reference's (a padded or transposed layout, a nested tensor).
    """

    fwd: Callable[[], Any]
    fwd_bwd: Callable[[], Any] | None = None
    leaves: Sequence[torch.Tensor] | None = None
    to_ref: Callable[[torch.Tensor], torch.Tensor] | None = None

    def __iter__(self):  # unpacks like the (fwd, fwd_bwd, leaves) tuples providers once were
        return iter((self.fwd, self.fwd_bwd, self.leaves))

    def __getitem__(self, index):
        return tuple(self)[index]

    @classmethod
    def of(cls, built: Timed | tuple) -> Timed:
        """A :class:`Timed` from a provider's result (a ``(fwd, fwd_bwd, leaves)`` tuple too)."""
        return built if isinstance(built, Timed) else cls(*built)

    def outputs(self) -> list[torch.Tensor]:
        """``[out, *input gradients]`` from one forward and one forward+backward."""
        for leaf in self.leaves or ():
            leaf.grad = None
        out = self.fwd()
        grads = self.fwd_bwd() if self.fwd_bwd is not None else None
        if self.leaves is not None:
            grads = [leaf.grad for leaf in self.leaves]
        tensors = [out, *(grads or ())]
        return [t if self.to_ref is None or t is None else self.to_ref(t) for t in tensors]


Provider = Callable[[Any], "Timed | tuple"]


class Run:
    """One benchmark run: its rows, errors and checks, written to ``out`` as it goes.

    ``extra`` goes into the meta block (update it as the run learns, e.g. a chosen config);
    ``checks_key`` names the meta entry holding each checked provider's relative errors by
    tensor; ``budget_s`` is the wall time after which :meth:`over_budget` says stop.
    """

    def __init__(
        self,
        benchmark: str,
        out: str | Path,
        *,
        script: str,
        timing: Mapping[str, float] | None = None,
        extra: dict | None = None,
        checks_key: str = "checks_rel_error",
        tensor_names: Sequence[str] = ("out", "dq", "dk", "dv"),
        budget_s: float = math.inf,
    ) -> None:
        self.benchmark, self.out, self.script = benchmark, Path(out), script
        self.timing = dict(timing or {"warmup": 25.0, "rep": 100.0})
        self.extra = dict(extra or {})
        self.checks_key, self.tensor_names = checks_key, tuple(tensor_names)
        self.budget_s, self.start = budget_s, time.time()
        self.rows: list[dict] = []
        self.errors: list[str] = []
        self.checks: dict[str, dict] = {}
        self.providers: list[str] = []  # in the order declared, for the table

    # Rows, errors and the file.

    def add(self, case: str, provider: str, mode: str, metric: str, value: float,
            digits: int = 4, **fields: object) -> None:  # fmt: skip
        """Appends one row (``value`` rounded to ``digits``)."""
        self.rows.append({"case": case, "provider": provider, "mode": mode, "metric": metric,
                          "value": round(value, digits), **fields})  # fmt: skip

    def error(self, message: str) -> None:
        """Records a failure in ``meta.errors`` and prints it; the run goes on."""
        self.errors.append(message[:400])
        print(self.errors[-1], flush=True)

    def over_budget(self, before: str) -> bool:
        """True (and an error naming ``before``) once the run has used its ``budget_s``."""
        if time.time() - self.start <= self.budget_s:
            return False
        self.error(f"budget reached before {before}")
        return True

    def write(self) -> None:
        """Writes the JSON with every row so far."""
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        versions = {}
        try:
            import triton

            versions["triton"] = triton.__version__
        except ImportError:
            pass
        block = meta(self.benchmark, command_line(self.script), device=device, **versions,
                     **self.extra)  # fmt: skip
        if self.checks:
            block[self.checks_key] = self.checks
        block.update(errors=self.errors, wall_s=round(time.time() - self.start, 1))
        write_results(self.out, block, self.rows)

    # Measurements.

    def measure(
        self,
        case: Any,
        providers: Mapping[str, Provider],
        *,
        flops: Mapping[str, float] | None = None,
        bytes_moved: Mapping[str, float] | None = None,
        reference: Provider | None = None,
        rounds: int = 1,
        modes: Sequence[str] = MODES,
    ) -> dict[str, dict[str, float]]:
        """Checks and times every provider on ``case``; returns ``{provider: {mode: ms}}``.

        Each provider is built from ``case`` (``NotImplementedError``: skipped, e.g. a peer
        without a sliding window), checked against ``reference`` once (rows ``rel_error`` and
        ``max_abs_error``: the output under ``fwd``, the worst gradient under ``fwd_bwd``) and
        timed ``rounds`` times, the order reversed every other round (the GPU clock falls under
        sustained load, favouring whoever runs first), keeping the median. ``flops`` and
        ``bytes_moved`` (by mode) add ``tflops`` and ``gbps`` rows beside ``ms``.
        """
        self.providers += [name for name in providers if name not in self.providers]
        want = self._reference_outputs(case, reference)
        samples: dict[str, dict[str, list[float]]] = {name: {} for name in providers}
        order = list(providers)
        for round_index in range(rounds):
            for name in order if round_index % 2 == 0 else order[::-1]:
                timed = self.build(case, name, providers[name])
                if timed is None:
                    continue
                if round_index == 0 and want is not None and providers[name] is not reference:
                    self._check(case, name, timed, want)
                for mode in modes:
                    ms = self._time(case, name, mode, timed)
                    if ms is not None:
                        samples[name].setdefault(mode, []).append(ms)
                del timed
                if round_index == rounds - 1:  # this provider is done: its rows, then the file
                    self._timing_rows(case, name, samples[name], rounds, flops, bytes_moved)
                    self.write()
        return {
            name: {m: statistics.median(t) for m, t in s.items()} for name, s in samples.items()
        }

    def build(self, case, name: str, make: Provider) -> Timed | None:
        """``make(case)`` as a :class:`Timed`; None (skip printed, error recorded) if it fails."""
        try:
            return Timed.of(make(case))
        except NotImplementedError as why:
            print(f"skip {case.name} {name}: {why}")
        except Exception as error:  # noqa: BLE001 - report and keep benchmarking
            self.error(f"{case.name} {name} setup: {error!r}")
            traceback.print_exc(limit=2)
        return None

    def peak_memory(self, case: Any, provider: str, make: Provider, **fields: object) -> None:
        """Rows ``peak_mib`` / ``peak_extra_mib`` (mode ``fwd_bwd``): ``max_memory_allocated``
        during one forward+backward after a warm-up one, and its part above what was allocated
        before the call."""
        try:
            timed = Timed.of(make(case))
            timed.fwd_bwd()  # warm-up: compilation, autotuning, workspaces
            for leaf in timed.leaves or ():
                leaf.grad = None
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            timed.fwd_bwd()
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
            del timed
        except NotImplementedError as why:
            print(f"skip memory {case.name} {provider}: {why}")
            return
        except Exception as error:  # noqa: BLE001 - report and keep benchmarking
            self.error(f"{case.name} {provider} memory: {error!r}")
            return
        for metric, value in (("peak_mib", peak), ("peak_extra_mib", peak - before)):
            self.add(case.name, provider, "fwd_bwd", metric, value / 2**20, digits=1, **fields)
        print(f"{case.name:28s} {provider:18s} peak {peak / 2**20:9.1f} MiB "
              f"(+{(peak - before) / 2**20:.1f} over inputs)")  # fmt: skip

    def table(self, metrics: Sequence[str] = ("ms", "tflops"), title: str | None = None) -> None:
        """Prints this run's rows (see :func:`print_table`)."""
        print_table(self.rows, metrics, title=title or self.benchmark, order=self.providers)

    # Steps of measure().

    def _reference_outputs(self, case, reference: Provider | None) -> list[torch.Tensor] | None:
        if reference is None:
            return None
        try:
            return Timed.of(reference(case)).outputs()
        except Exception as error:  # noqa: BLE001 - no reference: the timings still count
            self.error(f"{case.name} reference: {error!r}")
            return None

    def _check(self, case, name: str, timed: Timed, want: list[torch.Tensor]) -> None:
        try:
            got = timed.outputs()
            pairs = [(n, g, w) for n, g, w in zip(self.tensor_names, got, want, strict=False)
                     if g is not None and w is not None]  # fmt: skip
            rel = {n: rel_error(g, w) for n, g, w in pairs}
            worst = {n: max_abs_error(g, w) for n, g, w in pairs}
        except Exception as error:  # noqa: BLE001 - report and keep benchmarking
            self.error(f"{case.name} {name} check: {error!r}")
            return
        self.checks[case.name if name == "gem" else f"{case.name}/{name}"] = rel
        out, grads = self.tensor_names[0], self.tensor_names[1:]
        for mode, names in (("fwd", [out]), ("fwd_bwd", [n for n in grads if n in rel])):
            if names:
                self.add(case.name, name, mode, "rel_error", max(rel[n] for n in names), 6)
                self.add(case.name, name, mode, "max_abs_error", max(worst[n] for n in names), 6)
        print(f"check {case.name} {name}: " + ", ".join(f"{k} {v:.1e}" for k, v in rel.items()))

    def _time(self, case, name: str, mode: str, timed: Timed) -> float | None:
        fn = timed.fwd if mode == "fwd" else timed.fwd_bwd
        if fn is None:
            return None
        try:
            leaves = timed.leaves if mode != "fwd" else None
            return median_ms(fn, grad_to_none=leaves, **self.timing)
        except Exception as error:  # noqa: BLE001 - report and keep benchmarking
            self.error(f"{case.name} {name} {mode}: {error!r}")
            return None

    def _timing_rows(self, case, name, samples, rounds, flops, bytes_moved) -> None:
        for mode, times in samples.items():
            ms = statistics.median(times)
            fields = {"rounds_ms": [round(t, 4) for t in times]} if rounds > 1 else {}
            rates = [("ms", ms)]
            if flops and mode in flops:
                rates.append(("tflops", flops[mode] / (ms * 1e-3) / 1e12))
            if bytes_moved and mode in bytes_moved:
                rates.append(("gbps", bytes_moved[mode] / (ms * 1e-3) / 1e9))
            for metric, value in rates:
                self.add(case.name, name, mode, metric, value, **fields)
            print(f"{case.name:28s} {name:26s} {mode:8s} "
                  + " ".join(f"{v:9.3f} {m}" for m, v in rates), flush=True)  # fmt: skip


def print_table(
    rows: Sequence[dict],
    metrics: Sequence[str] = ("ms", "tflops"),
    *,
    title: str | None = None,
    order: Sequence[str] = (),
) -> None:
    """A ``rich`` table of ``rows``: one line per (case, provider), providers of a case in
    ``order`` (then as they come), a column per mode and metric in ``metrics`` that has values,
    and the worst ``rel_error`` against the reference."""
    from rich.console import Console
    from rich.table import Table

    values = {(r["case"], r["provider"], r["mode"], r["metric"]): r["value"] for r in rows}
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    columns = [(m, k) for m in modes for k in metrics if any(key[2:] == (m, k) for key in values)]
    cases = list(dict.fromkeys(r["case"] for r in rows))
    rank = {name: i for i, name in enumerate(order)}
    lines = sorted(
        dict.fromkeys((r["case"], r["provider"]) for r in rows),
        key=lambda line: (cases.index(line[0]), rank.get(line[1], len(rank))),
    )
    with_error = any(key[3] == "rel_error" for key in values)
    table = Table(title=title)
    table.add_column("case")
    table.add_column("provider")
    for mode, metric in columns:
        table.add_column(f"{mode} {metric}", justify="right")
    if with_error:
        table.add_column("rel err", justify="right")
    for case, provider in lines:
        cells = [values.get((case, provider, m, k)) for m, k in columns]
        if not any(c is not None for c in cells):
            continue
        text = ["-" if c is None else f"{c:.4g}" if c < 10 else f"{c:.1f}" for c in cells]
        if with_error:
            errs = [values.get((case, provider, m, "rel_error")) for m in modes]
            errs = [e for e in errs if e is not None]
            text.append(f"{max(errs):.1e}" if errs else "-")
        table.add_row(case, provider, *text)
    console = Console()
    if not console.is_terminal:  # a log file: do not squeeze the columns to 80 characters
        console = Console(width=max(120, 30 + 16 * len(columns)))
    console.print(table)
