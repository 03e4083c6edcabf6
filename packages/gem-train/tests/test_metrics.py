"""NE and AUC against references written out here (NE as He et al. define it, AUC as the
probability that a positive outranks a negative, ties counting half)."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch
from gem_train import auc, normalized_entropy
from gem_train.metrics import json_ready


def _pairwise_auc(scores: list[float], labels: list[int]) -> float:
    positives = [s for s, y in zip(scores, labels, strict=True) if y]
    negatives = [s for s, y in zip(scores, labels, strict=True) if not y]
    wins = sum(
        1.0 if p > n else 0.5 if p == n else 0.0 for p, n in itertools.product(positives, negatives)
    )
    return wins / (len(positives) * len(negatives))


def test_auc_counts_ties_half_whatever_the_order():
    """torchrec's AUC gave 0.8503 or 0.8309 for one set of tied scores in two orders."""
    generator = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 11, (300,), generator=generator).double() / 10
    labels = (torch.rand(300, generator=generator) < scores * 0.8 + 0.1).long()
    want = _pairwise_auc(scores.tolist(), labels.tolist())
    got = set()
    for _ in range(3):
        order = torch.randperm(300, generator=generator)
        got.add(auc(scores[order], labels[order]))
    assert len(got) == 1  # the same number in every order
    assert got.pop() == pytest.approx(want, abs=1e-6)  # torchmetrics sums in float32


def test_auc_edge_cases_and_bad_input():
    assert auc(torch.tensor([0.2, 0.9]), torch.tensor([1, 1])) == 0.5  # one class
    assert auc(torch.tensor([0.2, 0.9]), torch.tensor([0, 1])) == 1.0
    with pytest.raises(ValueError, match="1-D of one shape"):
        auc(torch.rand(100), torch.ones(150))
    with pytest.raises(ValueError, match="1-D of one shape"):
        auc(torch.rand(10, 2), torch.ones(10, 2))


def test_normalized_entropy_is_log_loss_over_the_base_rate_entropy():
    generator = torch.Generator().manual_seed(1)
    p = torch.rand(1000, generator=generator, dtype=torch.float64) * 0.98 + 0.01
    y = (torch.rand(1000, generator=generator, dtype=torch.float64) < p).double()
    log_loss = -(y * p.log() + (1 - y) * (1 - p).log()).mean()
    rate = y.mean()
    entropy = -(rate * rate.log() + (1 - rate) * (1 - rate).log())
    assert normalized_entropy(p, y) == pytest.approx(float(log_loss / entropy), rel=1e-9)


def test_normalized_entropy_of_one_class_is_undefined_and_written_as_null():
    """The base rate's entropy is 0: torchrec's formula gave 2.3e11 for an all-negative
    eval (a rare task on a small eval set)."""
    p = torch.tensor([0.1, 0.2, 0.3])
    assert math.isnan(normalized_entropy(p, torch.zeros(3)))
    assert math.isnan(normalized_entropy(p, torch.ones(3)))
    assert math.isnan(normalized_entropy(torch.zeros(0), torch.zeros(0)))
    record = {"ne_cvr": normalized_entropy(p, torch.zeros(3)), "rows": [math.inf, 1.0], "step": 3}
    line = json.dumps(json_ready(record), allow_nan=False)
    assert json.loads(line) == {"ne_cvr": None, "rows": [None, 1.0], "step": 3}
