"""The attention kernels as PyTorch operators (``torch.ops.gem_kernels.*``).

The public functions of :mod:`gem_kernels.attention` check their arguments and run these
operators; ``torch.compile`` sees each call as one opaque node (shapes from the fake
implementations below), so a model using them compiles without graph breaks, and AOTAutograd
or compiled autograd trace the registered backward, itself an operator:

==========================================================  =====================================
operator                                                    returns
==========================================================  =====================================
``jagged_flash_attention(q, k, v, q_offsets, k_offsets,     ``(out (Tq, H, D) q.dtype,
rel_pos_bias, jagged_bias, max_q, max_k, scale, causal,     lse (H, Tq) float32)``
window_left, window_right, backend, precision)``
``jagged_flash_attention_backward(grad_out, q, k, v, out,   ``[dq, dk, dv]`` + ``d_rel_pos_bias``
lse, q_offsets, k_offsets, rel_pos_bias, jagged_bias,       and ``d_jagged_bias`` for the biases
scale, causal, window_left, window_right, backend,          given
precision)``
``gdpa(q, k, v, q_offsets, k_offsets, max_q, max_k,         ``(Tq, H, D)``, PMA ``(B * Nq, H, D)``
activation, scale, causal, window_left, window_right,
normalize_by_length, backend, precision)``
``gdpa_backward(grad_out, q, k, v, q_offsets, k_offsets,    ``(dq, dk, dv)``
activation, scale, causal, window_left, window_right,
normalize_by_length, backend, precision)``
``block_attention(q, k, v, offsets, positions, max_len,     ``(T, H, D)``
block_size, rope_theta, scale, backend)``
``block_attention_backward(grad_out, q, k, v, offsets,      ``(dq, dk, dv)``
positions, block_size, rope_theta, scale, backend)``
``rope(x, positions, cos, sin, inverse, backend)``           ``(T, H, D)``, contiguous; its
                                                            gradient is ``rope`` with
                                                            ``not inverse``
``rope_qkv(qkv, positions, cos, sin, backend)``              ``(q, k, v)`` of ``(T, 3, H, D)``:
                                                            q, k rotated, v copied, each
                                                            contiguous
``rope_qkv_backward(grad_q, grad_k, grad_v, positions,      ``(T, 3, H, D)``
cos, sin, backend)``
``swiglu(hidden, bias, backend)``                            ``(T, H)`` of ``(T, 2H)``
``swiglu_backward(grad_out, hidden, bias, backend)``         ``(T, 2H)``, bias grad or ``(0,)``
==========================================================  =====================================

(exact schemas: ``_*_SCHEMA`` below). Arguments mean what they mean in the public functions,
resolved: ``scale`` is a float, a window is two optional ints (``None``: unbounded side; both
``None``: no window), ``backend`` is ``"auto"``, ``"triton"`` or ``"reference"``, ``precision``
(default ``"bf16"``) ``"bf16"`` or ``"fp8"``. ``lse`` is the
softmax log-sum-exp the Triton backward reads (log2 domain, ``+inf`` for rows without keys; the
reference computes the same); it is not differentiable.

Opaque operators, not ``torch.library.triton_op``: every call first reads the offsets on the
host (one cached copy per offsets tensor) to validate them and to build its tile tables, and
chooses between the Triton kernels and the PyTorch reference at run time. A traced
(``triton_op``) body cannot read tensor values, so the operators stay opaque to Inductor; the
kernels are hand-fused already. They are defined with ``torch.library.Library`` and get their
fake and autograd implementations from ``torch.library.register_fake`` / ``register_autograd``
(``gem_kernels.library.OperatorLibrary`` says why not ``torch.library.custom_op``). Each
backward operator's own autograd formula raises: the backward is once-differentiable.

What runs at call time, inside the operator (never traced, so never a graph break, in eager
and compiled code alike): the checks that read offsets values (start at 0, non-decreasing,
last entry = rows, ``max_*`` against the real lengths, ``jagged_bias`` width), the backend
choice, and the host planning. The public functions keep every check that reads no values.

Backward on the reference path: it recomputes the reference forward with autograd (the
forward operator cannot hand an autograd graph to the backward one), so gradients are those
plain autograd gave before, at the cost of one more reference forward. The Triton path runs
the kernels the ``autograd.Function`` s of :mod:`gem_kernels.jfa_triton` (and of the GDPA and
BlockAttention modules) run, on the same prepared inputs.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Sequence
from types import ModuleType

import torch

from gem_kernels import reference
from gem_kernels.jagged import host_lengths, validated_lengths
from gem_kernels.library import OperatorLibrary

__all__ = ["BACKENDS", "PRECISIONS", "check_jagged_pair", "check_max_len"]

#: Accepted ``backend`` values of every operator (and public function).
BACKENDS = ("auto", "triton", "reference")

#: Accepted ``precision`` values of the jagged flash attention and GDPA operators: the GEMM operand
#: format (``"fp8"``: E4M3 with power-of-two block scales, see ``reference.FP8_BLOCK``).
PRECISIONS = ("bf16", "fp8")

Window = tuple[int | None, int | None] | None

_JFA_SCHEMA = (
    "(Tensor q, Tensor k, Tensor v, Tensor q_offsets, Tensor? k_offsets, Tensor? rel_pos_bias, "
    "Tensor? jagged_bias, SymInt? max_q, SymInt? max_k, float scale, bool causal, "
    'SymInt? window_left, SymInt? window_right, str backend, str precision="bf16", '
    "bool plan_backward=False) -> (Tensor, Tensor)"
)
_JFA_BACKWARD_SCHEMA = (
    "(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor q_offsets, "
    "Tensor? k_offsets, Tensor? rel_pos_bias, Tensor? jagged_bias, float scale, bool causal, "
    'SymInt? window_left, SymInt? window_right, str backend, str precision="bf16") '
    "-> Tensor[]"
)
_GDPA_SCHEMA = (
    "(Tensor q, Tensor k, Tensor v, Tensor? q_offsets, Tensor? k_offsets, SymInt? max_q, "
    "SymInt? max_k, str activation, float scale, bool causal, SymInt? window_left, "
    'SymInt? window_right, bool normalize_by_length, str backend, str precision="bf16", '
    "bool plan_backward=False) -> Tensor"
)
_GDPA_BACKWARD_SCHEMA = (
    "(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor? q_offsets, Tensor? k_offsets, "
    "str activation, float scale, bool causal, SymInt? window_left, SymInt? window_right, "
    'bool normalize_by_length, str backend, str precision="bf16") -> (Tensor, Tensor, Tensor)'
)
_BLOCK_SCHEMA = (
    "(Tensor q, Tensor k, Tensor v, Tensor offsets, Tensor? positions, SymInt? max_len, "
    "SymInt block_size, float rope_theta, float scale, str backend) -> Tensor"
)
_BLOCK_BACKWARD_SCHEMA = (
    "(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor offsets, Tensor? positions, "
    "SymInt block_size, float rope_theta, float scale, str backend) -> (Tensor, Tensor, Tensor)"
)
_ROPE_SCHEMA = (
    "(Tensor x, Tensor positions, Tensor cos, Tensor sin, bool inverse, str backend) -> Tensor"
)

_ROPE_QKV_SCHEMA = (
    "(Tensor qkv, Tensor positions, Tensor cos, Tensor sin, str backend) "
    "-> (Tensor, Tensor, Tensor)"
)
_ROPE_QKV_BACKWARD_SCHEMA = (
    "(Tensor grad_q, Tensor grad_k, Tensor grad_v, Tensor positions, Tensor cos, Tensor sin, "
    "str backend) -> Tensor"
)

_SWIGLU_SCHEMA = "(Tensor hidden, Tensor? bias, str backend) -> Tensor"
_SWIGLU_BACKWARD_SCHEMA = (
    "(Tensor grad_out, Tensor hidden, Tensor? bias, str backend) -> (Tensor, Tensor)"
)

_LIBRARY = OperatorLibrary("gem_kernels")
_operator, _fake, _autograd = _LIBRARY.operator, _LIBRARY.fake, _LIBRARY.autograd
_once_differentiable = _LIBRARY.once_differentiable


def _qkv_autograd(
    name: str, *, saved: int, options_from: int, options_to: int | None = None
) -> None:
    """Fake and autograd of ``gem_kernels::<name>``, whose gradients are those of its
    ``<name>_backward`` operator, ``(dq, dk, dv)``: the backward takes ``grad_out``, the
    forward's first ``saved`` inputs (q, k, v and the offsets-like tensors) and its inputs
    ``options_from:options_to``; the forward's other inputs get no gradient."""
    backward_op = getattr(torch.ops.gem_kernels, f"{name}_backward").default

    @_fake(f"{name}_backward")
    def _backward_fake(grad_out, q, k, v, *_):
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs[:saved])
        ctx.options = inputs[options_from:options_to]
        ctx.num_inputs = len(inputs)

    def backward(ctx, grad_out):
        dq, dk, dv = backward_op(grad_out, *ctx.saved_tensors, *ctx.options)
        return (dq, dk, dv) + (None,) * (ctx.num_inputs - 3)

    _autograd(name, backward, setup_context)
    _once_differentiable(f"{name}_backward")


