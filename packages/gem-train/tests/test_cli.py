import json

import pytest
from gem_train import apply_overrides, get_recipe, tiny
from gem_train.cli import main


def test_unknown_recipe_is_a_clear_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--recipe", "gigantic"])
    assert exit_info.value.code == 2
    assert "unknown recipe 'gigantic'" in capsys.readouterr().err
    with pytest.raises(
        ValueError, match="known recipes: \\['h200', 'h200-large', 'h200x8', 'tiny'\\]"
    ):
        get_recipe("gigantic")


def test_overrides_change_typed_fields():
    config = apply_overrides(
        tiny(),
        [
            "model.embedding_dim=64",
            "max_steps=7",
            "optim.dense_lr=0.01",
            "compare_no_sequence=false",
            "model.dhen_experts=mlp,cross",
        ],
    )
    assert config.model.embedding_dim == 64
    assert config.max_steps == 7
    assert config.optim.dense_lr == 0.01
    assert config.compare_no_sequence is False
    assert config.model.dhen_experts == ("mlp", "cross")
    assert tiny().model.embedding_dim == 32, "overrides must not leak into the recipe"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model.embedding_dim", "section.field=value"),
        ("model.width=3", "unknown field 'width'"),
        ("nosuch.field=3", "unknown section 'nosuch'"),
        ("max_steps=many", "max_steps"),
        ("compare_no_sequence=maybe", "boolean"),
    ],
)
def test_bad_override_is_a_clear_error(override, message):
    with pytest.raises(ValueError, match=message):
        apply_overrides(tiny(), [override])


def test_print_config(capsys):
    assert main(["--print-config", "--set", "batch_size=64"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["batch_size"] == 64
    assert printed["recipe"] == "tiny"


def test_gpu_recipes_describe_gem_v1_at_gpu_scale(capsys):
    """h200: d_model 512, GEM-like lengths up to 1024, 100-300M dense parameters; h200-large at
    d_model 1024 in FP8; h200x8 the same model on the 5D layout. Sizes come from the model
    built on the meta device, FLOPs from gem_model.model_flops."""
    import torch
    from gem_data.writer import _feature_spec
    from gem_model import GemModel, GemModelConfig
    from gem_train.cli import synthetic_config

    def dense_parameters(config):
        synthetic = synthetic_config(config.data)
        sequence, sparse = _feature_spec(synthetic)
        model_config = GemModelConfig(
            sequence_features=sequence,
            sparse_features=sparse,
            num_dense_features=synthetic.num_dense_features,
            max_seq_len=config.data.max_seq_len,
            architecture=config.model,
        )
        model = GemModel(model_config, device=torch.device("meta"))
        tables = {
            id(p)
            for module in (model.sparse_embeddings, model.sequence_embeddings)
            for p in module.parameters()
        }
        return sum(p.numel() for p in model.parameters() if id(p) not in tables)

    h200 = get_recipe("h200")
    assert h200.model.embedding_dim == 512 and h200.model.attention_window == 256
    assert h200.data.profile == "gem" and 1024 <= h200.data.max_seq_len <= 4096
    assert 100e6 <= dense_parameters(h200) <= 300e6
    large = get_recipe("h200-large")
    assert large.model.embedding_dim == 1024 and large.precision.mode == "fp8"
    x8 = get_recipe("h200x8")
    assert x8.model == h200.model and x8.batch_size == h200.batch_size
    assert (x8.parallel.dense, x8.parallel.sparse) == ("fsdp", "fully_sharded_2d")
    assert main(["--print-config", "--recipe", "h200"]) == 0
    assert json.loads(capsys.readouterr().out)["model"]["history_cross"] is True


def test_data_profile_and_table_sizes_reach_the_generator():
    from gem_data import SyntheticConfig
    from gem_train.cli import synthetic_config

    config = apply_overrides(tiny(), ["data.profile=gem", "data.num_items=5000"])
    assert synthetic_config(config.data) == SyntheticConfig.gpu_scale(128, num_items=5000)
    assert synthetic_config(tiny().data) == SyntheticConfig(), "tiny's data must not change"
    with pytest.raises(ValueError, match="data.profile must be one of"):
        apply_overrides(tiny(), ["data.profile=huge"])
    with pytest.raises(ValueError, match="data.num_users must be an int >= 1"):
        apply_overrides(tiny(), ["data.num_users=0"])
