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

Peers (RoPE as separate eager PyTorch ops with precomputed cos/sin tables, the way a user would
write it, and its backward through autograd):

* ``sdpa_blocks_rope``: each sample padded to a multiple of 64 tokens, SDPA over
  ``(blocks, H, 64, D)`` (no mask, so padded keys are attended: a lower bound on its cost).
* ``flash_varlen_blocks_rope``: ``aten._flash_attention_forward`` with one "sequence" per block
  (exact, no padding); also the correctness reference for gem's output and gradients.
* ``flex_block_rope``: FlexAttention over the packed tokens with a same-block mask
  (``torch.compile``; only at the shapes in ``--flex-shapes``: compiling is slow).

    PYTHONPATH=packages/gem-kernels/src python benchmarks/bench_block_attention.py \
        --out benchmarks/results/h200/block_attention.json

``--sweep`` first times a few launch configurations of gem's kernels at B128xL4096 and uses
the fastest forward and backward.
"""

from __future__ import annotations

import sys
import time
import traceback

import torch
import torch.nn.functional as F
from _results import ROOT, meta, require_cuda, results_parser, write_results
from _timing import autograd_provider, fastest, grad_leaves, median_ms, record_check, rel_error

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


def _bench(fn, grad_to_none=None) -> float:
    return median_ms(fn, warmup=25, rep=100, grad_to_none=grad_to_none)


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
        self.fwd_flops = 4.0 * H * D * float((block_len.double() ** 2).sum())
        self.tensor_bytes = self.total * H * D * torch.finfo(DTYPE).bits // 8
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

    def leaves(self):
        return grad_leaves((self.q, self.k, self.v))

    def rope(self, x):
        half = D // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * self.cos + rotated * self.sin


def _provider(case, run):
    """(fwd, fwd_bwd, leaves) from ``run(q, k, v) -> out``."""
    return autograd_provider(run, (case.q, case.k, case.v), case.grad)


def provider_gem(case: Case, config=None):
    if config is None:
        return _provider(case, lambda q, k, v: block_attention(q, k, v, case.offsets))
    return _provider(
        case, lambda q, k, v: block_attention_from_lengths(q, k, v, case.lengths, config=config)
    )


def provider_sdpa_blocks(case: Case):
    rows = case.num_blocks * BLOCK

    def pad(x):
        padded = x.new_zeros(rows, H, D).index_copy(0, case.pad_index, x)
        return padded.view(case.num_blocks, BLOCK, H, D).transpose(1, 2)

    def run(q, k, v):
        out = F.scaled_dot_product_attention(pad(case.rope(q)), pad(case.rope(k)), pad(v))
        return out.transpose(1, 2).reshape(rows, H, D)[case.pad_index]

    return _provider(case, run)


def _flash_blocks(case: Case, q, k, v):
    cu = case.cu_blocks
    return torch.ops.aten._flash_attention_forward(
        q, k, v, cu, cu, BLOCK, BLOCK, 0.0, False, False
    )[0]


def provider_flash_blocks(case: Case):
    return _provider(case, lambda q, k, v: _flash_blocks(case, case.rope(q), case.rope(k), v))


_FLEX = {}


def provider_flex(case: Case):
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


# ---------------------------------------------------------------------------------------------


def _check(case: Case, checks: dict) -> None:
    """gem's output and gradients against flash varlen over blocks (+ separate RoPE)."""
    record_check(checks, case.name, lambda: _errors_against_flash(case))


def _errors_against_flash(case: Case) -> dict[str, float]:
    """Relative errors of gem's out, dq, dk, dv against flash varlen over blocks."""
    results = {}
    for name, make in (("gem", provider_gem), ("ref", provider_flash_blocks)):
        _, _, leaves = make(case)
        out = (
            block_attention(*leaves, case.offsets)
            if name == "gem"
            else _flash_blocks(case, case.rope(leaves[0]), case.rope(leaves[1]), leaves[2])
        )
        out.backward(case.grad)
        results[name] = [out.detach()] + [leaf.grad for leaf in leaves]
    return {
        label: rel_error(a, b)
        for label, a, b in zip(
            ("out", "dq", "dk", "dv"), results["gem"], results["ref"], strict=True
        )  # fmt: skip
    }


