"""Jagged softmax attention on one GPU: gem's Triton kernels against the usual alternatives.

Protocol (shared/BENCHMARKS.md): jagged lengths ``randint(1, Lmax + 1, (B,))`` with a fixed
seed, H=4, D=128, bf16, (B, Lmax) in {(512, 1024), (128, 4096), (32, 16384)}, causal and not,
forward and forward+backward, plus a causal sliding window of 256 at L16384 and gem's bias
variants (``rel_pos_bias`` with 512 buckets, ``jagged_bias``) at every shape, causal.
``triton.testing.do_bench`` medians; every provider is measured in the same run, the unbiased
cases in ``--rounds`` rounds (default 2) whose provider order alternates, keeping each
provider's median (the first provider timed after an idle spell runs at higher clocks). TFLOP/s count
useful work only: ``4 * H * D * sum(L^2)`` forward (half of it when causal; the exact visible
pairs for the window), x3.5 for forward+backward. Every provider's output and gradients are
checked against flash varlen (rows ``rel_error`` / ``max_abs_error``); the padded SDPA peers
attend the zero padding (no mask), so their errors are large by construction.

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
gem runs through the public entry point (each call gets the ``JFA_CONFIGS`` entry of its
lengths and masks); tile exploration is ``benchmarks/tune/jagged_attention_tiles.py``.
``gem-fp8`` is the same call with ``precision="fp8"`` (issue 29), checked against flash varlen
like every provider (its error is the FP8 quantisation's).
A full run takes about 4 minutes on an H200 (the ``--budget-s`` guard stops starting new cases
after that many seconds). A CPU smoke run (Triton interpreter, tiny shapes):
``TRITON_INTERPRET=1 python benchmarks/bench_jagged_attention.py --device cpu --shapes 3x40
--peers njt_sdpa --out /tmp/jagged.json``.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F
from harness import (
    ROOT,
    Run,
    Timed,
    autograd_provider,
    grad_leaves,
    raise_recompile_limits,
    results_parser,
)

sys.path.insert(0, str(ROOT / "packages" / "gem-kernels" / "src"))

from gem_kernels import jagged_flash_attention  # noqa: E402
from gem_kernels.jfa_triton import (  # noqa: E402
    JfaTritonConfig,
    default_config,
    jagged_flash_attention_from_lengths,
)

H, D = 4, 128
PRECISIONS = ("bf16", "fp8")  # gem and gem-fp8
SHAPES = [(512, 1024), (128, 4096), (32, 16384)]
WINDOW = 256
DTYPE = torch.bfloat16
TIMING = {"warmup": 25.0, "rep": 100.0}  # do_bench milliseconds; --warmup-ms / --rep-ms


def _precompile_job(job) -> str:
    """Compile gem's kernels for one (causal, window, bias) variant on a small batch.

    The kernels do not specialise on batch-size-dependent integers, so these compilations are
    the ones the benchmark's shapes use; run in worker processes, they fill Triton's cache in
    parallel instead of one after the other inside the timed loop's warm-up.
    """
    causal, window, bias, config_fields, precision = job
    start = time.time()
    # Short batches (longest <= SHORT_SEQUENCE_LEN) get other default forward tiles than long.
    for lengths in (torch.tensor([3, 300, 0, 129, 1000]), torch.tensor([3, 1500, 0, 129])):
        failure = _precompile_batch(causal, window, bias, config_fields, precision, lengths)
        if failure:
            return f"precompile {job[:3]} failed: {failure}"[:300]
    return f"precompiled {job[:3]} in {time.time() - start:.1f} s"


def _precompile_batch(causal, window, bias, config_fields, precision, lengths) -> str | None:
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
        window = None if window is None else (window, None)
        options = dict(causal=causal, window=window, precision=precision)
        if config_fields is None:
            out = jagged_flash_attention(*leaves, offsets, backend="triton", **options, **extra)
        else:
            out = jagged_flash_attention_from_lengths(
                *leaves, lengths, config=JfaTritonConfig(*config_fields), **options, **extra
            )
        out.backward(g)
        torch.cuda.synchronize()
        return None
    except Exception as error:  # noqa: BLE001 - the timed run reports real failures
        return repr(error)


def precompile_variants(jobs) -> None:
    """Compile gem's kernels for the (causal, window, bias, config fields, precision) jobs in parallel
    worker processes (Triton's cache then serves the timed runs)."""
    import multiprocessing

    start = time.time()
    with multiprocessing.get_context("spawn").Pool(min(len(jobs), 12)) as pool:
        for line in pool.imap_unordered(_precompile_job, sorted(jobs, key=str)):
            print(line, flush=True)
    print(f"precompiled {len(jobs)} variants in {time.time() - start:.0f} s", flush=True)


def lengths_for(batch: int, max_len: int) -> torch.Tensor:
    """The protocol's jagged lengths: ``randint(1, max_len + 1, (batch,))``, fixed seed."""
    gen = torch.Generator().manual_seed(1234 + max_len)
    return torch.randint(1, max_len + 1, (batch,), generator=gen)


def visible_pairs(lengths: torch.Tensor, causal: bool, window: int | None) -> float:
    """(query, key) pairs the mask lets through: the useful work."""
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
        self.lengths = lengths_for(batch, max_len)
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
        self.fwd_flops = 4.0 * H * D * visible_pairs(self.lengths, causal, window)
        self.flops = {"fwd": self.fwd_flops, "fwd_bwd": 3.5 * self.fwd_flops}

    def leaves(self):
        return grad_leaves((self.q, self.k, self.v))


def bias_inputs(case: Case, device, jagged: bool):
    """A ``rel_pos_bias`` table (512 buckets) and, with ``jagged``, a ``jagged_bias``."""
    gen = torch.Generator(device=device).manual_seed(3)
    rel = torch.randn(H, 512, generator=gen, device=device, dtype=DTYPE)
    if not jagged:
        return rel, None
    pairs = int((case.lengths * case.lengths).sum())
    return rel, torch.randn(H, pairs, generator=gen, device=device, dtype=DTYPE)


# ---------------------------------------------------------------------------------------------
# Providers: case -> Timed (or raise NotImplementedError: the peer cannot do this case).


def provider_gem(case: Case, config=None, rel=None, jagged=None, precision="bf16") -> Timed:
    window = None if case.window is None else (case.window, None)
    options = dict(causal=case.causal, window=window, precision=precision)

    def call(q, k, v, **extra):
        if config is not None:
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
        call(*leaves, **bias_leaves).backward(case.grad)

    return Timed(fwd, fwd_bwd, leaves + list(bias_leaves.values()))


def provider_flash_varlen(case: Case) -> Timed:
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

    def fwd_bwd():  # returns (dq, dk, dv): there are no leaves
        out, lse, rng, unused, _ = forward(case.q, case.k, case.v)
        return torch.ops.aten._flash_attention_backward(
            case.grad, case.q, case.k, case.v, out, lse, cu, cu, max_len, max_len, 0.0,
            case.causal, rng, unused, **window,
        )  # fmt: skip

    return Timed(fwd, fwd_bwd)


def provider_njt(case: Case) -> Timed:
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

    def packed(t):  # the forward's nested (B, H, j, D) output as (T, H, D)
        return t.transpose(1, 2).values() if t.is_nested else t

    return Timed(fwd, fwd_bwd, leaves, to_ref=packed)


def _token_index(case: Case):
    sample = torch.repeat_interleave(torch.arange(case.batch), case.lengths)
    position = torch.arange(case.total) - case.offsets[:-1][sample]
    return sample, position


def _padded(case: Case, t: torch.Tensor) -> torch.Tensor:
    padded = torch.zeros(case.batch, case.max_len, H, D, dtype=t.dtype, device=t.device)
    sample, position = _token_index(case)
    padded[sample.to(t.device), position.to(t.device)] = t
    return padded.transpose(1, 2).contiguous()  # (B, H, L, D)


def provider_padded(case: Case, backend) -> Timed:
    if case.window is not None:
        raise NotImplementedError("padded SDPA without a mask has no sliding window")
    from torch.nn.attention import sdpa_kernel

    qp, kp, vp, gp = (_padded(case, t) for t in (case.q, case.k, case.v, case.grad))
    sample, position = (t.to(qp.device) for t in _token_index(case))

    def run(q, k, v):
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=case.causal)

    def packed(t):  # (B, H, L, D) -> the real tokens as (T, H, D)
        return t.transpose(1, 2)[sample, position]

    return Timed(*autograd_provider(run, (qp, kp, vp), gp), to_ref=packed)


