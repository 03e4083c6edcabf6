"""build_gem_mesh on real gloo process groups in real (spawned) processes."""

from __future__ import annotations

import json
import os
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from gem_parallel import ParallelLayout, Topology, build_gem_mesh, group_of, run_in_processes

# --------------------------------------------------------------------------------------------
# Independent expectations (numpy reshape of arange(world), as DeviceMesh lays ranks out)
# --------------------------------------------------------------------------------------------


def expected_groups(layout: ParallelLayout, rank: int) -> dict[str, list[int]]:
    world = layout.replicate * layout.shard
    dense = np.arange(world).reshape(layout.replicate, layout.shard)
    sparse = np.arange(world).reshape(world // layout.model_parallel, layout.model_parallel)
    experts = np.arange(world).reshape(-1, layout.expert)
    r_dense, s_dense = np.argwhere(dense == rank)[0]
    r_sparse, s_sparse = np.argwhere(sparse == rank)[0]
    return {
        "shard": dense[r_dense, :].tolist(),
        "replicate": dense[:, s_dense].tolist(),
        "expert": experts[rank // layout.expert].tolist(),
        "model_parallel": sparse[r_sparse, :].tolist(),
        "sparse_replica": sparse[:, s_sparse].tolist(),
    }


# --------------------------------------------------------------------------------------------
# Workers (module level so spawned children can unpickle them)
# --------------------------------------------------------------------------------------------


def _mesh_worker(rank: int, cases, out_dir: str) -> None:
    world = dist.get_world_size()
    results = []
    for layout, topology in cases:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mesh = build_gem_mesh(layout, topology, device_type="cpu")
        expected = expected_groups(layout, rank)

        # The views are DeviceMesh objects with the documented dim names and rank grids.
        assert mesh.dense.mesh_dim_names == ("replicate", "shard")
        assert mesh.sparse.mesh_dim_names == ("sparse_replica", "model_parallel")
        assert mesh.expert.ndim == 1 and mesh.expert.mesh_dim_names == ("expert",)
        assert (
            mesh.dense.mesh.tolist()
            == np.arange(world).reshape(layout.replicate, layout.shard).tolist()
        )
        assert (
            mesh.sparse.mesh.tolist()
            == np.arange(world).reshape(layout.sparse_replica, layout.model_parallel).tolist()
        )
        assert mesh.expert.mesh.tolist() == expected["expert"]
        assert mesh.dense.get_local_rank("shard") == expected["shard"].index(rank)
        assert mesh.sparse.get_local_rank("model_parallel") == expected["model_parallel"].index(
            rank
        )

        groups = {
            "shard": mesh.dense_shard_group,
            "replicate": mesh.dense_replicate_group,
            "expert": mesh.expert_group,
            "model_parallel": mesh.model_parallel_group,
            "sparse_replica": mesh.sparse_replica_group,
        }
        observed = {}
        for dim, group in groups.items():
            ranks = dist.get_process_group_ranks(group)
            assert ranks == expected[dim], (dim, ranks, expected[dim])
            assert tuple(ranks) == group_of(layout, dim, rank)
            # The group really connects these ranks: sum and gather of global ranks.
            total = torch.tensor([rank], dtype=torch.int64)
            dist.all_reduce(total, group=group)
            gathered = [torch.zeros(1, dtype=torch.int64) for _ in ranks]
            dist.all_gather(gathered, torch.tensor([rank], dtype=torch.int64), group=group)
            assert total.item() == sum(expected[dim]), (dim, total.item())
            assert [int(t) for t in gathered] == expected[dim]
            observed[dim] = {"ranks": ranks, "sum": total.item()}
        results.append(observed)

    # Validation happens before any collective, so every rank raises the same error: no hang.
    try:
        build_gem_mesh(ParallelLayout(replicate=1, shard=2 * world))
    except ValueError as err:
        assert "must equal the world size" in str(err)
    else:
        raise AssertionError("build_gem_mesh accepted a layout larger than the world")

    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))


def _failing_worker(rank: int) -> None:
    if rank == 1:
        raise RuntimeError("deliberate failure on rank 1")
    dist.barrier()  # rank 0 waits for a peer that never arrives


def _exiting_worker(rank: int) -> None:
    dist.barrier()
    if rank == 0:
        os._exit(3)


def _hanging_worker(rank: int) -> None:
    if rank == 1:
        time.sleep(600)  # never joins the barrier and never fails
    dist.barrier()


# --------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------

CASES = {
    4: [
        # 2 hosts of 2 GPUs, one host per zone
        (ParallelLayout(replicate=2, shard=2, expert=2, model_parallel=2), Topology(2, 1)),
        # every dim spanning the whole world (torch reuses the default group for those)
        (ParallelLayout(replicate=1, shard=4, expert=4, model_parallel=4), Topology(4, 1)),
        # size-1 dims, default topology
        (ParallelLayout(replicate=4, shard=1, expert=1, model_parallel=1), None),
    ],
    8: [
        (ParallelLayout(replicate=2, shard=4, expert=2, model_parallel=4), Topology(4, 1)),
        (ParallelLayout(replicate=1, shard=8, expert=2, model_parallel=8), Topology(2, 2)),
    ],
}


@pytest.mark.parametrize("world_size", sorted(CASES))
def test_mesh_groups_connect_expected_ranks(world_size, tmp_path):
    cases = CASES[world_size]
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    run_in_processes(_mesh_worker, world_size, cases, str(out_dir), store_dir=tmp_path)

    # Every rank ran every case and saw the independently expected groups.
    for rank in range(world_size):
        results = json.loads((out_dir / f"rank{rank}.json").read_text())
        assert len(results) == len(cases)
        for (layout, _), observed in zip(cases, results, strict=True):
            for dim, ranks in expected_groups(layout, rank).items():
                assert observed[dim] == {"ranks": ranks, "sum": sum(ranks)}


def test_child_exception_fails_the_test():
    with pytest.raises(mp.ProcessRaisedException) as info:
        run_in_processes(_failing_worker, 2, timeout=60)
    message = str(info.value)
    # The root cause is reported first even when rank 0's barrier error reaches join() first.
    assert message.startswith("rank 1 failed first:")
    assert "deliberate failure on rank 1" in message.split("failed later")[0]


def test_child_exit_code_fails_the_test():
    with pytest.raises(mp.ProcessExitedException, match="exit code 3"):
        run_in_processes(_exiting_worker, 2, timeout=60)


def test_hanging_children_are_killed_after_timeout():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="still running after 3"):
        run_in_processes(_hanging_worker, 2, timeout=3)
    assert time.monotonic() - start < 30


def test_run_in_processes_rejects_bad_arguments():
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        run_in_processes(_exiting_worker, 0)
    with pytest.raises(ValueError, match="timeout must be positive"):
        run_in_processes(_exiting_worker, 2, timeout=0)
