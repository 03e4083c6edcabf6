"""The baseline of the training benchmark: GEM as a capable user writes it in plain PyTorch.

``BaselineGem`` is ``gem_model.GemModel`` (same ``GemModelConfig``, same parameter names and
shapes, so ``baseline.load_state_dict(gem.state_dict())`` works strictly, same forward and
logits) with none of our kernels: no gem_kernels, no gem_precision. What replaces them:

* jagged self-attention (JFA / BlockAttention): ``flex_attention`` over all histories packed
  into one sequence, ``(1, H, T_pad, D)``, with a ``BlockMask`` whose ``mask_mod`` is
  same-history & causal & ``q - kv <= window`` (``'block'``: same history & same 64-token
  block); ``rel_pos_bias`` goes in through ``score_mod``, RoPE is applied to q and k in
  plain torch (the cos / sin table is precomputed);
* GDPA (history x feature cross, PMA, target attention): matmuls + the activation on
  histories padded to ``(B, L, ...)``, ``L = max_seq_len``; padded rows hold zeros, so they
  add nothing (``act(0) * 0``) and need no mask;
* ``NormLinear``: ``F.layer_norm`` + ``nn.Linear``; the torchrec tables, DHEN (already
  plain ``nn.Linear`` + SDPA) and ``SequenceInput`` (token sum + recency + LayerNorm) are the
  same modules as GemModel's.

How a benchmark runs it (H200, the same batches and optimizer as our stack)::

    model = BaselineGem(config).cuda()               # fp32 master weights, like the stack
    model.load_state_dict(gem.state_dict())          # optional: the same weights
    compiled = torch.compile(model)                  # see below for the flags
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = compiled(sequence_features, sparse_features, dense_features)

* ``torch.compile(model)`` with the default flags (``mode=None``, ``dynamic=None``): the
  torchrec lookups run eagerly (``embed`` is ``torch.compiler.disable``-d: KJT bookkeeping
  does not trace and the table kernels are fbgemm's anyway); everything after them, from the
  token sums to the heads, including the block mask, is one compiled graph (plus its
  backward). The total history length ``T`` changes every batch: the first batch compiles
  with static shapes, the second recompiles once with ``T`` symbolic (automatic dynamic) and
  later batches reuse that graph. Warm up on at least 3 batches of different ``T`` before
  timing, or pass ``dynamic=True`` (one compile, every size symbolic, ``B`` included) or mark
  ``T`` dynamic yourself. ``mode="max-autotune-no-cudagraphs"`` may buy a few percent on the
  GEMMs at a long compile; CUDA graphs do not apply (``T`` changes every step).
* The block mask is built once per forward, *inside* the compiled graph, by
  :func:`make_block_mask`, and shared by every self-attention layer (forward and backward):
  ~20 small index ops on ``(T_pad / 128)``-sized vectors plus four ``(T_pad / 128)^2`` int32
  index tables (64 MiB each at ``T_pad`` = 512k), which inductor fuses into a few kernels,
  with no host sync and no launches of its own; built eagerly outside, the same work is ~40
  launches and int64 temporaries. Inside, the per-batch ``mask_mod`` closure is traced code,
  not a graph input that dynamo has to guard. Outside works too:
  ``block_mask=make_block_mask(offsets, padded_length(T), window, kind=...)`` (torch 2.14
  matches the new closure by its code, no recompile); use it if an inductor version rejects
  the in-graph tables (the CPU inductor's FlexAttention template does: it wants them as
  graph inputs; the CPU has no FlexAttention backward anyway).
* ``T`` is padded up to a multiple of 128 (always by at least one row) for the block mask;
  the padding rows form a history of their own and are dropped after the self-attention.
* bf16: under autocast every linear, the attention and the GDPA matmuls run in bf16 (the
  attention inputs are cast like GemModel's ``_cast``: ``attention_dtype='auto'`` is bf16 on
  CUDA), norms and softmax statistics in fp32, and the sequence tower's residual stream in
  bf16 (``SequenceInput``'s tokens and the final norm's output), as in our stack.
* No host sync in the forward: lengths above ``max_seq_len`` are not checked (GemModel
  checks them on the host), ``sequence_offsets`` (GemModel's host copy) is accepted and not
  needed. ``max_len`` (default ``config.max_seq_len``) is the padded length of the GDPA
  layers; a history longer than it would be cut there.
* FlexAttention's compiled kernels need ``head_dim >= 16`` (GEM at GPU scale has 128).
"""

