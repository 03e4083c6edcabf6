"""GDPA (pointwise-activation attention) on one GPU: gem's Triton kernels against peers.

Protocol (shared/BENCHMARKS.md and issue 4): H=4, D=128, bf16, activation ``gelu_fast``
(polynomial GELU), non-causal, jagged lengths ``randint(1, Lmax + 1, (B,))`` with a fixed seed.

* ``self/BxL`` for (512, 1024), (128, 4096), (1152, 1000);
* ``cross/BxL``: jagged queries (same lengths), 256 dense keys per sample, L1024 (B512) and
  L4096 (B128);
* ``pma/BxL``: 32 broadcast queries over jagged keys, L1024 (B512) and L4096 (B128); also
  ``gbps``: useful bytes (K, V read once, Q read, O written) over time, and for gem
  ``graph_ms`` / ``graph_gbps``: the same call replayed from a CUDA graph
  (``triton.testing.do_bench_cudagraph``), the kernel time without the host overhead that
  bounds eager calls of ~0.15 ms;
* ``skew/alpha1.7``: self, lengths from a power law (``P(L > x) ~ x^-0.7``, 16..16384, total
  ~2^18 tokens): gem's three schedules, with ``max_over_mean`` = modelled SM work max/mean.

TFLOP/s count useful work: ``4 * H * D * sum(Lq * Lk)`` forward, x3.5 for forward+backward.
Peers, measured in the same run: ``compile_padded`` (``torch.compile`` of padded activation
attention with a key mask; only where the padded score tensor fits, B512xL1024 self, cross,
PMA), ``sdpa_flash_padded`` (softmax, flash, padded, no mask: a speed reference, not the same
function) and ``njt_sdpa`` (nested-jagged softmax SDPA, cross and PMA).

    PYTHONPATH=packages/gem-kernels/src python benchmarks/bench_gdpa.py \
        --out benchmarks/results/h200/gdpa.json [--check] [--sweep] [--config k=v,...]

``--workers N`` compiles every kernel of the run in N processes first (Triton's on-disk cache;
the timed process then loads binaries: minutes of serial compiling become ~15 s).
``--explore --workers N --out X.json`` times the variants behind the current defaults of the
bandwidth-bound forwards (PMA split-KV items vs the streamed kernel, BlockAttention launch
options) eagerly, from CUDA graphs and for their host time, after a correctness check.
``--explore-self-cross [--explore-set 2] --workers N --out X.json`` checks and times the
self/cross forward and backward variants (one loop, TMA, hand pipelining, tiles, programs per
SM; round 2 combines round 1's winners; round 3 the fused backward, round 4 its tiles, round 5
warp specialisation of the forward) on the protocol shapes. Rounds 6 and 7 (``tuning/gdpa_explore6.json``,
``tuning/gdpa_explore7.json``: fused-backward dQ by TMA reduce, TMA loads of Q/dO, warp specialisation,
dQ as ``K^T dS^T``, smaller tiles) were no faster; their variants and options were removed.
``--explore-pma-cross [--explore-set 2] --workers N --out X.json`` (issue 4, round 4): the
streamed PMA forward (eager medians repeated, CUDA-graph and host times, repeat-call
bit-equality) and cross forward variants (query rows per item). The one-launch PMA forward and
the chunked short-KV kernel this mode also timed (``tuning/gdpa_explore4.json``, ``tuning/gdpa_explore4b.json``)
were slower and have been removed.
Without ``--config`` gem runs through the public entry point, so each call gets the default
configuration of its lengths and masks (``gdpa_triton.default_config``).
``--kinds pma --merge benchmarks/results/h200/gdpa.json`` reruns only the PMA cases and keeps
the other rows of the earlier run (``meta.merged_from`` records where they come from).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from _results import ROOT, meta, require_cuda, results_parser, user_args, write_results  # noqa: E402
from _timing import autograd_provider, grad_leaves, median_ms, raise_recompile_limits, rel_error

sys.path.insert(0, str(ROOT / "packages" / "gem-kernels" / "src"))

from gem_kernels import gdpa  # noqa: E402
from gem_kernels import gdpa_triton as gt  # noqa: E402
from gem_kernels.reference import gdpa_activation  # noqa: E402

H, D = 4, 128
DTYPE = torch.bfloat16
ACT = "gelu_fast"
NUM_QUERIES = 32
CROSS_KV = 256
SELF_SHAPES = [(512, 1024), (128, 4096), (1152, 1000)]
ASYM_SHAPES = [(512, 1024), (128, 4096)]
# Compile times are long: the compiled peer runs at L1024 only (as in BENCHMARKS.md).
COMPILE_OK = {"self/B512xL1024", "pma/B512xL1024"}


def _bench(fn, grad_to_none=None) -> float:
    return median_ms(fn, warmup=10, rep=40, grad_to_none=grad_to_none)


def _lengths(batch: int, max_len: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1234 + max_len)
    return torch.randint(1, max_len + 1, (batch,), generator=gen)


def _power_law_lengths(alpha=1.7, low=16, high=16384, total=1 << 18) -> torch.Tensor:
    gen = torch.Generator().manual_seed(17)
    out, acc = [], 0
    while acc < total:
        u = float(torch.rand((), generator=gen))
        length = int(min(high, low * (1.0 - u) ** (-1.0 / (alpha - 1.0))))
        out.append(length)
        acc += length
    return torch.tensor(out)


def _offsets(lengths: torch.Tensor) -> torch.Tensor:
    return torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths, 0)])


class Case:
    """One shape with its inputs, shared by every provider."""

    def __init__(self, kind, batch, max_len, device, lengths=None, name=None):
        self.kind, self.batch, self.max_len = kind, batch, max_len
        self.q_lengths = _lengths(batch, max_len) if lengths is None else lengths
        self.batch = self.q_lengths.numel()
        if kind == "self":
            self.k_lengths = self.q_lengths
        elif kind == "cross":
            self.k_lengths = torch.full_like(self.q_lengths, CROSS_KV)
        else:  # pma: keys are the jagged side
            self.k_lengths = self.q_lengths
            self.q_lengths = torch.full_like(self.k_lengths, NUM_QUERIES)
        self.q_off = None if kind == "pma" else _offsets(self.q_lengths)
        self.k_off = None if kind == "self" else _offsets(self.k_lengths)
        q_rows = NUM_QUERIES if kind == "pma" else int(self.q_lengths.sum())
        k_rows = int(self.k_lengths.sum())
        out_rows = int(self.q_lengths.sum())
        gen = torch.Generator(device=device).manual_seed(7)

        def rnd(rows):
            return torch.randn(rows, H, D, generator=gen, device=device, dtype=DTYPE)

        self.q, self.k, self.v, self.grad = rnd(q_rows), rnd(k_rows), rnd(k_rows), rnd(out_rows)
        self.name = name or f"{kind}/B{batch}xL{max_len}"
        pairs = float((self.q_lengths.double() * self.k_lengths.double()).sum())
        self.fwd_flops = 4.0 * H * D * pairs
        self.bytes = 2.0 * H * D * (2 * k_rows + q_rows + out_rows)

    def leaves(self):
        return grad_leaves((self.q, self.k, self.v))


# ---------------------------------------------------------------------------------------------
# Providers: (fwd_fn, fwd_bwd_fn, grad_leaves) or raise NotImplementedError.


def provider_gem(case: Case, config=None, activation=ACT):
    def call(q, k, v):
        if config is None:
            return gdpa(q, k, v, case.q_off, case.k_off, activation=activation, backend="triton")
        q_len = None if case.kind == "pma" else case.q_lengths
        k_len = None if case.kind == "self" else case.k_lengths
        return gt.gdpa_from_lengths(q, k, v, q_len, k_len, activation=activation, config=config)

    return autograd_provider(call, (case.q, case.k, case.v), case.grad)


def _pad(t, lengths, max_len):
    batch = lengths.numel()
    out = torch.zeros(batch, max_len, H, D, dtype=t.dtype, device=t.device)
    sample = torch.repeat_interleave(torch.arange(batch), lengths).to(t.device)
    starts = _offsets(lengths)[:-1]
    pos = (torch.arange(int(lengths.sum())) - starts.repeat_interleave(lengths)).to(t.device)
    out[sample, pos] = t
    return out.transpose(1, 2).contiguous()  # (B, H, L, D)


def _padded_inputs(case: Case):
    if case.kind == "pma":
        qp = case.q.transpose(0, 1).unsqueeze(0).expand(case.batch, H, NUM_QUERIES, D)
        qp = qp.contiguous()
    else:
        qp = _pad(case.q, case.q_lengths, int(case.q_lengths.max()))
    lk = int(case.k_lengths.max())
    kp, vp = (_pad(t, case.k_lengths, lk) for t in (case.k, case.v))
    gp = _pad(case.grad, case.q_lengths, int(case.q_lengths.max()))
    return qp, kp, vp, gp


_COMPILED = {}


def provider_compile_padded(case: Case):
    if case.name not in COMPILE_OK:
        raise NotImplementedError("padded score tensor too large for this shape")
    act = gdpa_activation(ACT)
    if "fn" not in _COMPILED:
        raise_recompile_limits(64)

        def padded_gdpa(q, k, v, key_mask):
            s = torch.matmul(q, k.transpose(-1, -2)).float() * (D**-0.5)
            p = torch.where(key_mask, act(s), 0.0).to(q.dtype)
            return torch.matmul(p, v)

        _COMPILED["fn"] = torch.compile(padded_gdpa, dynamic=False)
    fn = _COMPILED["fn"]
    qp, kp, vp, gp = _padded_inputs(case)
    lk = kp.shape[2]
    key_mask = (torch.arange(lk)[None, :] < case.k_lengths[:, None]).to(qp.device)
    key_mask = key_mask[:, None, None, :]
    return autograd_provider(lambda q, k, v: fn(q, k, v, key_mask), (qp, kp, vp), gp)


def provider_sdpa_padded(case: Case):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qp, kp, vp, gp = _padded_inputs(case)

    def fwd():
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]), torch.no_grad():
            return F.scaled_dot_product_attention(qp, kp, vp)

    leaves = [t.detach().clone().requires_grad_(True) for t in (qp, kp, vp)]

    def fwd_bwd():
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            F.scaled_dot_product_attention(*leaves).backward(gp)

    return fwd, fwd_bwd, leaves


def provider_njt(case: Case):
    if case.kind == "self":
        raise NotImplementedError("njt_sdpa is measured for the asymmetric shapes only")
    dev = case.q.device
    q_off = _offsets(case.q_lengths).to(dev)
    k_off = _offsets(case.k_lengths).to(dev)
    q_src = case.q.repeat(case.batch, 1, 1) if case.kind == "pma" else case.q

    def nest(t, off, lengths):
        return torch.nested.nested_tensor_from_jagged(
            t, offsets=off, max_seqlen=int(lengths.max()), min_seqlen=int(lengths.min())
        ).transpose(1, 2)

    def run(q, k, v):
        return F.scaled_dot_product_attention(
            nest(q, q_off, case.q_lengths),
            nest(k, k_off, case.k_lengths),
            nest(v, k_off, case.k_lengths),
        )

    def fwd():
        with torch.no_grad():
            return run(q_src, case.k, case.v)

    leaves = [t.detach().clone().requires_grad_(True) for t in (q_src, case.k, case.v)]

    def fwd_bwd():
        run(*leaves).transpose(1, 2).values().backward(case.grad)

    return fwd, fwd_bwd, leaves


PEERS = {
    "compile_padded": provider_compile_padded,
    "sdpa_flash_padded": provider_sdpa_padded,
    "njt_sdpa": provider_njt,
}


# ---------------------------------------------------------------------------------------------


def _measure(rows, errors, case, provider, make, modes=("fwd", "fwd_bwd")):
    try:
        fwd, fwd_bwd, leaves = make()
    except NotImplementedError as why:
        print(f"skip {case.name} {provider}: {why}")
        return {}
    except Exception as error:  # noqa: BLE001
        errors.append(f"{case.name} {provider}: {error!r}"[:300])
        print(errors[-1])
        return {}
    times = {}
    for mode in modes:
        try:
            fn = fwd if mode == "fwd" else fwd_bwd
            ms = _bench(fn, grad_to_none=leaves if mode == "fwd_bwd" else None)
        except Exception as error:  # noqa: BLE001
            errors.append(f"{case.name} {provider} {mode}: {error!r}"[:300])
            print(errors[-1])
            torch.cuda.empty_cache()
            continue
        times[mode] = ms
        flops = case.fwd_flops * (3.5 if mode == "fwd_bwd" else 1.0)
        rows.append(dict(case=case.name, provider=provider, mode=mode, metric="ms", value=ms))
        rows.append(
            dict(case=case.name, provider=provider, mode=mode, metric="tflops",
                 value=flops / ms * 1e-9)
        )  # fmt: skip
        if case.kind == "pma" and mode == "fwd":
            rows.append(
                dict(case=case.name, provider=provider, mode=mode, metric="gbps",
                     value=case.bytes / ms * 1e-6)
            )  # fmt: skip
        if case.kind == "pma" and mode == "fwd" and provider == "gem":
            # Kernel time without host overhead: eager calls of ~0.15 ms are host-bound.
            try:
                graph = _graph_ms(fwd)
            except Exception as error:  # noqa: BLE001 - report and keep benchmarking
                errors.append(f"{case.name} {provider} graph: {error!r}"[:300])
                graph = float("nan")
            for metric, value in (("graph_ms", graph), ("graph_gbps", case.bytes / graph * 1e-6)):
                rows.append(dict(case=case.name, provider=provider, mode=mode, metric=metric,
                                 value=value))  # fmt: skip
            print(f"{case.name:22s} {provider:20s} graph    {graph:8.3f} ms "
                  f"{case.bytes / graph * 1e-6:7.0f} GB/s")  # fmt: skip
        print(f"{case.name:22s} {provider:20s} {mode:8s} {ms:8.3f} ms "
              f"{flops / ms * 1e-9:7.1f} TFLOP/s")  # fmt: skip
    return times


# Samples of at most SHORT_SEQUENCE_LEN keys (the default's 64x32 forward tiles).
SHORT_CHECK_LEN = [0, 1, 300, 77, 513, 64, 1000, 129, 1024]
CHECK_CASES = 7  # cases of check() without a config


def check(device, config=None, only=None) -> dict:
    """gem (bf16 and fp32 inputs) against the fp32 reference on small jagged problems
    (``config``: gem's config, else the default one through the public entry point; ``only``:
    the index of the one case to run)."""
    results = {}
    gen = torch.Generator().manual_seed(0)
    # 2500: PMA keys and cross queries long enough for the split-KV / split-Q partial paths.
    q_len = [0, 1, 300, 77, 513, 64, 1000, 129, 2500]
    k_len = [5, 0, 129, 200, 256, 1, 17, 256, 100]
    cases = [
        ("self", q_len, None, dict(activation="gelu_fast", causal=True, window=(100, None))),
        ("self", q_len, None, dict(activation="silu", window=(40, 30), normalize_by_length=True)),
        ("cross", q_len, k_len, dict(activation="gelu_tanh", causal=True)),
        ("pma", None, q_len, dict(activation="gelu", normalize_by_length=True)),
        # Unmasked: the default's one-loop / TMA kernels (long and short tiles, short KV).
        ("self", q_len, None, dict(activation="gelu_fast")),
        ("self", SHORT_CHECK_LEN, None, dict(activation="gelu_fast", normalize_by_length=True)),
        ("cross", q_len, k_len, dict(activation="gelu_fast")),
    ]
    if config is not None and config.packed_gelu:  # the packed path is gelu_fast's only
        cases += [
            ("cross", q_len, k_len, dict(activation="gelu_fast", window=(None, 40))),
            ("pma", None, q_len, dict(activation="gelu_fast")),
            ("self", q_len, None, dict(activation="gelu_fast")),
        ]
    for i, (kind, ql, kl, opts) in enumerate(cases):
        if only is not None and i != only:
            continue
        for dtype in (torch.bfloat16, torch.float32) if i == 1 else (torch.bfloat16,):
            name = f"{i}:{kind}:{opts.get('activation')}:{str(dtype)[6:]}"
            try:
                keys = ql if kl is None else kl
                q_rows = 32 if ql is None else sum(ql)
                tensors = [
                    torch.randn(n, H, D, generator=gen).to(device, dtype)
                    for n in (q_rows, sum(keys), sum(keys))
                ]
                q_off = None if ql is None else _offsets(torch.tensor(ql))
                k_off = None if kl is None else _offsets(torch.tensor(kl))
                leaves = [t.clone().requires_grad_(True) for t in tensors]
                ref_leaves = [t.float().requires_grad_(True) for t in tensors]
                if config is None or dtype == torch.float32:  # fp32 takes its own tiles
                    out = gdpa(*leaves, q_off, k_off, backend="triton", **opts)
                else:
                    q_lens = None if ql is None else torch.tensor(ql)
                    k_lens = None if kl is None else torch.tensor(kl)
                    out = gt.gdpa_from_lengths(*leaves, q_lens, k_lens, config=config, **opts)
                ref = gdpa(*ref_leaves, q_off, k_off, backend="reference", **opts)
                g = torch.randn(out.shape, generator=gen).to(device)
                out.backward(g.to(dtype))
                ref.backward(g)
                errs = [rel_error(out, ref)] + [
                    rel_error(a.grad, b.grad) for a, b in zip(leaves, ref_leaves, strict=True)
                ]
                results[name] = [round(e, 6) for e in errs]
                print(f"check {name}: " + " ".join(f"{e:.1e}" for e in errs))
            except Exception as error:  # noqa: BLE001
                results[name] = repr(error)[:300]
                print(f"check {name} FAILED: {error!r}"[:600])
                traceback.print_exc()
    return results


def _time_config(case, config, modes=("fwd", "fwd_bwd")):
    fwd, fwd_bwd, leaves = provider_gem(case, config)
    out = {}
    for mode in modes:
        try:
            out[mode] = _bench(fwd if mode == "fwd" else fwd_bwd, leaves if mode != "fwd" else None)
        except Exception as error:  # noqa: BLE001
            print(f"  {mode} failed: {error!r}"[:300])
            out[mode] = float("inf")
    return out


def sweep(device, deadline) -> gt.GdpaTritonConfig:
    """Times tile/schedule variants; returns the config made of the fastest choices."""
    best = gt.default_config(D)
    cases = {
        "self4096": Case("self", 128, 4096, device),
        "self1024": Case("self", 512, 1024, device),
    }

    def pick(label, variants, case_names, mode):
        nonlocal best
        scores = {}
        for name, change in variants.items():
            if time.time() > deadline:
                print("sweep deadline reached")
                break
            config = replace(best, **change)
            total = 0.0
            for cname in case_names:
                total += _time_config(cases[cname], config, (mode,))[mode]
            scores[name] = total
            print(f"sweep {label:6s} {name:28s} {mode} sum {total:8.3f} ms")
        if scores:
            winner = min(scores, key=scores.get)
            best = replace(best, **variants[winner])
            print(f"sweep {label}: {winner}")

    fwd_variants = {
        "default": {},
        "f128x128": dict(fwd_block_n=128),
        "f128x64w8s4": dict(fwd_stages=4),
        "f64x128w4s3": dict(fwd_block_m=64, fwd_warps=4),
    }
    fwd_variants["zigzag_x2"] = dict(programs_per_sm=2)
    fwd_variants["sorted"] = dict(schedule="sorted")
    pick("fwd", fwd_variants, ["self4096", "self1024"], "fwd")
    bwd_variants = {
        "default": {},
        "b64x64/64x64w4s3": dict(dkdv_block_n=64, dq_block_m=64, bwd_warps=4),
        "b128x32/128x32w8s3": dict(dkdv_block_m=32, dq_block_n=32),
    }
    pick("bwd", bwd_variants, ["self4096"], "fwd_bwd")
    del cases["self4096"], cases["self1024"]
    torch.cuda.empty_cache()
    cases["cross4096"] = Case("cross", 128, 4096, device)
    cases["cross1024"] = Case("cross", 512, 1024, device)
    short_variants = {
        "default": {},
        "s64w8r512": dict(short_warps=8),
        "s128w8r512": dict(short_block_m=128, short_warps=8),
        "s64w4r1024": dict(short_rows_per_item=1024),
        "generic": dict(short_kv_max=0),
    }
    pick("short", short_variants, ["cross4096", "cross1024"], "fwd")
    cases["pma4096"] = Case("pma", 128, 4096, device)
    pma_variants = {
        "default": {},
        "p128w4s3": dict(pma_block_n=128, pma_stages=3),
        "p128w8s3": dict(pma_block_n=128, pma_warps=8, pma_stages=3),
    }
    pick("pma", pma_variants, ["pma4096"], "fwd")
    print(f"sweep best: {best}")
    return best


def _skew_config(config) -> gt.GdpaTritonConfig:
    """``config``, or the default one of the skew case's lengths (the schedules need tiles)."""
    if config is not None:
        return config
    return gt.default_config(D, max_len=int(_power_law_lengths().max()))


