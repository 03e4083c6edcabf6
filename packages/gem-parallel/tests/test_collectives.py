"""Collective selection and the plain / copy-engine collectives on real gloo processes.

On CPU the copy engine is never available, so selection must fall back to gloo and log why;
the chosen functions must agree with ``torch.distributed``'s own collectives and with a
computation every rank can do alone (each rank's input is a function of its rank).
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
from gem_parallel import (
    COLLECTIVE_CHOICES,
    copy_engine_all_gather,
    copy_engine_reduce_scatter,
    copy_engine_status,
    plain_all_gather,
    plain_reduce_scatter,
    run_in_processes,
    select_all_gather,
    select_reduce_scatter,
)

ROWS, COLS = 3, 5


def rank_input(rank: int, rows: int = ROWS) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 + rank)
    return torch.randn(rows, COLS, generator=generator, dtype=torch.float64)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _selection_worker(rank: int) -> None:
    world = dist.get_world_size()
    records = _Records()
    logger = logging.getLogger("gem_parallel")
    logger.addHandler(records)
    logger.setLevel(logging.INFO)

    ok, why = copy_engine_status()
    assert not ok and "gloo" in why and "not NCCL" in why, why

    # auto: falls back to gloo, logged at INFO with the reason.
    gather, reason = select_all_gather()
    assert gather is plain_all_gather
    assert reason.startswith("gloo: copy engine unavailable"), reason
    logged = [r for r in records.records if "all-gather" in r.getMessage()]
    assert logged and logged[-1].levelno == logging.INFO and reason in logged[-1].getMessage()

    # Asking for the copy engine also falls back, but warns.
    gather_ce, reason_ce = select_all_gather(prefer="copy_engine")
    assert gather_ce is plain_all_gather and reason_ce.startswith("gloo"), reason_ce
    assert records.records[-1].levelno == logging.WARNING
    _, reason_nccl = select_all_gather(prefer="nccl")
    assert reason_nccl.startswith("gloo: requested"), reason_nccl

    # The chosen all-gather equals torch's and the independent concatenation.
    inp = rank_input(rank)
    out = torch.empty(world * ROWS, COLS, dtype=torch.float64)
    assert gather(out, inp, None) is out
    reference = torch.empty_like(out)
    dist.all_gather_into_tensor(reference, inp)
    assert torch.equal(out, reference)
    assert torch.equal(out, torch.cat([rank_input(r) for r in range(world)]))

    # Over a subgroup of ranks {1, 3} (new_group is collective: every rank calls it).
    odd = dist.new_group([1, 3])
    if rank in (1, 3):
        sub_gather, sub_reason = select_all_gather(odd)
        assert sub_reason.startswith("gloo")
        sub_out = torch.empty(2 * ROWS, COLS, dtype=torch.float64)
        sub_gather(sub_out, inp, odd)
        assert torch.equal(sub_out, torch.cat([rank_input(1), rank_input(3)]))

    # Reduce-scatter: rank r gets rows [r*ROWS, (r+1)*ROWS) of the sum of every rank's input.
    scatter, scatter_reason = select_reduce_scatter()
    assert scatter is plain_reduce_scatter and scatter_reason.startswith("gloo")
    big = rank_input(rank, world * ROWS)
    mine = torch.empty(ROWS, COLS, dtype=torch.float64)
    scatter(mine, big, None)
    total = sum(rank_input(r, world * ROWS) for r in range(world))
    torch.testing.assert_close(mine, total[rank * ROWS : (rank + 1) * ROWS], rtol=1e-12, atol=0)

    # Shape errors name the arguments.
    with pytest.raises(ValueError, match=r"out.shape must be"):
        plain_all_gather(torch.empty(ROWS, COLS, dtype=torch.float64), inp)
    with pytest.raises(ValueError, match=r"inp.shape must be"):
        plain_reduce_scatter(mine, inp)
    logger.removeHandler(records)


def test_selection_falls_back_to_gloo_and_matches_torch(tmp_path):
    run_in_processes(_selection_worker, 4, store_dir=tmp_path)


def test_copy_engine_collectives_reject_cpu_tensors():
    inp = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="out must be a CUDA tensor"):
        copy_engine_all_gather(torch.zeros(4, 3), inp)
    with pytest.raises(ValueError, match="out must be a CUDA tensor"):
        copy_engine_reduce_scatter(torch.zeros(1, 3), inp)
    with pytest.raises(TypeError, match="out must be a torch.Tensor"):
        copy_engine_all_gather(None, inp)


def test_select_rejects_unknown_preference():
    assert COLLECTIVE_CHOICES == ("auto", "copy_engine", "nccl")
    with pytest.raises(ValueError, match="prefer must be one of"):
        select_all_gather(prefer="nvshmem")
