import dataclasses
import itertools
import json
import logging
import time
from pathlib import Path

import pytest
import torch
from gem_precision import rounding_state
from gem_train import Trainer
from gem_train.checkpoint import latest_checkpoint
from gem_train.cli import prepare_data, run
from gem_train.config import PrecisionConfig
from gem_train.throughput import PHASES, StepClock, peak_tflops, speed_line
from rich.console import Console


@pytest.mark.parametrize("precision", ["fp32", "fp8-stochastic-rounding"])
def test_resume_gives_the_same_next_losses_as_an_uninterrupted_run(
    small_config, tmp_path, precision
):
    train_data, _ = prepare_data(small_config.data, progress=False)
    config = dataclasses.replace(small_config, max_steps=5)
    if precision != "fp32":  # the rounding counters must resume too (trainer_state.json)
        config = dataclasses.replace(
            config,
            precision=PrecisionConfig(mode="fp8", min_features=16, stochastic_rounding_grads=True),
        )

    uninterrupted = Trainer(config, train_data, output_dir=tmp_path / "a")
    reference_losses = uninterrupted.fit(progress=False)
    assert len(reference_losses) == 5

    first = Trainer(
        dataclasses.replace(config, max_steps=3, checkpoint_every=1),
        train_data,
        output_dir=tmp_path / "b",
    )
    first.fit(progress=False)
    first.save(tmp_path / "b" / "checkpoints")
    assert latest_checkpoint(tmp_path / "b" / "checkpoints").name == "step_00000003"
    assert sorted(p.name for p in (tmp_path / "b" / "checkpoints").glob("step_*")) == [
        "step_00000002",
        "step_00000003",
    ], "only the newest two checkpoints are kept"

    torch.manual_seed(1234)  # a different init: everything must come from the checkpoint
    resumed = Trainer(config, train_data, output_dir=tmp_path / "c")
    assert resumed.resume(tmp_path / "b" / "checkpoints")
    assert resumed.step == 3
    resumed_losses = resumed.fit(progress=False)
    assert resumed_losses == reference_losses[3:]


def test_fit_pipelines_the_lookups_and_trains_as_plain_steps(small_config, tmp_path, caplog):
    """fit runs torchrec's train pipeline over both tables and the module that makes their
    inputs (torchrec would silently leave a lookup whose inputs it cannot trace unpipelined),
    and gives the losses of plain steps on the loader's batches: across an epoch's end, and
    after an evaluation between two fits, which runs the model without the pipeline."""
    train_data, eval_data = prepare_data(small_config.data, progress=False)
    config = dataclasses.replace(small_config, max_steps=10)  # 8 steps per epoch
    pipelined = Trainer(config, train_data, output_dir=tmp_path / "a")
    pipelined.total_steps = 3
    with caplog.at_level(logging.INFO, logger="torchrec.distributed.train_pipeline"):
        losses = pipelined.fit(progress=False)
    said = caplog.text
    for module in ("sparse_embeddings", "sequence_embeddings"):
        assert f"Module '{module}' will be pipelined" in said
    assert "will NOT be pipelined" not in said
    assert "_TableInputs() is a valid postproc module" in said
    metrics = pipelined.evaluate(eval_data)
    pipelined.total_steps = 10
    losses += pipelined.fit(progress=False)

    plain = Trainer(config, train_data, output_dir=tmp_path / "b")
    batches = itertools.chain(plain.loader, plain.loader)  # two epochs
    expected = [plain.train_step(next(batches)) for _ in range(3)]
    assert plain.evaluate(eval_data) == metrics
    expected += [plain.train_step(next(batches)) for _ in range(7)]
    assert losses == expected


def test_fresh_trainer_differs_without_resume(small_config, tmp_path):
    """Guards the test above: a different seed must give different losses."""
    train_data, _ = prepare_data(small_config.data, progress=False)
    a = Trainer(
        dataclasses.replace(small_config, max_steps=2), train_data, output_dir=tmp_path / "a"
    )
    b = Trainer(
        dataclasses.replace(small_config, max_steps=2, seed=7),
        train_data,
        output_dir=tmp_path / "b",
    )
    assert a.fit(progress=False) != b.fit(progress=False)


