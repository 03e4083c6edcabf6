"""model_flops against the real model: dense GEMMs measured by FlopCounterMode on a CPU
forward + backward, attention from brute-force counts of the visible (query, key) pairs."""

from collections import defaultdict

import numpy as np
import pytest
import torch
from gem_model import GemInputs, GemModel
from gem_model.dhen import DotProductExpert
from gem_model.flops import ModelFlops, model_flops
from gem_model_inputs import V1, make_inputs
from gem_model_inputs import make_config as _make_config
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode, flop_registry

MAX_LEN = 70
DIM = 32
# An empty history, a length-1 history, one at the cap, odd lengths, one exact 64-token block.
LENGTHS = [0, 1, MAX_LEN, 5, 33, 67, 64]
ATTENTION = 4 * DIM  # forward FLOPs of one visible (query, key) pair: Q K^T and P V
ATTENTION_FWD_BWD = 3.5


def make_config(**changes):
    return _make_config(dim=DIM, max_seq_len=MAX_LEN, **changes)


ARCHITECTURES = {
    "v0": {},
    "block": {"self_attention": "block", "position": "rope"},
    "v1": V1,
    "v1-no-target-two-layers": {**V1, "target_attention": False, "num_sequence_layers": 2},
    "no-sequence": {"use_sequence_tower": False},
}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The GEMMs here are tiny: one thread skips the thread pool's warm-up, which takes seconds
    per new shape on a busy host."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# The model's top-level modules -> the ModelFlops region that counts their GEMMs.
REGION_OF = {
    "sequence_layers": "sequence_dense",
    "history_cross": "cross",
    "cross_attention": "cross",
    "pma": "pma",
    "dense_projection": "dhen",
    "interaction": "dhen",
    "heads": "heads",
}


def gemm_owners(model):
    """The modules that own the model's dense GEMMs, outermost only, by name: every
    ``nn.Linear`` or wrapper holding one as ``.linear`` (e.g. gem-precision's NormLinear, whose
    GEMM may run in its own forward) and DHEN's dot-product expert (its ``bmm`` and ``out``).
    The attention modules' own matmuls (the padded CPU reference kernels, DHEN's SDPA) are
    left out: attention is checked against the brute-force pair counts instead."""
    owners = {}
    for name, module in model.named_modules():
        owns = isinstance(module, (nn.Linear, DotProductExpert)) or isinstance(
            getattr(module, "linear", None), nn.Linear
        )
        if owns and not any(name.startswith(f"{owner}.") for owner in owners):
            owners[name] = module
    return owners


class BackwardFlops(TorchDispatchMode):
    """FlopCounterMode's formulas for the backward, per autograd node. (FlopCounterMode's own
    per-module attribution is reliable in the forward only: in the backward it credits most
    GEMMs to whichever module's hook fired last, e.g. a head's Dropout.)"""

    def __init__(self):
        super().__init__()
        self.per_node = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            node = torch._C._current_autograd_node()
            self.per_node[node] += formula(*args, **kwargs, out_val=out)
        return out


def measure(model, lengths):
    """Dense FLOPs of one real forward + backward, per GEMM owner: ``(forward, backward)``.

    The forward from FlopCounterMode's per-module counts; the backward from the autograd
    nodes each owner's forward created (walked from its output back to its inputs)."""
    owners = gemm_owners(model)
    owner_of_node = {}

    def record(name):
        def hook(module, args, output):
            inputs = {a.grad_fn for a in args if isinstance(a, torch.Tensor)}
            todo = [output.grad_fn]
            while todo:
                node = todo.pop()
                if node is None or node in inputs or node in owner_of_node:
                    continue
                owner_of_node[node] = name
                todo.extend(next_node for next_node, _ in node.next_functions)

        return hook

    handles = [module.register_forward_hook(record(name)) for name, module in owners.items()]
    try:
        inputs = make_inputs(lengths, torch.Generator().manual_seed(0))
        with FlopCounterMode(display=False) as forward_counter:
            logits = model(GemInputs(*inputs))
        with BackwardFlops() as backward_counter:
            logits.sum().backward()
    finally:
        for handle in handles:
            handle.remove()
    counts = forward_counter.get_flop_counts()
    root = type(model).__name__
    forward = {name: sum(counts.get(f"{root}.{name}", {}).values()) for name in owners}
    backward = dict.fromkeys(owners, 0)
    for node, name in owner_of_node.items():
        backward[name] += backward_counter.per_node.get(node, 0)
    return forward, backward


