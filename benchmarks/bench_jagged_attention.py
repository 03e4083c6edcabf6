"""Jagged softmax attention on one GPU: gem's Triton kernels against the usual alternatives.

Protocol (shared/BENCHMARKS.md): jagged lengths ``randint(1, Lmax + 1, (B,))`` with a fixed
seed, H=4, D=128, bf16, (B, Lmax) in {(512, 1024), (128, 4096), (32, 16384)}, causal and not,
forward and forward+backward, plus a causal sliding window of 256 at L16384 and gem's bias
variants (``rel_pos_bias`` with 512 buckets, ``jagged_bias``) at every shape, causal.
``triton.testing.do_bench`` medians; every provider is measured in the same run, the unbiased
cases in ``--rounds`` rounds (default 2) whose provider order alternates, keeping each
provider's median (the first provider timed after an idle spell runs at higher clocks). TFLOP/s count
useful work only: ``4 * H * D * sum(L^2)`` forward (half of it when causal; the exact visible
pairs for the window), x3.5 for forward+backward.

Peak memory (metric ``peak_mib``): ``torch.cuda.max_memory_allocated`` during one
forward+backward (inputs and upstream gradient already allocated, so it counts them too;
``peak_extra_mib`` is the part above what was allocated before the call), non-causal, for gem
and three peers at the three shapes and at B16xL16384 (half the tokens: memory linear in tokens).

Peers: FlexAttention (document mask, ``torch.compile``), flash varlen
(``aten._flash_attention_forward`` / ``_backward``), nested-jagged SDPA, padded SDPA with the
flash and cuDNN backends (no mask: padding costs them work that is not counted).

    PYTHONPATH=packages/gem-kernels/src python benchmarks/bench_jagged_attention.py \
        --out benchmarks/results/h200/jagged_attention.json

Writes the JSON (schema in BENCHMARKS.md) and prints a table. gem's kernels are compiled first,
in parallel worker processes (one small call per mask and bias variant); the bias variants are
timed before the other cases, and ``--warmup-ms`` / ``--rep-ms`` set do_bench's times.
``--sweep`` first times a few tile configurations of gem's kernels at B128xL4096 and uses the
fastest. ``--bias-sweep`` only checks ``rel_pos_bias`` against the reference and times the bias
variants of ``_bias_sweep_configs`` (causal, every shape) into ``--out``; ``--tile-sweep``
times the unbiased tile variants of ``_tile_sweep_configs`` the same way. A full run takes
about 4 minutes on an H200 (the ``--budget-s`` guard stops starting new cases after that many
seconds).
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F
from _results import ROOT, meta, require_cuda, results_parser, user_args, write_results  # noqa: E402
from _timing import (
    autograd_provider,
    fastest,
    grad_leaves,
    median_ms,
    raise_recompile_limits,
    record_check,
    rel_error,
)

sys.path.insert(0, str(ROOT / "packages" / "gem-kernels" / "src"))

from gem_kernels import jagged_flash_attention  # noqa: E402
from gem_kernels.jfa_triton import JfaTritonConfig, default_config  # noqa: E402

H, D = 4, 128
SHAPES = [(512, 1024), (128, 4096), (32, 16384)]
WINDOW = 256
DTYPE = torch.bfloat16


TIMING = {"warmup": 25, "rep": 100}  # do_bench milliseconds; --warmup-ms / --rep-ms


def _bench(fn, grad_to_none=None) -> float:
    return median_ms(fn, grad_to_none=grad_to_none, **TIMING)


def _precompile_job(job) -> str:
    """Compile gem's kernels for one (causal, window, bias) variant on a small batch.

    The kernels do not specialise on batch-size-dependent integers, so these compilations are
    the ones the benchmark's shapes use; run in worker processes, they fill Triton's cache in
    parallel instead of one after the other inside the timed loop's warm-up.
    """
    causal, window, bias, config_fields = job
    start = time.time()
    # Short batches (longest <= SHORT_SEQUENCE_LEN) get other default forward tiles than long.
    for lengths in (torch.tensor([3, 300, 0, 129, 1000]), torch.tensor([3, 1500, 0, 129])):
        failure = _precompile_batch(causal, window, bias, config_fields, lengths)
        if failure:
            return f"precompile {job[:3]} failed: {failure}"[:300]
    return f"precompiled {job[:3]} in {time.time() - start:.1f} s"


def _precompile_batch(causal, window, bias, config_fields, lengths) -> str | None:
    """One small forward+backward; the error text on failure, else None."""
    try:
        offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
        offsets[1:] = torch.cumsum(lengths, 0)
        gen = torch.Generator().manual_seed(0)
        q, k, v, g = (
            torch.randn(int(lengths.sum()), H, D, generator=gen).to("cuda", DTYPE) for _ in range(4)
        )
        leaves = [t.requires_grad_(True) for t in (q, k, v)]
        extra = {}
        if bias == "rel_pos_bias":
            extra[bias] = torch.randn(H, 512, device="cuda", dtype=DTYPE, requires_grad=True)
        elif bias == "jagged_bias":
            pairs = int((lengths * lengths).sum())
            extra[bias] = torch.randn(H, pairs, device="cuda", dtype=DTYPE, requires_grad=True)
        options = dict(causal=causal, window=None if window is None else (window, None))
        if config_fields is None:
            out = jagged_flash_attention(*leaves, offsets, backend="triton", **options, **extra)
        else:
            from gem_kernels.jfa_triton import jagged_flash_attention_from_lengths

            out = jagged_flash_attention_from_lengths(
                *leaves, lengths, config=JfaTritonConfig(*config_fields), **options, **extra
            )
        out.backward(g)
        torch.cuda.synchronize()
        return None
    except Exception as error:  # noqa: BLE001 - the timed run reports real failures
        return repr(error)


def _precompile(cases, config) -> None:
    fields = None if config is None else dataclasses.astuple(config)
    jobs = {(causal, window, None, fields) for _, _, causal, window in cases}
    jobs |= {(True, None, bias, fields) for bias in ("rel_pos_bias", "jagged_bias")}
    _precompile_variants(jobs)


def _precompile_variants(jobs) -> None:
    """Compile gem's kernels for the (causal, window, bias, config fields) jobs in parallel
    worker processes (Triton's cache then serves the timed runs)."""
    import multiprocessing

    start = time.time()
    with multiprocessing.get_context("spawn").Pool(min(len(jobs), 12)) as pool:
        for line in pool.imap_unordered(_precompile_job, sorted(jobs, key=str)):
            print(line, flush=True)
    print(f"precompiled {len(jobs)} variants in {time.time() - start:.0f} s", flush=True)


def _lengths(batch: int, max_len: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1234 + max_len)
    return torch.randint(1, max_len + 1, (batch,), generator=gen)


def _visible_pairs(lengths: torch.Tensor, causal: bool, window: int | None) -> float:
    lengths = lengths.double()
    if window is not None:
        # Query i sees min(i, window) + 1 keys (causal sliding window).
        full = torch.clamp(lengths - window, min=0)
        ramp = lengths - full
        return float((ramp * (ramp + 1) / 2 + full * (window + 1)).sum())
    squares = float((lengths * lengths).sum())
    return squares / 2 if causal else squares


class Case:
    """One (shape, mask) case with its inputs, built once and shared by the providers."""

    def __init__(self, batch, max_len, causal, window, device):
        self.batch, self.max_len, self.causal, self.window = batch, max_len, causal, window
        self.lengths = _lengths(batch, max_len)
        self.total = int(self.lengths.sum())
        self.offsets = torch.zeros(batch + 1, dtype=torch.int64)
        self.offsets[1:] = torch.cumsum(self.lengths, 0)
        self.offsets_dev = self.offsets.to(device)
        gen = torch.Generator(device=device).manual_seed(7)
        shape = (self.total, H, D)
        self.q, self.k, self.v = (
            torch.randn(shape, generator=gen, device=device, dtype=DTYPE) for _ in range(3)
        )
        self.grad = torch.randn(shape, generator=gen, device=device, dtype=DTYPE)
        mask = "causal" if causal else "full"
        if window is not None:
            mask = f"causal_window{window}"
        self.name = f"B{batch}xL{max_len}/{mask}"
        self.fwd_flops = 4.0 * H * D * _visible_pairs(self.lengths, causal, window)

    def leaves(self):
        return grad_leaves((self.q, self.k, self.v))


# ---------------------------------------------------------------------------------------------
# Providers: each returns (fwd_fn, fwd_bwd_fn, grad_leaves) or raises NotImplementedError.


def provider_gem(case: Case, config=None, rel=None, jagged=None):
    window = None if case.window is None else (case.window, None)
    options = dict(causal=case.causal, window=window)

    def call(q, k, v, **extra):
        if config is not None:
            from gem_kernels.jfa_triton import jagged_flash_attention_from_lengths

            return jagged_flash_attention_from_lengths(
                q, k, v, case.lengths, config=config, **options, **extra
            )
        return jagged_flash_attention(q, k, v, case.offsets, backend="triton", **options, **extra)

    biases = {}
    if rel is not None:
        biases["rel_pos_bias"] = rel
    if jagged is not None:
        biases["jagged_bias"] = jagged

    def fwd():
        with torch.no_grad():
            return call(case.q, case.k, case.v, **biases)

    leaves = case.leaves()
    bias_leaves = {n: b.detach().clone().requires_grad_(True) for n, b in biases.items()}

    def fwd_bwd():
        out = call(*leaves, **bias_leaves)
        out.backward(case.grad)

    return fwd, fwd_bwd, leaves + list(bias_leaves.values())


def provider_flash_varlen(case: Case):
    cu = case.offsets_dev.to(torch.int32)
    max_len = int(case.lengths.max())
    window = {}
    if case.window is not None:
        window = dict(window_size_left=case.window, window_size_right=0)

    def forward(q, k, v):
        return torch.ops.aten._flash_attention_forward(
            q, k, v, cu, cu, max_len, max_len, 0.0, case.causal, False, **window
        )

    def fwd():
        return forward(case.q, case.k, case.v)[0]

    def fwd_bwd():
        out, lse, rng, unused, _ = forward(case.q, case.k, case.v)
        return torch.ops.aten._flash_attention_backward(
            case.grad, case.q, case.k, case.v, out, lse, cu, cu, max_len, max_len, 0.0,
            case.causal, rng, unused, **window,
        )  # fmt: skip

    return fwd, fwd_bwd, None


def provider_njt(case: Case):
    if case.window is not None:
        raise NotImplementedError("nested-jagged SDPA has no sliding window")
    offsets = case.offsets_dev
    max_len = int(case.lengths.max())

    def nest(t):
        return torch.nested.nested_tensor_from_jagged(
            t, offsets=offsets, max_seqlen=max_len, min_seqlen=int(case.lengths.min())
        ).transpose(1, 2)

    def run(q, k, v):
        return F.scaled_dot_product_attention(nest(q), nest(k), nest(v), is_causal=case.causal)

    def fwd():
        with torch.no_grad():
            return run(case.q, case.k, case.v)

    leaves = case.leaves()

    def fwd_bwd():
        out = run(*leaves).transpose(1, 2).values()
        out.backward(case.grad)

    return fwd, fwd_bwd, leaves


def _padded(case: Case, t: torch.Tensor) -> torch.Tensor:
    padded = torch.zeros(case.batch, case.max_len, H, D, dtype=t.dtype, device=t.device)
    sample = torch.repeat_interleave(torch.arange(case.batch), case.lengths)
    position = torch.arange(case.total) - case.offsets[:-1][sample]
    padded[sample.to(t.device), position.to(t.device)] = t
    return padded.transpose(1, 2).contiguous()  # (B, H, L, D)


def provider_padded(case: Case, backend):
    if case.window is not None:
        raise NotImplementedError("padded SDPA without a mask has no sliding window")
    from torch.nn.attention import sdpa_kernel

    qp, kp, vp, gp = (_padded(case, t) for t in (case.q, case.k, case.v, case.grad))

    def run(q, k, v):
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=case.causal)

    return autograd_provider(run, (qp, kp, vp), gp)


