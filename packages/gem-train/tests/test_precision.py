"""Tests for the precision hook: TrainConfig.precision -> gem-precision layer conversion."""

from __future__ import annotations

import pytest
import torch
from gem_precision import Bf16GemmLinear, Fp8Linear
from gem_train.config import PrecisionConfig, TrainConfig, apply_overrides
from gem_train.precision import apply_precision, autocast, precision_policy
from torch import nn

CPU = torch.device("cpu")
CUDA = torch.device("cuda")  # a name only: nothing below allocates on it


def small_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.Linear(32, 1))


def test_overrides_reach_the_recipe():
    config = apply_overrides(
        TrainConfig(),
        [
            "precision.mode=fp8",
            "precision.min_features=16",
            "precision.hadamard=true",
            "precision.exclude=heads.*,out",
            "precision.wgrad_x_tiles=false",
        ],
    )
    assert config.precision.mode == "fp8" and config.precision.min_features == 16
    policy = precision_policy(config.precision)
    assert policy.recipe.hadamard and not policy.recipe.stochastic_rounding_grads
    assert (
        not policy.recipe.wgrad_x_tiles and precision_policy(PrecisionConfig()).recipe.wgrad_x_tiles
    )
    assert policy.exclude == ("heads.*", "out")
    with pytest.raises(ValueError, match="precision.mode"):
        apply_overrides(TrainConfig(), ["precision.mode=fp4"])


@pytest.mark.parametrize(("mode", "layer_type"), [("fp8", Fp8Linear), ("bf16", Bf16GemmLinear)])
def test_apply_precision_converts_the_same_layers(mode, layer_type):
    model = small_model()
    weights = [m.weight for m in model if isinstance(m, nn.Linear)]
    converted = apply_precision(model, PrecisionConfig(mode=mode, min_features=16), CPU)
    assert converted == ["2"]  # 8-wide input and 1-wide output stay float32
    assert type(model[2]) is layer_type and type(model[0]) is nn.Linear
    assert model[2].weight is weights[1]  # parameters are shared, optimizers keep working
    x = torch.randn(4, 8)
    reference = small_model()
    out, ref = model(x), reference(x)
    assert 0 < float((out - ref).norm() / ref.norm()) < 0.1


def test_on_cuda_bf16_is_autocast_and_fp8_keeps_its_bf16_layers_plain():
    model = small_model()
    assert apply_precision(model, PrecisionConfig(mode="bf16", min_features=16), CUDA) == []
    assert all(type(m) in (nn.Linear, nn.ReLU) for m in model)
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    config = PrecisionConfig(mode="fp8", min_features=16, bf16_layers=("1",))
    assert apply_precision(model, config, CUDA) == ["0"]
    assert type(model[0]) is Fp8Linear and type(model[1]) is nn.Linear
    assert isinstance(autocast(config, CUDA), torch.autocast)
    assert not isinstance(autocast(config, CPU), torch.autocast)
    assert not isinstance(autocast(PrecisionConfig(), CUDA), torch.autocast)


def test_fp32_changes_nothing():
    model = small_model()
    assert apply_precision(model, PrecisionConfig(), CPU) == []
    assert all(type(m) in (nn.Linear, nn.ReLU) for m in model)


def test_fp8_with_bf16_layers_mixes_both():
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    config = PrecisionConfig(mode="fp8", min_features=16, bf16_layers=("1",))
    assert sorted(apply_precision(model, config, CPU)) == ["0", "1"]
    assert type(model[0]) is Fp8Linear and type(model[1]) is Bf16GemmLinear


