"""``parallel.sparse_plan`` and ``parallel.fsdp_all_gather_collective`` through the trainer, and
the host-time split of ``StepClock`` that benchmarks read instead of patching the trainer.

Both plans and both collectives build a trainer and train on two real gloo ranks (a row-wise
table needs more than one rank to be split, and FSDP gathers nothing on one)."""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from gem_data import ParquetBatchLoader
from gem_model import GemArchitecture
from gem_parallel import run_in_processes
from gem_parallel.testing import fresh_forkserver
from gem_train import DataConfig, OptimConfig, TrainConfig, Trainer, apply_overrides, tiny
from gem_train.cli import prepare_data
from gem_train.config import ParallelConfig
from gem_train.parallel import ROW_WISE_MIN_ROWS, row_wise_plan
from gem_train.throughput import HOST_PHASES, PHASES, StepClock
from torchrec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
)

WORLD = 2
STEPS = 2


@pytest.fixture(scope="module", autouse=True)
def _fresh_forkserver():
    with fresh_forkserver():
        yield


# ------------------------------------------------------------------------- config validation
def test_new_parallel_options_parse_and_default_to_todays_behaviour():
    assert tiny().parallel.sparse_plan == "auto"
    assert tiny().parallel.fsdp_all_gather_collective == "auto"
    config = apply_overrides(
        tiny(),
        [
            "parallel.dense=fsdp",
            "parallel.fsdp_all_gather_collective=nccl",
            "parallel.sparse_plan=row_wise",
        ],
    )
    assert config.parallel == ParallelConfig(
        dense="fsdp", fsdp_all_gather_collective="nccl", sparse_plan="row_wise"
    )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["parallel.sparse_plan=rw"], "parallel.sparse_plan must be 'auto' or 'row_wise'"),
        (
            ["parallel.sparse=2d", "parallel.sparse_plan=row_wise"],
            "parallel.sparse_plan='row_wise' only applies to parallel.sparse='1d'",
        ),
        (
            ["parallel.dense=fsdp", "parallel.fsdp_all_gather_collective=copy"],
            "parallel.fsdp_all_gather_collective must be 'auto' or 'nccl'",
        ),
        (
            ["parallel.fsdp_all_gather_collective=nccl"],
            "parallel.fsdp_all_gather_collective='nccl' only applies to parallel.dense='fsdp'",
        ),
        # Removed: gathering only the looked-up rows under fully sharded 2D.
        (["parallel.sparse_gather=rows"], "unknown field 'sparse_gather'"),
    ],
)
def test_bad_values_name_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        apply_overrides(tiny(), overrides)


def test_bad_values_in_the_constructor_name_the_field():
    with pytest.raises(ValueError, match="parallel.sparse_plan must be"):
        ParallelConfig(sparse_plan=None)
    with pytest.raises(ValueError, match="parallel.fsdp_all_gather_collective must be"):
        ParallelConfig(dense="fsdp", fsdp_all_gather_collective="NCCL")


# ------------------------------------------------------------------------------ row_wise_plan
def test_row_wise_plan_places_sequence_and_large_tables_row_wise():
    big = ROW_WISE_MIN_ROWS
    model = torch.nn.ModuleDict(
        {
            "pooled": EmbeddingBagCollection(
                tables=[
                    EmbeddingBagConfig(
                        name=name, embedding_dim=8, num_embeddings=rows, feature_names=[name]
                    )
                    for name, rows in (("small0", 10), ("large", big), ("small1", 10), ("s2", 9))
                ],
                device=torch.device("meta"),
            ),
            "history": EmbeddingCollection(
                tables=[
                    EmbeddingConfig(
                        name="history_items",
                        embedding_dim=8,
                        num_embeddings=10,
                        feature_names=["i"],
                    )
                ],
                device=torch.device("meta"),
            ),
        }
    )
    plan = row_wise_plan(model, 2, "cpu").plan
    kinds = {
        (path, table): (sharding.sharding_type, sharding.ranks)
        for path, module_plan in plan.items()
        for table, sharding in module_plan.items()
    }
    assert kinds == {
        ("history", "history_items"): ("row_wise", [0, 1]),
        ("pooled", "large"): ("row_wise", [0, 1]),
        # small pooled tables dealt round-robin
        ("pooled", "small0"): ("table_wise", [0]),
        ("pooled", "small1"): ("table_wise", [1]),
        ("pooled", "s2"): ("table_wise", [0]),
    }
    assert all(s.compute_kernel == "fused" for m in plan.values() for s in m.values())
    with pytest.raises(ValueError, match="world_size must be an int >= 1"):
        row_wise_plan(model, 0, "cpu")


# ----------------------------------------------------------------------------------- StepClock
def test_step_clock_splits_host_time_into_issue_and_wait():
    clock = StepClock(torch.device("cpu"))
    clock.start()
    time.sleep(0.01)
    clock.mark("data")
    clock.mark("forward")
    clock.mark("backward")
    clock.mark("optimizer")
    clock.finish()
    host = clock.take_host()
    assert set(host) == set(HOST_PHASES) == {*PHASES, "wait"}
    assert host["data"] >= 0.01 and all(v >= 0.0 for v in host.values())
    assert clock.take_host() == dict.fromkeys(HOST_PHASES, 0.0)
    # take() reads its own (stream) split: take_host() did not reset it.
    assert clock.take()["data"] >= 0.01


