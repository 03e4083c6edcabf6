"""Block attention (64-token blocks, RoPE fused) on one GPU: gem's Triton kernels vs peers.

Protocol (shared/BENCHMARKS.md): jagged lengths ``randint(1, Lmax + 1, (B,))`` with a fixed
seed, H=4, D=128, bf16, (B, Lmax) in {(512, 1024), (128, 4096), (32, 16384)}; 64-token blocks
inside each sample (last block partial), RoPE on q and k from the in-sample positions, forward
and forward+backward, ``triton.testing.do_bench`` medians, every provider in the same run.

Metrics: ``ms``; ``tflops`` counts useful work only, ``4 * H * D * sum(block_len^2)`` forward,
x3.5 for forward+backward; ``gbps`` counts the bytes of q, k, v and out once for the forward,
and of q, k, v, out, dout, dq, dk, dv once for forward+backward, over the measured time (the
device-to-device copy ceiling is 4.27 TB/s). gem also gets ``hbm_fraction`` (gbps / 4270),
``speedup_vs_sdpa_blocks_rope`` (peer ms / gem ms) and, for the forward, ``graph_ms`` /
``graph_gbps`` (the call replayed from a CUDA graph: kernel time without host overhead).
Every provider's output and gradients are checked against flash varlen over blocks (rows
``rel_error`` / ``max_abs_error``; ``sdpa_blocks_rope`` attends the zero padding of partial
blocks, so its errors are large by construction).

Peers (RoPE as separate eager PyTorch ops with precomputed cos/sin tables, the way a user would
write it, and its backward through autograd):

* ``sdpa_blocks_rope``: each sample padded to a multiple of 64 tokens, SDPA over
  ``(blocks, H, 64, D)`` (no mask, so padded keys are attended: a lower bound on its cost).
* ``flash_varlen_blocks_rope``: ``aten._flash_attention_forward`` with one "sequence" per block
  (exact, no padding); also the correctness reference for the other providers.
* ``flex_block_rope``: FlexAttention over the packed tokens with a same-block mask
  (``torch.compile``; only at the shapes in ``--flex-shapes``: compiling is slow).

    PYTHONPATH=packages/gem-kernels/src python benchmarks/bench_block_attention.py \
        --out benchmarks/results/h200/block_attention.json

``--sweep`` first times a few launch configurations of gem's kernels at B128xL4096 and uses
the fastest forward and backward. A CPU smoke run (gem's reference path, tiny shapes):
``python benchmarks/bench_block_attention.py --device cpu --shapes 3x200 --flex-shapes ''
--out /tmp/block.json``.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F
from harness import ROOT, Run, Timed, autograd_provider, fastest, median_ms, results_parser

sys.path.insert(0, str(ROOT / "packages" / "gem-kernels" / "src"))

from gem_kernels import block_attention  # noqa: E402
from gem_kernels.block_attention_triton import (  # noqa: E402
    BlockAttentionTritonConfig,
    block_attention_from_lengths,
    default_config,
)

H, D, BLOCK = 4, 128, 64
SHAPES = [(512, 1024), (128, 4096), (32, 16384)]
DTYPE = torch.bfloat16
HBM_GBPS = 4270.0
THETA = 10000.0
TIMING = {"warmup": 25.0, "rep": 100.0}


def _graph_ms(fn) -> float:
    """Median ms of ``fn`` replayed from a CUDA graph (no host overhead)."""
    import triton.testing

    with torch.cuda.stream(torch.cuda.Stream()):
        return triton.testing.do_bench_cudagraph(fn, rep=40, return_mode="median")


class Case:
    """One shape with its inputs, block layout and RoPE tables, shared by all providers."""

    def __init__(self, batch, max_len, device):
        gen = torch.Generator().manual_seed(1234 + max_len)
        self.lengths = torch.randint(1, max_len + 1, (batch,), generator=gen)
        self.total = int(self.lengths.sum())
        self.offsets = torch.zeros(batch + 1, dtype=torch.int64)
        self.offsets[1:] = torch.cumsum(self.lengths, 0)
        self.name = f"B{batch}xL{max_len}"
        blocks = (self.lengths + BLOCK - 1) // BLOCK
        self.num_blocks = int(blocks.sum())
        sample = torch.repeat_interleave(torch.arange(batch), self.lengths)
        position = torch.arange(self.total) - self.offsets[:-1][sample]
        first_block = torch.cumsum(blocks, 0) - blocks
        block_of_token = first_block[sample] + position // BLOCK
        # Row of each token in the padded (blocks * 64) layout; the block id of each token.
        self.pad_index = (block_of_token * BLOCK + position % BLOCK).to(device)
        self.block_id = block_of_token.to(device)
        block_len = torch.bincount(block_of_token, minlength=self.num_blocks)
        self.cu_blocks = torch.zeros(self.num_blocks + 1, dtype=torch.int32)
        self.cu_blocks[1:] = torch.cumsum(block_len, 0)
        self.cu_blocks = self.cu_blocks.to(device)
        fwd_flops = 4.0 * H * D * float((block_len.double() ** 2).sum())
        self.flops = {"fwd": fwd_flops, "fwd_bwd": 3.5 * fwd_flops}
        tensor_bytes = self.total * H * D * torch.finfo(DTYPE).bits // 8
        # q, k, v, out forward; q, k, v, out, dout, dq, dk, dv forward+backward.
        self.bytes_moved = {"fwd": 4 * tensor_bytes, "fwd_bwd": 8 * tensor_bytes}
        # cos/sin tables of the rotate-half convention, (T, 1, D), in the data dtype.
        inv_freq = THETA ** (-2.0 * torch.arange(D // 2, dtype=torch.float64) / D)
        angles = position.double()[:, None] * inv_freq[None, :]
        self.cos = torch.cat([angles.cos()] * 2, -1)[:, None, :].to(device, DTYPE)
        self.sin = torch.cat([angles.sin()] * 2, -1)[:, None, :].to(device, DTYPE)
        dgen = torch.Generator(device=device).manual_seed(7)
        shape = (self.total, H, D)
        self.q, self.k, self.v, self.grad = (
            torch.randn(shape, generator=dgen, device=device, dtype=DTYPE) for _ in range(4)
        )

    def rope(self, x):
        half = D // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * self.cos + rotated * self.sin


def _provider(case, run) -> Timed:
    """A provider from ``run(q, k, v) -> out``."""
    return Timed(*autograd_provider(run, (case.q, case.k, case.v), case.grad))


def provider_gem(case: Case, config=None) -> Timed:
    if config is None:
        return _provider(case, lambda q, k, v: block_attention(q, k, v, case.offsets))
    return _provider(
        case, lambda q, k, v: block_attention_from_lengths(q, k, v, case.lengths, config=config)
    )


def provider_sdpa_blocks(case: Case) -> Timed:
    rows = case.num_blocks * BLOCK

    def pad(x):
        padded = x.new_zeros(rows, H, D).index_copy(0, case.pad_index, x)
        return padded.view(case.num_blocks, BLOCK, H, D).transpose(1, 2)

    def run(q, k, v):
        out = F.scaled_dot_product_attention(pad(case.rope(q)), pad(case.rope(k)), pad(v))
        return out.transpose(1, 2).reshape(rows, H, D)[case.pad_index]

    return _provider(case, run)


def provider_flash_blocks(case: Case) -> Timed:
    cu = case.cu_blocks

    def run(q, k, v):
        q, k = case.rope(q), case.rope(k)
        return torch.ops.aten._flash_attention_forward(
            q, k, v, cu, cu, BLOCK, BLOCK, 0.0, False, False
        )[0]

    return _provider(case, run)


_FLEX = {}


def provider_flex(case: Case) -> Timed:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if "fn" not in _FLEX:
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    flex = _FLEX["fn"]
    block_id = case.block_id

    def mask_mod(b, h, q_idx, kv_idx):
        return block_id[q_idx] == block_id[kv_idx]

    block_mask = create_block_mask(
        mask_mod, None, None, case.total, case.total, device=case.q.device, _compile=True
    )

    def run(q, k, v):
        qf, kf, vf = (t.transpose(0, 1).unsqueeze(0) for t in (case.rope(q), case.rope(k), v))
        return flex(qf, kf, vf, block_mask=block_mask)[0].transpose(0, 1)

    return _provider(case, run)


PEERS = {
    "sdpa_blocks_rope": provider_sdpa_blocks,
    "flash_varlen_blocks_rope": provider_flash_blocks,
    "flex_block_rope": provider_flex,
}
REFERENCE = provider_flash_blocks


def _sweep(device, deadline) -> BlockAttentionTritonConfig:
    """Time a few launch configurations at B128xL4096; return the fastest fwd and bwd mix."""
    case = Case(128, 4096, device)
    base = default_config(D)

    def time_fwd(fields) -> float:
        timed = provider_gem(case, BlockAttentionTritonConfig(*fields, 4, 8, 1))
        return median_ms(timed.fwd, **TIMING)

    best_fwd = fastest(
        [(4, 4, 2), (4, 4, 3), (2, 4, 3), (4, 4, 4)],
        time_fwd,
        default=(base.fwd_heads_per_program, base.fwd_warps, base.fwd_stages),
        deadline=deadline,
        label="fwd",
        describe=lambda fields: f"sweep fwd (heads/program, warps, stages) {fields}",
    )

    def time_bwd(fields) -> float:
        timed = provider_gem(case, BlockAttentionTritonConfig(*best_fwd, *fields))
        return median_ms(timed.fwd_bwd, grad_to_none=timed.leaves, **TIMING)

    best_bwd = fastest(
        [(4, 8, 1), (4, 8, 2), (2, 8, 2)],
        time_bwd,
        default=(base.bwd_heads_per_program, base.bwd_warps, base.bwd_stages),
        deadline=deadline,
        label="bwd",
        describe=lambda fields: f"sweep fwd+bwd, bwd (heads/program, warps, stages) {fields}",
    )
    chosen = BlockAttentionTritonConfig(*best_fwd, *best_bwd)
    print(f"chosen config: {chosen}")
    return chosen


def _gem_extras(run: Run, case: Case, times: dict, gem: Timed | None) -> None:
    """gem's ``hbm_fraction``, ``speedup_vs_sdpa_blocks_rope`` and CUDA-graph forward rows."""
    ours, sdpa = times.get("gem", {}), times.get("sdpa_blocks_rope", {})
    for mode, ms in ours.items():
        gbps = case.bytes_moved[mode] / (ms * 1e-3) / 1e9
        run.add(case.name, "gem", mode, "hbm_fraction", gbps / HBM_GBPS)
        if mode in sdpa:
            run.add(case.name, "gem", mode, "speedup_vs_sdpa_blocks_rope", sdpa[mode] / ms, 3)
    if gem is None or not torch.cuda.is_available():
        return
    try:  # kernel time without host overhead
        graph = _graph_ms(gem.fwd)
    except Exception as error:  # noqa: BLE001 - report and keep benchmarking
        run.error(f"{case.name} gem graph: {error!r}")
        graph = float("nan")
    graph_gbps = case.bytes_moved["fwd"] / (graph * 1e-3) / 1e9
    run.add(case.name, "gem", "fwd", "graph_ms", graph)
    run.add(case.name, "gem", "fwd", "graph_gbps", graph_gbps)
    print(f"{case.name:28s} {'gem':26s} graph    {graph:9.3f} ms {graph_gbps:9.0f} GB/s")