# ---------------------------------------------------------------------------------------------
# Checks that read offsets values (run at call time) and the backend choice.


def check_max_len(
    max_len: int | None,
    name: str,
    lengths: torch.Tensor | int,
    what: str,
    longest: int | None = None,
) -> None:
    """``max_len`` (None, or an int already type-checked) is >= every length (``lengths``: a
    host tensor, or one int, such as a dimension: symbolic under ``torch.compile``).
    ``longest``: ``lengths.max()`` where the caller knows it already."""
    if max_len is None:
        return
    if not isinstance(lengths, torch.Tensor):
        if lengths > max_len:
            raise ValueError(f"{name}={max_len} is smaller than the real {what}: {lengths}")
        return
    if lengths.numel() > 0:
        if longest is None:
            longest = int(lengths.max())
        if longest > max_len:
            sample = int(torch.argmax(lengths))
            raise ValueError(
                f"{name}={max_len} is smaller than a real {what} length: sample {sample} has "
                f"{longest}"
            )


def check_jagged_pair(q, k, q_offsets: torch.Tensor, k_offsets: torch.Tensor | None) -> None:
    """The shape checks of a q / k offsets pair: keys sharing ``q_offsets`` need as many rows
    as q; two offsets vectors describe the same number of samples."""
    if k_offsets is None:
        if k.shape[0] != q.shape[0]:
            raise ValueError(
                "k_offsets is None, so keys share q_offsets and k must have as many rows as q "
                f"({q.shape[0]}), got {k.shape[0]}"
            )
    elif k_offsets.shape[0] != q_offsets.shape[0]:
        raise ValueError(
            f"k_offsets has B={k_offsets.shape[0] - 1} samples but q_offsets has "
            f"B={q_offsets.shape[0] - 1}; they must describe the same batch"
        )


