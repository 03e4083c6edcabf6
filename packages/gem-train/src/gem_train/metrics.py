"""Evaluation metrics: normalized entropy (NE, torchrec's functions) and ROC AUC (torchmetrics',
whose curve steps once per distinct score, so tied scores count as sklearn counts them)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torchmetrics.functional.classification import binary_auroc
from torchrec.metrics.ne import compute_ne, get_ne_states

__all__ = ["normalized_entropy", "auc"]

_ETA = 1e-12


def _check(probabilities: torch.Tensor, labels: torch.Tensor) -> None:
    if probabilities.shape != labels.shape or probabilities.ndim != 1:
        raise ValueError(
            f"probabilities and labels must be 1-D of one shape, got {tuple(probabilities.shape)} "
            f"and {tuple(labels.shape)}"
        )


def _one_class(labels: torch.Tensor) -> bool:
    """Whether the labels hold one class only, or none: NE and AUC are undefined there."""
    return labels.numel() == 0 or bool(labels.min() == labels.max())


def normalized_entropy(probabilities: torch.Tensor, labels: torch.Tensor) -> float:
    """Log loss divided by the entropy of the base rate (1.0 = predicting the average; lower is better).

    NaN when the labels hold one class only (or none): the base rate's entropy is then 0 and
    NE undefined (torchrec's formula gives 1e11 to 1e12 there). Run files write it as null."""
    _check(probabilities, labels)
    if _one_class(labels):
        return math.nan
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
    """Area under the ROC curve, ties counted half (0.5 when one class is missing).

    torchrec's AUC integrated sample by sample, so with tied scores (bf16 probabilities tie by
    the thousand) it depended on the order of the samples, and so on the number of ranks."""
    _check(probabilities, labels)
    if _one_class(labels):
        return 0.5
    return float(binary_auroc(probabilities.double(), labels.long()))


def json_ready(value: Any) -> Any:
    """``value`` with every non-finite float (an undefined NE, say) replaced by ``None``, inside
    dicts and lists: run files are strict JSON (``null``, never ``NaN``)."""
    if isinstance(value, dict):
        return {key: json_ready(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [json_ready(item) for item in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
