"""Typed configuration of the GEM model."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["GemArchitecture", "GemModelConfig"]

_SELF_ATTENTION_KINDS = ("jagged_flash", "block")
ATTENTION_DTYPES = ("auto", "float32", "bfloat16", "float16")
"""Values of ``GemArchitecture.attention_dtype`` ("auto" or names of torch dtypes)."""
_EXPERT_KINDS = ("attention", "mlp", "cross", "dot")
POSITION_SIGNALS = ("none", "rope", "rel_pos_bias")
"""Values of ``GemArchitecture.position``."""
FFN_KINDS = ("gelu", "swiglu")
"""Values of ``GemArchitecture.ffn``."""
SEQUENCE_ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "gelu_fast", "relu2", "identity")
"""Values of ``GemArchitecture.sequence_activation``: gem-kernels' GDPA activations, named here
so that a config is checked without importing torch (a test keeps the two lists equal)."""


@dataclass(frozen=True)
class GemArchitecture:
    """The model's own choices: widths, depths and which attention and experts it uses."""

    embedding_dim: int = 32
    """Width of every embedding table and of every token (d_model)."""
    num_heads: int = 2
    """Attention heads in the sequence tower (embedding_dim must divide evenly)."""
    num_sequence_layers: int = 1
    """Self-attention layers over the history."""
    self_attention: str = "jagged_flash"
    """'jagged_flash' (causal softmax attention, windowed by ``attention_window``) or 'block'
    (full attention inside 64-token blocks, RoPE fused into the kernel)."""
    attention_window: int = 0
    """'jagged_flash': each event attends to itself and the ``attention_window`` events before
    it (JFA ``window=(w, 0)`` with causal); 0 attends to the whole history before it."""
    position: str = "none"
    """Position signal of the self-attention: 'rope' (rotary q and k by the event's index in
    its history), 'rel_pos_bias' (a learned per-head bias per causal distance, inside JFA) or
    'none'. Every event token also carries the learned recency embedding (its distance from
    the end of the history), which the pooling and cross-attention read. 'block' attention
    always applies RoPE in its kernel and needs 'rope'."""
    ffn: str = "gelu"
    """Feed-forward of the sequence layers: 'gelu' (d -> 4d -> d) or 'swiglu' (d -> 8d/3 -> d,
    gated)."""
    history_cross: bool = False
    """GEM's user x ad cross-attention: every history event attends over the sample's
    non-sequence feature tokens (ad, pooled sparse features, dense projection) through GDPA
    cross (long jagged queries, short keys and values)."""
    target_attention: bool = True
    """The candidate ad's query attends over the history (GDPA, one query per sample)."""
    pma_queries: int = 4
    """Learned queries of the PMA pooling that compresses the history into this many tokens."""
    sequence_activation: str = "silu"
    """Element-wise activation of the GDPA used by PMA and cross-attention."""
    dhen_layers: int = 2
    """Stacked DHEN interaction layers over the feature tokens."""
    dhen_experts: tuple[str, ...] = ("attention", "mlp", "cross")
    """Experts of every DHEN layer, drawn from 'attention' (self-attention over the feature
    tokens), 'mlp', 'cross' (DCN-v2, low rank) and 'dot' (pairwise dot products of the tokens,
    FM-style); their outputs are summed (so they can be split across ranks)."""
    expert_hidden_dim: int = 128
    """Hidden width of the MLP expert and of the task heads."""
    dropout: float = 0.0
    """Dropout in the DHEN layers and heads."""
    attention_dtype: str = "auto"
    """Dtype of q, k and v handed to the attention kernels (self-attention, PMA, cross):
    'bfloat16' (or 'float16') selects gem-kernels' Triton kernels on CUDA (fp32 accumulation
    inside); 'float32' runs their PyTorch reference, which reads lengths back to the host and
    pads, so a GPU step becomes host-bound; 'auto' is bfloat16 for CUDA tensors and the
    residual stream's own dtype elsewhere. Outputs are cast back to the residual stream's
    dtype, so the rest of the model keeps its precision."""

    def __post_init__(self) -> None:
        if self.embedding_dim <= 0 or self.num_heads <= 0 or self.embedding_dim % self.num_heads:
            raise ValueError(
                f"embedding_dim must be a positive multiple of num_heads ({self.num_heads}), "
                f"got {self.embedding_dim}"
            )
        if self.sequence_activation not in SEQUENCE_ACTIVATIONS:
            raise ValueError(
                f"sequence_activation must be one of {SEQUENCE_ACTIVATIONS}, "
                f"got {self.sequence_activation!r}"
            )
        if self.self_attention not in _SELF_ATTENTION_KINDS:
            raise ValueError(
                f"self_attention must be one of {_SELF_ATTENTION_KINDS}, got {self.self_attention!r}"
            )
        unknown = [e for e in self.dhen_experts if e not in _EXPERT_KINDS]
        if unknown or not self.dhen_experts:
            raise ValueError(
                f"dhen_experts must be a non-empty tuple drawn from {_EXPERT_KINDS}, "
                f"got {self.dhen_experts}"
            )
        for name in ("num_sequence_layers", "dhen_layers"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("pma_queries", "expert_hidden_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.position not in POSITION_SIGNALS:
            raise ValueError(f"position must be one of {POSITION_SIGNALS}, got {self.position!r}")
        if self.ffn not in FFN_KINDS:
            raise ValueError(f"ffn must be one of {FFN_KINDS}, got {self.ffn!r}")
        window = self.attention_window
        if isinstance(window, bool) or not isinstance(window, int) or window < 0:
            raise ValueError(f"attention_window must be an int >= 0, got {window!r}")
        if self.self_attention == "block" and window:
            raise ValueError(
                "attention_window applies to self_attention='jagged_flash'; 'block' attends "
                f"within 64-token blocks (got attention_window={window})"
            )
        if self.self_attention == "block" and self.position != "rope":
            raise ValueError(
                "self_attention='block' applies RoPE inside its kernel: set position='rope' "
                f"(got {self.position!r})"
            )
        if self.attention_dtype not in ATTENTION_DTYPES:
            raise ValueError(
                f"attention_dtype must be one of {ATTENTION_DTYPES}, got {self.attention_dtype!r}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")


@dataclass(frozen=True)
class GemModelConfig:
    """The GEM model: the data's features plus a ``GemArchitecture``.

    Feature names and cardinalities usually come from the dataset description
    (``gem_data.DatasetInfo``).
    """

    sequence_features: dict[str, int]
    """Per-token history features (name -> number of ids). Their embeddings are summed into one token."""
    sparse_features: dict[str, int]
    """Non-sequence sparse features (name -> number of ids), each pooled into one feature token."""
    num_dense_features: int
    """Width of the dense feature vector, projected into one feature token."""
    max_seq_len: int
    """Longest history the model accepts; sizes the recency embedding."""
    candidate_feature: str = "ad_category_id"
    """Sparse feature whose embedding is the query of the candidate-to-history cross-attention."""
    candidate_history_feature: str = "hist_category_ids"
    """Sequence feature sharing its embedding table with ``candidate_feature`` (same id space),
    so the cross-attention compares the ad and the history in one embedding space."""
    tasks: tuple[str, ...] = ("ctr", "cvr")
    """One logit per task, in this order."""
    task_base_rates: tuple[float, ...] | None = None
    """Positive rate of each task in the training data; starts each head at that rate's log-odds
    instead of 0.5, so early steps learn features instead of the bias."""
    use_sequence_tower: bool = True
    """False removes the history entirely (the no-sequence reference model)."""
    architecture: GemArchitecture = field(default_factory=GemArchitecture)
    """Widths, depths, attention kinds and experts."""

    def __post_init__(self) -> None:
        for kind in ("sequence_features", "sparse_features"):
            for name, cardinality in getattr(self, kind).items():
                if not _is_int(cardinality) or cardinality < 1:
                    raise ValueError(
                        f"{kind}[{name!r}] must be an int number of ids >= 1, got {cardinality!r}"
                    )
        if self.candidate_feature not in self.sparse_features:
            raise ValueError(
                f"candidate_feature {self.candidate_feature!r} is not in sparse_features "
                f"{sorted(self.sparse_features)}"
            )
        if self.use_sequence_tower:
            if not self.sequence_features:
                raise ValueError("sequence_features must not be empty when use_sequence_tower=True")
            if self.candidate_history_feature not in self.sequence_features:
                raise ValueError(
                    f"candidate_history_feature {self.candidate_history_feature!r} is not in "
                    f"sequence_features {sorted(self.sequence_features)}"
                )
            # The candidate looks its ids up in the history feature's table.
            candidate = self.sparse_features[self.candidate_feature]
            history = self.sequence_features[self.candidate_history_feature]
            if candidate != history:
                raise ValueError(
                    f"sparse_features[{self.candidate_feature!r}] ({candidate} ids) must equal "
                    f"sequence_features[{self.candidate_history_feature!r}] ({history} ids): "
                    "the candidate shares that table"
                )
        if not _is_int(self.max_seq_len) or self.max_seq_len <= 0:
            raise ValueError(f"max_seq_len must be a positive int, got {self.max_seq_len!r}")
        if not _is_int(self.num_dense_features) or self.num_dense_features < 0:
            raise ValueError(
                f"num_dense_features must be an int >= 0, got {self.num_dense_features!r}"
            )
        if not self.tasks:
            raise ValueError("tasks must name at least one task")
        if len(set(self.tasks)) != len(self.tasks):
            raise ValueError(f"tasks must be distinct names, got {self.tasks}")
        if self.task_base_rates is not None and (
            len(self.task_base_rates) != len(self.tasks)
            or not all(0.0 < rate < 1.0 for rate in self.task_base_rates)
        ):
            raise ValueError(
                f"task_base_rates must hold one rate in (0, 1) per task {self.tasks}, "
                f"got {self.task_base_rates}"
            )


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