def _jagged_lengths(q, k, q_offsets, k_offsets, max_q, max_k):
    """Validated host ``(q_lengths, k_lengths)``; ``k_lengths`` is ``q_lengths`` when
    ``k_offsets`` is None. Offsets checks are remembered per tensor version (free when every
    layer passes the same offsets); the shape checks run again for direct operator calls."""
    check_jagged_pair(q, k, q_offsets, k_offsets)
    q_lengths, q_longest = validated_lengths(q_offsets, "q_offsets", num_rows=q.shape[0])
    k_lengths, k_longest = q_lengths, q_longest
    if k_offsets is not None:
        k_lengths, k_longest = validated_lengths(k_offsets, "k_offsets", num_rows=k.shape[0])
    check_max_len(max_q, "max_q", q_lengths, "query", q_longest)
    check_max_len(max_k, "max_k", k_lengths, "key", k_longest)
    return q_lengths, k_lengths


def _window(left: int | None, right: int | None) -> Window:
    return None if left is None and right is None else (left, right)


def _triton_module(
    backend: str, q: torch.Tensor, name: str, unsupported: Callable[[ModuleType], str | None]
) -> ModuleType | None:
    """The Triton module ``gem_kernels.<name>`` when this call runs its kernels, else None
    (the reference). ``"auto"`` tries them for CUDA float16/bfloat16 inputs and falls back to
    the reference for calls they do not take (``unsupported`` says why); ``"triton"`` raises
    that reason instead."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "reference":
        return None
    if backend == "auto" and not (
        q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16)
    ):
        return None
    # Imported here so that the reference path never loads Triton.
    module = importlib.import_module(f"gem_kernels.{name}")
    reason = unsupported(module)
    if reason is None:
        return module
    if backend == "triton":
        raise ValueError(f"backend='triton' cannot run this call: {reason}")
    return None


# What an operator's implementation runs without: the dispatcher calls it below autograd.
_AUTOGRAD_KEYS = (
    torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradFunctionality)
    | torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradOther)
    | torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradNestedTensor)
    | torch._C.DispatchKeySet(torch._C.DispatchKey.ADInplaceOrView)
)


def _reference_grads(
    forward: Callable[..., torch.Tensor],
    primals: Sequence[torch.Tensor],
    grad_out: torch.Tensor,
) -> list[torch.Tensor]:
    """Gradients of ``forward(*primals)`` for ``grad_out``, by autograd over a recomputed
    forward (the forward operator cannot hand its autograd graph to the backward one).

    An operator's implementation runs with the autograd dispatch keys excluded, so they are
    let back in for the recomputation. ``torch.func.vjp`` would need no private API, but it
    fails under the ``TorchDispatchMode`` s ``opcheck`` runs the operator in: its wrapper
    tensors reach the mode without storage."""
    include = torch._C._dispatch_tls_local_include_set()
    exclude = torch._C._dispatch_tls_local_exclude_set() - _AUTOGRAD_KEYS
    with torch._C._ForceDispatchKeyGuard(include, exclude), torch.enable_grad():
        leaves = [t.detach().requires_grad_(True) for t in primals]
        grads = torch.autograd.grad(forward(*leaves), leaves, grad_out, allow_unused=True)
    # A bias no visible pair reads (every sample empty) gets no gradient from autograd.
    return [torch.zeros_like(t) if g is None else g for t, g in zip(leaves, grads, strict=True)]


def _fresh(grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    # Contiguous, as the fake implementations promise (autograd's gradients of transposed
    # views come back transposed).
    return [g.contiguous() for g in grads]


# ---------------------------------------------------------------------------------------------
# Jagged flash attention.


@_operator("jagged_flash_attention", _JFA_SCHEMA)
def _jfa(
    q, k, v, q_offsets, k_offsets, rel_pos_bias, jagged_bias, max_q, max_k, scale, causal,
    window_left, window_right, backend, precision="bf16", plan_backward=False,
):  # fmt: skip
    _check_precision(precision, q)
    q_lengths, k_lengths = _jagged_lengths(q, k, q_offsets, k_offsets, max_q, max_k)
    if jagged_bias is not None:
        expected = int((q_lengths * k_lengths).sum())
        if jagged_bias.shape[1] != expected:
            raise ValueError(
                f"jagged_bias must have shape (H, sum_b Lq_b * Lk_b) = ({q.shape[1]}, {expected}), "
                f"got {tuple(jagged_bias.shape)}"
            )
    options = dict(
        scale=scale,
        causal=causal,
        window=_window(window_left, window_right),
        rel_pos_bias=rel_pos_bias,
        jagged_bias=jagged_bias,
    )
    triton = _jfa_triton(backend, q, rel_pos_bias, jagged_bias, scale, precision)
    if triton is not None:
        return triton.forward_from_lengths(
            q, k, v, q_lengths, k_lengths, precision=precision, plan_backward=plan_backward,
            **options,
        )  # fmt: skip
    return reference.jagged_flash_attention_reference(
        q, k, v, q_offsets, k_offsets, return_lse=True, precision=precision, **options
    )


def _check_precision(precision, q) -> None:
    """``precision`` of a direct operator call (the public function checks it first)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "fp8" and q.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"precision='fp8' takes float16/bfloat16 q, k and v, got {q.dtype}")


