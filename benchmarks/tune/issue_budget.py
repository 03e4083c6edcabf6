"""Instruction-issue budget of the attention key loops (bf16, FP8), compiled for sm_90 offline.

Why FP8 attention is not faster where its MMAs are twice as fast: per key tile, compare the
cycles the tile's MMAs need with the cycles its warps need to issue their other instructions.
Hopper issues one warp instruction per clock per SM sub-partition (four per SM), its dense
tensor cores retire 2048 bf16 or 4096 FP8 multiply-adds per clock per SM (989.4 / 1979 TFLOP/s
at 1.83 GHz over 132 SMs) and its special-function units 16 results (``MUFU``: exp2, log2,
reciprocal) per clock per SM. A loop whose issue (or MUFU) cycles exceed its MMA cycles is
bound by them, whatever the MMA precision: FP8 then speeds it up only by what it removes there.

Counts come from the SASS of each kernel's steady-state key loop (the innermost loop with MMAs
and the fewest instructions: the unmasked one), per thread per tile, at the tiles the kernels
run at D=128 on long samples. Nothing here is timed; the bound is a model (no stalls, one
program per SM; more programs per SM scale both sides alike).

    python benchmarks/tune/issue_budget.py --out benchmarks/results/cpu/tuning/issue_budget.json

Needs only Triton (the GPU machine's 3.6 gives its code; see ``compile_offline.py``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
from pathlib import Path

import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import compile_offline as co  # noqa: E402

MACS_PER_CLOCK = {"bf16": 2048, "fp8": 4096}  # dense, per SM (H100 / H200 SXM)
MUFU_PER_CLOCK = 16  # per SM
SUB_PARTITIONS = 4
MMA_OPCODES = ("HGMMA", "QGMMA")

_BF16_POINTERS = dict(co._FP8_POINTERS)  # "*": bf16
_FP8_POINTERS = co._e4m3("q_ptr", "k_ptr", "v_ptr")
_JFA = dict(co._JFA_FP8, HAS_RIGHT=False, BLOCK_M=128, BLOCK_N=128, ONE_LOOP=False)
_GDPA = dict(co._GDPA_FP8, BLOCK_M=128, BLOCK_N=64)
# bf16's d128_long forward loop: one loop, the next tile's Q K^T issued before the activation.
_GDPA_PIPELINED = dict(
    _GDPA, FP8=False, ONE_LOOP=True, PIPELINE=True, KV_TMA=False, WARP_SPECIALIZE=False
)

# name -> (kernel file, kernel, constexprs, pointer types, warps, stages, MMA precision[,
# GEMMs per tile: 2 for the forwards])
VARIANTS = {
    # JFA, full attention: the d128_long forward (128x128, 8 warps, 3 stages) in both modes.
    # (bf16 v is (T, H, D) contiguous: the launch passes stride_vd = 1, which Triton
    # specialises to a constant; the FP8 copy is tokens-contiguous, its head_dim stride large.)
    "jfa_fwd_bf16": (
        co._JFA, "jfa_fwd_kernel", dict(_JFA, FP8=False, stride_vd=1), _BF16_POINTERS, 8, 3, "bf16",
    ),
    "jfa_fwd_fp8": (co._JFA, "jfa_fwd_kernel", _JFA, _FP8_POINTERS, 8, 3, "fp8"),
    # The GEM model's windowed causal self-attention up to 1024 events (d128_short_masked:
    # 64x32, 4 warps, one loop whose masked tiles branch to the mask: both paths counted).
    "jfa_fwd_bf16_window": (
        co._JFA, "jfa_fwd_kernel",
        dict(_JFA, FP8=False, stride_vd=1, HAS_LEFT=True, HAS_RIGHT=True, BLOCK_M=64, BLOCK_N=32,
             ONE_LOOP=True),
        _BF16_POINTERS, 4, 3, "bf16",
    ),
    # GDPA self, gelu_fast: bf16's d128_long forward (pipelined one loop, packed f16x2
    # activation, 4 stages) and the phased loop FP8 mode runs; the bf16 phased loop (packed and
    # float32 activation) separates the loop's share from the activation's.
    "gdpa_fwd_bf16": (
        co._GDPA, "gdpa_fwd_kernel", dict(_GDPA_PIPELINED, PACKED=1), _BF16_POINTERS, 8, 4, "bf16",
    ),
    "gdpa_fwd_bf16_phased": (
        co._GDPA, "gdpa_fwd_kernel", dict(_GDPA, FP8=False, PACKED=1), _BF16_POINTERS, 8, 3, "bf16",
    ),
    "gdpa_fwd_bf16_phased_f32_act": (
        co._GDPA, "gdpa_fwd_kernel", dict(_GDPA, FP8=False), _BF16_POINTERS, 8, 3, "bf16",
    ),
    "gdpa_fwd_fp8": (co._GDPA, "gdpa_fwd_kernel", _GDPA, _FP8_POINTERS, 8, 3, "fp8"),
    # silu, the GEM model's GDPA activation (float32, no packed path).
    "gdpa_silu_fwd_bf16": (
        co._GDPA, "gdpa_fwd_kernel", dict(_GDPA_PIPELINED, ACT=0), _BF16_POINTERS, 8, 4, "bf16",
    ),
    "gdpa_silu_fwd_fp8": (
        co._GDPA, "gdpa_fwd_kernel", dict(_GDPA, ACT=0), _FP8_POINTERS, 8, 3, "fp8",
    ),
    # The same window's split backward (d128_short: dK/dV 64 keys x 32 queries, 4 GEMMs; dQ 64
    # queries x 32 keys, 3 GEMMs; 4 warps): phased loops, the masked ones in mma_loops.
    "jfa_dkdv_bf16_window": (
        co._JFA, "jfa_bwd_dkdv_kernel",
        dict(co._JFA_FP8, FP8=False, HAS_LEFT=True, BLOCK_M=32, BLOCK_N=64, DIAG_W=256,
             BUCKETS_PAD=16, FUSED_DQ=False),
        _BF16_POINTERS, 4, 3, "bf16", 4,
    ),
    "jfa_dq_bf16_window": (
        co._JFA, "jfa_bwd_dq_kernel",
        dict(co._JFA_FP8, FP8=False, HAS_LEFT=True, BLOCK_M=64, BLOCK_N=32),
        _BF16_POINTERS, 4, 3, "bf16", 3,
    ),
}  # fmt: skip

# Opcode families reported beside the total (the rest is addressing, loads, barriers, MMA).
FAMILIES = {
    "fp32": ("FFMA", "FMUL", "FADD", "FMNMX", "FSEL", "FSETP"),
    "f16x2": ("HFMA2", "HMUL2", "HADD2", "HMNMX2"),
    "mufu": ("MUFU",),
    "convert": ("F2FP", "F2F", "I2F", "F2I"),
}


def _family(opcode: str) -> str | None:
    base = opcode.split(".")[0]
    for family, names in FAMILIES.items():
        if base in names:
            return family
    return None


def budget(name: str) -> dict:
    path, kernel, constexprs, pointers, warps, stages, mma, *gemms = VARIANTS[name]
    compiled = co.compile_sm90(path, kernel, constexprs, pointers, warps, stages)
    loops = [
        mix for mix in compiled["innermost_loop_opcodes"]
        if any(op.startswith(MMA_OPCODES) for op in mix)
    ]  # fmt: skip
    steady = min(loops, key=lambda mix: sum(mix.values()))
    per_thread = sum(steady.values())
    block_m, block_n, dim = constexprs["BLOCK_M"], constexprs["BLOCK_N"], constexprs["BLOCK_D"]
    threads = 32 * warps
    scores = block_m * block_n
    families = {f: 0 for f in FAMILIES}
    for opcode, count in steady.items():
        family = _family(opcode)
        if family:
            families[family] += count
    issue = per_thread * warps / SUB_PARTITIONS
    mma_cycles = (gemms or [2])[0] * block_m * block_n * dim / MACS_PER_CLOCK[mma]
    mufu_cycles = families["mufu"] * threads / MUFU_PER_CLOCK
    cycles = {"issue": issue, "mma": mma_cycles, "mufu": mufu_cycles}
    return {
        "kernel": kernel,
        "mma": mma,
        "tile": f"{block_m}x{block_n}",
        "warps": warps,
        "stages": stages,
        "registers": compiled["registers"],
        "spills_in_innermost_loops": compiled["spills_in_innermost_loops"],
        "instructions_per_thread_per_tile": per_thread,
        # every innermost loop with MMAs (phased kernels: the masked ones too)
        "mma_loops_instructions_per_thread": [sum(mix.values()) for mix in loops],
        "instructions_per_score": round(per_thread * threads / scores, 2),
        "families_per_score": {f: round(c * threads / scores, 2) for f, c in families.items()},
        "issue_cycles_per_tile": issue,
        "mma_cycles_per_tile": mma_cycles,
        "mufu_cycles_per_tile": mufu_cycles,
        "bound": max(cycles, key=cycles.get),
        "steady_loop_opcodes": steady,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated")
    parser.add_argument("--out", type=Path, help="write the JSON here")
    args = parser.parse_args()
    rows = {}
    for name in args.variants.split(","):
        rows[name] = budget(name)
        row = rows[name]
        print(
            f"{name:32s} {row['tile']:8s} {row['instructions_per_thread_per_tile']:4d} instr/thread "
            f"({row['instructions_per_score']:5.2f}/score) issue {row['issue_cycles_per_tile']:6.0f} "
            f"MMA {row['mma_cycles_per_tile']:5.0f} MUFU {row['mufu_cycles_per_tile']:5.0f} cycles: "
            f"{row['bound']}-bound",
            flush=True,
        )  # fmt: skip

    # Predicted speed of each FP8 forward against its bf16 forward: the largest of the issue,
    # MMA and MUFU cycles per score (the loops overlap them at best).
    def cycles_per_score(row: dict) -> float:
        block_m, block_n = (int(x) for x in row["tile"].split("x"))
        slowest = max(row[f"{k}_cycles_per_tile"] for k in ("issue", "mma", "mufu"))
        return slowest / (block_m * block_n)

    predicted = {}
    for kind in ("jfa", "gdpa", "gdpa_silu"):
        fp8, bf16 = rows.get(f"{kind}_fwd_fp8"), rows.get(f"{kind}_fwd_bf16")
        if fp8 and bf16:
            predicted[kind] = round(cycles_per_score(bf16) / cycles_per_score(fp8), 3)
            print(f"{kind}: FP8 / bf16 forward speed, issue / MMA / MUFU bound: {predicted[kind]}x")
    if args.out:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=co.ROOT
        ).stdout.strip()
        meta = {
            "benchmark": "issue_budget",
            "triton": triton.__version__,
            "target": "sm_90 (offline)",
            "commit": commit,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": "python benchmarks/tune/issue_budget.py " + " ".join(sys.argv[1:]),
            "model": "per tile and SM: issue cycles = instructions x warps / 4 sub-partitions; "
            "MMA cycles = 2 x BLOCK_M x BLOCK_N x D / (2048 bf16 or 4096 FP8 MACs per clock); "
            "MUFU cycles = MUFU instructions x threads / 16",
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps({"meta": meta, "predicted_speedup": predicted, "rows": rows}, indent=1)
            + "\n"
        )


if __name__ == "__main__":
    main()
