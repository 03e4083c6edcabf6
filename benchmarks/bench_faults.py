"""Faults, measured: SIGKILL at any moment and ``gem-train --resume`` give the uninterrupted run.

**Kill anywhere** (rows ``kill/world1``, ``kill/world2``): a short CPU ``gem-train`` run
(11 steps, a checkpoint every 3 and at the end, eval, report) is SIGKILLed, resumed with
``--resume``, killed again, ... until an attempt finishes. Every per-step train loss and
learning rate any attempt logged (``metrics.jsonl``, ``log_every=1``) and the final eval
metrics (``summary.json``) must equal those of an uninterrupted run of the same seed, bit for
bit. A second uninterrupted run is the determinism control.

The kill moments are drawn at random from these kinds, so that some land inside a checkpoint
save, some between the save and the ``latest`` pointer update and some in the middle of a step:

========== ==================================================================================
step       a random delay (up to one step) after the n-th step's log line: mid-step
save       a random delay (up to one save) after the n-th save created its ``.partial`` dir
shard      a random delay (up to one shard write) after a rank opened its DCP shard file
metadata   just before DCP renames ``.metadata.tmp`` into place
state      just before ``trainer_state.json`` is written into the ``.partial`` dir
publish    just before the ``.partial`` dir is renamed to ``step_N``
pointer    just before ``latest`` is replaced: the checkpoint is complete, the pointer old
cleanup    just before an older checkpoint is deleted (after the pointer update)
random     the launcher SIGKILLs at a uniformly random time of the attempt (2 ranks: one rank
           or all of them)
========== ==================================================================================

The aim needs nothing in the product: every training process is forked from this script
(which imported ``gem_train.cli`` once) and runs the real ``gem_train.cli.main``; a Python
audit hook (``sys.addaudithook``) watches its file operations (``open``, ``os.mkdir``,
``os.rename``, ``shutil.rmtree`` of the checkpoint paths) and the process SIGKILLs itself at
the drawn one (or a timer thread does, after the drawn delay). With 2 ranks (gloo, env://
rendezvous like torchrun) one rank is killed and the launcher SIGKILLs the survivors after a
random grace of up to 1 s unless they already exited (torchrun's teardown).

**Corrupt or partial checkpoints** (rows ``checkpoint/<case>``): a finished run's newest
checkpoint is damaged (truncated shard, missing or truncated DCP metadata, truncated
``trainer_state.json``, ``latest`` naming a deleted step) and ``gem-train --resume`` must name
the problem and the file (``named_error``), fall back to the newest whole checkpoint, say so
and finish with the uninterrupted run's eval metrics (``fell_back``); a checkpoint of another
model config or another world size must be refused with a named error (``refused``: no
fallback). **Full disk / unwritable path** (``checkpoint/enospc_<write>``,
``checkpoint/unwritable``, ``..._2ranks``): the audit hook raises ``OSError`` (ENOSPC, EACCES)
at one write of the second save; every rank must stop with an error naming the checkpoint
(``named_error``, ``stopped``), the previous checkpoint must stay the ``latest`` and resume
exactly (``previous_loadable``).

**Dead rank** (rows ``kill/dead_rank_sigkill``, ``kill/dead_rank_sigstop``, metric
``within_timeout``): 2 ranks with ``GEM_DIST_TIMEOUT_S``; rank 1 is SIGKILLed or SIGSTOPped
after step 3 and rank 0 must exit non-zero on its own within the timeout.

Every kill, its moment, the checkpoint ``latest`` named after it, the exit codes and each
chain's verdict are in the result's ``meta.kill``; the per-case details in
``meta.checkpoint`` and ``meta.dead_rank``.

Usage (from the workspace root; replaces only the kill/ and checkpoint/ rows of
``benchmarks/results/cpu/faults.json``, keeping the file's other rows); about 5 minutes on
2 busy cores::

    .venv/bin/python benchmarks/bench_faults.py --kills 30 --kills2 10

CI runs a short form (``tests/test_faults_short.py``).
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import random
import re
import shutil
import signal
import socket
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness import ROOT, meta, user_args, write_results

STEPS, EVERY = 11, 3
"""Steps of every run and the checkpoint interval (saves at 3, 6, 9 and the final 11)."""

SMALL = {
    "data.num_train": 2048,
    "data.num_eval": 512,
    "data.max_seq_len": 32,
    "data.num_shards": 2,
    "data.workers": 1,
    "data.num_users": 1000,
    "data.num_items": 1000,
    "data.num_ads": 100,
    "model.embedding_dim": 16,
    "model.dhen_layers": 1,
    "batch_size": 64,
    "eval_batch_size": 256,
    "log_every": 1,
    "checkpoint_every": EVERY,
    "max_steps": STEPS,
    "compare_no_sequence": "false",
    "optim.warmup_steps": 2,
}

WRITER_KINDS = ("metadata", "state", "publish", "pointer", "cleanup")
"""Kill kinds at operations only the writer (rank 0) does."""
KINDS = ("step", "save", "shard", *WRITER_KINDS, "random")
GROUPS = {
    "step": "mid-step",
    "save": "inside a save",
    "shard": "inside a save",
    "metadata": "inside a save",
    "state": "inside a save",
    "publish": "inside a save",
    "pointer": "between save and latest",
    "cleanup": "after latest",
    "random": "anywhere",
}
SUMMARY_IGNORED = {"train_seconds", "final_train_loss"}
"""summary.json fields that are not model results: wall time, and the mean of the last 20
losses of the *last* attempt's ``fit`` call only (not of the whole run)."""