#: Smallest non-zero ``|scale|`` the Triton JFA kernels take with a bias: they add the bias
#: divided by the scale to q.k in float32, which overflows for smaller scales (and any bias
#: below 2**60). Such calls run the reference instead (``backend="auto"``).
MIN_TRITON_BIAS_SCALE = 2.0**-60


def _jfa_triton(backend, q, rel_pos_bias, jagged_bias, scale, precision) -> ModuleType | None:
    def unsupported(module: ModuleType) -> str | None:
        reason = module.triton_unsupported_reason(
            q, rel_pos_bias=rel_pos_bias, jagged_bias=jagged_bias, precision=precision
        )
        biased = rel_pos_bias is not None or jagged_bias is not None
        if reason is None and biased and 0.0 < abs(scale) < MIN_TRITON_BIAS_SCALE:
            reason = (
                f"scale={scale!r} is below {MIN_TRITON_BIAS_SCALE!r} in magnitude with a bias "
                "(the kernels add bias / scale in float32)"
            )
        return reason

    return _triton_module(backend, q, "jfa_triton", unsupported)


@_fake("jagged_flash_attention")
def _jfa_fake(q, k, v, q_offsets, k_offsets, rel_pos_bias, jagged_bias, *_):
    return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@_operator("jagged_flash_attention_backward", _JFA_BACKWARD_SCHEMA)
