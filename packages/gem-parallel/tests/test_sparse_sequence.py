"""2D and fully sharded 2D for torchrec ``EmbeddingCollection`` (sequence embeddings, as the GEM
model's history tables), next to an ``EmbeddingBagCollection``, on real gloo processes.

Every rank rebuilds the same single-process reference (the unsharded module fed all ranks'
batches, updated by hand-written SGD / Adagrad) and compares the sharded run's loss and full
tables against it after every step; a DCP checkpoint of the fully sharded run (weights and
Adagrad state) loads back exactly into a fresh one.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from gem_parallel import ParallelLayout, build_gem_mesh, run_in_processes
from gem_parallel.sparse import shard_sparse
from gem_parallel.testing import fresh_forkserver
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    KeyedJaggedTensor,
    PoolingType,
)
from torchrec.optim import RowWiseAdagrad

BAG_FEATURES = ("b0", "b1")
# "c0" shares table s0 with the history feature "h0", like the GEM model's candidate.
SEQ_FEATURES = ("h0", "c0", "h1", "h2")
BATCH = 3  # samples per rank
DIM = 4
SHARDING = {
    "t0": "row_wise",
    "t1": "table_wise",
    "s0": "table_wise",
    "s1": "row_wise",
    "s2": "column_wise",
}
# Row-wise Adagrad averages g**2 over a shard's columns, so a column-wise shard differs from
# the unsharded table: those cases shard every table by rows or whole.
SHARDING_ROWWISE = {**SHARDING, "s2": "table_wise"}
LR = 0.1
EPS = 1e-8


@pytest.fixture(scope="module", autouse=True)
def _fresh_forkserver():
    with fresh_forkserver():
        yield


def seq_tables() -> list[EmbeddingConfig]:
    return [
        EmbeddingConfig(
            name="s0", embedding_dim=DIM, num_embeddings=11, feature_names=["h0", "c0"]
        ),
        EmbeddingConfig(name="s1", embedding_dim=DIM, num_embeddings=10, feature_names=["h1"]),
        EmbeddingConfig(name="s2", embedding_dim=DIM, num_embeddings=7, feature_names=["h2"]),
    ]


def bag_tables() -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(name="t0", embedding_dim=DIM, num_embeddings=10, feature_names=["b0"]),
        EmbeddingBagConfig(
            name="t1",
            embedding_dim=DIM,
            num_embeddings=6,
            feature_names=["b1"],
            pooling=PoolingType.MEAN,
        ),
    ]


class Towers(nn.Module):
    """A pooled table and three sequence tables; returns the pooled embeddings and every
    sequence feature's per-id embeddings (jagged values)."""

    def __init__(self, device: torch.device | None = None) -> None:
        super().__init__()
        self.bags = EmbeddingBagCollection(tables=bag_tables(), device=device)
        self.sequences = EmbeddingCollection(tables=seq_tables(), device=device)

    def forward(
        self, bag_ids: KeyedJaggedTensor, seq_ids: KeyedJaggedTensor
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        pooled = self.bags(bag_ids).values()
        embedded = self.sequences(seq_ids)
        return pooled, [embedded[name].values() for name in SEQ_FEATURES]


def make_towers() -> Towers:
    torch.manual_seed(4321)
    towers = Towers(torch.device("cpu"))
    with torch.no_grad():
        for param in towers.parameters():
            param.uniform_(-1.0, 1.0)
    return towers


def make_batch(rank: int, step: int):
    """Rank ``rank``'s ids (repeats and empty histories included) and targets at ``step``."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    bag_lengths = torch.randint(0, 4, (2, BATCH), generator=gen)
    bag_ids = KeyedJaggedTensor.from_lengths_sync(
        keys=list(BAG_FEATURES),
        values=torch.cat(
            [
                torch.randint(0, 10, (int(bag_lengths[0].sum()),), generator=gen),
                torch.randint(0, 6, (int(bag_lengths[1].sum()),), generator=gen),
            ]
        ),
        lengths=bag_lengths.reshape(-1),
    )
    rows = {"h0": 11, "c0": 11, "h1": 10, "h2": 7}
    history = torch.randint(0, 5, (BATCH,), generator=gen)
    lengths = {"h0": history, "c0": torch.ones(BATCH, dtype=torch.long), "h1": history}
    lengths["h2"] = torch.randint(0, 3, (BATCH,), generator=gen)
    values = [
        torch.randint(0, rows[f], (int(lengths[f].sum()),), generator=gen) for f in SEQ_FEATURES
    ]
    seq_ids = KeyedJaggedTensor.from_lengths_sync(
        keys=list(SEQ_FEATURES),
        values=torch.cat(values),
        lengths=torch.cat([lengths[f] for f in SEQ_FEATURES]),
    )
    pooled_target = torch.randn(BATCH, 2 * DIM, generator=gen)
    seq_targets = [torch.randn(len(v), DIM, generator=gen) for v in values]
    return bag_ids, seq_ids, pooled_target, seq_targets


def rank_loss(outputs, pooled_target, seq_targets) -> torch.Tensor:
    pooled, sequences = outputs
    loss = 0.5 * ((pooled - pooled_target) ** 2).sum()
    for got, want in zip(sequences, seq_targets, strict=True):
        loss = loss + 0.5 * ((got - want) ** 2).sum()
    return loss


def reference_run(world: int, groups: int, optimizer: str, steps: int, sync_every: int):
    """Single process: yields (mean loss over ranks, [tables per copy]) after each step.

    ``sync_every == 0``: one copy trained on the mean of all ranks' losses. Otherwise 2D's
    semantics: each of ``groups`` replica groups (``world // groups`` consecutive ranks)
    trains its own copy on its ranks' mean loss, and every ``sync_every`` steps the copies'
    weights and Adagrad sums are averaged."""
    copies = [make_towers() for _ in range(groups if sync_every else 1)]
    params = [dict(towers.named_parameters()) for towers in copies]
    sums = [
        {k: torch.zeros(p.shape[:1] if optimizer == "rowwise" else p.shape) for k, p in ps.items()}
        for ps in params
    ]
    per_group = world // len(copies)
    for step in range(steps):
        losses = []
        for r in range(world):
            bag_ids, seq_ids, pooled_target, seq_targets = make_batch(r, step)
            outputs = copies[r // per_group](bag_ids, seq_ids)
            losses.append(rank_loss(outputs, pooled_target, seq_targets))
        for c, ps in enumerate(params):
            copy_loss = sum(losses[c * per_group : (c + 1) * per_group]) / per_group
            grads = torch.autograd.grad(copy_loss, list(ps.values()), retain_graph=True)
            with torch.no_grad():
                for (k, p), g in zip(ps.items(), grads, strict=True):
                    if optimizer == "sgd":
                        p -= LR * g
                    elif optimizer == "rowwise":  # fbgemm's exact row-wise Adagrad
                        sums[c][k] += (g**2).mean(1)
                        p -= LR * g / (sums[c][k].sqrt().unsqueeze(1) + EPS)
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
        tables = [{k: p.detach().clone() for k, p in ps.items()} for ps in params]
        yield (sum(losses) / world).detach(), tables


def full_tables(state: dict, group) -> dict[str, torch.Tensor]:
    """Assemble every ``ShardedTensor`` of ``state`` from ``group``'s local shards."""
    tables = {}
    for key, value in state.items():
        if not isinstance(value, ShardedTensor):
            continue
        full = torch.zeros(value.size())
        for shard in value.local_shards():
            offsets, sizes = shard.metadata.shard_offsets, shard.metadata.shard_sizes
            index = tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))
            full[index] = shard.tensor
        dist.all_reduce(full, group=group)
        tables[key] = full
    return tables


