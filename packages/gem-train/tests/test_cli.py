import json
import subprocess
import sys

import gem_data
import gem_model
import gem_train
import pytest
from gem_train import apply_overrides, get_recipe, tiny
from gem_train.cli import main

_NO_TORCH_PROBE = """
import contextlib, io, sys
from gem_train.cli import main
for argv in (["--help"], ["--recipe", "h200", "--print-config"], ["--recipe", "gigantic"]):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            main(argv)
        except SystemExit:
            pass
print(sorted(m for m in ("torch", "torchrec", "gem_model.model") if m in sys.modules))
"""


def test_help_print_config_and_misuse_import_no_torch():
    """``gem-train --help``, ``--print-config`` and a bad ``--recipe`` answer without importing
    torch or torchrec (about 10 s of a 2-core CPU's time): the packages import lazily and the CLI
    imports the trainer only to run."""
    probe = subprocess.run(
        [sys.executable, "-c", _NO_TORCH_PROBE], capture_output=True, text=True, check=True
    )
    assert probe.stdout.strip() == "[]", probe.stdout + probe.stderr


@pytest.mark.parametrize("package", [gem_data, gem_model, gem_train], ids=lambda p: p.__name__)
def test_every_lazy_export_resolves(package):
    """Every name of the package's ``__init__.pyi`` stub loads from its module."""
    assert len(package.__all__) > 10
    for name in package.__all__:
        assert getattr(package, name) is not None, name


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
    assert large.activation_checkpointing == "auto"  # out of memory on an H200 without
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


# ---------------------------------------------------------------- misuse: one line, exit 2


def _corrupt_shard(root):
    """``root/train`` with a dataset.json matching the tiny recipe and a shard of garbage."""
    from gem_train.cli import synthetic_config

    data = tiny().data
    directory = root / "train"
    directory.mkdir(parents=True)
    (directory / "part-00000.parquet").write_bytes(b"PAR1 not really parquet")
    document = {
        "format_version": 1,
        "num_samples": data.num_train,
        "start_index": 0,
        "files": [{"name": "part-00000.parquet", "start_index": 0, "num_rows": data.num_train}],
        "sequence_features": {},
        "sparse_features": {},
        "num_dense_features": 8,
        "max_seq_len": data.max_seq_len,
        "oracle_ne": {},
        "config": synthetic_config(data).to_dict(),
        "source": "synthetic",
    }
    (directory / "dataset.json").write_text(json.dumps(document))
    return root


def _corrupt_info(root):
    (root / "train").mkdir(parents=True)
    (root / "train" / "dataset.json").write_text("{not json")
    return root


def _interaction_logs(root):
    _corrupt_shard(root)
    path = root / "train" / "dataset.json"
    path.write_text(path.read_text().replace('"synthetic"', '"interactions"'))
    return root


def _previous_run(root):
    """A run with a whole checkpoint in the output directory (the test's ``output``, beside
    ``root``), and one that crashed before its first (only a partial save and its metrics:
    nothing to lose, so that alone starts again)."""
    import torch
    from gem_train.checkpoint import save_checkpoint

    run = root.parent / "run"
    save_checkpoint(run / "gem" / "checkpoints", 5, {"model": {"w": torch.ones(2)}}, {"step": 5})
    (run / "no_sequence" / "checkpoints" / "step_00000003.partial").mkdir(parents=True)
    (run / "no_sequence" / "metrics.jsonl").write_text('{"step": 1}\n')
    return root


def _a_file(root):
    root.mkdir()
    (root / "file").write_text("not a directory")
    return root / "file" / "data"


MISUSES = {
    # id: (--set overrides or other arguments, option named, words of the expectation)
    "negative batch": (["--set", "batch_size=-1"], "--set batch_size", "an int >= 1, got -1"),
    "zero eval batch": (["--set", "eval_batch_size=0"], "--set eval_batch_size", ">= 1"),
    "negative max_steps": (["--set", "max_steps=-1"], "--set max_steps", ">= 0"),
    "zero epochs": (["--set", "epochs=0"], "--set epochs", ">= 1"),
    "zero log_every": (["--set", "log_every=0"], "--set log_every", ">= 1"),
    "negative checkpoint_every": (
        ["--set", "checkpoint_every=-5"],
        "--set checkpoint_every",
        ">= 0",
    ),
    "batch above the data": (["--set", "batch_size=999999"], "--set batch_size", "at most"),
    "not an int": (
        ["--set", "model.embedding_dim=abc"],
        "--set model.embedding_dim=abc",
        "expected an int, got 'abc'",
    ),
    "not a number": (["--set", "optim.dense_lr=fast"], "--set optim.dense_lr", "a number"),
    "not a boolean": (["--set", "compare_no_sequence=maybe"], "--set compare_no_sequence", "bool"),
    "no value": (["--set", "max_steps"], "--set max_steps", "FIELD=VALUE"),
    "unknown field": (["--set", "model.width=3"], "--set model.width=3", "unknown field 'width'"),
    "unknown section": (["--set", "nosuch.field=3"], "--set nosuch.field", "unknown section"),
    "unknown recipe": (["--recipe", "gigantic"], "--recipe", "unknown recipe 'gigantic'"),
    "unknown option": (["--gigantic"], "--gigantic", "unrecognized arguments"),
    "block with a window": (
        ["--set", "model.self_attention=block"],
        "--set model.self_attention=block",
        "attention_window",
    ),
    "block without rope": (
        ["--set", "model.position=none", "--set", "model.attention_window=0"]
        + ["--set", "model.self_attention=block"],
        "--set model.self_attention=block",
        "set position='rope'",
    ),
    "sync with 1d": (
        ["--set", "parallel.sparse_sync_every=2"],
        "--set parallel.sparse_sync_every",
        "only applies to parallel.sparse='2d'",
    ),
    "replicas vs world": (
        ["--set", "parallel.sparse=2d", "--set", "parallel.sparse_replicas=2"],
        "--set parallel.sparse_replicas",
        "must divide the world size (1)",
    ),
    "table smaller than categories": (["--set", "data.num_ads=3"], "--set data.num_ads", ">="),
    "expert groups vs the shard group": (
        ["--set", "parallel.expert_parallel=3"],
        "--set parallel.expert_parallel",
        "parallel.expert_parallel (3) must divide the shard group (1)",
    ),
    "missing GPU": (["--set", "device=cuda"], "--set device", "no CUDA device"),
    "unknown device": (["--set", "device=tpu"], "--set device", "'auto', 'cpu' or 'cuda'"),
    "data under a file": (_a_file, "--set data.directory", "is not a directory"),
    "corrupt dataset.json": (_corrupt_info, "--set data.directory", "not a readable JSON file"),
    "corrupt shard": (_corrupt_shard, "--set data.directory", "not a readable Parquet file"),
    "interaction logs": (_interaction_logs, "--set data.directory", "'interactions' data"),
    "resume without checkpoint": (["--resume"], "--resume", "no checkpoint under"),
    "fresh run over a previous one": (
        _previous_run,
        "--set output_dir",
        "holds a run with checkpoints (gem/checkpoints/step_00000005): pass --resume",
    ),
}