_FLEX = {}


def provider_flex(case: Case) -> Timed:
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
    built = autograd_provider(
        lambda q, k, v: flex(q, k, v, block_mask=block_mask), (qf, kf, vf), gf
    )
    return Timed(*built, to_ref=lambda t: t[0].transpose(0, 1))


def _backend(name):
    from torch.nn.attention import SDPBackend

    return getattr(SDPBackend, name)


PEERS = {
    "flex": provider_flex,
    "flash_varlen": provider_flash_varlen,
    "njt_sdpa": provider_njt,
    "sdpa_flash_padded": lambda c: provider_padded(c, _backend("FLASH_ATTENTION")),
    "sdpa_cudnn_padded": lambda c: provider_padded(c, _backend("CUDNN_ATTENTION")),
}
REFERENCE = provider_flash_varlen  # the oracle every provider is checked against
# Peers whose peak memory is measured (flex would recompile for the extra half-token shape).
MEMORY_PEERS = ("flash_varlen", "njt_sdpa", "sdpa_flash_padded")


# ---------------------------------------------------------------------------------------------


def fwd_fields(c: JfaTritonConfig):
    return (c.fwd_block_m, c.fwd_block_n, c.fwd_warps, c.fwd_stages)


def bwd_fields(c: JfaTritonConfig):
    return (c.dkdv_block_n, c.dkdv_block_m, c.dq_block_m, c.dq_block_n, c.bwd_warps, c.bwd_stages)