# Peers whose peak memory is measured (flex would recompile for the extra half-token shape).
MEMORY_PEERS = ("flash_varlen", "njt_sdpa", "sdpa_flash_padded")

_FLEX = {}


def provider_flex(case: Case):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if "fn" not in _FLEX:
        # One compiled graph per shape, mask and grad mode: lift dynamo's recompile cap (8),
        # past which flex would run eagerly and materialise the full score matrix.
        raise_recompile_limits(256)
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    flex = _FLEX["fn"]
    device = case.q.device
    doc = torch.repeat_interleave(torch.arange(case.batch), case.lengths).to(device)
    causal, window = case.causal, case.window

    def mask_mod(b, h, q_idx, kv_idx):
        keep = doc[q_idx] == doc[kv_idx]
        if causal:
            keep = keep & (q_idx >= kv_idx)
        if window is not None:
            keep = keep & (q_idx - kv_idx <= window)
        return keep

    block_mask = create_block_mask(
        mask_mod, None, None, case.total, case.total, device=device, _compile=True
    )
    qf, kf, vf, gf = (
        t.transpose(0, 1).unsqueeze(0).contiguous() for t in (case.q, case.k, case.v, case.grad)
    )
    return autograd_provider(lambda q, k, v: flex(q, k, v, block_mask=block_mask), (qf, kf, vf), gf)