def skew(rows, errors, device, config):
    lengths = _power_law_lengths()
    case = Case("self", lengths.numel(), int(lengths.max()), device, lengths, "skew/alpha1.7")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    samples = gt._samples(case.q_lengths, case.q_lengths, None)
    _, work = gt._query_tile_items(samples, config.fwd_block_m, config.fwd_block_n, None, None)
    item_work = np.repeat(work, H)
    print(f"skew: B={case.batch}, max L={int(lengths.max())}, tokens={int(lengths.sum())}")
    for schedule in gt.GDPA_SCHEDULES:
        cfg = replace(config, schedule=schedule)
        per_sm = cfg.fwd_programs_per_sm or cfg.programs_per_sm
        loads = gt.schedule_loads(item_work, sms * per_sm, schedule)
        ratio = float(loads.max() / loads.mean())
        rows.append(dict(case=case.name, provider=f"gem-{schedule}", mode="fwd",
                         metric="max_over_mean", value=ratio))  # fmt: skip
        print(f"skew {schedule}: modelled max/mean SM work {ratio:.3f}")
        _measure(rows, errors, case, f"gem-{schedule}", lambda c=cfg: provider_gem(case, c))


# ---------------------------------------------------------------------------------------------
# Parallel warm-up of Triton's on-disk kernel cache: compiling dozens of kernel variants one
# after the other costs minutes of GPU-machine time; worker processes (spread over the visible
# GPUs) run every (case, config) once, so the timed process only loads cached binaries.

