"""Model FLOPs of one GEM training step: the denominator of every MFU in this project.

``model_flops(config, lengths)`` counts one forward + backward of ``GemModel(config)`` on a
batch whose histories have ``lengths``; MFU is ``flops.total / (step_seconds * peak_flops)``.

Convention (model FLOPs, not the FLOPs a kernel happens to execute):

- Matmul FLOPs only: ``2 * M * N * K`` per GEMM. Embedding lookups and their sparse
  gradients, norms, activations (GELU, SwiGLU's gate, GDPA's), softmax, RoPE, the
  relative-position bias, biases, residual adds and the optimizer count 0.
- Dense GEMMs (every ``nn.Linear``, DHEN's dot-product ``bmm``): backward = 2x forward (input
  and weight gradients), so forward + backward = 3x forward. This holds even where the input
  needs no gradient (``dense_projection`` on the dense features, where autograd runs only the
  weight gradient): the count describes the model, not autograd's shortcuts.
- Attention (the score and value products ``Q K^T`` and ``P V``, over all heads, of the
  self-attention, PMA, both cross-attentions and DHEN's attention expert): forward =
  ``4 * d_model * pairs``, where ``pairs`` counts the visible (query, key) pairs over the
  batch from the real lengths (inside the causal mask, the window or the 64-token blocks;
  never a padded ``L^2``, never the kernels' partly masked tiles). Backward = 2.5x forward
  (flash-style: the scores are recomputed), so forward + backward = 3.5x forward.

Visible pairs of one history of length ``L``:

- causal, window ``w`` (0: the whole history before the query):
  ``sum_{i<L} (min(i, w) + 1) = m (m + 1) / 2 + (L - m) (w + 1)`` with ``m = min(L, w + 1)``
  (``m = L`` when ``w = 0``);
- block attention (full attention inside 64-token blocks, the last one partial):
  ``(L // 64) * 64^2 + (L % 64)^2``;
- PMA: ``pma_queries * L``; history cross: ``L * F`` (``F`` feature tokens: the pooled sparse
  features, the dense projection and the candidate); target attention: ``L``.

PMA's ``q_proj`` runs once per step on the learned queries, whatever the batch size.

The count is a few vectorised passes over ``lengths`` on the host (exact int64 sums, then
Python ints), cheap enough to call every step with the batch's lengths.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

from gem_model.config import GemArchitecture, GemModelConfig
from gem_model.sequence import swiglu_hidden_dim

__all__ = ["ModelFlops", "model_flops"]

DENSE_FWD_BWD = 3.0
"""Forward + backward of a dense GEMM, in forward FLOPs."""
ATTENTION_FWD_BWD = 3.5
"""Forward + backward of the attention score and value products, in forward FLOPs."""
BLOCK_SIZE = 64
"""Tokens per block of ``self_attention="block"`` (gem_kernels.block_attention's default)."""


@dataclass(frozen=True)
class ModelFlops:
    """FLOPs of one forward + backward, per region of the model (see the module docstring)."""

    embeddings: float
    """Always 0: lookups are not matmuls."""
    sequence_attention: float
    """Score and value products of the history self-attention layers."""
    sequence_dense: float
    """The self-attention layers' qkv, output and FFN projections."""
    pma: float
    """PMA pooling: its projections and its attention over the history."""
    cross: float
    """History x feature cross-attention and candidate (target) attention: projections and
    attention."""
    dhen: float
    """``dense_projection`` and the DHEN layers (their experts' GEMMs and attention)."""
    heads: float
    """The task heads."""
    forward: float
    """The forward pass alone, all regions together (dense and attention at 1x)."""

    @property
    def total(self) -> float:
        """Forward + backward of the whole model."""
        return self.as_dict()["total"]

    def __add__(self, other: ModelFlops) -> ModelFlops:
        """Region by region: the FLOPs of two steps (or batches) together."""
        return ModelFlops(**{f.name: getattr(self, f.name) + getattr(other, f.name)
                             for f in fields(self)})  # fmt: skip

    def as_dict(self) -> dict[str, float]:
        """The regions, then ``total``."""
        regions = {name: getattr(self, name) for name in _REGIONS}
        return {**regions, "total": sum(regions.values())}


_REGIONS = tuple(f.name for f in fields(ModelFlops) if f.name != "forward")


def model_flops(config: GemModelConfig, lengths: torch.Tensor | Sequence[int]) -> ModelFlops:
    """FLOPs of one forward + backward of ``GemModel(config)`` on a batch whose histories have
    ``lengths`` (1-D ints, one per sample: a tensor on any device, a numpy array or a
    sequence). A CUDA tensor is copied to the host (a sync): pass the host copy when there is
    one.

    Raises ``ValueError`` for lengths that are not 1-D, negative, or above
    ``config.max_seq_len``; ``TypeError`` for non-integer lengths or a config of another type.
    """
    if not isinstance(config, GemModelConfig):
        raise TypeError(f"config must be a GemModelConfig, got {type(config).__name__}")
    lengths = _as_lengths(lengths, config.max_seq_len)
    arch = config.architecture
    d = arch.embedding_dim
    hidden = arch.expert_hidden_dim
    batch = int(lengths.numel())

    num_pooled = len(config.sparse_features) - (1 if config.use_sequence_tower else 0)
    has_dense = 1 if config.num_dense_features else 0
    num_tokens = num_pooled + has_dense  # the DHEN tokens (GemModel.num_tokens)

    # Forward FLOPs, split into dense GEMMs and attention products, per region.
    dense = dict.fromkeys(_REGIONS, 0)
    attention = dict.fromkeys(_REGIONS, 0)
    dense["dhen"] += 2 * batch * config.num_dense_features * d  # dense_projection

    if config.use_sequence_tower:
        events = int(lengths.sum())  # history tokens of the whole batch
        queries = arch.pma_queries
        if arch.ffn == "gelu":
            ffn = 2 * d * 4 * d * 2
        else:
            swiglu = swiglu_hidden_dim(d)
            ffn = 2 * d * 2 * swiglu + 2 * swiglu * d
        layer = 2 * d * 3 * d + 2 * d * d + ffn  # per event: qkv, attn_out, ffn
        layers = arch.num_sequence_layers
        dense["sequence_dense"] = layers * events * layer
        attention["sequence_attention"] = layers * 4 * d * _self_attention_pairs(lengths, arch)

        if arch.history_cross:
            features = num_pooled + has_dense + 1  # keys: feature tokens and the candidate
            # q_proj and out over the history, kv_proj over the B x F feature tokens.
            dense["cross"] += 2 * d * d * (2 * events) + 2 * d * 2 * d * batch * features
            attention["cross"] += 4 * d * events * features
        # q_proj on the (batch independent) learned queries, kv_proj over the history, out.
        dense["pma"] = 2 * d * d * queries + 2 * d * 2 * d * events + 2 * d * d * batch * queries
        attention["pma"] = 4 * d * queries * events
        if arch.target_attention:
            # qk_proj on the candidates and the history, v_proj on the history, out.
            dense["cross"] += 2 * d * d * ((batch + events) + events + batch)
            attention["cross"] += 4 * d * events
        num_tokens += queries + (1 if arch.target_attention else 0) + 1

    width = num_tokens * d  # the flattened DHEN tokens
    layer_dense = layer_attention = 0  # per sample, per DHEN layer
    for expert in arch.dhen_experts:
        if expert == "attention":
            layer_dense += num_tokens * (2 * d * 3 * d + 2 * d * d)  # qkv, out
            layer_attention += 4 * d * num_tokens * num_tokens
        elif expert == "mlp":
            layer_dense += 2 * (2 * width * hidden)
        elif expert == "cross":
            layer_dense += 2 * (2 * width * max(1, hidden // 4))
        elif expert == "dot":
            num_pairs = num_tokens * (num_tokens + 1) // 2
            layer_dense += 2 * num_tokens * num_tokens * d + 2 * num_pairs * width  # bmm, out
    dense["dhen"] += arch.dhen_layers * batch * layer_dense
    attention["dhen"] = arch.dhen_layers * batch * layer_attention
    dense["heads"] = len(config.tasks) * batch * (2 * width * hidden + 2 * hidden)

    return ModelFlops(
        **{
            name: DENSE_FWD_BWD * dense[name] + ATTENTION_FWD_BWD * attention[name]
            for name in _REGIONS
        },
        forward=float(sum(dense.values()) + sum(attention.values())),
    )


def _as_lengths(lengths: object, max_seq_len: int) -> torch.Tensor:
    """``lengths`` as a 1-D int64 CPU tensor, checked (a CUDA tensor is copied to the host)."""
    if isinstance(lengths, torch.Tensor) or hasattr(lengths, "__array__"):
        tensor = torch.as_tensor(lengths)
        if tensor.dtype == torch.bool or tensor.dtype.is_floating_point or tensor.is_complex():
            raise TypeError(f"lengths must hold integers, got dtype {tensor.dtype}")
        tensor = tensor.detach().to("cpu", torch.int64)
    elif isinstance(lengths, Sequence) and not isinstance(lengths, (str, bytes)):
        try:
            values = [operator.index(x) for x in lengths]
        except TypeError as error:
            raise TypeError(f"lengths must hold integers: {error}") from None
        tensor = torch.tensor(values, dtype=torch.int64)
    else:
        raise TypeError(
            f"lengths must be a 1-D tensor, array or sequence of ints, got {type(lengths).__name__}"
        )
    if tensor.dim() != 1:
        raise ValueError(
            f"lengths must be 1-D (one length per sample), got shape {tuple(tensor.shape)}"
        )
    if tensor.numel():
        low, high = (int(x) for x in torch.aminmax(tensor))
        if low < 0:
            raise ValueError(f"lengths must be >= 0, got {low}")
        if high > max_seq_len:
            raise ValueError(f"lengths must be <= config.max_seq_len={max_seq_len}, got {high}")
    return tensor


def _self_attention_pairs(lengths: torch.Tensor, arch: GemArchitecture) -> int:
    """Visible (query, key) pairs of one self-attention layer, summed over the batch (as sums
    over the batch: a handful of passes over ``lengths``)."""
    total = int(lengths.sum())
    if arch.self_attention == "block":
        # (L // 64) full blocks of 64^2 pairs, then rest^2: 64 (L - rest) + rest^2.
        rest = lengths % BLOCK_SIZE
        return BLOCK_SIZE * (total - int(rest.sum())) + _sum_of_squares(rest)
    window = arch.attention_window
    # Query i sees keys max(0, i - w) .. i: the first m = min(L, w + 1) queries see i + 1
    # keys (m (m + 1) / 2 pairs), the other L - m queries w + 1 each.
    first = lengths if window == 0 else lengths.clamp(max=window + 1)
    first_total = total if window == 0 else int(first.sum())
    triangle = (_sum_of_squares(first) + first_total) // 2
    return triangle + (total - first_total) * (window + 1)


def _sum_of_squares(values: torch.Tensor) -> int:
    return int(torch.dot(values, values))
