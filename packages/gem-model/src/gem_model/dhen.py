"""DHEN interaction stack: layers of heterogeneous experts over the feature tokens.

Each layer normalises its input, sums the outputs of its experts (attention
across tokens, an MLP over all tokens, a low-rank cross network, pairwise dot products) and adds them
to the residual stream. Pre-norm keeps an identity path from every feature
token to the heads, and every expert's output layer starts at zero, so a new
layer is the identity: on noisy click labels, randomly initialised experts
otherwise bury the few informative tokens under noise and training stalls.
Summing, rather than concatenating, keeps experts independent: expert
parallelism can run a subset of them per rank and reduce the outputs.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["AttentionExpert", "MLPExpert", "CrossExpert", "DotProductExpert", "DHENLayer"]


class AttentionExpert(nn.Module):
    """Multi-head softmax self-attention across the (few, dense) feature tokens."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        batch, num_tokens, dim = tokens.shape
        q, k, v = (
            self.qkv(tokens)
            .view(batch, num_tokens, 3, self.num_heads, dim // self.num_heads)
            .permute(2, 0, 3, 1, 4)
        )
        attended = F.scaled_dot_product_attention(q, k, v)
        return self.out(attended.transpose(1, 2).reshape(batch, num_tokens, dim))


class MLPExpert(nn.Module):
    """An MLP over all tokens flattened: learns arbitrary interactions at a fixed token count."""

    def __init__(self, num_tokens: int, dim: int, hidden_dim: int, dropout: float) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(num_tokens * dim, hidden_dim),
            nn.GELU(),
            nn.Dropout(dropout),
            nn.Linear(hidden_dim, num_tokens * dim),
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.net(tokens.flatten(1)).view_as(tokens)


class CrossExpert(nn.Module):
    """DCN-v2 style explicit feature crossing, low rank: x * (U (V x)) + b."""

    def __init__(self, num_tokens: int, dim: int, rank: int) -> None:
        super().__init__()
        self.down = nn.Linear(num_tokens * dim, rank, bias=False)
        self.up = nn.Linear(rank, num_tokens * dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        flat = tokens.flatten(1)
        return (flat * self.up(self.down(flat))).view_as(tokens)


class DotProductExpert(nn.Module):
    """FM-style interaction: the dot products of every pair of tokens (and each token with
    itself), scaled by ``dim ** -0.5``, mapped back to the tokens by a linear layer."""

    def __init__(self, num_tokens: int, dim: int) -> None:
        super().__init__()
        rows, cols = torch.triu_indices(num_tokens, num_tokens)
        self.register_buffer("pairs", rows * num_tokens + cols, persistent=False)
        self.scale = dim**-0.5
        self.out = nn.Linear(rows.numel(), num_tokens * dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        gram = torch.bmm(tokens, tokens.transpose(1, 2)).flatten(1) * self.scale
        return self.out(gram[:, self.pairs]).view_as(tokens)


class DHENLayer(nn.Module):
    """One DHEN layer: ``x + sum_e expert_e(norm(x))``."""

    def __init__(
        self,
        num_tokens: int,
        dim: int,
        num_heads: int,
        experts: tuple[str, ...],
        hidden_dim: int,
        dropout: float,
    ) -> None:
        super().__init__()
        built: list[nn.Module] = []
        for kind in experts:
            if kind == "attention":
                built.append(AttentionExpert(dim, num_heads))
            elif kind == "mlp":
                built.append(MLPExpert(num_tokens, dim, hidden_dim, dropout))
            elif kind == "cross":
                built.append(CrossExpert(num_tokens, dim, max(1, hidden_dim // 4)))
            elif kind == "dot":
                built.append(DotProductExpert(num_tokens, dim))
            else:
                raise ValueError(f"unknown DHEN expert kind {kind!r}")
        self.experts = nn.ModuleList(built)
        self.norm = nn.LayerNorm(dim)
        for expert in self.experts:
            output_layer = [m for m in expert.modules() if isinstance(m, nn.Linear)][-1]
            nn.init.zeros_(output_layer.weight)
            nn.init.zeros_(output_layer.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        normed = self.norm(tokens)
        mixed = tokens
        for expert in self.experts:
            mixed = mixed + expert(normed)
        return mixed
