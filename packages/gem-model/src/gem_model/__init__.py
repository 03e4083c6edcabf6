"""gem-model: the GEM recommendation model (torchrec embeddings, jagged sequence tower, DHEN, CTR/CVR heads)."""

from gem_model.config import GemArchitecture, GemModelConfig
from gem_model.dhen import AttentionExpert, CrossExpert, DHENLayer, DotProductExpert, MLPExpert
from gem_model.flops import ModelFlops, model_flops
from gem_model.model import REGION_SCOPE_PREFIX, GemInputs, GemModel
from gem_model.sequence import (
    AttentionPrecision,
    CandidateCrossAttention,
    HistoryFeatureCrossAttention,
    JaggedSelfAttentionLayer,
    PoolingByMultiheadAttention,
)

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
