"""PyTorch reference implementations of the jagged attention kernels.

These run on any device, are built only from differentiable torch ops (autograd gives every
gradient) and are the oracle the Triton kernels are tested against. They assume validated
input: call the public entry points in :mod:`gem_kernels.attention` for argument checks.

Memory: samples are never padded to the batch max length. Samples are grouped into buckets by
the power of two above their query and key lengths (at least ``_MIN_BUCKET``), so padding inside
a bucket is below 2x per dimension, and each bucket is processed in chunks of samples and query
rows so that one score tensor ``(samples, heads, query rows, keys)`` holds at most
``score_budget`` elements (a single query row of one sample is the smallest chunk).
Work is batched per chunk; the Python loop runs over buckets and chunks, not over samples.

Masking conventions (shared by all functions):

* For a sample with ``Lq`` queries and ``Lk`` keys, query ``i`` sits at the aligned position
  ``p = i + Lk - Lq`` (bottom-right alignment; ``p = i`` when ``Lq == Lk``).
* ``causal``: query ``i`` sees keys ``j <= p``.
* ``window=(left, right)``: query ``i`` sees keys ``p - left <= j <= p + right``; ``None`` on a
  side means unbounded. Combined with ``causal`` by intersection.
* Relative-position bias bucket: with ``d = p - j`` (positive for keys in the past) and a table
  of ``N`` buckets, the bucket is ``clamp(d + N // 2, 0, N - 1)``, i.e. distance 0 maps to the
  middle entry, distances beyond the table reuse its end entries. Causal models only use the
  upper half (``d >= 0``), so size the table ``2 * max_distance``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gem_kernels.jagged import host_offsets

__all__ = [
    "DEFAULT_SCORE_BUDGET",
    "FP8_ACT_TILE",
    "FP8_BLOCK",
    "FP8_MAX",
    "FP8_P_SCALE",
    "GDPA_ACTIVATIONS",
    "GELU_FAST_CLAMP",
    "GELU_FAST_MAX_ABS_ERROR",
    "ScoreTensorStats",
    "apply_rope",
    "rope_tables",
    "block_attention_reference",
    "compute_dtype",
    "gdpa_act_and_grad",
    "gdpa_activation",
    "gdpa_fp8_backward",
    "gdpa_fp8_operands",
    "gdpa_reference",
    "gelu_fast",
    "jagged_flash_attention_fp8_backward",
    "jagged_flash_attention_reference",
    "quantize_fp8_blocks",
    "rel_pos_bucket",
    "swiglu_backward_reference",
    "swiglu_reference",
    "track_score_elements",
]

#: Default cap on the number of elements of one score tensor (4M floats = 16 MiB in float32).
DEFAULT_SCORE_BUDGET = 1 << 22

_LOG2E = 1.4426950408889634

# Smallest padded bucket length: short samples share one bucket instead of many tiny ones.
_MIN_BUCKET = 16

Window = tuple[int | None, int | None]


# ---------------------------------------------------------------------------------------------
# Score-tensor accounting (used by tests to prove memory does not scale with B * Lmax^2).


@dataclass
class ScoreTensorStats:
    """Sizes of the score tensors the reference allocated while a tracker was active."""

    max_elements: int = 0
    """Largest score tensor seen, in elements."""
    total_elements: int = 0
    """Sum of the sizes of all score tensors seen, in elements."""
    num_tensors: int = 0
    """How many score tensors were allocated."""


_ACTIVE_TRACKERS: list[ScoreTensorStats] = []


@contextlib.contextmanager
def track_score_elements() -> Iterator[ScoreTensorStats]:
    """Context manager recording the size of every score tensor the reference allocates."""
    stats = ScoreTensorStats()
    _ACTIVE_TRACKERS.append(stats)
    try:
        yield stats
    finally:
        _ACTIVE_TRACKERS.remove(stats)


def _record_scores(scores: torch.Tensor) -> None:
    for stats in _ACTIVE_TRACKERS:
        stats.max_elements = max(stats.max_elements, scores.numel())
        stats.total_elements += scores.numel()
        stats.num_tensors += 1


# ---------------------------------------------------------------------------------------------
# Element-wise pieces.


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype the reference computes in: float64 stays float64, everything else uses float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


#: From ``|x| >= GELU_FAST_CLAMP`` on, :func:`gelu_fast` returns the exact limits (x or 0): its
#: polynomial CDF crosses 1 at x ~= 3.41999 and the clamp to [0, 1] takes over.
GELU_FAST_CLAMP = 3.4201

#: Bound on ``|gelu_fast(x) - gelu(x)|`` over all real x, float32 or float64 (measured 1.07e-3
#: on a dense grid; below the bfloat16 rounding of the activations the kernels feed the MMA).
#: The derivative is within 4e-2 of exact GELU's, worst just inside ``|x| = GELU_FAST_CLAMP``.
GELU_FAST_MAX_ABS_ERROR = 1.2e-3

# Odd polynomial Phi(t) - 0.5 ~= t * sum_k c_k t^(2k) (degree 9), fitted (Lawson iterations,
# minimax on |x| * error over [0, 3.42]) so that x * clamp(Phi~(x), 0, 1) tracks exact GELU on
# the whole real line; the leading coefficient is positive, so Phi~ stays >= 1 past the crossing.
_GELU_FAST_COEFFS = (
    0.39411301321858166,
    -0.05963710540773677,
    0.006659413612540281,
    -0.0004089246193980127,
    1.0307510177589354e-05,
)


def gelu_fast(x: torch.Tensor) -> torch.Tensor:
    """GELU from multiplies, adds and min/max only (no exp/erf/tanh): cheap on the ALU.

    ``gelu_fast(x) = x * clamp(0.5 + x * P(x^2), 0, 1)`` with ``P`` of degree 4 (a degree-9
    odd polynomial normal CDF, Horner in ``x^2``): 9 float32 operations per element. Max
    absolute error against exact (erf) GELU: below ``GELU_FAST_MAX_ABS_ERROR`` (1.2e-3) for
    every real input. For ``|x| >= GELU_FAST_CLAMP`` (3.42) the result is exactly ``x`` or
    ``0``; the error there is ``|x| * Phi(-|x|)`` and shrinks. QK-norm keeps attention scores
    well inside that range. The Triton kernels evaluate the same expression.
    """
    # Clamping the polynomial's input changes no value (its CDF is already 0 / 1 there) but
    # keeps huge inputs from overflowing to inf, whose zero gradient would turn into NaN.
    t = x.clamp(-GELU_FAST_CLAMP, GELU_FAST_CLAMP)
    t2 = t * t
    poly = torch.full_like(t, _GELU_FAST_COEFFS[-1])
    for coeff in reversed(_GELU_FAST_COEFFS[:-1]):
        poly = poly * t2 + coeff
    cdf = (0.5 + t * poly).clamp(0.0, 1.0)
    return x * cdf


def _relu_squared(x: torch.Tensor) -> torch.Tensor:
    return torch.square(F.relu(x))


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


#: Activation name -> element-wise function, as accepted by ``gdpa(activation=...)``.
GDPA_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": lambda x: F.gelu(x, approximate="none"),
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_fast": gelu_fast,
    "relu2": _relu_squared,
    "identity": _identity,
}


def gdpa_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The element-wise function behind a GDPA activation name (see ``GDPA_ACTIVATIONS``)."""
    try:
        return GDPA_ACTIVATIONS[name]
    except KeyError:
        raise ValueError(
            f"activation must be one of {sorted(GDPA_ACTIVATIONS)}, got {name!r}"
        ) from None