PEERS = {
    "flex": provider_flex,
    "flash_varlen": provider_flash_varlen,
    "njt_sdpa": provider_njt,
    "sdpa_flash_padded": lambda c: provider_padded(c, _backend("FLASH_ATTENTION")),
    "sdpa_cudnn_padded": lambda c: provider_padded(c, _backend("CUDNN_ATTENTION")),
}


def _backend(name):
    from torch.nn.attention import SDPBackend

    return getattr(SDPBackend, name)


# ---------------------------------------------------------------------------------------------


def _check_against_flash(case: Case, results: dict) -> None:
    """gem's output and gradients against flash varlen on the same inputs."""
    record_check(results, case.name, lambda: _errors_against_flash(case))


def _errors_against_flash(case: Case) -> dict[str, float]:
    """Relative errors of gem's out, dq, dk, dv against flash varlen."""
    fwd, _, _ = provider_gem(case)
    ours = fwd()
    ref_out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
        case.q, case.k, case.v, case.offsets_dev.int(), case.offsets_dev.int(),
        int(case.lengths.max()), int(case.lengths.max()), 0.0, case.causal, False,
        **({} if case.window is None else dict(window_size_left=case.window,
                                                 window_size_right=0)),
    )  # fmt: skip
    leaves = case.leaves()
    window = None if case.window is None else (case.window, None)
    out = jagged_flash_attention(
        *leaves, case.offsets, causal=case.causal, window=window, backend="triton"
    )
    out.backward(case.grad)
    ref_grads = torch.ops.aten._flash_attention_backward(
        case.grad, case.q, case.k, case.v, ref_out, lse, case.offsets_dev.int(),
        case.offsets_dev.int(), int(case.lengths.max()), int(case.lengths.max()), 0.0,
        case.causal, rng, unused,
        **({} if case.window is None else dict(window_size_left=case.window,
                                                 window_size_right=0)),
    )  # fmt: skip
    errors = {"out": rel_error(ours, ref_out)}
    for name, leaf, ref in zip("qkv", leaves, ref_grads, strict=True):
        errors[f"d{name}"] = rel_error(leaf.grad, ref)
    return errors


