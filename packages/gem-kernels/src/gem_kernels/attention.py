"""Public functional attention API on jagged inputs.

Each entry point validates its arguments (clear errors naming the argument) and then runs its
operator, ``torch.ops.gem_kernels.{jagged_flash_attention, gdpa, block_attention}``
(:mod:`gem_kernels.ops`), which runs the Triton kernels of :mod:`gem_kernels.jfa_triton` (resp.
:mod:`gem_kernels.gdpa_triton`, :mod:`gem_kernels.block_attention_triton`) for CUDA
float16/bfloat16 inputs (``backend="auto"``) and the PyTorch reference in
:mod:`gem_kernels.reference` otherwise.

Under ``torch.compile`` these functions trace without graph breaks: the checks made here read
only shapes, dtypes, devices and Python arguments. The checks that read the offsets' values
(start at 0, non-decreasing, last entry = rows, ``max_*`` against the real lengths, the width of
``jagged_bias``) run inside the operator at call time, in eager and compiled code alike, with
the same messages: nothing is skipped under compilation, and those errors come from the
operator call.

Jagged layout: the tokens of all samples concatenated along dim 0, plus an ``offsets`` vector of
shape ``(B + 1,)`` (see :mod:`gem_kernels.jagged`). All tensors are ``(tokens, heads, head_dim)``.
bf16/fp16 inputs are computed in float32 and returned in the input dtype.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from gem_kernels import ops, reference
from gem_kernels.jagged import _check_offsets_layout

__all__ = [
    "BLOCK_ATTENTION_BACKENDS",
    "GDPA_BACKENDS",
    "GDPA_PRECISIONS",
    "JFA_BACKENDS",
    "JFA_PRECISIONS",
    "block_attention",
    "gdpa",
    "jagged_flash_attention",
    "rope",
    "rope_qkv",
    "swiglu",
]

#: Accepted values of ``jagged_flash_attention(backend=...)``.
JFA_BACKENDS = ops.BACKENDS

#: Accepted values of ``jagged_flash_attention(precision=...)``.
JFA_PRECISIONS = ops.PRECISIONS

#: Accepted values of ``gdpa(backend=...)``.
GDPA_BACKENDS = ops.BACKENDS

#: Accepted values of ``gdpa(precision=...)``.
GDPA_PRECISIONS = ops.PRECISIONS

#: Accepted values of ``block_attention(backend=...)``.
BLOCK_ATTENTION_BACKENDS = ops.BACKENDS

# The operators' overloads, looked up once (every call would otherwise resolve the names).
_JFA_OP = torch.ops.gem_kernels.jagged_flash_attention.default
_GDPA_OP = torch.ops.gem_kernels.gdpa.default
_BLOCK_OP = torch.ops.gem_kernels.block_attention.default
_ROPE_OP = torch.ops.gem_kernels.rope.default
_ROPE_QKV_OP = torch.ops.gem_kernels.rope_qkv.default
_SWIGLU_OP = torch.ops.gem_kernels.swiglu.default

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_FLOAT_DTYPE_NAMES = "float16, bfloat16, float32 or float64"

#: Window sides, declared max lengths and block sizes at or above this bound mean "unbounded"
#: (a window side or max length of ``None``; one block per sample): no tensor has 2**48 rows,
#: and the operators take 64-bit integers, which a larger Python int would overflow.
UNBOUNDED = 2**48


# ---------------------------------------------------------------------------------------------
# Argument checks.


def _check_float_tensor(tensor: object, name: str, rank: int, layout: str) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name} must have dtype {_FLOAT_DTYPE_NAMES}, got {tensor.dtype}")
    if tensor.dim() != rank:
        raise ValueError(f"{name} must be {rank}-D {layout}, got shape {tuple(tensor.shape)}")
    return tensor


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        _check_float_tensor(tensor, name, 3, "(tokens, heads, head_dim)")
    if q.shape[1] < 1 or q.shape[2] < 1:
        raise ValueError(f"q must have heads >= 1 and head_dim >= 1, got shape {tuple(q.shape)}")
    for name, tensor in (("k", k), ("v", v)):
        if tensor.shape[1] != q.shape[1]:
            raise ValueError(f"{name} has {tensor.shape[1]} heads but q has {q.shape[1]}")
        if tensor.shape[2] != q.shape[2]:
            raise ValueError(
                f"{name} has head_dim {tensor.shape[2]} but q has head_dim {q.shape[2]}"
            )
        if tensor.dtype != q.dtype:
            raise TypeError(
                f"q, k and v must share one dtype, got q {q.dtype}, {name} {tensor.dtype}"
            )
        if tensor.device != q.device:
            raise ValueError(f"{name} is on {tensor.device} but q is on {q.device}")
    if k.shape[0] != v.shape[0]:
        raise ValueError(
            f"k and v must have the same number of rows, got {k.shape[0]} and {v.shape[0]}"
        )


def _check_bool(value: object, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return value


def _finite_float(value: object, name: str, what: str = "a Python float") -> float:
    """``value`` (a Python int or float, not a bool) as a finite float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be {what}, got {type(value).__name__}")
    try:
        result = float(value)  # an int beyond float's range raises OverflowError
    except OverflowError:
        result = math.inf
    if not math.isfinite(result):
        raise ValueError(f"{name} must be finite, got {value!r:.40}")
    return result