_WORKER_CASES: dict = {}


def _warm_job(job) -> str:
    spec, config, activation, modes, device_index = job
    try:
        torch.cuda.set_device(device_index)
        device = torch.device("cuda", device_index)
        if spec[0] == "check":
            check(device, config, spec[1])
            return "check"
        if spec[0] == "xcheck":
            _variant_errors(config, _check_problems(device))
            return "check"
        if spec not in _WORKER_CASES:
            _WORKER_CASES.clear()
            _WORKER_CASES[spec] = _case_of(spec, device)
        case = _WORKER_CASES[spec]
        if spec[0] == "block":
            import bench_block_attention as bba

            fwd, fwd_bwd, _ = bba.provider_gem(case, config)
        else:
            fwd, fwd_bwd, _ = provider_gem(case, config, activation)
        for mode in modes:
            (fwd if mode == "fwd" else fwd_bwd)()
        torch.cuda.synchronize()
        return f"{spec} ok"
    except Exception as error:  # noqa: BLE001
        return f"{spec} {error!r}"[:300]


def _case_of(spec, device) -> Case:
    if spec == "skew":
        lengths = _power_law_lengths()
        return Case("self", lengths.numel(), int(lengths.max()), device, lengths, "skew/alpha1.7")
    if spec[0] == "block":
        import bench_block_attention as bba

        return bba.Case(spec[1], spec[2], device)
    return Case(*spec, device)


def precompile(jobs, workers: int) -> None:
    """Runs ``jobs`` ``(case spec, config, activation, modes)`` in ``workers`` processes."""
    if workers <= 0 or not jobs:
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    start = time.time()
    gpus = 1  # tensors of other devices fail Triton's pointer check in the worker
    # Jobs of one case stay together (a worker keeps its last case's tensors).
    jobs = sorted(jobs, key=lambda job: str(job[0]))
    tagged = [(*job, i % gpus) for i, job in enumerate(jobs)]
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        for result in pool.map(_warm_job, tagged):
            if not result.endswith("ok") and result != "check":  # noqa: SIM102
                print(f"precompile: {result}")
    print(f"precompiled {len(jobs)} jobs in {time.time() - start:.0f} s")


def _pma_variants(base: gt.GdpaTritonConfig) -> dict:
    """PMA forward variants of ``--explore``: the split-KV items and the streamed kernel."""
    out = {"items": replace(base, pma_stream=False)}
    stream = replace(base, pma_stream=True)
    for n, w, st, x in [(128, 4, 2, 1), (128, 4, 2, 2), (128, 8, 3, 1), (64, 4, 3, 2),
                        (64, 4, 2, 3), (32, 4, 4, 2), (32, 4, 3, 3)]:  # fmt: skip
        out[f"stream-n{n}w{w}s{st}x{x}"] = replace(
            stream, pma_block_n=n, pma_warps=w, pma_stages=st, pma_programs_per_sm=x
        )
    return out


def _block_variants() -> dict:
    """BlockAttention forward variants of ``--explore`` (old default: offsets lookup)."""
    from gem_kernels.block_attention_triton import BlockAttentionTritonConfig as BlockConfig

    base = BlockConfig()
    out = {"old": replace(base, fwd_block_table=False), "table": base}
    out["table-w2"] = replace(base, fwd_warps=2)
    out["table-s1"] = replace(base, fwd_stages=1)
    for h, w, st, x in [(4, 4, 2, 1), (4, 4, 2, 2), (4, 4, 2, 4), (1, 4, 3, 2)]:
        out[f"pers-h{h}w{w}s{st}x{x}"] = replace(
            base, fwd_heads_per_program=h, fwd_warps=w, fwd_stages=st, fwd_programs_per_sm=x
        )
    return out