def _peak_memory(rows, errors, case, provider, make) -> None:
    """Peak allocated memory of one forward+backward (MiB), as ``peak_mib`` rows."""
    try:
        _, fwd_bwd, leaves = make()
        fwd_bwd()  # warm-up (compilation, autotuning, workspaces)
        for leaf in leaves or ():
            leaf.grad = None
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        fwd_bwd()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        for leaf in leaves or ():
            leaf.grad = None
    except NotImplementedError as why:
        print(f"skip memory {case.name} {provider}: {why}")
        return
    except Exception as error:  # noqa: BLE001
        errors.append(f"{case.name} {provider} memory: {error!r}"[:400])
        print(errors[-1])
        return
    for metric, value in (("peak_mib", peak / 2**20), ("peak_extra_mib", (peak - before) / 2**20)):
        rows.append({"case": case.name, "provider": provider, "mode": "fwd_bwd",
                     "metric": metric, "value": round(value, 1), "tokens": case.total})  # fmt: skip
    print(f"{case.name:28s} {provider:18s} peak {peak / 2**20:9.1f} MiB "
          f"(+{(peak - before) / 2**20:.1f} over inputs) tokens {case.total}")  # fmt: skip


def _measure(rows, errors, case, provider, make, modes=("fwd", "fwd_bwd")):
    try:
        fwd, fwd_bwd, leaves = make()
    except NotImplementedError as why:
        print(f"skip {case.name} {provider}: {why}")
        return {}
    except Exception as error:  # noqa: BLE001
        errors.append(f"{case.name} {provider} setup: {error!r}"[:400])
        print(errors[-1])
        traceback.print_exc(limit=2)
        return {}
    times = {}
    for mode in modes:
        fn = fwd if mode == "fwd" else fwd_bwd
        try:
            ms = _bench(fn, grad_to_none=leaves if mode == "fwd_bwd" else None)
        except Exception as error:  # noqa: BLE001
            errors.append(f"{case.name} {provider} {mode}: {error!r}"[:400])
            print(errors[-1])
            continue
        times[mode] = ms
        rows += _timing_rows(case, provider, mode, ms)
        print(f"{case.name:28s} {provider:18s} {mode:8s} {ms:9.3f} ms {rows[-1]['value']:7.1f} "
              "TFLOP/s")  # fmt: skip
    return times