def test_fp8_default_keeps_the_task_heads_bf16():
    """The default FP8 policy of a GEM model: task heads' hidden layers on bf16 GEMMs (where
    FP8 lost NE), the sequence tower and DHEN layers in FP8, 1-wide outputs untouched."""
    from gem_model import GemModel, GemModelConfig
    from gem_train import tiny

    model_config = GemModelConfig(
        sequence_features={"hist_item_ids": 50, "hist_category_ids": 8},
        sparse_features={"user_id": 10, "ad_category_id": 8},
        num_dense_features=3,
        max_seq_len=16,
        architecture=tiny().model,
    )
    model = GemModel(model_config)
    converted = apply_precision(model, PrecisionConfig(mode="fp8", min_features=16), CPU)
    types = {name: type(module) for name, module in model.named_modules()}
    heads = [name for name in converted if name.startswith("heads.")]
    assert heads and all(types[name] is Bf16GemmLinear for name in heads)
    others = [name for name in converted if not name.startswith("heads.")]
    assert others and all(types[name] is Fp8Linear for name in others)
    assert all(types[f"heads.{task}.3"] is nn.Linear for task in model_config.tasks)
    # Every LayerNorm -> Linear pair of the sequence tower runs the fused norm -> quantise.
    from gem_precision import Fp8NormLinear, NormLinear

    assert not any(isinstance(module, NormLinear) for module in model.modules())
    fused = sorted(name for name, kind in types.items() if kind is Fp8NormLinear)
    assert fused == [
        "history_cross.kv_proj",
        "history_cross.q_proj",
        "pma.kv_proj",
        "sequence_layers.0.ffn.up",
        "sequence_layers.0.qkv",
    ]
    everything = GemModel(model_config)
    apply_precision(everything, PrecisionConfig(mode="fp8", min_features=16, bf16_layers=()), CPU)
    assert not any(isinstance(module, Bf16GemmLinear) for module in everything.modules())
    assert any(isinstance(module, Fp8Linear) for module in everything.heads.modules())


def test_fp8_attention_runs_the_matched_layers_in_fp8(small_config, tmp_path):
    """``precision.fp8_attention`` switches the matched attention modules (a JFA layer and the
    GDPA pooling) to FP8 (the CPU runs the emulation): finite losses that differ from bf16's."""
    import dataclasses

    from gem_model import AttentionPrecision
    from gem_train import Trainer
    from gem_train.cli import prepare_data

    train_data, _ = prepare_data(small_config.data, progress=False)
    base = dataclasses.replace(
        small_config,
        max_steps=2,
        model=dataclasses.replace(small_config.model, num_sequence_layers=2),
    )
    losses = {}
    for name, patterns in (("bf16", ()), ("fp8", ("sequence_layers.1", "pma"))):
        config = apply_overrides(base, [f"precision.fp8_attention={','.join(patterns)}"])
        trainer = Trainer(config, train_data, output_dir=tmp_path / name)
        precisions = {
            n.rsplit("module.", 1)[-1]: m.precision  # the name inside the DMP / DDP wrappers
            for n, m in trainer.model.named_modules()
            if isinstance(m, AttentionPrecision)
        }
        fp8 = {n for n, precision in precisions.items() if precision == "fp8"}
        assert fp8 == set(patterns), precisions
        assert [n for n in trainer.precision_converted if n in patterns] == list(patterns)
        losses[name] = trainer.fit(progress=False)
    assert all(torch.isfinite(torch.tensor(v)).all() for v in losses.values())
    assert losses["fp8"] != losses["bf16"]


def test_fp8_attention_pattern_must_match_a_layer(small_config, tmp_path):
    from gem_train import Trainer
    from gem_train.cli import prepare_data

    train_data, _ = prepare_data(small_config.data, progress=False)
    config = apply_overrides(small_config, ["precision.fp8_attention=sequence_layer.*"])
    with pytest.raises(ValueError, match="fp8_attention pattern 'sequence_layer.\\*' matches"):
        Trainer(config, train_data, output_dir=tmp_path)


def test_patterns_that_match_no_linear_are_refused():
    """A misspelled exclude or bf16_layers pattern used to change nothing, in silence."""
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))
    for config, field in (
        (PrecisionConfig(mode="fp8", min_features=16, exclude=("head.*",)), "exclude"),
        (PrecisionConfig(mode="fp8", min_features=16, bf16_layers=("9*",)), "bf16_layers"),
        (PrecisionConfig(mode="bf16", exclude=("x",)), "exclude"),
    ):
        with pytest.raises(ValueError, match=rf"precision.{field} pattern .* matches none"):
            apply_precision(model, config, CPU)
    with pytest.raises(ValueError, match="precision.min_features must be an int >= 1"):
        PrecisionConfig(min_features=-1)