@pytest.mark.parametrize(("arguments", "option", "expected"), MISUSES.values(), ids=MISUSES)
def test_misuse_is_one_line_naming_the_option_and_exit_status_2(
    arguments, option, expected, tmp_path, capsys, monkeypatch
):
    """Every misuse ends before any data is generated or a model built: one line on stderr
    naming the option and what it expects, status 2, no traceback."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    data, output = tmp_path / "data", tmp_path / "run"
    if callable(arguments):
        data, arguments = arguments(data), []
    before = sorted(tmp_path.rglob("*"))
    with pytest.raises(SystemExit) as exit_info:
        main(["--set", f"data.directory={data}", "--set", f"output_dir={output}", *arguments])
    captured = capsys.readouterr()
    assert exit_info.value.code == 2
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("gem-train: error: ") and option in lines[0], lines[0]
    assert expected in lines[0]
    assert "Traceback" not in captured.err and captured.out == ""
    assert sorted(tmp_path.rglob("*")) == before, "a misuse must not write anything"
    if option == "--resume":
        assert (
            lines[0] == f"gem-train: error: --resume: no checkpoint under {output}/gem/checkpoints"
        )


def test_validate_accepts_the_recipe_without_writing(tmp_path):
    from gem_train.cli import validate

    config = apply_overrides(
        tiny(), [f"data.directory={tmp_path / 'data'}", f"output_dir={tmp_path / 'run'}"]
    )
    validate(config)
    assert list(tmp_path.iterdir()) == []


def test_errors_inside_training_keep_their_traceback(monkeypatch, tmp_path):
    """A loss that becomes NaN is not a misuse: main lets it propagate."""
    import gem_train.cli as cli

    def diverge(config, *, resume=False, profile=False):
        raise FloatingPointError("loss became nan at step 3")

    monkeypatch.setattr(cli, "run", diverge)
    with pytest.raises(FloatingPointError):
        main(["--set", f"output_dir={tmp_path}"])


def test_every_rank_needs_an_evaluation_sample(tmp_path, monkeypatch):
    """A rank without evaluation samples failed in torch.cat after the whole training."""
    from gem_train.cli import UsageError, validate

    monkeypatch.setenv("WORLD_SIZE", "2")
    config = apply_overrides(
        tiny(),
        [f"data.directory={tmp_path / 'data'}", f"output_dir={tmp_path / 'run'}"]
        + ["data.num_eval=1", "data.num_shards=1"],
    )
    with pytest.raises(UsageError, match=r"data.num_eval.*one evaluation sample per rank \(2\)"):
        validate(config)


def test_a_run_that_crashed_before_its_first_checkpoint_starts_again(tmp_path):
    """Nothing to resume and nothing to lose: a fresh run is accepted (--resume would say
    there is no checkpoint)."""
    from gem_train.cli import validate

    run = tmp_path / "run"
    (run / "gem" / "checkpoints" / "step_00000003.partial").mkdir(parents=True)
    (run / "gem" / "metrics.jsonl").write_text('{"step": 1}\n')
    config = apply_overrides(tiny(), [f"data.directory={tmp_path / 'data'}", f"output_dir={run}"])
    validate(config)


def test_eval_table_shows_an_undefined_ne_as_n_a():
    """A one-class eval (a rare task on a small eval set) has no NE: n/a, not a huge number."""
    from gem_train.cli import _print_summary
    from rich.console import Console

    console = Console(record=True, width=200)
    results = {"gem": {"ne_ctr": 0.8612, "auc_ctr": 0.75, "ne_cvr": float("nan"), "auc_cvr": 0.5}}
    summary = {"recipe": "tiny", "results": results, "oracle_ne": {"ctr": 0.82, "cvr": 0.77},
               "seconds": 1.0}  # fmt: skip
    _print_summary(console, summary)
    rows = {line.split()[1]: line for line in console.export_text().splitlines() if "│" in line}
    assert "0.8612" in rows["ctr"] and "n/a" in rows["cvr"] and "nan" not in rows["cvr"]
