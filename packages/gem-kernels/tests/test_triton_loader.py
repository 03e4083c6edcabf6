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


KERNEL_FILES = sorted((Path(triton_loader.__file__).parent).glob("_*_kernels.py"))

#: Arguments that hold a batch's token, row, sample or work-item count (or a stride equal to
#: such a count): never specialised.
PER_BATCH = {
    "num_tokens",
    "num_rows",
    "num_q_rows",
    "num_items",
    "num_samples",
    "q_rows",
    "k_rows",
    "stride_lse_h",
    "stride_delta_h",
    "stride_jb_h",
}


def test_the_kernel_files_are_found():
    names = {path.name for path in KERNEL_FILES}
    assert {"_rope_kernels.py", "_swiglu_kernels.py", "_jfa_kernels.py"} <= names


@pytest.mark.parametrize("path", KERNEL_FILES, ids=lambda p: p.stem)
def test_per_batch_arguments_are_not_specialised(path):
    """Kernel arguments that change with every batch are not specialised on.

    Triton compiles one variant per value class of an unmarked integer argument (divisible by 16
    or not, equal to 1). A token count is a multiple of 16 in about one batch of 16, so a kernel
    specialised on it compiled a second variant at such a batch, tens of steps into training: on
    the H200 the RoPE and SwiGLU kernels stalled the h200 recipe's step for about 1.1 s there (a
    10-step timing's mean went from about 160 to 274 ms). These arguments only bound masks and
    loops, where specialising buys nothing.
    """
    # Imported here: collecting a module that imports triton would load triton.language in
    # compiled mode before the interpreter tests of the files that sort before this one.
    from triton.runtime.jit import JITFunction

    module = triton_loader.load_kernel_module(path, interpret=False)
    kernels = {
        name: fn
        for name, fn in vars(module).items()
        if isinstance(fn, JITFunction) and name.endswith("_kernel")
    }
    assert kernels, f"no @triton.jit kernels in {path.name}"
    specialised = [
        f"{name}({param.name})"
        for name, fn in kernels.items()
        for param in fn.params
        if param.name in PER_BATCH and not param.do_not_specialize
    ]
    assert not specialised, f"specialised on a per-batch count: {specialised}"
