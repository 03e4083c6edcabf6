"""Sequence tower: jagged self-attention over the history, PMA pooling and candidate cross-attention.

Every layer works on the jagged layout (tokens of all samples concatenated plus
``offsets``), so no sample is ever padded to the longest history.
"""

from __future__ import annotations

import torch
from gem_kernels import block_attention, gdpa, jagged_flash_attention
from torch import nn

__all__ = ["JaggedSelfAttentionLayer", "PoolingByMultiheadAttention", "CandidateCrossAttention"]


def _cast(dtype: torch.dtype | None, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q, k, v in the attention dtype (a no-op when they already have it). ``None`` ('auto'):
    bfloat16 on CUDA, where it selects the Triton kernels, and unchanged elsewhere."""
    if dtype is None:
        dtype = torch.bfloat16 if tensors[0].is_cuda else tensors[0].dtype
    return tuple(t.to(dtype) for t in tensors)


class JaggedSelfAttentionLayer(nn.Module):
    """Pre-norm transformer layer with causal softmax attention over each history."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        kind: str,
        dropout: float = 0.0,
        attention_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.kind = kind
        self.attention_dtype = attention_dtype
        self.attn_norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.attn_out = nn.Linear(dim, dim)
        self.ffn_norm = nn.LayerNorm(dim)
        self.ffn = nn.Sequential(
            nn.Linear(dim, 4 * dim), nn.GELU(), nn.Dropout(dropout), nn.Linear(4 * dim, dim)
        )

    def forward(self, tokens: torch.Tensor, offsets: torch.Tensor, max_len: int) -> torch.Tensor:
        num_tokens, dim = tokens.shape
        q, k, v = (
            self.qkv(self.attn_norm(tokens))
            .view(num_tokens, 3, self.num_heads, dim // self.num_heads)
            .unbind(1)
        )
        q, k, v = _cast(self.attention_dtype, q, k, v)
        if self.kind == "block":
            attended = block_attention(q, k, v, offsets, max_len)
        else:
            attended = jagged_flash_attention(q, k, v, offsets, max_q=max_len, causal=True)
        tokens = tokens + self.attn_out(attended.reshape(num_tokens, dim).to(tokens.dtype))
        return tokens + self.ffn(self.ffn_norm(tokens))


class PoolingByMultiheadAttention(nn.Module):
    """PMA: a few learned queries, shared by every sample, pool its whole history.

    Uses GDPA (element-wise activation, normalised by the history length), so the
    pooled tokens are a learned weighted mean of the history and empty histories pool to zero.
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
        self.norm = nn.LayerNorm(dim)
        self.q_proj = nn.Linear(dim, dim)
        self.kv_proj = nn.Linear(dim, 2 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, tokens: torch.Tensor, offsets: torch.Tensor, max_len: int) -> torch.Tensor:
        """Returns ``(B, num_queries, dim)``."""
        num_queries, dim = self.queries.shape
        head_dim = dim // self.num_heads
        q = self.q_proj(self.queries).view(num_queries, self.num_heads, head_dim)
        k, v = self.kv_proj(self.norm(tokens)).view(-1, 2, self.num_heads, head_dim).unbind(1)
        q, k, v = _cast(self.attention_dtype, q, k, v)
        pooled = gdpa(
            q,
            k,
            v,
            k_offsets=offsets,
            max_k=max_len,
            activation=self.activation,
            normalize_by_length=True,
        )
        batch_size = offsets.numel() - 1
        return self.out(pooled.reshape(batch_size, num_queries, dim).to(tokens.dtype))


class CandidateCrossAttention(nn.Module):
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
        q, k, v = _cast(self.attention_dtype, q, k, v)
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
        )
        return self.out(attended.reshape(batch_size, dim).to(tokens.dtype))