def _jfa_backward_impl(
    grad_out, q, k, v, out, lse, q_offsets, k_offsets, rel_pos_bias, jagged_bias, scale, causal,
    window_left, window_right, backend, precision="bf16",
):  # fmt: skip
    _check_precision(precision, q)
    options = dict(scale=scale, causal=causal, window=_window(window_left, window_right))
    triton = _jfa_triton(backend, q, rel_pos_bias, jagged_bias, scale, precision)
    if triton is not None:
        grads = triton.backward_from_lengths(
            grad_out, q, k, v, out, lse, host_lengths(q_offsets),
            None if k_offsets is None else host_lengths(k_offsets),
            rel_pos_bias=rel_pos_bias, jagged_bias=jagged_bias, **options,
        )  # fmt: skip
        return _fresh([g for g in grads if g is not None])
    if precision == "fp8":
        # As the kernels: the bf16 backward normalised by the FP8 forward's lse (autograd over
        # the reference would recompute its own).
        grads = reference.jagged_flash_attention_fp8_backward(
            grad_out.contiguous(), q, k, v, out, lse, q_offsets, k_offsets,
            rel_pos_bias=rel_pos_bias, jagged_bias=jagged_bias, **options,
        )  # fmt: skip
        return _fresh([g for g in grads if g is not None])
    has_rel, has_jagged = rel_pos_bias is not None, jagged_bias is not None

    def forward(q, k, v, *biases):
        biases = list(biases)
        return reference.jagged_flash_attention_reference(
            q, k, v, q_offsets, k_offsets,
            rel_pos_bias=biases.pop(0) if has_rel else None,
            jagged_bias=biases.pop(0) if has_jagged else None,
            **options,
        )  # fmt: skip

    primals = [t for t in (q, k, v, rel_pos_bias, jagged_bias) if t is not None]
    return _fresh(_reference_grads(forward, primals, grad_out))


_JFA_BACKWARD_OP = torch.ops.gem_kernels.jagged_flash_attention_backward.default


@_fake("jagged_flash_attention_backward")
def _jfa_backward_fake(
    grad_out, q, k, v, out, lse, q_offsets, k_offsets, rel_pos_bias, jagged_bias, *_
):
    inputs = (q, k, v, rel_pos_bias, jagged_bias)
    return [t.new_empty(t.shape) for t in inputs if t is not None]


def _jfa_setup_context(ctx, inputs, output):
    q, k, v, q_offsets, k_offsets, rel_pos_bias, jagged_bias = inputs[:7]
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, out, lse, q_offsets, k_offsets, rel_pos_bias, jagged_bias)
    # scale, causal, window_left, window_right, backend, precision (not plan_backward)
    ctx.options = tuple(inputs[9:15])
    ctx.num_inputs = len(inputs)


def _jfa_backward(ctx, grad_out, _grad_lse):
    q, k, v, out, lse, q_offsets, k_offsets, rel_pos_bias, jagged_bias = ctx.saved_tensors
    grads = _JFA_BACKWARD_OP(
        grad_out, q, k, v, out, lse, q_offsets, k_offsets, rel_pos_bias, jagged_bias,
        *ctx.options,
    )  # fmt: skip
    dq, dk, dv, *bias_grads = grads
    d_rel = bias_grads.pop(0) if rel_pos_bias is not None else None
    d_jagged = bias_grads.pop(0) if jagged_bias is not None else None
    return (dq, dk, dv, None, None, d_rel, d_jagged) + (None,) * (ctx.num_inputs - 7)


_autograd("jagged_flash_attention", _jfa_backward, _jfa_setup_context)
_once_differentiable("jagged_flash_attention_backward")


# ---------------------------------------------------------------------------------------------
# GDPA.


def _gdpa_lengths(q, k, q_offsets, k_offsets, max_q, max_k):
    """Validated host ``(q_lengths, k_lengths)``: ``q_lengths`` None for PMA broadcast
    (``q_offsets`` None), ``k_lengths`` None for self-attention (``k_offsets`` None)."""
    if q_offsets is None:
        if k_offsets is None:
            raise ValueError(
                "gdpa needs q_offsets (self/cross attention) or k_offsets (PMA broadcast with "
                "q_offsets=None); both are None"
            )
        k_lengths, k_longest = validated_lengths(k_offsets, "k_offsets", num_rows=k.shape[0])
        check_max_len(max_q, "max_q", q.shape[0], "query (Nq)")
        check_max_len(max_k, "max_k", k_lengths, "key", k_longest)
        return None, k_lengths
    q_lengths, k_lengths = _jagged_lengths(q, k, q_offsets, k_offsets, max_q, max_k)
    return q_lengths, None if k_offsets is None else k_lengths