def _resolve_scale(scale: object, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    return _finite_float(scale, "scale", "a Python float or None")


def _check_window(window: object) -> tuple[int | None, int | None] | None:
    if window is None:
        return None
    message = (
        "window must be None or a pair (left, right) of ints >= 0 (None = unbounded side), "
        f"got {window!r}"
    )
    if not isinstance(window, Sequence) or isinstance(window, str) or len(window) != 2:
        raise ValueError(message)
    for side in window:
        if side is None:
            continue
        if isinstance(side, bool) or not isinstance(side, int) or side < 0:
            raise ValueError(message)
    left, right = window[0], window[1]
    # A side of UNBOUNDED or more is no bound at all (and would overflow the operator's int64).
    return (
        None if left is None or left >= UNBOUNDED else left,
        None if right is None or right >= UNBOUNDED else right,
    )


def _check_max_len(max_len: object, name: str) -> int | None:
    """``max_len`` is None or an int >= 0 (the operator compares it with the real lengths);
    returns it, or None for ``UNBOUNDED`` and above (no length reaches it)."""
    if max_len is None:
        return None
    if isinstance(max_len, bool) or not isinstance(max_len, int):
        raise TypeError(f"{name} must be an int or None, got {max_len!r}")
    if max_len < 0:
        raise ValueError(f"{name} must be >= 0, got {max_len}")
    return None if max_len >= UNBOUNDED else max_len


def _check_offsets_device(offsets: torch.Tensor, name: str, device: torch.device) -> None:
    # Offsets may live on the CPU (the reference reads them there) or on the data's device.
    if offsets.device.type != "cpu" and offsets.device != device:
        raise ValueError(f"{name} is on {offsets.device} but the data is on {device}")


def _check_offsets(offsets: object, name: str, device: torch.device) -> None:
    _check_offsets_layout(offsets, name)
    _check_offsets_device(offsets, name, device)


def _check_jagged_pair(
    q: torch.Tensor,
    k: torch.Tensor,
    q_offsets: torch.Tensor,
    k_offsets: torch.Tensor | None,
    max_q: int | None,
    max_k: int | None,
) -> tuple[int | None, int | None]:
    """The checks of q/k offsets that read no values (the operator checks the values); returns
    ``(max_q, max_k)`` as the operator takes them (see :func:`_check_max_len`)."""
    _check_offsets(q_offsets, "q_offsets", q.device)
    if k_offsets is not None:
        _check_offsets(k_offsets, "k_offsets", q.device)
    ops.check_jagged_pair(q, k, q_offsets, k_offsets)
    return _check_max_len(max_q, "max_q"), _check_max_len(max_k, "max_k")


def _check_bias_tensor(bias: object, name: str, q: torch.Tensor, layout: str) -> torch.Tensor:
    _check_float_tensor(bias, name, 2, layout)
    if bias.shape[0] != q.shape[1]:
        raise ValueError(f"{name} has {bias.shape[0]} heads in dim 0 but q has {q.shape[1]}")
    if bias.device != q.device:
        raise ValueError(f"{name} is on {bias.device} but q is on {q.device}")
    return bias


def _check_positions(positions: object, x: torch.Tensor, name: str) -> None:
    """RoPE ``positions``: a ``(T,)`` int32/int64 tensor on the device of ``x`` (named ``name``)."""
    if not isinstance(positions, torch.Tensor):
        raise TypeError(f"positions must be a torch.Tensor, got {type(positions).__name__}")
    if positions.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"positions must have dtype int64 or int32, got {positions.dtype}")
    if positions.shape != (x.shape[0],):
        raise ValueError(
            f"positions must have shape (T,) = ({x.shape[0]},), got {tuple(positions.shape)}"
        )
    if positions.device != x.device:
        raise ValueError(f"positions is on {positions.device} but {name} is on {x.device}")