_cli: Any = None  # gem_train.cli, imported once by the launcher before it forks


def cli_args(data: Path, output: Path, **overrides: object) -> list[str]:
    settings = {**SMALL, "data.directory": data, "output_dir": output, **overrides}
    return ["--recipe", "tiny", *(f"--set={key}={value}" for key, value in settings.items())]


def generate_data(data: Path) -> None:
    """Writes the runs' dataset once, in a forked child (so that no run's start-up time, which
    aims the 'random' kills, includes it)."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            overrides = [arg.removeprefix("--set=") for arg in cli_args(data, data)[2:]]
            _cli.prepare_data(_cli.configure("tiny", overrides).data, progress=False)
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"generating the dataset in {data} failed")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _path(value: object) -> str | None:
    if isinstance(value, str | bytes) or hasattr(value, "__fspath__"):
        return os.fsdecode(value)  # type: ignore[arg-type]
    return None


# ----------------------------------------------------------------------------- in the child
class _Watcher:
    """Audit hook of one training process: names the moments of a step and a save from the
    file operations the product does, records their times, and kills (or fails) at the planned
    one. Nothing of the product is replaced."""

    def __init__(self, plan: dict | None, record_fd: int, rank: int) -> None:
        self.plan = plan or {}
        self.record_fd = record_fd
        self.rank = rank
        self.counts: Counter[str] = Counter()
        self.seen_partials: set[str] = set()
        self.after_pointer = False
        self.started = time.perf_counter()
        self.busy = False
        self.last = "start"

    def record(self, **entry: object) -> None:
        entry = {"t": round(time.perf_counter() - self.started, 4), "rank": self.rank, **entry}
        os.write(self.record_fd, (json.dumps(entry) + "\n").encode())

    def moment(self, event: str, args: tuple) -> tuple[str, str] | None:
        path = _path(args[0]) if args else None
        if path is None:
            return None
        name = os.path.basename(path.rstrip("/"))
        if event == "open":
            mode = args[1] if len(args) > 1 else None
            flags = args[2] if len(args) > 2 else 0  # os.open: (path, None, flags)
            writing = (isinstance(mode, str) and mode[:1] in "wax") or (
                mode is None and isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR)
            )
            if name == "metrics.jsonl" and mode == "a":
                return "logged", path
            if ".partial/" in path and name.endswith(".distcp") and writing:
                return "shard", path
            if ".partial/" in path and name == "trainer_state.json" and writing:
                return "state", path
            return None
        if event == "os.mkdir" and name.endswith(".partial"):
            if path in self.seen_partials:
                return None
            self.seen_partials.add(path)
            self.after_pointer = False
            return "save", path
        if event == "os.rename":
            target = _path(args[1]) if len(args) > 1 else None
            if name == ".metadata.tmp":
                return "metadata", path
            if (
                name.endswith(".partial")
                and target
                and re.fullmatch(r"step_\d+", Path(target).name)
            ):
                return "publish", f"{path} -> {target}"
            if target and os.path.basename(target) == "latest":
                self.after_pointer = True
                return "pointer", f"{path} -> {target}"
            return None
        if event == "shutil.rmtree" and re.fullmatch(r"step_\d+", name) and self.after_pointer:
            return "cleanup", path
        return None

    def __call__(self, event: str, args: tuple) -> None:
        if self.busy or event not in ("open", "os.mkdir", "os.rename", "shutil.rmtree"):
            return
        self.busy = True
        try:
            found = self.moment(event, args)
            if found is None:
                return
            kind, detail = found
            self.counts[kind] += 1
            self.last = kind
            if self.plan.get("timeline"):
                self.record(moment=kind, n=self.counts[kind], detail=detail)
            trigger = "logged" if self.plan.get("kind") == "step" else self.plan.get("kind")
            if kind != trigger or self.counts[kind] != self.plan.get("n"):
                return
            if self.plan.get("fail"):  # an injected write error instead of a kill
                self.record(injected=self.plan["fail"], moment=kind, detail=detail)
                code = errno.ENOSPC if self.plan["fail"] == "enospc" else errno.EACCES
                raise OSError(code, os.strerror(code), detail.split(" -> ")[0])
            delay = float(self.plan.get("delay", 0.0))
            what = {"moment": kind, "n": self.counts[kind], "detail": detail, "delay": delay}
            if delay <= 0:
                self.kill(what)
            else:
                threading.Thread(target=self._later, args=(delay, what), daemon=True).start()
        finally:
            self.busy = False

    def _later(self, delay: float, what: dict) -> None:
        time.sleep(delay)
        self.kill(what)

    def watch_steps(self, metrics: Path) -> None:
        """Ranks other than 0 log nothing: they count rank 0's train lines in ``metrics``
        (polled every 2 ms) to aim a 'step' kill."""
        if self.plan.get("kind") != "step" or self.rank == 0:
            return

        def lines() -> int:
            try:
                return metrics.read_bytes().count(b'"split": "train"')
            except OSError:
                return 0

        def poll() -> None:
            before = lines()
            while lines() < before + self.plan["n"]:
                time.sleep(0.002)
            self.last = "logged"
            what = {"moment": "logged", "n": self.plan["n"], "detail": str(metrics)}
            self._later(float(self.plan.get("delay", 0.0)), {**what, "delay": self.plan["delay"]})

        threading.Thread(target=poll, daemon=True).start()

    def kill(self, what: dict) -> None:
        how = self.plan.get("signal", "SIGKILL")
        self.record(killed=how == "SIGKILL", stopped=how == "SIGSTOP", wall=time.time(),
                    last_moment=self.last, counts=dict(self.counts), **what)  # fmt: skip
        os.kill(os.getpid(), getattr(signal, how))


def _child(argv: list[str], env: dict[str, str | None], log: Path, plan: dict | None, rank: int,
           records: Path, threads: int) -> None:  # fmt: skip
    """The forked training process: ``gem_train.cli.main(argv)`` with its output in ``log``."""
    code = 1
    try:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        for key, value in env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        import torch

        torch.set_num_threads(threads)
        record_fd = os.open(records, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        watcher = _Watcher(plan, record_fd, rank)
        sys.addaudithook(watcher)
        output = next(a.split("=", 2)[2] for a in argv if a.startswith("--set=output_dir="))
        watcher.watch_steps(Path(output) / "gem" / "metrics.jsonl")
        code = _cli.main(argv)
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code or 0)


# ---------------------------------------------------------------------------- the launcher
@dataclass
class Attempt:
    """One launch of all ranks: their exit codes and what the audit hooks recorded."""

    index: int
    resume: bool
    plan: dict | None
    codes: list[int]
    seconds: float
    records: list[dict]
    logs: list[str]
    external: dict | None = None
    """The launcher's own SIGKILL ('random' kind), when it fired."""
    teardown: list[dict] = field(default_factory=list)
    """Survivors of a dead rank: exited on their own (code, seconds) or killed by the launcher."""
    hung: bool = False
    exit_wall: list[float] = field(default_factory=list)
    """Wall-clock time (time.time()) each rank was seen to exit."""

    @property
    def killed(self) -> bool:
        return self.external is not None or any(r.get("killed") for r in self.records)

    @property
    def ok(self) -> bool:
        return all(code == 0 for code in self.codes)