def _mesh(world: int, model_parallel: int):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build_gem_mesh(ParallelLayout(shard=world, model_parallel=model_parallel))


def _optimizer(name: str) -> dict:
    if name == "sgd":
        return {"optimizer": torch.optim.SGD, "optimizer_kwargs": {"lr": LR}}
    if name == "rowwise":
        return {"optimizer": RowWiseAdagrad, "optimizer_kwargs": {"lr": LR, "eps": EPS}}
    return {"optimizer": torch.optim.Adagrad, "optimizer_kwargs": {"lr": LR, "eps": EPS}}


def _train_and_compare(rank: int, world: int, model_parallel: int, case, out_dir: str) -> None:
    mode, optimizer, sync_every = case
    mesh = _mesh(world, model_parallel)
    group = dist.group.WORLD if mode == "1d" else mesh.model_parallel_group
    sharding = SHARDING_ROWWISE if optimizer == "rowwise" else SHARDING
    sharded = shard_sparse(
        make_towers(),
        mesh,
        mode,
        sharding_types=sharding,
        sync_every=max(sync_every, 1),
        **_optimizer(optimizer),
    )
    local = mode == "2d"
    steps = 2
    reference = reference_run(
        world, world // model_parallel, optimizer, steps, sync_every if local else 0
    )
    for step in range(steps):
        bag_ids, seq_ids, pooled_target, seq_targets = make_batch(rank, step)
        loss = rank_loss(sharded(bag_ids, seq_ids), pooled_target, seq_targets)
        loss.backward()
        sharded.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        ref_loss, ref_copies = next(reference)
        torch.testing.assert_close(total / world, ref_loss, rtol=1e-5, atol=1e-5)
        ref_tables = ref_copies[rank // model_parallel if local else 0]
        tables = full_tables(sharded.sharded_state_dict(), group)
        assert tables.keys() == ref_tables.keys()
        for key, table in tables.items():
            torch.testing.assert_close(
                table,
                ref_tables[key],
                rtol=1e-5,
                atol=1e-5,
                msg=lambda m, k=key, st=step: f"{case} step {st} {k}: {m}",
            )
    if mode != "fully_sharded_2d" or optimizer != "rowwise":
        return
    # DCP round trip of weights and Adagrad state into a fresh fully sharded module: the next
    # step must repeat exactly what the trained module does.
    checkpoint = str(Path(out_dir, "fs2d"))
    dcp.save(sharded.sharded_state_dict(include_optimizer=True), checkpoint_id=checkpoint)
    fresh = make_towers()
    with torch.no_grad():
        for param in fresh.parameters():
            param.add_(3.0)  # the load has to overwrite every element
    restored = shard_sparse(fresh, mesh, mode, sharding_types=sharding, **_optimizer(optimizer))
    state = restored.sharded_state_dict(include_optimizer=True)
    dcp.load(state, checkpoint_id=checkpoint)
    restored.load_sharded_state_dict(state)
    bag_ids, seq_ids, pooled_target, seq_targets = make_batch(rank, steps)
    for module in (sharded, restored):
        rank_loss(module(bag_ids, seq_ids), pooled_target, seq_targets).backward()
        module.step()
    want = full_tables(sharded.sharded_state_dict(), group)
    got = full_tables(restored.sharded_state_dict(), group)
    for key, table in want.items():
        torch.testing.assert_close(got[key], table, rtol=0, atol=0)


CASES = (  # (mode, optimizer, sync_every); 1D checks the row-wise reference against fbgemm
    ("1d", "rowwise", 1),
    ("2d", "adagrad", 2),
    ("fully_sharded_2d", "adagrad", 1),
    ("fully_sharded_2d", "rowwise", 1),
)


def _worker(rank: int, world: int, model_parallel: int, out_dir: str) -> None:
    for case in CASES:
        _train_and_compare(rank, world, model_parallel, case, out_dir)


def test_sequence_tables_train_like_single_process_world4(tmp_path):
    """An EmbeddingCollection (a table shared by two features; table-, row- and column-wise)
    beside an EmbeddingBagCollection, model-parallel groups of 2 x 2 replicas: 1D and FS-2D
    equal single-process Adagrad / row-wise Adagrad (FS-2D's own flat-slice implementation of
    it), 2D equals replicas training their own copies averaged at each sync; FS-2D's
    checkpoint (weights and row-wise state) resumes exactly."""
    run_in_processes(_worker, 4, 4, 2, str(tmp_path), timeout=240, preload=("torchrec",))
