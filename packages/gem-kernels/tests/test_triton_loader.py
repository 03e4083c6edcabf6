"""The kernel-file loader: one module per file and mode, and no filesystem work once loaded."""

from __future__ import annotations

from pathlib import Path

import gem_kernels
import pytest
from gem_kernels import triton_loader

KERNEL_FILE = Path(gem_kernels.__file__).with_name("_block_kernels.py")


def test_each_spelling_of_a_file_gets_the_same_module_per_mode():
    interpreted = triton_loader.load_kernel_module(KERNEL_FILE, interpret=True)
    assert triton_loader.load_kernel_module(str(KERNEL_FILE), interpret=True) is interpreted
    relative = Path(gem_kernels.__file__).parent / ".." / "gem_kernels" / KERNEL_FILE.name
    assert triton_loader.load_kernel_module(relative, interpret=True) is interpreted
    compiled = triton_loader.load_kernel_module(KERNEL_FILE, interpret=False)
    assert compiled is not interpreted
    assert interpreted.__name__ == "gem_kernels._block_kernels_interpreted"
    assert compiled.__name__ == "gem_kernels._block_kernels_compiled"


def test_a_loaded_file_is_returned_without_resolving_its_path(monkeypatch):
    # Every kernel launch asks for its module: the hot path must not touch the filesystem.
    module = triton_loader.load_kernel_module(KERNEL_FILE, interpret=True)

    def no_resolve(self, strict=False):
        raise AssertionError("Path.resolve called on the hot path")

    monkeypatch.setattr(Path, "resolve", no_resolve)
    assert triton_loader.load_kernel_module(KERNEL_FILE, interpret=True) is module
    with pytest.raises(AssertionError, match="hot path"):
        triton_loader.load_kernel_module(Path(str(KERNEL_FILE) + "x"), interpret=True)
