"""Exploration: tile variants of gem's jagged attention kernels, timed against the defaults.

Not a benchmark (``bench_jagged_attention.py`` is): edit the variants below and run on a GPU.

``--bias``: checks the ``rel_pos_bias`` variants of :func:`bias_configs` against the reference
on odd lengths (with and without a window), then times every variant of it and the unbiased
kernel, causal, at ``--shapes``. Default output ``h200/tuning/jagged_attention_bias_sweep.json``.

``--tiles`` (default): times the unbiased variants of :func:`tile_configs`, the default and
flash varlen on ``TILE_CASES`` in ``--rounds`` alternating rounds, each variant checked against
the default's output and gradients. Default output ``h200/tuning/jagged_attention_tile_sweep.json``.
Earlier rounds: ``results/h200/tuning/jagged_attention_{bias,tile}_explore.json``.

    PYTHONPATH=packages/gem-kernels/src:benchmarks python benchmarks/tune/jagged_attention_tiles.py --tiles
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness, the bench

import bench_jagged_attention as bench  # noqa: E402
import torch  # noqa: E402
from bench_jagged_attention import (  # noqa: E402
    DTYPE,
    WINDOW,
    Case,
    D,
    H,
    bias_inputs,
    bwd_fields,
    fwd_fields,
    precompile_variants,
    provider_flash_varlen,
    provider_gem,
)
from gem_kernels.jfa_triton import (  # noqa: E402
    JfaTritonConfig,
    default_config,
    jagged_flash_attention_from_lengths,
)
from gem_kernels.reference import jagged_flash_attention_reference  # noqa: E402
from harness import Run, rel_error, require_cuda, tuning_path  # noqa: E402


def bias_configs() -> dict[str, tuple[JfaTritonConfig, str]]:
    """Tile variants of the biased paths: name -> (config, ``rel_pos_bias`` or ``jagged_bias``)."""
    biased = default_config(D, with_bias=True)
    jagged = default_config(D, with_jagged_bias=True)
    short = JfaTritonConfig(64, 32, 4, 3, 64, 32, 64, 32, 4, 3)
    medium = JfaTritonConfig(*fwd_fields(biased), 64, 32, 128, 64, 4, 3, 8, 3)
    return {
        "default": (biased, "rel_pos_bias"),
        "jagged_default": (jagged, "jagged_bias"),
        "short": (short, "rel_pos_bias"),
        "short_dkdv16": (dataclasses.replace(short, dkdv_block_m=16), "rel_pos_bias"),
        "short_fwd_only": (
            JfaTritonConfig(*fwd_fields(short), *bwd_fields(biased)),
            "rel_pos_bias",
        ),
        "medium": (medium, "rel_pos_bias"),
        "jagged_short": (short, "jagged_bias"),
        "jagged_medium": (dataclasses.replace(medium, dq_block_n=32), "jagged_bias"),
    }


def tile_configs() -> dict[str, JfaTritonConfig]:
    """Tile variants of the unbiased kernels: the regimes' tiles against each other."""
    return {
        "short": default_config(D, max_len=1024, masked=True),
        "medium": default_config(D, max_len=2048, masked=True),
        "long": default_config(D, masked=True),
    }


def window_configs() -> dict[str, JfaTritonConfig]:
    """Tile variants at the h200 recipe's self-attention (causal, window 256, samples up to
    1024): its default (``d128_short_masked``) against longer tiles and the fused backward."""
    short = default_config(D, max_len=WINDOW + 1, masked=True)
    replace = dataclasses.replace
    return {
        "short": short,
        "short_fused": replace(short, bwd_fused=True),
        "short_fwd128x64": replace(short, fwd_block_m=128, fwd_block_n=64, fwd_warps=8),
        "short_dkdv128": replace(short, dkdv_block_n=128, dkdv_block_m=32, bwd_warps=8),
        "short_dq128": replace(short, dq_block_m=128, dq_block_n=64, dq_warps=8),
        "medium": default_config(D, max_len=2048, masked=True),
        "medium_fused": replace(default_config(D, max_len=2048, masked=True), bwd_fused=True),
        "long": default_config(D, masked=True),
        "long_fused": replace(default_config(D, masked=True), bwd_fused=True),
        "d64_tiles": replace(
            short,
            dkdv_block_n=128,
            dkdv_block_m=64,
            dq_block_m=128,
            dq_block_n=64,
            bwd_warps=8,
            bwd_stages=2,
        ),
    }


#: (batch, max_len, causal, window) of the ``--tiles`` cases.
TILE_CASES = [(32, 16384, True, WINDOW), (512, 1024, True, None), (512, 1024, False, None),
              (128, 4096, True, None), (128, 4096, False, None), (32, 16384, True, None),
              (32, 16384, False, None)]  # fmt: skip


