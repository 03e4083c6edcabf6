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
  ~2^18 tokens), with ``max_over_mean``: the modelled max/mean work of the forward's persistent
  programs (``gdpa_triton.schedule_loads``);
* ``gem-identity`` / ``gem-silu``: the self B128xL4096 forward with cheaper activations (what
  the activation costs);
* ``gem-fp8``: gem with ``precision="fp8"`` on every self / cross / PMA shape.

TFLOP/s count useful work: ``4 * H * D * sum(Lq * Lk)`` forward, x3.5 for forward+backward.
Peers, measured in the same run: ``compile_padded`` (``torch.compile`` of padded activation
attention with a key mask; only where the padded score tensor fits, B512xL1024 self and PMA),
``sdpa_flash_padded`` (softmax, flash, padded, no mask: a speed reference, not the same
function) and ``njt_sdpa`` (nested-jagged softmax SDPA, cross and PMA). gem runs through the
public entry point, so each call gets the default configuration of its lengths and masks
(``gdpa_triton.GDPA_CONFIGS``); ``benchmarks/tune/gdpa_configs.py`` times other configurations.

    PYTHONPATH=benchmarks:packages/gem-kernels/src python benchmarks/bench_gdpa.py \
        --check --workers 8     # writes benchmarks/results/h200/gdpa.json

``--check`` first compares gem (bf16 and fp32 inputs) with the fp32 reference, forward and
every gradient, on small jagged problems with masks, cross, PMA and normalisation.
``--workers N`` compiles every kernel of the run in N processes first (Triton's on-disk cache;
the timed process then loads binaries: minutes of serial compiling become ~15 s).
``--kinds pma --merge benchmarks/results/h200/gdpa.json`` reruns only the PMA cases and keeps
the other rows of the earlier run (``meta.merged_from`` records where they come from).
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from harness import (
    ROOT,
    Run,
    autograd_provider,
    grad_leaves,
    raise_recompile_limits,
    rel_error,
    require_cuda,
    results_parser,
)

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


def provider_gem(case: Case, config=None, activation=ACT, precision="bf16"):
    """gem through the public entry point (each call gets the default configuration of its
    lengths and masks), or with ``config`` through ``gdpa_from_lengths`` (tuning scripts)."""

    def call(q, k, v):
        if config is None:
            return gdpa(q, k, v, case.q_off, case.k_off, activation=activation, backend="triton",
                        precision=precision)  # fmt: skip
        q_len = None if case.kind == "pma" else case.q_lengths
        k_len = None if case.kind == "self" else case.k_lengths
        return gt.gdpa_from_lengths(
            q, k, v, q_len, k_len, activation=activation, config=config, precision=precision
        )

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
# Checks and the cases of a run.


def _graph_ms(fn) -> float:
    """Median ms of ``fn`` replayed from a CUDA graph (GPU time without host overhead)."""
    import triton.testing

    with torch.cuda.stream(torch.cuda.Stream()):
        return triton.testing.do_bench_cudagraph(fn, rep=40, return_mode="median")


# 2500: PMA keys and cross queries long enough for the split-KV / split-Q partial paths.
CHECK_Q = [0, 1, 300, 77, 513, 64, 1000, 129, 2500]
CHECK_K = [5, 0, 129, 200, 256, 1, 17, 256, 100]
# Samples of at most SHORT_SEQUENCE_LEN keys (the short unmasked configurations).
CHECK_SHORT = [0, 1, 300, 77, 513, 64, 1000, 129, 1024]
CHECK_CASES = [
    ("self", CHECK_Q, None, dict(activation="gelu_fast", causal=True, window=(100, None))),
    ("self", CHECK_Q, None, dict(activation="silu", window=(40, 30), normalize_by_length=True)),
    ("cross", CHECK_Q, CHECK_K, dict(activation="gelu_tanh", causal=True)),
    ("pma", None, CHECK_Q, dict(activation="gelu", normalize_by_length=True)),
    # Unmasked: the one-loop kernels (long and short configurations, short KV).
    ("self", CHECK_Q, None, dict(activation="gelu_fast")),
    ("self", CHECK_SHORT, None, dict(activation="gelu_fast", normalize_by_length=True)),
    ("cross", CHECK_Q, CHECK_K, dict(activation="gelu_fast")),
    ("pma", None, CHECK_Q, dict(activation="gelu_fast")),
]