def _gdpa_triton(backend, q, precision="bf16") -> ModuleType | None:
    return _triton_module(
        backend, q, "gdpa_triton", lambda m: m.triton_unsupported_reason(q, precision=precision)
    )


@_operator("gdpa", _GDPA_SCHEMA)
def _gdpa(
    q, k, v, q_offsets, k_offsets, max_q, max_k, activation, scale, causal, window_left,
    window_right, normalize_by_length, backend, precision="bf16", plan_backward=False,
):  # fmt: skip
    _check_precision(precision, q)
    q_lengths, k_lengths = _gdpa_lengths(q, k, q_offsets, k_offsets, max_q, max_k)
    options = dict(
        activation=activation,
        scale=scale,
        causal=causal,
        window=_window(window_left, window_right),
        normalize_by_length=normalize_by_length,
    )
    triton = _gdpa_triton(backend, q, precision)
    if triton is not None:
        return triton.forward_from_lengths(
            q, k, v, q_lengths, k_lengths, precision=precision, plan_backward=plan_backward,
            **options,
        )  # fmt: skip
    return reference.gdpa_reference(q, k, v, q_offsets, k_offsets, precision=precision, **options)


@_fake("gdpa")
def _gdpa_fake(q, k, v, q_offsets, k_offsets, *_):
    # PMA broadcast: the Nq shared queries once per sample of k_offsets.
    rows = q.shape[0] if q_offsets is not None else (k_offsets.shape[0] - 1) * q.shape[0]
    return q.new_empty((rows, q.shape[1], q.shape[2]))


@_operator("gdpa_backward", _GDPA_BACKWARD_SCHEMA)
def _gdpa_backward_impl(
    grad_out, q, k, v, q_offsets, k_offsets, activation, scale, causal, window_left,
    window_right, normalize_by_length, backend, precision="bf16",
):  # fmt: skip
    _check_precision(precision, q)
    options = dict(
        activation=activation,
        scale=scale,
        causal=causal,
        window=_window(window_left, window_right),
        normalize_by_length=normalize_by_length,
    )
    triton = _gdpa_triton(backend, q, precision)
    if triton is not None:
        q_lengths = None if q_offsets is None else host_lengths(q_offsets)
        k_lengths = None if k_offsets is None else host_lengths(k_offsets)
        grads = triton.backward_from_lengths(
            grad_out, q, k, v, q_lengths, k_lengths, precision=precision, **options
        )
        return tuple(_fresh(grads))
    if precision == "fp8":
        # As the kernels: the bf16 backward, with the kernels' roundings.
        grads = reference.gdpa_fp8_backward(
            grad_out.contiguous(), q, k, v, q_offsets, k_offsets, **options
        )
        return tuple(_fresh(grads))

    def forward(q, k, v):
        return reference.gdpa_reference(q, k, v, q_offsets, k_offsets, **options)

    return tuple(_fresh(_reference_grads(forward, (q, k, v), grad_out)))


# Saved: q, k, v, q_offsets, k_offsets; passed on: activation .. precision (not max_q, max_k
# nor plan_backward).
_qkv_autograd("gdpa", saved=5, options_from=7, options_to=15)


# ---------------------------------------------------------------------------------------------
# Block attention.


#: Largest RoPE frequency, in turns per position, that the Triton kernels' fixed-point table
#: holds exactly (2**40 fractions of a turn in an int64). A rope_theta below 1 makes the
#: frequencies ``theta ** (-2i / D)`` grow with ``i``; beyond this bound the reference runs.
MAX_TRITON_ROPE_TURNS = 2.0**20


def _rope_unsupported_reason(head_dim: int, rope_theta: float) -> str | None:
    if rope_theta >= 1.0 or head_dim <= 2:
        return None  # every frequency is at most 1 radian per position
    turns = rope_theta ** (-(head_dim - 2) / head_dim) / (2.0 * math.pi)
    if turns < MAX_TRITON_ROPE_TURNS:
        return None
    return (
        f"rope_theta={rope_theta!r} gives RoPE frequencies of {turns:.3g} turns per position, "
        f"more than the kernels' fixed-point table holds ({MAX_TRITON_ROPE_TURNS:.0f})"
    )


