import pytest
import torch
from gem_model import GemInputs, GemModel
from gem_model_inputs import SEQUENCE, SPARSE, V1, make_config, make_inputs
from torchrec import KeyedJaggedTensor

ARCHITECTURES = {
    "v0": {},
    "block": {"self_attention": "block", "position": "rope"},
    "v1": V1,
    "v1-rel-pos": {**V1, "position": "rel_pos_bias"},
    "v1-full-causal-gelu": {**V1, "attention_window": 0, "ffn": "gelu", "position": "none"},
    "v1-no-target": {**V1, "target_attention": False},
    "v1-two-layers": {**V1, "num_sequence_layers": 2},
}


@pytest.mark.parametrize("architecture", list(ARCHITECTURES))
def test_forward_backward_reaches_every_parameter(architecture):
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = GemModel(make_config(**ARCHITECTURES[architecture]))
    # an empty history, a length-1 history, one at the cap, odd lengths
    sequence, sparse, dense = make_inputs([0, 1, 70, 5, 33], generator)
    logits = model(GemInputs(sequence, sparse, dense))
    assert logits.shape == (5, 2)
    assert torch.isfinite(logits).all()
    logits.sum().backward()
    missing = [name for name, p in model.named_parameters() if p.grad is None]
    assert not missing, f"no gradient reached {missing}"
    # The candidate id used in the cross-attention shares the history category table.
    table = model.sequence_embeddings.embeddings["sequence_hist_category_ids"].weight
    assert table.grad[sparse["ad_category_id"].values()].abs().sum() > 0


def test_history_changes_the_prediction_only_with_the_sequence_tower():
    generator = torch.Generator().manual_seed(1)
    sequence, sparse, dense = make_inputs([4, 9, 2], generator)
    other_sequence, _, _ = make_inputs([4, 9, 2], generator)
    for use_sequence, should_differ in ((True, True), (False, False)):
        torch.manual_seed(0)
        model = GemModel(make_config(use_sequence_tower=use_sequence)).eval()
        differ = not torch.allclose(
            model(GemInputs(sequence, sparse, dense)),
            model(GemInputs(other_sequence, sparse, dense)),
        )
        assert differ == should_differ


@pytest.mark.parametrize("architecture", ["v0", "v1"])
def test_prediction_of_a_sample_does_not_depend_on_the_rest_of_the_batch(architecture):
    generator = torch.Generator().manual_seed(2)
    torch.manual_seed(0)
    model = GemModel(make_config(**ARCHITECTURES[architecture])).eval()
    sequence, sparse, dense = make_inputs([3, 0, 12, 7], generator)
    full = model(GemInputs(sequence, sparse, dense))
    for i in range(4):
        keep = torch.tensor([i])
        one_seq = KeyedJaggedTensor.from_jt_dict(
            {k: _take(sequence[k], keep) for k in sequence.keys()}
        )
        one_sparse = KeyedJaggedTensor.from_jt_dict(
            {k: _take(sparse[k], keep) for k in sparse.keys()}
        )
        alone = model(GemInputs(one_seq, one_sparse, dense[keep]))
        torch.testing.assert_close(alone, full[keep], rtol=1e-5, atol=1e-5)


def _take(jagged, index):
    from torchrec import JaggedTensor

    offsets = jagged.offsets()
    i = int(index[0])
    values = jagged.values()[offsets[i] : offsets[i + 1]]
    return JaggedTensor(values=values, lengths=jagged.lengths()[index])


