"""Compile the project's Triton kernels for Hopper (sm_90) on a machine without a GPU.

Registers, spills, shared memory, SASS instruction counts and the TTGIR's layout conversions of a
kernel, without device time: Triton lowers to PTX and runs its bundled ``ptxas`` offline. With the
Triton the GPU machine runs (3.6: ``pip install triton==3.6.0`` into a spare venv, no torch
needed) the numbers match the H200's (checked 2026-12-01: the dy quantise kernel's 211 registers
and 13 barriers, the GDPA fused backward's 255 registers, 8-byte stack and 196,608 bytes of
shared memory); other Triton versions generate different code.

    python benchmarks/compile_offline.py dy            # the dy quantise tile kernel (4 warps)
    python benchmarks/compile_offline.py gdpa_dkdv     # GDPA's fused dK/dV/dQ backward
    python benchmarks/compile_offline.py mx_dequant    # MX (1x32, E4M3) -> bfloat16
    python benchmarks/compile_offline.py jfa_fwd_fp8  # JFA's FP8 forward (also gdpa_*)
    python benchmarks/compile_offline.py swiglu_bwd    # SwiGLU's gradient
    python benchmarks/compile_offline.py dy --warps 8 --set COLSUM=False

Spills inside an inner loop cost every iteration: ``spills_in_innermost_loops`` counts them
(``loops`` and ``spill_lines`` are SASS line numbers; a persistent kernel's item loop holds
everything else).
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import re
import subprocess
import sys
import tempfile
import types
from collections import Counter
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

ROOT = Path(__file__).resolve().parents[1]
_BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"

# name -> (kernel file, kernel, constexprs, pointer element types, warps, stages)
PRESETS = {
    "dy": (
        "packages/gem-precision/src/gem_precision/_quant_kernels.py",
        "blockwise_tile_kernel",
        dict(
            EMAX=8,
            MAX_NORMAL=448.0,
            MBITS=3,
            BIAS=7,
            SOFT=False,
            MIN_EXP=-127,
            MAX_EXP=127,
            ROW=True,
            COL=True,
            FIXED=False,
            COL_TILE=False,
            NORM=False,
            HAS_MEAN=False,
            HAS_W=False,
            HAS_B=False,
            BF16_BITS=False,
            COLSUM=True,
            EVEN=True,
            BLOCK_R=128,
            BLOCK=128,
            T_RUN=4,
            PREFETCH=165,
            RUN_ASM=True,
        ),  # fmt: skip
        {"x_ptr": "bf16", "q_ptr": "fp8e4nv", "qt_ptr": "i32"},
        4,
        3,
    ),
    "mx_dequant": (
        "packages/gem-precision/src/gem_precision/_quant_kernels.py",
        "mx_dequantize_kernel",
        dict(
            MBITS=3,
            BIAS=7,
            E4M3FN=True,
            SOFT=False,
            SQUARE=False,
            BS=32,
            BF16_BITS=False,
            BLOCK_R=8,
            BLOCK_C=1024,
        ),  # fmt: skip
        {"q_ptr": "fp8e4nv", "s_ptr": "u8", "out_ptr": "bf16"},
        4,
        3,
    ),
    "gdpa_dkdv": (
        "packages/gem-kernels/src/gem_kernels/_gdpa_kernels.py",
        "gdpa_bwd_dkdv_kernel",
        dict(
            HEAD_DIM=128,
            BLOCK_M=64,
            BLOCK_N=128,
            BLOCK_D=128,
            ACT=3,
            HAS_LEFT=False,
            HAS_RIGHT=False,
            NORMALIZE=False,
            DOT_PRECISION="tf32",
            UPCAST=False,
            PACKED=1,
            ONE_LOOP=True,
            FUSED_DQ=True,
        ),  # fmt: skip
        {"items_ptr": "i64", "dkp_ptr": "fp32", "dvp_ptr": "fp32", "dq_ptr": "fp32", "*": "bf16"},
        8,
        3,
    ),
}

# The FP8 attention forwards (precision="fp8") at the tiles their default configurations give:
# operands in E4M3 (V stored K-major), per-token float32 scales. (Their backward is bf16.)
_JFA = "packages/gem-kernels/src/gem_kernels/_jfa_kernels.py"
_GDPA = "packages/gem-kernels/src/gem_kernels/_gdpa_kernels.py"
_FP8_POINTERS = {
    "tiles_ptr": "i32", "items_ptr": "i64", "lse_ptr": "fp32", "delta_ptr": "fp32",
    "rs_ptr": "fp32", "rel_partial_ptr": "fp32", "part_ptr": "fp32", "dkp_ptr": "fp32",
    "dvp_ptr": "fp32", "qs_ptr": "fp32", "ks_ptr": "fp32", "vs_ptr": "fp32",
    "*": "bf16",
}  # fmt: skip
_JFA_FP8 = dict(
    HEAD_DIM=128, BLOCK_D=128, HAS_LEFT=False, HAS_RIGHT=True, HAS_REL=False, HAS_JAGGED=False,
    DOT_PRECISION="ieee", UPCAST=False, STRIP_P=0, STRIP_W=1, FP8=True,
)  # fmt: skip
_GDPA_FP8 = dict(
    HEAD_DIM=128, BLOCK_D=128, ACT=3, HAS_LEFT=False, HAS_RIGHT=False, NORMALIZE=False,
    DOT_PRECISION="ieee", UPCAST=False, PACKED=0, ONE_LOOP=False, FP8=True,
)  # fmt: skip


# bf16 silu, the GEM model's GDPA activation: the FP8 presets' constexprs without the ones
# only the self/cross kernels take; pointers as theirs, with the streamed PMA's step lists
# and the fused backward's float32 dQ.
_GDPA_SILU = {k: v for k, v in _GDPA_FP8.items() if k not in ("PACKED", "ONE_LOOP", "FP8")}
_GDPA_SILU |= {"ACT": 0, "DOT_PRECISION": "tf32"}  # as the launches pass for 16-bit inputs
_GDPA_SILU_PTRS = dict(_FP8_POINTERS, steps_ptr="i64", bounds_ptr="i64", dq_ptr="fp32")


def _e4m3(*names: str) -> dict:
    return dict(_FP8_POINTERS, **dict.fromkeys(names, "fp8e4nv"))


PRESETS |= {
    "jfa_fwd_fp8": (
        _JFA, "jfa_fwd_kernel", dict(_JFA_FP8, BLOCK_M=128, BLOCK_N=128, ONE_LOOP=True),
        _e4m3("q_ptr", "k_ptr", "v_ptr"), 8, 3,
    ),
    "gdpa_fwd_fp8": (
        _GDPA, "gdpa_fwd_kernel", dict(_GDPA_FP8, BLOCK_M=128, BLOCK_N=64),
        _e4m3("q_ptr", "k_ptr", "v_ptr"), 8, 3,
    ),
    # silu, the GEM model's GDPA activation: its cross-attention over the feature tokens (the
    # short-KV forward), its PMA (the streamed forward) and the fused backward.
    "gdpa_short_kv_silu": (
        _GDPA, "gdpa_fwd_short_kv_kernel",
        dict(_GDPA_SILU, BLOCK_M=128, BLOCK_KV=256, PACKED=0, MASK_FREE=True), _GDPA_SILU_PTRS, 8, 2,
    ),
    "gdpa_pma_silu": (
        _GDPA, "gdpa_pma_fwd_stream_kernel",
        dict({k: v for k, v in _GDPA_SILU.items() if not k.startswith("HAS_")}, NORMALIZE=True,
             BLOCK_M=32, BLOCK_N=128),
        _GDPA_SILU_PTRS, 4, 2,
    ),
    "gdpa_dkdv_silu": (
        _GDPA, "gdpa_bwd_dkdv_kernel",
        dict(_GDPA_SILU, BLOCK_M=64, BLOCK_N=128, PACKED=0, ONE_LOOP=True, FUSED_DQ=True),
        _GDPA_SILU_PTRS, 8, 3,
    ),
    "swiglu_bwd": (
        "packages/gem-kernels/src/gem_kernels/_swiglu_kernels.py", "swiglu_bwd_kernel",
        dict(BLOCK_R=8, BLOCK_C=512, HAS_BIAS=True), {"*": "bf16"}, 4, 1,
    ),
}  # fmt: skip


def _load_module(path: Path) -> types.ModuleType:
    """The kernel file as a module. gem-kernels' kernels import one constant from its reference
    module, which imports torch: it is read from the source instead, so no torch is needed
    (the torch-free ``triton_loader`` is imported as it is)."""
    if "gem_kernels.reference" not in sys.modules and "gem_kernels" in path.parts:
        source = (path.parent / "reference.py").read_text()
        found = re.search(r"_GELU_FAST_COEFFS\s*=\s*(\([^)]*\))", source, re.S)
        stub = types.ModuleType("gem_kernels.reference")
        stub._GELU_FAST_COEFFS = ast.literal_eval(found.group(1))
        # A bare package (its __init__ imports torch) whose torch-free submodules, such as
        # triton_loader, still import from the source folder.
        package = types.ModuleType("gem_kernels")
        package.__path__ = [str(path.parent)]
        sys.modules.setdefault("gem_kernels", package)
        sys.modules["gem_kernels.reference"] = stub
    spec = importlib.util.spec_from_file_location(f"offline_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


FLOAT_ARGS = ("scale", "qk_scale", "eps")
# A SASS line's opcode, after its address and an optional predicate (@P0, @!UP1).
_OPCODE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")


def compile_sm90(path, kernel, constexprs, pointer_types, warps, stages) -> dict:
    """Compile ``kernel`` of ``path`` for sm_90 and summarise the result. Pointer arguments
    (``*_ptr``) take ``pointer_types`` (``"*"``: the default, else fp32), :data:`FLOAT_ARGS`
    are fp32, other runtime arguments i32; pointers and strides (except the kernel's
    ``do_not_specialize`` ones) are marked 16-divisible, as the launches specialise them. A
    stride a launch passes as 1 (which Triton specialises to the constant) is not modelled:
    the compile then sees a strided operand."""
    fn = getattr(_load_module(ROOT / path), kernel)
    names = fn.arg_names
    # A constexpr left out would be compiled as a runtime argument: take its default or refuse.
    constexprs = dict(constexprs)
    for param in fn.params:
        if param.is_constexpr and param.name not in constexprs:
            if not param.has_default:
                raise ValueError(f"constexprs: {kernel} needs a value for {param.name}")
            constexprs[param.name] = param.default
    signature = {}
    for name in names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = "*" + pointer_types.get(name, pointer_types.get("*", "fp32"))
        else:
            signature[name] = "fp32" if name in FLOAT_ARGS else "i32"
    unhinted = set(getattr(fn, "do_not_specialize", None) or ())
    hinted = [
        i
        for i, n in enumerate(names)
        if (n.endswith("_ptr") or n.startswith("stride"))
        and n not in unhinted
        and i not in unhinted
    ]
    hinted += [i for i, n in enumerate(names) if n in ("R", "C")]  # the quantise kernels' shape
    source = ASTSource(
        fn,
        signature,
        constexprs={(names.index(k),): v for k, v in constexprs.items()},
        attrs={(i,): [["tt.divisibility", 16]] for i in hinted},
    )
    compiled = triton.compile(
        source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages}
    )
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = _run("cuobjdump", "--dump-resource-usage", cubin.name)
        sass = _run("cuobjdump", "--dump-sass", cubin.name)
    lines = sass.splitlines()
    counts = {
        key: sum(bool(re.search(pattern, line)) for line in lines)
        for key, pattern in {
            "BAR.SYNC": r"\bBAR\.SYNC", "STS": r"\bSTS\b", "LDS": r"\bLDS\b", "SHFL": r"\bSHFL",
            "HGMMA": r"\bHGMMA", "QGMMA": r"\bQGMMA", "HMMA": r"\bHMMA", "LDG": r"\bLDG", "STG": r"\bSTG", "STL/LDL": r"\b(STL|LDL)\b",
            # byte-wide global loads (an operand the compiler cannot vectorise) and the 16-byte
            # asynchronous copies to shared memory that pipelined tiles use
            "LDG.U8": r"\bLDG\.E\.U8\b", "LDGSTS.128": r"\bLDGSTS\.E(\.BYPASS)?\.128\b",
        }.items()
    }  # fmt: skip
    address = {}  # SASS address -> line number
    for i, line in enumerate(lines):
        here = re.search(r"/\*([0-9a-f]{4,})\*/", line)
        if here:
            address[int(here.group(1), 16)] = i
    loops = []  # (first line, back-edge line) of every backward branch
    for i, line in enumerate(lines):
        target = re.search(r"\bBRA\s+(0x[0-9a-f]+)", line)
        if target and address.get(int(target.group(1), 16), i) < i:
            loops.append((address[int(target.group(1), 16)], i))
    spills = [i for i, ln in enumerate(lines) if re.search(r"\b(STL|LDL)\b", ln)]
    innermost = [
        (a, b)
        for a, b in loops
        if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in loops)
    ]
    # The opcode mix of each innermost loop (its steady state: what one key tile costs).
    loop_opcodes = [
        dict(
            sorted(
                Counter(
                    found.group(1) for ln in lines[a : b + 1] if (found := _OPCODE.search(ln))
                ).items()
            )
        )
        for a, b in innermost
    ]
    return {
        "kernel": kernel,
        "triton": triton.__version__,
        "warps": warps,
        "stages": stages,
        "registers": int(re.search(r"REG:(\d+)", usage).group(1)),
        "stack_bytes": int(re.search(r"STACK:(\d+)", usage).group(1)),
        "shared_bytes": compiled.metadata.shared,
        "sass_instructions": sum(bool(re.search(r"/\*[0-9a-f]{4,}\*/", ln)) for ln in lines),
        **counts,
        "loops": loops,
        "spill_lines": spills,
        "spills_in_innermost_loops": sum(any(a <= i <= b for a, b in innermost) for i in spills),
        "layout_conversions": compiled.asm["ttgir"].count("ttg.convert_layout"),
        "innermost_loop_opcodes": loop_opcodes,
    }


def _run(tool: str, *args: str) -> str:
    return subprocess.run(
        [str(_BIN / tool), *args], capture_output=True, text=True, check=True
    ).stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("preset", choices=sorted(PRESETS))
    parser.add_argument("--warps", type=int, help="num_warps (default: the preset's)")
    parser.add_argument("--stages", type=int, help="num_stages (default: the preset's)")
    parser.add_argument(
        "--set", action="append", default=[], metavar="NAME=VALUE",
        help="override a constexpr (Python literal), e.g. COLSUM=False",
    )  # fmt: skip
    args = parser.parse_args()
    path, kernel, constexprs, pointer_types, warps, stages = PRESETS[args.preset]
    constexprs = dict(constexprs)
    for item in args.set:
        name, _, value = item.partition("=")
        if name not in constexprs:
            raise SystemExit(
                f"--set: {name!r} is not a constexpr of the preset ({sorted(constexprs)})"
            )
        constexprs[name] = ast.literal_eval(value)
    result = compile_sm90(
        path, kernel, constexprs, pointer_types, args.warps or warps, args.stages or stages
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