def check(device, config=None, only=None) -> dict:
    """gem (bf16 inputs, and fp32 for case 1) against the fp32 reference on small jagged
    problems: relative errors of the output, dq, dk, dv by case name. ``config``: gem's
    config (``gdpa_from_lengths``; fp32 inputs keep their own), else the public entry point's
    default; ``only``: the index of the one case to run."""
    results = {}
    gen = torch.Generator().manual_seed(0)
    for i, (kind, ql, kl, opts) in enumerate(CHECK_CASES):
        if only is not None and i != only:
            continue
        for dtype in (torch.bfloat16, torch.float32) if i == 1 else (torch.bfloat16,):
            name = f"{i}:{kind}:{opts.get('activation')}:{str(dtype)[6:]}"
            try:
                keys = ql if kl is None else kl
                q_rows = NUM_QUERIES if ql is None else sum(ql)
                tensors = [
                    torch.randn(n, H, D, generator=gen).to(device, dtype)
                    for n in (q_rows, sum(keys), sum(keys))
                ]
                q_off = None if ql is None else _offsets(torch.tensor(ql))
                k_off = None if kl is None else _offsets(torch.tensor(kl))
                leaves = [t.clone().requires_grad_(True) for t in tensors]
                ref_leaves = [t.float().requires_grad_(True) for t in tensors]
                if config is None or dtype == torch.float32:
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
                results[name] = dict(zip(("out", "dq", "dk", "dv"), errs, strict=True))
                print(f"check {name}: " + " ".join(f"{e:.1e}" for e in errs))
            except Exception as error:  # noqa: BLE001 - report and keep checking
                results[name] = repr(error)[:300]
                print(f"check {name} FAILED: {error!r}"[:600])
                traceback.print_exc()
    return results


def skew_case(device) -> Case:
    lengths = _power_law_lengths()
    return Case("self", lengths.numel(), int(lengths.max()), device, lengths, "skew/alpha1.7")


