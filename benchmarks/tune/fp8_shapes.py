"""Exploration (GPU): which small Fp8Linear shapes fall back to the emulation, and their time.

Per shape and recipe: whether a GEMM falls back to the emulation (cuBLAS rejects the layout)
and the eager forward+backward time against bf16 nn.Linear.

``python benchmarks/tune/fp8_shapes.py`` on a GPU (no install needed) writes
``benchmarks/results/h200/tuning/fp8_probe.json``. Rows: case ``M<m>xK<k>xN<n>``, provider
``gem-<recipe>`` or ``bf16_linear`` (measured in the same run on the same tensors), mode
``fwd_bwd``, metrics ``ms`` (eager, per call) and ``first_ms`` (the first call, compiles
included); the ``fallbacks`` field lists the emulation warnings the call raised. gem-precision
warns once per process about each fallback, so every (recipe, shape) runs in a fresh process.
"""

import sys
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from multiprocessing import get_context
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness

import torch  # noqa: E402
from harness import (  # noqa: E402
    ROOT,
    command_line,
    meta,
    require_cuda,
    results_parser,
    write_results,
)

for _package in ("gem-kernels", "gem-precision"):
    sys.path.insert(0, str(ROOT / "packages" / _package / "src"))

from gem_precision.linear import Fp8Linear, Fp8Recipe  # noqa: E402

SHAPES = [
    (256, 3072, 32),
    (768, 3072, 32),
    (256, 32, 32),
    (4, 32, 32),
    (45001, 32, 32),
    (45002, 32, 32),
    (45003, 128, 32),
    (45004, 32, 128),
    (301, 256, 384),
    (1000, 256, 384),
    (4099, 256, 384),
    (4096, 256, 384),
    (45005, 96, 32),
    (45006, 32, 96),
]
RECIPES = {
    "gem": Fp8Recipe(),
    "sr": Fp8Recipe(stochastic_rounding_grads=True),
    "rht": Fp8Recipe(hadamard=True),
}


def step(layer, x, dy):
    x.grad = None
    layer(x).backward(dy)


def seconds(fn, calls=1):
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls


def eager_ms(layer, x, dy):
    """Per-call forward+backward after 3 warm-up calls (host time included: eager)."""
    call = partial(step, layer, x, dy)
    seconds(call, 3)
    return 1e3 * seconds(call, 10)


def probe(rname: str, m: int, k: int, n: int) -> list[dict]:
    """One recipe at one shape (in its own process: its fallback warnings are all fresh)."""
    fp8 = Fp8Linear.from_linear(torch.nn.Linear(k, n, device="cuda"), recipe=RECIPES[rname])
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = seconds(partial(step, fp8, x, dy))  # compiles the kernels
        ms = eager_ms(fp8, x, dy)
    ms16 = eager_ms(torch.nn.Linear(k, n, device="cuda", dtype=torch.bfloat16), x, dy)
    fallbacks = sorted({str(w.message).split(":")[0][:90] for w in caught})
    case = f"M{m}xK{k}xN{n}"
    print(f"{rname:4} {case:18} fp8 {ms:7.3f} ms  bf16 {ms16:7.3f} ms  {fallbacks}", flush=True)
    return [
        dict(case=case, provider=f"gem-{rname}", mode="fwd_bwd", metric="ms", value=ms,
             fallbacks=fallbacks),
        dict(case=case, provider=f"gem-{rname}", mode="fwd_bwd", metric="first_ms",
             value=1e3 * first),
        dict(case=case, provider="bf16_linear", mode="fwd_bwd", metric="ms", value=ms16,
             recipe_run=rname),
    ]  # fmt: skip


def main() -> None:
    args = results_parser(__doc__, "h200/tuning/fp8_probe.json").parse_args()
    require_cuda()
    rows = []
    # One process per probe, one at a time (the timings must not share the GPU).
    with ProcessPoolExecutor(1, mp_context=get_context("spawn"), max_tasks_per_child=1) as pool:
        for rname in RECIPES:
            for m, k, n in SHAPES:
                rows += pool.submit(probe, rname, m, k, n).result()
    block = meta("fp8_probe", command_line("benchmarks/tune/fp8_shapes.py"), device="cuda")
    write_results(Path(args.out), block, rows)


if __name__ == "__main__":
    main()