def launch(world: int, argv: list[str], plan: dict | None, directory: Path, index: int,
           rng: random.Random, timeout: float = 600.0, env_extra: dict | None = None,
           teardown: bool = True) -> Attempt:  # fmt: skip
    """Forks ``world`` ranks of ``gem-train argv``; applies ``plan``; waits for all of them.

    ``teardown``: once a rank died, SIGKILL the others after a random grace of up to 1 s (as
    torchrun would); without it they must end on their own (a rank the plan stopped with
    SIGSTOP is killed once all the others ended)."""
    directory.mkdir(parents=True, exist_ok=True)
    records = directory / f"attempt{index}.records.jsonl"
    logs = [directory / f"attempt{index}.rank{rank}.log" for rank in range(world)]
    port = str(_free_port())
    pids = []
    sys.stdout.flush()
    sys.stderr.flush()
    started = time.monotonic()
    for rank in range(world):
        if world == 1:
            env: dict[str, str | None] = {
                key: None for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
            }
        else:
            env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                   "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": port}  # fmt: skip
        env.update(env_extra or {})
        rank_plan = plan if plan and rank in plan.get("ranks", [0]) else None
        if plan and plan.get("timeline"):
            rank_plan = plan
        pid = os.fork()
        if pid == 0:
            _child(argv, env, logs[rank], rank_plan, rank, records, 2 if world == 1 else 1)
        pids.append(pid)
    codes: dict[int, int] = {}
    exited_at: dict[int, float] = {}
    exit_wall: dict[int, float] = {}
    external = None
    kill_at = started + plan["delay"] if plan and plan.get("kind") == "random" else None
    first_death = None
    grace = rng.uniform(0.0, 1.0)
    teardown_log: list[dict] = []
    hung = False
    while len(codes) < world:
        now = time.monotonic()
        for rank, pid in enumerate(pids):
            if rank in codes:
                continue
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[rank] = os.waitstatus_to_exitcode(status)
                exited_at[rank] = now
                exit_wall[rank] = time.time()
                if codes[rank] != 0 and first_death is None:
                    first_death = now
        if kill_at is not None and now >= kill_at and external is None:
            targets = [r for r in plan["ranks"] if r not in codes]
            for rank in targets:
                os.kill(pids[rank], signal.SIGKILL)
            external = {"seconds": round(now - started, 3), "ranks": targets}
            if not targets:
                external = None
            kill_at = None
        stopped = plan.get("ranks", []) if plan and plan.get("signal") == "SIGSTOP" else []
        if stopped and all(r in codes for r in range(world) if r not in stopped):
            for rank in stopped:
                if rank not in codes:
                    os.kill(pids[rank], signal.SIGKILL)
        if (
            teardown
            and first_death is not None
            and len(codes) < world
            and now >= first_death + grace
        ):
            for rank, pid in enumerate(pids):
                if rank not in codes:
                    os.kill(pid, signal.SIGKILL)
                    teardown_log.append(
                        {"rank": rank, "killed_after_s": round(now - first_death, 3)}
                    )
            first_death = float("inf")  # once
        if now - started > timeout and len(codes) < world:
            hung = True
            for rank, pid in enumerate(pids):
                if rank not in codes:
                    os.kill(pid, signal.SIGKILL)
        time.sleep(0.005)
    dead = [r for r, c in codes.items() if c == -signal.SIGKILL]
    for rank, code in codes.items():
        if rank not in dead and code != 0 and dead:
            death = min(exited_at[r] for r in dead)
            teardown_log.append(
                {
                    "rank": rank,
                    "exit_code": code,
                    "exited_after_s": round(exited_at[rank] - death, 3),
                }
            )
    entries = (
        [json.loads(line) for line in records.read_text().splitlines()] if records.exists() else []
    )
    return Attempt(
        index=index,
        resume="--resume" in argv,
        plan=plan,
        codes=[codes[r] for r in range(world)],
        seconds=round(time.monotonic() - started, 3),
        records=entries,
        logs=[str(p) for p in logs],
        external=external,
        teardown=teardown_log,
        hung=hung,
        exit_wall=[exit_wall[r] for r in range(world)],
    )


