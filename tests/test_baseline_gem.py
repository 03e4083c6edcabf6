"""benchmarks/baseline_gem.py (the plain-PyTorch baseline of the training benchmark) computes
GemModel's function: GemModel's state dict loads strictly, the logits and every parameter's
gradient match in float32 on the CPU, and its FlexAttention block mask is exactly the one
``create_block_mask`` derives from the same ``mask_mod``.

FlexAttention refuses backward on the CPU in its Python entry point (``_validate_device``):
its compiled CPU kernel has no backward. The eager path it would otherwise take (the dense
math reference, which ``torch.compile`` also runs under ``aot_eager``) differentiates fine,
so the tests lift that check; on CUDA nothing is patched. The eager path evaluates
``mask_mod`` on every (q, kv) pair and ignores the block tables, which is why the tables get
a test of their own.
"""

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.attention.flex_attention as flex
from torch._dynamo.utils import counters

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "packages" / "gem-model" / "tests"))

from baseline_gem import BLOCK_SIZE, BaselineGem, make_block_mask, padded_length  # noqa: E402
from gem_model import GemInputs, GemModel  # noqa: E402
from gem_model_inputs import V1, make_config, make_inputs  # noqa: E402

# Odd lengths: empty, a single event, one at the cap (70), more than one 128-row block in all.
LENGTHS = [0, 1, 70, 5, 33, 2, 67, 0, 41]

ARCHITECTURES = {
    # window 4, RoPE, SwiGLU, history x feature cross, target attention, all DHEN experts
    "v1": V1,
    "rel-pos-window": {**V1, "position": "rel_pos_bias"},
    "rel-pos-full-causal": {**V1, "position": "rel_pos_bias", "attention_window": 0},
    "rope-full-causal-gelu-2-layers": {
        **V1,
        "attention_window": 0,
        "ffn": "gelu",
        "num_sequence_layers": 2,
        "sequence_activation": "gelu_fast",
    },
    "block": {
        **V1,
        "self_attention": "block",
        "attention_window": 0,
        "sequence_activation": "relu2",
    },
    "v0-no-position-no-cross": {"position": "none", "history_cross": False},
    "no-sequence-tower": {"use_sequence_tower": False},
}


@pytest.fixture(autouse=True)
def _flex_backward_on_cpu(monkeypatch):
    monkeypatch.setattr(flex, "_validate_device", lambda *tensors: None)


def _models(architecture, **changes):
    torch.manual_seed(0)
    config = make_config(**ARCHITECTURES[architecture], **changes)
    gem = GemModel(config)
    with torch.no_grad():  # off the init (zero DHEN outputs, zero rel_pos_bias): every path live
        for parameter in gem.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    baseline = BaselineGem(config)
    baseline.load_state_dict(gem.state_dict(), strict=True)
    return gem, baseline


def _step(model, inputs, weights, *, call=None, **kwargs):
    """Logits and gradients of one step of ``model`` (run through ``call``, if given)."""
    model.zero_grad()
    # GemModel reads one inputs object; the baseline takes the features as a user writes them.
    args = (GemInputs(*inputs),) if isinstance(model, GemModel) else inputs
    logits = (model if call is None else call)(*args, **kwargs)
    (logits * weights).square().sum().backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


def _assert_same_step(expected, got):
    (logits, grads), (base_logits, base_grads) = expected, got
    torch.testing.assert_close(base_logits, logits, rtol=1e-5, atol=1e-6)
    assert base_grads.keys() == grads.keys()
    for name, grad in grads.items():
        scale = float(grad.abs().max())
        torch.testing.assert_close(
            base_grads[name], grad, rtol=1e-4, atol=1e-5 * scale + 1e-9, msg=name
        )


@pytest.mark.parametrize("architecture", list(ARCHITECTURES))
def test_state_dict_logits_and_every_gradient_match_gem_model(architecture):
    gem, baseline = _models(architecture)
    assert [(n, p.shape) for n, p in baseline.named_parameters()] == [
        (n, p.shape) for n, p in gem.named_parameters()
    ]
    inputs = make_inputs(LENGTHS, torch.Generator().manual_seed(1))
    weights = torch.randn(len(LENGTHS), 2, generator=torch.Generator().manual_seed(2))
    expected = _step(gem, inputs, weights)
    assert len(expected[1]) == len(list(gem.parameters()))  # every parameter has a gradient
    _assert_same_step(expected, _step(baseline, inputs, weights))


def test_under_autocast_the_sequence_tokens_are_bf16_as_in_gem_model(monkeypatch):
    """The residual-stream dtype is part of the model: both carry bf16 tokens into PMA. CUDA's
    autocast runs LayerNorm in float32; the CPU's does not, so every LayerNorm here returns
    float32 as on CUDA (inside gem's final norm, which casts its own output)."""
    layer_norm = torch.nn.functional.layer_norm
    monkeypatch.setattr(
        torch.nn.functional,
        "layer_norm",
        lambda *args, **kwargs: layer_norm(*args, **kwargs).float(),
    )
    inputs = make_inputs(LENGTHS, torch.Generator().manual_seed(1))
    weights = torch.ones(len(LENGTHS), 2)
    for model in _models("v1"):
        seen = []
        model.pma.register_forward_hook(
            lambda module, args, out, seen=seen: seen.append(args[0].dtype)
        )
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _step(model, inputs, weights)
        assert seen == [torch.bfloat16], type(model).__name__