def _needs_backward(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd will call the operator's backward: the kernels then plan its work lists
    with the forward's, once per batch's lengths, instead of again inside the backward, where
    the host work would leave the GPU waiting. Under ``torch.compile`` this is decided at trace
    time (grad mode is guarded)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _check_backend(backend: object, accepted: tuple[str, ...]) -> str:
    if backend not in accepted:
        raise ValueError(f"backend must be one of {accepted}, got {backend!r}")
    return backend


def _check_precision(precision: object, q: torch.Tensor) -> str:
    if not isinstance(precision, str) or precision not in ops.PRECISIONS:
        raise ValueError(f"precision must be one of {ops.PRECISIONS}, got {precision!r}")
    if precision == "fp8" and q.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(
            f"precision='fp8' takes float16/bfloat16 q, k and v (quantised to E4M3 inside the "
            f"kernels), got {q.dtype}"
        )
    return precision


def _window_sides(window: tuple[int | None, int | None] | None) -> tuple[int | None, int | None]:
    return (None, None) if window is None else window


# ---------------------------------------------------------------------------------------------
# Public entry points.


def jagged_flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor,
    k_offsets: torch.Tensor | None = None,
    max_q: int | None = None,
    max_k: int | None = None,
    *,
    scale: float | None = None,
    causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
    rel_pos_bias: torch.Tensor | None = None,
    jagged_bias: torch.Tensor | None = None,
    backend: str = "auto",
    precision: str = "bf16",
) -> torch.Tensor:
    """Softmax attention of each sample's queries over its own keys (jagged layout).

    Args:
        q: ``(Tq, H, D)`` queries of all samples concatenated.
        k, v: ``(Tk, H, D)`` keys and values.
        q_offsets: ``(B + 1,)`` int offsets into q.
        k_offsets: ``(B + 1,)`` offsets into k/v; ``None`` = ``q_offsets`` (self-attention).
        max_q, max_k: declared max lengths; a real length above them raises ``ValueError``.
        scale: score multiplier, default ``1 / sqrt(D)``.
        causal: query ``i`` of a sample with lengths ``(Lq, Lk)`` sees keys
            ``j <= i + Lk - Lq`` (bottom-right aligned).
        window: ``(left, right)``: the query at aligned position ``p = i + Lk - Lq`` sees keys
            ``p - left <= j <= p + right`` (``None`` = unbounded side); intersected with causal.
        rel_pos_bias: ``(H, N)`` learned table added to the scores; entry
            ``clamp(p - j + N // 2, 0, N - 1)`` (distance 0 is the middle entry).
        jagged_bias: ``(H, sum_b Lq_b * Lk_b)`` additive bias, each sample's row-major
            ``Lq_b x Lk_b`` block concatenated over samples.
        backend: ``"auto"`` (default): the Triton kernels when q is a CUDA float16/bfloat16
            tensor and the call is within their limits, the PyTorch reference otherwise (CPU,
            float32/float64, head_dim > 256, ``rel_pos_bias`` with more than 2048 buckets, or
            Triton not importable); both compute the same function. ``"triton"``: the kernels
            or a ``ValueError`` saying why they cannot run (CPU tensors only under
            ``TRITON_INTERPRET=1``; float32 runs with IEEE-exact dot products).
            ``"reference"``: always the PyTorch reference.
        precision: ``"bf16"`` (default): GEMMs on the input dtype's operands. ``"fp8"``
            (float16/bfloat16 inputs): q, k, v quantised to E4M3 in blocks of
            ``reference.FP8_BLOCK`` tokens with power-of-two scales; the forward's Q K^T and
            P V run in FP8 (float32 accumulation); the backward runs in the input precision,
            given the FP8 forward's output and log-sum-exp. The reference backend runs an
            emulation with the kernels' numerics (``reference.jagged_flash_attention_fp8_*``).

    Returns:
        ``(Tq, H, D)`` in q's dtype. Rows that see no key (empty KV, or fully masked) are 0.
    """
    _check_qkv(q, k, v)
    max_q, max_k = _check_jagged_pair(q, k, q_offsets, k_offsets, max_q, max_k)
    resolved_scale = _resolve_scale(scale, q.shape[2])
    _check_bool(causal, "causal")
    left, right = _window_sides(_check_window(window))
    if rel_pos_bias is not None:
        _check_bias_tensor(rel_pos_bias, "rel_pos_bias", q, "(heads, num_buckets)")
        if rel_pos_bias.shape[1] < 1:
            raise ValueError("rel_pos_bias must have at least one bucket (shape (H, N), N >= 1)")
    if jagged_bias is not None:
        # Its width (sum_b Lq_b * Lk_b) depends on the offsets' values: checked by the operator.
        _check_bias_tensor(jagged_bias, "jagged_bias", q, "(heads, sum_b Lq_b * Lk_b)")
    _check_backend(backend, JFA_BACKENDS)
    _check_precision(precision, q)
    out, _ = _JFA_OP(
        q, k, v, q_offsets, k_offsets, rel_pos_bias, jagged_bias, max_q, max_k, resolved_scale,
        causal, left, right, backend, precision,
        _needs_backward(q, k, v, rel_pos_bias, jagged_bias),
    )  # fmt: skip
    return out


def gdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor | None = None,
    k_offsets: torch.Tensor | None = None,
    max_q: int | None = None,
    max_k: int | None = None,
    *,
    activation: str = "silu",
    scale: float | None = None,
    causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
    normalize_by_length: bool = False,
    backend: str = "auto",
    precision: str = "bf16",
) -> torch.Tensor:
    """Generalized dot-product attention: ``act(scale * Q K^T) V`` per sample, no softmax.

    Shapes:
        * self: ``q_offsets`` given, ``k_offsets=None`` -> keys share ``q_offsets``;
        * cross: both given (same B, lengths may differ);
        * PMA broadcast: ``q`` is ``(Nq, H, D)``, ``q_offsets=None``, ``k_offsets`` given -> the
          same Nq queries attend over every sample's keys; output ``(B * Nq, H, D)``,
          sample-major.

    Args:
        activation: ``"silu"``, ``"gelu"`` (exact erf), ``"gelu_tanh"``, ``"gelu_fast"``
            (polynomial, ALU only, max abs error < 1.2e-3, exact for |x| >= 3.42, see
            :func:`gem_kernels.reference.gelu_fast`), ``"relu2"`` (relu squared),
            ``"identity"``.
        scale: default ``1 / sqrt(D)``.
        causal, window: as in :func:`jagged_flash_attention` (bottom-right aligned).
            Masked positions contribute nothing.
        normalize_by_length: divide each sample's output by its KV length (0 keys -> zeros).
        max_q, max_k: declared max lengths (``max_q`` bounds Nq in PMA mode).
        backend: ``"auto"`` (default): the Triton kernels of :mod:`gem_kernels.gdpa_triton`
            when q is a CUDA float16/bfloat16 tensor with head_dim <= 256, the PyTorch
            reference otherwise (CPU, float32/float64, larger heads, Triton not importable);
            both compute the same function. ``"triton"``: the kernels or a ``ValueError``
            saying why they cannot run (CPU tensors only under ``TRITON_INTERPRET=1``; float32
            runs with IEEE-exact dot products). ``"reference"``: always the PyTorch reference.
        precision: ``"bf16"`` (default): GEMMs on the input dtype's operands. ``"fp8"``
            (float16/bfloat16 inputs): q, k, v quantised to E4M3 in blocks of
            ``reference.FP8_BLOCK`` tokens with power-of-two scales; Q K^T, A V (A divided by a
            power-of-two scale per query row and ``reference.FP8_ACT_TILE`` keys, from their
            maximum) run in FP8 with float32 accumulation; the backward runs in the input
            precision. The reference backend runs an emulation with the kernels' numerics
            (``reference.gdpa_fp8_backward``).

    Returns:
        Output in q's dtype: ``(Tq, H, D)``, or ``(B * Nq, H, D)`` in PMA mode.
    """
    _check_qkv(q, k, v)
    if not isinstance(activation, str) or activation not in reference.GDPA_ACTIVATIONS:
        raise ValueError(
            f"activation must be one of {sorted(reference.GDPA_ACTIVATIONS)}, got {activation!r}"
        )
    if q_offsets is None:
        if k_offsets is None:
            raise ValueError(
                "gdpa needs q_offsets (self/cross attention) or k_offsets (PMA broadcast with "
                "q_offsets=None); both are None"
            )
        _check_offsets(k_offsets, "k_offsets", q.device)
        max_q = _check_max_len(max_q, "max_q")
        ops.check_max_len(max_q, "max_q", q.shape[0], "query (Nq)")
        max_k = _check_max_len(max_k, "max_k")
    else:
        max_q, max_k = _check_jagged_pair(q, k, q_offsets, k_offsets, max_q, max_k)
    resolved_scale = _resolve_scale(scale, q.shape[2])
    _check_bool(causal, "causal")
    _check_bool(normalize_by_length, "normalize_by_length")
    left, right = _window_sides(_check_window(window))
    _check_backend(backend, GDPA_BACKENDS)
    _check_precision(precision, q)
    return _GDPA_OP(
        q, k, v, q_offsets, k_offsets, max_q, max_k, activation, resolved_scale, causal, left,
        right, normalize_by_length, backend, precision, _needs_backward(q, k, v),
    )  # fmt: skip


