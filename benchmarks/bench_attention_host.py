"""Host time of one eager public attention call on a GPU, beside its kernel time.

The host time is validation, planning, autograd, dispatch and the Triton launches: what the
call costs the CPU.

Short attention calls (PMA over B=512 histories: ~0.15 ms on an H200) are bound by this host
time, not by the GPU. Each case calls the public function (``gdpa``, ``jagged_flash_attention``,
``block_attention``, ``backend="triton"``) on CUDA bfloat16 tensors with host offsets (as the
loader has them). ``host_us``: the median over ``--rounds`` of the mean wall time per call of
``--calls`` back-to-back calls issued while a queue of large matmuls keeps the GPU busy: the
calls' kernels cannot start, so the loop times only the host's work (a call that synchronised
would wait for the whole queue and show as a large time). Rounds in which the queue ran dry
before the last call was issued are counted in ``meta.rounds_gpu_caught_up``. ``device_us``: the kernel time per
call from ``torch.profiler``. Both without and with autograd (modes ``no_grad`` / ``grad``).

Usage (from the workspace root, on a GPU machine):
    python benchmarks/bench_attention_host.py           # writes benchmarks/results/h200/attention_host.json
    PYTHONPATH=<old checkout>/packages/gem-kernels/src python benchmarks/bench_attention_host.py \
        --provider before --out /tmp/before.json        # the same cases on another version

``benchmarks/results/cpu/attention_host.json`` came from an earlier version that replaced the
kernel modules' launch functions by stubs and ran on the CPU: it left the launches out.
"""

from __future__ import annotations

import math
import statistics
import sys
import time

import torch
from harness import ROOT, Run, require_cuda, results_parser

sys.path.insert(0, str(ROOT / "packages" / "gem-kernels" / "src"))

B, H, D, NUM_QUERIES, MAX_LEN = 512, 4, 128, 32, 1024
BUSY_N = 8192  # side of the bf16 matmuls that keep the GPU busy (~1.4 ms each on an H200)


def _cases():
    from gem_kernels import block_attention, gdpa, jagged_flash_attention

    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, MAX_LEN + 1, (B,), generator=gen)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])  # host
    tokens = int(offsets[-1])
    q = torch.randn(tokens, H, D, generator=gen).to("cuda", torch.bfloat16)
    k, v = torch.randn_like(q), torch.randn_like(q)
    queries = torch.randn(NUM_QUERIES, H, D, generator=gen).to("cuda", torch.bfloat16)
    return {
        "pma": (
            gdpa,
            (queries, k, v, None, offsets),
            {"max_k": MAX_LEN, "activation": "gelu_fast"},
        ),
        "gdpa_self": (gdpa, (q, k, v, offsets), {"max_q": MAX_LEN, "activation": "gelu_fast"}),
        "jfa_causal": (
            jagged_flash_attention,
            (q, k, v, offsets),
            {"max_q": MAX_LEN, "causal": True},
        ),
        "block_attention": (block_attention, (q, k, v, offsets), {"max_len": MAX_LEN}),
    }


def _is_data(t) -> bool:
    """q, k or v (not offsets, not None)."""
    return isinstance(t, torch.Tensor) and t.is_floating_point()


class Busy:
    """Large matmuls queued ahead of the timed calls, so that the GPU stays busy."""

    def __init__(self) -> None:
        self.a = torch.randn(BUSY_N, BUSY_N, device="cuda", dtype=torch.bfloat16)
        self.out = torch.empty_like(self.a)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.mm(self.a, self.a, out=self.out)
        start.record()
        for _ in range(5):
            torch.mm(self.a, self.a, out=self.out)
        end.record()
        end.synchronize()
        self.matmul_ms = start.elapsed_time(end) / 5

    def queue(self, ms: float) -> torch.cuda.Event:
        """Queues about ``ms`` of GPU work; the returned event completes when it has run."""
        for _ in range(max(1, math.ceil(ms / self.matmul_ms))):
            torch.mm(self.a, self.a, out=self.out)
        done = torch.cuda.Event()
        done.record()
        return done


def host_us(call, busy: Busy, calls: int, rounds: int) -> tuple[float, int]:
    """Median over ``rounds`` of the mean µs per call with the GPU busy, and how many rounds
    the GPU caught up with the host before the calls were issued (those waited on it)."""
    for _ in range(20):
        call()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    estimate_ms = (time.perf_counter() - start) * 1e3  # an upper bound: it may have waited
    torch.cuda.synchronize()
    means, caught_up = [], 0
    for _ in range(rounds):
        done = busy.queue(2 * estimate_ms + 5)
        start = time.perf_counter()
        for _ in range(calls):
            call()
        means.append((time.perf_counter() - start) / calls * 1e6)
        caught_up += bool(done.query())
        torch.cuda.synchronize()
    return statistics.median(means), caught_up


def device_us(call, calls: int = 20) -> float:
    """Kernel time per call (µs), summed over the kernels ``torch.profiler`` records."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    total = sum(getattr(e, "self_device_time_total", 0.0) for e in prof.key_averages())
    return total / calls


def main() -> None:
    parser = results_parser(__doc__, "h200/attention_host.json")
    parser.add_argument("--provider", default="gem", help="row provider name (e.g. 'before')")
    parser.add_argument("--calls", type=int, default=50, help="calls per round")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    require_cuda()
    run = Run("attention_host", args.out, script="benchmarks/bench_attention_host.py",
              extra=dict(batch=B, heads=H, head_dim=D, max_len=MAX_LEN, rounds_gpu_caught_up={}))  # fmt: skip
    busy = Busy()
    for case, (fn, tensors, kwargs) in _cases().items():
        kwargs = {**kwargs, "backend": "triton"}
        for mode in ("no_grad", "grad"):
            leaves = [
                t.detach().requires_grad_(mode == "grad") if _is_data(t) else t for t in tensors
            ]

            def call(fn=fn, leaves=leaves, kwargs=kwargs, mode=mode):
                with torch.set_grad_enabled(mode == "grad"):
                    return fn(*leaves, **kwargs)

            try:
                us, caught_up = host_us(call, busy, args.calls, args.rounds)
                kernel_us = device_us(call)
            except Exception as error:  # noqa: BLE001 - report and keep measuring
                run.error(f"{case} {mode}: {error!r}")
                continue
            run.add(case, args.provider, mode, "host_us", us)
            run.add(case, args.provider, mode, "device_us", kernel_us)
            run.extra["rounds_gpu_caught_up"][f"{case}/{mode}"] = caught_up
            print(f"{case:>16} {mode:>8}: host {us:7.1f} us, kernels {kernel_us:7.1f} us per call"
                  f"{f' (GPU caught up in {caught_up} rounds)' if caught_up else ''}", flush=True)  # fmt: skip
            run.write()
    run.write()
    run.table(("host_us", "device_us"), title="attention host time per call (us)")
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