def _timing_rows(case, provider: str, mode: str, ms: float, **extra) -> list[dict]:
    """The ``ms`` and ``tflops`` rows of one timing (forward+backward counts 3.5x the flops)."""
    tflops = case.fwd_flops * (3.5 if mode == "fwd_bwd" else 1.0) / (ms * 1e-3) / 1e12
    return [
        {"case": case.name, "provider": provider, "mode": mode, "metric": metric,
         "value": round(value, 4), **extra}
        for metric, value in (("ms", ms), ("tflops", tflops))
    ]  # fmt: skip


def _measure_rounds(rows, errors, case, providers, rounds: int) -> None:
    """Time every provider ``rounds`` times, the order reversed every other round, and keep
    the median per (provider, mode). Under sustained load the H200's clock falls from ~1980
    to 1620-1830 MHz within seconds (power), so whoever is timed first in a case runs
    faster: the same kernel timed first and sixth in a row differed by 9%
    (``results/h200/tuning/jagged_attention_timing_drift.json``, ``probe_timing_drift.py``)."""
    samples: dict[tuple[str, str], list[float]] = {}
    for round_index in range(rounds):
        order = providers if round_index % 2 == 0 else providers[::-1]
        for name, make in order:
            for mode, ms in _measure([], errors, case, name, make).items():
                samples.setdefault((name, mode), []).append(ms)
    for (name, mode), times in samples.items():
        rows += _timing_rows(
            case, name, mode, statistics.median(times), rounds_ms=[round(t, 4) for t in times]
        )


def _sweep(device, deadline) -> JfaTritonConfig:
    """Time a few tile configurations at B128xL4096 (non-causal); return the fastest mix."""
    base = default_config(D)
    case = Case(128, 4096, False, None, device)
    fwd_candidates = [
        base,
        JfaTritonConfig(128, 128, 8, 3, *_bwd_fields(base)),
        JfaTritonConfig(128, 64, 8, 4, *_bwd_fields(base)),
        JfaTritonConfig(64, 64, 4, 3, *_bwd_fields(base)),
    ]
    best_fwd = fastest(
        fwd_candidates,
        lambda config: _bench(provider_gem(case, config=config)[0]),
        default=base,
        deadline=deadline,
        label="fwd",
        describe=lambda config: f"sweep fwd {_fwd_fields(config)}",
    )
    bwd_candidates = [
        _bwd_fields(base),
        (128, 32, 128, 32, 4, 3),
        (128, 64, 128, 64, 8, 3),
        (64, 64, 64, 64, 4, 3),
    ]

    def time_bwd(fields) -> float:
        config = JfaTritonConfig(*_fwd_fields(best_fwd), *fields)
        _, fwd_bwd, leaves = provider_gem(case, config=config)
        return _bench(fwd_bwd, grad_to_none=leaves)

    best_bwd = fastest(
        bwd_candidates,
        time_bwd,
        default=_bwd_fields(base),
        deadline=deadline,
        label="bwd",
        describe=lambda fields: f"sweep fwd+bwd {fields}",
    )
    chosen = JfaTritonConfig(*_fwd_fields(best_fwd), *best_bwd)
    print(f"chosen config: {chosen}")
    return chosen


def _bias_inputs(case: Case, device, jagged: bool):
    gen = torch.Generator(device=device).manual_seed(3)
    rel = torch.randn(H, 512, generator=gen, device=device, dtype=DTYPE)
    if not jagged:
        return rel, None
    pairs = int((case.lengths * case.lengths).sum())
    return rel, torch.randn(H, pairs, generator=gen, device=device, dtype=DTYPE)


