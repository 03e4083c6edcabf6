"""Balancing jagged batches across ranks: cost models, Base Batch Shuffling, global rebalance.

A synchronous data-parallel step lasts as long as its slowest rank, and with jagged histories a
rank's work depends on the lengths it drew. Work is estimated by a pluggable *cost model*
(per-sample cost from the history length: self-attention is ``L**2``, embedding lookups ``L``).

* **Base Batch Shuffling (BBS)**, :func:`bbs_merge`: each rank reads a pool of sub-batches
  (``pool_batches`` batches' worth), sorts them by cost and deals them to the pool's batches in
  snake order (heaviest with lightest), so every batch of the pool costs about the pool's mean.
  No communication: a rank only sees its own data, and ranks differ only by how far their pool
  means are from the global mean (the spread shrinks with the pool size).
* **Global rebalance**, :func:`global_rebalance`: with every rank's sub-batches of a step in view
  (an all-gather per step), assign them to ranks, the same number each, to minimise the busiest
  rank: LPT (heaviest first onto the least loaded rank with room) plus improving swaps.
* :func:`simulate_balance` compares no balancing, BBS and global rebalance on a length
  distribution.

Numpy only (no torch).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "CostModel",
    "AffineCost",
    "linear_cost",
    "attention_cost",
    "sub_batch_costs",
    "bbs_merge",
    "global_rebalance",
    "max_over_mean",
    "BalanceSimulation",
    "simulate_balance",
]

#: Per-sample cost from history lengths: ``lengths`` (int64, any shape) -> float64, same shape.
CostModel = Callable[[np.ndarray], np.ndarray]


def linear_cost(lengths: np.ndarray) -> np.ndarray:
    """``L``: work linear in the tokens (embedding lookups, MLPs over tokens)."""
    return np.asarray(lengths, dtype=np.float64)


def attention_cost(lengths: np.ndarray) -> np.ndarray:
    """``L**2``: self-attention over the history (score and value GEMMs)."""
    lengths = np.asarray(lengths, dtype=np.float64)
    return lengths * lengths


@dataclass(frozen=True)
class AffineCost:
    """``per_sample + per_token * L + per_token_pair * L**2``, e.g. fitted to measured step times."""

    per_sample: float = 0.0
    """Cost of a sample regardless of its history (sparse lookups, the interaction stack)."""
    per_token: float = 0.0
    """Cost per history event (embeddings, projections, feed-forward layers)."""
    per_token_pair: float = 1.0
    """Cost per pair of history events (attention scores and values)."""

    def __post_init__(self) -> None:
        for name in ("per_sample", "per_token", "per_token_pair"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"AffineCost.{name} must be a finite number >= 0, got {value!r}")

    def __call__(self, lengths: np.ndarray) -> np.ndarray:
        lengths = np.asarray(lengths, dtype=np.float64)
        return self.per_sample + lengths * (self.per_token + self.per_token_pair * lengths)


def _costs_of(cost_model: CostModel, lengths: np.ndarray) -> np.ndarray:
    costs = np.asarray(cost_model(lengths), dtype=np.float64)
    if costs.shape != np.shape(lengths):
        raise ValueError(
            f"cost_model must return one cost per sample (shape {np.shape(lengths)}), "
            f"got shape {costs.shape}"
        )
    if costs.size and not (np.isfinite(costs).all() and costs.min() >= 0):
        raise ValueError("cost_model must return finite costs >= 0")
    return costs


def sub_batch_costs(
    lengths: np.ndarray, sub_batch_size: int, cost_model: CostModel = attention_cost
) -> np.ndarray:
    """Cost of each run of ``sub_batch_size`` consecutive samples (the last may be shorter)."""
    lengths = np.asarray(lengths)
    if lengths.ndim != 1:
        raise ValueError(f"lengths must be 1-D, got shape {lengths.shape}")
    if sub_batch_size < 1:
        raise ValueError(f"sub_batch_size must be >= 1, got {sub_batch_size}")
    costs = _costs_of(cost_model, lengths)
    if costs.size == 0:
        return costs
    return np.add.reduceat(costs, np.arange(0, costs.size, sub_batch_size))


def bbs_merge(costs: np.ndarray, sub_batches_per_batch: int) -> np.ndarray:
    """Base Batch Shuffling: deal a pool of sub-batches to batches, heaviest with lightest.

    Args:
        costs: (n,) cost of each sub-batch of the pool; ``n`` a multiple of
            ``sub_batches_per_batch``.
        sub_batches_per_batch: sub-batches merged into one batch (``m``).

    Returns:
        (n // m, m) int64 sub-batch indices of each batch. Sub-batches are sorted by cost
        (heaviest first, ties by index) and dealt in rounds of ``n // m``: forward in even
        rounds, backward in odd ones (snake order), so the batch that got the heaviest item of
        one round gets the lightest of the next. The spread between batch costs is at most
        ``max(costs) - min(costs)``.
    """
    costs = np.asarray(costs, dtype=np.float64)
    if costs.ndim != 1:
        raise ValueError(f"costs must be 1-D, got shape {costs.shape}")
    if sub_batches_per_batch < 1 or costs.size % sub_batches_per_batch:
        raise ValueError(
            f"the pool's {costs.size} sub-batches must be a multiple of "
            f"sub_batches_per_batch={sub_batches_per_batch} (>= 1)"
        )
    num_batches = costs.size // sub_batches_per_batch
    order = np.argsort(-costs, kind="stable")
    rounds = order.reshape(sub_batches_per_batch, num_batches).copy()
    rounds[1::2] = rounds[1::2, ::-1]
    return np.ascontiguousarray(rounds.T)


def global_rebalance(
    costs: np.ndarray, num_ranks: int, *, max_swaps: int | None = None
) -> np.ndarray:
    """Assign sub-batches to ranks, the same number each, minimising the busiest rank's cost.

    The reference that needs every rank's costs (one all-gather per step). LPT: sub-batches by
    decreasing cost, each onto the least loaded rank that still has room; then improving swaps:
    while one sub-batch of the busiest rank can be exchanged with one of another rank so that
    both end below the current maximum, do the exchange that balances the pair best (at most
    ``max_swaps`` times, default ``4 * num_ranks``). The result is a heuristic upper bound on
    the optimum; ``costs.sum() / num_ranks`` is a lower bound.

    Returns:
        (num_ranks, n // num_ranks) int64 sub-batch indices per rank.
    """
    costs = np.asarray(costs, dtype=np.float64)
    if costs.ndim != 1:
        raise ValueError(f"costs must be 1-D, got shape {costs.shape}")
    if num_ranks < 1 or costs.size % num_ranks:
        raise ValueError(
            f"the {costs.size} sub-batches must be a multiple of num_ranks={num_ranks} (>= 1)"
        )
    per_rank = costs.size // num_ranks
    assignment = np.empty((num_ranks, per_rank), dtype=np.int64)
    if per_rank == 0:
        return assignment
    heap = [(0.0, rank) for rank in range(num_ranks)]
    filled = np.zeros(num_ranks, dtype=np.int64)
    for index in np.argsort(-costs, kind="stable"):
        load, rank = heapq.heappop(heap)
        assignment[rank, filled[rank]] = index
        filled[rank] += 1
        if filled[rank] < per_rank:
            heapq.heappush(heap, (load + costs[index], rank))

    member_costs = costs[assignment]
    loads = member_costs.sum(axis=1)
    swaps = 4 * num_ranks if max_swaps is None else max_swaps
    for _ in range(swaps):
        busiest = int(np.argmax(loads))
        peak = loads[busiest]
        # delta[r, i, j]: cost moved off the busiest rank by swapping its item i with r's item j.
        delta = member_costs[busiest][None, :, None] - member_costs[:, None, :]
        new_peak = np.maximum(peak - delta, loads[:, None, None] + delta)
        new_peak[busiest] = np.inf
        new_peak[delta <= 0] = np.inf
        best = int(np.argmin(new_peak))
        if not new_peak.flat[best] < peak * (1 - 1e-12):
            break
        rank, i, j = np.unravel_index(best, new_peak.shape)
        moved = delta[rank, i, j]
        assignment[busiest, i], assignment[rank, j] = assignment[rank, j], assignment[busiest, i]
        member_costs[busiest, i], member_costs[rank, j] = (
            member_costs[rank, j],
            member_costs[busiest, i],
        )
        loads[busiest] -= moved
        loads[rank] += moved
    return assignment


def max_over_mean(loads: np.ndarray) -> float:
    """Busiest rank's load over the mean load (1.0 = perfectly balanced)."""
    loads = np.asarray(loads, dtype=np.float64)
    mean = loads.mean()
    return float(loads.max() / mean) if mean > 0 else 1.0


@dataclass
class BalanceSimulation:
    """Per-step max/mean rank cost of each strategy in :func:`simulate_balance`."""

    none: np.ndarray
    """(steps,) each rank merges its next sub-batches in stream order."""
    bbs: np.ndarray
    """(steps,) Base Batch Shuffling per rank (no communication)."""
    global_: np.ndarray
    """(steps,) :func:`global_rebalance` of all ranks' sub-batches of the step."""
    settings: dict[str, object] = field(default_factory=dict)
    """The simulation's arguments."""

    def summary(self) -> dict[str, float]:
        """Mean over steps of max/mean for ``none``, ``bbs``, ``global``, and the share of the
        ``none`` -> ``global`` gap that BBS removes (``bbs_gap_removed``; against the lower
        bound 1.0 in ``bbs_gap_removed_vs_bound``)."""
        none, bbs, best = (float(x.mean()) for x in (self.none, self.bbs, self.global_))
        return {
            "none": none,
            "bbs": bbs,
            "global": best,
            "bbs_gap_removed": (none - bbs) / (none - best) if none > best else float("nan"),
            "bbs_gap_removed_vs_bound": (none - bbs) / (none - 1.0) if none > 1 else float("nan"),
        }


def simulate_balance(
    sample_lengths: Callable[[int, np.random.Generator], np.ndarray],
    *,
    num_ranks: int,
    num_pools: int = 2,
    batch_size: int = 1024,
    sub_batch_size: int = 128,
    pool_batches: int = 32,
    cost_model: CostModel = attention_cost,
    balance_cost_model: CostModel | None = None,
    seed: int = 0,
    rebalance_globally: bool = True,
) -> BalanceSimulation:
    """Simulate per-rank step costs without balancing, with BBS and with a global rebalance.

    Each rank draws a stream of i.i.d. history lengths from ``sample_lengths(n, rng)`` (what a
    globally shuffled dataset gives), cut into sub-batches of ``sub_batch_size``. ``none``:
    a rank's batch is its next ``batch_size // sub_batch_size`` sub-batches; ``bbs``: each pool
    of ``pool_batches`` batches is merged by :func:`bbs_merge`; ``global``: every step, all
    ranks' sub-batches of the ``none`` schedule are re-assigned by :func:`global_rebalance`.
    Step time is assumed proportional to the rank's summed ``cost_model`` cost (compute-bound,
    no overlap); the step waits for the busiest rank. ``balance_cost_model`` (default
    ``cost_model``) is what BBS and the global rebalance sort by, to study a mismatched model.
    Simulates ``num_pools * pool_batches`` steps; ``rebalance_globally=False`` skips the
    (slowest) global reference and leaves ``global_`` NaN.
    """
    for name, value, minimum in (
        ("num_ranks", num_ranks, 1),
        ("num_pools", num_pools, 1),
        ("batch_size", batch_size, 1),
        ("sub_batch_size", sub_batch_size, 1),
        ("pool_batches", pool_batches, 1),
    ):
        if not isinstance(value, int) or value < minimum:
            raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    if batch_size % sub_batch_size:
        raise ValueError(
            f"batch_size ({batch_size}) must be a multiple of sub_batch_size ({sub_batch_size})"
        )
    balance_cost_model = balance_cost_model or cost_model
    per_batch = batch_size // sub_batch_size
    pool_sub_batches = pool_batches * per_batch
    steps = num_pools * pool_batches
    rng = np.random.default_rng(seed)
    none = np.empty((steps, num_ranks))
    bbs = np.empty((steps, num_ranks))
    best = np.full(steps, np.nan)
    for pool in range(num_pools):
        true_costs = np.empty((num_ranks, pool_sub_batches))
        sort_costs = np.empty((num_ranks, pool_sub_batches))
        for rank in range(num_ranks):
            lengths = np.asarray(sample_lengths(pool_batches * batch_size, rng))
            true_costs[rank] = sub_batch_costs(lengths, sub_batch_size, cost_model)
            sort_costs[rank] = sub_batch_costs(lengths, sub_batch_size, balance_cost_model)
            merged = bbs_merge(sort_costs[rank], per_batch)
            bbs[pool * pool_batches : (pool + 1) * pool_batches, rank] = true_costs[rank][
                merged
            ].sum(axis=1)
        steps_of_pool = slice(pool * pool_batches, (pool + 1) * pool_batches)
        none[steps_of_pool] = true_costs.reshape(num_ranks, pool_batches, per_batch).sum(-1).T
        for step in range(pool_batches if rebalance_globally else 0):
            window = slice(step * per_batch, (step + 1) * per_batch)
            assignment = global_rebalance(sort_costs[:, window].reshape(-1), num_ranks)
            loads = true_costs[:, window].reshape(-1)[assignment].sum(axis=1)
            best[pool * pool_batches + step] = max_over_mean(loads)
    ratio = lambda loads: loads.max(axis=1) / loads.mean(axis=1)  # noqa: E731
    return BalanceSimulation(
        none=ratio(none),
        bbs=ratio(bbs),
        global_=best,
        settings={
            "num_ranks": num_ranks,
            "num_pools": num_pools,
            "batch_size": batch_size,
            "sub_batch_size": sub_batch_size,
            "pool_batches": pool_batches,
            "seed": seed,
        },
    )
