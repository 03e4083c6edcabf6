"""Bookkeeping of the fuzz tests: every example is run, classified and counted, never raised.

An example either works and matches its oracle, or raises a ``ValueError`` / ``TypeError`` whose
message names one of the arguments the example broke. Anything else is counted: ``unexpected``
(another exception type, an error that names none of the broken arguments, a valid call that
raised, or a call over the time limit) or ``wrong`` (an invalid call that was accepted, or a
result that differs from the oracle). The test asserts both counts are 0 at the end, listing
the first failures; since no example raises, hypothesis runs its whole budget.

``GEM_FUZZ_SCALE`` multiplies every test's example budget and ``GEM_FUZZ_REPORT_DIR`` makes
each API write ``<api>.json`` with its counts there (``benchmarks/bench_fuzz.py`` uses both).
Shared by the packages' fuzz tests: pytest puts ``tests/support`` on the path (root
``pyproject.toml``), so each package's suite still runs alone.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from hypothesis import HealthCheck, settings

__all__ = ["Fault", "Tally", "fuzz_settings"]

#: Documented error types: everything else a call raises is unexpected.
EXPECTED_ERRORS = (ValueError, TypeError)


def fuzz_settings(examples: int, **overrides) -> settings:
    """Hypothesis settings for ``examples`` examples (times ``GEM_FUZZ_SCALE``), derandomized
    unless ``GEM_FUZZ_SEED`` is set (the bench's larger runs draw fresh examples)."""
    scale = float(os.environ.get("GEM_FUZZ_SCALE", "1"))
    random_run = "GEM_FUZZ_SEED" in os.environ
    return settings(
        max_examples=max(1, int(examples * scale)),
        deadline=None,
        derandomize=not random_run,
        database=None,
        suppress_health_check=list(HealthCheck),
        **overrides,
    )


class Fault:
    """One deliberate change of a call's arguments: ``kind`` says what the call must do.

    ``"reject"``: raise naming one of ``names``; ``"accept"``: work and match the oracle;
    ``"either"``: one of the two.
    """

    __slots__ = ("label", "kind", "names")

    def __init__(self, label: str, kind: str, names: Iterable[str]) -> None:
        assert kind in ("reject", "accept", "either"), kind
        self.label, self.kind, self.names = label, kind, tuple(names)

    def __repr__(self) -> str:
        return f"{self.label}({self.kind}: {', '.join(self.names)})"


class _TimeLimit(Exception):
    pass


@contextlib.contextmanager
def _time_limit(seconds: float):
    """Raise ``_TimeLimit`` in the main thread after ``seconds`` (a hang becomes a failure)."""

    def expire(signum, frame):
        raise _TimeLimit(f"no result after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _names_one_of(message: str, names: Iterable[str]) -> bool:
    return any(re.search(rf"(?<![\w.]){re.escape(name)}(?!\w)", message) for name in names)


class Tally:
    """Counts of one API's examples: ``examples``, ``ok``, ``rejected`` (documented errors),
    ``unexpected`` and ``wrong``; the first failures are kept to be shown."""

    def __init__(self, api: str, *, time_limit: float = 60.0) -> None:
        self.api = api
        self.time_limit = time_limit
        self.counts = dict.fromkeys(("examples", "ok", "rejected", "unexpected", "wrong"), 0)
        self.failures: list[str] = []

    def _fail(self, kind: str, faults: list[Fault], detail: str, describe: str) -> None:
        self.counts[kind] += 1
        if len(self.failures) < 8:
            self.failures.append(f"{kind}: {detail}\n    faults={faults}\n    case={describe}")

    def check(
        self,
        call: Callable[[], object],
        faults: list[Fault],
        oracle: Callable[[object], str | None],
        *,
        describe: str = "",
        also_names: Iterable[str] = (),
    ) -> None:
        """Run ``call`` and classify it. ``oracle(result)`` returns None when the result is
        right, else what is wrong. ``also_names``: further names an error may give (such as
        ``backend`` for a backend that cannot run the call)."""
        self.counts["examples"] += 1
        must_reject = any(f.kind == "reject" for f in faults)
        may_reject = must_reject or any(f.kind == "either" for f in faults)
        names = [n for f in faults if f.kind != "accept" for n in f.names]
        started = time.perf_counter()
        try:
            with _time_limit(self.time_limit):
                result = call()
        except EXPECTED_ERRORS as error:
            message = str(error)
            if _names_one_of(message, list(also_names)):
                self.counts["rejected"] += 1
            elif not may_reject:
                self._fail("unexpected", faults, f"valid call raised {error!r}", describe)
            elif not _names_one_of(message, names):
                self._fail(
                    "unexpected", faults, f"error names none of {names}: {error!r}", describe
                )
            else:
                self.counts["rejected"] += 1
            return
        except _TimeLimit as error:
            self._fail("unexpected", faults, f"hang: {error}", describe)
            return
        except Exception as error:  # noqa: BLE001 - classified, counted and reported
            self._fail("unexpected", faults, f"{type(error).__name__}: {error}", describe)
            return
        seconds = time.perf_counter() - started
        if must_reject:
            self._fail("wrong", faults, "an invalid call was accepted", describe)
            return
        try:
            problem = oracle(result)
        except Exception as error:  # noqa: BLE001 - an oracle that cannot judge is a failure
            problem = f"the oracle failed on the result: {type(error).__name__}: {error}"
        if problem is not None:
            self._fail("wrong", faults, problem, describe)
        elif seconds > self.time_limit:
            self._fail("unexpected", faults, f"took {seconds:.1f} s", describe)
        else:
            self.counts["ok"] += 1

    def finish(self) -> None:
        """Write the counts (``GEM_FUZZ_REPORT_DIR``, added to earlier runs of the same API in
        this report) and assert that nothing unexpected or wrong happened."""
        directory = os.environ.get("GEM_FUZZ_REPORT_DIR")
        if directory:
            path = Path(directory) / f"{self.api.replace('/', '__')}.json"
            previous = json.loads(path.read_text()) if path.exists() else {"api": self.api}
            for key, value in self.counts.items():
                previous[key] = previous.get(key, 0) + value
            previous["failures"] = previous.get("failures", []) + self.failures
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(previous, indent=2))
        assert self.counts["examples"] > 0, f"{self.api}: no example ran"
        bad = self.counts["unexpected"] + self.counts["wrong"]
        assert bad == 0, f"{self.api}: {self.counts}\n" + "\n".join(self.failures)