def per_region(per_owner):
    regions = defaultdict(int)
    for name, flops in per_owner.items():
        regions[REGION_OF[name.split(".")[0]]] += flops  # KeyError: a module without a region
    return regions


def visible_pairs(queries, keys, visible=lambda q, k: True):
    """Brute force: (query, key) pairs of the same sample that ``visible`` lets through; queries
    and keys are ``(sample, index)`` tuples."""
    return sum(
        1 for qs, qi in queries for ks, ki in keys if qs == ks and visible((qs, qi), (ks, ki))
    )


def history(lengths):
    return [(b, i) for b, length in enumerate(lengths) for i in range(length)]


def self_attention_pairs(lengths, kind, window):
    tokens = history(lengths)
    if kind == "block":
        return visible_pairs(tokens, tokens, lambda q, k: q[1] // 64 == k[1] // 64)
    return visible_pairs(
        tokens, tokens, lambda q, k: k[1] <= q[1] and (window == 0 or q[1] - k[1] <= window)
    )


def expected_attention(model, lengths):
    """Forward attention FLOPs per region, from brute-force pair counts on the model's shapes."""
    arch = model.config.architecture
    batch = len(lengths)
    samples = [(b, 0) for b in range(batch)]
    attention = defaultdict(int)
    if model.config.use_sequence_tower:
        tokens = history(lengths)
        layers = len(model.sequence_layers)
        pairs = self_attention_pairs(lengths, arch.self_attention, arch.attention_window)
        attention["sequence_attention"] = ATTENTION * layers * pairs
        pma_queries = [(b, q) for b in range(batch) for q in range(arch.pma_queries)]
        attention["pma"] = ATTENTION * visible_pairs(pma_queries, tokens)
        if model.history_cross is not None:
            # keys: the pooled sparse tokens, the dense projection and the candidate
            num_features = len(model.pooled_features) + (model.dense_projection is not None) + 1
            features = [(b, f) for b in range(batch) for f in range(num_features)]
            attention["cross"] += ATTENTION * visible_pairs(tokens, features)
        if model.cross_attention is not None:
            attention["cross"] += ATTENTION * visible_pairs(samples, tokens)
    num_tokens = model.num_tokens
    feature_tokens = [(b, t) for b in range(batch) for t in range(num_tokens)]
    experts = len(model.interaction) * arch.dhen_experts.count("attention")
    attention["dhen"] = ATTENTION * experts * visible_pairs(feature_tokens, feature_tokens)
    return attention


@pytest.mark.parametrize("architecture", list(ARCHITECTURES))
def test_regions_match_the_flop_counter_and_brute_force_attention(architecture):
    torch.manual_seed(0)
    config = make_config(**ARCHITECTURES[architecture])
    model = GemModel(config)
    flops = model_flops(config, torch.tensor(LENGTHS))
    attention = expected_attention(model, LENGTHS)
    forward, backward = measure(model, LENGTHS)

    # The backward of every dense GEMM is twice its forward (input and weight gradients)...
    for name in forward:
        factor = 2 if name != "dense_projection" else 1
        assert backward[name] == factor * forward[name] > 0, name
    # ...except dense_projection's: its input (the dense features) needs no gradient, so
    # autograd skips the input-gradient GEMM. The convention counts every dense GEMM 3x (the
    # model's FLOPs, not autograd's shortcut), so add that GEMM back.
    backward["dense_projection"] += forward["dense_projection"]

    dense = per_region({name: forward[name] + backward[name] for name in forward})
    regions = [name for name in ModelFlops.__dataclass_fields__ if name != "forward"]
    expected = {name: dense[name] + ATTENTION_FWD_BWD * attention[name] for name in regions}
    # Exact, not within 1%: the counts are integers (halves at most) far below 2**53, and a
    # small GEMM (the candidates' qk_proj, dense_projection) is well under 1% of its region.
    assert flops.as_dict() == {**expected, "total": sum(expected.values())}
    assert flops.total == sum(expected.values())
    assert flops.forward == sum(forward.values()) + sum(attention.values())
    assert flops.embeddings == 0
    if not config.use_sequence_tower:
        assert flops.sequence_attention == flops.sequence_dense == flops.pma == flops.cross == 0


@pytest.mark.parametrize(
    ("kind", "window"),
    [
        ("jagged_flash", 0),
        ("jagged_flash", 1),
        ("jagged_flash", 3),
        ("jagged_flash", 64),
        ("block", 0),
    ],
)
def test_self_attention_counts_the_visible_pairs(kind, window):
    """Windows shorter and longer than the histories (64 >= most of them), and 64-token
    blocks, one partial, against a brute-force count; two layers count twice."""
    lengths = [0, 1, 2, 3, 4, 5, 63, 64, 65, MAX_LEN, 7, 31]
    position = "rope" if kind == "block" else "none"
    config = make_config(
        self_attention=kind, attention_window=window, position=position, num_sequence_layers=2
    )
    pairs = self_attention_pairs(lengths, kind, window)
    flops = model_flops(config, lengths)
    assert flops.sequence_attention == ATTENTION_FWD_BWD * ATTENTION * 2 * pairs


def test_attention_follows_the_real_lengths_not_the_padded_batch():
    config = make_config()
    one = model_flops(config, [MAX_LEN])
    padded = model_flops(config, [MAX_LEN, 0, 0, 0])
    assert padded.sequence_attention == one.sequence_attention
    assert padded.sequence_dense == one.sequence_dense
    assert model_flops(config, [2, 3]).sequence_attention == ATTENTION_FWD_BWD * ATTENTION * (3 + 6)


def test_lengths_may_be_a_tensor_an_array_or_a_sequence():
    config = make_config(**V1)
    reference = model_flops(config, LENGTHS)
    for lengths in (
        torch.tensor(LENGTHS, dtype=torch.int32),
        np.array(LENGTHS, dtype=np.int64),
        tuple(LENGTHS),
    ):
        assert model_flops(config, lengths) == reference
    assert set(reference.as_dict()) == {
        "embeddings",
        "sequence_attention",
        "sequence_dense",
        "pma",
        "cross",
        "dhen",
        "heads",
        "total",
    }


@pytest.mark.parametrize(
    ("lengths", "error", "match"),
    [
        ([3, -1], ValueError, "lengths must be >= 0"),
        ([3, MAX_LEN + 1], ValueError, "max_seq_len"),
        (torch.ones(2, 3, dtype=torch.long), ValueError, "lengths must be 1-D"),
        (torch.tensor(3), ValueError, "lengths must be 1-D"),
        (torch.tensor([1.0, 2.0]), TypeError, "lengths must hold integers"),
        ([1, 2.5], TypeError, "lengths must hold integers"),
        (3, TypeError, "lengths must be"),
    ],
)
def test_bad_lengths_are_rejected(lengths, error, match):
    with pytest.raises(error, match=match):
        model_flops(make_config(), lengths)


def test_config_must_be_a_gem_model_config():
    with pytest.raises(TypeError, match="config must be a GemModelConfig"):
        model_flops(make_config().architecture, [1])


def test_flops_of_two_batches_add_region_by_region():
    config = make_config(**V1)
    a, b = model_flops(config, [3, 0, 70]), model_flops(config, [5, 9])
    both = a + b
    assert both.as_dict() == {k: a.as_dict()[k] + b.as_dict()[k] for k in a.as_dict()}
    assert both.forward == a.forward + b.forward