def main() -> None:
    parser = results_parser(__doc__, "h200/block_attention.json")
    parser.add_argument("--sweep", action="store_true", help="pick gem's launch config by a sweep")
    parser.add_argument("--config", default="", help="6 comma-separated config fields")
    parser.add_argument("--peers", default=",".join(PEERS), help="comma-separated peer names")
    parser.add_argument("--shapes", default="all", help="'all' or e.g. 128x4096,512x1024")
    parser.add_argument("--flex-shapes", default="128x4096", help="shapes that run flex")
    parser.add_argument("--budget-s", type=float, default=150.0, help="stop starting new work")
    parser.add_argument("--device", default="cuda", help="'cpu' for a smoke run")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device (or --device cpu)")
    run = Run("block_attention", args.out, script="benchmarks/bench_block_attention.py",
              timing=TIMING, checks_key="checks_vs_flash_varlen_blocks_rel_error",
              budget_s=args.budget_s)  # fmt: skip
    config = None
    if args.config:
        config = BlockAttentionTritonConfig(*(int(x) for x in args.config.split(",")))
    if args.sweep:
        config = _sweep(device, run.start + 0.35 * args.budget_s)
    run.extra.update(
        shape={"heads": H, "head_dim": D, "block": BLOCK, "dtype": "bfloat16", "rope_theta": THETA},
        gem_config=str(config or default_config(D)),
    )
    shapes = SHAPES
    if args.shapes != "all":
        shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    flex_shapes = {tuple(int(x) for x in s.split("x")) for s in args.flex_shapes.split(",") if s}
    peers = [p for p in args.peers.split(",") if p]

    def gem(case: Case) -> Timed:
        return provider_gem(case, config)

    for batch, max_len in shapes:
        if run.over_budget(f"B{batch}xL{max_len}"):
            break
        case = Case(batch, max_len, device)
        print(f"{case.name}: {case.total} tokens, {case.num_blocks} blocks")
        providers = {"gem": gem}
        providers |= {
            p: PEERS[p] for p in peers if p != "flex_block_rope" or (batch, max_len) in flex_shapes
        }
        times = run.measure(case, providers, flops=case.flops, bytes_moved=case.bytes_moved,
                            reference=REFERENCE)  # fmt: skip
        _gem_extras(run, case, times, run.build(case, "gem", gem) if "gem" in times else None)
        run.write()
        del case
        torch.cuda.empty_cache()
    run.write()
    run.table(("ms", "tflops", "gbps"), title="block attention")
    print(f"wrote {args.out} ({len(run.rows)} rows) in {time.time() - run.start:.0f} s")


if __name__ == "__main__":
    main()
