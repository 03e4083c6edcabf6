"""ExpertParallel on real gloo process groups against a single-process reference."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from gem_parallel import (
    ExpertParallel,
    ParallelLayout,
    all_gather_dim0,
    build_gem_mesh,
    collectives,
    expert_assignment,
    run_in_processes,
)
from torch import nn

TOKENS, DIM = 3, 4


class TokenMLP(nn.Module):
    """Per-token MLP expert."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(DIM, hidden), nn.GELU(), nn.Linear(hidden, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class LowRankCross(nn.Module):
    """x * U(V x) over all tokens flattened (like DHEN's cross expert)."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.down = nn.Linear(TOKENS * DIM, rank, bias=False)
        self.up = nn.Linear(rank, TOKENS * DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.flatten(1)
        return (flat * self.up(self.down(flat))).view_as(x)


def make_expert(index: int) -> nn.Module:
    torch.manual_seed(100 + index)
    module = TokenMLP(5 + index) if index % 2 == 0 else LowRankCross(2 + index)
    return module.double()


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    # torch.testing.assert_close costs ~4 s of imports in every fresh process.
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    if not torch.allclose(actual, expected, rtol=1e-10, atol=1e-12):
        raise AssertionError(f"max abs difference {(actual - expected).abs().max().item():.3g}")


def global_batch(sizes: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    total = sum(sizes)
    inputs = torch.randn(total, TOKENS, DIM, generator=generator, dtype=torch.float64)
    targets = torch.randn(total, TOKENS, DIM, generator=generator, dtype=torch.float64)
    return inputs, targets


def _check_uniform_batch(layer: ExpertParallel, x: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal per-rank batches: ``uniform_batch`` gives the same output and gradients without
    exchanging sizes (the exchange is made to fail if it is ever called)."""

    def no_exchange(*_args):
        raise AssertionError("uniform_batch must not exchange batch sizes")

    exchanged = {"calls": 0}
    original = layer._batch_sizes

    def counting(*args):
        exchanged["calls"] += 1
        return original(*args)

    layer._batch_sizes = counting
    assert_close(layer(x), expected)
    assert exchanged["calls"] == 1  # the default still exchanges

    layer._batch_sizes = no_exchange
    for uniform in ("call", "constructor"):
        for p in layer.experts.parameters():
            p.grad = None
        leaf = x.clone().requires_grad_(True)
        if uniform == "call":
            out = layer(leaf, uniform_batch=True)
        else:
            layer.uniform_batch = True
            out = layer(leaf)
            layer.uniform_batch = False
        assert_close(out, expected)
        out.square().sum().backward()
        grads = [p.grad.clone() for p in layer.experts.parameters()]
        # The same backward through the exchanging path: identical gradients.
        layer._batch_sizes = original
        for p in layer.experts.parameters():
            p.grad = None
        ref_leaf = x.clone().requires_grad_(True)
        layer(ref_leaf).square().sum().backward()
        assert_close(leaf.grad, ref_leaf.grad)
        for grad, p in zip(grads, layer.experts.parameters(), strict=True):
            assert_close(grad, p.grad)
        layer._batch_sizes = no_exchange
    layer._batch_sizes = original


