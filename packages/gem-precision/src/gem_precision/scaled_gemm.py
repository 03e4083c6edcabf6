"""Scaled FP8 GEMMs: native ``torch._scaled_mm`` per GPU generation, emulation elsewhere.

All GEMMs here are ``a @ b.T`` with both operands stored row-major along the reduction dim K
(``a`` (M, K), ``b`` (N, K)), which is the layout ``_scaled_mm`` wants (``b.T`` is then
column-major).

* Hopper (sm90): blockwise scales with torch's ``ScalingType`` BlockWise1x128 /
  BlockWise128x128 (float32 scales; 1x128 scales outer-dim-major, 128x128 scales of ``b`` with
  ``scale_b.t()`` contiguous; K zero-padded to a multiple of 4 blocks of 128, which cuBLAS
  assumes when it reads block scales), or one tensorwise scale per operand.
* Blackwell (sm100): MXFP8, E8M0 scales per 1x32 block in cuBLAS's swizzled 128x4 layout
  (:func:`swizzle_mx_scales`).
* Everything else (CPU, other GPUs, shapes ``_scaled_mm`` rejects): dequantise and multiply in
  float32. The quantised operands are the same, so the numerics match up to summation order.
"""

from __future__ import annotations

import os
import warnings

import torch
import torch.nn.functional as F

from gem_precision.blockwise import _gemm_k, _gemm_rows, dequantize_operand
from gem_precision.mx import MXTensor, dequantize_mx

__all__ = [
    "backend_for_capability",
    "gemm_backend",
    "mx_scaled_mm_nt",
    "scaled_mm_nt",
    "swizzle_mx_scales",
    "unswizzle_mx_scales",
]

