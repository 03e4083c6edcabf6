"""Host time of one public attention call with the GPU work taken out: validation, planning,
autograd and dispatch, i.e. what an eager call costs the CPU besides its kernel launches.

Short attention calls (PMA over B=512 histories: ~0.15 ms on an H200) are bound by this host
time, not by the GPU. Each case calls the public function (``gdpa``, ``jagged_flash_attention``,
``block_attention``) on CPU bfloat16 tensors under ``TRITON_INTERPRET=1`` (so the Triton path is
taken) with the module's ``_forward`` (the launches) replaced by a stub that returns an empty
output (after the kernel-module lookup each real forward makes), and reports the median over
rounds of the mean microseconds per call, without and with autograd. The Triton launch cost
itself is not included (it needs a GPU).

Usage (from the workspace root):
    python benchmarks/bench_attention_host.py           # writes benchmarks/results/cpu/attention_host.json
    PYTHONPATH=<old checkout>/packages/gem-kernels/src python benchmarks/bench_attention_host.py \
        --provider before --out /tmp/before.json        # the same cases on another version
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: CPU tensors take the Triton path

import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from _results import meta, results_parser, user_args, write_results  # noqa: E402

B, H, D, NUM_QUERIES, MAX_LEN = 512, 4, 128, 32, 1024


def _stub_launches():
    """Replaces each Triton module's ``_forward`` by an empty-output stub (no kernels run) that
    still asks for the kernel module once, as every real forward does before it launches."""
    from gem_kernels import block_attention_triton, gdpa_triton, jfa_triton

    def gdpa_forward(q, k, v, plan, launch, out_rows):
        gdpa_triton._kernels(False)
        return torch.empty((out_rows, q.shape[1], q.shape[2]), dtype=q.dtype)

    def jfa_forward(q, k, v, rel_pos_bias, jagged_bias, plan, launch):
        jfa_triton._kernels(False)
        return torch.empty_like(q), torch.empty(q.shape[:2], dtype=torch.float32)

    def block_forward(q, k, v, positions, launch):
        block_attention_triton._kernels(False)
        return torch.empty_like(q)

    gdpa_triton._forward = gdpa_forward
    jfa_triton._forward = jfa_forward
    block_attention_triton._forward = block_forward


def _cases():
    from gem_kernels import block_attention, gdpa, jagged_flash_attention

    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, MAX_LEN + 1, (B,), generator=gen)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    tokens = int(offsets[-1])
    q = torch.randn(tokens, H, D, generator=gen).bfloat16()
    k, v = torch.randn_like(q), torch.randn_like(q)
    queries = torch.randn(NUM_QUERIES, H, D, generator=gen).bfloat16()
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


def _time_us(call, calls: int, rounds: int) -> float:
    for _ in range(20):
        call()
    means = []
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(calls):
            call()
        means.append((time.perf_counter() - started) / calls * 1e6)
    return statistics.median(means)


def main() -> None:
    parser = results_parser(__doc__, "cpu/attention_host.json")
    parser.add_argument("--provider", default="gem", help="row provider name (e.g. 'before')")
    parser.add_argument("--calls", type=int, default=500, help="calls per round")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    _stub_launches()
    rows = []
    for case, (fn, tensors, kwargs) in _cases().items():
        kwargs = {**kwargs, "backend": "triton"}
        for mode in ("no_grad", "grad"):
            leaves = [
                t.detach().requires_grad_(mode == "grad") if _is_data(t) else t for t in tensors
            ]

            def call(fn=fn, leaves=leaves, kwargs=kwargs, mode=mode):
                with torch.set_grad_enabled(mode == "grad"):
                    return fn(*leaves, **kwargs)

            us = _time_us(call, args.calls, args.rounds)
            rows.append(
                {"case": case, "provider": args.provider, "mode": mode, "metric": "host_us",
                 "value": us}
            )  # fmt: skip
            print(f"{case:>16} {mode:>8}: {us:7.1f} us per call", flush=True)
    command = "python benchmarks/bench_attention_host.py " + " ".join(user_args())
    write_results(
        Path(args.out),
        meta("attention_host", command.strip(), batch=B, heads=H, head_dim=D, max_len=MAX_LEN),
        rows,
    )
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