def _tail(path: str, lines: int = 25) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


# ----------------------------------------------------------------------------- comparisons
def read_run(output: Path) -> dict:
    """Every train line's (loss, lr) by step, every eval line, and summary.json's results."""
    train: dict[int, list[tuple[float, float]]] = {}
    evals: list[dict] = []
    torn = 0
    metrics = output / "gem" / "metrics.jsonl"
    for line in metrics.read_text().splitlines() if metrics.exists() else []:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            torn += 1
            continue
        if record.get("split") == "train":
            train.setdefault(record["step"], []).append((record["loss"], record["lr"]))
        elif record.get("split") == "eval":
            evals.append({k: v for k, v in record.items() if k.startswith(("ne_", "auc_"))})
    summary_file = output / "summary.json"
    summary = None
    if summary_file.exists():
        results = json.loads(summary_file.read_text())["results"]["gem"]
        summary = {k: v for k, v in results.items() if k not in SUMMARY_IGNORED}
    return {"train": train, "evals": evals, "summary": summary, "torn": torn}


def compare(run: dict, reference: dict) -> list[str]:
    """What differs from the uninterrupted run (empty: identical)."""
    problems = []
    if run["torn"]:
        problems.append(f"{run['torn']} unreadable metrics.jsonl lines")
    expected = {step: values[0] for step, values in reference["train"].items()}
    if sorted(run["train"]) != sorted(expected):
        problems.append(f"logged steps {sorted(run['train'])} != {sorted(expected)}")
    for step, values in sorted(run["train"].items()):
        for value in values:
            if step in expected and value != expected[step]:
                problems.append(f"step {step}: (loss, lr) {value} != {expected[step]}")
    if run["summary"] != reference["summary"]:
        problems.append(f"summary {run['summary']} != {reference['summary']}")
    if not run["evals"] or any(e != reference["evals"][-1] for e in run["evals"]):
        problems.append(f"eval lines {run['evals']} != {reference['evals'][-1:]}")
    return problems


# ---------------------------------------------------------------------------- kill campaign
def checkpoint_step(checkpoints: Path) -> int:
    """The step ``latest`` names, else the newest ``step_N`` (0 when none): where the next
    attempt should resume."""
    try:
        return int((checkpoints / "latest").read_text().strip().split("_")[1].split(".")[0])
    except (OSError, ValueError, IndexError):
        steps = [int(p.name[5:]) for p in checkpoints.glob("step_*") if p.name[5:].isdigit()]
        return max(steps, default=0)


def has_checkpoint(checkpoints: Path) -> bool:
    return (checkpoints / "latest").exists() or any(
        re.fullmatch(r"step_\d+", p.name) for p in checkpoints.glob("step_*")
    )


def saves_after(step: int) -> int:
    saves = [s for s in range(EVERY, STEPS + 1, EVERY)]
    if STEPS % EVERY:
        saves.append(STEPS)
    return max(1, sum(s > step for s in saves))