_WARNED: set[str] = set()
# (scaling pair, output dtype) for which _scaled_mm refused a bias epilogue (the bias is then
# added apart). The output dtype is part of the key: a refusal for float32 outputs (a float32
# model's layers) must not cost bfloat16 layers their fused bias (an extra pass over the
# output: +0.4 ms, 6%, for a 65536 x 4096 x 4096 forward+backward on the H200).
_NO_BIAS_EPILOGUE: set[tuple[str, str, torch.dtype]] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def _gemm_out_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype an FP8 GEMM writes: that of the tensor its result stands for (the activation
    for forward and dgrad, the weight for wgrad), so an FP8 layer differs from a bf16-GEMM one
    only in its operands' format. float32 master weights get float32 weight gradients (like
    Transformer Engine's main-grad). cuBLAS on the H200 writes float32 and bfloat16 for all
    three scalings (1x128 x 128x128, 1x128 x 1x128, tensorwise; probed 2026-12-01); other
    dtypes get bfloat16. Every path, native or emulated, rounds the same way, or CPU quality
    runs would not predict GPU ones."""
    probed = (torch.float32, torch.bfloat16)  # float16 output was not probed on the H200
    return dtype if dtype in probed else torch.bfloat16


def backend_for_capability(device_type: str, capability: tuple[int, int] | None) -> str:
    """``"sm90"``, ``"sm100"`` or ``"emulated"`` for a device type and CUDA capability."""
    if device_type != "cuda" or capability is None:
        return "emulated"
    if capability[0] == 9:
        return "sm90"
    if capability[0] == 10:
        return "sm100"
    return "emulated"


def gemm_backend(device: torch.device | str) -> str:
    """The FP8 GEMM backend used for tensors on ``device``.

    ``GEM_PRECISION_GEMM=emulated`` forces the emulation (for debugging numerics on a GPU).
    """
    device = torch.device(device)
    if os.environ.get("GEM_PRECISION_GEMM", "") == "emulated":
        return "emulated"
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    return backend_for_capability(device.type, capability)


def _native_shape_ok(a: torch.Tensor, b: torch.Tensor) -> bool:
    # _scaled_mm needs K, and both dims of b, divisible by 16.
    return a.shape[1] % 16 == 0 and b.shape[0] % 16 == 0 and b.shape[1] % 16 == 0


def _pad_data(data: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """FP8 ``data`` zero-padded to (rows, cols) (through uint8: copies work for any torch)."""
    out = torch.zeros((rows, cols), dtype=torch.uint8, device=data.device)
    out[: data.shape[0], : data.shape[1]] = data.view(torch.uint8)
    return out.view(data.dtype)


def _pad_scale(scale: torch.Tensor, kind: str, rows: int, k_blocks: int) -> torch.Tensor:
    """Scales of one operand padded to ``rows`` (1x128 kind) and ``k_blocks`` blocks along K
    (new entries 1: their data is 0)."""
    if kind == "1x128":  # (R, Kb) outer-dim-major
        out = torch.ones((k_blocks, rows), dtype=scale.dtype, device=scale.device)
        out[: scale.shape[1], : scale.shape[0]] = scale.t()
        return out.t()
    if kind == "128x128":  # (ceil(R/128), Kb) contiguous
        out = torch.ones((scale.shape[0], k_blocks), dtype=scale.dtype, device=scale.device)
        out[:, : scale.shape[1]] = scale
        return out
    return scale


def _pad_for_block_scales(a_data, a_scale, a_kind, b_data, b_scale, b_kind):
    """Blockwise operands padded (zero data, unit scales: they add nothing) to what the H200's
    cuBLAS handles, in one copy per operand that is not stored so already (the linear operators
    quantise activations into padded layouts, ``_quantize_operand``'s ``gemm_padded``, and copy
    only weights whose K needs it). An operand padded along K pads the other to its K.

    * K: K/128 a multiple of 4 (and K of 16). cuBLAS reads block scales as if the count of
      128-blocks along K were rounded up to a multiple of 4: with 2 blocks (K=256) the H200
      returned garbage (dgrad of a layer with 256 outputs: relative error 0.7 to 3e4 against
      the emulation, varying with what lay in memory), while K=512, 1024, 4096 matched.
    * M of a 1x128-scaled ``a``: a multiple of 4. Other M are rejected
      (CUBLAS_STATUS_NOT_SUPPORTED, measured with M = 301, 4099, 45001, 45002; 1000, 4096 and
      45004 run), and a jagged batch has any token count. The extra output rows are cut off.
    """
    if not {a_kind, b_kind} & {"1x128", "128x128"}:
        return a_data, a_scale, b_data, b_scale
    cols = _gemm_k(max(a_data.shape[1], b_data.shape[1]))
    rows = _gemm_rows(a_data.shape[0], False) if a_kind == "1x128" else a_data.shape[0]
    scale_blocks = -(-cols // 128)
    if (rows, cols) != tuple(a_data.shape):
        a_data = _pad_data(a_data, rows, cols)
        a_scale = _pad_scale(a_scale, a_kind, rows, scale_blocks)
    if cols != b_data.shape[1]:
        b_data = _pad_data(b_data, b_data.shape[0], cols)
        b_scale = _pad_scale(b_scale, b_kind, b_data.shape[0], scale_blocks)
    return a_data, a_scale, b_data, b_scale


def _native_scaled_mm(a_data, a_scale, a_kind, b_data, b_scale, b_kind, out_dtype, bias):
    """``torch._scaled_mm`` on prepared operands, or None (after one warning) if torch
    rejects the scaling."""
    scale_b = b_scale.t() if b_scale.dim() == 2 else b_scale
    key = (a_kind, b_kind, out_dtype)
    if bias is not None and bias.dtype == out_dtype and key not in _NO_BIAS_EPILOGUE:
        try:  # the bias in cuBLAS's epilogue saves a pass over the output
            return torch._scaled_mm(
                a_data, b_data.t(), scale_a=a_scale, scale_b=scale_b, bias=bias,
                out_dtype=out_dtype,
            )  # fmt: skip
        except (RuntimeError, ValueError, NotImplementedError):
            _NO_BIAS_EPILOGUE.add(key)
    try:
        out = torch._scaled_mm(
            a_data, b_data.t(), scale_a=a_scale, scale_b=scale_b, out_dtype=out_dtype
        )
        return out if bias is None else out + bias.to(out.dtype)
    except (RuntimeError, ValueError, NotImplementedError) as err:
        _warn_once(
            f"scaled_mm:{a_kind}:{b_kind}",
            f"torch._scaled_mm rejected ({a_kind}, {b_kind}) scaling, emulating the FP8 "
            f"GEMM instead (slow): {str(err).splitlines()[0]}",
        )
        return None


def scaled_mm_nt(
    a_data: torch.Tensor,
    a_scale: torch.Tensor,
    a_kind: str,
    b_data: torch.Tensor,
    b_scale: torch.Tensor,
    b_kind: str,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    native: bool = False,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``dequant(a) @ dequant(b).T (+ bias)`` for operands laid out by ``quantize_operand``.

    ``a_kind`` / ``b_kind``: ``"1x128"``, ``"128x128"`` (``b`` only) or ``"tensorwise"``.
    With ``native`` the GEMM is ``torch._scaled_mm`` (float32 accumulation, ``out_dtype``
    result); if torch rejects the call it warns once and falls back to the emulation.
    Runs the ``gem_precision::scaled_mm_nt`` operator (see :mod:`gem_precision.ops`).
    """
    for name, kind in (("a_kind", a_kind), ("b_kind", b_kind)):
        if kind not in _KINDS:
            raise ValueError(f"{name} must be one of {_KINDS}, got {kind!r}")
    return torch.ops.gem_precision.scaled_mm_nt(
        a_data, a_scale, a_kind, b_data, b_scale, b_kind, out_dtype, native, bias
    )