def _host_us(fn, calls: int = 50) -> float:
    """Host microseconds per call (enqueue only; the GPU queue is drained before and after)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    return host


def _graph_ms(fn) -> float:
    """Median ms of ``fn`` replayed from a CUDA graph (GPU time without host overhead)."""
    import triton.testing

    with torch.cuda.stream(torch.cuda.Stream()):
        return triton.testing.do_bench_cudagraph(fn, rep=40, return_mode="median")


def explore(device, out_path: Path, workers: int) -> None:
    """One-call exploration of the bandwidth-bound forwards: PMA (split-KV items against the
    streamed kernel) and BlockAttention (offsets vs block table, persistent grids), after a
    GPU correctness check of every variant against the reference / the old default. Each
    variant is timed eagerly, from a CUDA graph (kernel time) and for its host time."""
    import bench_block_attention as bba

    pma = _pma_variants(gt.default_config(D, masked=True))  # PMA's configuration
    blocks = _block_variants()
    plan = []  # (spec, variant name, config)
    for shape in ASYM_SHAPES:
        plan += [(("pma", *shape), name, cfg) for name, cfg in pma.items()]
        plan.append((("pma", *shape), "public-default", None))
    for shape in bba.SHAPES:
        plan += [(("block", *shape), name, cfg) for name, cfg in blocks.items()]
        plan.append((("block", *shape), "public-default", None))
    jobs = [(spec, cfg, ACT, ("fwd",)) for spec, _, cfg in plan]
    precompile(jobs, workers)
    checks, rows = {}, []
    # Correctness: PMA variants against the float32 reference on a small jagged problem with
    # long keys (split segments) and an empty sample, normalised; block variants vs "old".
    gen = torch.Generator().manual_seed(0)
    lengths = torch.tensor([0, 1, 300, 77, 2500, 64, 1000, 129, 5000])
    q, k, v = (torch.randn(n, H, D, generator=gen).to(device, DTYPE)
               for n in (NUM_QUERIES, int(lengths.sum()), int(lengths.sum())))  # fmt: skip
    k_off = _offsets(lengths).to(device)
    ref = gdpa(q.float(), k.float(), v.float(), None, k_off, activation=ACT,
               normalize_by_length=True, backend="reference")  # fmt: skip
    for name, cfg in pma.items():
        got = gt.gdpa_from_lengths(q, k, v, None, lengths, activation=ACT, config=cfg,
                                   normalize_by_length=True)  # fmt: skip
        checks[f"pma-{name}"] = round(rel_error(got, ref), 6)
    current = None
    for spec, name, cfg in plan:
        if spec != current:
            case = None
            torch.cuda.empty_cache()
            case = _case_of(spec, device)
            current, base_out = spec, None
        if spec[0] == "block":
            fwd, _, _ = bba.provider_gem(case, cfg)
            out = fwd()
            base_out = out if base_out is None else base_out
            checks[f"block/{case.name}-{name}"] = round(rel_error(out, base_out), 6)
            size = 4 * case.tensor_bytes
            label = f"block/{case.name}"
        else:
            fwd, _, _ = provider_gem(case, cfg)
            size = case.bytes
            label = case.name
        ms = _bench(fwd)
        try:
            graph = _graph_ms(fwd)
        except Exception as error:  # noqa: BLE001
            print(f"graph {label} {name}: {error!r}"[:300])
            graph = float("nan")
        host = _host_us(fwd)
        for metric, value in (("ms", ms), ("gbps", size / ms * 1e-6), ("graph_ms", graph),
                              ("graph_gbps", size / graph * 1e-6), ("host_us", host)):  # fmt: skip
            rows.append(dict(case=label, provider=f"gem-{name}", mode="fwd", metric=metric,
                             value=value))  # fmt: skip
        print(f"{label:20s} {name:20s} eager {ms:7.4f} ms {size / ms * 1e-6 / 4270:6.1%} | "
              f"graph {graph:7.4f} ms {size / graph * 1e-6 / 4270:6.1%} | host {host:5.0f} us",
              flush=True)  # fmt: skip
    print("checks:", checks)
    write_results(out_path, meta("gdpa_explore", "bench_gdpa.py --explore", checks=checks), rows)


def _self_cross_variants(base: gt.GdpaTritonConfig) -> dict:
    """Self/cross variants of ``--explore-self-cross``: name -> (config, kinds, modes)."""
    fwd = ("fwd",)
    both = ("fwd", "fwd_bwd")
    ol = dict(fwd_one_loop=True)
    tma = dict(fwd_one_loop=True, fwd_kv_tma=True)
    m64 = dict(fwd_block_m=64, fwd_warps=4)
    out = {
        "default": (base, ("self", "cross"), both),
        "ol": (replace(base, **ol), ("self",), fwd),
        "ol-pipe": (replace(base, **ol, fwd_pipeline=True), ("self",), fwd),
        "tma": (replace(base, **tma), ("self",), fwd),
        "tma-pipe": (replace(base, **tma, fwd_pipeline=True), ("self",), fwd),
        "tma-s2": (replace(base, **tma, fwd_stages=2), ("self",), fwd),
        "tma-s4": (replace(base, **tma, fwd_stages=4), ("self",), fwd),
        "tma-x2": (replace(base, **tma, fwd_programs_per_sm=2), ("self",), fwd),
        "m64-ol-x2": (replace(base, **m64, **ol, fwd_programs_per_sm=2), ("self",), fwd),
        "m64-tma-x2": (replace(base, **m64, **tma, fwd_programs_per_sm=2), ("self",), fwd),
        "m64-tma-s2x2": (
            replace(base, **m64, **tma, fwd_stages=2, fwd_programs_per_sm=2),
            ("self",),
            fwd,
        ),
        "m64-tma-s2x3": (
            replace(base, **m64, **tma, fwd_stages=2, fwd_programs_per_sm=3),
            ("self",),
            fwd,
        ),
        "m64-tma-pipe-x2": (
            replace(base, **m64, **tma, fwd_pipeline=True, fwd_programs_per_sm=2),
            ("self",),
            fwd,
        ),
        "m64n128-tma-s2x2": (
            replace(base, **m64, **tma, fwd_block_n=128, fwd_stages=2, fwd_programs_per_sm=2),
            ("self",),
            fwd,
        ),
        "n128-tma-pipe": (replace(base, **tma, fwd_block_n=128, fwd_pipeline=True), ("self",), fwd),
        # Backward: one loop, 64-wide 4-warp tiles with 2 programs per SM.
        "bol": (replace(base, bwd_one_loop=True), ("self",), ("fwd_bwd",)),
        "bol-x2": (
            replace(base, bwd_one_loop=True, bwd_programs_per_sm=2),
            ("self",),
            ("fwd_bwd",),
        ),
        "b64w4-bol-x2": (
            replace(
                base,
                bwd_one_loop=True,
                dkdv_block_n=64,
                dq_block_m=64,
                bwd_warps=4,
                bwd_programs_per_sm=2,
            ),
            ("self",),
            ("fwd_bwd",),
        ),  # fmt: skip
        "b64w4-bol-x3s2": (
            replace(
                base,
                bwd_one_loop=True,
                dkdv_block_n=64,
                dq_block_m=64,
                bwd_warps=4,
                bwd_programs_per_sm=3,
                bwd_stages=2,
            ),
            ("self",),
            ("fwd_bwd",),
        ),  # fmt: skip
        # Cross (short-KV forward).
        "mf": (replace(base, short_mask_free=True), ("cross",), fwd),
        "mf-m64": (replace(base, short_mask_free=True, short_block_m=64), ("cross",), fwd),
        "mf-m64w4x2": (
            replace(
                base, short_mask_free=True, short_block_m=64, short_warps=4, fwd_programs_per_sm=2
            ),
            ("cross",),
            fwd,
        ),  # fmt: skip
        "mf-m64w4x3": (
            replace(
                base, short_mask_free=True, short_block_m=64, short_warps=4, fwd_programs_per_sm=3
            ),
            ("cross",),
            fwd,
        ),  # fmt: skip
        "generic-tma": (replace(base, **tma, short_kv_max=0), ("cross",), fwd),
        "generic-m64-tma-x2": (
            replace(base, **m64, **tma, short_kv_max=0, fwd_programs_per_sm=2),
            ("cross",),
            fwd,
        ),
    }
    return out


def _self_cross_variants2(base: gt.GdpaTritonConfig) -> dict:
    """Second round of ``--explore-self-cross`` (``--explore-set 2``): combinations of the
    first round's winners (64-row 4-warp tiles with TMA at L1024, the hand-pipelined 128-row
    TMA loop at L4096, the one-loop backward with 2 programs per SM, the mask-free short-KV
    forward). The short-KV forward in two halves, measured here too and slower, was removed."""
    fwd = ("fwd",)
    both = ("fwd", "fwd_bwd")
    tma = dict(fwd_one_loop=True, fwd_kv_tma=True)
    m64 = dict(fwd_block_m=64, fwd_warps=4, fwd_programs_per_sm=2, **tma)
    pipe = dict(fwd_pipeline=True, **tma)
    bol = dict(bwd_one_loop=True, bwd_programs_per_sm=2)
    mf = dict(short_mask_free=True)
    return {
        "default": (base, ("self", "cross"), fwd),
        "m64-tma-x2-bolx2": (replace(base, **m64, **bol), ("self",), both),
        "m64n32-tma-x3": (
            replace(base, **m64 | dict(fwd_block_n=32, fwd_programs_per_sm=3)),
            ("self",),
            fwd,
        ),
        "tma-pipe-bolx2": (replace(base, **pipe, **bol), ("self",), both),
        "tma-pipe-x2-bolx2": (
            replace(base, **pipe, **bol, fwd_programs_per_sm=2),
            ("self",),
            both,
        ),  # fmt: skip
        "tma-pipe-s4": (replace(base, **pipe, fwd_stages=4), ("self",), fwd),
        "tma-pipe-x2-s4": (
            replace(base, **pipe, fwd_stages=4, fwd_programs_per_sm=2),
            ("self",),
            fwd,
        ),  # fmt: skip
        "mf": (replace(base, **mf), ("cross",), fwd),
        "mf-x2": (replace(base, **mf, fwd_programs_per_sm=2), ("cross",), fwd),
        "mf-s3": (replace(base, **mf, short_stages=3), ("cross",), fwd),
        "mf-r256": (replace(base, **mf, short_rows_per_item=256), ("cross",), fwd),
        "mf-r1024": (replace(base, **mf, short_rows_per_item=1024), ("cross",), fwd),
        "mf-bolx2": (replace(base, **mf, **bol), ("cross",), ("fwd_bwd",)),
    }


def _self_cross_variants3() -> dict:
    """Third round of ``--explore-self-cross`` (``--explore-set 3``): the fused backward
    (``bwd_fused``: dQ by float32 atomics inside the dK/dV kernel) and its tiles, against the
    default (when round 3 ran the default was the two-kernel backward; rerun now, "default" is
    the fused one and ``bwd_fused=False`` is the old). Values are overrides of each case's own
    default config (short/long tiles)."""
    both = ("fwd", "fwd_bwd")
    fused = dict(bwd_fused=True)
    return {
        "default": ({}, ("self", "cross"), both),
        "fused": (fused, ("self", "cross"), ("fwd_bwd",)),
        "fused-x1": (fused | dict(bwd_programs_per_sm=1), ("self", "cross"), ("fwd_bwd",)),
        "fused-s2": (fused | dict(bwd_stages=2), ("self", "cross"), ("fwd_bwd",)),
        "fused-n64": (fused | dict(dkdv_block_n=64), ("self", "cross"), ("fwd_bwd",)),
        "fused-n64m128": (
            fused | dict(dkdv_block_n=64, dkdv_block_m=128),
            ("self", "cross"),
            ("fwd_bwd",),
        ),
        "fused-n64w4": (
            fused | dict(dkdv_block_n=64, bwd_warps=4, bwd_stages=2),
            ("self", "cross"),
            ("fwd_bwd",),
        ),  # fmt: skip
        "fused-m32": (fused | dict(dkdv_block_m=32), ("self", "cross"), ("fwd_bwd",)),
    }


def _self_cross_variants4() -> dict:
    """Fourth round (``--explore-set 4``): tiles of the fused backward (the default since
    round 3): pipelining depth and, for cross attention, the query rows per dK/dV item."""
    kinds = ("self", "cross")
    return {
        "default": ({}, kinds, ("fwd_bwd",)),
        "s4": (dict(bwd_stages=4), kinds, ("fwd_bwd",)),
        "qc1024": (dict(dkdv_q_chunk=1024), ("cross",), ("fwd_bwd",)),
        "qc0": (dict(dkdv_q_chunk=0), ("cross",), ("fwd_bwd",)),
    }


def _old_default(spec) -> dict:
    """Overrides that give a case the forward default before warp specialisation (short: 64x32
    tiles, 3 programs per SM and the short-KV cross kernel; long: the hand-pipelined 128x64)."""
    max_len = CROSS_KV if spec[0] == "cross" else (spec[2] if len(spec) > 2 else None)
    old = dict(fwd_warp_specialize=False)
    if max_len is not None and max_len <= gt.SHORT_SEQUENCE_LEN:
        return old | dict(fwd_block_m=64, fwd_block_n=32, fwd_warps=4, fwd_stages=3,
                          fwd_programs_per_sm=3, short_kv_max=256)  # fmt: skip
    return old | dict(fwd_block_m=128, fwd_block_n=64, fwd_warps=8, fwd_stages=4,
                      fwd_programs_per_sm=2, fwd_pipeline=True)  # fmt: skip


def _self_cross_variants5() -> dict:
    """Fifth round (``--explore-set 5``): Triton's automatic warp specialisation on Hopper
    (``tl.range(..., warp_specialize=True)``) of the one-loop forward over whole-tensor TMA
    descriptors, 128-row tiles, 4 warps per consumer group, 1 program per SM ("default" when
    this round ran, ``tuning/gdpa_explore5b.json``: 128x128 tiles, 2 stages up to 1024 keys, cross
    attention on the generic path; 128x64 beyond, since reverted), against the default before
    it ("old", per case) and a few tiles, stages and schedules. Forward only. (Its first run,
    ``tuning/gdpa_explore5.json``, remade per-item descriptors in the persistent loop: wrong results,
    and the short-KV cross kernel did not compile with the flag.)"""
    fwd = ("fwd",)
    both = ("self", "cross")
    ws = dict(fwd_pipeline=False, fwd_warp_specialize=True, fwd_warps=4, fwd_programs_per_sm=1)
    return {
        "default": ({}, both, fwd),
        "old": (_old_default, both, fwd),
        "ws-n64s2": (ws | dict(fwd_block_m=128, fwd_block_n=64, fwd_stages=2), both, fwd),
        "ws-n64s3": (ws | dict(fwd_block_m=128, fwd_block_n=64, fwd_stages=3), both, fwd),
        "ws-n128s2": (ws | dict(fwd_block_m=128, fwd_block_n=128, fwd_stages=2), both, fwd),
        "ws-n128s2-x2": (
            ws | dict(fwd_block_m=128, fwd_block_n=128, fwd_stages=2, fwd_programs_per_sm=2),
            ("self",),
            fwd,
        ),  # fmt: skip
        "ws-n128s2-sorted": (
            ws | dict(fwd_block_m=128, fwd_block_n=128, fwd_stages=2, schedule="sorted"),
            ("self",),
            fwd,
        ),  # fmt: skip
    }


_SEEN_KERNELS: set = set()


def _new_kernel_stats() -> list[dict]:
    """Registers, spills, warps (after warp specialisation) and shared memory of the GDPA
    forward kernels compiled or loaded since the last call (Triton's in-memory caches)."""
    kernels = gt._kernels(False)
    stats = []
    for fn_name in ("gdpa_fwd_kernel", "gdpa_fwd_short_kv_kernel"):
        caches = getattr(getattr(kernels, fn_name), "device_caches", {})
        for entry in list(caches.values()):
            cache = entry[0] if isinstance(entry, tuple) else entry
            for compiled in list(cache.values()):
                if id(compiled) in _SEEN_KERNELS:
                    continue
                _SEEN_KERNELS.add(id(compiled))
                try:
                    md = compiled.metadata
                    stats.append(dict(
                        kernel=fn_name, regs=getattr(compiled, "n_regs", None),
                        spills=getattr(compiled, "n_spills", None),
                        warps=getattr(md, "num_warps", None), shared=getattr(md, "shared", None),
                    ))  # fmt: skip
                except Exception as error:  # noqa: BLE001 - stats are informative only
                    stats.append(dict(kernel=fn_name, error=repr(error)[:200]))
    return stats


def _triton_version() -> str:
    import triton

    return triton.__version__


def _round3_config(overrides: dict, spec) -> gt.GdpaTritonConfig:
    """The case's default config (by its longest key length) with ``overrides`` (a dict, or a
    function of the case spec returning one)."""
    if callable(overrides):
        overrides = overrides(spec)
    max_len = CROSS_KV if spec[0] == "cross" else (spec[2] if len(spec) > 2 else None)
    return replace(gt.default_config(D, max_len=max_len), **overrides)


def _check_problems(device) -> list:
    """Small jagged self and cross problems (bf16 inputs, gelu_fast, with and without a
    window) with the float32 reference's output and gradients."""
    gen = torch.Generator().manual_seed(0)
    q_len = [0, 1, 300, 77, 513, 64, 1000, 129, 2500]
    k_len = [5, 0, 129, 200, 256, 1, 17, 256, 100]
    problems = []
    for kind, ql, kl in (("self", q_len, None), ("cross", q_len, k_len)):
        keys = ql if kl is None else kl
        tensors = [torch.randn(n, H, D, generator=gen).to(device, DTYPE).float()
                   for n in (sum(ql), sum(keys), sum(keys))]  # fmt: skip
        grad = torch.randn(sum(ql), H, D, generator=gen).to(device, DTYPE).float()
        for opts in (dict(), dict(window=(200, 30), normalize_by_length=True)):
            leaves = [t.clone().requires_grad_(True) for t in tensors]
            ref = gdpa(*leaves, _offsets(torch.tensor(ql)),
                       None if kl is None else _offsets(torch.tensor(kl)), activation=ACT,
                       backend="reference", **opts)  # fmt: skip
            ref.backward(grad)
            want = [ref.detach()] + [t.grad for t in leaves]
            label = f"{kind}{'-win' if opts else ''}"
            problems.append((label, ql, kl, tensors, grad, opts, want))
    return problems


def _variant_errors(cfg, problems, forward_only: bool = False) -> dict:
    """Relative errors (out, dq, dk, dv; ``forward_only``: out) of gem with ``cfg`` on each
    check problem."""
    errs = {}
    for label, ql, kl, tensors, grad, opts, want in problems:
        try:
            leaves = [t.to(DTYPE).requires_grad_(True) for t in tensors]
            out = gt.gdpa_from_lengths(
                *leaves, torch.tensor(ql), None if kl is None else torch.tensor(kl),
                activation=ACT, config=cfg, **opts,
            )  # fmt: skip
            if forward_only:
                errs[label] = [round(rel_error(out, want[0]), 5)]
                continue
            out.backward(grad.to(DTYPE))
            got = [out] + [t.grad for t in leaves]
            errs[label] = [round(rel_error(a, b), 5) for a, b in zip(got, want, strict=True)]
        except Exception as error:  # noqa: BLE001
            errs[label] = repr(error)[:300]
            traceback.print_exc()
    return errs


def _explore_shapes() -> list:
    return [("self", b, n) for b, n in SELF_SHAPES] + [("cross", b, n) for b, n in ASYM_SHAPES]


def _correct(errors) -> bool:
    """Whether a check's relative errors (a list; else an error message) are all <= 0.05 (NaN
    fails)."""
    return isinstance(errors, list) and all(e <= 0.05 for e in errors)


def _round5_checks(cfg, problems) -> dict:
    """Forward errors of a round-5 variant (overrides): the self problem with the long- and
    short-sequence configs, the cross problem with the cross config (each the class's own
    default with ``cfg``)."""
    by_label = {p[0]: p for p in problems}
    out = {}
    for label, kind, spec in (
        ("self", "self", ("check",)), ("self-short", "self", ("self", 512, 1024)),
        ("cross", "cross", ("cross", 512, 1024)),
    ):  # fmt: skip
        errs = _variant_errors(_round3_config(cfg, spec), [by_label[kind]], forward_only=True)
        out[label] = errs[kind]
    return out


def warm_variant(name: str) -> None:
    """``--warm-variant NAME``: compiles, checks (forward, unwindowed problems) and runs once one
    round-5 variant in this process; exits non-zero when it fails or is wrong, so that a
    compiler crash or a faulting kernel costs only this process (see
    :func:`precompile_isolated`)."""
    device = torch.device("cuda")
    cfg, kinds, modes = _self_cross_variants5()[name]
    problems = [p for p in _check_problems(device) if not p[5]]
    errs = _round5_checks(cfg, problems)
    print(f"check {name}: {errs}", flush=True)
    bad = {k: v for k, v in errs.items() if not _correct(v)}
    if bad:
        raise SystemExit(f"{name} failed its check: {bad}")
    for spec in _explore_shapes():
        if spec[0] in kinds:
            result = _warm_job((spec, _round3_config(cfg, spec), ACT, modes, 0))
            if not result.endswith("ok"):
                raise SystemExit(result)


def precompile_isolated(names, workers: int, timeout_s: float) -> dict:
    """Runs ``--warm-variant`` for each round-5 variant in its own process, ``workers`` at a
    time: name -> ``None`` (compiled, correct) or why not (return code and output tail)."""
    import subprocess
    from concurrent.futures import ThreadPoolExecutor

    def one(name):
        cmd = [sys.executable, __file__, "--warm-variant", name]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return f"compile + check took over {timeout_s:.0f} s"
        if done.returncode == 0:
            return None
        return f"rc={done.returncode}: " + (done.stdout + done.stderr)[-600:]

    with ThreadPoolExecutor(max(workers, 1)) as pool:
        failed = dict(zip(names, pool.map(one, names), strict=True))
    for name, why in failed.items():
        if why:
            print(f"precompile {name}: {why}", flush=True)
    return failed


def explore_self_cross(device, out_path: Path, workers: int, budget_s: float, round_: int = 1):
    """One-call exploration of the self/cross forward and backward variants: a GPU check of
    every variant (bf16, gelu_fast, forward and all gradients against the float32 reference,
    self and cross, with and without a window) and its time on the protocol shapes."""
    start = time.time()
    shapes = _explore_shapes()
    if round_ >= 3:
        make = {3: _self_cross_variants3, 4: _self_cross_variants4, 5: _self_cross_variants5}
        variants = make[round_]()
        config_of = _round3_config
    else:
        make = _self_cross_variants2 if round_ == 2 else _self_cross_variants
        variants = make(gt.default_config(D, masked=True))  # the defaults before this round

        def config_of(cfg, spec):
            return cfg

    jobs = [
        (spec, config_of(cfg, spec), ACT, modes)
        for _, (cfg, kinds, modes) in variants.items()
        for spec in shapes
        if spec[0] in kinds
    ]
    # The check problems reach 2500 keys: the long-sequence tiles.
    jobs += [(("xcheck",), config_of(cfg, ("check",)), ACT, ()) for cfg, _, _ in variants.values()]
    # Round 5 (warp specialisation, forward only): each variant compiles in its own process (a
    # compiler crash or a faulting kernel must not end the run) and is checked forward-only on
    # the unwindowed problems (the only ones its flags change).
    forward_only = round_ == 5
    failed = precompile_isolated(list(variants), workers, 0.5 * budget_s) if forward_only else {}
    if not forward_only:
        precompile(jobs, workers)
    print(f"precompiled at {time.time() - start:.0f} s", flush=True)
    problems = _check_problems(device)
    if forward_only:
        problems = [p for p in problems if not p[5]]
    checks, kernel_stats = {}, {}
    _new_kernel_stats()  # kernels of the check problems' reference runs are not a variant's
    for name, (cfg, _, _) in variants.items():
        if failed.get(name):  # never run in this process
            checks[name] = {"failed": failed[name]}
            continue
        if not forward_only:
            checks[name] = _variant_errors(config_of(cfg, ("check",)), problems)
        else:  # twice: a race shows as a run-to-run difference; keep the worst
            checks[name] = _round5_checks(cfg, problems)
            again = _round5_checks(cfg, problems)
            for label, errs in again.items():
                first = checks[name].get(label)
                if isinstance(errs, list) and isinstance(first, list):
                    worst = [max(a, b) if a == a and b == b else float("nan")
                             for a, b in zip(first, errs, strict=True)]  # fmt: skip
                    checks[name][label] = worst
                else:
                    checks[name][label] = errs if isinstance(first, list) else first
        print(f"check {name}: {checks[name]}", flush=True)
        kernel_stats[f"{name}@check"] = _new_kernel_stats()
    rows = []
    for spec in shapes:
        if time.time() - start > budget_s:
            print(f"budget reached before {spec}")
            break
        case = Case(*spec, device)
        for name, (cfg, kinds, modes) in variants.items():
            if spec[0] not in kinds or not isinstance(checks[name].get(spec[0]), list):
                continue
            if forward_only and not all(map(_correct, checks[name].values())):
                continue  # round 5: wrong results are not timed
            times = _time_config(case, config_of(cfg, spec), modes)
            stats = _new_kernel_stats()
            if stats:
                kernel_stats[f"{name}@{case.name}"] = stats
                print(f"  kernels {name}: {stats}", flush=True)
            for mode, ms in times.items():
                flops = case.fwd_flops * (3.5 if mode == "fwd_bwd" else 1.0)
                rows.append(dict(case=case.name, provider=f"gem-{name}", mode=mode,
                                 metric="ms", value=ms))  # fmt: skip
                rows.append(dict(case=case.name, provider=f"gem-{name}", mode=mode,
                                 metric="tflops", value=flops / ms * 1e-9))  # fmt: skip
                print(f"{case.name:18s} {name:20s} {mode:8s} {ms:8.3f} ms "
                      f"{flops / ms * 1e-9:6.1f} TFLOP/s", flush=True)  # fmt: skip
        del case
        torch.cuda.empty_cache()
        command = f"bench_gdpa.py --explore-self-cross --explore-set {round_}"
        name = f"gdpa_explore{round_}" if round_ >= 3 else "gdpa_explore2"
        write_results(out_path, meta(name, command,
                                     device=torch.cuda.get_device_name(), checks=checks,
                                     variants={k: str(v[0]) for k, v in variants.items()},
                                     kernels=kernel_stats, triton=_triton_version()),
                      rows)  # fmt: skip
    print(f"explore done in {time.time() - start:.0f} s")


def _cross_variants(base: gt.GdpaTritonConfig, round_: int = 1) -> dict:
    """Cross forward variants of ``--explore-pma-cross`` (overrides of the cross default): the
    short-KV kernel's query rows per item and, in round 1, the generic pipelined TMA forward
    with the long-sequence tiles. When the rounds ran (``tuning/gdpa_explore4.json``,
    ``tuning/gdpa_explore4b.json``), "default" streamed 1024 query rows per item (4096 since); their
    chunked short-KV variants (``s2-*``, ``s4-*``) were slower and were removed with that
    kernel."""
    variants = {
        "default": base,
        "r1024": replace(base, short_rows_per_item=1024),
        "r2048": replace(base, short_rows_per_item=2048),
    }
    if round_ == 1:
        long_tiles = gt.default_config(D, max_len=4096)
        variants["generic-long"] = replace(long_tiles, short_kv_max=0)
    return variants


def _pma_wrapper_call(case: Case, cfg: gt.GdpaTritonConfig):
    """The PMA forward's launch wrapper alone (plan and launch resolved once, no checks)."""
    # PMA never takes the warp-specialised forward: no descriptor layout needed.
    launch = gt._Launch(1.0 / D**0.5, None, None, gt._ACTIVATION_CODES[ACT], False,
                        NUM_QUERIES, cfg, False, False)  # fmt: skip
    plan = gt._cached_plan(
        None,
        case.k_lengths.to(torch.int64),
        NUM_QUERIES,
        H,
        None,
        None,
        cfg,
        case.q.device,
        False,
        False,
        gt._pma_block_m(NUM_QUERIES, cfg),
    )
    out_rows = case.batch * NUM_QUERIES

    def call():
        with torch.no_grad():
            return gt._forward(case.q, case.k, case.v, plan, launch, out_rows)

    return call


def _eager_repeats(fn, repeats: int) -> list[float]:
    return [_bench(fn) for _ in range(repeats)]


def _host_profile(label: str, fn, calls: int = 300) -> None:
    """Prints the 15 most expensive functions (own time) of ``calls`` host calls of ``fn``."""
    import cProfile
    import io
    import pstats

    fn()
    torch.cuda.synchronize()
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(calls):
        fn()
    profile.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(15)
    print(f"host profile {label} ({calls} calls):\n" + text.getvalue()[-3500:], flush=True)


def explore_pma_cross(
    device, out_path: Path, workers: int, repeats: int = 5, round_: int = 1
) -> None:
    """Issue 4, round 4 (one H200 call): (1) the streamed PMA forward (stream + combine
    kernels): GPU check (reference, bit-equality over repeat calls), eager median ``repeats``
    times, CUDA-graph time and host enqueue time of the kernel wrapper, of
    ``gdpa_from_lengths`` and of the public ``gdpa``; (2) the cross forward variants of
    :func:`_cross_variants` at L1024 and L4096 after a GPU check against the reference. (The
    rounds recorded in ``tuning/gdpa_explore4.json`` / ``tuning/gdpa_explore4b.json`` also timed a one-launch
    PMA forward, ``gem-fused``: slower, removed.)"""
    start = time.time()
    pma = {"two-launch": gt.default_config(D, masked=True)}
    cross_base = gt.default_config(D, max_len=CROSS_KV)
    cross = _cross_variants(cross_base, round_)
    jobs = [(("pma", *shape), cfg, ACT, ("fwd",)) for shape in ASYM_SHAPES for cfg in pma.values()]
    jobs += [(("cross", *shape), cfg, ACT, ("fwd",)) for shape in ASYM_SHAPES
             for cfg in cross.values()]  # fmt: skip
    precompile(jobs, workers)
    print(f"precompiled at {time.time() - start:.0f} s", flush=True)
    checks, rows = {}, []

    def row(case, provider, metric, value, mode="fwd"):
        rows.append(dict(case=case, provider=provider, mode=mode, metric=metric, value=value))

    # PMA check: long keys (segments split over programs), an empty sample, normalised.
    gen = torch.Generator().manual_seed(0)
    lengths = torch.tensor([0, 1, 300, 77, 2500, 64, 1000, 129, 5000] * 8)
    q, k, v = (torch.randn(n, H, D, generator=gen).to(device, DTYPE)
               for n in (NUM_QUERIES, int(lengths.sum()), int(lengths.sum())))  # fmt: skip
    ref = gdpa(q.float(), k.float(), v.float(), None, _offsets(lengths).to(device),
               activation=ACT, normalize_by_length=True, backend="reference")  # fmt: skip
    outs = {}
    for name, cfg in pma.items():
        outs[name] = [gt.gdpa_from_lengths(q, k, v, None, lengths, activation=ACT, config=cfg,
                                           normalize_by_length=True) for _ in range(3)]  # fmt: skip
        checks[f"pma-{name}"] = round(rel_error(outs[name][0], ref), 6)
    torch.cuda.synchronize()
    checks["pma-bit-equal-3-calls"] = all(
        torch.equal(o, outs["two-launch"][0]) for o in outs["two-launch"]
    )
    print("pma checks:", checks, flush=True)
    for shape in ASYM_SHAPES:
        case = Case("pma", *shape, device)
        for name, cfg in pma.items():
            fwd, _, _ = provider_gem(case, cfg)
            fwd()
            times = _eager_repeats(fwd, repeats)
            graph = _graph_ms(fwd)
            host = [_host_us(fwd) for _ in range(3)]
            kernel_only = [_host_us(_pma_wrapper_call(case, cfg)) for _ in range(3)]
            for i, ms in enumerate(times):
                row(case.name, f"gem-{name}", f"ms_repeat{i}", ms)
            row(case.name, f"gem-{name}", "ms", float(np.median(times)))
            row(case.name, f"gem-{name}", "ms_min", min(times))
            row(case.name, f"gem-{name}", "gbps", case.bytes / float(np.median(times)) * 1e-6)
            row(case.name, f"gem-{name}", "graph_ms", graph)
            row(case.name, f"gem-{name}", "graph_gbps", case.bytes / graph * 1e-6)
            row(case.name, f"gem-{name}", "host_us", float(np.median(host)))
            row(case.name, f"gem-{name}", "host_us_kernel_wrapper", float(np.median(kernel_only)))
            print(f"{case.name:16s} {name:11s} eager " + " ".join(f"{t:.4f}" for t in times)
                  + f" ms | graph {graph:.4f} ms {case.bytes / graph * 1e-6 / 4270:.1%} | host "
                  f"{np.median(host):.0f} us (wrapper {np.median(kernel_only):.0f} us)",
                  flush=True)  # fmt: skip
        # The public entry point (default config of the call, validation included).
        fwd, _, _ = provider_gem(case)
        times = _eager_repeats(fwd, repeats)
        host = [_host_us(fwd) for _ in range(3)]
        for i, ms in enumerate(times):
            row(case.name, "gem-public-default", f"ms_repeat{i}", ms)
        row(case.name, "gem-public-default", "ms", float(np.median(times)))
        row(case.name, "gem-public-default", "host_us", float(np.median(host)))
        print(f"{case.name:16s} public      eager " + " ".join(f"{t:.4f}" for t in times)
              + f" ms | host {np.median(host):.0f} us", flush=True)  # fmt: skip
        if round_ >= 2 and case.batch == 128:  # where the host time goes
            _host_profile(f"public {case.name}", fwd)
        del case
        torch.cuda.empty_cache()
    # Cross: check every variant (forward, bf16, against the float32 reference).
    gen = torch.Generator().manual_seed(1)
    q_len = [0, 1, 300, 77, 513, 64, 1000, 129, 2500]
    k_len = [5, 0, 129, 200, 256, 1, 17, 256, 100]
    tensors = [torch.randn(n, H, D, generator=gen).to(device, DTYPE)
               for n in (sum(q_len), sum(k_len), sum(k_len))]  # fmt: skip
    for opts in (dict(), dict(normalize_by_length=True)):
        ref = gdpa(
            *(t.float() for t in tensors),
            _offsets(torch.tensor(q_len)),
            _offsets(torch.tensor(k_len)),
            activation=ACT,
            backend="reference",
            **opts,
        )
        for name, cfg in cross.items():
            try:
                got = gt.gdpa_from_lengths(*tensors, torch.tensor(q_len), torch.tensor(k_len),
                                           activation=ACT, config=cfg, **opts)  # fmt: skip
                checks[f"cross-{name}{'-norm' if opts else ''}"] = round(rel_error(got, ref), 6)
            except Exception as error:  # noqa: BLE001
                checks[f"cross-{name}{'-norm' if opts else ''}"] = repr(error)[:300]
    print("cross checks:", {k: v for k, v in checks.items() if k.startswith("cross")}, flush=True)
    for shape in ASYM_SHAPES:
        case = Case("cross", *shape, device)
        base_out = None
        for name, cfg in cross.items():
            if not isinstance(checks.get(f"cross-{name}"), float) or checks[f"cross-{name}"] > 1e-2:
                continue
            try:
                fwd, _, _ = provider_gem(case, cfg)
                out = fwd()
                base_out = out if base_out is None else base_out
                checks[f"{case.name}-{name}-vs-default"] = round(rel_error(out, base_out), 6)
                times = _eager_repeats(fwd, 2)
            except Exception as error:  # noqa: BLE001
                checks[f"{case.name}-{name}"] = repr(error)[:300]
                print(f"{case.name} {name}: {error!r}"[:300], flush=True)
                continue
            ms = min(times)
            row(case.name, f"gem-{name}", "ms", ms)
            row(case.name, f"gem-{name}", "tflops", case.fwd_flops / ms * 1e-9)
            print(f"{case.name:18s} {name:20s} fwd " + " ".join(f"{t:.4f}" for t in times)
                  + f" ms {case.fwd_flops / ms * 1e-9:6.1f} TFLOP/s", flush=True)  # fmt: skip
        del case
        torch.cuda.empty_cache()
    print("checks:", checks)
    command = f"bench_gdpa.py --explore-pma-cross --explore-set {round_} --workers {workers}"
    write_results(out_path, meta("gdpa_explore4", command, device=torch.cuda.get_device_name(),
                                 checks=checks, pma_variants={k: str(v) for k, v in pma.items()},
                                 cross_variants={k: str(v) for k, v in cross.items()}),
                  rows)  # fmt: skip
    print(f"explore done in {time.time() - start:.0f} s")


def quick_sweep(device, deadline, rows) -> gt.GdpaTritonConfig:
    """A few variants per group (self fwd tiles, PMA split-KV, cross short-KV, backward tiles);
    each group's winner is kept. Every timing goes to ``rows`` (provider ``gem-sweep-...``)."""
    best = gt.default_config(D)
    variants = {
        "self": (
            ["self", 128, 4096], "fwd",
            {
                "default": {},
                "f128x128-plain": dict(fwd_block_n=128, packed_gelu=False),
                "f128x64w8s4": dict(fwd_stages=4),
            },
        ),
        "pma": (
            ["pma", 128, 4096], "fwd",
            {
                "default": {},
                "x1": dict(pma_programs_per_sm=1),
                "n64s4": dict(pma_block_n=64, pma_stages=4),
                "nosplit": dict(pma_kv_chunk=0),
            },
        ),
        "cross": (
            ["cross", 128, 4096], "fwd",
            {
                "default": {},
                "plain": dict(packed_gelu=False),
                "generic": dict(short_kv_max=0),
            },
        ),
        "bwd": (
            ["self", 128, 4096], "fwd_bwd",
            {
                "default": {},
                "plain": dict(packed_gelu=False),
            },
        ),
    }  # fmt: skip
    for label, (shape, mode, options) in variants.items():
        case = Case(*shape, device)
        scores = {}
        for name, change in options.items():
            if time.time() > deadline:
                print("sweep deadline reached")
                break
            scores[name] = _time_config(case, replace(best, **change), (mode,))[mode]
            rows.append(dict(case=case.name, provider=f"gem-sweep-{label}-{name}", mode=mode,
                             metric="ms", value=scores[name]))  # fmt: skip
            print(f"sweep {label:6s} {name:20s} {mode} {scores[name]:8.3f} ms")
        if scores:
            winner = min(scores, key=scores.get)
            best = replace(best, **options[winner])
            print(f"sweep {label}: {winner}")
        del case
        torch.cuda.empty_cache()
    print(f"sweep best: {best}")
    return best


def _parse_config(text: str) -> gt.GdpaTritonConfig | None:
    if not text:
        return None
    changes = {}
    for item in text.split(","):
        key, value = item.split("=")
        changes[key] = value if key == "schedule" else int(value)
    return replace(gt.default_config(D), **changes)


KINDS = ("self", "cross", "pma", "skew", "activations")


def _kind_of(row: dict) -> str:
    """Kind of a result row: its case prefix (``self/B..`` -> self, ``skew/..`` -> skew), or
    ``activations`` for the ``gem-identity`` / ``gem-silu`` rows (see ``main``)."""
    if row["provider"] in ("gem-identity", "gem-silu"):
        return "activations"
    return row["case"].split("/")[0]


def _shapes(kinds) -> list[tuple[str, int, int]]:
    shapes = [("self", b, n) for b, n in SELF_SHAPES if "self" in kinds]
    return shapes + [(k, b, n) for k in ("cross", "pma") if k in kinds for b, n in ASYM_SHAPES]


def main() -> None:
    parser = results_parser(__doc__, "h200/gdpa.json")
    parser.add_argument("--check", action="store_true", help="correctness vs the reference")
    parser.add_argument("--sweep", action="store_true", help="pick gem's tiles by a sweep")
    parser.add_argument("--sweep-only", action="store_true", help="check + sweep, no JSON")
    parser.add_argument("--quick-sweep", action="store_true", help="cross/PMA variants first")
    parser.add_argument("--config", default="", help="gem config overrides, k=v,k=v")
    parser.add_argument(
        "--budget-s", type=float, default=200.0, help="stop starting new cases (after --check)"
    )
    parser.add_argument("--peers", default=",".join(PEERS))
    parser.add_argument("--explore", action="store_true", help="time variants only (to --out)")
    parser.add_argument(
        "--explore-self-cross", action="store_true",
        help="check and time the self/cross forward and backward variants (to --out)",
    )  # fmt: skip
    parser.add_argument("--explore-set", type=int, default=1, help="variant round (1 to 5)")
    parser.add_argument("--warm-variant", default="", help=argparse.SUPPRESS)
    parser.add_argument(
        "--explore-pma-cross", action="store_true",
        help="streamed PMA forward and cross forward variants, checked and timed (to --out)",
    )  # fmt: skip
    parser.add_argument(
        "--workers", type=int, default=0, help="processes that pre-compile the kernels in parallel"
    )
    parser.add_argument(
        "--kinds", default=",".join(KINDS), help=f"comma-separated subset of {','.join(KINDS)}"
    )
    parser.add_argument(
        "--merge", default="", help="result JSON whose rows of the kinds not run here are kept"
    )
    args = parser.parse_args()
    kinds = [k for k in args.kinds.split(",") if k]
    if not set(kinds) <= set(KINDS):
        parser.error(f"--kinds must be a subset of {KINDS}, got {args.kinds!r}")
    require_cuda()
    device = torch.device("cuda")
    if args.warm_variant:  # a child of precompile_isolated
        warm_variant(args.warm_variant)
        return
    if args.explore:
        explore(device, Path(args.out), args.workers)
        return
    if args.explore_self_cross:
        explore_self_cross(device, Path(args.out), args.workers, args.budget_s, args.explore_set)
        return
    if args.explore_pma_cross:
        explore_pma_cross(device, Path(args.out), args.workers, round_=args.explore_set)
        return
    # No --config: gem runs through the public entry point, whose default configuration
    # depends on the call (sequence length, masks), as in a model.
    config = _parse_config(args.config)
    if args.workers > 0:  # every kernel of the run below, compiled in parallel first
        jobs = [(("check", i), None, ACT, ()) for i in range(CHECK_CASES)] if args.check else []
        jobs += [(spec, config, ACT, ("fwd", "fwd_bwd")) for spec in _shapes(kinds)]
        if "skew" in kinds:
            jobs += [
                ("skew", replace(_skew_config(config), schedule=s), ACT, ("fwd", "fwd_bwd"))
                for s in gt.GDPA_SCHEDULES
            ]
        if "activations" in kinds:
            jobs += [(("self", 128, 4096), config, a, ("fwd",)) for a in ("identity", "silu")]
        precompile(jobs, args.workers)
    checks = check(device) if args.check or args.sweep_only else {}
    start = time.time()  # --budget-s covers the sweep and the cases, not the check
    if args.sweep or args.sweep_only:
        config = sweep(device, start + (0.9 if args.sweep_only else 0.5) * args.budget_s)
    if args.sweep_only:
        return
    rows, errors = [], []
    if args.quick_sweep:
        config = quick_sweep(device, start + 0.4 * args.budget_s, rows)
    peers = [p for p in args.peers.split(",") if p]

    kept, merged = [], {}
    if args.merge:  # rows of the kinds not measured here, from an earlier run
        earlier = json.loads(Path(args.merge).read_text())
        kept = [row for row in earlier["rows"] if _kind_of(row) not in kinds]
        merged = {"merged_from": {"path": args.merge, "commit": earlier["meta"].get("commit"),
                                  "date": earlier["meta"].get("date"), "rows": len(kept),
                                  "kinds_rerun": kinds}}  # fmt: skip

    def write():
        import triton

        meta_block = meta(
            "gdpa",
            " ".join(["python benchmarks/bench_gdpa.py", *user_args()]),
            device=torch.cuda.get_device_name(),
            triton=triton.__version__,
            shape={
                "heads": H,
                "head_dim": D,
                "dtype": "bfloat16",
                "activation": ACT,
                "pma_queries": NUM_QUERIES,
                "cross_kv": CROSS_KV,
            },  # fmt: skip
            gem_config=str(config)
            if config is not None
            else {
                "short (max_len <= SHORT_SEQUENCE_LEN)": str(gt.default_config(D, max_len=1)),
                "long": str(gt.default_config(D)),
                "masked and PMA": str(gt.default_config(D, masked=True)),
            },
            checks_rel_error_out_dq_dk_dv=checks,
            errors=errors,
            wall_s=round(time.time() - start, 1),
            **merged,
        )
        write_results(Path(args.out), meta_block, kept + rows)

    for kind, batch, max_len in _shapes(kinds):
        if time.time() - start > args.budget_s:
            errors.append(f"budget reached before {kind}/B{batch}xL{max_len}")
            break
        case = Case(kind, batch, max_len, device)
        _measure(rows, errors, case, "gem", lambda c=case: provider_gem(c, config))
        for peer in peers:
            _measure(rows, errors, case, peer, lambda c=case, p=peer: PEERS[p](c))
        del case
        torch.cuda.empty_cache()
        write()
    if "skew" in kinds and time.time() - start < args.budget_s:
        skew(rows, errors, device, _skew_config(config))
    elif "skew" in kinds:
        errors.append("budget reached before the skew experiment")
    write()
    if "activations" not in kinds:
        print(f"wrote {args.out} in {time.time() - start:.0f} s; {len(errors)} errors")
        return
    # What the activation costs: the same self case with cheaper element-wise functions.
    case = Case("self", 128, 4096, device)
    for activation in ("identity", "silu"):
        if time.time() - start > args.budget_s:
            errors.append(f"budget reached before gem-{activation}")
            break
        make = lambda a=activation: provider_gem(case, config, a)  # noqa: E731
        _measure(rows, errors, case, f"gem-{activation}", make, ("fwd",))
        write()
    print(f"wrote {args.out} in {time.time() - start:.0f} s; {len(errors)} errors")


if __name__ == "__main__":
    main()