@pytest.mark.parametrize("architecture", ["v0", "block", "v1", "v1-rel-pos"])
def test_bf16_attention_matches_fp32_and_keeps_the_residual_dtype(architecture):
    """attention_dtype='bfloat16' (the Triton path on CUDA) changes only q/k/v rounding."""
    generator = torch.Generator().manual_seed(1)
    sequence, sparse, dense = make_inputs([0, 1, 70, 5, 33], generator)
    outputs, grads = [], []
    for dtype in ("float32", "bfloat16", "auto"):
        torch.manual_seed(0)
        model = GemModel(make_config(**ARCHITECTURES[architecture], attention_dtype=dtype))
        logits = model(GemInputs(sequence, sparse, dense))
        assert logits.dtype == torch.float32
        logits.sum().backward()
        outputs.append(logits.detach())
        grads.append(model.sequence_layers[0].qkv.linear.weight.grad.clone())
    torch.testing.assert_close(outputs[1], outputs[0], atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(outputs[2], outputs[0], atol=0, rtol=0)  # auto on CPU: float32
    scale = grads[0].abs().max()
    assert (grads[1] - grads[0]).abs().max() <= 5e-2 * scale
    assert (grads[1] != grads[0]).any(), "bfloat16 attention should round q/k/v"


def test_autocast_carries_the_sequence_residual_stream_in_bf16():
    """Under bf16 autocast the tower's tokens (its residual stream) are bf16 from SequenceInput
    to PMA; without autocast they stay float32; the parameters' gradients are float32."""
    generator = torch.Generator().manual_seed(4)
    sequence, sparse, dense = make_inputs([0, 1, 70, 5, 33], generator)
    torch.manual_seed(0)
    model = GemModel(make_config(**V1, num_sequence_layers=2))
    stream = {}
    for name in ("sequence_layers.0", "sequence_layers.1", "history_cross", "pma"):
        model.get_submodule(name).register_forward_hook(
            lambda module, args, out, name=name: stream.__setitem__(
                name, (args[0].dtype, out.dtype)
            )
        )
    reference = model(GemInputs(sequence, sparse, dense))
    assert set(stream.values()) == {(torch.float32, torch.float32)}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(GemInputs(sequence, sparse, dense))
    assert set(stream.values()) == {(torch.bfloat16, torch.bfloat16)}
    torch.testing.assert_close(logits.float(), reference, atol=2e-2, rtol=2e-2)
    logits.float().sum().backward()
    assert {p.grad.dtype for p in model.parameters() if p.grad is not None} == {torch.float32}


def test_too_long_history_is_rejected():
    generator = torch.Generator().manual_seed(3)
    model = GemModel(make_config(max_seq_len=8))
    sequence, sparse, dense = make_inputs([3, 9], generator)
    with pytest.raises(ValueError, match="max_seq_len"):
        model(GemInputs(sequence, sparse, dense))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"embedding_dim": 15}, "embedding_dim"),
        ({"self_attention": "ring"}, "self_attention"),
        ({"dhen_experts": ("mlp", "moe")}, "dhen_experts"),
        ({"candidate_feature": "nope"}, "candidate_feature"),
        ({"candidate_history_feature": "nope"}, "candidate_history_feature"),
        ({"pma_queries": 0}, "pma_queries"),
        ({"tasks": ()}, "tasks"),
        ({"dropout": 1.5}, "dropout"),
        ({"attention_dtype": "float8"}, "attention_dtype"),
        ({"max_seq_len": 0}, "max_seq_len"),
        ({"position": "alibi"}, "position must be one of"),
        ({"ffn": "relu"}, "ffn must be one of"),
        ({"attention_window": -1}, "attention_window must be an int >= 0"),
        ({"self_attention": "block", "position": "rope", "attention_window": 8}, "'block'"),
        ({"self_attention": "block"}, "position='rope'"),
        ({"max_seq_len": 8.5}, "max_seq_len must be a positive int"),
        ({"sequence_activation": "bogus"}, "sequence_activation must be one of"),
        ({"tasks": ("ctr", "ctr")}, "tasks must be distinct"),
        ({"sparse_features": {**SPARSE, "ad_category_id": 100}}, "the candidate shares that table"),
        ({"sparse_features": {**SPARSE, "region": 0}}, r"sparse_features\['region'\]"),
        ({"sequence_features": {**SEQUENCE, "hist_item_ids": -5}}, "hist_item_ids"),
    ],
)
def test_bad_config_is_rejected(changes, message):
    with pytest.raises(ValueError, match=message):
        make_config(**changes)