def _measure(rows, errors, case, provider, make) -> dict:
    try:
        fwd, fwd_bwd, leaves = make()
    except Exception as error:  # noqa: BLE001
        errors.append(f"{case.name} {provider} setup: {error!r}"[:400])
        print(errors[-1])
        traceback.print_exc(limit=2)
        return {}
    times = {}
    for mode, fn, tensors in (("fwd", fwd, 4), ("fwd_bwd", fwd_bwd, 8)):
        try:
            ms = _bench(fn, grad_to_none=leaves if mode == "fwd_bwd" else None)
        except Exception as error:  # noqa: BLE001
            errors.append(f"{case.name} {provider} {mode}: {error!r}"[:400])
            print(errors[-1])
            continue
        flops = case.fwd_flops * (3.5 if mode == "fwd_bwd" else 1.0)
        tflops = flops / (ms * 1e-3) / 1e12
        gbps = tensors * case.tensor_bytes / (ms * 1e-3) / 1e9
        times[mode] = ms
        for metric, value in (("ms", ms), ("tflops", tflops), ("gbps", gbps)):
            rows.append({"case": case.name, "provider": provider, "mode": mode,
                         "metric": metric, "value": round(value, 4)})  # fmt: skip
        if provider == "gem":
            rows.append({"case": case.name, "provider": provider, "mode": mode,
                         "metric": "hbm_fraction", "value": round(gbps / HBM_GBPS, 4)})  # fmt: skip
        if provider == "gem" and mode == "fwd":  # kernel time without host overhead
            try:
                graph = _graph_ms(fn)
            except Exception as error:  # noqa: BLE001 - report and keep benchmarking
                errors.append(f"{case.name} {provider} graph: {error!r}"[:300])
                graph = float("nan")
            graph_gbps = tensors * case.tensor_bytes / (graph * 1e-3) / 1e9
            for metric, value in (("graph_ms", graph), ("graph_gbps", graph_gbps)):
                rows.append({"case": case.name, "provider": provider, "mode": mode,
                             "metric": metric, "value": round(value, 4)})  # fmt: skip
            print(f"{case.name:14s} {provider:26s} graph    {graph:8.3f} ms {graph_gbps:7.0f} GB/s")
        print(f"{case.name:14s} {provider:26s} {mode:8s} {ms:8.3f} ms {tflops:7.1f} TFLOP/s "
              f"{gbps:7.0f} GB/s")  # fmt: skip
    return times


def _sweep(device, deadline) -> BlockAttentionTritonConfig:
    """Time a few launch configurations at B128xL4096; return the fastest fwd and bwd mix."""
    case = Case(128, 4096, device)
    base = default_config(D)
    best_fwd = fastest(
        [(4, 4, 2), (4, 4, 3), (2, 4, 3), (4, 4, 4)],
        lambda fields: _bench(provider_gem(case, BlockAttentionTritonConfig(*fields, 4, 8, 1))[0]),
        default=(base.fwd_heads_per_program, base.fwd_warps, base.fwd_stages),
        deadline=deadline,
        label="fwd",
        describe=lambda fields: f"sweep fwd (heads/program, warps, stages) {fields}",
    )

    def time_bwd(fields) -> float:
        _, fwd_bwd, leaves = provider_gem(case, BlockAttentionTritonConfig(*best_fwd, *fields))
        return _bench(fwd_bwd, grad_to_none=leaves)

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


def main() -> None:
    parser = results_parser(__doc__, "h200/block_attention.json")
    parser.add_argument("--sweep", action="store_true", help="pick gem's launch config by a sweep")
    parser.add_argument("--config", default="", help="6 comma-separated config fields")
    parser.add_argument("--peers", default=",".join(PEERS), help="comma-separated peer names")
    parser.add_argument("--shapes", default="all", help="'all' or e.g. 128x4096,512x1024")
    parser.add_argument("--flex-shapes", default="128x4096", help="shapes that run flex")
    parser.add_argument("--budget-s", type=float, default=150.0, help="stop starting new work")
    args = parser.parse_args()
    require_cuda()
    import triton

    device = torch.device("cuda")
    start = time.time()
    config = None
    if args.config:
        config = BlockAttentionTritonConfig(*(int(x) for x in args.config.split(",")))
    if args.sweep:
        config = _sweep(device, start + 0.35 * args.budget_s)
    shapes = SHAPES
    if args.shapes != "all":
        shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    flex_shapes = {tuple(int(x) for x in s.split("x")) for s in args.flex_shapes.split(",") if s}
    peers = [p for p in args.peers.split(",") if p]
    rows, errors, checks = [], [], {}

    def write():
        command = " ".join(["python benchmarks/bench_block_attention.py", *sys.argv[1:]])
        meta_block = meta(
            "block_attention", command, device=torch.cuda.get_device_name(),
            triton=triton.__version__,
            shape={"heads": H, "head_dim": D, "block": BLOCK, "dtype": "bfloat16",
                   "rope_theta": THETA},
            gem_config=str(config or default_config(D)),
            checks_vs_flash_varlen_blocks_rel_error=checks, errors=errors,
            wall_s=round(time.time() - start, 1),
        )  # fmt: skip
        write_results(__import__("pathlib").Path(args.out), meta_block, rows)

    for batch, max_len in shapes:
        if time.time() - start > args.budget_s:
            errors.append(f"budget reached before B{batch}xL{max_len}")
            break
        case = Case(batch, max_len, device)
        print(f"{case.name}: {case.total} tokens, {case.num_blocks} blocks")
        _check(case, checks)
        gem = _measure(rows, errors, case, "gem", lambda c=case: provider_gem(c, config))
        for peer in peers:
            if peer == "flex_block_rope" and (batch, max_len) not in flex_shapes:
                continue
            times = _measure(rows, errors, case, peer, lambda c=case, p=peer: PEERS[p](c))
            if peer == "sdpa_blocks_rope":
                for mode, ms in times.items():
                    if mode in gem:
                        rows.append({"case": case.name, "provider": "gem", "mode": mode,
                                     "metric": "speedup_vs_sdpa_blocks_rope",
                                     "value": round(ms / gem[mode], 3)})  # fmt: skip
        write()
        del case
        torch.cuda.empty_cache()
    write()
    print(f"wrote {args.out} ({len(rows)} rows) in {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