def _block_triton(backend, q, block_size, rope_theta) -> ModuleType | None:
    def unsupported(module: ModuleType) -> str | None:
        reason = module.triton_unsupported_reason(q, block_size)
        return reason or _rope_unsupported_reason(q.shape[2], rope_theta)

    return _triton_module(backend, q, "block_attention_triton", unsupported)


@_operator("block_attention", _BLOCK_SCHEMA)
def _block(q, k, v, offsets, positions, max_len, block_size, rope_theta, scale, backend):
    lengths, longest = validated_lengths(offsets, "offsets", num_rows=q.shape[0])
    check_max_len(max_len, "max_len", lengths, "sample", longest)
    options = dict(block_size=block_size, positions=positions, rope_theta=rope_theta, scale=scale)
    triton = _block_triton(backend, q, block_size, rope_theta)
    if triton is not None:
        return triton.forward_from_lengths(q, k, v, lengths, **options)
    return reference.block_attention_reference(q, k, v, offsets, **options)


@_fake("block_attention")
def _block_fake(q, *_):
    return q.new_empty(q.shape)


@_operator("block_attention_backward", _BLOCK_BACKWARD_SCHEMA)
def _block_backward_impl(
    grad_out, q, k, v, offsets, positions, block_size, rope_theta, scale, backend
):
    options = dict(block_size=block_size, positions=positions, rope_theta=rope_theta, scale=scale)
    triton = _block_triton(backend, q, block_size, rope_theta)
    if triton is not None:
        grads = triton.backward_from_lengths(grad_out, q, k, v, host_lengths(offsets), **options)
        return tuple(_fresh(grads))

    def forward(q, k, v):
        return reference.block_attention_reference(q, k, v, offsets, **options)

    return tuple(_fresh(_reference_grads(forward, (q, k, v), grad_out)))


# Saved: q, k, v, offsets, positions; passed on: block_size .. backend (not max_len).
_qkv_autograd("block_attention", saved=5, options_from=6)


# ---------------------------------------------------------------------------------------------
# Rotary embedding.


@_operator("rope", _ROPE_SCHEMA)
def _rope(x, positions, cos, sin, inverse, backend):
    triton = _rope_triton(backend, x)
    if triton is not None:
        return triton.rope(x, positions, cos, sin, inverse)
    return reference.apply_rope(x, positions, tables=(cos, -sin if inverse else sin))


@_fake("rope")
def _rope_fake(x, *_):
    return x.new_empty(x.shape)


def _rope_setup_context(ctx, inputs, output):
    ctx.save_for_backward(inputs[1], inputs[2], inputs[3])
    ctx.inverse, ctx.backend = inputs[4], inputs[5]


def _rope_backward(ctx, grad_out):
    # A rotation's gradient is the opposite rotation of the output's gradient.
    positions, cos, sin = ctx.saved_tensors
    grad = torch.ops.gem_kernels.rope(grad_out, positions, cos, sin, not ctx.inverse, ctx.backend)
    return grad, None, None, None, None, None


_autograd("rope", _rope_backward, _rope_setup_context)


def _rotate(triton, x, positions, cos, sin, inverse, out, rotate=True):
    """``out`` (a slice of a fused tensor) = ``x`` rotated (``rotate=False``: copied), by the
    kernels of ``triton`` (the ``rope_triton`` module) or, when it is None, the reference."""
    if triton is not None:
        triton.rope(x, positions, cos, sin, inverse, out=out, rotate=rotate)
    elif rotate:
        out.copy_(reference.apply_rope(x, positions, tables=(cos, -sin if inverse else sin)))
    else:
        out.copy_(x)


def _rope_triton(backend: str, x: torch.Tensor) -> ModuleType | None:
    return _triton_module(backend, x, "rope_triton", lambda m: m.triton_unsupported_reason(x))


@_operator("rope_qkv", _ROPE_QKV_SCHEMA)
def _rope_qkv(qkv, positions, cos, sin, backend):
    q, k, v = (torch.empty(qkv.shape[:1] + qkv.shape[2:], dtype=qkv.dtype, device=qkv.device)
               for _ in range(3))  # fmt: skip
    triton = _rope_triton(backend, qkv[:, 0])
    _rotate(triton, qkv[:, 0], positions, cos, sin, False, q)
    _rotate(triton, qkv[:, 1], positions, cos, sin, False, k)
    _rotate(triton, qkv[:, 2], positions, cos, sin, False, v, rotate=False)
    return q, k, v


