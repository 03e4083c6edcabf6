"""Per-region activation checkpointing: the measured choice and unchanged training."""

import dataclasses

import pytest
import torch
from gem_model import GemArchitecture
from gem_train import Trainer
from gem_train.checkpointing import RegionCost, checkpoint_module, choose_regions, measure_regions
from gem_train.cli import prepare_data

GIB = 2**30


def test_choice_takes_the_cheapest_recompute_per_byte_until_the_rest_fits():
    costs = [
        RegionCost("sequence_layers.0", forward_seconds=0.010, freed_bytes=4 * GIB),  # 2.5 ms/GiB
        RegionCost("pma", forward_seconds=0.004, freed_bytes=1 * GIB),  # 4 ms/GiB
        RegionCost("interaction.0", forward_seconds=0.003, freed_bytes=GIB // 2),  # 6 ms/GiB
        RegionCost("heads.ctr", forward_seconds=0.001, freed_bytes=0),
    ]
    assert choose_regions(costs, budget_bytes=6 * GIB) == []
    assert choose_regions(costs, budget_bytes=4 * GIB) == ["sequence_layers.0"]
    assert choose_regions(costs, budget_bytes=GIB // 4) == [
        "sequence_layers.0", "pma", "interaction.0"]  # fmt: skip
    assert choose_regions(costs, budget_bytes=0) == ["sequence_layers.0", "pma", "interaction.0"]


def test_measuring_keeps_no_region_activations_alive():
    """measure_regions runs at a batch whose activations do not all fit: while a region runs,
    what the earlier ones saved for backward is already freed. Its bytes are still counted."""
    import weakref

    from torch import nn

    class Region(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(64))
            self.saved: list[weakref.ref] = []

        def forward(self, x):
            hidden = x.exp()  # saved by the multiplication below
            self.saved.append(weakref.ref(hidden))
            return hidden * self.weight

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.second = Region(), Region()
            self.alive_during_second: bool | None = None

        def forward(self, x):
            y = self.first(x)
            self.alive_during_second = self.first.saved[-1]() is not None
            return self.second(y)

    model = Model()
    x = torch.randn(8, 64)
    model(x).sum()  # plain autograd keeps the first region's activation
    assert model.alive_during_second
    costs = measure_regions(model, {"first": model.first, "second": model.second},
                            lambda: model(x))  # fmt: skip
    assert model.alive_during_second is False
    assert [c.freed_bytes for c in costs] == [8 * 64 * 4] * 2


def test_a_checkpointed_module_compiles_into_one_graph():
    """``module.compile()`` of a checkpointed module captures its forward (the recompute runs
    in the compiled backward): no eager op of the region runs, and the gradients are those
    of the module without checkpointing."""
    from torch import nn
    from torch._dynamo.utils import counters

    class Region(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear, self.norm = nn.Linear(16, 16), nn.LayerNorm(16)

        def forward(self, x, *, scale):
            return nn.functional.silu(self.norm(self.linear(x))) * scale

    torch.manual_seed(0)
    plain, checkpointed = Region(), Region()
    checkpointed.load_state_dict(plain.state_dict())
    checkpoint_module(checkpointed)
    x = torch.randn(8, 16, requires_grad=True)
    plain(x, scale=2.0).square().sum().backward()
    want = [x.grad.clone(), *(p.grad.clone() for p in plain.parameters())]
    torch.compiler.reset()
    counters.clear()
    checkpointed.compile()
    checkpointed(x, scale=2.0).square().sum().backward()  # compiles
    checkpointed.zero_grad()
    x.grad = None
    with torch.profiler.profile() as profile:
        checkpointed(x, scale=2.0).square().sum().backward()
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"]
    eager = {e.key for e in profile.key_averages()} & {
        "aten::silu", "aten::silu_backward", "aten::native_layer_norm"}  # fmt: skip
    assert not eager, f"the checkpointed region ran eagerly: {eager}"
    got = [x.grad, *(p.grad for p in checkpointed.parameters())]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


@pytest.fixture
def config(small_config):
    return dataclasses.replace(
        small_config,
        max_steps=3,
        model=GemArchitecture(embedding_dim=16, num_heads=2, dhen_layers=2, expert_hidden_dim=32,
                              history_cross=True, attention_window=4, position="rope",
                              num_sequence_layers=2),
    )  # fmt: skip


def test_checkpointed_regions_train_exactly_as_without(config, tmp_path):
    train, _ = prepare_data(config.data, progress=False)
    reference = Trainer(config, train, output_dir=tmp_path / "none").fit(progress=False)
    full = Trainer(
        dataclasses.replace(config, activation_checkpointing="full"), train,
        output_dir=tmp_path / "full",
    )  # fmt: skip
    assert full.fit(progress=False) == reference
    assert set(full.checkpointed) >= {"sequence_layers.0", "sequence_layers.1", "pma"}
    # Checkpointed, a module keeps nothing of its own for backward.
    batch = next(iter(full.loader))
    kept = measure_regions(full.model, full._dense_region_modules(), lambda: full._forward(batch))
    assert kept and all(cost.freed_bytes == 0 for cost in kept)

    measured = Trainer(config, train, output_dir=tmp_path / "m")
    auto = Trainer(
        dataclasses.replace(config, activation_checkpointing="auto", activation_budget_gib=1e-9),
        train, output_dir=tmp_path / "auto",
    )  # fmt: skip
    assert auto.fit(progress=False) == reference  # measuring moved no weight
    costs = {cost.name: cost for cost in auto.region_costs}
    assert set(costs) == set(measured._dense_region_modules())
    assert all(cost.forward_seconds > 0 for cost in costs.values())
    # A self-attention layer keeps its whole history at every projection; a head, (B, d).
    assert costs["sequence_layers.0"].freed_bytes > 10 * costs["heads.ctr"].freed_bytes > 0
    # A budget of ~0 checkpoints every module that frees anything.
    assert set(auto.checkpointed) == {n for n, c in costs.items() if c.freed_bytes > 0}


def test_bad_checkpointing_options_are_rejected(config):
    with pytest.raises(ValueError, match="activation_checkpointing must be one of"):
        dataclasses.replace(config, activation_checkpointing="some")
    with pytest.raises(ValueError, match="activation_budget_gib > 0"):
        dataclasses.replace(config, activation_checkpointing="auto")