def config_meta(config: JfaTritonConfig | None) -> dict:
    """The meta block's record of gem's tiles (the default ones per regime, or ``config``)."""
    return {
        "shape": {"heads": H, "head_dim": D, "dtype": "bfloat16", "window": WINDOW},
        "gem_config": str(config or default_config(D)),
        "gem_config_short": str(config or default_config(D, max_len=1024)),
        "gem_config_short_causal": str(config or default_config(D, max_len=1024, masked=True)),
        "gem_config_with_bias": str(config or default_config(D, with_bias=True)),
        "gem_config_with_jagged_bias": str(config or default_config(D, with_jagged_bias=True)),
    }


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """``all`` or ``BxL,BxL...``."""
    if text == "all":
        return SHAPES
    return [tuple(int(x) for x in s.split("x")) for s in text.split(",")]


def main() -> None:
    parser = results_parser(__doc__, "h200/jagged_attention.json")
    parser.add_argument("--peers", default=",".join(PEERS), help="comma-separated peer names")
    parser.add_argument("--shapes", default="all", help="'all' or e.g. 128x4096,512x1024")
    parser.add_argument("--budget-s", type=float, default=360.0, help="stop starting new cases")
    parser.add_argument(
        "--rounds", type=int, default=2, help="timings per provider and case (order alternates)"
    )
    parser.add_argument("--warmup-ms", type=float, default=25.0, help="do_bench warm-up")
    parser.add_argument("--rep-ms", type=float, default=100.0, help="do_bench repetition time")
    parser.add_argument(
        "--device", default="cuda", help="'cpu' for a smoke run (needs TRITON_INTERPRET=1)"
    )
    args = parser.parse_args()
    TIMING.update(warmup=args.warmup_ms, rep=args.rep_ms)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device (or --device cpu with TRITON_INTERPRET=1)")
    shapes = parse_shapes(args.shapes)
    run = Run("jagged_attention", args.out, script="benchmarks/bench_jagged_attention.py",
              timing=TIMING, checks_key="checks_vs_flash_varlen_rel_error",
              budget_s=args.budget_s)  # fmt: skip
    run.extra.update(config_meta(None))
    peers = {name: PEERS[name] for name in args.peers.split(",") if name}
    gem = {"gem": provider_gem, "gem-fp8": lambda case: provider_gem(case, precision="fp8")}

    cases = [(b, length, causal, None) for b, length in shapes for causal in (False, True)]
    if (32, 16384) in shapes:
        cases.append((32, 16384, True, WINDOW))
    if device.type == "cuda":
        jobs = {
            (causal, window, None, None, p) for _, _, causal, window in cases for p in PRECISIONS
        }
        precompile_variants(
            jobs | {(True, None, b, None, "bf16") for b in ("rel_pos_bias", "jagged_bias")}
        )

    # Bias variants (gem only), causal, at every shape (first: the budget may cut the tail);
    # the unbiased causal rows are measured below.
    for batch, max_len in shapes:
        if run.over_budget(f"the bias variants at B{batch}xL{max_len}"):
            break
        case = Case(batch, max_len, True, None, device)
        rel, jagged = bias_inputs(case, device, jagged=True)
        variants = {
            "gem-rel_pos_bias": lambda c, r=rel: provider_gem(c, rel=r),
            "gem-jagged_bias": lambda c, j=jagged: provider_gem(c, jagged=j),
        }
        run.measure(case, variants, flops=case.flops)
        del case, rel, jagged, variants
        torch.cuda.empty_cache()

    for batch, max_len, causal, window in cases:
        if run.over_budget(f"B{batch}xL{max_len} causal={causal}"):
            break
        case = Case(batch, max_len, causal, window, device)
        run.measure(case, {**gem, **peers}, flops=case.flops, reference=REFERENCE,
                    rounds=args.rounds)  # fmt: skip
        del case
        torch.cuda.empty_cache()

    # Peak memory of one forward+backward (non-causal), gem and peers; B16xL16384 has half the
    # tokens of the other shapes.
    memory_shapes = list(shapes) + ([(16, 16384)] if (32, 16384) in shapes else [])
    for batch, max_len in memory_shapes if device.type == "cuda" else []:
        if run.over_budget(f"peak memory at B{batch}xL{max_len}"):
            break
        case = Case(batch, max_len, False, None, device)
        for name, make in {"gem": provider_gem, **peers}.items():
            if name == "gem" or name in MEMORY_PEERS:
                run.peak_memory(case, name, make, tokens=case.total)
        del case
        torch.cuda.empty_cache()

    run.write()
    run.table(("ms", "tflops"), title="jagged attention (TFLOP/s of useful work)")
    print(f"wrote {args.out} in {time.time() - run.start:.0f} s; {len(run.errors)} errors")


if __name__ == "__main__":
    main()