def block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    max_len: int | None = None,
    *,
    block_size: int = 64,
    positions: torch.Tensor | None = None,
    rope_theta: float = 10000.0,
    scale: float | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Softmax self-attention restricted to ``block_size``-token blocks, with RoPE on q and k.

    Block ``b`` of a sample holds its tokens ``[b * block_size, (b + 1) * block_size)``; the last
    block may be partial and blocks never cross samples. Attention inside a block is full
    (non-causal). Rotary embedding (rotate-half: pairs ``(x[..., i], x[..., i + D/2])``, angle
    ``position * rope_theta^(-2i/D)``) is applied to q and k before the scores.

    Args:
        q, k, v: ``(T, H, D)`` with ``D`` even.
        offsets: ``(B + 1,)`` int offsets shared by q, k and v.
        max_len: declared max sample length; a longer sample raises ``ValueError``.
        block_size: tokens per block, ``>= 1``.
        positions: ``(T,)`` integer RoPE positions; default: index of each token in its sample.
        rope_theta: RoPE base, ``> 0``.
        scale: default ``1 / sqrt(D)``.
        backend: ``"auto"`` (default): the fused Triton kernels (RoPE applied in-kernel, one
            forward and one backward kernel) when q is a CUDA float16/bfloat16 tensor and the
            call is within their limits, the PyTorch reference otherwise (CPU, float32/float64,
            head_dim > 256, block_size > 128, or Triton not importable); both compute the same
            function. ``"triton"``: the kernels or a ``ValueError`` saying why they cannot run
            (CPU tensors only under ``TRITON_INTERPRET=1``; float32 runs with IEEE-exact dot
            products). ``"reference"``: always the PyTorch reference.

    Returns:
        ``(T, H, D)`` in q's dtype.
    """
    _check_qkv(q, k, v)
    if k.shape[0] != q.shape[0]:
        raise ValueError(
            f"k and v must have as many rows as q ({q.shape[0]}) for block attention, "
            f"got {k.shape[0]}"
        )
    if q.shape[2] % 2 != 0:
        raise ValueError(f"head_dim must be even for rotary embedding, got {q.shape[2]}")
    _check_offsets(offsets, "offsets", q.device)
    max_len = _check_max_len(max_len, "max_len")
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise TypeError(f"block_size must be an int, got {block_size!r}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    block_size = min(block_size, UNBOUNDED)  # one block per sample either way
    theta = _finite_float(rope_theta, "rope_theta")
    if theta <= 0:
        raise ValueError(f"rope_theta must be finite and > 0, got {rope_theta}")
    if positions is not None:
        _check_positions(positions, q, "q")
    resolved_scale = _resolve_scale(scale, q.shape[2])
    _check_backend(backend, BLOCK_ATTENTION_BACKENDS)
    return _BLOCK_OP(
        q, k, v, offsets, positions, max_len, block_size, theta, resolved_scale, backend,
    )  # fmt: skip


def rope(
    x: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """Rotary embedding of q or k rows before :func:`jagged_flash_attention` (rotate-half: pairs
    ``(x[..., i], x[..., i + D/2])`` rotated by the tables' angle ``i`` at each row's position).

    Args:
        x: ``(T, H, D)``, ``D`` even; any strides (a slice of a fused qkv projection is read in
            place).
        positions: ``(T,)`` int64 or int32, each row's position, every one in ``[0, L)``
            (checked for CPU tensors; on a GPU, where the check would synchronise, a row
            outside the tables comes out as zeros).
        cos, sin: ``(L, D/2)`` float32 tables of the angles'
            cosines and sines, as :func:`gem_kernels.reference.rope_tables` builds them.
        backend: ``"auto"`` (default): one Triton kernel for CUDA float16/bfloat16 ``x``, the
            PyTorch reference otherwise; ``"triton"``: the kernel or a ``ValueError`` saying
            why it cannot run (CPU tensors only under ``TRITON_INTERPRET=1``);
            ``"reference"``: always the reference
            (:func:`gem_kernels.reference.apply_rope`).

    Returns:
        ``(T, H, D)`` contiguous, in x's dtype. The gradient is the inverse rotation, one more
        kernel: no slices or concatenations for autograd to undo.
    """
    _check_float_tensor(x, "x", 3, "(tokens, heads, head_dim)")
    _check_rope_arguments(x, "x", positions, cos, sin, backend)
    return _ROPE_OP(x, positions, cos, sin, False, backend)


def rope_qkv(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`rope` of q and k taken from a fused qkv projection, with v: ``(q, k, v)``.

    The same rotations as ``rope`` on ``qkv[:, 0]`` and ``qkv[:, 1]``, and ``v`` a copy of
    ``qkv[:, 2]``. What it adds is the gradient: one ``(T, 3, H, D)`` tensor, written by the
    two inverse rotations and v's copy into their slices, where unbinding ``qkv`` and calling
    ``rope`` twice has autograd rotate into two new tensors and stack all three again.

    Args:
        qkv: ``(T, 3, H, D)``, ``D`` even; any strides with a contiguous last dimension (the
            fused projection's output viewed as ``(T, 3, H, D)``).
        positions, cos, sin, backend: as in :func:`rope`.

    Returns:
        ``(q, k, v)``, each ``(T, H, D)`` contiguous in qkv's dtype.
    """
    _check_float_tensor(qkv, "qkv", 4, "(tokens, 3, heads, head_dim)")
    if qkv.shape[1] != 3:
        raise ValueError(f"qkv must be (tokens, 3, heads, head_dim), got shape {tuple(qkv.shape)}")
    _check_rope_arguments(qkv[:, 0], "qkv", positions, cos, sin, backend)
    return _ROPE_QKV_OP(qkv, positions, cos, sin, backend)


