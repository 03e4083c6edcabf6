"""Pure layout math of gem_parallel.mesh (no process groups)."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from gem_parallel import (
    DIM_NAMES,
    TIERS,
    ParallelLayout,
    Topology,
    build_gem_mesh,
    default_topology,
    describe_layout,
    dim_tier,
    group_of,
    mesh_dims,
    rank_groups,
    validate_layout,
)
from hypothesis import given, settings
from hypothesis import strategies as st

# --------------------------------------------------------------------------------------------
# Independent reference: groups from numpy reshapes of arange(world), tiers from host/zone ids
# --------------------------------------------------------------------------------------------


def reference_groups(layout: ParallelLayout, dim: str) -> list[tuple[int, ...]]:
    world = layout.replicate * layout.shard
    ranks = np.arange(world)
    if dim in ("replicate", "shard"):
        grid = ranks.reshape(layout.replicate, layout.shard)
        rows = grid if dim == "shard" else grid.T
    elif dim == "expert":
        rows = ranks.reshape(-1, layout.expert)
    else:
        grid = ranks.reshape(world // layout.model_parallel, layout.model_parallel)
        rows = grid if dim == "model_parallel" else grid.T
    return sorted(tuple(int(r) for r in row) for row in rows)


def reference_tier(groups, gpus_per_host: int, hosts_per_zone: int) -> str:
    worst = 0
    for group in groups:
        hosts = {r // gpus_per_host for r in group}
        zones = {r // (gpus_per_host * hosts_per_zone) for r in group}
        worst = max(worst, 0 if len(hosts) == 1 else 1 if len(zones) == 1 else 2)
    return ["nvlink", "zone", "cross-zone"][worst]


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def layouts_and_topologies(draw):
    gpus_per_host = draw(st.sampled_from([1, 2, 4, 8]))
    hosts_per_zone = draw(st.integers(1, 3))
    zones = draw(st.integers(1, 3))
    world = gpus_per_host * hosts_per_zone * zones
    shard = draw(st.sampled_from(divisors(world)))
    expert = draw(st.sampled_from(divisors(math.gcd(shard, gpus_per_host))))
    model_parallel = draw(st.sampled_from(divisors(world)))
    layout = ParallelLayout(
        replicate=world // shard, shard=shard, expert=expert, model_parallel=model_parallel
    )
    return layout, Topology(gpus_per_host, hosts_per_zone)


# --------------------------------------------------------------------------------------------
# Rank groups and tiers
# --------------------------------------------------------------------------------------------


def test_hand_worked_example():
    # 16 ranks: 2 zones x 2 hosts x 4 GPUs. Hosts are {0..3}, {4..7}, ...; zones {0..7}, {8..15}.
    layout = ParallelLayout(replicate=2, shard=8, expert=4, model_parallel=4)
    topo = Topology(gpus_per_host=4, hosts_per_zone=2)
    assert group_of(layout, "shard", 9) == tuple(range(8, 16))
    assert group_of(layout, "replicate", 9) == (1, 9)
    assert group_of(layout, "expert", 9) == (8, 9, 10, 11)
    assert group_of(layout, "model_parallel", 9) == (8, 9, 10, 11)
    assert group_of(layout, "sparse_replica", 9) == (1, 5, 9, 13)
    assert dim_tier(layout, topo, "shard") == "zone"
    assert dim_tier(layout, topo, "replicate") == "cross-zone"
    assert dim_tier(layout, topo, "expert") == "nvlink"
    assert dim_tier(layout, topo, "model_parallel") == "nvlink"
    assert dim_tier(layout, topo, "sparse_replica") == "cross-zone"
    assert layout.sparse_replica == 4 and layout.world_size == 16


@settings(max_examples=30, deadline=None)
@given(case=layouts_and_topologies())
def test_groups_and_tiers_match_reference(case):
    layout, topo = case
    world = layout.world_size
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # cross-zone model_parallel only warns
        validate_layout(layout, topo, world)
    for dim in DIM_NAMES:
        groups = rank_groups(layout, dim)
        assert sorted(groups) == reference_groups(layout, dim)
        assert all(len(g) == layout.size(dim) for g in groups)
        assert sorted(r for g in groups for r in g) == list(range(world))  # a partition
        assert dim_tier(layout, topo, dim) == reference_tier(
            groups, topo.gpus_per_host, topo.hosts_per_zone
        )
        for rank in range(world):
            assert rank in group_of(layout, dim, rank)
    shard_groups = [set(g) for g in rank_groups(layout, "shard")]
    for group in rank_groups(layout, "expert"):
        # nested in a shard group and on one host: expert traffic stays on NVLink
        assert any(set(group) <= s for s in shard_groups)
        assert len({r // topo.gpus_per_host for r in group}) == 1
    assert dim_tier(layout, topo, "expert") == "nvlink"


@settings(max_examples=20, deadline=None)
@given(case=layouts_and_topologies())
def test_describe_lists_every_dim_with_size_and_tier(case):
    layout, topo = case
    text = describe_layout(layout, topo)
    rows = {tuple(line.split()[:2]): line.split()[2:] for line in text.splitlines()[2:]}
    expected_views = {
        "replicate": "dense",
        "shard": "dense",
        "expert": "expert",
        "sparse_replica": "sparse",
        "model_parallel": "sparse",
    }
    assert len(rows) == len(DIM_NAMES)
    for dim, view in expected_views.items():
        size, stride, tier = rows[(view, dim)]
        groups = reference_groups(layout, dim)
        assert int(size) == len(groups[0])
        assert int(stride) == (groups[0][1] - groups[0][0] if len(groups[0]) > 1 else 1)
        assert tier == reference_tier(groups, topo.gpus_per_host, topo.hosts_per_zone)
    zones = layout.world_size // (topo.gpus_per_host * topo.hosts_per_zone)
    assert text.splitlines()[0].startswith(f"world {layout.world_size} = {zones} zone(s)")


def test_mesh_dims_records_groups():
    layout = ParallelLayout(replicate=2, shard=4, expert=2, model_parallel=2)
    dims = {d.name: d for d in mesh_dims(layout, Topology(4))}
    assert [d.view for d in mesh_dims(layout, Topology(4))] == [
        "dense",
        "dense",
        "expert",
        "sparse",
        "sparse",
    ]
    for name, d in dims.items():
        assert sorted(d.groups) == reference_groups(layout, name)
        assert d.tier in TIERS


def test_topology_tiers():
    topo = Topology(gpus_per_host=2, hosts_per_zone=3)
    assert topo.gpus_per_zone == 6
    assert topo.tier_of([4]) == "nvlink"
    assert topo.tier_of([4, 5]) == "nvlink"
    assert topo.tier_of([5, 6]) == "cross-zone"  # 5 is in zone 0, 6 in zone 1
    assert topo.tier_of([0, 5]) == "zone"
    assert topo.num_zones(12) == 2
    assert [topo.host_of(r) for r in (0, 1, 2, 11)] == [0, 0, 1, 5]
    assert [topo.zone_of(r) for r in (0, 5, 6, 11)] == [0, 0, 1, 1]


def test_default_topology():
    assert default_topology(8) == Topology(gpus_per_host=8, hosts_per_zone=1)
    assert default_topology(16, 8) == Topology(gpus_per_host=8, hosts_per_zone=2)
    with pytest.raises(ValueError, match=r"local_world_size \(3\) must divide"):
        default_topology(8, 3)
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        default_topology(0)


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["replicate", "shard", "expert", "model_parallel"])
@pytest.mark.parametrize("bad", [0, -2, 1.5, True])
def test_layout_rejects_non_positive_sizes(field, bad):
    with pytest.raises(ValueError, match=rf"layout\.{field} must be a positive int"):
        ParallelLayout(**{field: bad})


@pytest.mark.parametrize("field", ["gpus_per_host", "hosts_per_zone"])
@pytest.mark.parametrize("bad", [0, -1, 2.0])
def test_topology_rejects_non_positive_sizes(field, bad):
    kwargs = {"gpus_per_host": 8, "hosts_per_zone": 1, field: bad}
    with pytest.raises(ValueError, match=rf"topology\.{field} must be a positive int"):
        Topology(**kwargs)


def test_expert_must_divide_shard():
    with pytest.raises(ValueError, match=r"layout\.expert \(3\) must divide layout\.shard \(4\)"):
        ParallelLayout(replicate=2, shard=4, expert=3)


def test_model_parallel_must_divide_world():
    with pytest.raises(ValueError, match=r"layout\.model_parallel \(3\) must divide the world"):
        ParallelLayout(replicate=2, shard=4, model_parallel=3)


def test_replicate_times_shard_must_equal_world():
    layout = ParallelLayout(replicate=2, shard=2)
    with pytest.raises(ValueError, match=r"layout\.replicate \* layout\.shard .* must equal"):
        validate_layout(layout, Topology(8), 8)


def test_world_must_match_topology():
    layout = ParallelLayout(replicate=3, shard=4)
    with pytest.raises(ValueError, match=r"world size 12 does not match the topology"):
        validate_layout(layout, Topology(gpus_per_host=8), 12)
    with pytest.raises(ValueError, match=r"topology\.hosts_per_zone \(2\)"):
        validate_layout(layout, Topology(gpus_per_host=4, hosts_per_zone=2), 12)


def test_expert_must_fit_in_a_host():
    wide = ParallelLayout(replicate=1, shard=16, expert=16)
    with pytest.raises(ValueError, match=r"layout\.expert \(16\) must fit inside one host"):
        validate_layout(wide, Topology(gpus_per_host=8), 16)
    misaligned = ParallelLayout(replicate=2, shard=12, expert=6)  # ranks 6..11 straddle hosts
    with pytest.raises(ValueError, match=r"layout\.expert \(6\) must fit inside one host"):
        validate_layout(misaligned, Topology(gpus_per_host=8), 24)


def test_cross_zone_model_parallel_warns():
    layout = ParallelLayout(replicate=1, shard=8, model_parallel=8)
    with pytest.warns(UserWarning, match=r"layout\.model_parallel \(8\) spans more than one"):
        validate_layout(layout, Topology(gpus_per_host=2, hosts_per_zone=2), 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        validate_layout(layout, Topology(gpus_per_host=4, hosts_per_zone=2), 8)  # one zone


def test_validate_layout_rejects_wrong_types():
    with pytest.raises(TypeError, match="layout must be a ParallelLayout"):
        validate_layout((2, 4), Topology(8), 8)
    with pytest.raises(TypeError, match="topology must be a Topology"):
        validate_layout(ParallelLayout(2, 4), 8, 8)


def test_unknown_dim_and_bad_rank():
    layout = ParallelLayout(replicate=2, shard=2)
    with pytest.raises(ValueError, match="dim must be one of"):
        rank_groups(layout, "tensor")
    with pytest.raises(ValueError, match=r"rank must be an int in \[0, 4\)"):
        group_of(layout, "shard", 4)


def test_build_gem_mesh_needs_process_group_and_valid_device_type():
    layout = ParallelLayout()
    with pytest.raises(RuntimeError, match="init_process_group"):
        build_gem_mesh(layout)
    with pytest.raises(ValueError, match="device_type must be a device type without index"):
        build_gem_mesh(layout, device_type="cuda:0")


def test_describe_refuses_a_layout_that_validate_refuses():
    topo = Topology(gpus_per_host=8, hosts_per_zone=2)
    with pytest.raises(ValueError, match="layout.expert"):
        describe_layout(ParallelLayout(replicate=1, shard=16, expert=16), topo)