def _bias_sweep_configs() -> dict[str, tuple[JfaTritonConfig, str]]:
    """Tile variants of the biased paths (``--bias-sweep``): name -> (config, bias), bias
    ``rel_pos_bias`` or ``jagged_bias``. Edit to explore; the rounds run so far are in
    ``results/h200/tuning/jagged_attention_bias_explore.json``."""
    biased = default_config(D, with_bias=True)
    jagged = default_config(D, with_jagged_bias=True)
    short = JfaTritonConfig(64, 32, 4, 3, 64, 32, 64, 32, 4, 3)
    medium = JfaTritonConfig(*_fwd_fields(biased), 64, 32, 128, 64, 4, 3, 8, 3)
    return {
        "default": (biased, "rel_pos_bias"),
        "jagged_default": (jagged, "jagged_bias"),
        "short": (short, "rel_pos_bias"),
        "short_dkdv16": (dataclasses.replace(short, dkdv_block_m=16), "rel_pos_bias"),
        "short_fwd_only": (
            JfaTritonConfig(*_fwd_fields(short), *_bwd_fields(biased)),
            "rel_pos_bias",
        ),
        "medium": (medium, "rel_pos_bias"),
        "jagged_short": (short, "jagged_bias"),
        "jagged_medium": (dataclasses.replace(medium, dq_block_n=32), "jagged_bias"),
    }


def _bias_sweep(device, out_path: Path, shapes) -> None:
    """Check the ``rel_pos_bias`` variants against the reference on odd lengths, then time
    every variant (and the unbiased kernel) causal at ``shapes``; rows go to ``out_path``."""
    from gem_kernels.jfa_triton import jagged_flash_attention_from_lengths
    from gem_kernels.reference import jagged_flash_attention_reference

    start = time.time()
    configs = _bias_sweep_configs()
    _precompile_variants(
        {(True, None, bias, dataclasses.astuple(config)) for config, bias in configs.values()}
    )
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
    checks, errors, rows = {}, [], []
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
                errs = [rel_error(out, ref)] + [
                    rel_error(a.grad, b.grad) for a, b in zip(leaves, ref_leaves, strict=True)
                ]
                checks[f"{name}/window={window}"] = errs
                print(f"check {name} window={window}: " + " ".join(f"{e:.1e}" for e in errs))
            except Exception as error:  # noqa: BLE001
                errors.append(f"check {name}: {error!r}"[:300])
                print(errors[-1])
    for batch, max_len in shapes:
        case = Case(batch, max_len, True, None, device)
        rel_table, jagged = _bias_inputs(case, device, jagged=True)
        inputs = {"rel_pos_bias": dict(rel=rel_table), "jagged_bias": dict(jagged=jagged)}
        variants = [("gem", lambda c=case: provider_gem(c))]
        variants += [
            (f"gem-{bias}-{name}",
             lambda c=case, cfg=config, e=inputs[bias]: provider_gem(c, config=cfg, **e))
            for name, (config, bias) in configs.items()
        ]  # fmt: skip
        for provider, make in variants:
            _measure(rows, errors, case, provider, make)
        del case, inputs, jagged
        torch.cuda.empty_cache()
        _write(out_path, None, None, checks, errors, rows, start)
    _print_table(rows)


def _tile_sweep_configs() -> dict[str, JfaTritonConfig]:
    """Tile variants of the unbiased kernels (``--tile-sweep``), timed on the cases of
    ``TILE_SWEEP_CASES`` against the default and flash varlen. Edit to explore; the rounds run
    so far are in ``results/h200/tuning/jagged_attention_tile_explore.json``."""
    # Round r12 (tiles dealt sample by sample, now the only order) showed the short tiles
    # ahead again at L1024 causal: the regimes' tiles against each other.
    return {
        "short": default_config(D, max_len=1024, masked=True),
        "medium": default_config(D, max_len=2048, masked=True),
        "long": default_config(D, masked=True),
    }


#: (batch, max_len, causal, window) of the ``--tile-sweep`` cases.
TILE_SWEEP_CASES = [(32, 16384, True, WINDOW), (512, 1024, True, None), (512, 1024, False, None),
                    (128, 4096, True, None), (128, 4096, False, None), (32, 16384, True, None),
                    (32, 16384, False, None)]  # fmt: skip