def modelled_balance(case: Case, device) -> float:
    """Max/mean work of the persistent forward programs for ``case`` (unmasked self): each
    (query tile, head) item visits every key tile of its sample."""
    config = gt.default_config(D, max_len=int(case.q_lengths.max()))
    lengths = case.q_lengths.numpy()
    tiles = -(-lengths // config.fwd_block_m)
    work = np.repeat(-(-lengths // config.fwd_block_n), tiles)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    per_sm = config.fwd_programs_per_sm or config.programs_per_sm
    loads = gt.schedule_loads(np.repeat(work, H), sms * per_sm)
    return float(loads.max() / loads.mean())


KINDS = ("self", "cross", "pma", "skew", "activations")
ACTIVATIONS = ("identity", "silu")


def _kind_of(row: dict) -> str:
    """Kind of a result row: its case prefix (``self/B..`` -> self, ``skew/..`` -> skew), or
    ``activations`` for the ``gem-identity`` / ``gem-silu`` rows."""
    if row["provider"] in {f"gem-{a}" for a in ACTIVATIONS}:
        return "activations"
    return row["case"].split("/")[0]


def _shapes(kinds) -> list[tuple[str, int, int]]:
    shapes = [("self", b, n) for b, n in SELF_SHAPES if "self" in kinds]
    return shapes + [(k, b, n) for k in ("cross", "pma") if k in kinds for b, n in ASYM_SHAPES]


def provider_fp8(case: Case):
    """gem with ``precision="fp8"`` (issue 29): E4M3 Q, K, V and activation tiles."""
    return provider_gem(case, precision="fp8")


def flops_of(case: Case) -> dict[str, float]:
    return {"fwd": case.fwd_flops, "fwd_bwd": 3.5 * case.fwd_flops}


# ---------------------------------------------------------------------------------------------
# Parallel warm-up of Triton's on-disk kernel cache: compiling every kernel of a run one after
# the other costs minutes of GPU-machine time; worker processes run each (case, activation)
# once, so the timed process only loads cached binaries.


def _warm_job(job) -> str:
    spec, activation = job
    try:
        device = torch.device("cuda", 0)
        if spec[0] == "check":
            check(device, only=spec[1])
            return "ok"
        case = skew_case(device) if spec == "skew" else Case(*spec, device)
        for precision in ("bf16", "fp8"):
            fwd, fwd_bwd, _ = provider_gem(case, activation=activation, precision=precision)
            fwd()
            fwd_bwd()
        torch.cuda.synchronize()
        return "ok"
    except Exception as error:  # noqa: BLE001 - the timed run reports it again
        return f"{spec} {error!r}"[:300]


def precompile(jobs, workers: int) -> None:
    """Runs ``jobs`` ``(case spec, activation)`` once each in ``workers`` processes."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    start = time.time()
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        for result in pool.map(_warm_job, jobs):
            if result != "ok":
                print(f"precompile: {result}")
    print(f"precompiled {len(jobs)} jobs in {time.time() - start:.0f} s")


def main() -> None:
    parser = results_parser(__doc__, "h200/gdpa.json")
    parser.add_argument("--check", action="store_true", help="correctness vs the reference")
    parser.add_argument(
        "--budget-s", type=float, default=200.0, help="stop starting new cases (after --check)"
    )
    parser.add_argument("--peers", default=",".join(PEERS))
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
    peers = [p for p in args.peers.split(",") if p]
    if not set(peers) <= set(PEERS):
        parser.error(f"--peers must be a subset of {tuple(PEERS)}, got {args.peers!r}")
    require_cuda()
    device = torch.device("cuda")
    if args.workers > 0:
        jobs = [(("check", i), ACT) for i in range(len(CHECK_CASES))] if args.check else []
        jobs += [(spec, ACT) for spec in _shapes(kinds)]
        jobs += [("skew", ACT)] if "skew" in kinds else []
        if "activations" in kinds:
            jobs += [(("self", 128, 4096), a) for a in ACTIVATIONS]
        precompile(jobs, args.workers)
    checks = check(device) if args.check else {}
    extra = {
        "shape": {"heads": H, "head_dim": D, "dtype": "bfloat16", "activation": ACT,
                  "pma_queries": NUM_QUERIES, "cross_kv": CROSS_KV},
        "gem_configs": {name: str(entry.config) for name, entry in gt.GDPA_CONFIGS.items()},
        "checks_rel_error_out_dq_dk_dv": checks,
    }  # fmt: skip
    kept = []
    if args.merge:  # rows of the kinds not measured here, from an earlier run
        earlier = json.loads(Path(args.merge).read_text())
        kept = [row for row in earlier["rows"] if _kind_of(row) not in kinds]
        extra["merged_from"] = {"path": args.merge, "commit": earlier["meta"].get("commit"),
                                "date": earlier["meta"].get("date"), "rows": len(kept),
                                "kinds_rerun": kinds}  # fmt: skip
    run = Run("gdpa", args.out, script="benchmarks/bench_gdpa.py", extra=extra,
              timing={"warmup": 10.0, "rep": 40.0}, budget_s=args.budget_s)  # fmt: skip
    run.rows += kept
    for kind, batch, max_len in _shapes(kinds):
        if run.over_budget(f"{kind}/B{batch}xL{max_len}"):
            break
        case = Case(kind, batch, max_len, device)
        providers = {"gem": provider_gem, "gem-fp8": provider_fp8, **{p: PEERS[p] for p in peers}}
        run.measure(case, providers, flops=flops_of(case),
                    bytes_moved={"fwd": case.bytes} if kind == "pma" else None)  # fmt: skip
        if kind == "pma":  # kernel time without the host overhead that bounds eager calls
            try:
                graph = _graph_ms(provider_gem(case)[0])
                run.add(case.name, "gem", "fwd", "graph_ms", graph)
                run.add(case.name, "gem", "fwd", "graph_gbps", case.bytes / graph * 1e-6)
            except Exception as error:  # noqa: BLE001 - report and keep benchmarking
                run.error(f"{case.name} gem graph: {error!r}")
        del case
        torch.cuda.empty_cache()
        run.write()
    if "skew" in kinds and not run.over_budget("the skew case"):
        case = skew_case(device)
        run.add(case.name, "gem", "fwd", "max_over_mean", modelled_balance(case, device))
        run.measure(case, {"gem": provider_gem}, flops=flops_of(case))
        del case
    if "activations" in kinds and not run.over_budget("the activation cases"):
        case = Case("self", 128, 4096, device)
        providers = {f"gem-{a}": lambda c, a=a: provider_gem(c, activation=a) for a in ACTIVATIONS}
        run.measure(case, providers, flops=flops_of(case), modes=("fwd",))
    run.write()
    run.table(("ms", "tflops", "gbps"))
    print(f"wrote {args.out} in {time.time() - run.start:.0f} s; {len(run.errors)} errors")


if __name__ == "__main__":
    main()