class Campaign:
    """SIGKILL-and-resume chains on ``world`` ranks until ``kills`` kills landed."""

    def __init__(self, world: int, kills: int, work: Path, data: Path, rng: random.Random,
                 per_chain: int, allowed: tuple[str, ...] = KINDS, control: bool = True) -> None:  # fmt: skip
        self.world, self.kills, self.rng, self.per_chain = world, kills, rng, per_chain
        self.allowed, self.control = allowed, control
        self.work, self.data = work / f"world{world}", data
        self.log: list[dict] = []
        self.chains: list[dict] = []

    def reference(self) -> None:
        """The uninterrupted run (with the hook recording its moments' times) and a control."""
        self.ref_attempt = launch(
            self.world,
            cli_args(self.data, self.work / "reference"),
            {"timeline": True, "ranks": list(range(self.world))},
            self.work / "reference",
            0,
            self.rng,
        )
        if not self.ref_attempt.ok:
            raise SystemExit(f"reference run failed:\n{_tail(self.ref_attempt.logs[0], 60)}")
        self.ref = read_run(self.work / "reference")
        self.control_identical = None
        if self.control:
            control = launch(self.world, cli_args(self.data, self.work / "control"), None,
                             self.work / "control", 0, self.rng)  # fmt: skip
            self.control_identical = control.ok and not compare(
                read_run(self.work / "control"), self.ref
            )
        timeline = [r for r in self.ref_attempt.records if r.get("rank") == 0]
        times = {kind: [r["t"] for r in timeline if r["moment"] == kind] for kind in
                 ("logged", "save", "shard", "pointer")}  # fmt: skip
        gaps = [b - a for a, b in zip(times["logged"], times["logged"][1:], strict=False)]
        self.step_seconds = statistics.median(gaps) if gaps else 0.1
        saves = [p - s for s, p in zip(times["save"], times["pointer"], strict=False)]
        self.save_seconds = statistics.median(saves) if saves else 0.1
        self.shard_seconds = self.save_seconds / 2
        self.attempt_seconds = self.ref_attempt.seconds
        # An attempt: start-up until the first step's log line, the steps it has left, then
        # the last save, eval and report (from the uninterrupted run's timeline).
        logged = times["logged"][:STEPS] or [0.0, self.attempt_seconds]
        self.startup_seconds = logged[0]
        self.train_seconds = logged[-1] - logged[0]
        self.tail_seconds = max(0.0, self.attempt_seconds - logged[-1])

    def expected_seconds(self, resume_step: int) -> float:
        """How long an attempt that resumes at ``resume_step`` runs without a kill."""
        left = (STEPS - resume_step) / STEPS
        return self.startup_seconds + self.train_seconds * left + self.tail_seconds

    def draw(self, kind: str, resume_step: int) -> dict:
        """The plan of one kill of ``kind`` for an attempt that resumes at ``resume_step``."""
        rng = self.rng
        ranks = [0]
        if self.world > 1 and kind not in WRITER_KINDS:
            ranks = [rng.randrange(self.world)]
        plan: dict[str, Any] = {"kind": kind, "ranks": ranks, "delay": 0.0}
        if kind == "step":
            plan["n"] = rng.randint(1, max(1, STEPS - resume_step))
            plan["delay"] = rng.uniform(0.0, self.step_seconds)
        elif kind == "random":
            if self.world > 1 and rng.random() < 0.5:
                plan["ranks"] = list(range(self.world))  # the whole job at once (a host dies)
            plan["delay"] = rng.uniform(0.0, self.expected_seconds(resume_step))
        elif kind == "cleanup":
            plan["n"] = 1
        else:
            plan["n"] = rng.randint(1, saves_after(resume_step))
            if kind == "save":
                plan["delay"] = rng.uniform(0.0, self.save_seconds)
            elif kind == "shard":
                plan["delay"] = rng.uniform(0.0, self.shard_seconds)
        return plan

    def kinds(self) -> list[str]:
        """The kinds of the kills to land: blocks that each hold every allowed kind once (with
        all kinds allowed, ``pointer``, ``publish`` and ``step`` twice), each block in random
        order."""
        extra = ("pointer", "publish", "step") if set(self.allowed) == set(KINDS) else ()
        block = [*self.allowed, *extra]
        drawn: list[str] = []
        while len(drawn) < self.kills + len(block):
            self.rng.shuffle(block)
            drawn += block
        return drawn

    def run(self) -> dict:
        self.reference()
        queue = self.kinds()
        landed = 0
        chain = 0
        while landed < self.kills:
            chain += 1
            output = self.work / f"chain{chain}"
            checkpoints = output / "gem" / "checkpoints"
            attempts: list[Attempt] = []
            failure = None
            fresh_retry = False
            while True:
                kills_here = sum(a.killed for a in attempts)
                plan = None
                if kills_here < self.per_chain and landed < self.kills and queue:
                    plan = self.draw(queue[0], checkpoint_step(checkpoints))
                resume = has_checkpoint(checkpoints) and not fresh_retry
                argv = cli_args(self.data, output) + (["--resume"] if resume else [])
                attempt = launch(self.world, argv, plan, output, len(attempts), self.rng)
                attempts.append(attempt)
                fresh_retry = False
                if attempt.hung:
                    failure = f"attempt {attempt.index} hung"
                    break
                if attempt.killed:
                    queue.pop(0)
                    landed += 1
                    self.log.append(self._entry(chain, attempt, checkpoints))
                    continue
                if attempt.ok:
                    if plan is not None:
                        queue.append(queue.pop(0))  # its moment did not come: draw it again
                    break
                log = _tail(attempt.logs[0], 40)
                if resume and "--resume: no checkpoint under" in log:
                    fresh_retry = True  # nothing whole to resume from: a fresh start
                    continue
                failure = f"attempt {attempt.index} exited {attempt.codes}:\n{log}"
                break
            problems = [failure] if failure else compare(read_run(output), self.ref)
            verdict = {
                "chain": chain,
                "attempts": len(attempts),
                "kills": sum(a.killed for a in attempts),
                "identical": not problems,
                "problems": problems[:5],
                "resumed_at": [_resumed_at(a) for a in attempts[1:]],
                "plans": [
                    {
                        "kind": a.plan["kind"],
                        "n": a.plan.get("n"),
                        "delay_s": round(a.plan.get("delay", 0.0), 3),
                        "landed": a.killed,
                        "seconds": a.seconds,
                    }
                    for a in attempts
                    if a.plan
                ],
                "fallbacks": [line for a in attempts for line in _fallback_lines(a)],
            }
            self.chains.append(verdict)
            for entry in self.log:
                if entry["chain"] == chain:
                    entry["identical"] = verdict["identical"]
            print(
                f"world{self.world} chain {chain}: {verdict['kills']} kills, "
                f"{'identical' if not problems else 'DIFFERENT: ' + problems[0][:300]}",
                flush=True,
            )
        return {
            "kills": landed,
            "identical": int(
                all(c["identical"] for c in self.chains) and self.control_identical is not False
            ),
            "control_identical": self.control_identical,
            "chains": self.chains,
            "kill_log": self.log,
            "by_kind": dict(Counter(e["kind"] for e in self.log)),
            "landed_after": dict(
                Counter((e["at"] or {}).get("last_moment", "launcher") for e in self.log)
            ),
            "by_group": dict(Counter(GROUPS[e["kind"]] for e in self.log)),
            "step_seconds": self.step_seconds,
            "save_seconds": self.save_seconds,
            "reference_seconds": self.attempt_seconds,
        }

    def _entry(self, chain: int, attempt: Attempt, checkpoints: Path) -> dict:
        plan = attempt.plan or {}
        killed = [r for r in attempt.records if r.get("killed")]
        return {
            "chain": chain,
            "attempt": attempt.index,
            "kind": plan.get("kind"),
            "group": GROUPS.get(plan.get("kind", ""), "?"),
            "ranks": plan.get("ranks"),
            "n": plan.get("n"),
            "delay_s": round(plan.get("delay", 0.0), 4),
            "at": killed[0] if killed else attempt.external,
            "lines_logged": (killed[0].get("counts", {}).get("logged") if killed else None),
            "latest_after": checkpoint_step(checkpoints),
            "codes": attempt.codes,
            "teardown": attempt.teardown,
            "resumed": attempt.resume,
        }


