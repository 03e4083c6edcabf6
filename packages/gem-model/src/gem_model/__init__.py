"""gem-model: the GEM recommendation model (torchrec embeddings, jagged sequence tower, DHEN, CTR/CVR heads).

Names are imported lazily: the architecture config (``GemArchitecture``, ``GemModelConfig``)
needs nothing but the standard library, so recipes and command lines can use it without
importing torch and torchrec; the modules bring them in on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gem_model.config import GemArchitecture, GemModelConfig
    from gem_model.dhen import (
        AttentionExpert,
        CrossExpert,
        DHENLayer,
        DotProductExpert,
        MLPExpert,
    )
    from gem_model.flops import ModelFlops, model_flops
    from gem_model.model import REGION_SCOPE_PREFIX, GemInputs, GemModel
    from gem_model.sequence import (
        AttentionPrecision,
        CandidateCrossAttention,
        HistoryFeatureCrossAttention,
        JaggedSelfAttentionLayer,
        PoolingByMultiheadAttention,
    )

_EXPORTS = {
    "GemModel": "gem_model.model",
    "GemInputs": "gem_model.model",
    "REGION_SCOPE_PREFIX": "gem_model.model",
    "ModelFlops": "gem_model.flops",
    "model_flops": "gem_model.flops",
    "GemModelConfig": "gem_model.config",
    "GemArchitecture": "gem_model.config",
    "DHENLayer": "gem_model.dhen",
    "AttentionExpert": "gem_model.dhen",
    "MLPExpert": "gem_model.dhen",
    "CrossExpert": "gem_model.dhen",
    "DotProductExpert": "gem_model.dhen",
    "AttentionPrecision": "gem_model.sequence",
    "HistoryFeatureCrossAttention": "gem_model.sequence",
    "JaggedSelfAttentionLayer": "gem_model.sequence",
    "PoolingByMultiheadAttention": "gem_model.sequence",
    "CandidateCrossAttention": "gem_model.sequence",
}

__all__ = [
    "GemModel",
    "GemInputs",
    "REGION_SCOPE_PREFIX",
    "ModelFlops",
    "model_flops",
    "GemModelConfig",
    "GemArchitecture",
    "DHENLayer",
    "AttentionExpert",
    "MLPExpert",
    "CrossExpert",
    "DotProductExpert",
    "AttentionPrecision",
    "HistoryFeatureCrossAttention",
    "JaggedSelfAttentionLayer",
    "PoolingByMultiheadAttention",
    "CandidateCrossAttention",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'gem_model' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
