"""Lint, per-package tests, integration tests and the GPU test session.

Every `tests(<package>)` session installs ONLY that package (plus the workspace
packages it declares, recursively) into a fresh environment, pinned to the
versions in uv.lock, and runs its tests. An undeclared import therefore fails
there, which keeps the package layering honest.

    uv run --extra cpu nox                 # lint + every package + integration (CPU)
    uv run --extra cpu nox -s "tests(gem-data)"
    python -m nox -s gpu                   # on the GPU machine, with its own interpreter
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import nox

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).parent
PACKAGES = sorted(p.name for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").is_file())

nox.options.default_venv_backend = "uv"
nox.options.sessions = ["lint", "tests", "integration"]
nox.options.error_on_external_run = True


def _project(name: str) -> dict:
    return tomllib.loads((ROOT / "packages" / name / "pyproject.toml").read_text())["project"]


def _requirement_name(requirement: str) -> str:
    name = requirement.split(";")[0].strip().split("[")[0]
    for separator in "<>=!~ ":
        name = name.split(separator)[0]
    return name


def _declared_workspace_dependencies(package: str) -> list[str]:
    """``package`` and every gem-* package it depends on, recursively, in install order."""
    seen: list[str] = []

    def visit(name: str) -> None:
        if name in seen:
            return
        for requirement in _project(name).get("dependencies", []):
            if _requirement_name(requirement) in PACKAGES:
                visit(_requirement_name(requirement))
        seen.append(name)

    visit(package)
    return seen


def _needs_torchrec(packages: list[str]) -> bool:
    return any(
        _requirement_name(requirement) == "torchrec"
        for name in packages
        for requirement in _project(name).get("dependencies", [])
    )


def _editable(name: str, *, with_test_extra: bool) -> str:
    """``packages/<name>``, with its ``test`` extra (what its tests import) when it has one."""
    has_test_extra = "test" in _project(name).get("optional-dependencies", {})
    return f"packages/{name}[test]" if with_test_extra and has_test_extra else f"packages/{name}"


def _pinned_requirements(session: nox.Session) -> list[str]:
    """uv.lock's versions as constraints, and an override dropping torchrec's fbgemm-gpu (CUDA) pin.

    The CPU wheel, fbgemm-gpu-cpu, provides the same `fbgemm_gpu` module.
    """
    tmp = Path(session.create_tmp())
    constraints = tmp / "constraints.txt"
    session.run(
        "uv",
        "export",
        "--frozen",
        "--extra",
        "cpu",
        "--no-hashes",
        "--no-emit-workspace",
        "--all-groups",
        "--output-file",
        str(constraints),
        silent=True,
        external=True,
    )
    overrides = tmp / "overrides.txt"
    overrides.write_text("fbgemm-gpu ; sys_platform == 'never'\n")
    return ["--constraint", str(constraints), "--override", str(overrides)]


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check over the whole repository."""
    session.install(*_pinned_requirements(session), "ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
@nox.parametrize("package", PACKAGES, ids=PACKAGES)
def tests(session: nox.Session, package: str) -> None:
    """Installs one package alone (with its declared dependencies) and runs its tests."""
    members = _declared_workspace_dependencies(package)
    extras = ["fbgemm-gpu-cpu"] if _needs_torchrec(members) else []
    session.install(
        *_pinned_requirements(session),
        *(
            arg
            for name in members
            for arg in ("-e", _editable(name, with_test_extra=name == package))
        ),
        *extras,
        "pytest",
        "hypothesis",
    )
    session.run("pytest", f"packages/{package}/tests", *session.posargs)


@nox.session
def integration(session: nox.Session) -> None:
    """The whole workspace from uv.lock (CPU variant) and the cross-package tests in tests/."""
    session.run_install(
        "uv",
        "sync",
        "--frozen",
        "--extra",
        "cpu",
        env={"UV_PROJECT_ENVIRONMENT": session.virtualenv.location},
        external=True,
    )
    session.run("pytest", "tests", *session.posargs)


@nox.session(python=False)
def gpu(session: nox.Session) -> None:
    """`gpu`-marked tests with the interpreter already on a GPU machine: no install, no network."""
    source_dirs = [str(ROOT / "packages" / name / "src") for name in PACKAGES]
    env = {"PYTHONPATH": os.pathsep.join([*source_dirs, os.environ.get("PYTHONPATH", "")])}
    session.run(
        sys.executable, "-m", "pytest", "-m", "gpu", "packages", "tests", *session.posargs, env=env
    )
