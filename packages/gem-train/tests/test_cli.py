import json

import pytest
from gem_train import apply_overrides, get_recipe, tiny
from gem_train.cli import main


def test_unknown_recipe_is_a_clear_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--recipe", "gigantic"])
    assert exit_info.value.code == 2
    assert "unknown recipe 'gigantic'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="known recipes: \\['tiny'\\]"):
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
