"""Evaluation metrics: normalized entropy (NE) and AUC, computed with torchrec's metric functions."""

from __future__ import annotations

import torch
from torchrec.metrics.auc import compute_auc
from torchrec.metrics.ne import compute_ne, get_ne_states

__all__ = ["normalized_entropy", "auc"]

_ETA = 1e-12


def normalized_entropy(probabilities: torch.Tensor, labels: torch.Tensor) -> float:
    """Log loss divided by the entropy of the base rate (1.0 = predicting the average; lower is better)."""
    if probabilities.shape != labels.shape or probabilities.ndim != 1:
        raise ValueError(
            f"probabilities and labels must be 1-D of one shape, got {tuple(probabilities.shape)} "
            f"and {tuple(labels.shape)}"
        )
    states = get_ne_states(
        labels.double(), probabilities.double(), torch.ones_like(labels, dtype=torch.double), _ETA
    )
    return float(
        compute_ne(
            states["cross_entropy_sum"],
            states["weighted_num_samples"],
            states["pos_labels"],
            states["neg_labels"],
            _ETA,
        )
    )


def auc(probabilities: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve (0.5 when one class is missing)."""
    weights = torch.ones_like(labels, dtype=torch.double)
    # torchrec takes (n_tasks, n_examples) tensors.
    as_rows = [t.double().view(1, -1) for t in (probabilities, labels, weights)]
    return float(compute_auc(1, *([row] for row in as_rows))[0])
