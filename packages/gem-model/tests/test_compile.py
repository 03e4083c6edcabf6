"""The model's regions under ``torch.compile``: no graph break, the eager numbers, and the
host copy of the offsets (``sequence_offsets``) in place of the device one."""

import pytest
import torch
from gem_model import GemInputs, GemModel
from gem_model_inputs import V1, make_config, make_inputs
from torch._dynamo.utils import counters

LENGTHS = [0, 1, 70, 5, 33]


def _grads(model):
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _step(model, inputs, offsets=None):
    model.zero_grad()
    logits = model(GemInputs(*inputs, sequence_offsets=offsets))
    logits.square().sum().backward()
    return logits.detach(), _grads(model)


def _offsets(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])


def test_host_offsets_give_the_same_step():
    """The host copy replaces the device offsets: same logits and gradients, bit for bit."""
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = GemModel(make_config(**V1, target_attention=True))
    inputs = make_inputs(LENGTHS, generator)
    logits, grads = _step(model, inputs)
    for offsets in (_offsets(LENGTHS), _offsets(LENGTHS).tolist()):
        host_logits, host_grads = _step(model, inputs, offsets)
        torch.testing.assert_close(host_logits, logits, rtol=0, atol=0)
        assert host_grads.keys() == grads.keys()
        for name in grads:
            torch.testing.assert_close(host_grads[name], grads[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize(
    ("offsets", "message"),
    [
        (torch.tensor([0, 1, 71]), "sequence_offsets must be the \\(6,\\) history offsets"),
        (_offsets([0, 1, 70, 5, 33]).float(), "int32 or int64"),
        (
            _offsets([0, 1, 70, 6, 33]),
            "sequence_offsets\\[-1\\] must equal the number of rows \\(109\\)",
        ),
        (torch.tensor([0, 0, 1, 71, 70, 109]), "sequence_offsets must be non-decreasing"),
    ],
)
def test_bad_host_offsets_are_rejected(offsets, message):
    generator = torch.Generator().manual_seed(0)
    model = GemModel(make_config(**V1))
    with pytest.raises((ValueError, TypeError), match=message):
        model(GemInputs(*make_inputs(LENGTHS, generator), sequence_offsets=offsets))


def test_regions_hold_every_parameter_once():
    model = GemModel(make_config(**V1, target_attention=True))
    owner = {}
    for region, modules in model.regions().items():
        for module in modules:
            for parameter in module.parameters():
                assert id(parameter) not in owner, f"{region} shares a parameter"
                owner[id(parameter)] = region
    glue = {"interaction_norm.weight", "interaction_norm.bias"}
    loose = {name for name, p in model.named_parameters() if id(p) not in owner}
    assert loose == glue
    assert set(model.regions()) == {"embeddings", "sequence", "cross", "pma", "dhen", "heads"}
    no_sequence = GemModel(make_config(**V1, use_sequence_tower=False)).regions()
    assert no_sequence["sequence"] == no_sequence["cross"] == no_sequence["pma"] == []


@pytest.mark.parametrize("architecture", ["v1", "v1-rel-pos", "block"])
def test_compiled_regions_match_eager_without_graph_breaks(architecture):
    changes = {
        "v1": {**V1, "target_attention": True},
        "v1-rel-pos": {**V1, "position": "rel_pos_bias", "num_sequence_layers": 2},
        "block": {"self_attention": "block", "position": "rope"},
    }[architecture]
    torch.manual_seed(1)
    model = GemModel(make_config(**changes))
    batches = [LENGTHS, [2, 6, 0, 1, 3, 9]]  # other lengths and batch size: recompiles once
    eager = []
    for lengths in batches:
        inputs = make_inputs(lengths, torch.Generator().manual_seed(len(lengths)))
        eager.append(_step(model, inputs, _offsets(lengths)))
    for region, modules in model.regions().items():
        if region != "embeddings":
            for module in modules:
                module.compile(backend="aot_eager", fullgraph=True)
    counters.clear()
    for lengths, (logits, grads) in zip(batches, eager, strict=True):
        inputs = make_inputs(lengths, torch.Generator().manual_seed(len(lengths)))
        got_logits, got_grads = _step(model, inputs, _offsets(lengths))
        torch.testing.assert_close(got_logits, logits, rtol=1e-5, atol=1e-6)
        for name in grads:
            torch.testing.assert_close(got_grads[name], grads[name], rtol=1e-4, atol=1e-6)
    # fullgraph=True raises on a break; the counter also catches a break dynamo skipped over.
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])


def test_a_new_token_count_compiles_nothing_new():
    """The token count changes every batch: the regions compile for any count at the first."""
    torch.manual_seed(1)
    model = GemModel(make_config(**V1, target_attention=True))
    for region, modules in model.regions().items():
        if region != "embeddings":
            for module in modules:
                module.compile(backend="aot_eager", fullgraph=True)
    torch._dynamo.reset()
    counters.clear()
    graphs = []
    for lengths in ([0, 1, 70, 5, 33], [9, 70, 2, 0, 41], [3, 3, 3, 3, 3]):  # same batch size
        inputs = make_inputs(lengths, torch.Generator().manual_seed(len(graphs)))
        _step(model, inputs, _offsets(lengths))
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] > 0 and graphs[1:] == [graphs[0]] * 2, graphs
