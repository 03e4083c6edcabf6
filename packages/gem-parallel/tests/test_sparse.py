"""2D and fully sharded 2D torchrec embedding parallelism on real gloo processes.

Every rank rebuilds the same single-process reference (an unsharded EmbeddingBagCollection fed
all ranks' batches, updated by hand-written SGD / Adagrad) and compares the sharded run's loss
and full tables against it after every step.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from gem_parallel import ParallelLayout, build_gem_mesh, run_in_processes
from gem_parallel.sparse import (
    SparseMemory,
    format_memory_table,
    shard_sparse,
    sparse_memory_report,
)
from gem_parallel.testing import fresh_forkserver
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.device_mesh import DeviceMesh
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor

FEATURES = ("f0", "f1", "f2")
BATCH = 4  # samples per rank
SHARDING = {"t0": "table_wise", "t1": "row_wise", "t2": "column_wise"}
LR = 0.1
EPS = 1e-8


@pytest.fixture(scope="module", autouse=True)
def _fresh_forkserver():
    with fresh_forkserver():
        yield


def make_tables() -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=10, feature_names=["f0"]),
        EmbeddingBagConfig(name="t1", embedding_dim=8, num_embeddings=15, feature_names=["f1"]),
        EmbeddingBagConfig(name="t2", embedding_dim=16, num_embeddings=12, feature_names=["f2"]),
    ]


def make_ebc() -> EmbeddingBagCollection:
    torch.manual_seed(1234)
    ebc = EmbeddingBagCollection(tables=make_tables(), device=torch.device("cpu"))
    with torch.no_grad():  # torchrec's init is tiny; make lookups clearly non-zero
        for param in ebc.parameters():
            param.uniform_(-1.0, 1.0)
    return ebc


def make_batch(rank: int, step: int) -> tuple[KeyedJaggedTensor, torch.Tensor]:
    """Rank ``rank``'s batch at ``step``: ids (repeats included, some empty bags) and targets."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    tables = make_tables()
    lengths = torch.randint(0, 4, (len(FEATURES), BATCH), generator=gen)
    values = torch.cat(
        [
            torch.randint(0, t.num_embeddings, (int(lengths[i].sum()),), generator=gen)
            for i, t in enumerate(tables)
        ]
    )
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=list(FEATURES), values=values, lengths=lengths.reshape(-1)
    )
    target = torch.randn(BATCH, sum(t.embedding_dim for t in tables), generator=gen)
    return kjt, target