from __future__ import annotations

import math

import torch
from gem_model.config import GemModelConfig
from gem_model.dhen import DHENLayer
from gem_model.model import SequenceInput
from torch import nn
from torch.nn import functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from torch.utils.checkpoint import checkpoint
from torchrec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    KeyedJaggedTensor,
    PoolingType,
)
from torchrec.distributed.types import Awaitable

__all__ = ["BLOCK_SIZE", "BaselineGem", "make_block_mask", "padded_length"]

BLOCK_SIZE = 128
"""FlexAttention's sparse block (q and kv): the packed token count is padded to a multiple."""
_ATTENTION_BLOCK = 64  # self_attention='block': full attention inside 64-token blocks
_MAX_REL_POS_BUCKETS = 2048  # the size cap of GemModel's rel_pos_bias table
_ROPE_THETA = 10000.0


def padded_length(total: int) -> int:
    """Rows of the packed self-attention: ``total`` rounded up to a multiple of
    ``BLOCK_SIZE``, always at least one padding row (so no branch on ``total == 0``)."""
    return (total // BLOCK_SIZE + 1) * BLOCK_SIZE


# ------------------------------------------------------------------------------------------
# Block mask of the packed histories.


def _documents(offsets: torch.Tensor, total_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of the packed sequence: its history (``B`` for the padding rows after
    ``offsets[-1]``) and the row where that history starts."""
    rows = torch.arange(total_len, device=offsets.device, dtype=offsets.dtype)
    # offsets[0] = 0 <= every row, so this is searchsorted(offsets[1:], rows, right=True),
    # without the slice: Inductor before torch 2.13 searched a sliced boundary tensor from
    # its storage start (pytorch/pytorch#182343), one history too far.
    doc = torch.searchsorted(offsets, rows, right=True) - 1
    return doc, offsets[doc]  # offsets[B] = T: the padding rows start there


def _ceil_div(x: torch.Tensor, d: int) -> torch.Tensor:
    return torch.div(x + (d - 1), d, rounding_mode="floor")


def _count_le(bounds: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    return torch.searchsorted(bounds, values, right=True)


def make_block_mask(
    offsets: torch.Tensor,
    total_len: int,
    window: int = 0,
    *,
    kind: str = "jagged_flash",
) -> BlockMask:
    """The FlexAttention ``BlockMask`` of histories packed back to back (``offsets``,
    ``(B + 1,)`` on the data's device) in a sequence of ``total_len`` rows (a multiple of
    ``BLOCK_SIZE``; rows past ``offsets[-1]`` are padding and attend among themselves).

    ``kind='jagged_flash'``: same history, causal, and ``q - kv <= window`` when ``window``;
    ``kind='block'``: same history and same 64-token block of it (non-causal).

    Built from the offsets by index arithmetic, without evaluating ``mask_mod`` on the
    ``T x T`` grid (``create_block_mask`` would: ~2.7e11 evaluations at T = 512k) and without
    host syncs. Every q block sees one contiguous range of kv blocks ``[a, b]``, of which
    ``[f0, f1)`` are full (no ``mask_mod`` evaluation in the kernel); the four bounds are
    non-decreasing in the q block, so the transposed (q-side) tables used by the backward
    come from ``searchsorted`` as well. The index tables are full width
    (``nb x nb``, ``nb = total_len / 128``), what every FlexAttention version expects.
    """
    bs = BLOCK_SIZE
    if total_len % bs:
        raise ValueError(f"total_len must be a multiple of {bs}, got {total_len}")
    device = offsets.device
    offsets = offsets.to(torch.int64)
    doc, start = _documents(offsets, total_len)
    doc32 = doc.to(torch.int32)
    num_blocks = total_len // bs
    blocks = torch.arange(num_blocks, device=device, dtype=torch.int64)
    first = blocks * bs  # first and last row of each q block
    last = first + (bs - 1)
    if kind == "jagged_flash":
        low = start[first]
        if window:
            low = torch.maximum(low, first - window)
        a = torch.div(low, bs, rounding_mode="floor")
        b = blocks  # causal: up to the diagonal block
        # kv block j is full iff its first row is in the history of the q block's last row,
        # it ends before the q block starts (j < i) and the window reaches it (last - j*bs <= w).
        full_low = _ceil_div(start[last], bs)
        if window:
            full_low = torch.maximum(full_low, _ceil_div(last - window, bs))
        f0 = torch.minimum(torch.maximum(full_low, a), b)
        f1 = b

        def mask_mod(batch, head, q_idx, kv_idx):
            visible = (doc32[q_idx] == doc32[kv_idx]) & (q_idx >= kv_idx)
            if window:
                visible = visible & (q_idx - kv_idx <= window)
            return visible

    elif kind == "block":
        position = torch.arange(total_len, device=device, dtype=torch.int64) - start
        block_start = start + position // _ATTENTION_BLOCK * _ATTENTION_BLOCK
        ends = torch.cat([offsets[1:], offsets.new_full((1,), total_len)])
        block_end = torch.minimum(block_start + _ATTENTION_BLOCK, ends[doc]) - 1
        a = torch.div(block_start[first], bs, rounding_mode="floor")
        b = torch.div(block_end[last], bs, rounding_mode="floor")
        f0 = f1 = b + 1  # a 128-row tile never lies inside one 64-token block: no full tiles
        block_of = (position // _ATTENTION_BLOCK).to(torch.int32)

        def mask_mod(batch, head, q_idx, kv_idx):
            return (doc32[q_idx] == doc32[kv_idx]) & (block_of[q_idx] == block_of[kv_idx])

    else:
        raise ValueError(f"kind must be 'jagged_flash' or 'block', got {kind!r}")

    slots = blocks[None, :]
    top = num_blocks - 1
    # kv side (forward): partial = [a, f0) then [f1, b]; full = [f0, f1).
    before = (f0 - a)[:, None]
    kv_indices = torch.where(slots < before, a[:, None] + slots, f1[:, None] + slots - before)
    kv_num = (f0 - a) + (b - f1 + 1)
    full_kv_indices = f0[:, None] + slots
    full_kv_num = f1 - f0
    # q side (backward), per kv block j: partial = {i: f1 <= j <= b} then {i: a <= j < f0},
    # full = {i: f0 <= j < f1}; each set is a contiguous, ascending range of q blocks.
    f1_le, f0_le, a_le = _count_le(f1, blocks), _count_le(f0, blocks), _count_le(a, blocks)
    b_lt = torch.searchsorted(b, blocks, right=False)
    after = (f1_le - b_lt)[:, None]
    q_indices = torch.where(slots < after, b_lt[:, None] + slots, f0_le[:, None] + slots - after)
    q_num = (f1_le - b_lt) + (a_le - f0_le)
    full_q_indices = f1_le[:, None] + slots
    full_q_num = f0_le - f1_le

    def table(indices: torch.Tensor) -> torch.Tensor:  # entries past the count are unread
        return indices.clamp(0, top).to(torch.int32)[None, None]

    def counts(num: torch.Tensor) -> torch.Tensor:
        return num.to(torch.int32)[None, None]

    has_full = kind == "jagged_flash"
    return BlockMask(
        seq_lengths=(total_len, total_len),
        kv_num_blocks=counts(kv_num),
        kv_indices=table(kv_indices),
        full_kv_num_blocks=counts(full_kv_num) if has_full else None,
        full_kv_indices=table(full_kv_indices) if has_full else None,
        q_num_blocks=counts(q_num),
        q_indices=table(q_indices),
        full_q_num_blocks=counts(full_q_num) if has_full else None,
        full_q_indices=table(full_q_indices) if has_full else None,
        BLOCK_SIZE=(bs, bs),
        mask_mod=mask_mod,
    )


# ------------------------------------------------------------------------------------------
# Jagged <-> padded, GDPA activations, RoPE.


class _Pad(torch.autograd.Function):
    """Jagged ``(T, C)`` -> zero-padded ``(B, L, C)``; the backward is the reverse gather
    (the aten ops behind nested tensors; inductor lowers both to fused gathers on CUDA)."""

    @staticmethod
    def forward(ctx, values, offsets, max_len):
        ctx.save_for_backward(offsets)
        ctx.total = values.shape[0]
        return torch.ops.aten._jagged_to_padded_dense_forward(values, [offsets], [max_len], 0.0)

    @staticmethod
    def backward(ctx, grad):
        (offsets,) = ctx.saved_tensors
        grad = torch.ops.aten._padded_dense_to_jagged_forward(
            grad.contiguous(), [offsets], ctx.total
        )
        return grad, None, None


class _Unpad(torch.autograd.Function):
    """Padded ``(B, L, C)`` -> jagged ``(T, C)``; the backward pads the gradient with zeros."""

    @staticmethod
    def forward(ctx, padded, offsets, total):
        ctx.save_for_backward(offsets)
        ctx.max_len = padded.shape[1]
        return torch.ops.aten._padded_dense_to_jagged_forward(padded, [offsets], total)

    @staticmethod
    def backward(ctx, grad):
        (offsets,) = ctx.saved_tensors
        grad = torch.ops.aten._jagged_to_padded_dense_forward(
            grad.contiguous(), [offsets], [ctx.max_len], 0.0
        )
        return grad, None, None


def _pad(values: torch.Tensor, offsets: torch.Tensor, max_len: int) -> torch.Tensor:
    return _Pad.apply(values.contiguous(), offsets, max_len)


def _unpad(padded: torch.Tensor, offsets: torch.Tensor, total: int) -> torch.Tensor:
    return _Unpad.apply(padded.contiguous(), offsets, total)


# gem_kernels.reference.gelu_fast: x * clamp(0.5 + t * P(t^2), 0, 1), t = clamp(x, +-3.4201).
_GELU_FAST_CLAMP = 3.4201
_GELU_FAST_COEFFS = (
    0.39411301321858166,
    -0.05963710540773677,
    0.006659413612540281,
    -0.0004089246193980127,
    1.0307510177589354e-05,
)


def _gelu_fast(x: torch.Tensor) -> torch.Tensor:
    t = x.clamp(-_GELU_FAST_CLAMP, _GELU_FAST_CLAMP)
    t2 = t * t
    poly = torch.full_like(t, _GELU_FAST_COEFFS[-1])
    for coeff in reversed(_GELU_FAST_COEFFS[:-1]):
        poly = poly * t2 + coeff
    return x * (0.5 + t * poly).clamp(0.0, 1.0)


_ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_fast": _gelu_fast,
    "relu2": lambda x: F.relu(x).square(),
    "identity": lambda x: x,
}


def _activation(name: str):
    try:
        return _ACTIVATIONS[name]
    except KeyError:
        raise ValueError(
            f"activation must be one of {sorted(_ACTIVATIONS)}, got {name!r}"
        ) from None


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on ``(T, H, D)``; ``cos``/``sin`` are ``(T, D/2)`` table rows, cast
    to x's dtype and applied in it, as gem_kernels.reference.apply_rope does."""
    half = x.shape[-1] // 2
    cos = cos.to(x.dtype)[:, None, :]
    sin = sin.to(x.dtype)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _cast(dtype: torch.dtype | None, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """GemModel's attention dtype: ``None`` ('auto') is bf16 on CUDA, unchanged elsewhere."""
    if dtype is None:
        dtype = torch.bfloat16 if tensors[0].is_cuda else tensors[0].dtype
    return tuple(t.to(dtype) for t in tensors)


# ------------------------------------------------------------------------------------------
# Layers (attribute names are GemModel's, so the state dicts match).


class _NormLinear(nn.Module):
    """``linear(layer_norm(x))``: gem_precision.NormLinear's parameters and math."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__()
        self.norm_weight = nn.Parameter(torch.ones(in_features))
        self.norm_bias = nn.Parameter(torch.zeros(in_features))
        self.linear = nn.Linear(in_features, out_features, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.layer_norm(x, (x.shape[-1],), self.norm_weight, self.norm_bias, 1e-5)
        return self.linear(normed)


class _FeedForward(nn.Module):
    def __init__(self, dim: int, kind: str, dropout: float) -> None:
        super().__init__()
        self.kind = kind
        hidden = 4 * dim if kind == "gelu" else -(-8 * dim // 3 // 16) * 16
        # SwiGLU's up bias is a parameter of its own, as in GemModel (same names and shapes)
        self.up = _NormLinear(dim, hidden if kind == "gelu" else 2 * hidden, kind == "gelu")
        if kind == "swiglu":
            self.up_bias = nn.Parameter(torch.zeros(2 * hidden))
        self.dropout = nn.Dropout(dropout)
        self.down = nn.Linear(hidden, dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.up(tokens)
        if self.kind == "gelu":
            hidden = F.gelu(hidden)
        else:
            gate, value = (hidden + self.up_bias).chunk(2, dim=-1)
            hidden = F.silu(gate) * value
        return self.down(self.dropout(hidden))


class _SelfAttentionLayer(nn.Module):
    """Pre-norm layer: FlexAttention over the packed histories, then the FFN."""

    def __init__(
        self, dim, num_heads, kind, dropout, attention_dtype, *, window, position, ffn, max_len
    ):
        super().__init__()
        self.num_heads = num_heads
        self.kind = kind
        self.attention_dtype = attention_dtype
        self.position = position
        self.qkv = _NormLinear(dim, 3 * dim)
        self.attn_out = nn.Linear(dim, dim)
        self.rel_pos_bias = None
        if position == "rel_pos_bias":
            span = min(window if window else max_len, _MAX_REL_POS_BUCKETS // 2 - 1)
            self.rel_pos_bias = nn.Parameter(torch.zeros(num_heads, 2 * (span + 1)))
        self.ffn = _FeedForward(dim, ffn, dropout)

    def forward(self, tokens, block_mask, rope):
        rows, dim = tokens.shape
        q, k, v = self.qkv(tokens).view(rows, 3, self.num_heads, dim // self.num_heads).unbind(1)
        if rope is not None:
            q, k = _rope(q, *rope), _rope(k, *rope)
        q, k, v = _cast(self.attention_dtype, q, k, v)
        score_mod = None
        if self.rel_pos_bias is not None:
            table = self.rel_pos_bias
            center, top = table.shape[1] // 2, table.shape[1] - 1

            def score_mod(score, batch, head, q_idx, kv_idx):
                return score + table[head, (q_idx - kv_idx + center).clamp(0, top)]

        attended = flex_attention(
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            score_mod=score_mod,
            block_mask=block_mask,
        )
        attended = attended[0].transpose(0, 1).reshape(rows, dim)
        tokens = tokens + self.attn_out(attended.to(tokens.dtype))
        return tokens + self.ffn(tokens)


class _HistoryFeatureCross(nn.Module):
    """Every event over its sample's F feature tokens: act(q k^T / sqrt(D)) v / F."""

    def __init__(self, dim, num_heads, activation, attention_dtype):
        super().__init__()
        self.num_heads = num_heads
        self.activation = _activation(activation)
        self.attention_dtype = attention_dtype
        self.q_proj = _NormLinear(dim, dim)
        self.kv_proj = _NormLinear(dim, 2 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, tokens, offsets, max_len, features):
        """``tokens`` ``(T, dim)`` (real rows only); returns the update ``(T, dim)``."""
        batch, num_features, dim = features.shape
        heads, head_dim = self.num_heads, dim // self.num_heads
        q = self.q_proj(tokens)
        k, v = self.kv_proj(features).view(batch, num_features, 2, heads, head_dim).unbind(2)
        q, k, v = _cast(self.attention_dtype, q, k, v)
        q = _pad(q * head_dim**-0.5, offsets, max_len).view(batch, max_len, heads, head_dim)
        weights = self.activation(torch.einsum("blhd,bfhd->bhlf", q, k))
        attended = torch.einsum("bhlf,bfhd->blhd", weights, v) / num_features
        attended = _unpad(attended.reshape(batch, max_len, dim), offsets, tokens.shape[0])
        return self.out(attended.to(tokens.dtype))


class _PoolingByMultiheadAttention(nn.Module):
    """Learned queries pool each history: act(q k^T / sqrt(D)) v / L (0 for empty ones)."""

    def __init__(self, dim, num_heads, num_queries, activation, attention_dtype):
        super().__init__()
        self.num_heads = num_heads
        self.activation = _activation(activation)
        self.attention_dtype = attention_dtype
        self.queries = nn.Parameter(torch.randn(num_queries, dim) * dim**-0.5)
        self.q_proj = nn.Linear(dim, dim)
        self.kv_proj = _NormLinear(dim, 2 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, tokens, offsets, max_len):
        """Returns ``(B, num_queries, dim)``."""
        num_queries, dim = self.queries.shape
        heads, head_dim = self.num_heads, dim // self.num_heads
        rows, batch = tokens.shape[0], offsets.shape[0] - 1
        q = self.q_proj(self.queries).view(num_queries, heads, head_dim)
        k, v = self.kv_proj(tokens).view(rows, 2, heads, head_dim).unbind(1)
        q, k, v = _cast(self.attention_dtype, q, k, v)
        # Scores on the packed rows (a plain GEMM), then one pad of [weights | values].
        weights = self.activation(torch.einsum("thd,nhd->thn", k, q * head_dim**-0.5))
        width = heads * num_queries
        packed = torch.cat([weights.reshape(rows, width), v.reshape(rows, dim)], dim=1)
        padded = _pad(packed, offsets, max_len)
        weights = padded[..., :width].view(batch, max_len, heads, num_queries)
        values = padded[..., width:].view(batch, max_len, heads, head_dim)
        pooled = torch.einsum("blhn,blhd->bnhd", weights, values)
        lengths = (offsets[1:] - offsets[:-1]).clamp(min=1).to(pooled.dtype)
        pooled = pooled / lengths[:, None, None, None]
        return self.out(pooled.reshape(batch, num_queries, dim).to(tokens.dtype))


class _CandidateCrossAttention(nn.Module):
    """The candidate over its history: sum_j act(q k_j^T / sqrt(D)) v_j (no normalisation);
    queries and keys share ``qk_proj``."""

    def __init__(self, dim, num_heads, activation, attention_dtype):
        super().__init__()
        self.num_heads = num_heads
        self.activation = _activation(activation)
        self.attention_dtype = attention_dtype
        self.query_norm = nn.LayerNorm(dim)
        self.key_norm = nn.LayerNorm(dim)
        self.qk_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, candidate, tokens, offsets, max_len):
        batch, dim = candidate.shape
        heads, head_dim = self.num_heads, dim // self.num_heads
        q = self.qk_proj(self.query_norm(candidate)).view(batch, heads, head_dim)
        normed = self.key_norm(tokens)
        q, k, v = _cast(self.attention_dtype, q, self.qk_proj(normed), self.v_proj(normed))
        padded = _pad(torch.cat([k, v], dim=1), offsets, max_len)
        k = padded[..., :dim].view(batch, max_len, heads, head_dim)
        v = padded[..., dim:].view(batch, max_len, heads, head_dim)
        weights = self.activation(torch.einsum("bhd,blhd->bhl", q * head_dim**-0.5, k))
        attended = torch.einsum("bhl,blhd->bhd", weights, v)
        return self.out(attended.reshape(batch, dim).to(tokens.dtype))


def _waited(output):
    """A torchrec module's output, waited for. Sharded modules return lazy awaitables, and
    their items reaching the compiled graph made dynamo guard on those objects: one
    recompile per step (torch 2.11, H200) until the recompile limit left the rest eager."""
    return output.wait() if isinstance(output, Awaitable) else output


def _select_keys(features: KeyedJaggedTensor, keys: list[str]) -> KeyedJaggedTensor:
    if list(features.keys()) == keys:
        return features
    index = {key: i for i, key in enumerate(features.keys())}
    missing = [key for key in keys if key not in index]
    if missing:
        raise ValueError(f"features is missing keys {missing}; it has {features.keys()}")
    return features.permute([index[key] for key in keys])


# ------------------------------------------------------------------------------------------
# The model.


class BaselineGem(nn.Module):
    """GemModel in plain PyTorch (see the module docstring for how to benchmark it)."""

    def __init__(
        self,
        config: GemModelConfig,
        device: torch.device | None = None,
        *,
        checkpoint_layers: bool = False,
    ) -> None:
        super().__init__()
        self.config = config
        # Each self-attention layer under torch.utils.checkpoint (non-reentrant): what a user
        # does when the activations do not fit (the FP8 shape of bench_train); the layers'
        # inputs are kept and everything inside is recomputed in the backward.
        self.checkpoint_layers = checkpoint_layers
        arch = config.architecture
        dim = arch.embedding_dim
        use_sequence = config.use_sequence_tower
        self.pooled_features = [
            name
            for name in config.sparse_features
            if not (use_sequence and name == config.candidate_feature)
        ]
        self.sparse_embeddings = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(
                    name=f"sparse_{name}",
                    embedding_dim=dim,
                    num_embeddings=config.sparse_features[name],
                    feature_names=[name],
                    pooling=PoolingType.MEAN,
                )
                for name in self.pooled_features
            ],
            device=device,
        )
        num_tokens = len(self.pooled_features) + (1 if config.num_dense_features else 0)
        self.dense_projection = (
            nn.Linear(config.num_dense_features, dim) if config.num_dense_features else None
        )
        if use_sequence:
            self.sequence_keys = list(config.sequence_features)
            self.sequence_embeddings = EmbeddingCollection(
                tables=[
                    EmbeddingConfig(
                        name=f"sequence_{name}",
                        embedding_dim=dim,
                        num_embeddings=config.sequence_features[name],
                        feature_names=[name]
                        + (
                            [config.candidate_feature]
                            if name == config.candidate_history_feature
                            else []
                        ),
                    )
                    for name in config.sequence_features
                ],
                device=device,
            )
            self.sequence_input = SequenceInput(config.max_seq_len, dim)
            attention_dtype = (
                None if arch.attention_dtype == "auto" else getattr(torch, arch.attention_dtype)
            )
            self.sequence_layers = nn.ModuleList(
                _SelfAttentionLayer(
                    dim,
                    arch.num_heads,
                    arch.self_attention,
                    arch.dropout,
                    attention_dtype,
                    window=arch.attention_window,
                    position=arch.position,
                    ffn=arch.ffn,
                    max_len=config.max_seq_len,
                )
                for _ in range(arch.num_sequence_layers)
            )
            self.history_cross = (
                _HistoryFeatureCross(dim, arch.num_heads, arch.sequence_activation, attention_dtype)
                if arch.history_cross
                else None
            )
            self.sequence_norm = nn.LayerNorm(dim)
            self.pma = _PoolingByMultiheadAttention(
                dim, arch.num_heads, arch.pma_queries, arch.sequence_activation, attention_dtype
            )
            self.cross_attention = (
                _CandidateCrossAttention(
                    dim, arch.num_heads, arch.sequence_activation, attention_dtype
                )
                if arch.target_attention
                else None
            )
            num_tokens += arch.pma_queries + (1 if arch.target_attention else 0) + 1
            # RoPE cos / sin of every position < max_seq_len, computed in float64 like
            # apply_rope, stored in float32 (what apply_rope casts them to for float32 q / k;
            # not in the state dict: GemModel has no such buffer).
            head_dim = dim // arch.num_heads
            exponent = torch.arange(head_dim // 2, dtype=torch.float64) * (-2.0 / head_dim)
            angles = torch.arange(config.max_seq_len, dtype=torch.float64)[:, None] * torch.pow(
                _ROPE_THETA, exponent
            )
            self.register_buffer("rope_cos", torch.cos(angles).float(), persistent=False)
            self.register_buffer("rope_sin", torch.sin(angles).float(), persistent=False)

        self.num_tokens = num_tokens
        self.interaction = nn.Sequential(
            *(
                DHENLayer(
                    num_tokens,
                    dim,
                    arch.num_heads,
                    arch.dhen_experts,
                    arch.expert_hidden_dim,
                    arch.dropout,
                )
                for _ in range(arch.dhen_layers)
            )
        )
        self.interaction_norm = nn.LayerNorm(dim)
        self.heads = nn.ModuleDict(
            {
                task: nn.Sequential(
                    nn.Linear(num_tokens * dim, arch.expert_hidden_dim),
                    nn.GELU(),
                    nn.Dropout(arch.dropout),
                    nn.Linear(arch.expert_hidden_dim, 1),
                )
                for task in config.tasks
            }
        )
        if config.task_base_rates is not None:
            for task, rate in zip(config.tasks, config.task_base_rates, strict=True):
                nn.init.constant_(self.heads[task][-1].bias, math.log(rate / (1.0 - rate)))

    def forward(
        self,
        sequence_features: KeyedJaggedTensor | None,
        sparse_features: KeyedJaggedTensor,
        dense_features: torch.Tensor,
        *,
        block_mask: BlockMask | None = None,
        max_len: int | None = None,
        sequence_offsets: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """GemModel's forward: ``(B, len(config.tasks))`` logits.

        ``block_mask``: a prebuilt :func:`make_block_mask` of this batch (default: built here,
        inside the compiled graph). ``max_len``: padded length of the GDPA layers (default
        ``config.max_seq_len``). ``sequence_offsets`` (GemModel's host offsets) is ignored.
        """
        del sequence_offsets  # nothing here reads offsets on the host
        pooled, history, offsets, candidate = self.embed(sequence_features, sparse_features)
        tokens = list(pooled)
        if self.dense_projection is not None:
            tokens.append(self.dense_projection(dense_features))
        if self.config.use_sequence_tower:
            tokens.extend(
                self._sequence_tokens(history, offsets, candidate, tokens, block_mask, max_len)
            )
        features = torch.stack(tokens, dim=1)
        features = self.interaction_norm(self.interaction(features)).flatten(1)
        return torch.cat([self.heads[task](features) for task in self.config.tasks], dim=1)

    @torch.compiler.disable
    def embed(
        self, sequence_features: KeyedJaggedTensor | None, sparse_features: KeyedJaggedTensor
    ):
        """The torchrec lookups (eager): the pooled sparse tokens, the history features'
        embedding rows (one tensor per key), the history offsets and the candidate's
        embedding (from the table it shares with ``candidate_history_feature``)."""
        config = self.config
        pooled_kt = _waited(
            self.sparse_embeddings(_select_keys(sparse_features, self.pooled_features))
        )
        pooled = tuple(pooled_kt[name] for name in self.pooled_features)
        if not config.use_sequence_tower:
            return pooled, (), None, None
        if sequence_features is None:
            raise ValueError("sequence_features is required when use_sequence_tower=True")
        history = _select_keys(sequence_features, self.sequence_keys)
        candidate = sparse_features[config.candidate_feature]
        keys = self.sequence_keys
        # One KJT for the lookup, its key sizes from the shapes (no length_per_key sync).
        per_key = history.values().numel() // len(keys)
        lookup = KeyedJaggedTensor(
            keys=[*keys, config.candidate_feature],
            values=torch.cat([history.values(), candidate.values().to(history.values().dtype)]),
            lengths=torch.cat([history.lengths(), candidate.lengths().to(history.lengths().dtype)]),
            length_per_key=[per_key] * len(keys) + [candidate.values().numel()],
        )
        embedded = _waited(self.sequence_embeddings(lookup))
        values = tuple(embedded[key].values() for key in keys)
        for value in values:  # the token count changes every batch: compile for any count
            torch._dynamo.maybe_mark_dynamic(value, 0)
        offsets = embedded[keys[0]].offsets()
        return pooled, values, offsets, embedded[config.candidate_feature].values()

    def _sequence_tokens(self, history, offsets, candidate, feature_tokens, block_mask, max_len):
        config = self.config
        arch = config.architecture
        max_len = config.max_seq_len if max_len is None else max_len
        offsets = offsets.to(torch.int64)
        total = history[0].shape[0]
        rows = padded_length(total)
        doc, start = _documents(offsets, rows)
        token_index = torch.arange(total, device=history[0].device, dtype=offsets.dtype)
        sample = doc[:total]
        from_end = offsets[1:][sample] - 1 - token_index  # recency: distance from the end
        positions = token_index - start[:total]  # index in the history (RoPE)
        tokens = self.sequence_input(history, from_end)
        tokens = F.pad(tokens, (0, 0, 0, rows - total))  # padding rows: a history of their own
        if self.sequence_layers:
            if block_mask is None:
                block_mask = make_block_mask(
                    offsets, rows, arch.attention_window, kind=arch.self_attention
                )
            rope = None
            if arch.position == "rope":
                padded_positions = F.pad(positions, (0, rows - total))
                rope = (self.rope_cos[padded_positions], self.rope_sin[padded_positions])
            for layer in self.sequence_layers:
                if self.checkpoint_layers:
                    tokens = checkpoint(layer, tokens, block_mask, rope, use_reentrant=False)
                else:
                    tokens = layer(tokens, block_mask, rope)
        tokens = tokens[:total]
        if self.history_cross is not None:
            features = torch.stack([*feature_tokens, candidate], dim=1)
            tokens = tokens + self.history_cross(tokens, offsets, max_len, features)
        tokens = self.sequence_norm(tokens)
        if torch.is_autocast_enabled(tokens.device.type):  # bf16 on, like SequenceInput's
            tokens = tokens.to(torch.get_autocast_dtype(tokens.device.type))
        pma_tokens = self.pma(tokens, offsets, max_len)
        if self.cross_attention is None:
            return [*pma_tokens.unbind(1), candidate]
        target_token = self.cross_attention(candidate, tokens, offsets, max_len)
        return [*pma_tokens.unbind(1), target_token, candidate]
