"""NCCL vs gem's copy-engine all-gather and reduce-scatter on 2 GPUs: bandwidth and SM interference.

    python benchmarks/bench_collectives.py --out benchmarks/results/h200x2/collectives.json

Spawns one process per GPU (NCCL, one host). First checks correctness (every result compared
with NCCL's, and FSDP2 training with the copy-engine all-gather against FSDP's default), then:

* bandwidth: all-gather and reduce-scatter of 16 / 64 / 256 MiB per rank (bf16), bus bandwidth
  ``S (n - 1) / t`` with ``S`` the per-rank chunk; CUDA events around back-to-back calls,
  median of 5 repetitions, slowest rank. Providers: ``nccl`` (``all_gather_into_tensor`` in
  place, ``reduce_scatter_tensor``), ``gem`` (copy engine; all-gather in place on a buffer from
  ``symmetric_empty``, reduce-scatter from a symmetric input), ``gem-staged`` (copy engine on
  ordinary tensors: an SM copy stages the input into symmetric memory);
* interference: four 8192^3 bf16 GEMMs on the main stream, alone and with one 256 MiB
  collective launched beside them on a high-priority side stream. Both streams are held behind
  a ``torch.cuda._sleep`` kernel while the CPU enqueues everything, so the GEMMs and the
  collective start together and CPU launch time is not counted; the GEMMs are timed by events
  on the main stream, the collective by events on the side stream. ``gemm_slowdown`` =
  median(with) / median(alone) - 1 (slowest rank). Case ``.../loop``: the collective repeated
  back to back to cover the GEMMs' whole duration.

NVLink multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
NVSHMEM_DISABLE_NVLS=1 are forced here, also for the children).
"""

from __future__ import annotations

import os

for _name, _value in (
    ("NCCL_NVLS_ENABLE", "0"),
    ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
    ("NVSHMEM_DISABLE_NVLS", "1"),
):
    os.environ[_name] = _value

import datetime  # noqa: E402
import logging  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from gem_parallel import collectives as col  # noqa: E402
from gem_parallel import fsdp as gem_fsdp  # noqa: E402
from gem_parallel import mesh as gem_mesh  # noqa: E402
from harness import meta, results_parser, write_results  # noqa: E402

MIB = 1 << 20
SIZES_MIB = (16, 64, 256)
INTERFERENCE_MIB = 256
GEMM_N = 8192
DTYPE = torch.bfloat16


def _max_over_ranks(value: float) -> float:
    t = torch.tensor([value], device="cuda", dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _sync_all() -> None:
    torch.cuda.synchronize()
    dist.barrier()
    torch.cuda.synchronize()


def _time_per_call(fn, iters: int, reps: int = 5, warmup: int = 3) -> float:
    """Median over reps of the mean ms per call (events on the current stream), slowest rank."""
    for _ in range(warmup):
        fn()
    _sync_all()
    samples = []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / iters)
    return _max_over_ranks(statistics.median(samples))


# ------------------------------------------------------------------------------------- checks


