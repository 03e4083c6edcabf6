"""Small GEM configs and random jagged inputs shared by the gem-model tests."""

import torch
from gem_model import GemArchitecture, GemModelConfig
from torchrec import KeyedJaggedTensor

SEQUENCE = {"hist_item_ids": 500, "hist_category_ids": 16, "hist_action_types": 3}
SPARSE = {"user_id": 1000, "user_segments": 20, "ad_id": 300, "ad_category_id": 16}
ARCHITECTURE_FIELDS = set(GemArchitecture.__dataclass_fields__)
# GEM v1's options at test scale (a short window, so it cuts into the test histories).
V1 = {
    "attention_window": 4,
    "position": "rope",
    "ffn": "swiglu",
    "history_cross": True,
    "dhen_experts": ("attention", "mlp", "cross", "dot"),
}


def make_config(*, dim=16, max_seq_len=70, **changes):
    """A small config; ``changes`` may name fields of either GemModelConfig or GemArchitecture."""
    architecture = {"embedding_dim": dim, "num_heads": 2, "pma_queries": 3, "expert_hidden_dim": 32}
    architecture.update({k: v for k, v in changes.items() if k in ARCHITECTURE_FIELDS})
    base = dict(
        sequence_features=SEQUENCE,
        sparse_features=SPARSE,
        num_dense_features=3,
        max_seq_len=max_seq_len,
        architecture=GemArchitecture(**architecture),
    )
    base.update({k: v for k, v in changes.items() if k not in ARCHITECTURE_FIELDS})
    return GemModelConfig(**base)


def make_inputs(lengths, generator):
    """History, sparse (multi-hot user segments) and dense inputs for histories of ``lengths``."""
    lengths = torch.tensor(lengths)
    batch, total = lengths.numel(), int(lengths.sum())
    sequence = KeyedJaggedTensor.from_lengths_sync(
        keys=list(SEQUENCE),
        values=torch.cat(
            [torch.randint(0, n, (total,), generator=generator) for n in SEQUENCE.values()]
        ),
        lengths=lengths.repeat(len(SEQUENCE)),
    )
    segment_lengths = torch.randint(0, 4, (batch,), generator=generator)
    sparse_lengths = {"user_segments": segment_lengths}
    values, all_lengths = [], []
    for name, cardinality in SPARSE.items():
        feature_lengths = sparse_lengths.get(name, torch.ones(batch, dtype=torch.long))
        values.append(
            torch.randint(0, cardinality, (int(feature_lengths.sum()),), generator=generator)
        )
        all_lengths.append(feature_lengths)
    sparse = KeyedJaggedTensor.from_lengths_sync(
        keys=list(SPARSE), values=torch.cat(values), lengths=torch.cat(all_lengths)
    )
    dense = torch.randn(batch, 3, generator=generator)
    return sequence, sparse, dense