def _resumed_at(attempt: Attempt) -> str:
    text = Path(attempt.logs[0]).read_text(errors="replace")
    found = re.search(r"resumed at step (\d+)", text)
    if found:
        return found.group(0)
    return "killed before it resumed" if attempt.resume else "fresh start"


def _fallback_lines(attempt: Attempt, *, skips: bool = False) -> list[str]:
    """The lines in which the product said it fell back (with ``skips``: and what it skipped)."""
    text = Path(attempt.logs[0]).read_text(errors="replace")
    keys = ("falling back", "skipping checkpoint") if skips else ("falling back",)
    return [line.strip() for line in text.splitlines() if any(k in line.lower() for k in keys)]


# ------------------------------------------------------------------------ checkpoint cases
def _truncate(path: Path, keep: float = 0.5) -> None:
    size = path.stat().st_size
    with path.open("r+b") as handle:
        handle.truncate(int(size * keep))


def _newest(checkpoints: Path) -> Path:
    return checkpoints / (checkpoints / "latest").read_text().strip()


DAMAGE = {
    "truncated_shard": lambda c: _truncate(next(_newest(c).glob("*.distcp"))),
    "missing_metadata": lambda c: (_newest(c) / ".metadata").unlink(),
    "truncated_metadata": lambda c: _truncate(_newest(c) / ".metadata", 0.3),
    "truncated_trainer_state": lambda c: _truncate(_newest(c) / "trainer_state.json", 0.4),
    "dangling_latest": lambda c: shutil.rmtree(_newest(c)),
}
"""Corruptions of the newest checkpoint; ``--resume`` must fall back to the one before."""

NAMED = {
    "truncated_shard": ("IncompleteCheckpointError", ".distcp"),
    "missing_metadata": ("IncompleteCheckpointError", ".metadata"),
    "truncated_metadata": ("IncompleteCheckpointError", ".metadata"),
    "truncated_trainer_state": ("IncompleteCheckpointError", "trainer_state.json"),
    "dangling_latest": ("IncompleteCheckpointError", "latest"),
    "other_model_config": ("CheckpointMismatchError", ".metadata"),
    "other_world_size": ("CheckpointMismatchError", "trainer_state.json"),
    "enospc_shard": ("CheckpointSaveError", ".partial"),
    "enospc_metadata": ("CheckpointSaveError", ".partial"),
    "enospc_state": ("CheckpointSaveError", ".partial"),
    "enospc_pointer": ("CheckpointSaveError", "latest"),
    "unwritable": ("CheckpointSaveError", ".partial"),
    "enospc_rank1_of_2": ("CheckpointSaveError", ".partial"),
    "enospc_state_2ranks": ("CheckpointSaveError", ".partial"),
}
"""Each case's expected exception class and the file its message must name."""


def _named(text: str, case: str) -> bool:
    name, file = NAMED[case]
    return any(name in line and file in line for line in text.splitlines())


