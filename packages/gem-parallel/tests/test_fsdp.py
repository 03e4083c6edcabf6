"""apply_fsdp (FSDP2 HSDP over GemMesh.dense) on real gloo processes vs one process."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
from gem_parallel import (
    FsdpAllGather,
    ParallelLayout,
    apply_fsdp,
    build_gem_mesh,
    default_fsdp_blocks,
    plain_all_gather,
    run_in_processes,
    set_fsdp_all_gather,
)
from torch import nn

IN, HIDDEN, OUT = 6, 8, 3


class Dense(nn.Module):
    """Blocks in a ModuleList plus a root-owned head, like a dense interaction stack."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            [nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh())]
            + [nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh()) for _ in range(2)]
        )
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, HIDDEN))
        self.head = nn.Linear(HIDDEN, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x * self.scale)


def make_model() -> Dense:
    torch.manual_seed(0)
    return Dense().double()


def make_batch(world: int, per_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(world * per_rank, IN, generator=generator, dtype=torch.float64)
    targets = torch.randn(world * per_rank, OUT, generator=generator, dtype=torch.float64)
    return inputs, targets


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()  # mean over this rank's shard


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    if not torch.allclose(actual, expected, rtol=1e-9, atol=1e-12):
        diff = (actual - expected).abs().max().item()
        raise AssertionError(f"{what}: max abs difference {diff:.3g}")


def _fsdp_worker(rank: int, replicate: int, shard: int, per_rank: int, lr: float) -> None:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor, Replicate, Shard

    world = dist.get_world_size()
    inputs, targets = make_batch(world, per_rank)

    # Reference: one process, global batch, mean loss over all samples, one SGD step.
    reference = make_model()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=lr)
    ref_loss = loss_fn(reference(inputs), targets)
    ref_loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in reference.named_parameters()}
    ref_opt.step()
    ref_loss_after = loss_fn(reference(inputs), targets)

    mesh = build_gem_mesh(ParallelLayout(replicate=replicate, shard=shard))
    ref_params = dict(reference.named_parameters())
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    messages: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = logging.getLogger("gem_parallel")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    # "auto" on gloo falls back (logged) and then a stream-ordered custom all-gather (fn that
    # returns no Work, as the copy engine does) replaces it; "nccl" keeps FSDP's default.
    for reshard, prefetch, all_gather in ((True, True, "auto"), (False, False, "nccl")):
        model = make_model()
        blocks = default_fsdp_blocks(model)
        assert [id(b) for b in blocks] == [id(b) for b in [*model.blocks, model.head]]
        messages.clear()
        apply_fsdp(
            model, mesh, reshard_after_forward=reshard, prefetch=prefetch, all_gather=all_gather
        )
        comm = None
        if all_gather == "auto":
            assert any("uses gloo: copy engine unavailable" in m for m in messages), messages
            comm = FsdpAllGather(plain_all_gather, group=mesh.dense.get_group("shard"))
            installed = set_fsdp_all_gather(model, comm)
            assert installed == hasattr(model, "set_custom_all_gather")
        else:
            assert not any("all-gather" in m for m in messages), messages
        assert isinstance(model, FSDPModule) and all(isinstance(b, FSDPModule) for b in blocks)
        for param in model.parameters():
            assert isinstance(param, DTensor)
            assert param.placements == (Replicate(), Shard(0)), param.placements
        opt = torch.optim.SGD(model.parameters(), lr=lr)

        for step in range(2):
            local = loss_fn(model(inputs[rows]), targets[rows])
            mean_loss = local.detach().clone()
            dist.all_reduce(mean_loss)
            mean_loss /= world
            expected = ref_loss if step == 0 else ref_loss_after
            assert_close(mean_loss, expected.detach(), f"loss at step {step}")
            if step == 0:
                local.backward()
                for name, param in model.named_parameters():
                    assert_close(param.grad.full_tensor(), ref_grads[name], f"grad of {name}")
                opt.step()
                opt.zero_grad()

        # Parameters after the step match the reference's (without resharding after forward
        # the last forward left them unsharded: reshard to read the sharded DTensors).
        for unit in model.modules():
            if isinstance(unit, FSDPModule):
                unit.reshard()
        for name, param in model.named_parameters():
            assert_close(param.full_tensor().detach(), ref_params[name].detach(), f"param {name}")
        if comm is not None and installed:
            # 4 units; forward twice and one backward re-gather per resharded unit.
            assert comm.calls >= 8, comm.calls
    logger.removeHandler(handler)

    try:
        apply_fsdp(make_model(), mesh.expert)
    except ValueError as err:
        assert "('replicate', 'shard')" in str(err)
    else:
        raise AssertionError("apply_fsdp accepted a 1-D mesh")


def test_hsdp_matches_single_process(tmp_path):
    run_in_processes(_fsdp_worker, 4, 2, 2, 3, 0.1, store_dir=tmp_path)


def test_apply_fsdp_rejects_bad_arguments():
    with pytest.raises(TypeError, match="module must be an nn.Module"):
        apply_fsdp(object(), None)
    with pytest.raises(TypeError, match="gem_mesh must be a GemMesh or DeviceMesh"):
        apply_fsdp(make_model(), None)
    with pytest.raises(TypeError, match="comm must be an FsdpAllGather"):
        set_fsdp_all_gather(make_model(), object())
    with pytest.raises(ValueError, match="module holds no FSDP unit"):
        set_fsdp_all_gather(make_model(), FsdpAllGather())


def test_default_blocks_expand_module_lists():
    model = make_model()
    assert default_fsdp_blocks(model) == [*model.blocks, model.head]
    assert default_fsdp_blocks(nn.Linear(2, 2)) == []