def test_run_trains_evaluates_and_writes_metrics(small_config):
    console = Console(record=True, width=300)
    summary = run(dataclasses.replace(small_config, epochs=2), console=console)
    # The console gets each variant's speed: its last train line, in words.
    printed = console.export_text()
    for variant in ("gem", "no_sequence"):
        line = next(ln for ln in printed.splitlines() if ln.startswith(f"{variant}, last "))
        assert "samples/s" in line and "MFU n/a" in line and "ms per step: data " in line
    for variant in ("gem", "no_sequence"):
        for task in ("ctr", "cvr"):
            assert 0.0 < summary["results"][variant][f"ne_{task}"] < 1.5
            assert 0.0 <= summary["results"][variant][f"auc_{task}"] <= 1.0
    assert set(summary["oracle_ne"]) == {"ctr", "cvr"}
    metrics_file = Path(small_config.output_dir) / "gem" / "metrics.jsonl"
    lines = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    assert any(line["split"] == "train" for line in lines)
    assert any(line["split"] == "eval" and "ne_ctr" in line for line in lines)
    # Every train line carries the model TFLOP per step (gem_model.model_flops of its batches),
    # the throughput and the time split; MFU needs a GPU's peak.
    for line in (line for line in lines if line["split"] == "train"):
        assert line["model_tflop"] > 0 and line["tflops"] > 0
        assert line["tokens_per_s"] > 0 and line["samples_per_s"] > 0
        assert line["mfu"] is None and line["mfu_measured"] is None
        assert line["graphs_compiled"] == 0  # not compiled
        phases = sum(line[f"time_{phase}"] for phase in PHASES)
        assert 0 < phases <= line["step_ms"] / 1e3 * 1.01
    # The same numbers as TensorBoard scalars beside metrics.jsonl.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(metrics_file.parent))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/tokens_per_s", "train/time_forward"} <= tags
    assert {"eval/ne_ctr", "eval/auc_cvr"} <= tags
    losses = [line["loss"] for line in lines if line["split"] == "train"]
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx(losses)


def test_speed_line_of_a_gpu_record():
    record = {"step_ms": 195.04, "samples_per_s": 5201.3, "tokens_per_s": 2.66e6, "tflops": 251.2,
              "mfu": 0.2539, "mfu_measured": 0.3132, "time_data": 0.0, "time_forward": 0.0651,
              "time_backward": 0.1269, "time_optimizer": 0.0028, "peak_mem_gib": 69.94}  # fmt: skip
    assert speed_line(record) == (
        "195.0 ms/step, 5,201 samples/s, 2,660,000 tokens/s, 251.2 model TFLOP/s, MFU 25.4% "
        "(31.3% of the measured peak), ms per step: data 0.0 / forward 65.1 / backward 126.9 / "
        "optimizer 2.8, peak 69.9 GiB"
    )
    assert speed_line(record | {"alloc_retries": 0}) == speed_line(record)
    assert speed_line(record | {"alloc_retries": 3}).endswith(
        "peak 69.9 GiB, 3 allocator retries (fragmented cache: each one syncs and frees it)"
    )
    assert speed_line(record | {"graphs_compiled": 0}) == speed_line(record)
    assert speed_line(record | {"graphs_compiled": 2}).endswith("peak 69.9 GiB, 2 graphs compiled")


def test_peak_table_and_step_clock():
    assert peak_tflops("NVIDIA H200") == 989.4
    assert peak_tflops("NVIDIA GH200 480GB") == 989.4
    assert peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert peak_tflops("NVIDIA H100 PCIe") == 756.5 and peak_tflops("NVIDIA H200 NVL") == 835.5
    assert peak_tflops("NVIDIA H100 80GB HBM3") == 989.4  # the SXM part
    assert peak_tflops("NVIDIA GB200") == 2500.0 and peak_tflops("NVIDIA B200") == 2250.0
    assert peak_tflops("Some Future GPU") is None
    assert peak_tflops(torch.device("cpu")) is None
    clock = StepClock(torch.device("cpu"))
    clock.start()
    time.sleep(0.01)
    clock.mark("forward")
    time.sleep(0.02)
    clock.mark("data")
    time.sleep(0.01)
    clock.mark("forward")  # a phase marked twice in a step adds up
    clock.finish()
    seconds = clock.take()
    assert set(seconds) == set(PHASES)
    assert seconds["data"] >= 0.02 and seconds["forward"] >= 0.02 and seconds["backward"] == 0.0
    assert clock.take()["data"] == 0.0


def test_a_crash_while_saving_leaves_the_previous_checkpoint_in_use(small_config, tmp_path):
    train_data, _ = prepare_data(small_config.data, progress=False)
    config = dataclasses.replace(small_config, max_steps=2, checkpoint_every=2)
    trainer = Trainer(config, train_data, output_dir=tmp_path / "run")
    trainer.fit(progress=False)
    checkpoints = tmp_path / "run" / "checkpoints"
    # A writer killed mid-save leaves only a .partial directory behind.
    (checkpoints / "step_00000004.partial").mkdir()
    (checkpoints / "step_00000004.partial" / "garbage.distcp").write_bytes(b"\0" * 10)
    assert latest_checkpoint(checkpoints).name == "step_00000002"
    resumed = Trainer(config, train_data, output_dir=tmp_path / "other")
    assert resumed.resume(checkpoints)
    assert resumed.step == 2