_KINDS = ("1x128", "128x128", "tensorwise")


def _scaled_mm_nt(a_data, a_scale, a_kind, b_data, b_scale, b_kind, out_dtype, native, bias):
    """:func:`scaled_mm_nt` on checked arguments: the body of its operator, and what the
    linear operators call."""
    rows = a_data.shape[0]
    if native:
        # Block-scaled operands: K padded to a multiple of 4 blocks of 128, which also makes
        # it a multiple of 16, so any token count works as the K of the wgrad GEMM; M padded
        # to a multiple of 4, so any token count works as the M of forward and dgrad.
        a_data, a_scale, b_data, b_scale = _pad_for_block_scales(
            a_data, a_scale, a_kind, b_data, b_scale, b_kind
        )
        if _native_shape_ok(a_data, b_data):
            out = _native_scaled_mm(
                a_data, a_scale, a_kind, b_data, b_scale, b_kind, out_dtype, bias
            )
            if out is not None:
                return out[:rows]
        else:
            _warn_once(
                f"shape:{a_data.shape[1]}:{b_data.shape}",
                f"FP8 GEMM with K={a_data.shape[1]}, N={b_data.shape[0]} is not a multiple of "
                "16: emulated (slow)",
            )
    a = dequantize_operand(a_data, a_scale, a_kind)
    b = dequantize_operand(b_data, b_scale, b_kind)
    out = (a @ b.T)[:rows]
    if bias is None:
        return out.to(out_dtype)
    if bias.dtype == out_dtype:  # native: bias in cuBLAS's epilogue, one rounding
        return (out + bias.to(torch.float32)).to(out_dtype)
    return out.to(out_dtype) + bias.to(out_dtype)  # native: rounded output, then the bias


def swizzle_mx_scales(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes (rows, cols) -> cuBLAS's block-scaling layout (flat, float8_e8m0fnu).

    The matrix is zero-padded to a multiple of 128 rows and 4 columns and cut into 128x4 tiles
    stored one after another (row of tiles by row of tiles); inside a tile, row
    ``r = 32 * i + j`` and column ``c`` go to byte ``16 * j + 4 * i + c``.
    """
    if scale.dim() != 2 or scale.dtype != torch.uint8:
        raise ValueError(
            f"scale must be a 2-D uint8 tensor, got {scale.dtype} shape {tuple(scale.shape)}"
        )
    rows, cols = scale.shape
    pad_r, pad_c = (-rows) % 128, (-cols) % 4
    padded = F.pad(scale, (0, pad_c, 0, pad_r))
    rb, cb = padded.shape[0] // 128, padded.shape[1] // 4
    tiles = padded.reshape(rb, 4, 32, cb, 4).permute(0, 3, 2, 1, 4)  # (rb, cb, j, i, c)
    return tiles.contiguous().reshape(-1).view(torch.float8_e8m0fnu)


def unswizzle_mx_scales(swizzled: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of :func:`swizzle_mx_scales` (uint8 (rows, cols))."""
    rb, cb = -(-rows // 128), -(-cols // 4)
    tiles = swizzled.view(torch.uint8).reshape(rb, cb, 32, 4, 4).permute(0, 3, 2, 1, 4)
    return tiles.reshape(rb * 128, cb * 4)[:rows, :cols]


def _row_scales(mx: MXTensor) -> torch.Tensor:
    """Per-row 1x32 scales of a 2-D MX tensor (square scales repeated over their 32 rows)."""
    if mx.square:
        return mx.scale.repeat_interleave(mx.block_size, dim=0)
    return mx.scale


def mx_scaled_mm_nt(
    a: MXTensor,
    b: MXTensor,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    native: bool = False,
) -> torch.Tensor:
    """``dequant(a) @ dequant(b).T`` for 2-D MXFP8 tensors with 1x32 (or square) blocks along K.

    ``native``: ``torch._scaled_mm`` with swizzled E8M0 scales (Blackwell); otherwise float32
    emulation.
    """
    if a.block_size != 32 or b.block_size != 32:
        raise ValueError("mx_scaled_mm_nt needs block_size=32 on both operands")
    if native and _native_shape_ok(a.data, b.data):
        try:
            return torch._scaled_mm(
                a.data,
                b.data.t(),
                scale_a=swizzle_mx_scales(_row_scales(a)),
                scale_b=swizzle_mx_scales(_row_scales(b)),
                out_dtype=out_dtype,
            )
        except (RuntimeError, ValueError, NotImplementedError) as err:
            _warn_once(
                "scaled_mm:mx",
                f"torch._scaled_mm rejected MXFP8 scaling, emulating (slow): "
                f"{str(err).splitlines()[0]}",
            )
    out = dequantize_mx(a, torch.float32) @ dequantize_mx(b, torch.float32).T
    return out.to(out_dtype)