def _tile_sweep(device, out_path: Path, rounds: int) -> None:
    """Time every ``_tile_sweep_configs`` variant, the default and flash varlen on
    ``TILE_SWEEP_CASES`` (outputs checked against flash varlen first); rows go to ``out_path``."""
    start = time.time()
    configs = _tile_sweep_configs()
    _precompile_variants(
        {
            (causal, window, None, dataclasses.astuple(config))
            for config in configs.values()
            for _, _, causal, window in TILE_SWEEP_CASES
        }
    )
    checks, errors, rows = {}, [], []
    for batch, max_len, causal, window in TILE_SWEEP_CASES:
        case = Case(batch, max_len, causal, window, device)
        _check_against_flash(case, checks)
        providers = [("gem", lambda c=case: provider_gem(c)),
                     ("flash_varlen", lambda c=case: provider_flash_varlen(c))]  # fmt: skip
        reference = _outputs(lambda c=case: provider_gem(c))
        for name, config in configs.items():
            make = lambda c=case, cfg=config: provider_gem(c, config=cfg)  # noqa: E731
            # Each variant's output and gradients against the default's (same inputs).
            record_check(
                checks,
                f"{case.name}/{name}",
                lambda m=make, r=reference: {
                    n: rel_error(value, r[n]) for n, value in _outputs(m).items()
                },
            )
            providers.append((f"gem-{name}", make))
        _measure_rounds(rows, errors, case, providers, rounds)
        del case
        torch.cuda.empty_cache()
        _write(out_path, None, None, checks, errors, rows, start)
    _print_table(rows)


def _outputs(make) -> dict[str, torch.Tensor]:
    """Output and q, k, v gradients of one provider's forward and forward+backward."""
    fwd, fwd_bwd, leaves = make()
    fwd_bwd()
    return {"out": fwd(), **{f"d{n}": leaf.grad for n, leaf in zip("qkv", leaves, strict=False)}}


def _fwd_fields(c: JfaTritonConfig):
    return (c.fwd_block_m, c.fwd_block_n, c.fwd_warps, c.fwd_stages)


def _bwd_fields(c: JfaTritonConfig):
    return (c.dkdv_block_n, c.dkdv_block_m, c.dq_block_m, c.dq_block_n, c.bwd_warps, c.bwd_stages)


def _write(path, args, config, checks, errors, rows, start) -> None:
    import triton

    meta_block = meta(
        "jagged_attention",
        " ".join(["python benchmarks/bench_jagged_attention.py", *user_args()]),
        device=torch.cuda.get_device_name(),
        triton=triton.__version__,
        shape={"heads": H, "head_dim": D, "dtype": "bfloat16", "window": WINDOW},
        gem_config=str(config or default_config(D)),
        gem_config_short=str(config or default_config(D, max_len=1024)),
        gem_config_short_causal=str(config or default_config(D, max_len=1024, masked=True)),
        gem_config_with_bias=str(config or default_config(D, with_bias=True)),
        gem_config_with_jagged_bias=str(config or default_config(D, with_jagged_bias=True)),
        checks_vs_flash_varlen_rel_error=checks,
        errors=errors,
        wall_s=round(time.time() - start, 1),
    )
    write_results(path, meta_block, rows)


