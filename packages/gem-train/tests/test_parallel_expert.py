"""ExpertParallelDHENLayer on 2 gloo ranks against the unsplit DHENLayer, with and without the
uniform-training-batch shortcut (no per-call batch-size exchange)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from gem_model.dhen import DHENLayer
from gem_parallel import run_in_processes
from gem_train.parallel import ExpertParallelDHENLayer

TOKENS, DIM, ROWS = 3, 8, 4


def make_layer() -> DHENLayer:
    torch.manual_seed(7)
    layer = DHENLayer(TOKENS, DIM, 2, ("attention", "mlp", "cross"), 16, 0.0).double()
    # DHEN zero-initialises every expert's output layer; random weights make the test see them.
    for parameter in layer.parameters():
        torch.nn.init.normal_(parameter, std=0.3)
    return layer


def _worker(rank: int) -> None:
    world = dist.get_world_size()
    inputs = torch.randn(world * ROWS, TOKENS, DIM, generator=torch.Generator().manual_seed(3))
    inputs = inputs.double()
    reference = make_layer()
    ref_x = inputs.clone().requires_grad_(True)
    ref_out = reference(ref_x)
    ref_out.square().sum().backward()
    rows = slice(rank * ROWS, (rank + 1) * ROWS)

    layer = ExpertParallelDHENLayer(make_layer(), dist.group.WORLD, uniform_train_batch=True)
    exchanges = {"calls": 0}
    original = layer.parallel._batch_sizes

    def counting(*args):
        exchanges["calls"] += 1
        return original(*args)

    layer.parallel._batch_sizes = counting

    layer.train()
    x = inputs[rows].clone().requires_grad_(True)
    out = layer(x)
    out.square().sum().backward()
    assert exchanges["calls"] == 0, "a training call with uniform_train_batch exchanged sizes"
    torch.testing.assert_close(out, ref_out[rows].detach())
    torch.testing.assert_close(x.grad, ref_x.grad[rows])
    # Each expert saw both ranks' rows: its gradient is the global one (before averaging).
    for index, expert in zip(layer.parallel.expert_indices, layer.experts, strict=True):
        for p, ref_p in zip(
            expert.parameters(), reference.experts[index].parameters(), strict=True
        ):
            torch.testing.assert_close(p.grad, ref_p.grad)

    layer.eval()  # evaluation batches may differ between ranks: sizes are exchanged
    with torch.no_grad():
        torch.testing.assert_close(layer(inputs[rows]), ref_out[rows].detach())
    assert exchanges["calls"] == 1

    layer.train()
    layer.uniform_train_batch = False
    with torch.no_grad():
        layer(inputs[rows])
    assert exchanges["calls"] == 2


def test_expert_parallel_dhen_layer_matches_unsplit_layer(tmp_path):
    run_in_processes(_worker, 2, store_dir=tmp_path)


def test_uniform_train_batch_must_be_bool():
    with pytest.raises(TypeError, match="uniform_train_batch must be a bool"):
        ExpertParallelDHENLayer(make_layer(), None, uniform_train_batch="yes")
