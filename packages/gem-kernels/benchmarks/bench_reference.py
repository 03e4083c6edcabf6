"""Time forward + backward of the reference attention at the tiny CPU-training shape.

Usage: python packages/gem-kernels/benchmarks/bench_reference.py [--batch 256] [--max-len 128]
"""

from __future__ import annotations

import argparse
import time

import torch
from gem_kernels import block_attention, gdpa, jagged_flash_attention, lengths_to_offsets


def _time(fn, repeats: int) -> float:
    fn()  # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--max-len", type=int, default=128)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, args.max_len + 1, (args.batch,), generator=generator)
    offsets = lengths_to_offsets(lengths)
    total = int(lengths.sum())

    def leaf(rows: int) -> torch.Tensor:
        shape = (rows, args.heads, args.head_dim)
        return torch.randn(shape, generator=generator).requires_grad_(True)

    q, k, v = leaf(total), leaf(total), leaf(total)
    pma_queries = leaf(4)
    cases = {
        "jagged_flash_attention causal": lambda: jagged_flash_attention(
            q, k, v, offsets, causal=True
        ),
        "gdpa silu self": lambda: gdpa(q, k, v, offsets, activation="silu"),
        "gdpa PMA (Nq=4)": lambda: gdpa(pma_queries, k, v, None, offsets),
        "block_attention (64)": lambda: block_attention(q, k, v, offsets),
    }
    print(
        f"B={args.batch} L<={args.max_len} tokens={total} H={args.heads} D={args.head_dim} "
        f"threads={torch.get_num_threads()}"
    )
    for name, forward in cases.items():
        fwd = _time(forward, args.repeats)
        fwd_bwd = _time(lambda forward=forward: forward().sum().backward(), args.repeats)
        print(f"{name:32s} forward {fwd * 1e3:8.1f} ms   forward+backward {fwd_bwd * 1e3:8.1f} ms")


if __name__ == "__main__":
    main()