def _checks(rank: int, world: int, rows: list, notes: dict) -> None:
    device = torch.device("cuda", rank)
    gather, reason = col.select_all_gather()
    scatter, scatter_reason = col.select_reduce_scatter()
    notes["all_gather_choice"] = reason
    notes["reduce_scatter_choice"] = scatter_reason
    if gather is not col.copy_engine_all_gather:
        raise RuntimeError(f"copy engine not selected on 2 GPUs: {reason}")

    worst = {"all_gather": 0.0, "reduce_scatter": 0.0}
    for dtype in (torch.bfloat16, torch.float32):
        for rows_per_rank, cols in ((1, 1), (1000, 77), (4096, 1024)):
            for trial in range(3):  # repeated calls reuse buffers: catches missing barriers
                g = torch.Generator(device=device).manual_seed(1000 * trial + rank)
                inp = torch.randn(rows_per_rank, cols, device=device, generator=g).to(dtype)
                expected = torch.empty(world * rows_per_rank, cols, device=device, dtype=dtype)
                dist.all_gather_into_tensor(expected, inp)
                # staged (ordinary tensors)
                out = torch.full_like(expected, float("nan"))
                col.copy_engine_all_gather(out, inp)
                # symmetric input
                sym_in = col.symmetric_empty(inp.shape, dtype) if trial == 0 else None
                outs = [out]
                if sym_in is not None:
                    sym_in.copy_(inp)
                    out2 = torch.full_like(expected, float("nan"))
                    col.copy_engine_all_gather(out2, sym_in)
                    outs.append(out2)
                # in place on a symmetric output
                sym_out = col.symmetric_empty(expected.shape, dtype) if trial == 0 else None
                if sym_out is not None:
                    sym_out.fill_(float("nan"))
                    own = sym_out.view(world, *inp.shape)[rank]
                    own.copy_(inp)
                    col.copy_engine_all_gather(sym_out, own)
                    outs.append(sym_out)
                for o in outs:
                    if not torch.equal(o, expected):
                        raise AssertionError(f"all-gather mismatch {dtype} {tuple(inp.shape)}")
                # reduce-scatter, staged and symmetric input
                big = torch.randn(world * rows_per_rank, cols, device=device, generator=g)
                big = big.to(dtype)
                ref = torch.empty(rows_per_rank, cols, device=device, dtype=dtype)
                dist.reduce_scatter_tensor(ref, big)
                mine = torch.empty_like(ref)
                col.copy_engine_reduce_scatter(mine, big)
                errs = [(mine.float() - ref.float()).abs().max().item()]
                if trial == 0:
                    sym_big = col.symmetric_empty(big.shape, dtype)
                    sym_big.copy_(big)
                    mine2 = torch.empty_like(ref)
                    col.copy_engine_reduce_scatter(mine2, sym_big)
                    errs.append((mine2.float() - ref.float()).abs().max().item())
                worst["reduce_scatter"] = max(worst["reduce_scatter"], *errs)
    torch.cuda.synchronize()
    for kind, err in worst.items():
        err = _max_over_ranks(err)
        rows.append(_row(f"check/{kind}", "gem", kind, "max_abs_err_vs_nccl", err))
        # 2 ranks: a + b rounds the same whichever rank adds; allow for a different NCCL path.
        if err > 1e-2:
            raise AssertionError(f"{kind} differs from NCCL by {err}")


def _fsdp_check(rank: int, world: int, rows: list, notes: dict) -> None:
    """FSDP2 over 2 GPUs: copy-engine all-gather vs FSDP's default, same losses and grads."""
    from torch import nn

    gem = gem_mesh.build_gem_mesh(
        gem_mesh.ParallelLayout(replicate=1, shard=world), None, device_type="cuda"
    )
    messages: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("gem_parallel").addHandler(handler)
    logging.getLogger("gem_parallel").setLevel(logging.INFO)

    def make():
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Linear(96, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 8)
        ).cuda()

    g = torch.Generator(device="cuda").manual_seed(rank)
    x = torch.randn(64, 96, device="cuda", generator=g)
    results = {}
    for mode in ("nccl", "auto"):
        messages.clear()
        model = gem_fsdp.apply_fsdp(make(), gem, all_gather=mode)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for _ in range(3):
            loss = model(x).square().mean()
            loss.backward()
            losses.append(loss.detach().clone())
            opt.step()
            opt.zero_grad()
        params = [p.full_tensor().detach().clone() for p in model.parameters()]
        results[mode] = (torch.stack(losses), params, list(messages))
    torch.cuda.synchronize()
    chosen = [m for m in results["auto"][2] if "FSDP all-gather" in m]
    notes["fsdp_auto_log"] = chosen
    diffs = [(results["nccl"][0] - results["auto"][0]).abs().max().item()] + [
        (a - b).abs().max().item()
        for a, b in zip(results["nccl"][1], results["auto"][1], strict=True)
    ]
    notes["fsdp_max_abs_diff"] = max(diffs)
    same = max(diffs) <= 1e-6
    if not chosen or "copy_engine" not in chosen[0]:
        raise AssertionError(
            f"apply_fsdp(all_gather='auto') did not pick the copy engine: {chosen}"
        )
    if not same:
        raise AssertionError("FSDP with the copy-engine all-gather differs from FSDP's default")
    rows.append(_row("check/fsdp_3_steps", "gem", "fsdp", "max_abs_diff_vs_nccl", max(diffs)))