def test_a_non_finite_loss_stops_training_with_a_clear_error(small_config, tmp_path):
    train_data, _ = prepare_data(small_config.data, progress=False)
    trainer = Trainer(small_config, train_data, output_dir=tmp_path / "run")
    batch = next(iter(trainer.loader))
    forward = trainer._forward
    trainer._forward = lambda b: forward(b) * float("nan")
    with pytest.raises(FloatingPointError, match="loss became nan at step 0; resume from the last"):
        trainer.train_step(batch)
    assert trainer.step == 0, "the failed step is not counted"


def test_a_non_finite_loss_in_fit_stops_before_the_next_checkpoint(small_config, tmp_path):
    """fit reads the losses back at log lines and checkpoints only: the first non-finite one
    is still named, and no checkpoint holds the weights it trained."""
    train_data, _ = prepare_data(small_config.data, progress=False)
    config = dataclasses.replace(small_config, max_steps=12, log_every=100, checkpoint_every=4)
    trainer = Trainer(config, train_data, output_dir=tmp_path / "run")
    forward, calls = trainer._forward, itertools.count()
    trainer._forward = lambda b: forward(b) * (float("nan") if next(calls) >= 5 else 1.0)
    with pytest.raises(FloatingPointError, match="loss became nan at step 5; resume from the last"):
        trainer.fit(checkpoint_dir=tmp_path / "checkpoints", progress=False)
    assert trainer.step == 5
    assert latest_checkpoint(tmp_path / "checkpoints").name == "step_00000004"


def test_profile_pass_tables_every_region_and_leaves_training_unchanged(small_config, tmp_path):
    from gem_model import GemArchitecture
    from gem_train.profiling import PROFILE_REGIONS

    train_data, _ = prepare_data(small_config.data, progress=False)
    config = dataclasses.replace(
        small_config,
        max_steps=7,
        model=GemArchitecture(embedding_dim=16, num_heads=2, dhen_layers=1, expert_hidden_dim=32,
                              history_cross=True, attention_window=4, position="rope"),
    )  # fmt: skip
    plain = Trainer(config, train_data, output_dir=tmp_path / "plain").fit(progress=False)
    trainer = Trainer(config, train_data, output_dir=tmp_path / "profiled")
    assert trainer.fit(progress=False, profile=True) == plain  # the profiler only observes
    written = json.loads((tmp_path / "profiled" / "profile.json").read_text())
    assert written["regions"] == trainer.profile["regions"] and written["steps"] == 3
    rows = {row["region"]: row for row in written["regions"]}
    assert list(rows) == [*PROFILE_REGIONS, "other"]
    for region in PROFILE_REGIONS:  # every region ran, in both passes where it has a backward
        assert rows[region]["forward_ms"] > 0, region
        if region != "optimizer":
            assert rows[region]["backward_ms"] > 0, region
    assert rows["sequence_attention"]["model_tflop"] > 0 and rows["embeddings"]["model_tflop"] == 0
    accounted = sum(row["ms"] for row in written["regions"][:-1])
    assert accounted <= written["step_ms"] * 1.05  # regions do not overlap
    trace = json.loads((tmp_path / "profiled" / written["trace"]).read_text())
    names = {event.get("name") for event in trace["traceEvents"]}
    assert "gem_model/sequence" in names and "gem_kernels::jagged_flash_attention" in names


def test_profile_of_a_run_shorter_than_the_pass_covers_the_steps_it_has(small_config, tmp_path):
    """Under 3 steps the pass used to start and never stop: no table, and a crash at exit."""
    train_data, _ = prepare_data(small_config.data, progress=False)
    trainer = Trainer(dataclasses.replace(small_config, max_steps=2), train_data,
                      output_dir=tmp_path / "run")  # fmt: skip
    trainer.fit(progress=False, profile=True)
    written = json.loads((tmp_path / "run" / "profile.json").read_text())
    assert written["steps"] == 2 and trainer.profile["steps"] == 2


def test_a_checkpoint_without_fp8_resumes_into_fp8_with_fresh_rounding_counters(
    small_config, tmp_path
):
    train_data, _ = prepare_data(small_config.data, progress=False)
    saved = Trainer(dataclasses.replace(small_config, max_steps=2), train_data,
                    output_dir=tmp_path / "a")  # fmt: skip
    saved.fit(progress=False)
    saved.save(tmp_path / "a" / "checkpoints")
    fp8 = PrecisionConfig(mode="fp8", min_features=16, stochastic_rounding_grads=True)
    config = dataclasses.replace(small_config, max_steps=3, precision=fp8)
    resumed = Trainer(config, train_data, output_dir=tmp_path / "b")
    assert resumed.resume(tmp_path / "a" / "checkpoints") and resumed.step == 2
    counters = rounding_state(resumed.model.module)
    assert counters and set(counters.values()) == {0}
    assert len(resumed.fit(progress=False)) == 1
