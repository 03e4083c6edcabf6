"""Lint, per-package tests, integration tests, wheels and the GPU test sessions.

Every `tests(<package>)` session installs ONLY that package (plus the workspace
packages it declares, recursively) into a fresh environment, pinned to the
versions in uv.lock, and runs its tests. An undeclared import therefore fails
there, which keeps the package layering honest. `wheels` does the same with the
built wheels instead of the source trees: what `pip install gem-<x>` would get.

    uv run --extra cpu nox                 # lint + every package + integration + wheels (CPU)
    uv run --extra cpu nox -s "tests(gem-data)"
    uv run --extra cpu nox -s wheels       # build every wheel + sdist; each alone + its README example
    python -m nox -s "gpu(hopper)"         # on an H100 / H200, with the machine's interpreter
    python -m nox -s "gpu(blackwell)"      # on a B200 (`-s gpu` runs both, one after the other)
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import nox
import nox.command

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).parent
PACKAGES = sorted(p.name for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").is_file())

nox.options.default_venv_backend = "uv"
nox.options.sessions = ["lint", "tests", "integration", "wheels"]
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


_SMOKE_TEST = """
import importlib, pkgutil, sys
package = importlib.import_module(sys.argv[1])
assert package.__file__.startswith(sys.prefix), f"{package.__file__} is not the installed wheel"
modules = [m.name for m in pkgutil.walk_packages(package.__path__, package.__name__ + ".")]
for name in modules:
    importlib.import_module(name)
print(package.__name__, f"and {len(modules)} submodules import from", sys.prefix)
"""
"""Imports the package from the fresh environment, then every submodule (gem_data's public
names are lazy, so its loaders would otherwise go unimported)."""

_RUN_EXAMPLE = """
import runpy, sys
script, package_name = sys.argv[1], sys.argv[2]
runpy.run_path(script, run_name="__main__")
package = sys.modules[package_name]
assert package.__file__.startswith(sys.prefix), f"{package.__file__} is not the installed wheel"
print(f"README example of {package_name} ran with", package.__file__)
"""
"""Runs a README example as ``__main__`` (a script), then checks that the package it used is the
wheel installed in this environment, not a source tree."""


def _readme_example(name: str) -> str:
    """The first ```python block of the "## Example" section of ``packages/<name>/README.md``."""
    readme = ROOT / "packages" / name / "README.md"
    section = re.search(r"^## Example[ \t]*\n(.*?)(?=^## |\Z)", readme.read_text(), re.M | re.S)
    block = section and re.search(r"^```python[ \t]*\n(.*?)^```", section.group(1), re.M | re.S)
    if not block:
        raise ValueError(f'{readme} has no ```python block under "## Example"')
    return block.group(1)


@nox.session(venv_backend="none")
def wheels(session: nox.Session) -> None:
    """Builds every package's wheel and sdist into dist/, then installs each wheel alone.

    Each wheel goes into its own fresh environment with only its declared dependencies: the
    gem-* ones from the wheels just built (``--find-links dist/``, pinned to the workspace
    versions so an index cannot substitute its own), third-party ones pinned to uv.lock like
    ``tests(<package>)``. Then every module of the package is imported, ``gem-train
    --print-config`` runs from gem-train's environment, and the first ```python block of the
    package README's "## Example" section runs with the environment's python, isolated (``-I``:
    no PYTHONPATH, no user site) in a temporary directory outside the repository that holds
    only the example, so only the installed wheels can be imported; it must then have imported
    the package from the environment.

    TRITON_INTERPRET is left as it is: on CPU tensors the examples' kernels (``backend="auto"``)
    take the PyTorch reference path and never launch a Triton kernel, so the interpreter would
    change nothing (a Triton launch on CPU would fail loudly, asking for it).
    """
    examples = {name: _readme_example(name) for name in PACKAGES}  # a missing one fails first
    dist = ROOT / "dist"
    session.run(
        "uv", "build", "--all-packages", "--no-sources", "--clear", "--out-dir", str(dist),
        external=True,
    )  # fmt: skip
    built = sorted(path.name for path in dist.iterdir())
    for name in PACKAGES:
        stem = f"{name.replace('-', '_')}-{_project(name)['version']}"
        missing = {f"{stem}-py3-none-any.whl", f"{stem}.tar.gz"} - set(built)
        if missing:
            session.error(f"uv build did not produce {sorted(missing)} (dist/ holds {built})")
    pinned = _pinned_requirements(session)
    workspace_pins = Path(session.create_tmp()) / "workspace-constraints.txt"
    workspace_pins.write_text("".join(f"{n}=={_project(n)['version']}\n" for n in PACKAGES))
    failed = []
    for name in PACKAGES:
        try:
            _install_wheel_alone(
                session, name, dist, [*pinned, "--constraint", str(workspace_pins)], examples[name]
            )
        except nox.command.CommandFailed:
            failed.append(name)
    if failed:
        session.error(
            f"these wheels do not install, import or run their README example alone: {failed} "
            "(output above)"
        )