def _ep_worker(rank: int, cases, force_all_reduce_fallback: bool) -> None:
    if force_all_reduce_fallback:  # exercise the path used when gloo lacks reduce-scatter
        collectives._NATIVE_REDUCE_SCATTER_UNSUPPORTED.add("gloo")
    world = dist.get_world_size()
    for case_index, (expert_size, sizes, num_experts, use_factory) in enumerate(cases):
        mesh = build_gem_mesh(ParallelLayout(shard=world, expert=expert_size))
        group_rank = dist.get_rank(mesh.expert_group)
        inputs, targets = global_batch(sizes, seed=case_index)

        # Single-process reference on the global batch; loss = sum over ranks of each rank's
        # loss (out_r * target_r).sum(), i.e. (out * target).sum() over the global batch.
        reference = [make_expert(i) for i in range(num_experts)]
        ref_x = inputs.clone().requires_grad_(True)
        ref_out = sum(expert(ref_x) for expert in reference)
        (ref_out * targets).sum().backward()

        experts = make_expert if use_factory else [make_expert(i) for i in range(num_experts)]
        layer = ExpertParallel(
            experts,
            mesh.expert_group,
            num_experts=num_experts if use_factory else None,
            replica_group=mesh.expert_replica_group,
        )
        owned = expert_assignment(num_experts, expert_size)[group_rank]
        assert layer.expert_indices == owned and len(layer.experts) == len(owned)

        start = sum(sizes[:rank])
        rows = slice(start, start + sizes[rank])
        x = inputs[rows].clone().requires_grad_(True)
        out = layer(x)
        (out * targets[rows]).sum().backward()

        assert_close(out, ref_out[rows].detach())
        assert_close(x.grad, ref_x.grad[rows])

        # Expert grads: after summing over expert replicas they are the global-batch grads;
        # average=True divides by the data-parallel world size on top.
        sums = {p: p.grad.clone() for p in layer.experts.parameters()}
        layer.reduce_grads(average=False)
        for local, index in zip(layer.experts, owned, strict=True):
            for p, ref_p in zip(local.parameters(), reference[index].parameters(), strict=True):
                assert_close(p.grad, ref_p.grad)
        for p, before in sums.items():
            p.grad = before
        layer.reduce_grads(average=True)
        for local, index in zip(layer.experts, owned, strict=True):
            for p, ref_p in zip(local.parameters(), reference[index].parameters(), strict=True):
                assert_close(p.grad, ref_p.grad / world)

        if len(set(sizes)) == 1:
            _check_uniform_batch(layer, inputs[rows], ref_out[rows].detach())

    # Bad construction fails on every rank before any collective.
    try:
        ExpertParallel([make_expert(0)], dist.group.WORLD)
    except ValueError as err:
        assert "num_experts (1) must be at least the expert group size" in str(err)
    else:
        raise AssertionError("ExpertParallel accepted fewer experts than ranks")


# (expert group size, per-rank batch sizes, number of experts, build with a factory)
EP_CASES = {
    4: [
        (2, [3, 3, 3, 3], 3, False),
        (4, [2, 2, 2, 2], 5, True),
        (2, [3, 1, 0, 2], 4, False),  # uneven shards, one rank with no rows
        (4, [1, 4, 2, 3], 4, True),
    ],
    2: [(2, [2, 2], 2, False), (2, [4, 1], 3, True)],
}


@pytest.mark.parametrize("world_size", sorted(EP_CASES))
def test_expert_parallel_matches_single_process(world_size, tmp_path):
    # World 2 runs reduce-scatter as all-reduce + slice, world 4 natively.
    fallback = world_size == 2
    run_in_processes(_ep_worker, world_size, EP_CASES[world_size], fallback, store_dir=tmp_path)


def test_expert_assignment_is_contiguous_and_complete():
    for num_experts in range(1, 12):
        for group_size in range(1, num_experts + 1):
            blocks = expert_assignment(num_experts, group_size)
            assert [i for block in blocks for i in block] == list(range(num_experts))
            lengths = [len(block) for block in blocks]
            assert min(lengths) >= 1 and max(lengths) - min(lengths) <= 1
    with pytest.raises(ValueError, match="num_experts"):
        expert_assignment(2, 3)
    with pytest.raises(ValueError, match="group_size must be a positive int"):
        expert_assignment(2, 0)


def test_collectives_reject_bad_shapes():
    with pytest.raises(ValueError, match="at least one dimension"):
        all_gather_dim0(torch.tensor(1.0))


def test_expert_parallel_needs_process_group():
    with pytest.raises(RuntimeError, match="init_process_group"):
        ExpertParallel([make_expert(0)])


def test_expert_parallel_rejects_non_bool_uniform_batch():
    with pytest.raises(TypeError, match="uniform_batch must be a bool"):
        ExpertParallel([make_expert(0)], uniform_batch=1)