# ---------------------------------------------------------------------------------- bandwidth


def _row(case: str, provider: str, mode: str, metric: str, value: float) -> dict:
    return {"case": case, "provider": provider, "mode": mode, "metric": metric, "value": value}


def _all_gather_setups(rank: int, world: int, chunk_mib: int) -> dict:
    """provider -> a zero-argument all-gather of chunk_mib MiB per rank."""
    numel = chunk_mib * MIB // DTYPE.itemsize
    plain_out = torch.randn(world * numel, device="cuda").to(DTYPE)
    plain_own = plain_out.view(world, numel)[rank]
    sym_out = col.symmetric_empty((world * numel,), DTYPE)
    sym_out.copy_(plain_out)
    sym_own = sym_out.view(world, numel)[rank]
    staged_in = plain_own.clone()
    staged_out = torch.empty_like(plain_out)
    return {
        "nccl": lambda: dist.all_gather_into_tensor(plain_out, plain_own),
        "gem": lambda: col.copy_engine_all_gather(sym_out, sym_own),
        "gem-staged": lambda: col.copy_engine_all_gather(staged_out, staged_in),
    }


def _reduce_scatter_setups(rank: int, world: int, chunk_mib: int) -> dict:
    numel = chunk_mib * MIB // DTYPE.itemsize
    plain_in = torch.randn(world * numel, device="cuda").to(DTYPE)
    out = torch.empty(numel, device="cuda", dtype=DTYPE)
    sym_in = col.symmetric_empty((world * numel,), DTYPE)
    sym_in.copy_(plain_in)
    return {
        "nccl": lambda: dist.reduce_scatter_tensor(out, plain_in),
        "gem": lambda: col.copy_engine_reduce_scatter(out, sym_in),
        "gem-staged": lambda: col.copy_engine_reduce_scatter(out, plain_in),
    }