def test_a_prebuilt_block_mask_and_a_longer_pad_change_nothing():
    gem, baseline = _models("rel-pos-window")
    inputs = make_inputs(LENGTHS, torch.Generator().manual_seed(3))
    weights = torch.ones(len(LENGTHS), 2)
    offsets = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    mask = make_block_mask(offsets, padded_length(sum(LENGTHS)), 4, kind="jagged_flash")
    got = _step(baseline, inputs, weights, block_mask=mask, max_len=101)
    _assert_same_step(_step(gem, inputs, weights), got)


def _dense(num_blocks, indices, size):
    """The (q block, kv block) set of one table, checked ascending and without repeats."""
    out = torch.zeros(size, size, dtype=torch.bool)
    if num_blocks is None:
        return out
    for row in range(size):
        used = indices[0, 0, row, : num_blocks[0, 0, row]].long()
        assert bool((used[1:] > used[:-1]).all())
        out[row, used] = True
    return out


_TABLES = [
    ("kv_num_blocks", "kv_indices"),
    ("full_kv_num_blocks", "full_kv_indices"),
    ("q_num_blocks", "q_indices"),
    ("full_q_num_blocks", "full_q_indices"),
]


@pytest.mark.parametrize(
    ("kind", "window"),
    # windows around the 128-row tile: off-by-ones in the full / partial split show there
    [("jagged_flash", w) for w in (0, 1, 5, 126, 127, 128, 129, 254, 255, 256, 300)]
    + [("block", 0)],
)
def test_block_mask_tables_equal_create_block_mask(kind, window):
    generator = torch.Generator().manual_seed(4)
    layouts = [[0], [1], [127], [128, 0, 129], [300, 1, 0, 250, 7], [700], [3, 650, 1]]
    layouts += [torch.randint(0, 400, (9,), generator=generator).tolist() for _ in range(3)]
    for lengths in layouts:
        offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
        rows = padded_length(sum(lengths))
        assert rows % BLOCK_SIZE == 0 and rows > sum(lengths)
        mask = make_block_mask(offsets, rows, window, kind=kind)
        reference = flex.create_block_mask(mask.mask_mod, None, None, rows, rows, device="cpu")
        for num, indices in _TABLES:
            got = _dense(getattr(mask, num), getattr(mask, indices), rows // BLOCK_SIZE)
            want = _dense(getattr(reference, num), getattr(reference, indices), rows // BLOCK_SIZE)
            assert torch.equal(got, want), (lengths, num)


@pytest.mark.slow
def test_compiles_with_one_graph_break_and_one_recompile():
    """torch.compile (aot_eager here: the CPU inductor has no FlexAttention backward) breaks
    the graph only at the eager torchrec lookups, builds the block mask inside the graph,
    gives the eager step, and a new total history length recompiles once (T symbolic)."""
    gem, baseline = _models("rel-pos-window")
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(baseline, backend="aot_eager")
    generator = torch.Generator().manual_seed(5)
    weights = torch.ones(6, 2)
    for lengths in ([0, 1, 70, 5, 33, 2], [9, 70, 0, 3, 60, 1], [70, 70, 70, 1, 2, 3]):
        inputs = make_inputs(lengths, generator)
        _assert_same_step(
            _step(gem, inputs, weights), _step(baseline, inputs, weights, call=compiled)
        )
    breaks = counters["graph_break"]
    assert len(breaks) == 1 and "BaselineGem.embed" in next(iter(breaks)), breaks
    assert counters["stats"]["unique_graphs"] == 2


def test_checkpointed_layers_recompute_in_the_backward_and_give_the_same_step():
    """``checkpoint_layers``: each self-attention layer runs again in the backward (its
    activations were not kept), with the eager and the compiled step unchanged. (RoPE: eager
    FlexAttention on the CPU, which torch does not support for training, gives a wrong
    ``score_mod`` bias gradient when recomputed; compiled it is right.)"""
    gem, baseline = _models("v1")
    baseline.checkpoint_layers = True
    calls = []
    hooks = [
        layer.register_forward_pre_hook(lambda module, args: calls.append(module))
        for layer in baseline.sequence_layers
    ]
    inputs = make_inputs(LENGTHS, torch.Generator().manual_seed(6))
    weights = torch.ones(len(LENGTHS), 2)
    expected = _step(gem, inputs, weights)
    _assert_same_step(expected, _step(baseline, inputs, weights))
    assert len(calls) == 2 * len(baseline.sequence_layers)  # forward, then the recompute
    for hook in hooks:  # a side effect inside the checkpointed region would break the graph
        hook.remove()
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(baseline, backend="aot_eager")
    _assert_same_step(expected, _step(baseline, inputs, weights, call=compiled))
    assert len(counters["graph_break"]) == 1
