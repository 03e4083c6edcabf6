"""Loads a Triton kernel file compiled (CUDA) or interpreted (CPU tests).

Shared by the gem-kernels attention kernels and the gem-precision quantise kernels.

``triton.jit`` reads ``TRITON_INTERPRET`` when it decorates a function, so one kernel file cannot
serve both modes. Each ``_*_kernels.py`` file is therefore executed once per mode, under its own
module name, with the variable set for the duration of the import only.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

__all__ = ["interpret_requested", "load_kernel_module", "triton_importable"]

_LOADED: dict[tuple[Path, bool], ModuleType] = {}
# (path as the caller passed it, mode) -> module. Every kernel launch asks for its module, and
# resolving the path (a filesystem walk) cost about 40 us a call, more than many launches.
_BY_ARGUMENT: dict[tuple[str | Path, bool], ModuleType] = {}
_UNSET = object()


def _runtime_knobs():
    """``triton.knobs.runtime`` where this Triton has it (3.4+), else None."""
    try:
        from triton import knobs
    except ImportError:  # older Triton reads the environment only
        return None
    return getattr(knobs, "runtime", None)


def interpret_requested() -> bool:
    """Whether ``TRITON_INTERPRET`` asks for the Triton interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def triton_importable() -> bool:
    """Whether ``triton`` can be imported here."""
    try:
        import triton  # noqa: F401
    except Exception:  # pragma: no cover - depends on the environment
        return False
    return True


def load_kernel_module(path: str | Path, interpret: bool) -> ModuleType:
    """The kernel file at ``path`` decorated for ``interpret`` (cached per file and mode).

    The module is registered as ``<package>.<stem>_interpreted`` or ``..._compiled``, where
    ``<package>`` is the name of the folder holding the file.
    """
    module = _BY_ARGUMENT.get((path, interpret))
    if module is None:
        resolved = Path(path).resolve()
        module = _LOADED.get((resolved, interpret)) or _load(resolved, interpret)
        _LOADED[(resolved, interpret)] = module
        _BY_ARGUMENT[(path, interpret)] = module
    return module


def _load(path: Path, interpret: bool) -> ModuleType:
    name = f"{path.parent.name}.{path.stem}_{'interpreted' if interpret else 'compiled'}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    # Some imports (torch._dynamo) pin triton.knobs.runtime.interpret, which then wins over the
    # environment: pin it to this mode while decorating, then put it back.
    runtime_knobs = _runtime_knobs()
    pinned = runtime_knobs.__dict__.get("interpret", _UNSET) if runtime_knobs else _UNSET
    if runtime_knobs is not None:
        runtime_knobs.__dict__["interpret"] = interpret
    try:
        sys.modules[name] = module
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    finally:
        if runtime_knobs is not None:
            if pinned is _UNSET:
                runtime_knobs.__dict__.pop("interpret", None)
            else:
                runtime_knobs.__dict__["interpret"] = pinned
        if previous is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = previous
    return module