def _bandwidth(rank: int, world: int, rows: list, setups_cache: dict) -> None:
    for mode, make in (
        ("all_gather", _all_gather_setups),
        ("reduce_scatter", _reduce_scatter_setups),
    ):
        for mib in SIZES_MIB:
            setups = make(rank, world, mib)
            setups_cache[mode, mib] = setups
            iters = max(3, 512 // mib)
            for provider, fn in setups.items():
                ms = _time_per_call(fn, iters)
                gbps = mib * MIB * (world - 1) / (ms * 1e-3) / 1e9
                case = f"{mode}/{mib}MiB"
                rows += [
                    _row(case, provider, mode, "ms", ms),
                    _row(case, provider, mode, "gbps", gbps),
                ]
                if rank == 0:
                    print(f"{case:<24}{provider:<12}{ms:8.3f} ms {gbps:8.1f} GB/s", flush=True)


# ------------------------------------------------------------------------------- interference


def _interference(rank: int, world: int, rows: list, setups_cache: dict) -> None:
    g = torch.Generator(device="cuda").manual_seed(rank)
    a = torch.randn(GEMM_N, GEMM_N, device="cuda", generator=g).to(DTYPE)
    b = torch.randn(GEMM_N, GEMM_N, device="cuda", generator=g).to(DTYPE)
    c = torch.empty_like(a)
    main = torch.cuda.current_stream()
    side = torch.cuda.Stream(priority=-1)
    sleep_cycles = 4_000_000  # ~2 ms at 2 GHz: time for the CPU to enqueue everything

    def run(collective, count: int) -> tuple[float, float]:
        _sync_all()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        c_start, c_end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(sleep_cycles)
        if collective is not None:
            side.wait_stream(main)
            with torch.cuda.stream(side):
                c_start.record()
                for _ in range(count):
                    collective()
                c_end.record()
        start.record()
        for _ in range(4):
            torch.mm(a, b, out=c)
        end.record()
        torch.cuda.synchronize()
        coll_ms = c_start.elapsed_time(c_end) if collective is not None else 0.0
        return start.elapsed_time(end), coll_ms

    for _ in range(3):
        run(None, 0)
    alone = _max_over_ranks(statistics.median(run(None, 0)[0] for _ in range(10)))
    tflops = 4 * 2 * GEMM_N**3 / (alone * 1e-3) / 1e12
    rows += [
        _row("gemm4x8192", "torch", "gemm", "ms", alone),
        _row("gemm4x8192", "torch", "gemm", "tflops", tflops),
    ]
    if rank == 0:
        print(f"4 x {GEMM_N}^3 bf16 GEMMs alone: {alone:.3f} ms ({tflops:.0f} TFLOP/s)", flush=True)
    for mode in ("all_gather", "reduce_scatter"):
        setups = setups_cache[mode, INTERFERENCE_MIB]
        for provider, fn in setups.items():
            single_ms = _time_per_call(fn, 3)
            for variant, count in (("", 1), ("/loop", max(1, round(alone / single_ms)))):
                for _ in range(2):
                    run(fn, count)
                samples = [run(fn, count) for _ in range(10)]
                gemm_ms = _max_over_ranks(statistics.median(s[0] for s in samples))
                coll_ms = _max_over_ranks(statistics.median(s[1] for s in samples))
                slowdown = gemm_ms / alone - 1
                case = f"gemm4x8192+{mode}/{INTERFERENCE_MIB}MiB{variant}"
                rows += [
                    _row(case, provider, mode, "gemm_slowdown", slowdown),
                    _row(case, provider, mode, "gemm_ms", gemm_ms),
                    _row(case, provider, mode, "collective_ms_overlapped", coll_ms),
                    _row(case, provider, mode, "collectives_launched", count),
                ]
                if rank == 0:
                    print(
                        f"{case:<44}{provider:<12} GEMMs {gemm_ms:7.3f} ms "
                        f"({100 * slowdown:+5.1f}%), {count} x collective {coll_ms:7.3f} ms",
                        flush=True,
                    )


# ------------------------------------------------------------------------------------ driver


def _worker(rank: int, world: int, out_path: str, command: str) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl",
        rank=rank,
        world_size=world,
        device_id=torch.device("cuda", rank),
        timeout=datetime.timedelta(seconds=90),
    )
    if rank == 0:
        logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    rows: list[dict] = []
    notes: dict = {}
    status = "complete"

    def save() -> None:
        if rank != 0:
            return
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
        try:
            cta_policy = hasattr(dist.ProcessGroupNCCL.Options().config, "cta_policy")
        except Exception:  # noqa: BLE001 - only informative
            cta_policy = False
        block = meta(
            "collectives",
            command,
            device=f"{world} x {torch.cuda.get_device_name(0)}",
            nccl=nccl,
            nccl_cta_policy_option_in_torch=cta_policy,
            status=status,
            **notes,
        )
        write_results(Path(out_path), block, rows)

    setups: dict = {}
    failures = []
    # A failed section is recorded and the next one still runs (results stay useful).
    for name, section, extra in (
        ("checks", _checks, notes),
        ("fsdp_check", _fsdp_check, notes),
        ("bandwidth", _bandwidth, setups),
        ("interference", _interference, setups),
    ):
        try:
            section(rank, world, rows, extra)
        except Exception:
            failures.append(f"{name}: {traceback.format_exc(limit=8)}")
            if rank == 0:
                print(failures[-1], flush=True)
            torch.cuda.synchronize()
            _sync_all()
        notes["failures"] = failures
        status = "complete" if not failures else f"{len(failures)} section(s) failed"
        save()
    dist.destroy_process_group()
    if rank == 0:
        print(f"wrote {out_path}")


def main() -> None:
    parser = results_parser(__doc__, "h200x2/collectives.json")
    args = parser.parse_args()
    world = torch.cuda.device_count()
    if world < 2:
        raise SystemExit(f"needs at least 2 GPUs, found {world}")
    world = 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    command = "python benchmarks/bench_collectives.py " + " ".join(sys.argv[1:])
    mp.spawn(_worker, args=(world, args.out, command), nprocs=world, join=True)


if __name__ == "__main__":
    main()