def _check_rope_arguments(x, name, positions, cos, sin, backend) -> None:
    """The checks of :func:`rope` after ``x``'s own, for ``x`` ``(T, H, D)`` (named ``name``)."""
    if x.shape[2] % 2 != 0:
        raise ValueError(f"{name}'s head_dim must be even for rotary embedding, got {x.shape[2]}")
    _check_positions(positions, x, name)
    for table_name, table in (("cos", cos), ("sin", sin)):
        if not isinstance(table, torch.Tensor):
            raise TypeError(f"{table_name} must be a torch.Tensor, got {type(table).__name__}")
        if table.dtype != torch.float32:
            raise TypeError(f"{table_name} must have dtype float32, got {table.dtype}")
        if table.dim() != 2 or table.shape[1] != x.shape[2] // 2:
            raise ValueError(
                f"{table_name} must be (positions, head_dim / 2) = (L, {x.shape[2] // 2}), got "
                f"shape {tuple(table.shape)}"
            )
    if cos.shape != sin.shape:
        raise ValueError(
            f"cos and sin must have one shape, got {tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    for table_name, tensor in (("cos", cos), ("sin", sin)):
        if tensor.device != x.device:
            raise ValueError(f"{table_name} is on {tensor.device} but {name} is on {x.device}")
    # Read on the host only where that is free: on a GPU it would synchronise every call, and
    # the kernel reads no table row outside [0, L) (such rows come out as zeros).
    if positions.device.type == "cpu" and positions.numel() and not torch.compiler.is_compiling():
        low, high = int(positions.min()), int(positions.max())
        if low < 0 or high >= cos.shape[0]:
            raise ValueError(
                f"positions must lie in [0, {cos.shape[0]}) (the tables' rows), got values from "
                f"{low} to {high}"
            )
    _check_backend(backend, ops.BACKENDS)


def swiglu(
    hidden: torch.Tensor, bias: torch.Tensor | None = None, *, backend: str = "auto"
) -> torch.Tensor:
    """SwiGLU's gate after a fused up projection: ``silu(gate) * value`` of the two halves
    ``(gate, value) = (hidden + bias).chunk(2, dim=-1)``, the FFN of the sequence layers.

    Args:
        hidden: ``(..., 2H)``, the last dimension even: the up projection's output.
        bias: ``None`` or the up projection's ``(2H,)`` bias, added here instead of in the GEMM
            so that its gradient comes out of the backward kernel (its column sums of hidden's
            gradient) instead of a second read of that gradient.
        backend: ``"auto"`` (default): one Triton kernel each way for CUDA float16/bfloat16
            ``hidden``, the PyTorch reference otherwise; ``"triton"``: the kernels or a
            ``ValueError`` saying why they cannot run (CPU tensors only under
            ``TRITON_INTERPRET=1``); ``"reference"``: always
            :func:`gem_kernels.reference.swiglu_reference`.

    Returns:
        ``(..., H)`` in hidden's dtype, computed in float32 and rounded once. The gradient is one
        kernel that writes both halves of hidden's gradient from one read of the gate, the
        value and the output gradient, and sums the bias's gradient (in the bias's dtype) in
        float32 in a fixed order.
    """
    if not isinstance(hidden, torch.Tensor):
        raise TypeError(f"hidden must be a torch.Tensor, got {type(hidden).__name__}")
    if hidden.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"hidden must have dtype {_FLOAT_DTYPE_NAMES}, got {hidden.dtype}")
    if hidden.dim() < 1 or hidden.shape[-1] % 2 != 0:
        raise ValueError(
            f"hidden's last dimension must be even (gate and value halves), got shape "
            f"{tuple(hidden.shape)}"
        )
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"bias must be None or a torch.Tensor, got {type(bias).__name__}")
        if bias.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"bias must have dtype {_FLOAT_DTYPE_NAMES}, got {bias.dtype}")
        if bias.shape != hidden.shape[-1:] or bias.device != hidden.device:
            raise ValueError(
                f"bias must have shape ({hidden.shape[-1]},) on {hidden.device} like hidden's "
                f"last dimension, got shape {tuple(bias.shape)} on {bias.device}"
            )
    _check_backend(backend, ops.BACKENDS)
    rows = hidden.reshape(-1, hidden.shape[-1])
    return _SWIGLU_OP(rows, bias, backend).view(*hidden.shape[:-1], hidden.shape[-1] // 2)