def test_heads_start_at_the_base_rate():
    model = GemModel(make_config(task_base_rates=(0.1, 0.03)))
    generator = torch.Generator().manual_seed(4)
    sequence, sparse, dense = make_inputs([2, 5], generator)
    bias = torch.tensor([model.heads[t][-1].bias.item() for t in ("ctr", "cvr")])
    torch.testing.assert_close(torch.sigmoid(bias), torch.tensor([0.1, 0.03]))
    with pytest.raises(ValueError, match="task_base_rates"):
        make_config(task_base_rates=(0.1,))
    with pytest.raises(ValueError, match="task_base_rates"):
        make_config(task_base_rates=(0.1, 1.0))
    assert model(GemInputs(sequence, sparse, dense)).shape == (2, 2)


def test_new_dhen_layers_start_as_the_identity():
    from gem_model import DHENLayer

    layer = DHENLayer(5, 16, 2, ("attention", "mlp", "cross", "dot"), 32, 0.0)
    tokens = torch.randn(3, 5, 16)
    torch.testing.assert_close(layer(tokens), tokens)


@pytest.mark.parametrize("position", ["none", "rope", "rel_pos_bias"])
def test_windowed_attention_sees_only_the_last_events(position):
    """With window w, the last event's output depends on the w events before it, not earlier."""
    from gem_model import JaggedSelfAttentionLayer

    torch.manual_seed(0)
    window, length = 3, 9
    layer = JaggedSelfAttentionLayer(
        16, 2, "jagged_flash", window=window, position=position, ffn="swiglu", max_len=length
    )
    if layer.rel_pos_bias is not None:
        torch.nn.init.normal_(layer.rel_pos_bias)
    tokens = torch.randn(length, 16)
    offsets = torch.tensor([0, length])
    positions = torch.arange(length)
    base = layer(tokens, offsets, length, positions)[-1]
    early, late = tokens.clone(), tokens.clone()
    early[length - window - 2] = torch.randn(16)  # outside the last event's window
    late[length - window - 1] = torch.randn(16)  # the oldest event inside it
    torch.testing.assert_close(layer(early, offsets, length, positions)[-1], base)
    assert not torch.allclose(layer(late, offsets, length, positions)[-1], base)


def test_rope_makes_self_attention_depend_on_order():
    """Without a position signal, causal attention of the last event over a permuted history
    prefix is the same; with RoPE it is not."""
    from gem_model import JaggedSelfAttentionLayer

    torch.manual_seed(0)
    tokens = torch.randn(6, 16)
    swapped = tokens[[1, 0, 2, 3, 4, 5]]
    offsets, positions = torch.tensor([0, 6]), torch.arange(6)
    for position, same in (("none", True), ("rope", False)):
        layer = JaggedSelfAttentionLayer(16, 2, "jagged_flash", position=position, max_len=6)
        a = layer(tokens, offsets, 6, positions)[-1]
        b = layer(swapped, offsets, 6, positions)[-1]
        assert torch.allclose(a, b, atol=1e-5) == same, position


def test_history_cross_reads_the_feature_tokens():
    """The history cross makes each event depend on its own sample's feature tokens only."""
    from gem_model import HistoryFeatureCrossAttention

    torch.manual_seed(0)
    cross = HistoryFeatureCrossAttention(16, 2, "silu")
    tokens = torch.randn(7, 16)
    offsets = torch.tensor([0, 0, 3, 7])  # an empty history first
    features = torch.randn(3, 4, 16)
    base = cross(tokens, offsets, 4, features)
    changed = features.clone()
    changed[1] = torch.randn(4, 16)
    out = cross(tokens, offsets, 4, changed)
    torch.testing.assert_close(out[3:], base[3:])
    assert not torch.allclose(out[:3], base[:3])


def test_sequence_activations_are_the_gdpa_activations():
    from gem_kernels.reference import GDPA_ACTIVATIONS
    from gem_model.config import SEQUENCE_ACTIVATIONS

    assert set(SEQUENCE_ACTIVATIONS) == set(GDPA_ACTIVATIONS)