def rel_pos_bucket(relative_distance: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """Bucket of the aligned relative distance ``d = p - j``: ``clamp(d + N // 2, 0, N - 1)``."""
    return (relative_distance + num_buckets // 2).clamp(0, num_buckets - 1)


def rope_tables(
    max_len: int, head_dim: int, theta: float = 10000.0, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` of :func:`apply_rope`'s angles for positions ``0 .. max_len - 1``: two
    ``(max_len, head_dim // 2)`` float32 tables, computed in float64 once. A model passes them
    to every call: gathering a row per token is far cheaper than a float64 cosine per element
    (on an H200 the latter cost more than the attention it feeds)."""
    half = head_dim // 2
    exponent = torch.arange(half, dtype=torch.float64, device=device) * (-2.0 / head_dim)
    positions = torch.arange(max_len, dtype=torch.float64, device=device)
    angles = positions[:, None] * torch.pow(float(theta), exponent)[None, :]
    return torch.cos(angles).float(), torch.sin(angles).float()


def apply_rope(
    x: torch.Tensor,
    positions: torch.Tensor,
    theta: float = 10000.0,
    *,
    tables: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Rotary embedding, rotate-half convention, on ``x`` of shape ``(T, H, D)`` (D even).

    Pairs are ``(x[..., i], x[..., i + D/2])`` rotated by angle ``positions * theta^(-2i/D)``.
    Angles are computed in float64 so large positions stay accurate; math runs in x's dtype.
    ``tables``: :func:`rope_tables` of ``theta`` covering every position (then ``theta`` is
    not read); the same result for float32 ``x`` (the tables hold the float64 values rounded
    to float32, the precision x's dtype gets anyway).
    """
    half = x.shape[-1] // 2
    if tables is None:
        exponent = torch.arange(half, dtype=torch.float64, device=x.device) * (-2.0 / x.shape[-1])
        inv_freq = torch.pow(float(theta), exponent)
        angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
        cos, sin = torch.cos(angles), torch.sin(angles)
    else:
        cos, sin = tables[0][positions], tables[1][positions]
    cos = cos.to(x.dtype)[:, None, :]
    sin = sin.to(x.dtype)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


# ---------------------------------------------------------------------------------------------
# The bucketed jagged attention engine shared by all three functions.


def swiglu_reference(hidden: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """SwiGLU's gate on ``(T, 2H)`` rows: ``silu(gate) * value`` of the halves
    ``(gate, value)`` of ``hidden + bias``, computed in :func:`compute_dtype` and rounded once
    to hidden's dtype."""
    gate, value = _biased(hidden, bias).chunk(2, dim=-1)
    return (gate * torch.sigmoid(gate) * value).to(hidden.dtype)


def swiglu_backward_reference(
    grad_out: torch.Tensor, hidden: torch.Tensor, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gradients of :func:`swiglu_reference` for ``grad_out`` ``(T, H)``: hidden's
    ``(T, 2H)`` ``(grad * value * s * (1 + gate * (1 - s)), grad * gate * s)`` with ``s =
    sigmoid(gate)``, and the bias's, its column sums before rounding (``None`` without a
    bias)."""
    gate, value = _biased(hidden, bias).chunk(2, dim=-1)
    grad = grad_out.to(gate.dtype)
    sig = torch.sigmoid(gate)
    d_gate = grad * value * sig * (1.0 + gate * (1.0 - sig))
    d_hidden = torch.cat([d_gate, grad * gate * sig], dim=-1)
    d_bias = None if bias is None else d_hidden.sum(0).to(bias.dtype)
    return d_hidden.to(hidden.dtype), d_bias


def _biased(hidden: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``hidden + bias`` in :func:`compute_dtype` of hidden's dtype."""
    out = hidden.to(compute_dtype(hidden.dtype))
    return out if bias is None else out + bias.to(out.dtype)


def _padded_lengths(lengths: torch.Tensor) -> torch.Tensor:
    """Bucket length of each length: the power of two above it, at least _MIN_BUCKET."""
    exponent = torch.ceil(torch.log2(lengths.clamp(min=1).to(torch.float64)))
    padded = torch.pow(2, exponent).to(torch.int64)
    padded = torch.where(padded < lengths, padded * 2, padded)  # guard float rounding
    return padded.clamp(min=_MIN_BUCKET)


def _chunk_shape(q_len: int, k_len: int, heads: int, num_samples: int, budget: int):
    """(samples per chunk, query rows per chunk) keeping samples*heads*rows*k_len <= budget."""
    per_row = heads * k_len
    per_sample = q_len * per_row
    if per_sample <= budget:
        return max(1, min(num_samples, budget // per_sample)), q_len
    return 1, max(1, budget // per_row)


@dataclass
class _Problem:
    """Everything one attention call shares across its chunks (tensors are head-major views)."""

    q_heads: torch.Tensor  # (H, Tq, D) view of q, pre-multiplied by scale
    k_heads: torch.Tensor  # (H, Tk, D)
    v_heads: torch.Tensor  # (H, Tk, D)
    out_rows: int
    activation: Callable[[torch.Tensor], torch.Tensor] | None
    causal: bool
    window: Window | None
    rel_pos_bias: torch.Tensor | None
    jagged_bias: torch.Tensor | None
    normalize_by_length: bool
    with_lse: bool


def _jagged_attention_core(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    q_starts: torch.Tensor,
    k_starts: torch.Tensor,
    out_starts: torch.Tensor,
    q_lengths: torch.Tensor,
    k_lengths: torch.Tensor,
    out_rows: int,
    scale: float,
    activation: Callable[[torch.Tensor], torch.Tensor] | None,
    causal: bool,
    window: Window | None,
    rel_pos_bias: torch.Tensor | None,
    jagged_bias: torch.Tensor | None,
    normalize_by_length: bool,
    score_budget: int,
    with_lse: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention of each sample's queries over its keys; returns ``(out_rows, H, D)`` and,
    ``with_lse`` (softmax only), the log-sum-exp ``(H, out_rows)`` in float32, else ``None``.

    Query row ``i`` of sample ``b`` is read from ``q[q_starts[b] + i]`` and written to
    ``out[out_starts[b] + i]`` (the two differ for broadcast queries). ``activation=None``
    means softmax; otherwise ``activation(scores)`` is used unnormalised. Starts and lengths
    are int64 CPU tensors of shape (B,). Rows of samples without keys stay zero (log-sum-exp:
    ``+inf``, the Triton kernels' convention).
    """
    device = q.device
    heads, head_dim = q.shape[1], q.shape[2]
    q_lengths = q_lengths.to(torch.int64)
    k_lengths = k_lengths.to(torch.int64)
    bias_sizes = q_lengths * k_lengths
    bias_starts = torch.cumsum(bias_sizes, 0) - bias_sizes
    problem = _Problem(
        # Scaling q (small) instead of the scores (large) saves a score-sized op.
        q_heads=(q * scale).transpose(0, 1),
        k_heads=k.transpose(0, 1),
        v_heads=v.transpose(0, 1),
        out_rows=out_rows,
        activation=activation,
        causal=causal,
        window=window,
        rel_pos_bias=rel_pos_bias,
        jagged_bias=jagged_bias,
        normalize_by_length=normalize_by_length,
        with_lse=with_lse,
    )

    # The empty slice keeps the output attached to the graph even when nothing is computed.
    pieces: list[torch.Tensor] = [q[:0]]
    targets: list[torch.Tensor] = [torch.zeros(0, dtype=torch.int64, device=device)]
    lse_pieces: list[torch.Tensor] = [torch.zeros(0, heads, device=device)]

    active = torch.nonzero((q_lengths > 0) & (k_lengths > 0)).flatten()
    if active.numel() > 0:
        q_pad = _padded_lengths(q_lengths[active])
        k_pad = _padded_lengths(k_lengths[active])
        key = q_pad * (int(k_pad.max()) + 1) + k_pad
        bucket_keys, bucket_of = torch.unique(key, return_inverse=True)
        for bucket in range(bucket_keys.numel()):
            in_bucket = bucket_of == bucket
            members = active[in_bucket]
            per_chunk, rows_per_chunk = _chunk_shape(
                int(q_pad[in_bucket][0]),
                int(k_pad[in_bucket][0]),
                heads,
                members.numel(),
                score_budget,
            )
            for first in range(0, members.numel(), per_chunk):
                chunk = members[first : first + per_chunk]
                _attend_chunk(
                    problem,
                    q_lengths=q_lengths[chunk],
                    k_lengths=k_lengths[chunk],
                    q_starts=q_starts[chunk].to(device),
                    k_starts=k_starts[chunk].to(device),
                    out_starts=out_starts[chunk].to(device),
                    bias_starts=bias_starts[chunk].to(device),
                    rows_per_chunk=rows_per_chunk,
                    pieces=pieces,
                    targets=targets,
                    lse_pieces=lse_pieces,
                )

    # Row out_rows is a scratch row that padded query rows are written to, then dropped.
    out = torch.zeros(out_rows + 1, heads, head_dim, dtype=q.dtype, device=device)
    all_targets = torch.cat(targets)
    out = out.index_copy(0, all_targets, torch.cat(pieces))[:out_rows]
    if not with_lse:
        return out, None
    lse = torch.full((out_rows + 1, heads), float("inf"), device=device)
    lse = lse.index_copy(0, all_targets, torch.cat(lse_pieces))[:out_rows]
    return out, lse.t().contiguous()


def _attend_chunk(
    problem: _Problem,
    *,
    q_lengths: torch.Tensor,
    k_lengths: torch.Tensor,
    q_starts: torch.Tensor,
    k_starts: torch.Tensor,
    out_starts: torch.Tensor,
    bias_starts: torch.Tensor,
    rows_per_chunk: int,
    pieces: list[torch.Tensor],
    targets: list[torch.Tensor],
    lse_pieces: list[torch.Tensor],
) -> None:
    """Attention for one chunk of samples (all in one length bucket); appends output rows.

    Lengths are CPU tensors, starts live on the data's device. Score tensors are laid out
    ``(H, n, rows, keys)`` so q/k/v gathers need no transposing copies.
    """
    q_heads, k_heads, v_heads = problem.q_heads, problem.k_heads, problem.v_heads
    device = q_heads.device
    heads, head_dim = q_heads.shape[0], q_heads.shape[2]
    num = q_lengths.numel()
    # Trim the bucket's padded shape to this chunk's real maxima.
    q_len = int(q_lengths.max())
    k_len = int(k_lengths.max())
    lq = q_lengths.to(device)
    lk = k_lengths.to(device)

    key_pos = torch.arange(k_len, device=device)
    key_valid = key_pos[None, :] < lk[:, None]  # (n, Lk)
    key_index = (k_starts[:, None] + key_pos[None, :]).clamp(max=k_heads.shape[1] - 1)
    k_pad = k_heads.index_select(1, key_index.flatten()).view(heads, num, k_len, head_dim)
    v_pad = v_heads.index_select(1, key_index.flatten()).view(heads, num, k_len, head_dim)
    # Key slots past a sample's length read another sample's rows: zero their values, since a
    # zero weight times a NaN or Inf there would still reach this sample's output.
    v_pad = v_pad.masked_fill(~key_valid[None, :, :, None], 0.0)
    k_pad_t = k_pad.transpose(-1, -2)  # matmul takes the transposed view without a copy

    window = problem.window
    for row0 in range(0, q_len, rows_per_chunk):
        rows = torch.arange(row0, min(q_len, row0 + rows_per_chunk), device=device)
        num_rows = rows.numel()
        row_valid = rows[None, :] < lq[:, None]  # (n, r)
        row_index = (q_starts[:, None] + rows[None, :]).clamp(max=q_heads.shape[1] - 1)
        q_rows = q_heads.index_select(1, row_index.flatten()).view(heads, num, num_rows, head_dim)

        scores = torch.matmul(q_rows, k_pad_t)  # (H, n, r, Lk), already scaled via q
        _record_scores(scores)

        # Visibility (n, r, Lk) from broadcast compares; p = i + Lk - Lq is the aligned position.
        mask = row_valid[:, :, None] & key_valid[:, None, :]
        aligned = (rows[None, :] + (lk - lq)[:, None])[:, :, None]  # (n, r, 1)
        keys = key_pos[None, None, :]
        if problem.causal:
            mask = mask & (keys <= aligned)
        if window is not None:
            left, right = window
            if left is not None:
                mask = mask & (keys >= aligned - left)
            if right is not None:
                mask = mask & (keys <= aligned + right)

        if problem.rel_pos_bias is not None:
            table = problem.rel_pos_bias
            scores = scores + table[:, rel_pos_bucket(aligned - keys, table.shape[1])]
        if problem.jagged_bias is not None:
            # Row-major Lq x Lk block of each sample; out-of-range slots read entry 0 (masked).
            flat = bias_starts[:, None, None] + rows[None, :, None] * lk[:, None, None] + keys
            flat = flat.masked_fill(~(row_valid[:, :, None] & key_valid[:, None, :]), 0)
            scores = scores + problem.jagged_bias[:, flat]

        if problem.activation is None:
            # Rows without any visible key (padding, or fully masked) get all keys unmasked so
            # softmax stays finite; their output is zeroed below, so they contribute nothing.
            row_has_key = mask.any(dim=-1)  # (n, r)
            mask = mask | ~row_has_key[:, :, None]
            masked_scores = scores.masked_fill(~mask, float("-inf"))
            weights = torch.softmax(masked_scores, dim=-1)
            # Selected, not multiplied: a NaN in the scores of a row without keys stays out.
            out = torch.matmul(weights, v_pad).masked_fill(~row_has_key[None, :, :, None], 0.0)
            if problem.with_lse:
                # log2 domain, +inf for rows without keys: what the Triton backward reads.
                lse = (torch.logsumexp(masked_scores, dim=-1) * _LOG2E).float()  # (H, n, r)
                lse = lse.masked_fill(~row_has_key[None], float("inf"))
                lse_pieces.append(lse.permute(1, 2, 0).reshape(num * num_rows, heads))
        else:
            weights = problem.activation(scores).masked_fill(~mask, 0.0)
            out = torch.matmul(weights, v_pad)  # (H, n, r, D)
        if problem.normalize_by_length:
            out = out / lk.to(out.dtype)[None, :, None, None]

        pieces.append(out.permute(1, 2, 0, 3).reshape(num * num_rows, heads, head_dim))
        target = out_starts[:, None] + rows[None, :]
        targets.append(target.masked_fill(~row_valid, problem.out_rows).flatten())


def _lengths_and_starts(offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    host = host_offsets(offsets)
    return host[1:] - host[:-1], host[:-1]


def _to_compute(tensor: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if tensor is None else tensor.to(dtype)


# ---------------------------------------------------------------------------------------------
# FP8 attention emulation (``precision="fp8"``): the numerics of the FP8 Triton kernels.
#
# q, k and v are quantised to E4M3 in blocks of FP8_BLOCK tokens of one sample and one head,
# each with a power-of-two scale (an E8M0 exponent), so every forward tile (at most FP8_BLOCK
# rows, aligned within the sample) sits inside one block and a scale is a scalar per tile and
# operand; scaling by a power of two is exact, so the MX storage format (E4M3 with E8M0 scales
# per 1x32 block) holds the same values. The forward's GEMMs, Q K^T and P V, multiply E4M3
# values exactly and accumulate in float32. The backward runs no FP8 GEMM: its five GEMMs take
# the input-precision (bf16/fp16) operands, with the FP8 forward's output and log-sum-exp. FP8
# backward GEMMs were slower on Hopper, and dP or dS in FP8 raised the dQ and dK error
# (docs/kernel-tuning.md, "FP8 backward in bf16").

#: Largest finite E4M3 value (``torch.float8_e4m3fn``).
FP8_MAX = 448.0
#: Tokens of one sample per quantisation block (one power-of-two scale per block and head): the
#: largest kernel tile, so that every tile of every kernel reads one scale per operand.
FP8_BLOCK = 128
#: P (in [0, 1] after the running-max subtraction) times this power of two is cast to E4M3: 1
#: maps to 256, exact, and the top binades keep E4M3's full 3-bit mantissa (relative error
#: <= 2^-4); P down to 2^-14 stays normal, below that subnormal, below 2^-18 zero.
FP8_P_SCALE = 256.0

_FP8 = torch.float8_e4m3fn


def _pow2_scale(amax: torch.Tensor) -> torch.Tensor:
    """Smallest power of two ``s`` with ``amax / s <= FP8_MAX``, as float32; exponents clamped
    to [-126, 127] (normal float32, inside E8M0's range). 1 for a maximum that is zero, below
    float32's smallest normal (the block then rounds to zeros) or not finite: the rule of the
    Triton quantisation (:mod:`gem_kernels.fp8_quantize`), which reads the exponent bits."""
    amax = amax.float()
    mantissa, exponent = torch.frexp(amax / FP8_MAX)
    # frexp: x = m * 2^e, m in [0.5, 1); an exact power of two (m = 0.5) needs e - 1.
    exponent = (exponent - (mantissa == 0.5).to(exponent.dtype)).clamp(-126, 127)
    tiny = amax < torch.finfo(torch.float32).tiny
    exponent = torch.where(tiny | ~torch.isfinite(amax), 0, exponent)
    # Built from the exponent bits: exact, unlike a float pow.
    return ((exponent.to(torch.int32) + 127) << 23).view(torch.float32)


def quantize_fp8_blocks(
    x: torch.Tensor, lengths: torch.Tensor, block: int = FP8_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 copy of jagged ``x`` ``(T, H, D)`` and its per-token scales ``(T, H)`` float32.

    Tokens ``[i * block, (i + 1) * block)`` of a sample (``lengths``: host ``(B,)``) share one
    power-of-two scale per head, from the block's absolute maximum: ``x ~= x8 * scale``. The
    scale is stored per token (constant over a block) so that a kernel tile reads the scale of
    its first row.
    """
    rows, heads = x.shape[0], x.shape[1]
    lengths = lengths.to("cpu", torch.int64)
    starts = torch.cumsum(lengths, 0) - lengths
    per_sample = (lengths + block - 1) // block
    first = torch.cumsum(per_sample, 0) - per_sample
    sample = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    local = torch.arange(rows) - starts[sample]
    block_of = (first[sample] + local // block).to(x.device)
    amax = torch.zeros(int(per_sample.sum()), heads, dtype=torch.float32, device=x.device)
    token_amax = x.abs().amax(-1).float()
    amax = amax.scatter_reduce(0, block_of[:, None].expand(-1, heads), token_amax, "amax")
    scale = _pow2_scale(amax)[block_of]
    return (x.float() / scale[..., None]).to(_FP8), scale


def _dequantized(x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``x`` rounded through :func:`quantize_fp8_blocks`, head-major ``(H, T, D)`` float32
    (exact: E4M3 values times powers of two)."""
    x8, scale = quantize_fp8_blocks(x, lengths)
    return (x8.float() * scale[..., None]).transpose(0, 1)


def _quantize_p(p: torch.Tensor) -> torch.Tensor:
    """P in [0, 1] through E4M3 at ``FP8_P_SCALE`` (the value the FP8 P V GEMM
    multiply, still times ``FP8_P_SCALE``)."""
    return (p * FP8_P_SCALE).to(_FP8).float()


@dataclass
class _Fp8Problem:
    """One FP8 call: the score operands (head-major float32) and the masking options."""

    q_lengths: torch.Tensor
    k_lengths: torch.Tensor
    q_starts: torch.Tensor
    k_starts: torch.Tensor
    q_heads: torch.Tensor  # (H, Tq, D): the E4M3 values in the forward, the inputs' in backward
    k_heads: torch.Tensor
    scale: float
    causal: bool
    window: Window | None
    rel_pos_bias: torch.Tensor | None  # float32
    jagged_bias: torch.Tensor | None  # float32
    score_budget: int

    def samples(self) -> Iterator[tuple[int, int, int, int, int, int, int]]:
        """``(b, q0, lq, k0, lk, bias0, rows_per_chunk)`` of the samples with queries and keys."""
        bias0 = 0
        heads = self.q_heads.shape[0]
        for b in range(self.q_lengths.numel()):
            lq, lk = int(self.q_lengths[b]), int(self.k_lengths[b])
            if lq > 0 and lk > 0:
                rows = max(1, self.score_budget // (heads * lk))
                yield b, int(self.q_starts[b]), lq, int(self.k_starts[b]), lk, bias0, rows
            bias0 += lq * lk

    def scores(self, q0, lq, k0, lk, bias0, rows) -> tuple[torch.Tensor, torch.Tensor]:
        """Log2-domain scores ``(H, r, lk)`` of query rows ``rows`` of a sample, masked pairs
        ``-inf``, and the visibility ``(r, lk)``."""
        device = self.q_heads.device
        q = self.q_heads[:, q0 + rows]
        k = self.k_heads[:, k0 : k0 + lk]
        s = torch.matmul(q, k.transpose(-1, -2)) * self.scale
        _record_scores(s)
        keys = torch.arange(lk, device=device)[None, :]
        aligned = (rows + (lk - lq))[:, None]
        mask = torch.ones(rows.numel(), lk, dtype=torch.bool, device=device)
        if self.causal:
            mask = mask & (keys <= aligned)
        if self.window is not None:
            left, right = self.window
            if left is not None:
                mask = mask & (keys >= aligned - left)
            if right is not None:
                mask = mask & (keys <= aligned + right)
        if self.rel_pos_bias is not None:
            table = self.rel_pos_bias
            s = s + table[:, rel_pos_bucket(aligned - keys, table.shape[1])]
        if self.jagged_bias is not None:
            s = s + self.jagged_bias[:, bias0 + rows[:, None] * lk + keys]
        return (s * _LOG2E).masked_fill(~mask, float("-inf")), mask


def _fp8_problem(
    q, k, q_offsets, k_offsets, *, scale, causal, window, rel_pos_bias, jagged_bias, score_budget,
    quantize=True,
) -> _Fp8Problem:  # fmt: skip
    """``quantize``: scores from the E4M3 q and k (the forward), else from the inputs."""
    q_lengths, q_starts = _lengths_and_starts(q_offsets)
    k_lengths, k_starts = _lengths_and_starts(q_offsets if k_offsets is None else k_offsets)
    return _Fp8Problem(
        q_lengths=q_lengths,
        k_lengths=k_lengths,
        q_starts=q_starts,
        k_starts=k_starts,
        q_heads=_dequantized(q, q_lengths) if quantize else q.float().transpose(0, 1),
        k_heads=_dequantized(k, k_lengths) if quantize else k.float().transpose(0, 1),
        scale=q.shape[-1] ** -0.5 if scale is None else float(scale),
        causal=causal,
        window=window,
        rel_pos_bias=_to_compute(rel_pos_bias, torch.float32),
        jagged_bias=_to_compute(jagged_bias, torch.float32),
        score_budget=score_budget,
    )


def _jfa_fp8_forward(
    q, k, v, q_offsets, k_offsets, *, scale, causal, window, rel_pos_bias, jagged_bias,
    score_budget,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """FP8 emulation of the forward: ``(out (Tq, H, D) q.dtype, lse (H, Tq) float32)``.

    As the kernels: scores from the E4M3 q and k, P = exp2(s - m) quantised at
    ``FP8_P_SCALE``, P V from the E4M3 v, accumulated in float32, divided by the float32 sum of
    the unquantised P. The kernels' online softmax quantises P against the running row maximum,
    this emulation against the final one: the same rounding up to a power-of-two shift of the
    inputs of the tiles before the maximum was reached (see the Triton tests' tolerance)."""
    problem = _fp8_problem(
        q, k, q_offsets, k_offsets, scale=scale, causal=causal, window=window,
        rel_pos_bias=rel_pos_bias, jagged_bias=jagged_bias, score_budget=score_budget,
    )  # fmt: skip
    v8 = _dequantized(v, problem.k_lengths)
    heads = q.shape[1]
    out = torch.zeros(heads, q.shape[0], q.shape[2], dtype=torch.float32, device=q.device)
    lse = torch.full((heads, q.shape[0]), float("inf"), dtype=torch.float32, device=q.device)
    for _, q0, lq, k0, lk, bias0, chunk in problem.samples():
        for r0 in range(0, lq, chunk):
            rows = torch.arange(r0, min(lq, r0 + chunk), device=q.device)
            s2, mask = problem.scores(q0, lq, k0, lk, bias0, rows)
            has_key = mask.any(-1)  # (r,)
            m = torch.where(has_key, s2.amax(-1), 0.0)  # (H, r)
            p = torch.exp2(s2 - m[..., None])
            total = p.sum(-1)
            acc = torch.matmul(_quantize_p(p), v8[:, k0 : k0 + lk]) / FP8_P_SCALE
            # Rows without a visible key: 0 and +inf, selected (never divided) as the kernels do.
            out[:, q0 + rows] = torch.where(
                has_key[None, :, None], acc / torch.where(has_key, total, 1.0)[..., None], 0.0
            )
            lse[:, q0 + rows] = torch.where(
                has_key, m + torch.log2(torch.where(has_key, total, 1.0)), float("inf")
            )
    return out.transpose(0, 1).to(q.dtype).contiguous(), lse


def jagged_flash_attention_fp8_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    q_offsets: torch.Tensor,
    k_offsets: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    causal: bool = False,
    window: Window | None = None,
    rel_pos_bias: torch.Tensor | None = None,
    jagged_bias: torch.Tensor | None = None,
    score_budget: int = DEFAULT_SCORE_BUDGET,
) -> tuple[torch.Tensor | None, ...]:
    """Emulation of the FP8 mode's backward: ``(dq, dk, dv, d_rel_pos_bias, d_jagged_bias)``
    (``None`` for absent biases) from the FP8 forward's ``out`` and ``lse``.

    The backward of ``precision="fp8"`` runs no FP8 GEMM (on Hopper they were slower and no
    more accurate): as the bf16 kernels, scores from the input-precision q and k, normalised
    by the FP8 forward's lse (P = exp2(s - lse)); dV = P^T dO with P rounded to the input
    dtype; dP = dO V^T in float32; dS = P (dP - delta) with delta = rowsum(dO * O);
    dQ = dS K and dK = dS^T Q from dS rounded to the input dtype. Deterministic."""
    problem = _fp8_problem(
        q, k, q_offsets, k_offsets, scale=scale, causal=causal, window=window,
        rel_pos_bias=rel_pos_bias, jagged_bias=jagged_bias, score_budget=score_budget,
        quantize=False,
    )  # fmt: skip
    low = q.dtype
    q_heads, k_heads = problem.q_heads, problem.k_heads
    v_heads = v.float().transpose(0, 1)
    do_heads = grad_out.float().transpose(0, 1)
    o_heads = out.float().transpose(0, 1)
    dq = torch.zeros_like(q_heads)
    dk = torch.zeros_like(k_heads)
    dv = torch.zeros_like(v_heads)
    d_rel = None if rel_pos_bias is None else torch.zeros_like(problem.rel_pos_bias)
    d_jagged = None if jagged_bias is None else torch.zeros_like(problem.jagged_bias)
    for _, q0, lq, k0, lk, bias0, chunk in problem.samples():
        keys = slice(k0, k0 + lk)
        for r0 in range(0, lq, chunk):
            rows = torch.arange(r0, min(lq, r0 + chunk), device=q.device)
            s2, _ = problem.scores(q0, lq, k0, lk, bias0, rows)
            p = torch.exp2(s2 - lse[:, q0 + rows, None])  # 0 where masked or lse = +inf
            do = do_heads[:, q0 + rows]
            delta = (do * o_heads[:, q0 + rows]).sum(-1)
            dp = torch.matmul(do, v_heads[:, keys].transpose(-1, -2))
            ds = p * (dp - delta[..., None])
            dv[:, keys] += torch.matmul(p.to(low).float().transpose(-1, -2), do)
            ds_low = ds.to(low).float()
            dk[:, keys] += torch.matmul(ds_low.transpose(-1, -2), q_heads[:, q0 + rows])
            dq[:, q0 + rows] = torch.matmul(ds_low, k_heads[:, keys])
            if d_rel is not None:
                aligned = (rows + (lk - lq))[:, None]
                bucket = rel_pos_bucket(aligned - torch.arange(lk, device=q.device), d_rel.shape[1])
                d_rel.index_add_(1, bucket.flatten(), ds.flatten(1))
            if d_jagged is not None:
                flat = bias0 + rows[:, None] * lk + torch.arange(lk, device=q.device)
                d_jagged[:, flat.flatten()] = ds.flatten(1)
    grads = (
        (dq * problem.scale).transpose(0, 1).to(q.dtype),
        (dk * problem.scale).transpose(0, 1).to(k.dtype),
        dv.transpose(0, 1).to(v.dtype),
        None if d_rel is None else d_rel.to(rel_pos_bias.dtype),
        None if d_jagged is None else d_jagged.to(jagged_bias.dtype),
    )
    return grads


class _Fp8AttentionFunction(torch.autograd.Function):
    """Autograd of the FP8 emulation for direct calls of the reference (the operators call the
    forward and :func:`jagged_flash_attention_fp8_backward` themselves)."""

    @staticmethod
    def forward(ctx, q, k, v, rel_pos_bias, jagged_bias, q_offsets, k_offsets, options):
        out, lse = _jfa_fp8_forward(
            q, k, v, q_offsets, k_offsets, rel_pos_bias=rel_pos_bias, jagged_bias=jagged_bias,
            **options,
        )  # fmt: skip
        ctx.save_for_backward(q, k, v, out, lse, rel_pos_bias, jagged_bias)
        ctx.offsets = (q_offsets, k_offsets)
        ctx.options = options
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, _grad_lse):
        q, k, v, out, lse, rel_pos_bias, jagged_bias = ctx.saved_tensors
        grads = jagged_flash_attention_fp8_backward(
            grad_out.contiguous(), q, k, v, out, lse, *ctx.offsets,
            rel_pos_bias=rel_pos_bias, jagged_bias=jagged_bias, **ctx.options,
        )  # fmt: skip
        return (*grads, None, None, None)


# ---------------------------------------------------------------------------------------------
# GDPA FP8 emulation (``gdpa(..., precision="fp8")``): the numerics of the FP8 GDPA kernels.
#
# q, k, v are quantised as for JFA (``quantize_fp8_blocks``; PMA's Nq shared queries as one
# sample). A = act(scale * Q K^T) has no fixed range (silu, gelu, identity grow like |s|, relu2
# like s^2), so the A V GEMM scales A dynamically: one power of two per query row and
# FP8_ACT_TILE-key tile, from the tile's absolute maximum. The scale must be constant along the
# GEMM's reduction, so its granularity is the kernel's tile along it; FP8 calls fix that tile at
# FP8_ACT_TILE, and the emulation groups keys the same way (tiles start at each sample's first
# key), so it matches every tile config the kernels accept. The backward runs in bf16, as JFA's.

#: Keys per A scale in the forward's A V: the FP8 kernel's tile along that reduction
#: (``fwd_block_n``, ``pma_block_n``) is set to it.
FP8_ACT_TILE = 64


def _pow2_floor_scale(amax: torch.Tensor) -> torch.Tensor:
    """``2^(floor(log2 amax) - 7)`` for non-negative float32 ``amax``, from its exponent bits
    (exact; exponents clamped to [-126, 120], so 0 gives 2^-126): ``amax / scale`` lies in
    [128, 256), inside E4M3's range with the row's largest values in its top binades. The
    kernels compute the same bits (``_act_scale`` in ``_gdpa_kernels.py``)."""
    bits = amax.float().contiguous().view(torch.int32)
    exponent = (((bits >> 23) & 0xFF) - 7).clamp(1, 247)
    return (exponent << 23).view(torch.float32)


def _quantize_act(a: torch.Tensor, tile: int = FP8_ACT_TILE) -> torch.Tensor:
    """A ``(..., rows, n)`` through E4M3 with one power-of-two scale per row and ``tile``
    columns (columns from 0), as float32 (dequantised: exact)."""
    n = a.shape[-1]
    padded = -(-n // tile) * tile
    grouped = F.pad(a, (0, padded - n)).unflatten(-1, (padded // tile, tile))
    scale = _pow2_floor_scale(grouped.abs().amax(-1, keepdim=True))
    return ((grouped / scale).to(_FP8).float() * scale).flatten(-2)[..., :n]


def gdpa_act_and_grad(s: torch.Tensor, activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(act(s), act'(s))`` element-wise in ``s``'s dtype, the formulas of the GDPA kernels."""
    if activation == "silu":
        sig = torch.sigmoid(s)
        return s * sig, sig * (1.0 + s * (1.0 - sig))
    if activation == "gelu":
        cdf = 0.5 * (1.0 + torch.erf(s * 0.7071067811865476))
        return s * cdf, cdf + s * (0.3989422804014327 * torch.exp(-0.5 * s * s))
    if activation == "gelu_tanh":
        s2 = s * s
        sig = torch.sigmoid(1.5957691216057308 * s * (1.0 + 0.044715 * s2))
        return s * sig, sig + s * sig * (1.0 - sig) * (1.5957691216057308 * (1.0 + 0.134145 * s2))
    if activation == "gelu_fast":
        t = s.clamp(-GELU_FAST_CLAMP, GELU_FAST_CLAMP)
        t2 = t * t
        poly = torch.full_like(t, _GELU_FAST_COEFFS[-1])
        dpoly = torch.full_like(t, 4.0 * _GELU_FAST_COEFFS[4])
        for coeff in reversed(_GELU_FAST_COEFFS[:-1]):
            poly = poly * t2 + coeff
        for power in (3, 2, 1):
            dpoly = dpoly * t2 + power * _GELU_FAST_COEFFS[power]
        raw = 0.5 + t * poly
        cdf = raw.clamp(0.0, 1.0)
        inside = (raw > 0.0) & (raw < 1.0)
        return s * cdf, cdf + torch.where(inside, s * (poly + 2.0 * t2 * dpoly), 0.0)
    if activation == "relu2":
        r = s.clamp_min(0.0)
        return r * r, 2.0 * r
    return s, torch.ones_like(s)


@dataclass
class _GdpaFp8Problem:
    """One FP8 GDPA call: sample geometry and operands (head-major float32; the E4M3 values
    in the forward, the inputs' in the backward)."""

    q_lengths: torch.Tensor  # (B,) queries per sample (Nq for PMA)
    k_lengths: torch.Tensor
    q_starts: torch.Tensor  # (B,) first row in q (0 for PMA)
    k_starts: torch.Tensor
    out_starts: torch.Tensor  # (B,) first row of the sample's output / dO
    out_rows: int
    q_heads: torch.Tensor  # (H, Tq, D)
    k_heads: torch.Tensor  # (H, Tk, D)
    v_heads: torch.Tensor  # (H, Tk, D)
    scale: float
    activation: str
    causal: bool
    window: Window | None
    normalize_by_length: bool
    score_budget: int

    def samples(self) -> Iterator[tuple[int, int, int, int, int, int]]:
        """``(q0, lq, k0, lk, o0, rows_per_chunk)`` of the samples with queries and keys."""
        heads = self.q_heads.shape[0]
        for b in range(self.k_lengths.numel()):
            lq, lk = int(self.q_lengths[b]), int(self.k_lengths[b])
            if lq > 0 and lk > 0:
                rows = max(1, self.score_budget // (heads * lk))
                yield (
                    int(self.q_starts[b]), lq, int(self.k_starts[b]), lk, int(self.out_starts[b]),
                    rows,
                )  # fmt: skip

    def scores(self, q0, lq, k0, lk, rows) -> tuple[torch.Tensor, torch.Tensor]:
        """Scores ``(H, r, lk)`` of query rows ``rows`` of a sample and the visibility."""
        s = torch.matmul(
            self.q_heads[:, q0 + rows], self.k_heads[:, k0 : k0 + lk].transpose(-1, -2)
        )
        s = s * self.scale
        _record_scores(s)
        keys = torch.arange(lk, device=s.device)[None, :]
        aligned = (rows + (lk - lq))[:, None]
        mask = torch.ones(rows.numel(), lk, dtype=torch.bool, device=s.device)
        if self.causal:
            mask = mask & (keys <= aligned)
        if self.window is not None:
            left, right = self.window
            if left is not None:
                mask = mask & (keys >= aligned - left)
            if right is not None:
                mask = mask & (keys <= aligned + right)
        return s, mask


def _gdpa_geometry(q, q_offsets, k_offsets):
    """``(q_lengths, k_lengths, q_starts, k_starts, out_starts, out_lengths, out_rows)``."""
    if q_offsets is None:  # PMA: every sample reads the same Nq rows
        k_lengths, k_starts = _lengths_and_starts(k_offsets)
        batch, nq = k_lengths.numel(), q.shape[0]
        q_lengths = torch.full((batch,), nq, dtype=torch.int64)
        q_starts = torch.zeros(batch, dtype=torch.int64)
        return q_lengths, k_lengths, q_starts, k_starts, q_starts + torch.arange(batch) * nq, (
            q_lengths
        ), batch * nq  # fmt: skip
    q_lengths, q_starts = _lengths_and_starts(q_offsets)
    k_lengths, k_starts = _lengths_and_starts(q_offsets if k_offsets is None else k_offsets)
    return q_lengths, k_lengths, q_starts, k_starts, q_starts, q_lengths, q.shape[0]


def gdpa_fp8_operands(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None,
    q_lengths: torch.Tensor | None,
    k_lengths: torch.Tensor | None,
    quantize: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> tuple[tuple[torch.Tensor | None, torch.Tensor | None], ...]:
    """E4M3 copies and per-token scales ``((q8, q_scale), (k8, k_scale), (v8, v_scale))`` of an
    FP8 GDPA call (:func:`quantize_fp8_blocks`; ``v=None`` gives ``(None, None)`` for v).
    ``q_lengths`` / ``k_lengths``: host ``(B,)`` lengths; ``q_lengths=None``: PMA, whose ``Nq``
    shared queries are one sample; ``k_lengths=None``: self-attention. The emulation and the
    Triton host code both call it; the latter passes its kernel as ``quantize``."""
    quantize = quantize or quantize_fp8_blocks
    if k_lengths is None:
        k_lengths = q_lengths
    own_q = torch.tensor([q.shape[0]]) if q_lengths is None else q_lengths
    return (
        quantize(q, own_q),
        quantize(k, k_lengths),
        (None, None) if v is None else quantize(v, k_lengths),
    )


def _gdpa_fp8_problem(
    q, k, v, q_offsets, k_offsets, *, activation, scale, causal, window, normalize_by_length,
    score_budget, quantize=True,
) -> _GdpaFp8Problem:  # fmt: skip
    """``quantize``: the E4M3 q, k, v (the forward), else the inputs (the backward)."""
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    q_lengths, k_lengths, q_starts, k_starts, out_starts, _, out_rows = _gdpa_geometry(
        q, q_offsets, k_offsets
    )
    if quantize:
        (q8, q_scale), (k8, k_scale), (v8, v_scale) = gdpa_fp8_operands(
            q, k, v, None if q_offsets is None else q_lengths, k_lengths
        )
        operands = [
            (x.float() * s[..., None]) for x, s in ((q8, q_scale), (k8, k_scale), (v8, v_scale))
        ]
    else:
        operands = [x.float() for x in (q, k, v)]
    q_heads, k_heads, v_heads = (x.transpose(0, 1) for x in operands)
    return _GdpaFp8Problem(
        q_lengths=q_lengths,
        k_lengths=k_lengths,
        q_starts=q_starts,
        k_starts=k_starts,
        out_starts=out_starts,
        out_rows=out_rows,
        q_heads=q_heads,
        k_heads=k_heads,
        v_heads=v_heads,
        scale=scale,
        activation=activation,
        causal=causal,
        window=window,
        normalize_by_length=normalize_by_length,
        score_budget=score_budget,
    )


def _gdpa_fp8_forward(
    q, k, v, q_offsets, k_offsets, *, activation, scale, causal, window, normalize_by_length,
    score_budget,
) -> torch.Tensor:  # fmt: skip
    """FP8 emulation of the GDPA forward, ``(out_rows, H, D)`` in q's dtype.

    As the kernels: scores from the E4M3 q and k in float32, A = act(s) (0 where masked), A
    through E4M3 with a power-of-two scale per row and ``FP8_ACT_TILE`` keys, A V from the
    E4M3 v accumulated in float32, then times 1 / k_len under ``normalize_by_length``."""
    problem = _gdpa_fp8_problem(
        q, k, v, q_offsets, k_offsets, activation=activation, scale=scale, causal=causal,
        window=window, normalize_by_length=normalize_by_length, score_budget=score_budget,
    )  # fmt: skip
    v8 = problem.v_heads
    heads, head_dim = q.shape[1], q.shape[2]
    out = torch.zeros(heads, problem.out_rows, head_dim, dtype=torch.float32, device=q.device)
    for q0, lq, k0, lk, o0, chunk in problem.samples():
        for r0 in range(0, lq, chunk):
            rows = torch.arange(r0, min(lq, r0 + chunk), device=q.device)
            s, mask = problem.scores(q0, lq, k0, lk, rows)
            a = torch.where(mask, gdpa_act_and_grad(s, activation)[0], 0.0)
            acc = torch.matmul(_quantize_act(a), v8[:, k0 : k0 + lk])
            if normalize_by_length:
                acc = acc * (1.0 / lk)
            out[:, o0 + rows] = acc
    return out.transpose(0, 1).to(q.dtype).contiguous()


def gdpa_fp8_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor | None,
    k_offsets: torch.Tensor | None = None,
    *,
    activation: str = "silu",
    scale: float | None = None,
    causal: bool = False,
    window: Window | None = None,
    normalize_by_length: bool = False,
    score_budget: int = DEFAULT_SCORE_BUDGET,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Emulation of the FP8 mode's GDPA backward: ``(dq, dk, dv)``.

    The backward of ``precision="fp8"`` runs no FP8 GEMM (on Hopper they were slower and no
    more accurate): as the bf16 kernels, scores from the input-precision q and k, A = act(s);
    dV = A^T dO with A rounded to the input dtype; dA = dO V^T in float32; dS = dA act'(s),
    rounded to the input dtype; dQ = dS K and dK = dS^T Q. Deterministic (PMA: dQ summed over
    the samples in order)."""
    problem = _gdpa_fp8_problem(
        q, k, v, q_offsets, k_offsets, activation=activation, scale=scale, causal=causal,
        window=window, normalize_by_length=normalize_by_length, score_budget=score_budget,
        quantize=False,
    )  # fmt: skip
    low = q.dtype
    q_heads, k_heads, v_heads = problem.q_heads, problem.k_heads, problem.v_heads
    do_heads = grad_out.float().transpose(0, 1)
    dq = torch.zeros_like(q_heads)
    dk = torch.zeros_like(k_heads)
    dv = torch.zeros_like(v_heads)
    for q0, lq, k0, lk, o0, chunk in problem.samples():
        keys = slice(k0, k0 + lk)
        norm = 1.0 / lk if normalize_by_length else 1.0
        dk_sample = torch.zeros_like(k_heads[:, keys])
        dv_sample = torch.zeros_like(v_heads[:, keys])
        for r0 in range(0, lq, chunk):
            rows = torch.arange(r0, min(lq, r0 + chunk), device=q.device)
            s, mask = problem.scores(q0, lq, k0, lk, rows)
            a, g = gdpa_act_and_grad(s, activation)
            a = torch.where(mask, a, 0.0)
            do = do_heads[:, o0 + rows]
            da = torch.matmul(do, v_heads[:, keys].transpose(-1, -2))
            ds = torch.where(mask, da * g, 0.0).to(low).float()
            dv_sample += torch.matmul(a.to(low).float().transpose(-1, -2), do)
            dk_sample += torch.matmul(ds.transpose(-1, -2), q_heads[:, q0 + rows])
            dq[:, q0 + rows] += torch.matmul(ds, k_heads[:, keys]) * (problem.scale * norm)
        dk[:, keys] = dk_sample * (problem.scale * norm)
        dv[:, keys] = dv_sample * norm
    return (
        dq.transpose(0, 1).to(q.dtype),
        dk.transpose(0, 1).to(k.dtype),
        dv.transpose(0, 1).to(v.dtype),
    )


class _GdpaFp8Function(torch.autograd.Function):
    """Autograd of the GDPA FP8 emulation for direct calls of the reference (the operators
    call the forward and :func:`gdpa_fp8_backward` themselves)."""

    @staticmethod
    def forward(ctx, q, k, v, q_offsets, k_offsets, options):
        ctx.save_for_backward(q, k, v)
        ctx.offsets = (q_offsets, k_offsets)
        ctx.options = options
        return _gdpa_fp8_forward(q, k, v, q_offsets, k_offsets, **options)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        q, k, v = ctx.saved_tensors
        grads = gdpa_fp8_backward(grad_out.contiguous(), q, k, v, *ctx.offsets, **ctx.options)
        return (*grads, None, None, None)


# ---------------------------------------------------------------------------------------------
# Reference entry points (validated input; see gem_kernels.attention for the public API).


def jagged_flash_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor,
    k_offsets: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    causal: bool = False,
    window: Window | None = None,
    rel_pos_bias: torch.Tensor | None = None,
    jagged_bias: torch.Tensor | None = None,
    score_budget: int = DEFAULT_SCORE_BUDGET,
    return_lse: bool = False,
    precision: str = "bf16",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention over jagged q ``(Tq,H,D)`` and k/v ``(Tk,H,D)``; returns ``(Tq,H,D)``.

    Same semantics as :func:`gem_kernels.jagged_flash_attention` without input checks;
    ``score_budget`` caps the elements of one score tensor. ``return_lse``: also return the
    softmax log-sum-exp ``(H, Tq)`` float32 in the Triton kernels' convention (log2 domain:
    ``log2(sum_j 2^(log2(e) * (scale * q.k_j + bias_j)))`` over the visible keys, ``+inf`` for
    rows without any), as the ``gem_kernels::jagged_flash_attention`` operator returns it.
    ``precision="fp8"`` (float16/bfloat16 inputs): the emulation of the FP8 kernels (see
    ``FP8_BLOCK``; differentiable, its backward is
    :func:`jagged_flash_attention_fp8_backward`); ``"bf16"``: exact up to the compute dtype.
    """
    if precision == "fp8":
        options = dict(scale=scale, causal=causal, window=window, score_budget=score_budget)
        out, lse = _Fp8AttentionFunction.apply(
            q, k, v, rel_pos_bias, jagged_bias, q_offsets, k_offsets, options
        )
        return (out, lse) if return_lse else out
    dtype = compute_dtype(q.dtype)
    q_lengths, q_starts = _lengths_and_starts(q_offsets)
    k_lengths, k_starts = _lengths_and_starts(q_offsets if k_offsets is None else k_offsets)
    out, lse = _jagged_attention_core(
        q.to(dtype),
        k.to(dtype),
        v.to(dtype),
        q_starts=q_starts,
        k_starts=k_starts,
        out_starts=q_starts,
        q_lengths=q_lengths,
        k_lengths=k_lengths,
        out_rows=q.shape[0],
        scale=q.shape[-1] ** -0.5 if scale is None else float(scale),
        activation=None,
        causal=causal,
        window=window,
        rel_pos_bias=_to_compute(rel_pos_bias, dtype),
        jagged_bias=_to_compute(jagged_bias, dtype),
        normalize_by_length=False,
        score_budget=score_budget,
        with_lse=return_lse,
    )
    return (out.to(q.dtype), lse) if return_lse else out.to(q.dtype)


def gdpa_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor | None,
    k_offsets: torch.Tensor | None = None,
    *,
    activation: str = "silu",
    scale: float | None = None,
    causal: bool = False,
    window: Window | None = None,
    normalize_by_length: bool = False,
    score_budget: int = DEFAULT_SCORE_BUDGET,
    precision: str = "bf16",
) -> torch.Tensor:
    """Generalized dot-product attention ``act(scale * Q K^T) V`` per sample, no softmax.

    Same semantics as :func:`gem_kernels.gdpa` without input checks. ``q_offsets=None`` with
    ``k_offsets`` given broadcasts the ``Nq`` rows of q to every sample (PMA); the output is then
    ``(B * Nq, H, D)``, sample-major. ``precision="fp8"`` (float16/bfloat16 inputs): the
    emulation of the FP8 kernels (see :func:`gdpa_fp8_operands`; differentiable, its backward
    is :func:`gdpa_fp8_backward`).
    """
    if precision == "fp8":
        if q_offsets is None and k_offsets is None:
            raise ValueError("gdpa_reference needs q_offsets or k_offsets")
        options = dict(
            activation=activation, scale=scale, causal=causal, window=window,
            normalize_by_length=normalize_by_length, score_budget=score_budget,
        )  # fmt: skip
        return _GdpaFp8Function.apply(q, k, v, q_offsets, k_offsets, options)
    dtype = compute_dtype(q.dtype)
    if q_offsets is None:
        if k_offsets is None:
            raise ValueError("gdpa_reference needs q_offsets or k_offsets")
        k_lengths, k_starts = _lengths_and_starts(k_offsets)
        num_queries, batch = q.shape[0], k_lengths.numel()
        q_lengths = torch.full((batch,), num_queries, dtype=torch.int64)
        q_starts = torch.zeros(batch, dtype=torch.int64)  # every sample reads the same rows
        out_starts = torch.arange(batch, dtype=torch.int64) * num_queries
        out_rows = batch * num_queries
    else:
        q_lengths, q_starts = _lengths_and_starts(q_offsets)
        k_lengths, k_starts = _lengths_and_starts(q_offsets if k_offsets is None else k_offsets)
        out_starts, out_rows = q_starts, q.shape[0]
    out, _ = _jagged_attention_core(
        q.to(dtype),
        k.to(dtype),
        v.to(dtype),
        q_starts=q_starts,
        k_starts=k_starts,
        out_starts=out_starts,
        q_lengths=q_lengths,
        k_lengths=k_lengths,
        out_rows=out_rows,
        scale=q.shape[-1] ** -0.5 if scale is None else float(scale),
        activation=gdpa_activation(activation),
        causal=causal,
        window=window,
        rel_pos_bias=None,
        jagged_bias=None,
        normalize_by_length=normalize_by_length,
        score_budget=score_budget,
    )
    return out.to(q.dtype)


def _default_positions(lengths: torch.Tensor, starts: torch.Tensor, device) -> torch.Tensor:
    total = int(lengths.sum())
    sample_of_token = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    return (torch.arange(total) - starts[sample_of_token]).to(device)


def block_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    *,
    block_size: int = 64,
    positions: torch.Tensor | None = None,
    rope_theta: float = 10000.0,
    scale: float | None = None,
    score_budget: int = DEFAULT_SCORE_BUDGET,
) -> torch.Tensor:
    """Softmax attention inside ``block_size``-token blocks of each sample, after RoPE on q, k.

    Same semantics as :func:`gem_kernels.block_attention` without input checks. Each block is
    treated as its own (non-causal) sequence, so padding is bounded by the block size.
    """
    dtype = compute_dtype(q.dtype)
    lengths, starts = _lengths_and_starts(offsets)
    if positions is None:
        positions = _default_positions(lengths, starts, q.device)
    q_rot = apply_rope(q.to(dtype), positions, rope_theta)
    k_rot = apply_rope(k.to(dtype), positions, rope_theta)

    # Blocks are contiguous row ranges, so they form a finer jagged layout of their own.
    blocks_per_sample = (lengths + block_size - 1) // block_size
    sample_of_block = torch.repeat_interleave(torch.arange(lengths.numel()), blocks_per_sample)
    first_block = torch.cumsum(blocks_per_sample, 0) - blocks_per_sample
    block_in_sample = torch.arange(sample_of_block.numel()) - first_block[sample_of_block]
    block_starts = starts[sample_of_block] + block_in_sample * block_size
    block_lengths = torch.clamp(
        lengths[sample_of_block] - block_in_sample * block_size, max=block_size
    )
    out, _ = _jagged_attention_core(
        q_rot,
        k_rot,
        v.to(dtype),
        q_starts=block_starts,
        k_starts=block_starts,
        out_starts=block_starts,
        q_lengths=block_lengths,
        k_lengths=block_lengths,
        out_rows=q.shape[0],
        scale=q.shape[-1] ** -0.5 if scale is None else float(scale),
        activation=None,
        causal=False,
        window=None,
        rel_pos_bias=None,
        jagged_bias=None,
        normalize_by_length=False,
        score_budget=score_budget,
    )
    return out.to(q.dtype)