@_fake("rope_qkv")
def _rope_qkv_fake(qkv, *_):
    shape = qkv.shape[:1] + qkv.shape[2:]
    return qkv.new_empty(shape), qkv.new_empty(shape), qkv.new_empty(shape)


@_operator("rope_qkv_backward", _ROPE_QKV_BACKWARD_SCHEMA)
def _rope_qkv_backward_impl(grad_q, grad_k, grad_v, positions, cos, sin, backend):
    # One (T, 3, H, D) gradient written in place of the stack autograd would build from three
    # separate ones: the inverse rotations write their slices, v's gradient is copied into its
    # (by the same kernel: ATen's copy into a strided slice ran at 1.7 TB/s on the H200).
    grad = grad_q.new_empty((grad_q.shape[0], 3, *grad_q.shape[1:]))
    triton = _rope_triton(backend, grad_q)
    _rotate(triton, grad_q, positions, cos, sin, True, grad[:, 0])
    _rotate(triton, grad_k, positions, cos, sin, True, grad[:, 1])
    _rotate(triton, grad_v, positions, cos, sin, True, grad[:, 2], rotate=False)
    return grad


@_fake("rope_qkv_backward")
def _rope_qkv_backward_fake(grad_q, *_):
    return grad_q.new_empty((grad_q.shape[0], 3, *grad_q.shape[1:]))


def _rope_qkv_setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs[1:4])
    ctx.backend = inputs[4]


def _rope_qkv_grad(ctx, grad_q, grad_k, grad_v):
    positions, cos, sin = ctx.saved_tensors
    present = next(g for g in (grad_q, grad_k, grad_v) if g is not None)
    grad_q, grad_k, grad_v = (torch.zeros_like(present) if g is None else g
                              for g in (grad_q, grad_k, grad_v))  # fmt: skip
    grad = torch.ops.gem_kernels.rope_qkv_backward(
        grad_q, grad_k, grad_v, positions, cos, sin, ctx.backend
    )
    return grad, None, None, None, None


_autograd("rope_qkv", _rope_qkv_grad, _rope_qkv_setup_context)
_once_differentiable("rope_qkv_backward")


# ---------------------------------------------------------------------------------------------
# SwiGLU's gate.


def _swiglu_triton(backend: str, hidden: torch.Tensor) -> ModuleType | None:
    return _triton_module(
        backend, hidden, "swiglu_triton", lambda m: m.triton_unsupported_reason(hidden)
    )


@_operator("swiglu", _SWIGLU_SCHEMA)
def _swiglu(hidden, bias, backend):
    triton = _swiglu_triton(backend, hidden)
    if triton is not None:
        return triton.swiglu(hidden, bias)
    return reference.swiglu_reference(hidden, bias)


@_fake("swiglu")
def _swiglu_fake(hidden, bias, backend):
    return hidden.new_empty((hidden.shape[0], hidden.shape[1] // 2))


@_operator("swiglu_backward", _SWIGLU_BACKWARD_SCHEMA)
def _swiglu_backward_impl(grad_out, hidden, bias, backend):
    triton = _swiglu_triton(backend, hidden)
    if triton is not None:
        grad, grad_bias = triton.swiglu_backward(grad_out, hidden, bias)
    else:
        grad, grad_bias = reference.swiglu_backward_reference(grad_out, hidden, bias)
    return grad, hidden.new_empty(0) if grad_bias is None else grad_bias


@_fake("swiglu_backward")
def _swiglu_backward_fake(grad_out, hidden, bias, backend):
    grad_bias = hidden.new_empty(0) if bias is None else bias.new_empty(bias.shape)
    return hidden.new_empty(hidden.shape), grad_bias


def _swiglu_setup_context(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1])
    ctx.backend = inputs[2]


def _swiglu_grad(ctx, grad_out):
    hidden, bias = ctx.saved_tensors
    grad, grad_bias = torch.ops.gem_kernels.swiglu_backward(grad_out, hidden, bias, ctx.backend)
    return grad, None if bias is None else grad_bias, None


_autograd("swiglu", _swiglu_grad, _swiglu_setup_context)
_once_differentiable("swiglu_backward")