# -------------------------------------------------------------------------- through the trainer
def _config(out: str, parallel: ParallelConfig) -> TrainConfig:
    return TrainConfig(
        data=DataConfig(
            directory=out + "/data",
            num_train=256,
            num_eval=64,
            max_seq_len=16,
            num_shards=2,
            workers=1,
            num_users=2 * ROW_WISE_MIN_ROWS,  # one pooled table large enough to go row-wise
        ),
        model=GemArchitecture(embedding_dim=8, num_heads=2, dhen_layers=1, expert_hidden_dim=16),
        batch_size=16,
        device="cpu",
        log_every=100,
        output_dir=out + "/run",
        optim=OptimConfig(warmup_steps=1),
        compare_no_sequence=False,
        parallel=parallel,
    )


VARIANTS = {
    "fsdp_auto": ParallelConfig(dense="fsdp"),
    "fsdp_nccl": ParallelConfig(dense="fsdp", fsdp_all_gather_collective="nccl"),
    "row_wise": ParallelConfig(sparse_plan="row_wise"),
}


def _worker(rank: int, out: str) -> None:
    train, _ = prepare_data(_config(out, ParallelConfig()).data, progress=False)
    loader = ParquetBatchLoader(
        train.directory, 16, shuffle=False, rank=rank, world_size=WORLD, drop_last=True
    )
    batches = [b for _, b in zip(range(STEPS), loader, strict=False)]
    result: dict[str, object] = {}
    for name, parallel in VARIANTS.items():
        trainer = Trainer(_config(out, parallel), train, output_dir=f"{out}/{name}")
        result[name] = [trainer.train_step(batch) for batch in batches]
        result[name + "_host"] = trainer.clock.take_host()
        wrapper = trainer.parallel.fsdp_wrapper
        result[name + "_all_gather"] = wrapper.all_gather if wrapper is not None else None
        result[name + "_layout"] = (
            f"{trainer.parallel.describe()}; {trainer.sparse_parallel.describe()}"
        )
        # (sharding type, table rows) per "module/table": the shards of a row- or table-wise
        # table stack along the rows
        result[name + "_plan"] = {
            f"{path}/{table}": (
                sharding.sharding_type,
                sum(shard.shard_sizes[0] for shard in sharding.sharding_spec.shards),
            )
            for path, module_plan in trainer.model.plan.plan.items()
            for table, sharding in module_plan.items()
        }
    gathered: list[object] = [None] * WORLD
    dist.all_gather_object(gathered, result)
    if rank == 0:
        Path(out, "result.json").write_text(json.dumps(gathered))


def test_each_option_value_builds_a_trainer_and_trains(tmp_path):
    run_in_processes(_worker, WORLD, str(tmp_path), timeout=300, preload=("torchrec", "gem_train"))
    ranks = json.loads((tmp_path / "result.json").read_text())
    for result in ranks:
        for name in VARIANTS:
            assert len(result[name]) == STEPS and all(math.isfinite(x) for x in result[name])
            host = result[name + "_host"]
            assert set(host) == set(HOST_PHASES)
            assert host["forward"] > 0 and host["backward"] > 0 and host["wait"] >= 0
        assert result["fsdp_auto_all_gather"] == "auto"
        assert result["fsdp_nccl_all_gather"] == "nccl"
        assert "nccl all-gather" in result["fsdp_nccl_layout"]
        assert "all-gather" not in result["fsdp_auto_layout"]
        assert result["row_wise_layout"].endswith("sparse 1d over 2 rank(s), row_wise plan")
        # The same weights and batches: the collective moves the same bytes.
        assert result["fsdp_nccl"] == pytest.approx(result["fsdp_auto"], rel=1e-6)
        plan = result["row_wise_plan"]
        # torchrec's planner keeps the 200k-row user table whole on one rank on the CPU
        assert result["fsdp_auto_plan"] != plan
        sequence = [
            kind for key, (kind, _) in plan.items() if key.startswith("sequence_embeddings/")
        ]
        assert sequence and set(sequence) == {"row_wise"}, plan
        pooled = {k: v for k, v in plan.items() if k.startswith("sparse_embeddings/")}
        assert max(rows for _, rows in pooled.values()) >= ROW_WISE_MIN_ROWS, plan
        for table, (kind, rows) in pooled.items():
            want = "row_wise" if rows >= ROW_WISE_MIN_ROWS else "table_wise"
            assert kind == want, (table, plan)


def test_row_wise_plan_on_one_rank_trains(small_config, tmp_path):
    """At world 1 every table is whole on the one rank, row-wise or not."""
    train_data, _ = prepare_data(small_config.data, progress=False)
    config = dataclasses.replace(
        small_config, max_steps=1, parallel=ParallelConfig(sparse_plan="row_wise")
    )
    trainer = Trainer(config, train_data, output_dir=tmp_path / "rw")
    assert all(math.isfinite(x) for x in trainer.fit(progress=False))
