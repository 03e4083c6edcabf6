"""Sequence tower: jagged self-attention over the history, history x feature cross-attention,
PMA pooling and candidate cross-attention.

Every layer works on the jagged layout (tokens of all samples concatenated plus
``offsets``), so no sample is ever padded to the longest history. A LayerNorm that feeds one
linear layer is a ``gem_precision.NormLinear``: when the precision policy runs that linear in
FP8, it becomes the fused norm -> quantise ``Fp8NormLinear``.
"""

from __future__ import annotations

import math

import torch
from gem_kernels import (
    block_attention,
    gdpa,
    jagged_flash_attention,
    rope_qkv,
    rope_tables,
    swiglu,
)
from gem_precision import NormLinear
from torch import nn
from torch.nn import functional as F

__all__ = [
    "ATTENTION_PRECISIONS",
    "AttentionPrecision",
    "JaggedSelfAttentionLayer",
    "HistoryFeatureCrossAttention",
    "PoolingByMultiheadAttention",
    "CandidateCrossAttention",
    "rel_pos_buckets",
    "swiglu_hidden_dim",
]

#: Values of ``AttentionPrecision.precision``: the GEMM precision of an attention kernel.
ATTENTION_PRECISIONS = ("bf16", "fp8")

# JFA's Triton kernels take rel_pos_bias tables of up to this many buckets.
_MAX_REL_POS_BUCKETS = 2048


