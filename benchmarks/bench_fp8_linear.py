"""FP8 linear (gem-precision) against bf16 ``nn.Linear`` on one GPU, plus quantise-kernel bandwidth.

Protocol (shared/BENCHMARKS.md): M=65536 tokens, (K, N) in {(4096, 4096), (8192, 8192),
(512, 512), (256, 1024)}, bf16 inputs and weights, forward+backward (input, weight and bias
gradients) with the quantisation of every operand included, ``triton.testing.do_bench``
medians, all providers in the same run. TFLOP/s count ``6 * M * K * N`` per forward+backward.

Providers (mode ``fwd_bwd``):

* ``bf16_linear``: ``torch.nn.Linear`` in bf16 (cuBLAS);
* ``gem``: what gem-precision's default ``PrecisionPolicy`` makes of that ``nn.Linear``
  (``convert_to_fp8``): ``Fp8Linear`` where FP8 pays, the untouched bf16 layer on small shapes
  (metric ``uses_fp8`` says which);
* ``gem-fp8``: ``Fp8Linear`` forced (default recipe: 1x128 activations / gradients, 128x128
  weights, power-of-two scales, blockwise ``torch._scaled_mm``);
* ``gem-fp8-tensorwise``, ``gem-fp8-wgrad_bf16``, ``gem-fp8-wgrad_1x128``, ``gem-fp8-rht``
  (random Hadamard transform; opt-in with ``--providers``): recipe variants;
* ``gem-norm`` vs ``bf16_norm_linear`` (case suffix ``/rmsnorm``): ``Fp8NormLinear``
  (RMSNorm fused into the FP8 quantisation) against ``nn.RMSNorm`` + ``nn.Linear`` in bf16.

Kernel bandwidth (mode ``quantize``, metrics ``ms``, ``gbps``, ``pct_hbm`` of 4.27 TB/s, the
measured device-to-device copy rate): MXFP8 1x32 and 32x32 quantise and 1x32 dequantise, the
1x128 operand kernel (both layouts of x in one pass, and rows only), the fused RMSNorm ->
quantise kernel, and ``torch_copy`` (a bf16 clone) as the yardstick. Bytes are those each
kernel must move (input read once, outputs written once).

    PYTHONPATH=packages/gem-kernels/src:packages/gem-precision/src python benchmarks/bench_fp8_linear.py \
        --out benchmarks/results/h200/fp8_linear.json

Every linear provider is timed in two rounds (the faster median counts): run once, each after
the bf16 run, the policy's ``gem`` (the very same bf16 ``nn.Linear`` at the small shapes)
showed 0.67x / 0.77x there.

``--only-kernels NAMES`` runs just those bandwidth rows and ``--merge`` replaces only them in an
existing ``--out`` file.

``--check`` first compares the GPU kernels bit for bit with the PyTorch references and the
native scaled GEMMs with the emulation.

Everything runs through gem-precision's public API with its shipped launch options (recorded
in ``meta.kernel_options``). Other launch options are explored by
``benchmarks/tune/fp8_quantize_configs.py``, which writes under ``results/<machine>/tuning/``.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
import traceback
from functools import partial
from pathlib import Path

import torch
from harness import ROOT, median_ms, meta, require_cuda, results_parser, write_results  # noqa: E402
from torch import nn

sys.path.insert(0, str(ROOT / "packages" / "gem-precision" / "src"))

from gem_precision import (  # noqa: E402
    Fp8Linear,
    Fp8NormLinear,
    Fp8Recipe,
    MxKernelConfig,
    OperandKernelConfig,
    PrecisionPolicy,
    convert_to_fp8,
    dequantize_mx,
    dequantize_mx_triton,
    norm_quantize,
    quantize_mx,
    quantize_mx_triton,
    quantize_operand,
    scaled_mm_nt,
)

M = 65536
SHAPES = [(4096, 4096), (8192, 8192), (512, 512), (256, 1024)]
HBM_GBPS = 4270.0
ROUNDS = 2
DTYPE = torch.bfloat16


def _bench(fn, rep=100) -> float:
    return median_ms(fn, warmup=25, rep=rep)


def _row(rows, case, provider, mode, metric, value):
    rows.append(
        {"case": case, "provider": provider, "mode": mode, "metric": metric, "value": value}
    )


# ---------------------------------------------------------------------------------------------
# Correctness on the GPU (bit-exact kernels, native GEMMs against the emulation).


def _with_cpu_copy(module, make_cpu_module, xs, dy):
    """Forward+backward of ``module`` on a leaf copy of ``xs``, then of ``make_cpu_module()``
    (loaded with ``module``'s state in float32) on a float32 CPU copy: ``(out, x_leaf,
    cpu_module, cpu_out, cpu_x_leaf)``."""
    xg = xs.detach().clone().requires_grad_(True)
    out = module(xg)
    out.backward(dy)
    cpu_module = make_cpu_module()
    cpu_module.load_state_dict({key: v.float().cpu() for key, v in module.state_dict().items()})
    xc = xs.detach().float().cpu().clone().requires_grad_(True)
    out_c = cpu_module(xc)
    out_c.backward(dy.float().cpu())
    return out, xg, cpu_module, out_c, xc


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape:
        return False
    if a.dtype.itemsize == 1:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    both_nan = torch.isnan(a) & torch.isnan(b)
    return bool(((a == b) | both_nan).all())


def _special_input(shape, device):
    gen = torch.Generator(device=device).manual_seed(3)
    x = torch.randn(shape, generator=gen, device=device)
    x = x * torch.exp2(torch.randint(-40, 40, shape, generator=gen, device=device).float())
    x[0, :64] = 0
    x[1, 3] = float("nan")
    x[2, 5] = float("inf")
    x[3, :] = 1e-39  # bf16 / fp32 subnormals
    x[:, 7] = -3e-42
    return x.to(DTYPE)


def check(device) -> dict:
    results = {}
    x = _special_input((384, 512), device)
    for square in (False, True):
        for rounding in ("floor", "ceil"):
            for dt in (torch.float8_e4m3fn, torch.float8_e5m2):
                name = f"mx_{'32x32' if square else '1x32'}_{rounding}_{str(dt)[-6:]}"
                ref = quantize_mx(x.cpu(), elem_dtype=dt, scale_rounding=rounding, square=square)
                got = quantize_mx_triton(x, elem_dtype=dt, scale_rounding=rounding, square=square)
                ok = _same_bits(ref.data, got.data.cpu()) and _same_bits(ref.scale, got.scale.cpu())
                deq_ok = _same_bits(dequantize_mx(ref), dequantize_mx_triton(got).cpu())
                results[name] = bool(ok and deq_ok)
    x_fin = torch.nan_to_num(x, nan=0.0, posinf=1.0)
    ragged = _special_input((200, 300), device)  # partial tiles: the masked kernel paths
    for dt in (torch.float8_e4m3fn, torch.float8_e5m2):
        for name, src in (("", x), ("_ragged", ragged)):
            for tiles in (False, True):
                ref = quantize_operand(src.cpu(), "1x128", dt, backend="torch", col_tiles=tiles)
                got = quantize_operand(src, "1x128", dt, backend="triton", col_tiles=tiles)
                tag = f"operand_1x128{'_coltiles' if tiles else ''}{name}_{str(dt)[-6:]}"
                results[tag] = all(
                    _same_bits(getattr(ref, f), getattr(got, f).cpu())
                    for f in ("data", "scale", "data_t", "scale_t")
                )
    for kind in ("1x128", "128x128", "tensorwise"):
        for dt in (torch.float8_e4m3fn, torch.float8_e5m2):
            src = x if kind != "tensorwise" else x_fin
            ref = quantize_operand(src.cpu(), kind, dt, backend="torch")
            got = quantize_operand(src, kind, dt, backend="triton")
            ok = all(
                _same_bits(getattr(ref, f), getattr(got, f).cpu())
                for f in ("data", "scale", "data_t", "scale_t")
            )
            results[f"operand_{kind}_{str(dt)[-6:]}"] = bool(ok)
    # Native scaled GEMMs against the emulation, for the three GEMM layouts of a linear layer.
    gen = torch.Generator(device=device).manual_seed(5)
    m, k, n = 1024, 1024, 512
    xs = torch.randn(m, k, generator=gen, device=device, dtype=DTYPE)
    ws = torch.randn(n, k, generator=gen, device=device, dtype=DTYPE) * 0.02
    dy = torch.randn(m, n, generator=gen, device=device, dtype=DTYPE)
    for act, wk in (("1x128", "128x128"), ("tensorwise", "tensorwise")):
        xq = quantize_operand(xs, act)
        xtq = quantize_operand(xs, act, col_tiles=act == "1x128")
        wq = quantize_operand(ws, wk)
        gq = quantize_operand(dy, act)
        for name, args in (
            ("fwd", (xq.data, xq.scale, act, wq.data, wq.scale, wk)),
            ("dgrad", (gq.data, gq.scale, act, wq.data_t, wq.scale_t, wk)),
            ("wgrad", (gq.data_t, gq.scale_t, act, xq.data_t, xq.scale_t, act)),
            (
                "wgrad_xtiles",
                (gq.data_t, gq.scale_t, act, xtq.data_t, xtq.scale_t, xtq.kind_t or act),
            ),
        ):
            emu = scaled_mm_nt(*args, out_dtype=torch.float32, native=False)
            nat = scaled_mm_nt(*args, out_dtype=torch.bfloat16, native=True).float()
            err = float((nat - emu).norm() / emu.norm())
            results[f"scaled_mm_{act}_{name}_rel_err"] = err
    # Fp8Linear / Fp8NormLinear end to end on the GPU against their CPU emulation.
    lin = Fp8Linear(k, n, device=device, dtype=DTYPE)
    cpu_copy = partial(Fp8Linear, k, n, dtype=torch.float32)
    out, xg, lin_cpu, out_c, xc = _with_cpu_copy(lin, cpu_copy, xs, dy)
    rel = lambda a, b: float((a.float().cpu() - b).norm() / b.norm())  # noqa: E731
    results["fp8_linear_out_rel_err_vs_cpu"] = rel(out, out_c)
    results["fp8_linear_dx_rel_err_vs_cpu"] = rel(xg.grad, xc.grad)
    results["fp8_linear_dw_rel_err_vs_cpu"] = rel(lin.weight.grad, lin_cpu.weight.grad)
    norm = Fp8NormLinear(k, n, device=device, dtype=DTYPE)
    with torch.no_grad():
        norm.norm_weight.uniform_(0.5, 1.5, generator=gen)
    cpu_copy = partial(Fp8NormLinear, k, n, dtype=torch.float32)
    out, xg, norm_cpu, out_c, xc = _with_cpu_copy(norm, cpu_copy, xs, dy)
    results["fp8_norm_linear_out_rel_err_vs_cpu"] = rel(out, out_c)
    results["fp8_norm_linear_dx_rel_err_vs_cpu"] = rel(xg.grad, xc.grad)
    results["fp8_norm_linear_dnorm_w_rel_err_vs_cpu"] = rel(
        norm.norm_weight.grad, norm_cpu.norm_weight.grad
    )
    results["fp8_norm_linear_dw_rel_err_vs_cpu"] = rel(
        norm.linear.weight.grad, norm_cpu.linear.weight.grad
    )
    # 256 outputs: the dgrad GEMM reduces over 2 blocks of 128, which cuBLAS only reads right
    # with K padded to 4 blocks (the cause of the fused path's H200 failure).
    small = Fp8NormLinear(512, 256, device=device, dtype=DTYPE)
    xs2 = torch.randn(256, 512, generator=gen, device=device, dtype=DTYPE)
    dy2 = torch.randn(256, 256, generator=gen, device=device, dtype=DTYPE)
    out, xg, small_cpu, out_c, xc = _with_cpu_copy(
        small, partial(Fp8NormLinear, 512, 256, dtype=torch.float32), xs2, dy2
    )
    results["fp8_norm_linear_k256_dx_rel_err_vs_cpu"] = rel(xg.grad, xc.grad)
    results["fp8_norm_linear_k256_dw_rel_err_vs_cpu"] = rel(
        small.linear.weight.grad, small_cpu.linear.weight.grad
    )
    # A float32 model's layers (the GEM quality runs): float32 activations, weights and GEMM
    # results, native against the emulation. Both quantize the same values, so what differs is
    # the GEMMs' accumulation, and these errors show how far below bfloat16 rounding it is.
    # 16381 tokens: not a multiple of 4, so the padded-M path of the 1x128 operands runs too.
    for m32, k32, n32 in ((16384, 192, 32), (16381, 192, 32), (16384, 32, 96), (16384, 1024, 512)):
        xs32 = torch.randn(m32, k32, generator=gen, device=device)
        dy32 = torch.randn(m32, n32, generator=gen, device=device)
        lin32 = Fp8Linear(k32, n32, device=device, dtype=torch.float32)
        out, xg, lin_cpu, out_c, xc = _with_cpu_copy(
            lin32, partial(Fp8Linear, k32, n32, dtype=torch.float32), xs32, dy32
        )
        tag = f"fp8_linear_fp32_k{k32}_n{n32}" + ("" if m32 == 16384 else f"_m{m32}")
        results[f"{tag}_out_rel_err_vs_cpu"] = rel(out, out_c)
        results[f"{tag}_dx_rel_err_vs_cpu"] = rel(xg.grad, xc.grad)
        results[f"{tag}_dw_rel_err_vs_cpu"] = rel(lin32.weight.grad, lin_cpu.weight.grad)
        results[f"{tag}_db_rel_err_vs_cpu"] = rel(lin32.bias.grad, lin_cpu.bias.grad)
    return results


def gemm_breakdown(rows, errors, device) -> None:
    """The three GEMMs of a 4096x4096 layer alone (scaled_mm per scaling, bf16 mm)."""
    k = n = 4096
    case = f"M{M}xK{k}xN{n}"
    gen = torch.Generator(device=device).manual_seed(19)
    x = torch.randn(M, k, generator=gen, device=device, dtype=DTYPE)
    w = torch.randn(n, k, generator=gen, device=device, dtype=DTYPE) * 0.02
    dy = torch.randn(M, n, generator=gen, device=device, dtype=DTYPE)
    flops = 2.0 * M * k * n
    try:
        for act, wk, provider in (
            ("1x128", "128x128", "gem"),
            ("tensorwise", "tensorwise", "gem-tensorwise"),
        ):
            tiles = act == "1x128"  # the default recipe's 128x128 tiles of x.T for wgrad
            xq, wq, gq = (
                quantize_operand(x, act, col_tiles=tiles),
                quantize_operand(w, wk),
                quantize_operand(dy, act),
            )
            gemms = {
                "gemm_fwd": (xq.data, xq.scale, act, wq.data, wq.scale, wk),
                "gemm_dgrad": (gq.data, gq.scale, act, wq.data_t, wq.scale_t, wk),
                "gemm_wgrad": (gq.data_t, gq.scale_t, act, xq.data_t, xq.scale_t, xq.kind_t or act),
            }
            if tiles:
                x1 = quantize_operand(x, act)
                gemms["gemm_wgrad_1x128"] = (gq.data_t, gq.scale_t, act, x1.data_t, x1.scale_t, act)
                del x1
            for mode, args in gemms.items():
                ms = _bench(lambda a=args: scaled_mm_nt(*a, native=True))
                _row(rows, case, provider, mode, "ms", ms)
                _row(rows, case, provider, mode, "tflops", flops / ms / 1e9)
            ms = _bench(lambda a=act, t=tiles: quantize_operand(x, a, col_tiles=t))
            _row(rows, case, provider, "quantize_x", "ms", ms)
            ms = _bench(lambda a=act: quantize_operand(dy, a, col_sum=True))
            _row(rows, case, provider, "quantize_dy", "ms", ms)
        for mode, (a, b) in {
            "gemm_fwd": (x, w.t()),
            "gemm_dgrad": (dy, w),
            "gemm_wgrad": (dy.t(), x),
        }.items():
            ms = _bench(lambda a=a, b=b: a @ b)
            _row(rows, case, "bf16_mm", mode, "ms", ms)
            _row(rows, case, "bf16_mm", mode, "tflops", flops / ms / 1e9)
    except Exception:
        errors.append(f"gemm breakdown: {traceback.format_exc(limit=3)}")


# ---------------------------------------------------------------------------------------------
# Linear-layer providers.


def _linear_case(rows, errors, k, n, device, providers) -> None:
    case = f"M{M}xK{k}xN{n}"
    gen = torch.Generator(device=device).manual_seed(11)
    x = torch.randn(M, k, generator=gen, device=device, dtype=DTYPE)
    grad = torch.randn(M, n, generator=gen, device=device, dtype=DTYPE)
    base = nn.Linear(k, n, device=device, dtype=DTYPE)
    flops = 6.0 * M * k * n

    def make(provider):
        if provider == "bf16_linear":
            return base, None
        if provider == "gem":
            holder = nn.Sequential(nn.Linear(k, n, device=device, dtype=DTYPE))
            holder[0].load_state_dict(base.state_dict())
            report = convert_to_fp8(holder, PrecisionPolicy())
            return holder, bool(report.converted)
        recipe = {
            "gem-fp8": Fp8Recipe(),
            "gem-fp8-tensorwise": Fp8Recipe(tensorwise=True),
            "gem-fp8-wgrad_bf16": Fp8Recipe(wgrad_in_bf16=True),
            "gem-fp8-wgrad_1x128": Fp8Recipe(wgrad_x_tiles=False),
            "gem-fp8-rht": Fp8Recipe(hadamard=True),
        }[provider]
        layer = Fp8Linear(k, n, device=device, dtype=DTYPE, recipe=recipe)
        layer.load_state_dict(base.state_dict())
        return layer, True

    rep = 400 if k * n >= 8192 * 8192 else 200
    measured = {}
    # Two rounds over all providers, the faster of each provider's two medians counts: clocks
    # and heat drift during a run, and a single pass would favour whoever runs first.
    order = list(providers) * ROUNDS
    for provider in order:
        try:
            module, uses_fp8 = make(provider)
            xl = x.detach().clone().requires_grad_(True)

            def fwd_bwd(module=module, xl=xl):
                module(xl).backward(grad)

            fwd_bwd()
            ms = _bench(fwd_bwd, rep=rep)
            if provider in measured:
                rows[:] = [r for r in rows if not (r["case"] == case and r["provider"] == provider)]
                ms = min(ms, measured[provider])
            measured[provider] = ms
            _row(rows, case, provider, "fwd_bwd", "ms", ms)
            _row(rows, case, provider, "fwd_bwd", "tflops", flops / ms / 1e9)
            if uses_fp8 is not None:
                _row(rows, case, provider, "fwd_bwd", "uses_fp8", float(uses_fp8))
            del module, xl
        except Exception:
            errors.append(f"{case}/{provider}: {traceback.format_exc(limit=3)}")
        torch.cuda.empty_cache()


def _norm_linear_case(rows, errors, k, n, device) -> None:
    case = f"M{M}xK{k}xN{n}/rmsnorm"
    gen = torch.Generator(device=device).manual_seed(13)
    x = torch.randn(M, k, generator=gen, device=device, dtype=DTYPE)
    grad = torch.randn(M, n, generator=gen, device=device, dtype=DTYPE)
    flops = 6.0 * M * k * n
    bf16 = nn.Sequential(
        nn.RMSNorm(k, eps=1e-6, device=device, dtype=DTYPE),
        nn.Linear(k, n, device=device, dtype=DTYPE),
    )
    gem = Fp8NormLinear(k, n, device=device, dtype=DTYPE)
    for provider, module in (("bf16_norm_linear", bf16), ("gem-norm", gem)):
        try:
            xl = x.detach().clone().requires_grad_(True)

            def fwd_bwd(module=module, xl=xl):
                module(xl).backward(grad)

            fwd_bwd()
            ms = _bench(fwd_bwd)
            _row(rows, case, provider, "fwd_bwd", "ms", ms)
            _row(rows, case, provider, "fwd_bwd", "tflops", flops / ms / 1e9)
        except Exception:
            errors.append(f"{case}/{provider}: {traceback.format_exc(limit=3)}")
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# Kernel bandwidth.


def _kernel_rows(rows, errors, device, only=None) -> None:
    k = 4096
    case = f"M{M}xK{k}"
    gen = torch.Generator(device=device).manual_seed(17)
    x = torch.randn(M, k, generator=gen, device=device, dtype=DTYPE)
    w = torch.rand(k, generator=gen, device=device, dtype=DTYPE) + 0.5
    elems = M * k
    wanted = only or set()
    mx = None
    if not only or "mx_dequant_1x32" in wanted:
        mx = quantize_mx_triton(x)
    kernels = {
        "torch_copy": (lambda: x.clone(), 4 * elems),
        "mx_1x32": (lambda: quantize_mx_triton(x), 3 * elems + elems // 32),
        "mx_1x32_e5m2_ceil": (
            lambda: quantize_mx_triton(x, elem_dtype=torch.float8_e5m2, scale_rounding="ceil"),
            3 * elems + elems // 32,
        ),
        "mx_32x32": (lambda: quantize_mx_triton(x, square=True), 3 * elems + elems // 1024),
        "mx_dequant_1x32": (lambda: dequantize_mx_triton(mx), 3 * elems + elems // 32),
        "blockwise_1x128_rows": (
            lambda: quantize_operand(x, "1x128", cols=False),
            3 * elems + 4 * elems // 128,
        ),
        "blockwise_1x128_rows_and_cols": (
            lambda: quantize_operand(x, "1x128"),
            4 * elems + 8 * elems // 128,
        ),
        "blockwise_1x128_rows_and_cols_colsum": (  # dy: bias gradient in the same pass
            lambda: quantize_operand(x, "1x128", col_sum=True),
            4 * elems + 8 * elems // 128 + 4 * elems // 128,
        ),
        "blockwise_1x128_rows_and_tiles": (  # x: 128x128 tiles of x.T (default recipe)
            lambda: quantize_operand(x, "1x128", col_tiles=True),
            4 * elems + 4 * elems // 128,
        ),
        "rmsnorm_quant_1x128": (lambda: norm_quantize(x, w), 3 * elems + 4 * elems // 128),
        "torch_eager_mx_1x32": (lambda: quantize_mx(x), 3 * elems + elems // 32),
    }
    for name, (fn, nbytes) in kernels.items():
        if only and name not in only:
            continue
        try:
            fn()
            ms = _bench(fn)
            provider = "torch_copy" if name == "torch_copy" else "gem"
            if name.startswith("torch_eager"):
                provider = "torch_eager"
            kcase = f"{case}/{name}"
            _row(rows, kcase, provider, "quantize", "ms", ms)
            gbps = nbytes / ms / 1e6
            _row(rows, kcase, provider, "quantize", "gbps", gbps)
            _row(rows, kcase, provider, "quantize", "pct_hbm", 100.0 * gbps / HBM_GBPS)
        except Exception:
            errors.append(f"{name}: {traceback.format_exc(limit=3)}")


def _summary(rows) -> list[str]:
    lines = []
    table = {(r["case"], r["provider"], r["mode"], r["metric"]): r["value"] for r in rows}
    for k, n in SHAPES:
        case = f"M{M}xK{k}xN{n}"
        bf16 = table.get((case, "bf16_linear", "fwd_bwd", "ms"))
        for provider in (
            "gem",
            "gem-fp8",
            "gem-fp8-tensorwise",
            "gem-fp8-wgrad_bf16",
            "gem-fp8-wgrad_1x128",
        ):
            ms = table.get((case, provider, "fwd_bwd", "ms"))
            if ms and bf16:
                tflops = table[(case, provider, "fwd_bwd", "tflops")]
                lines.append(
                    f"{case:24s} {provider:20s} {ms:8.3f} ms  {tflops:7.1f} TFLOP/s  "
                    f"x{bf16 / ms:5.2f} vs bf16"
                )
        if bf16:
            lines.append(f"{case:24s} {'bf16_linear':20s} {bf16:8.3f} ms")
    for (case, provider, mode, metric), value in table.items():
        if mode.startswith("gemm") and metric == "tflops":
            lines.append(f"{case:24s} {provider:14s} {mode:11s} {value:7.1f} TFLOP/s")
        if mode.startswith("quantize_") and metric == "ms":
            lines.append(f"{case:24s} {provider:14s} {mode:11s} {value:7.3f} ms")
        if metric == "pct_hbm":
            lines.append(f"{case:36s} {provider:12s} {value:5.1f}% of HBM")
        if case.endswith("/rmsnorm") and metric == "ms":
            lines.append(f"{case:36s} {provider:18s} {value:8.3f} ms")
    return lines


def _merged(old: dict, new_meta: dict, new_rows: list[dict]) -> tuple[dict, list[dict]]:
    """``old``'s rows with those this run measured replaced, and ``old``'s meta with this run
    recorded under ``merged_runs``."""

    def key(r):
        return r["case"], r["provider"], r["mode"], r["metric"]

    fresh = {key(r) for r in new_rows}
    rows = [r for r in old["rows"] if key(r) not in fresh] + new_rows
    merged_meta = dict(old["meta"])
    runs = list(merged_meta.get("merged_runs", []))
    runs.append({**new_meta, "rows": sorted({f"{r['case']}/{r['provider']}" for r in new_rows})})
    merged_meta["merged_runs"] = runs
    return merged_meta, rows


def main() -> None:
    parser = results_parser(__doc__, "h200/fp8_linear.json")
    parser.add_argument("--check", action="store_true", help="GPU correctness checks first")
    parser.add_argument("--shapes", default="all", help="'all' or e.g. 4096x4096,512x512")
    parser.add_argument(
        "--providers",
        default="bf16_linear,gem,gem-fp8,gem-fp8-tensorwise,gem-fp8-wgrad_bf16,gem-fp8-wgrad_1x128",
    )
    parser.add_argument("--no-kernels", action="store_true", help="skip the bandwidth rows")
    parser.add_argument("--no-norm", action="store_true", help="skip the rmsnorm cases")
    parser.add_argument(
        "--only-kernels",
        default="",
        help="comma list of bandwidth rows to run (e.g. blockwise_1x128_rows_and_cols_colsum), "
        "nothing else",
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help="replace only this run's rows in an existing --out file, keep the others",
    )
    args = parser.parse_args()
    require_cuda()
    import triton

    device = torch.device("cuda")
    start = time.time()
    rows, errors, extra = [], [], {}
    if args.check:
        try:
            extra["checks"] = check(device)
        except Exception:
            errors.append(f"check: {traceback.format_exc(limit=5)}")
        print(extra.get("checks"), flush=True)
    shapes = SHAPES
    if args.shapes != "all":
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    providers = [p for p in args.providers.split(",") if p]
    only = {name for name in args.only_kernels.split(",") if name}
    if only:
        shapes, args.no_norm = [], True
    for k, n in shapes:
        small = min(k, n) < 1024
        skip_small = ("gem-fp8-tensorwise", "gem-fp8-wgrad_1x128", "gem-fp8-rht")
        chosen = [p for p in providers if not (small and p in skip_small)]
        _linear_case(rows, errors, k, n, device, chosen)
        print("\n".join(_summary(rows)[-6:]), flush=True)
    if not args.no_norm:
        for k, n in [s for s in shapes if min(s) >= 1024][:1]:
            _norm_linear_case(rows, errors, k, n, device)
    if not args.no_kernels:
        _kernel_rows(rows, errors, device, only)
        if not only:
            gemm_breakdown(rows, errors, device)
    meta_block = meta(
        "fp8_linear",
        "python benchmarks/bench_fp8_linear.py " + " ".join(sys.argv[1:]),
        device=torch.cuda.get_device_name(),
        triton=triton.__version__,
        m=M,
        dtype="bfloat16",
        hbm_gbps_reference=HBM_GBPS,
        # The shipped launch options (benchmarks/tune/fp8_quantize_configs.py explores others).
        kernel_options={
            "operand": dataclasses.asdict(OperandKernelConfig()),
            "mx": dataclasses.asdict(MxKernelConfig()),
        },
        errors=errors,
        wall_s=round(time.time() - start, 1),
        **extra,
    )
    out = Path(args.out)
    if args.merge and out.exists():
        meta_block, rows = _merged(json.loads(out.read_text()), meta_block, rows)
    write_results(out, meta_block, rows)
    print("\n".join(_summary(rows)))
    for e in errors:
        print("ERROR", e)


if __name__ == "__main__":
    main()
