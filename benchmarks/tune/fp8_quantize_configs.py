"""Tuning: time launch options of gem-precision's FP8 quantise kernels against the shipped ones.

Exploration, not a benchmark: it writes under ``benchmarks/results/<machine>/tuning/``. Every
option goes through the public API: an ``OperandKernelConfig`` variant (``--variant``, field
overrides of the shipped config) through ``quantize_operand(config=...)``, an
``MxKernelConfig`` (``--mx-variant``) through ``quantize_mx_triton(config=...)`` and the fused
norm's ``rows_per_program`` / ``num_warps`` (``--norm-variant``) through ``norm_quantize``.
Each variant is first checked bit for bit against the PyTorch reference (E4M3 and E5M2, inputs
with zeros, subnormals, NaN and Inf, whole and partial tiles; column sums within a float64
bound); one that fails is recorded and not timed. The shipped options (``default``) are timed
in the same run, first and again last (the spread is the run's drift).

    PYTHONPATH=benchmarks:packages/gem-kernels/src:packages/gem-precision/src \\
        python benchmarks/tune/fp8_quantize_configs.py --operands dy,dy_nobias \\
        --variant no_asm:run_asm_col_sum=false --variant w8:tile_warps_col_sum=8 \\
        --mx-variant 16x512x4 --norm-variant 2x8

Operands (M = 65536 rows of bfloat16 by default, K = ``--sizes``): ``dy`` both 1x128 layouts
with the column sums (an output gradient with its bias gradient), ``dy_nobias`` without them,
``xtiles`` rows plus 128x128 tiles of x.T (the default recipe's input), ``rows`` the row layout
alone, ``w`` 128x128 tiles (a weight). Bytes are those each kernel must move; ``pct_hbm`` is
of ``--hbm-gbps`` (the H200's measured copy rate). On a machine without a GPU, run it with
``TRITON_INTERPRET=1`` and small ``--rows`` / ``--sizes`` as a smoke test (CPU timings mean
nothing). What was measured and why the defaults are what they are:
``packages/gem-precision/docs/kernel-tuning.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gem_precision import (  # noqa: E402
    MxKernelConfig,
    OperandKernelConfig,
    norm_quantize,
    quantize_mx,
    quantize_mx_triton,
    quantize_operand,
)
from harness import (  # noqa: E402
    command_line,
    config_variant,
    median_ms,
    meta,
    tuning_path,
    write_results,
)

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
FIELDS = ("data", "scale", "data_t", "scale_t")

#: operand -> (quantize_operand keyword arguments, bytes moved per element of x: 2 read,
#: 1 per FP8 layout written, 4 per 128 elements for each layout's scales, 4 per 128 rows for
#: the column sums).
OPERANDS = {
    "dy": (dict(kind="1x128", col_sum=True), (4, 8 + 4)),
    "dy_nobias": (dict(kind="1x128"), (4, 8)),
    "xtiles": (dict(kind="1x128", col_tiles=True), (4, 4)),
    "rows": (dict(kind="1x128", cols=False), (3, 4)),
    "w": (dict(kind="128x128"), (4, 0)),
}


def parse_sizes(text: str, names: tuple[str, ...]) -> tuple[int, ...]:
    """``AxBxC`` -> ints (one per name)."""
    values = tuple(int(v) for v in text.split("x"))
    if len(values) != len(names):
        raise ValueError(f"expected {'x'.join(names)}, got {text!r}")
    return values


def special_input(rows: int, cols: int, device) -> torch.Tensor:
    """bfloat16 values over 80 binades with zeros, NaN, Inf and subnormal rows / columns."""
    gen = torch.Generator(device=device).manual_seed(3)
    x = torch.randn((rows, cols), generator=gen, device=device)
    x = x * torch.exp2(torch.randint(-40, 40, (rows, cols), generator=gen, device=device).float())
    x[0, : min(64, cols)] = 0
    x[1, 3] = float("nan")
    x[2, 5] = float("inf")
    x[3, :] = 1e-39
    x[:, 7] = -3e-42
    return x.to(torch.bfloat16)


def _same_bits(a, b) -> bool:
    if a is None or b is None:
        return a is b
    a, b = a.cpu(), b.cpu()
    if a.shape != b.shape:
        return False
    if a.dtype.itemsize == 1:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())


def check_operand(operand: str, config: OperandKernelConfig | None, smalls) -> bool:
    """Bit-exact against ``backend="torch"`` on every small input and FP8 format."""
    kwargs, _ = OPERANDS[operand]
    for x in smalls:
        finite = torch.nan_to_num(x.float(), nan=0.0, posinf=0.0, neginf=0.0).to(x.dtype)
        src = finite if kwargs.get("col_sum") else x
        for dtype in FP8:
            ref = quantize_operand(src.cpu(), dtype=dtype, backend="torch", **kwargs)
            got = quantize_operand(src, dtype=dtype, backend="triton", config=config, **kwargs)
            if not all(_same_bits(getattr(ref, f), getattr(got, f)) for f in FIELDS):
                return False
            if kwargs.get("col_sum"):
                want = src.double().sum(0)
                bound = 1e-6 * src.double().abs().sum(0) + 1e-3
                if not bool(((got.col_sum.double() - want).abs() <= bound).all()):
                    return False
    return True


def check_mx(config: MxKernelConfig, device) -> bool:
    # MX blocks need dims divisible by 32 (rows too, for 32x32 squares).
    for x in (special_input(384, 512, device), special_input(96, 320, device)):
        for square in (False, True):
            ref = quantize_mx(x.cpu(), square=square)
            got = quantize_mx_triton(x, square=square, config=config)
            if not (_same_bits(ref.data, got.data) and _same_bits(ref.scale, got.scale)):
                return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variant", action="append", default=[], help="NAME:FIELD=VALUE,...")
    parser.add_argument("--mx-variant", action="append", default=[], help="ROWSxCOLSxWARPS")
    parser.add_argument("--norm-variant", action="append", default=[], help="ROWSxWARPS")
    parser.add_argument("--operands", default="dy,dy_nobias,xtiles,rows,w")
    parser.add_argument("--rows", type=int, default=65536, help="M")
    parser.add_argument("--sizes", default="4096", help="comma-separated K")
    parser.add_argument("--hbm-gbps", type=float, default=4270.0)
    parser.add_argument("--machine", default="h200")
    parser.add_argument(
        "--out", default="", help="default: <machine>/tuning/fp8_quantize_configs.json"
    )
    args = parser.parse_args()
    try:
        variants = dict(config_variant(text, OperandKernelConfig()) for text in args.variant)
        mx_shape = ("ROWS", "COLS", "WARPS")
        mx_variants = [MxKernelConfig(*parse_sizes(t, mx_shape)) for t in args.mx_variant]
        norm_variants = [parse_sizes(t, ("ROWS", "WARPS")) for t in args.norm_variant]
        operands = [o for o in args.operands.split(",") if o]
        unknown = sorted(set(operands) - set(OPERANDS))
        if unknown:
            raise ValueError(f"unknown --operands {unknown}; known: {sorted(OPERANDS)}")
    except (TypeError, ValueError) as error:
        parser.error(str(error))
    if torch.cuda.is_available():
        device = torch.device("cuda")
        device_name = torch.cuda.get_device_name()
    elif os.environ.get("TRITON_INTERPRET") == "1":
        device, device_name = torch.device("cpu"), "cpu (Triton interpreter, smoke run)"
    else:
        raise SystemExit("needs a CUDA device (or TRITON_INTERPRET=1 for a CPU smoke run)")
    out = Path(args.out) if args.out else tuning_path(args.machine, "fp8_quantize_configs.json")
    sizes = [int(k) for k in args.sizes.split(",")]
    smalls = [special_input(384, 512, device), special_input(200, 300, device)]
    rows, checks, start = [], {}, time.time()

    def write() -> None:
        block = meta(
            "fp8_quantize_configs",
            command_line("benchmarks/tune/fp8_quantize_configs.py"),
            device=device_name,
            m=args.rows,
            dtype="bfloat16",
            hbm_gbps_reference=args.hbm_gbps,
            default=dataclasses.asdict(OperandKernelConfig()),
            variants={name: dataclasses.asdict(c) for name, c in variants.items()},
            checks=checks,
            wall_s=round(time.time() - start, 1),
        )
        write_results(out, block, rows)

    def row(case, provider, ms, nbytes) -> None:
        gbps = nbytes / ms / 1e6
        for metric, value in (("ms", ms), ("gbps", gbps), ("pct_hbm", 100 * gbps / args.hbm_gbps)):
            rows.append({"case": case, "provider": provider, "mode": "quantize",
                         "metric": metric, "value": round(value, 4)})  # fmt: skip
        print(f"{case:28s} {provider:24s} {ms:8.4f} ms {100 * gbps / args.hbm_gbps:6.1f}% of HBM")

    gen = torch.Generator(device=device).manual_seed(17)
    inputs = {
        k: torch.randn(args.rows, k, generator=gen, device=device, dtype=torch.bfloat16)
        for k in sizes
    }
    # The shipped options first and last: None runs the operator, as every caller does.
    timed = [("default", None), *variants.items(), ("default_again", None)]
    for operand in operands:
        kwargs, (per_elem, per_block) = OPERANDS[operand]
        for name, config in timed:
            key = f"{operand}/{name}"
            if name != "default_again":
                try:
                    checks[key] = check_operand(operand, config, smalls)
                except Exception as error:  # noqa: BLE001 - a variant that fails is recorded
                    checks[key] = f"error: {str(error).splitlines()[0][:200]}"
                if checks[key] is not True:
                    print(f"{key}: not bit-exact, not timed ({checks[key]})")
                    continue
            for k, x in inputs.items():

                def call(x=x, c=config, kw=kwargs):
                    return quantize_operand(x, config=c, **kw)

                ms = median_ms(call, warmup=25, rep=100)
                nbytes = per_elem * x.numel() + per_block * x.numel() // 128
                row(f"M{args.rows}xK{k}/{operand}", f"gem-{name}", ms, nbytes)
            write()
    x = inputs[sizes[0]]
    elems = x.numel()
    for config in [MxKernelConfig(), *mx_variants]:
        name = f"mx_{config.block_rows}x{config.block_cols}_w{config.num_warps}"
        checks[name] = check_mx(config, device)
        if checks[name]:
            ms = median_ms(lambda c=config: quantize_mx_triton(x, config=c), warmup=25, rep=100)
            row(f"M{args.rows}xK{sizes[0]}/mx_1x32", f"gem-{name}", ms, 3 * elems + elems // 32)
    if x.shape[1] % 128 == 0:
        w = torch.rand(x.shape[1], generator=gen, device=device, dtype=torch.bfloat16) + 0.5
        for rows_per_program, warps in [(None, None), *norm_variants]:
            name = "norm_default" if warps is None else f"norm_r{rows_per_program}_w{warps}"

            def call(r=rows_per_program, nw=warps):
                return norm_quantize(x, w, rows_per_program=r, num_warps=nw)

            # The launch options do not change the results (each row is normalised and
            # scaled on its own): only timed.
            ms = median_ms(call, warmup=25, rep=100)
            nbytes = 3 * elems + 4 * elems // 128
            row(f"M{args.rows}xK{sizes[0]}/rmsnorm_quant", f"gem-{name}", ms, nbytes)
    write()
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