def rel_pos_buckets(window: int, max_len: int) -> int:
    """Buckets of the learned relative-position bias: one per visible causal distance
    ``0 .. span`` (JFA's table is centred on distance 0, so it has ``2 * (span + 1)`` entries),
    where ``span`` is the window, or the history cap; longer distances share the last bucket."""
    span = min(window if window else max_len, _MAX_REL_POS_BUCKETS // 2 - 1)
    return 2 * (span + 1)


def swiglu_hidden_dim(dim: int) -> int:
    """SwiGLU's hidden width: 8/3 of ``dim`` (the GELU FFN's 4x at equal parameters and FLOPs),
    rounded up to a multiple of 16 for the GEMM tiles."""
    return -(-8 * dim // 3 // 16) * 16


class _FeedForward(nn.Module):
    """Pre-norm FFN: ``gelu`` (d -> 4d -> d) or ``swiglu`` (gated, d -> 8d/3 -> d).

    SwiGLU's up projection has its bias in ``up_bias``, added by :func:`gem_kernels.swiglu`
    rather than by the GEMM: the gate's backward kernel then sums the bias's gradient from the
    rows it already has in registers, where the GEMM's bias would cost a second read of the
    whole ``(T, 2H)`` gradient."""

    def __init__(self, dim: int, kind: str, dropout: float) -> None:
        super().__init__()
        self.kind = kind
        hidden = 4 * dim if kind == "gelu" else swiglu_hidden_dim(dim)
        self.up = NormLinear(dim, hidden if kind == "gelu" else 2 * hidden, bias=kind == "gelu")
        if kind == "swiglu":
            # nn.Linear's bias initialisation, for the fan-in of the projection it belongs to
            bound = 1 / math.sqrt(dim)
            self.up_bias = nn.Parameter(torch.empty(2 * hidden).uniform_(-bound, bound))
        self.dropout = nn.Dropout(dropout)
        self.down = nn.Linear(hidden, dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.up(tokens)
        # SwiGLU: one kernel each way on the GPU; Inductor's backward of the unfused form reads
        # the gate and the output gradient twice (gem_kernels.swiglu_triton says where).
        hidden = F.gelu(hidden) if self.kind == "gelu" else swiglu(hidden, self.up_bias)
        return self.down(self.dropout(hidden))


def _cast(dtype: torch.dtype | None, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q, k, v in the attention dtype (a no-op when they already have it). ``None`` ('auto'):
    bfloat16 on CUDA, where it selects the Triton kernels, and unchanged elsewhere."""
    if dtype is None:
        dtype = torch.bfloat16 if tensors[0].is_cuda else tensors[0].dtype
    return tuple(t.to(dtype) for t in tensors)


class AttentionPrecision:
    """The ``precision`` attribute of the sequence tower's attention modules, set by a precision
    policy (gem-train's ``precision.fp8_attention``): ``"bf16"`` (default) or ``"fp8"``, the
    kernels' FP8 mode (E4M3 Q, K, V with power-of-two block scales, fp32 accumulation;
    ``gem_kernels.jagged_flash_attention`` / ``gdpa(precision=...)``). FP8 quantises from
    16-bit inputs, so float32 q, k, v are handed over in bfloat16."""

    _precision = "bf16"

    @property
    def precision(self) -> str:
        return self._precision

    @precision.setter
    def precision(self, value: str) -> None:
        if value not in ATTENTION_PRECISIONS:
            raise ValueError(f"precision must be one of {ATTENTION_PRECISIONS}, got {value!r}")
        self._check_precision(value)
        self._precision = value

    def _check_precision(self, value: str) -> None:
        """Raises a ``ValueError`` when this module's kernel has no ``value`` mode."""

    def _kernel_inputs(self, dtype: torch.dtype | None, *tensors: torch.Tensor):
        """q, k, v as the kernel takes them: the attention dtype, bfloat16 for float32 in FP8."""
        tensors = _cast(dtype, *tensors)
        if self._precision == "fp8" and tensors[0].dtype == torch.float32:
            return tuple(t.to(torch.bfloat16) for t in tensors)
        return tensors


class JaggedSelfAttentionLayer(AttentionPrecision, nn.Module):
    """Pre-norm transformer layer: causal softmax attention over each history, then an FFN.

    ``kind="jagged_flash"`` sees the last ``window + 1`` events up to each query (``window=0``:
    the whole history before it) with a position signal: ``"rope"`` (rotary q and k by each
    event's index in its history), ``"rel_pos_bias"`` (a learned per-head bias per causal
    distance, added inside JFA) or ``"none"``. ``kind="block"`` is full attention inside
    64-token blocks with RoPE fused into the kernel.

    ``precision`` (:class:`AttentionPrecision`): ``"fp8"`` needs ``"jagged_flash"``.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        kind: str,
        dropout: float = 0.0,
        attention_dtype: torch.dtype | None = None,
        *,
        window: int = 0,
        position: str = "none",
        ffn: str = "gelu",
        max_len: int = 1,
        precision: str = "bf16",
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.kind = kind
        self.precision = precision
        self.attention_dtype = attention_dtype
        self.window = window
        self.position = position
        self.qkv = NormLinear(dim, 3 * dim)
        self.attn_out = nn.Linear(dim, dim)
        self.rel_pos_bias = (
            nn.Parameter(torch.zeros(num_heads, rel_pos_buckets(window, max_len)))
            if position == "rel_pos_bias"
            else None
        )
        self.ffn = _FeedForward(dim, ffn, dropout)
        if position == "rope" and kind != "block":
            cos, sin = rope_tables(max_len, dim // num_heads)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)

    def _check_precision(self, value: str) -> None:
        if value == "fp8" and self.kind != "jagged_flash":
            raise ValueError(f"precision='fp8' needs kind='jagged_flash', got {self.kind!r}")

    def forward(
        self,
        tokens: torch.Tensor,
        offsets: torch.Tensor,
        max_len: int,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``positions``: each token's index in its history (needed for ``"rope"``)."""
        num_tokens, dim = tokens.shape
        qkv = self.qkv(tokens).view(num_tokens, 3, self.num_heads, dim // self.num_heads)
        (qkv,) = self._kernel_inputs(self.attention_dtype, qkv)
        if self.position == "rope" and self.kind != "block":
            if positions is None:
                raise ValueError("position='rope' needs the tokens' positions")
            # One operator for q, k and v, so that their gradients land in one (T, 3, H, D)
            # tensor for the projection's backward instead of being stacked again.
            q, k, v = rope_qkv(qkv, positions, self.rope_cos, self.rope_sin)
        else:
            q, k, v = qkv.unbind(1)
        if self.kind == "block":
            attended = block_attention(q, k, v, offsets, max_len)
        else:
            attended = jagged_flash_attention(
                q,
                k,
                v,
                offsets,
                max_q=max_len,
                causal=True,
                window=(self.window, 0) if self.window else None,
                rel_pos_bias=self.rel_pos_bias,
                precision=self.precision,
            )
        tokens = tokens + self.attn_out(attended.reshape(num_tokens, dim).to(tokens.dtype))
        return tokens + self.ffn(tokens)


class HistoryFeatureCrossAttention(AttentionPrecision, nn.Module):
    """GEM's user x ad cross-attention: every history event (long, jagged queries) attends over
    its sample's non-sequence feature tokens (short keys and values: the ad, the pooled sparse
    features, the dense projection) through GDPA cross, and the result is added to the event.

    Complements :class:`CandidateCrossAttention`, where the one candidate query reads the
    history: here each event learns how it relates to this ad and user before it is pooled.
    GDPA's values are averaged over the fixed number of feature tokens.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        activation: str,
        attention_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.activation = activation
        self.attention_dtype = attention_dtype
        self.q_proj = NormLinear(dim, dim)
        self.kv_proj = NormLinear(dim, 2 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(
        self, tokens: torch.Tensor, offsets: torch.Tensor, max_len: int, features: torch.Tensor
    ) -> torch.Tensor:
        """``tokens`` ``(T, dim)`` jagged by ``offsets``; ``features`` ``(B, F, dim)``."""
        batch_size, num_features, dim = features.shape
        head_dim = dim // self.num_heads
        q = self.q_proj(tokens).view(-1, self.num_heads, head_dim)
        k, v = (
            self.kv_proj(features)
            .view(batch_size * num_features, 2, self.num_heads, head_dim)
            .unbind(1)
        )
        q, k, v = self._kernel_inputs(self.attention_dtype, q, k, v)
        feature_offsets = torch.arange(
            0, (batch_size + 1) * num_features, num_features, device=offsets.device
        ).to(offsets.dtype)
        attended = gdpa(
            q,
            k,
            v,
            q_offsets=offsets,
            k_offsets=feature_offsets,
            max_q=max_len,
            max_k=num_features,
            activation=self.activation,
            normalize_by_length=True,
            precision=self.precision,
        )
        return tokens + self.out(attended.reshape(-1, dim).to(tokens.dtype))


class PoolingByMultiheadAttention(AttentionPrecision, nn.Module):
    """PMA: a few learned queries, shared by every sample, pool its whole history.

    Uses GDPA (element-wise activation, normalised by the history length), so the
    pooled tokens are a learned weighted mean of the history. An empty history's attention is
    zero, so its pooled tokens are the output projection's bias.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        num_queries: int,
        activation: str,
        attention_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.activation = activation
        self.attention_dtype = attention_dtype
        self.queries = nn.Parameter(torch.randn(num_queries, dim) * dim**-0.5)
        self.q_proj = nn.Linear(dim, dim)
        self.kv_proj = NormLinear(dim, 2 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, tokens: torch.Tensor, offsets: torch.Tensor, max_len: int) -> torch.Tensor:
        """Returns ``(B, num_queries, dim)``."""
        num_queries, dim = self.queries.shape
        head_dim = dim // self.num_heads
        q = self.q_proj(self.queries).view(num_queries, self.num_heads, head_dim)
        k, v = self.kv_proj(tokens).view(-1, 2, self.num_heads, head_dim).unbind(1)
        q, k, v = self._kernel_inputs(self.attention_dtype, q, k, v)
        pooled = gdpa(
            q,
            k,
            v,
            k_offsets=offsets,
            max_k=max_len,
            activation=self.activation,
            normalize_by_length=True,
            precision=self.precision,
        )
        batch_size = offsets.numel() - 1
        return self.out(pooled.reshape(batch_size, num_queries, dim).to(tokens.dtype))


class CandidateCrossAttention(AttentionPrecision, nn.Module):
    """The candidate ad (one query per sample) attends over its user's history via GDPA.

    The attended values are summed, not averaged over the history length: a few
    recent events that match the ad should count the same in a long history as in
    a short one, and the activation can switch off the events that do not matter.

    Queries and keys share one projection (and both are normalised): the candidate
    and the history live in one embedding space, so ``q . k`` is a positive
    semi-definite form and an exact match scores high from the first step. On
    noisy click labels this learns the interest signal several times faster
    than independent query and key projections.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        activation: str,
        attention_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.activation = activation
        self.attention_dtype = attention_dtype
        self.query_norm = nn.LayerNorm(dim)
        self.key_norm = nn.LayerNorm(dim)
        self.qk_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)

    def forward(
        self, candidate: torch.Tensor, tokens: torch.Tensor, offsets: torch.Tensor, max_len: int
    ) -> torch.Tensor:
        """``candidate`` is ``(B, dim)``; returns ``(B, dim)``."""
        batch_size, dim = candidate.shape
        head_dim = dim // self.num_heads
        q = self.qk_proj(self.query_norm(candidate)).view(batch_size, self.num_heads, head_dim)
        normed = self.key_norm(tokens)
        k = self.qk_proj(normed).view(-1, self.num_heads, head_dim)
        v = self.v_proj(normed).view(-1, self.num_heads, head_dim)
        q, k, v = self._kernel_inputs(self.attention_dtype, q, k, v)
        one_query_each = torch.arange(batch_size + 1, device=offsets.device, dtype=offsets.dtype)
        attended = gdpa(
            q,
            k,
            v,
            q_offsets=one_query_each,
            k_offsets=offsets,
            max_q=1,
            max_k=max_len,
            activation=self.activation,
            normalize_by_length=False,
            precision=self.precision,
        )
        return self.out(attended.reshape(batch_size, dim).to(tokens.dtype))