def main() -> None:
    parser = results_parser(__doc__, "h200/jagged_attention.json")
    parser.add_argument("--sweep", action="store_true", help="pick gem's tiles by a short sweep")
    parser.add_argument("--peers", default=",".join(PEERS), help="comma-separated peer names")
    parser.add_argument("--shapes", default="all", help="'all' or e.g. 128x4096,512x1024")
    parser.add_argument(
        "--config", default="", help="gem tiles: 10 comma-separated JfaTritonConfig fields"
    )
    parser.add_argument("--budget-s", type=float, default=360.0, help="stop starting new cases")
    parser.add_argument(
        "--bias-sweep", action="store_true", help="only check and time rel_pos_bias variants"
    )
    parser.add_argument(
        "--tile-sweep", action="store_true", help="only time the unbiased tile variants"
    )
    parser.add_argument(
        "--rounds", type=int, default=2, help="timings per provider and case (order alternates)"
    )
    parser.add_argument("--warmup-ms", type=float, default=25.0, help="do_bench warm-up")
    parser.add_argument("--rep-ms", type=float, default=100.0, help="do_bench repetition time")
    args = parser.parse_args()
    TIMING.update(warmup=args.warmup_ms, rep=args.rep_ms)
    require_cuda()
    device = torch.device("cuda")
    start = time.time()
    shapes = SHAPES
    if args.shapes != "all":
        shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    if args.bias_sweep:
        _bias_sweep(device, Path(args.out), shapes)
        return
    if args.tile_sweep:
        _tile_sweep(device, Path(args.out), args.rounds)
        return
    rows, errors, checks = [], [], {}
    config = None
    if args.config:
        config = JfaTritonConfig(*(int(x) for x in args.config.split(",")))
    if args.sweep:
        config = _sweep(device, start + 0.3 * args.budget_s)
        if config == default_config(D):
            config = None
    peers = [p for p in args.peers.split(",") if p]

    cases = [(b, length, causal, None) for b, length in shapes for causal in (False, True)]
    if (32, 16384) in shapes:
        cases.append((32, 16384, True, WINDOW))
    _precompile(cases, config)
    # Bias variants (gem only), causal, at every shape (first: the budget may cut the tail);
    # the unbiased causal rows are measured below.
    for batch, max_len in shapes:
        if time.time() - start > args.budget_s:
            errors.append(f"budget reached before the bias variants at B{batch}xL{max_len}")
            break
        case = Case(batch, max_len, True, None, device)
        rel, jagged = _bias_inputs(case, device, jagged=True)
        for variant, extra in (
            ("rel_pos_bias", dict(rel=rel)),
            ("jagged_bias", dict(jagged=jagged)),
        ):
            _measure(rows, errors, case, f"gem-{variant}",
                     lambda c=case, e=extra: provider_gem(c, config=config, **e))  # fmt: skip
        del case, jagged
        torch.cuda.empty_cache()
        _write(Path(args.out), args, config, checks, errors, rows, start)

    for batch, max_len, causal, window in cases:
        if time.time() - start > args.budget_s:
            errors.append(f"budget reached before B{batch}xL{max_len} causal={causal}")
            break
        case = Case(batch, max_len, causal, window, device)
        _check_against_flash(case, checks)
        providers = [("gem", lambda c=case: provider_gem(c, config=config))]
        providers += [(peer, lambda c=case, p=peer: PEERS[p](c)) for peer in peers]
        _measure_rounds(rows, errors, case, providers, args.rounds)
        del case
        torch.cuda.empty_cache()
        _write(Path(args.out), args, config, checks, errors, rows, start)  # partial results

    # Peak memory of one forward+backward (non-causal), gem and peers; B16xL16384 has half the
    # tokens of the other shapes.
    memory_shapes = list(shapes) + ([(16, 16384)] if (32, 16384) in shapes else [])
    for batch, max_len in memory_shapes:
        if time.time() - start > args.budget_s:
            errors.append(f"budget reached before peak memory at B{batch}xL{max_len}")
            break
        case = Case(batch, max_len, False, None, device)
        _peak_memory(rows, errors, case, "gem", lambda c=case: provider_gem(c, config=config))
        for peer in [p for p in peers if p in MEMORY_PEERS]:
            _peak_memory(rows, errors, case, peer, lambda c=case, p=peer: PEERS[p](c))
        del case
        torch.cuda.empty_cache()

    out = Path(args.out)
    _write(out, args, config, checks, errors, rows, start)
    _print_table(rows)
    print(f"wrote {out} in {time.time() - start:.0f} s; {len(errors)} errors")


def _print_table(rows) -> None:
    tflops = {
        (r["case"], r["provider"], r["mode"]): r["value"] for r in rows if r["metric"] == "tflops"
    }
    cases = sorted({k[0] for k in tflops}, key=lambda c: (len(c), c))
    print("\nTFLOP/s (useful work)        mode     gem    best peer")
    for case in cases:
        for mode in ("fwd", "fwd_bwd"):
            ours = tflops.get((case, "gem", mode))
            peers = {
                p: v
                for (c, p, m), v in tflops.items()
                if c == case and m == mode and not p.startswith("gem")
            }
            best = max(peers.items(), key=lambda kv: kv[1]) if peers else ("-", float("nan"))
            ours_text = "-" if ours is None else f"{ours:6.1f}"
            print(f"{case:28s} {mode:8s} {ours_text:>6s}  {best[1]:6.1f} ({best[0]})")
    for (case, provider, mode), value in sorted(tflops.items()):
        if provider.startswith("gem-"):
            print(f"{case:28s} {mode:8s} {provider}: {value:.1f}")


if __name__ == "__main__":
    main()
