"""Cost model formulas against hand-computed small cases."""

from __future__ import annotations

import pytest
from gem_parallel import (
    Bandwidths,
    Latencies,
    ModelSizes,
    ParallelLayout,
    Topology,
    Workload,
    estimate_step,
)
from gem_parallel.cost_model import (
    all_gather_bytes,
    all_reduce_bytes,
    all_to_all_bytes,
    latency_steps,
    reduce_scatter_bytes,
)

# 4 ranks = 2 zones of one host with 2 GPUs: shard/expert/model_parallel (contiguous pairs) stay
# on NVLink, replicate/sparse_replica (stride 2) cross zones. Round bandwidths for hand math.
TOPOLOGY = Topology(gpus_per_host=2, hosts_per_zone=1)
LAYOUT = ParallelLayout(replicate=2, shard=2, expert=2, model_parallel=2)
BANDWIDTHS = Bandwidths(nvlink=100.0, zone=10.0, cross_zone=1.0)
MODEL = ModelSizes(
    dense_params=1000,
    expert_params=400,
    param_bytes=2,
    grad_bytes=4,
    embedding_table_bytes=8000,
    embedding_lookup_bytes_per_sample=10,
    expert_activation_bytes_per_sample=5,
)
WORKLOAD = Workload(batch_per_gpu=4, dense_compute_s=10.0)
NO_LATENCY = Latencies(nvlink=0, zone=0, cross_zone=0)


def by_name(cost):
    return {c.name: c for c in cost.collectives}


def test_collective_byte_formulas():
    assert all_gather_bytes(800, 4) == 600
    assert reduce_scatter_bytes(800, 4) == 600
    assert all_reduce_bytes(800, 4) == 1200
    assert all_to_all_bytes(800, 4) == 600
    assert all_gather_bytes(800, 1) == 0


def test_2d_step_by_hand():
    cost = estimate_step(
        MODEL, WORKLOAD, LAYOUT, TOPOLOGY, BANDWIDTHS, sparse_sync_interval=2, latencies=NO_LATENCY
    )
    c = by_name(cost)
    # FSDP gathers 600 non-expert + 400/2 expert params = 800 params, twice (reshard):
    # 2 * 800 params * 2 B * (2-1)/2 = 1600 B over NVLink (100 B/s).
    assert (c["fsdp_all_gather"].bytes_per_gpu, c["fsdp_all_gather"].seconds) == (1600, 16)
    assert c["fsdp_all_gather"].tier == "nvlink" and c["fsdp_all_gather"].dim == "shard"
    # Reduce-scatter of 800 grads * 4 B: 3200 * 1/2.
    assert c["fsdp_reduce_scatter"].bytes_per_gpu == 1600
    # All-reduce over replicate of the grad shard 1000 * 4 / 2 = 2000 B: 2 * 2000 * 1/2, 1 B/s.
    assert c["fsdp_all_reduce"].tier == "cross-zone"
    assert (c["fsdp_all_reduce"].bytes_per_gpu, c["fsdp_all_reduce"].seconds) == (2000, 2000)
    # EP: gathered activations 2 ranks * 4 samples * 5 B = 40; fwd + bwd: 2 * 40 * 1/2.
    assert c["ep_all_gather"].bytes_per_gpu == 40 and c["ep_reduce_scatter"].bytes_per_gpu == 40
    assert c["ep_all_gather"].seconds == pytest.approx(0.4)
    # Sparse: lookups 4 * 10 = 40 B, forward + backward: 2 * 40 * 1/2.
    assert c["sparse_all_to_all"].bytes_per_gpu == 40
    # Replica sync: all-reduce of the 8000/2 B shard over 2 replicas every 2 steps.
    assert c["sparse_replica_sync"].bytes_per_gpu == 2000
    assert c["sparse_replica_sync"].seconds == 2000
    assert "sparse_fs2d_all_gather" not in c
    assert cost.embedding_bytes_per_gpu == 4000
    assert cost.total_bytes == 1600 + 1600 + 2000 + 40 + 40 + 40 + 2000
    assert cost.total_seconds == pytest.approx(16 + 16 + 2000 + 0.4 * 3 + 2000)
    # FSDP (2032 s) hides 10 s behind compute; the rest is exposed.
    assert cost.exposed_seconds == pytest.approx(2022 + 1.2 + 2000)
    assert cost.seconds_by_dim()["shard"] == 32
    assert cost.bytes_by_dim()["sparse_replica"] == 2000