def _check_rel_pos_bias(run: Run, configs, device) -> None:
    """The ``rel_pos_bias`` variants against the float32 reference on odd lengths."""
    gen = torch.Generator().manual_seed(0)
    q_len = [0, 1, 300, 77, 513, 64, 1000]
    k_len = [5, 0, 129, 600, 513, 1, 1000]
    qo = torch.tensor([0, *torch.tensor(q_len).cumsum(0).tolist()])
    ko = torch.tensor([0, *torch.tensor(k_len).cumsum(0).tolist()])
    q = torch.randn(sum(q_len), H, D, generator=gen).to(device, DTYPE)
    k = torch.randn(sum(k_len), H, D, generator=gen).to(device, DTYPE)
    v = torch.randn(sum(k_len), H, D, generator=gen).to(device, DTYPE)
    g = torch.randn(sum(q_len), H, D, generator=gen).to(device, DTYPE)
    rel = torch.randn(H, 257, generator=gen).to(device, DTYPE)
    for window in (None, (200, None)):
        ref_leaves = [t.float().requires_grad_(True) for t in (q, k, v, rel)]
        ref = jagged_flash_attention_reference(
            *ref_leaves[:3], qo.to(device), ko.to(device), causal=True, window=window,
            rel_pos_bias=ref_leaves[3],
        )  # fmt: skip
        ref.backward(g.float())
        for name, (config, bias) in configs.items():
            if bias != "rel_pos_bias":
                continue
            try:
                leaves = [t.clone().requires_grad_(True) for t in (q, k, v, rel)]
                out = jagged_flash_attention_from_lengths(
                    *leaves[:3], torch.tensor(q_len), torch.tensor(k_len), causal=True,
                    window=window, rel_pos_bias=leaves[3], config=config,
                )  # fmt: skip
                out.backward(g)
                errors = [rel_error(out, ref)] + [
                    rel_error(a.grad, b.grad) for a, b in zip(leaves, ref_leaves, strict=True)
                ]
            except Exception as error:  # noqa: BLE001 - report and keep exploring
                run.error(f"check {name}: {error!r}")
                continue
            run.checks[f"{name}/window={window}"] = dict(zip(("out", "dq", "dk", "dv", "drel"),
                                                             errors, strict=True))  # fmt: skip
            print(f"check {name} window={window}: " + " ".join(f"{e:.1e}" for e in errors))


def bias_sweep(run: Run, device, shapes) -> None:
    configs = bias_configs()
    precompile_variants(
        {
            (True, None, bias, dataclasses.astuple(config), "bf16")
            for config, bias in configs.values()
        }
    )
    _check_rel_pos_bias(run, configs, device)
    for batch, max_len in shapes:
        case = Case(batch, max_len, True, None, device)
        rel, jagged = bias_inputs(case, device, jagged=True)
        inputs = {"rel_pos_bias": dict(rel=rel), "jagged_bias": dict(jagged=jagged)}
        variants = {"gem": provider_gem}
        variants |= {
            f"gem-{bias}-{name}": lambda c, cfg=config, e=inputs[bias]: provider_gem(c, cfg, **e)
            for name, (config, bias) in configs.items()
        }
        run.measure(case, variants, flops=case.flops)
        del case, inputs, jagged
        torch.cuda.empty_cache()


def tile_sweep(run: Run, device, rounds: int) -> None:
    configs = tile_configs()
    precompile_variants(
        {
            (causal, window, None, dataclasses.astuple(config), "bf16")
            for config in configs.values()
            for _, _, causal, window in TILE_CASES
        }
    )
    for batch, max_len, causal, window in TILE_CASES:
        case = Case(batch, max_len, causal, window, device)
        providers = {"gem": provider_gem, "flash_varlen": provider_flash_varlen}
        providers |= {
            f"gem-{name}": lambda c, cfg=config: provider_gem(c, config=cfg)
            for name, config in configs.items()
        }
        # Variants against the default's outputs and gradients (same inputs).
        run.measure(case, providers, flops=case.flops, reference=provider_gem, rounds=rounds)
        del case
        torch.cuda.empty_cache()


def window_sweep(run: Run, device, rounds: int) -> None:
    """:func:`window_configs` at the h200 recipe's attention shape, each variant checked against
    the default's outputs and gradients."""
    configs = window_configs()
    precompile_variants(
        {(True, WINDOW, None, dataclasses.astuple(c), "bf16") for c in configs.values()}
    )
    case = Case(1024, 1024, True, WINDOW, device)
    providers = {"gem": provider_gem}
    providers |= {
        f"gem-{name}": lambda c, cfg=config: provider_gem(c, config=cfg)
        for name, config in configs.items()
    }
    run.measure(case, providers, flops=case.flops, reference=provider_gem, rounds=rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="result JSON (default: see above)")
    parser.add_argument("--bias", action="store_true", help="the biased variants")
    parser.add_argument("--tiles", action="store_true", help="the unbiased variants (default)")
    parser.add_argument(
        "--window", action="store_true", help="the h200 recipe's windowed attention variants"
    )
    parser.add_argument("--shapes", default="all", help="--bias: 'all' or e.g. 128x4096")
    parser.add_argument("--rounds", type=int, default=2, help="--tiles: alternating rounds")
    parser.add_argument("--machine", default="h200", help="results/<machine>/tuning/")
    args = parser.parse_args()
    require_cuda()
    device = torch.device("cuda")
    name = (
        "jagged_attention_bias_sweep"
        if args.bias
        else "jagged_attention_window_sweep"
        if args.window
        else "jagged_attention_tile_sweep"
    )
    out = args.out or tuning_path(args.machine, f"{name}.json")
    run = Run(name, out, script="benchmarks/tune/jagged_attention_tiles.py", timing=bench.TIMING,
              extra=bench.config_meta(None))  # fmt: skip
    if args.bias:
        bias_sweep(run, device, bench.parse_shapes(args.shapes))
    elif args.window:
        window_sweep(run, device, args.rounds)
    else:
        tile_sweep(run, device, args.rounds)
    run.write()
    run.table(("ms", "tflops"), title=name)


if __name__ == "__main__":
    main()