def _install_wheel_alone(
    session: nox.Session, name: str, dist: Path, pins: list[str], example: str
) -> None:
    """A fresh environment with the wheel of ``name`` and its dependencies; imports it all and
    runs ``example`` (its README's) there."""
    # Absolute: the example runs from another directory.
    environment = Path(session.create_tmp()).resolve() / f"venv-{name}"
    python = environment / "bin" / "python"
    session.run(
        "uv", "venv", "--quiet", "--clear", "--python", sys.executable, str(environment),
        external=True,
    )  # fmt: skip
    wheel = dist / f"{name.replace('-', '_')}-{_project(name)['version']}-py3-none-any.whl"
    members = _declared_workspace_dependencies(name)
    extras = ["fbgemm-gpu-cpu"] if _needs_torchrec(members) else []
    session.run(
        "uv", "pip", "install", "--quiet", "--python", str(python), "--find-links", str(dist),
        *(arg for member in members for arg in ("--refresh-package", member)),
        *pins, str(wheel), *extras,
        external=True,
    )  # fmt: skip
    session.run(str(python), "-c", _SMOKE_TEST, name.replace("-", "_"), external=True)
    if name == "gem-train":
        session.run(
            str(environment / "bin" / "gem-train"), "--print-config", silent=True, external=True
        )
    with tempfile.TemporaryDirectory(prefix=f"{name}-example-") as workdir:
        script = Path(workdir) / "readme_example.py"
        script.write_text(example)
        start = time.perf_counter()
        with session.chdir(workdir):
            session.run(
                str(python), "-I", "-c", _RUN_EXAMPLE, str(script), name.replace("-", "_"),
                external=True,
            )  # fmt: skip
        session.log(f"{name}: README example ran in {time.perf_counter() - start:.1f} s")


def _load_gpu_capability():
    """``tests/support/gpu_capability.py`` (plain Python): the GPU types and the markers."""
    path = ROOT / "tests" / "support" / "gpu_capability.py"
    spec = importlib.util.spec_from_file_location("gpu_capability", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GPU = _load_gpu_capability()

_GPU_PROBE = """
import torch
if torch.cuda.is_available():
    major, minor = torch.cuda.get_device_capability()
    print(f"visible GPU: {major} {minor} {torch.cuda.get_device_name()}")
else:
    print("visible GPU: none")
"""


@nox.session(venv_backend="none")
@nox.parametrize("arch", list(GPU.GPU_ARCHS), ids=list(GPU.GPU_ARCHS))
def gpu(session: nox.Session, arch: str) -> None:
    """The `gpu` tests that one GPU type runs, with the GPU machine's own interpreter (no install).

    The interpreter running nox runs pytest, the workspace's sources on its path: nothing is
    installed and nothing is fetched.

    `hopper` (sm_90) runs every `gpu` test, `blackwell` (sm_100) all but those marked `hopper`
    (``tests/support/gpu_capability.py`` has the markers and what they need). First it asks the
    interpreter for the visible GPU; on one of another type it says which tests are deselected
    or will skip and why, then runs what that GPU can: a test marked for a capability the GPU
    lacks skips with the reason (root ``conftest.py``), in pytest's ``-ra`` summary."""
    source_dirs = [str(ROOT / "packages" / name / "src") for name in PACKAGES]
    env = {"PYTHONPATH": os.pathsep.join([*source_dirs, os.environ.get("PYTHONPATH", "")])}
    target = GPU.GPU_ARCHS[arch]
    probe = session.run(sys.executable, "-c", _GPU_PROBE, env=env, silent=True)
    if probe is None:  # --install-only: nothing to install here
        return
    found = re.search(r"^visible GPU: (\d+) (\d+) (.+)$", probe, re.M)
    if not found:
        session.error(f"no CUDA device visible to {sys.executable}: every gpu test would skip")
    capability, name = (int(found[1]), int(found[2])), found[3].strip()
    session.log(
        f"{name}, {GPU.sm(capability)}; gpu({arch}) is for {GPU.sm(target.capability)} and "
        f"runs pytest -m {target.marker_expression!r}"
    )
    if capability[0] != target.capability[0]:
        session.warn(
            f"this GPU is {GPU.sm(capability)}, not {arch} ({GPU.sm(target.capability)}): "
            "it runs what it can; what it leaves out follows"
        )
    own = [other for other, kind in GPU.GPU_ARCHS.items() if kind.capability[0] == capability[0]]
    for marker, requirement in GPU.CAPABILITY_MARKERS.items():
        unmet = GPU.unmet(marker, capability)
        if marker in target.deselect:
            note = (
                f"deselected: tests marked {marker!r}, which need {GPU.needs(marker)} "
                f"({requirement.why})"
            )
            if unmet is None and own:  # this GPU could run them
                session.warn(f'{note}; this GPU has it: nox -s "gpu({own[0]})" runs them')
            else:
                session.log(note)
        elif unmet is not None:
            session.warn(f"will skip: tests marked {marker!r}: {unmet}")
    session.run(
        sys.executable, "-m", "pytest", "-m", target.marker_expression, "packages", "tests",
        *session.posargs, env=env,
    )  # fmt: skip