def checkpoint_cases(work: Path, data: Path, rng: random.Random, world1: Path,
                     world2_reference: Path) -> dict[str, dict]:  # fmt: skip
    """Damaged checkpoints under ``--resume`` and write errors during a save."""
    reference = read_run(world1 / "reference")
    finished = world1 / "reference"
    results: dict[str, dict] = {}
    for case, damage in DAMAGE.items():
        output = work / "checkpoint" / case
        shutil.copytree(finished, output)
        checkpoints = output / "gem" / "checkpoints"
        damaged = _newest(checkpoints).name
        damage(checkpoints)
        attempt = launch(1, cli_args(data, output) + ["--resume"], None, output, 0, rng)
        text = Path(attempt.logs[0]).read_text(errors="replace")
        run = read_run(output)
        results[case] = {
            "named_error": int(_named(text, case)),
            "fell_back": int(attempt.ok and bool(_fallback_lines(attempt))),
            "finished_identical": int(attempt.ok and run["summary"] == reference["summary"]),
            "damaged": damaged,
            "exit_code": attempt.codes[0],
            "said": [line[:400] for line in _fallback_lines(attempt, skips=True)]
            or _tail(attempt.logs[0], 3),
        }
    mismatches = {
        "other_model_config": (1, finished, {"model.embedding_dim": 32}),
        "other_world_size": (1, world2_reference, {}),
    }
    for case, (world, source, overrides) in mismatches.items():
        output = work / "checkpoint" / case
        shutil.copytree(source, output)
        argv = cli_args(data, output, **overrides) + ["--resume"]
        attempt = launch(world, argv, None, output, 0, rng)
        text = Path(attempt.logs[0]).read_text(errors="replace")
        results[case] = {
            "named_error": int(_named(text, case) and not attempt.ok),
            "refused": int(not attempt.ok and not _fallback_lines(attempt)),
            "exit_code": attempt.codes[0],
            "said": _error_line(text),
        }
    # Write errors: the second save (step 6) fails at one of its writes.
    references = {1: reference, 2: read_run(world2_reference)}
    failures = {
        "enospc_shard": (1, "shard", "enospc", 0),
        "enospc_metadata": (1, "metadata", "enospc", 0),
        "enospc_state": (1, "state", "enospc", 0),
        "enospc_pointer": (1, "pointer", "enospc", 0),
        "unwritable": (1, "save", "eacces", 0),
        "enospc_rank1_of_2": (2, "shard", "enospc", 1),
        "enospc_state_2ranks": (2, "state", "enospc", 0),
    }
    for case, (world, moment, error, rank) in failures.items():
        output = work / "checkpoint" / case
        plan = {"kind": moment, "n": 2, "fail": error, "ranks": [rank]}
        attempt = launch(world, cli_args(data, output), plan, output, 0, rng, 300, teardown=False)
        texts = [Path(log).read_text(errors="replace") for log in attempt.logs]
        failed_run = read_run(output)
        latest = checkpoint_step(output / "gem" / "checkpoints")
        resumed = launch(world, cli_args(data, output) + ["--resume"], None, output, 1, rng)
        run = read_run(output)
        results[case] = {
            # every rank stops with the named error, none goes on
            "named_error": int(
                all(_named(text, case) for text in texts) and all(c > 0 for c in attempt.codes)
            ),
            "stopped": int(max(failed_run["train"], default=0) == 2 * EVERY),
            "latest_after": latest,
            "previous_loadable": int(
                latest == EVERY and resumed.ok and not compare(run, references[world])
            ),
            "exit_codes": attempt.codes,
            "said": _error_line(texts[0]),
        }
    return results


# ------------------------------------------------------------------------------ dead rank
def dead_rank(work: Path, data: Path, rng: random.Random, timeout_s: float) -> dict[str, dict]:
    """2 gloo ranks with ``GEM_DIST_TIMEOUT_S=timeout_s``; after its 3rd step rank 1 is
    SIGKILLed (its sockets close) or SIGSTOPped (alive but silent: only the timeout can tell).
    Rank 0 must exit non-zero by itself, within the timeout; nothing tears it down."""
    results = {}
    for how in ("SIGKILL", "SIGSTOP"):
        output = work / "dead_rank" / how
        plan = {"kind": "step", "n": 3, "delay": 0.0, "ranks": [1], "signal": how}
        attempt = launch(2, cli_args(data, output), plan, output, 0, rng, timeout=timeout_s + 120,
                         env_extra={"GEM_DIST_TIMEOUT_S": str(timeout_s)}, teardown=False)  # fmt: skip
        died = next(
            (r["wall"] for r in attempt.records if r.get("killed") or r.get("stopped")), None
        )
        survivor = attempt.codes[0]
        seconds = attempt.exit_wall[0] - died if died is not None and attempt.exit_wall else None
        text = Path(attempt.logs[0]).read_text(errors="replace")
        results[how] = {
            "survivor_exit_code": survivor,
            "survivor_exit_s": round(seconds, 2) if seconds is not None else None,
            "within_timeout": int(
                survivor not in (0, -signal.SIGKILL)
                and seconds is not None
                and seconds <= timeout_s + 10
            ),
            "timeout_s": timeout_s,
            "said": _error_line(text),
        }
    return results


def _error_line(text: str) -> str:
    lines = [line for line in text.splitlines() if "Error" in line or "error" in line]
    return (lines[-1] if lines else "\n".join(text.splitlines()[-3:]))[:400]


# ----------------------------------------------------------------------------------- main
def merge_rows(path: Path, rows: list[dict], meta_block: dict) -> None:
    """Replaces this script's rows (case kill/... and checkpoint/...) in ``path``, keeping the
    other rows and meta entries (another script adds its own cases to the same file)."""
    old: dict = {"meta": {}, "rows": []}
    if path.exists():
        old = json.loads(path.read_text())
    kept = [r for r in old["rows"] if not r["case"].startswith(("kill/", "checkpoint/"))]
    write_results(path, {**old["meta"], **meta_block}, kept + rows)