def test_fully_sharded_2d_and_no_resharding_by_hand():
    cost = estimate_step(
        MODEL,
        WORKLOAD,
        LAYOUT,
        TOPOLOGY,
        BANDWIDTHS,
        sparse="fully_sharded_2d",
        reshard_after_forward=False,
        latencies=NO_LATENCY,
    )
    c = by_name(cost)
    assert c["fsdp_all_gather"].bytes_per_gpu == 800  # gathered once
    assert "sparse_replica_sync" not in c
    # The 40 B of served rows are gathered from / reduced to the 2 replicas: 40 * 1/2 each.
    assert c["sparse_fs2d_all_gather"].bytes_per_gpu == 20
    assert c["sparse_fs2d_reduce_scatter"].seconds == 20  # cross-zone, 1 B/s
    assert cost.embedding_bytes_per_gpu == 2000


def test_1d_sharding_crosses_zones_and_needs_world_model_parallel():
    layout = ParallelLayout(replicate=2, shard=2, expert=1, model_parallel=4)
    cost = estimate_step(
        MODEL, WORKLOAD, layout, TOPOLOGY, BANDWIDTHS, sparse="1d", latencies=NO_LATENCY
    )
    c = by_name(cost)
    assert c["sparse_all_to_all"].tier == "cross-zone"
    assert c["sparse_all_to_all"].bytes_per_gpu == 2 * 40 * 3 / 4
    assert "ep_all_gather" not in c  # expert = 1: no EP traffic
    assert c["fsdp_all_gather"].bytes_per_gpu == 2 * 1000 * 2 / 2  # all experts gathered
    with pytest.raises(ValueError, match="model_parallel"):
        estimate_step(MODEL, WORKLOAD, LAYOUT, TOPOLOGY, BANDWIDTHS, sparse="1d")


def test_expert_parallel_trades_fsdp_bytes_for_activation_bytes():
    no_ep = ParallelLayout(replicate=2, shard=2, expert=1, model_parallel=2)
    base = by_name(estimate_step(MODEL, WORKLOAD, no_ep, TOPOLOGY, BANDWIDTHS))
    ep = by_name(estimate_step(MODEL, WORKLOAD, LAYOUT, TOPOLOGY, BANDWIDTHS))
    saved = base["fsdp_all_gather"].bytes_per_gpu - ep["fsdp_all_gather"].bytes_per_gpu
    assert saved == 2 * (400 - 200) * 2 / 2
    assert base["fsdp_all_reduce"].bytes_per_gpu == ep["fsdp_all_reduce"].bytes_per_gpu