def rank_loss(pooled: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return 0.5 * ((pooled - target) ** 2).sum()


def full_tables(sharded, group) -> dict[str, torch.Tensor]:
    """Assemble every table from the local shards of ``group`` (each element held once)."""
    tables = {}
    for key, value in sharded.sharded_state_dict().items():
        assert isinstance(value, ShardedTensor), key
        full = torch.zeros(value.size())
        for shard in value.local_shards():
            (r0, c0), (rows, cols) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
            full[r0 : r0 + rows, c0 : c0 + cols] = shard.tensor
        dist.all_reduce(full, group=group)
        tables[key] = full
    return tables


def reference_run(world: int, groups: int, optimizer: str, steps: int, sync_every: int = 0):
    """Single process: yields (mean loss over ranks, [tables per copy]) after each step.

    ``sync_every == 0``: one copy trained with SGD / Adagrad (``optimizer``) on the mean of all
    ranks' losses. Otherwise 2D's semantics: each of ``groups`` replica groups (``world //
    groups`` consecutive ranks) updates its own copy on the mean of its ranks' losses, and every
    ``sync_every`` steps the copies' weights and Adagrad sums are averaged.
    """
    copies = [make_ebc() for _ in range(groups if sync_every else 1)]
    params = [dict(ebc.named_parameters()) for ebc in copies]
    sums = [{k: torch.zeros_like(p) for k, p in ps.items()} for ps in params]
    per_group = world // len(copies)
    for step in range(steps):
        losses = []
        for r in range(world):
            kjt, target = make_batch(r, step)
            losses.append(rank_loss(copies[r // per_group](kjt).values(), target))
        for c, ps in enumerate(params):
            copy_loss = sum(losses[c * per_group : (c + 1) * per_group]) / per_group
            grads = torch.autograd.grad(copy_loss, list(ps.values()), retain_graph=True)
            with torch.no_grad():
                for (k, p), g in zip(ps.items(), grads, strict=True):
                    if optimizer == "sgd":
                        p -= LR * g
                    else:
                        sums[c][k] += g**2
                        p -= LR * g / (sums[c][k].sqrt() + EPS)
        if sync_every and (step + 1) % sync_every == 0:
            with torch.no_grad():
                for k in params[0]:
                    mean_w = torch.stack([ps[k] for ps in params]).mean(0)
                    mean_s = torch.stack([ss[k] for ss in sums]).mean(0)
                    for ps, ss in zip(params, sums, strict=True):
                        ps[k].copy_(mean_w)
                        ss[k] = mean_s.clone()
        tables = [
            {f"embedding_bags.{k.split('.')[1]}.weight": p.detach().clone() for k, p in ps.items()}
            for ps in params
        ]
        yield (sum(losses) / world).detach(), tables


def _replica_contiguous_mesh(world: int, model_parallel: int) -> DeviceMesh:
    """Sparse mesh with the replica dim on contiguous ranks (model-parallel groups strided)."""
    replicas = world // model_parallel
    ranks = torch.arange(world).reshape(model_parallel, replicas).T
    return DeviceMesh("cpu", ranks, mesh_dim_names=("sparse_replica", "model_parallel"))


def _train_and_compare(
    rank: int,
    world: int,
    model_parallel: int,
    case: tuple[str, str, int],
    replica_contiguous: bool = False,
) -> None:
    mode, optimizer, sync_every = case
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if replica_contiguous:
            mesh = _replica_contiguous_mesh(world, model_parallel)
            table_group = mesh.get_group("model_parallel")
        else:
            mesh = build_gem_mesh(ParallelLayout(shard=world, model_parallel=model_parallel))
            table_group = mesh.model_parallel_group
    if mode == "1d":
        table_group = dist.group.WORLD
    opt_class = torch.optim.SGD if optimizer == "sgd" else torch.optim.Adagrad
    opt_kwargs = {"lr": LR} if optimizer == "sgd" else {"lr": LR, "eps": EPS}
    sharded = shard_sparse(
        make_ebc(),
        mesh,
        mode,
        optimizer=opt_class,
        optimizer_kwargs=opt_kwargs,
        sharding_types=SHARDING,
        sync_every=max(sync_every, 1),
    )
    steps = 2
    local = mode == "2d"  # replicas train their own copies between syncs
    reference = reference_run(
        world, world // model_parallel, optimizer, steps, sync_every if local else 0
    )
    for step in range(steps):
        kjt, target = make_batch(rank, step)
        out = sharded(kjt)
        assert out.keys() == list(FEATURES)
        loss = rank_loss(out.values(), target)
        loss.backward()
        sharded.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        if mode == "fully_sharded_2d":  # gloo: the copy engine is CUDA-only, fallback logged
            assert sharded.collective_choices["all_gather"].startswith("gloo")
        ref_loss, ref_copies = next(reference)
        torch.testing.assert_close(total / world, ref_loss, rtol=1e-5, atol=1e-5)
        ref_tables = ref_copies[rank // model_parallel if local else 0]
        tables = full_tables(sharded, table_group)
        assert tables.keys() == ref_tables.keys()
        for key, table in tables.items():
            torch.testing.assert_close(
                table,
                ref_tables[key],
                rtol=1e-5,
                atol=1e-5,
                msg=lambda m, k=key, st=step: f"{case} step {st} {k}: {m}",
            )
        if local and sync_every == 2 and step == 0:  # replicas really differ before a sync
            assert not torch.equal(
                ref_copies[0]["embedding_bags.t1.weight"], ref_copies[1]["embedding_bags.t1.weight"]
            )


CASES = (  # (mode, optimizer, sync_every)
    ("1d", "sgd", 1),
    ("2d", "sgd", 1),
    ("2d", "adagrad", 1),
    ("2d", "sgd", 2),
    ("fully_sharded_2d", "sgd", 1),
    ("fully_sharded_2d", "adagrad", 1),
)


def _train_worker(rank: int, world: int, model_parallel: int) -> None:
    for case in CASES:
        _train_and_compare(rank, world, model_parallel, case)


def test_training_matches_single_process_world4():
    """Tables sharded table-, row- and column-wise over model-parallel groups of 2, 2 replicas.

    1D and FS-2D equal single-process SGD / Adagrad; 2D equals it for SGD synced every step,
    and otherwise equals replicas training their own copies, averaged (weights and Adagrad
    state) at each sync."""
    run_in_processes(_train_worker, 4, 4, 2, timeout=240, preload=("torchrec",))


# --------------------------------------------------------------------------------------------
# Checkpoints across a changed mesh, and the memory report
# --------------------------------------------------------------------------------------------

PROBE_RANK = 99  # a batch no rank trains on; every rank looks it up


def _mesh(world: int, model_parallel: int):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build_gem_mesh(ParallelLayout(shard=world, model_parallel=model_parallel))


ADAGRAD = {"optimizer": torch.optim.Adagrad, "optimizer_kwargs": {"lr": LR, "eps": EPS}}


def full_optimizer_state(sharded, group) -> dict[str, torch.Tensor]:
    """Adagrad's per-element sum of every table, assembled like :func:`full_tables`. Fused
    1D / 2D list only the tables a rank holds, so iterate over all tables in a fixed order."""
    state = sharded.sharded_state_dict(include_optimizer=True)["optimizer"]
    assembled = {}
    for table in make_tables():
        full = torch.zeros(table.num_embeddings, table.embedding_dim)
        entry = state.get(f"embedding_bags.{table.name}.weight", {}).get(f"{table.name}.momentum1")
        for shard in entry.local_shards() if entry is not None else []:
            (r0, c0), (rows, cols) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
            full[r0 : r0 + rows, c0 : c0 + cols] = shard.tensor
        dist.all_reduce(full, group=group)
        assembled[table.name] = full
    return assembled


def _save_worker(rank: int, out_dir: str) -> None:
    mesh = _mesh(4, 2)
    for mode in ("2d", "fully_sharded_2d"):
        sharded = shard_sparse(make_ebc(), mesh, mode, sharding_types=SHARDING, **ADAGRAD)
        kjt, target = make_batch(rank, 0)
        rank_loss(sharded(kjt).values(), target).backward()
        sharded.step()  # so the checkpoint differs from the initial tables and state
        probe = sharded(make_batch(PROBE_RANK, 0)[0]).values().detach()
        states = full_optimizer_state(sharded, mesh.model_parallel_group)
        checkpoint = sharded.sharded_state_dict(include_optimizer=True)
        dcp.save(checkpoint, checkpoint_id=str(Path(out_dir, mode)))
        if rank == 0:
            assert all(state.abs().sum() > 0 for state in states.values())
            torch.save((probe, states), Path(out_dir, f"{mode}_expected.pt"))


def _load_worker(rank: int, out_dir: str) -> None:
    world = dist.get_world_size()
    # While 8 ranks are up: FS-2D over 4 contiguous replicas equals single-process Adagrad.
    _train_and_compare(rank, world, 2, ("fully_sharded_2d", "adagrad", 1), replica_contiguous=True)
    probe_kjt = make_batch(PROBE_RANK, 0)[0]
    for source in ("2d", "fully_sharded_2d"):
        expected_probe, expected_states = torch.load(Path(out_dir, f"{source}_expected.pt"))
        for mode, model_parallel in (("1d", world), ("2d", 4), ("fully_sharded_2d", 2)):
            fresh = make_ebc()
            with torch.no_grad():
                for param in fresh.parameters():
                    param.add_(3.0)  # the load has to overwrite every element
            mesh = _mesh(world, model_parallel)
            sharded = shard_sparse(fresh, mesh, mode, sharding_types=SHARDING, **ADAGRAD)
            state = sharded.sharded_state_dict(include_optimizer=True)
            dcp.load(state, checkpoint_id=str(Path(out_dir, source)))
            sharded.load_sharded_state_dict(state)
            got = sharded(probe_kjt).values().detach()
            what = f"{source}->{mode}"
            torch.testing.assert_close(got, expected_probe, msg=lambda m, w=what: f"{w}: {m}")
            # Read back through the live optimizer (FS-2D: re-gathered from the owned slices).
            group = dist.group.WORLD if mode == "1d" else mesh.model_parallel_group
            for table, value in full_optimizer_state(sharded, group).items():
                torch.testing.assert_close(
                    value, expected_states[table], msg=lambda m, w=what, t=table: f"{w} {t}: {m}"
                )


def test_dcp_checkpoint_saved_on_4_ranks_loads_on_8_in_every_layout(tmp_path):
    """2D and FS-2D checkpoints (weights and Adagrad state) written by 4 ranks (model-parallel
    2 x 2 replicas) load on 8 ranks as 1D, 2D (4 x 2) and FS-2D (2 x 4): identical lookups of a
    probe batch and identical optimizer state read back from the live optimizer. The 8 ranks
    also train FS-2D with 4 replicas on contiguous ranks against single-process Adagrad."""
    run_in_processes(_save_worker, 4, str(tmp_path), timeout=240, preload=("torchrec",))
    run_in_processes(_load_worker, 8, str(tmp_path), timeout=240, preload=("torchrec",))


def _memory_worker(rank: int, world: int, model_parallel: int, out_dir: str) -> None:
    mesh = _mesh(world, model_parallel)
    # A module on "meta" gets torchrec's per-shard init, broadcast so replicas agree.
    meta_ebc = EmbeddingBagCollection(tables=make_tables(), device=torch.device("meta"))
    sharded = shard_sparse(meta_ebc, mesh, "fully_sharded_2d", sharding_types=SHARDING)
    for key, table in full_tables(sharded, mesh.model_parallel_group).items():
        copies = [torch.empty_like(table) for _ in range(world // model_parallel)]
        dist.all_gather(copies, table, group=mesh.sparse_replica_group)
        assert table.abs().sum() > 0 and all(torch.equal(c, table) for c in copies), key
    rows = sparse_memory_report(
        make_ebc(),
        mesh,
        optimizer=torch.optim.Adagrad,
        optimizer_kwargs={"lr": LR},
        sharding_types=SHARDING,
    )
    if rank == 0:
        torch.save([r.__dict__ for r in rows], Path(out_dir, "memory.pt"))


def test_memory_report_shows_replica_fold_reduction(tmp_path):
    """Measured bytes against the table sizes; also: a meta module's replicas agree."""
    world, model_parallel = 4, 2
    replicas = world // model_parallel
    run_in_processes(
        _memory_worker,
        world,
        world,
        model_parallel,
        str(tmp_path),
        timeout=240,
        preload=("torchrec",),
    )
    rows = [SparseMemory(**r) for r in torch.load(Path(tmp_path, "memory.pt"))]
    by = {(r.mode, r.rank): r for r in rows}
    tables = make_tables()
    table_bytes = sum(t.num_embeddings * t.embedding_dim * 4 for t in tables)
    # Independent expectations: Adagrad keeps one float per weight.
    one_copy = sum(by["1d", r].weight_bytes for r in range(world))
    assert one_copy == table_bytes
    assert sum(by["2d", r].weight_bytes for r in range(world)) == replicas * table_bytes
    for r in range(world):
        for mode in ("1d", "2d"):
            assert by[mode, r].optimizer_bytes == by[mode, r].weight_bytes
        two_d, fs = by["2d", r], by["fully_sharded_2d", r]
        # Each local shard split in R slices (the last padded), plus Adagrad's step counters.
        assert fs.weight_bytes * replicas >= two_d.weight_bytes
        assert fs.weight_bytes * replicas - two_d.weight_bytes <= replicas * 4 * len(tables)
        assert abs(fs.optimizer_bytes - fs.weight_bytes) <= 4 * len(tables)
        assert two_d.transient_bytes == 0
        # Inside a step FS-2D gathers the 2D shard and materialises its dense gradient.
        assert fs.transient_bytes >= 2 * two_d.weight_bytes
    assert max(by["fully_sharded_2d", r].total_bytes for r in range(world)) * replicas <= (
        max(by["2d", r].total_bytes for r in range(world)) + 64
    )
    table = format_memory_table(rows)
    assert "fully_sharded_2d" in table and len(table.splitlines()) == world + 2


def test_bad_arguments_raise_clear_errors():
    ebc = make_ebc()
    with pytest.raises(ValueError, match="mode"):
        shard_sparse(ebc, None, "3d")
    with pytest.raises(ValueError, match="sync_every"):
        shard_sparse(ebc, None, "2d", sync_every=0)
    with pytest.raises(TypeError, match="GemMesh"):
        shard_sparse(ebc, None, "2d")
    with pytest.raises(TypeError, match="module"):
        shard_sparse("not a module", None, "1d")
    with pytest.raises(ValueError, match="EmbeddingBagCollection"):
        shard_sparse(torch.nn.Linear(2, 2), None, "1d")
    with pytest.raises(ValueError, match="sharding_types"):
        shard_sparse(ebc, None, "1d", sharding_types={"nope": "row_wise"})
    with pytest.raises(ValueError, match="sharding_types"):
        shard_sparse(ebc, None, "1d", sharding_types={"t0": "diagonal"})
    with pytest.raises(TypeError, match="optimizer"):
        shard_sparse(ebc, None, "1d", optimizer="sgd")
    with pytest.raises(ValueError, match="collectives"):
        shard_sparse(ebc, None, "1d", collectives="carrier pigeon")
    with pytest.raises(ValueError, match="element-wise"):
        shard_sparse(ebc, object(), "fully_sharded_2d", optimizer=torch.optim.LBFGS)