def rows_of(results: dict, cases: dict, dead: dict) -> list[dict]:
    """The result rows: kill/world<N> (kills, identical), checkpoint/<case> (named_error and,
    per case, fell_back / refused / stopped / previous_loadable), kill/dead_rank_<signal>."""
    rows = []
    for world, result in results.items():
        mode = f"{STEPS} steps, checkpoint every {EVERY}, {world} rank(s), gloo, SIGKILL + --resume"
        for metric in ("kills", "identical"):
            rows.append({"case": f"kill/world{world}", "provider": "gem-train --resume",
                         "mode": mode, "metric": metric, "value": result[metric]})  # fmt: skip
    for case, result in cases.items():
        if case in DAMAGE:
            mode, metrics = "damaged newest checkpoint, --resume", ("named_error", "fell_back")
        elif case.startswith("other_"):
            mode, metrics = "checkpoint of another job, --resume", ("named_error", "refused")
        else:
            mode = "write error injected into a save"
            metrics = ("named_error", "stopped", "previous_loadable")
        for metric in metrics:
            rows.append({"case": f"checkpoint/{case}", "provider": "gem-train", "mode": mode,
                         "metric": metric, "value": result[metric]})  # fmt: skip
    for how, result in dead.items():
        rows.append({"case": f"kill/dead_rank_{how.lower()}", "provider": "init_distributed",
                     "mode": f"2 gloo ranks, rank 1 {how} after step 3, GEM_DIST_TIMEOUT_S="
                     f"{result['timeout_s']:g}", "metric": "within_timeout",
                     "value": result["within_timeout"]})  # fmt: skip
    return rows


def main() -> None:
    global _cli
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--out", default=str(ROOT / "benchmarks" / "results" / "cpu" / "faults.json")
    )
    parser.add_argument("--kills", type=int, default=30, help="kills on one rank (default 30)")
    parser.add_argument("--kills2", type=int, default=10, help="kills on two ranks (default 10)")
    parser.add_argument("--per-chain", type=int, default=4, help="kills per resumed run")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill moments")
    parser.add_argument(
        "--kinds", default=",".join(KINDS), help=f"kill kinds to draw from (default: all, {KINDS})"
    )
    parser.add_argument(
        "--no-control", action="store_true", help="skip the second uninterrupted run"
    )
    parser.add_argument("--no-checkpoint-cases", action="store_true")
    parser.add_argument(
        "--dead-rank-timeout", type=float, default=10.0, help="GEM_DIST_TIMEOUT_S of the dead-rank "
        "runs (default 10; 0 skips them)",
    )  # fmt: skip
    parser.add_argument("--work", help="keep the runs in this directory (default: a temp dir)")
    args = parser.parse_args()
    allowed = tuple(kind for kind in args.kinds.split(",") if kind)
    unknown = set(allowed) - set(KINDS)
    if unknown or not allowed:
        parser.error(f"--kinds: unknown {sorted(unknown)}; known: {KINDS}")
    started = time.perf_counter()
    import gem_train.cli

    _cli = gem_train.cli
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="gem-faults-"))
    work.mkdir(parents=True, exist_ok=True)
    data = work / "data"
    rng = random.Random(args.seed)
    results: dict[int, dict] = {}
    cases: dict[str, dict] = {}
    dead: dict[str, dict] = {}
    try:
        generate_data(data)
        for world, kills in ((1, args.kills), (2, args.kills2)):
            campaign = Campaign(world, kills, work, data, rng, args.per_chain, allowed,
                                control=not args.no_control)  # fmt: skip
            results[world] = campaign.run()
            print(
                f"kill/world{world}: {results[world]['kills']} kills "
                f"{results[world]['by_kind']}, identical={results[world]['identical']} "
                f"(control identical={results[world]['control_identical']}, "
                f"{time.perf_counter() - started:.0f} s)",
                flush=True,
            )
        if args.dead_rank_timeout > 0:
            dead = dead_rank(work, data, rng, args.dead_rank_timeout)
            for how, result in dead.items():
                print(f"kill/dead_rank_{how.lower()}: {result}", flush=True)
        if not args.no_checkpoint_cases:
            cases = checkpoint_cases(
                work, data, rng, work / "world1", work / "world2" / "reference"
            )
            for case, result in cases.items():
                print(f"checkpoint/{case}: {result}", flush=True)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    rows = rows_of(results, cases, dead)
    seconds = time.perf_counter() - started
    command = " ".join(["python benchmarks/bench_faults.py", *user_args()])
    meta_block = meta(
        "faults",
        command,
        faults_command=command,
        kill={f"world{w}": r for w, r in results.items()},
        dead_rank=dead,
        checkpoint=cases,
        faults_seconds=round(seconds, 1),
    )
    merge_rows(Path(args.out), rows, meta_block)
    print(f"wrote {args.out} ({seconds:.0f} s)")
    failed = [r for r in rows if r["value"] == 0]
    if failed:
        raise SystemExit(
            f"{len(failed)} checks failed: {[r['case'] + ':' + r['metric'] for r in failed]}"
        )


if __name__ == "__main__":
    main()