def test_latency_term_by_hand():
    assert [latency_steps(p) for p in (1, 2, 5, 8)] == [0, 1, 4, 7]
    assert [latency_steps(p, "log") for p in (1, 2, 5, 8, 9)] == [0, 1, 3, 3, 4]
    model = ModelSizes(
        dense_params=1000,
        expert_params=400,
        embedding_table_bytes=8000,
        embedding_lookup_bytes_per_sample=10,
        expert_activation_bytes_per_sample=5,
        fsdp_units=3,
        expert_layers=2,
    )
    latencies = Latencies(nvlink=1.0, zone=10.0, cross_zone=100.0)
    kwargs = dict(sparse_sync_interval=4, latencies=latencies)
    base = estimate_step(model, WORKLOAD, LAYOUT, TOPOLOGY, BANDWIDTHS, latencies=NO_LATENCY)
    cost = estimate_step(model, WORKLOAD, LAYOUT, TOPOLOGY, BANDWIDTHS, **kwargs)
    c, b = (
        by_name(cost),
        by_name(
            estimate_step(
                model,
                WORKLOAD,
                LAYOUT,
                TOPOLOGY,
                BANDWIDTHS,
                sparse_sync_interval=4,
                latencies=NO_LATENCY,
            )
        ),
    )
    # Groups of 2 ranks: 1 ring step (2 for all-reduce), times calls, times the tier's alpha.
    expected_latency = {
        "fsdp_all_gather": 2 * 3 * 1 * 1.0,  # twice per unit (reshard), 3 units, NVLink
        "fsdp_reduce_scatter": 3 * 1 * 1.0,
        "fsdp_all_reduce": 3 * 2 * 100.0,  # all-reduce over replicate: cross-zone
        "ep_all_gather": 2 * 2 * 1 * 1.0,  # forward + backward per expert layer
        "ep_reduce_scatter": 2 * 2 * 1.0,
        "sparse_all_to_all": 2 * 1.0,
        "sparse_replica_sync": 2 * 100.0 / 4,  # every 4 steps
    }
    assert set(c) == set(expected_latency)
    for name, latency in expected_latency.items():
        assert c[name].latency_seconds == pytest.approx(latency), name
        assert c[name].seconds == pytest.approx(b[name].seconds + latency), name
    assert cost.latency_seconds == pytest.approx(sum(expected_latency.values()))
    assert base.latency_seconds == 0
    # Ring latency grows linearly with the group, log latency logarithmically.
    wide = ParallelLayout(replicate=1, shard=8, expert=1, model_parallel=8)
    ring = by_name(estimate_step(model, WORKLOAD, wide, Topology(8), BANDWIDTHS, **kwargs))
    log = by_name(
        estimate_step(model, WORKLOAD, wide, Topology(8), BANDWIDTHS, latency_model="log", **kwargs)
    )
    assert ring["sparse_all_to_all"].latency_seconds == pytest.approx(2 * 7 * 1.0)
    assert log["sparse_all_to_all"].latency_seconds == pytest.approx(2 * 3 * 1.0)


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="sparse must be one of"):
        estimate_step(MODEL, WORKLOAD, LAYOUT, TOPOLOGY, sparse="3d")
    with pytest.raises(ValueError, match="sparse_sync_interval"):
        estimate_step(MODEL, WORKLOAD, LAYOUT, TOPOLOGY, sparse_sync_interval=0)
    with pytest.raises(TypeError, match="model must be a ModelSizes"):
        estimate_step(None, WORKLOAD, LAYOUT, TOPOLOGY)
    with pytest.raises(ValueError, match="topology"):
        estimate_step(MODEL, WORKLOAD, LAYOUT, Topology(gpus_per_host=3))
    with pytest.raises(ValueError, match="model.expert_params"):
        ModelSizes(dense_params=1, expert_params=2)
    with pytest.raises(ValueError, match="workload.batch_per_gpu"):
        Workload(batch_per_gpu=0)
    with pytest.raises(ValueError, match="bandwidths.zone"):
        Bandwidths(zone=0)
    with pytest.raises(ValueError, match="tier must be one of"):
        Bandwidths().of("wifi")
    with pytest.raises(ValueError, match="latency_model must be one of"):
        estimate_step(MODEL, WORKLOAD, LAYOUT, TOPOLOGY, latency_model="tree")
    with pytest.raises(TypeError, match="latencies must be a Latencies"):
        estimate_step(MODEL, WORKLOAD, LAYOUT, TOPOLOGY, latencies=1e-6)
    with pytest.raises(ValueError, match="latencies.zone"):
        Latencies(zone=-1)
    with pytest.raises(ValueError, match="model.fsdp_units"):
        ModelSizes(dense_params=1, fsdp_units=0)
    with pytest.raises(ValueError, match="layout.expert .* must fit inside one host"):
        estimate_step(
            MODEL, WORKLOAD, ParallelLayout(replicate=2, shard=8, expert=8, model_parallel=4),
            Topology(gpus_per_host=4, hosts_per_zone=2),
        )  # fmt: skip
    with pytest.raises(TypeError, match="reshard_after_forward must be a bool"):
        estimate_step(MODEL, WORKLOAD, LAYOUT, TOPOLOGY, reshard_after_forward="no")
    nan, inf = float("nan"), float("inf")
    with pytest.raises(ValueError, match="model.dense_params must be a finite"):
        ModelSizes(dense_params=nan)
    with pytest.raises(ValueError, match="bandwidths.zone must be a finite"):
        Bandwidths(zone=inf)
    with pytest.raises(ValueError, match="latencies.nvlink must be a finite"):
        Latencies(nvlink=nan)


def _load_cost_table():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "cost_table.py"
    spec = importlib.util.spec_from_file_location("gem_parallel_cost_table", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cost_table_rows_differ_by_scale_through_latency(capsys):
    table = _load_cost_table()
    rows = list(table.rows())
    assert sorted({world for world, *_ in rows}) == [1024, 2048, 4096]
    alpha = {"nvlink": 2e-6, "zone": 6e-6, "cross-zone": 25e-6}
    by_key = {}
    for world, name, ring, log in rows:
        by_key[world, name] = ring
        for c in ring.collectives:  # ring: (p-1) steps per call, twice for all-reduce
            steps = (c.group_size - 1) * (2 if "all_reduce" in c.name or "sync" in c.name else 1)
            assert c.latency_seconds == pytest.approx(c.calls * steps * alpha[c.tier]), c.name
        assert log.latency_seconds <= ring.latency_seconds
        assert log.total_bytes == ring.total_bytes  # same traffic, only latency differs
    for name in ("1D", "2D", "FS-2D", "FS-2D+EP8"):
        exposed = [by_key[w, name].exposed_seconds for w in (1024, 2048, 4096)]
        assert exposed[0] < exposed[1] < exposed[2], (name, exposed)
    table.main()
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 2 + len(rows) and "exp(log)" in printed[1]
