"""MXFP8 storage of the activations autograd saves for backward, around any module.

Inside :class:`mx_saved_activations` (a context manager built on
``torch.autograd.graph.saved_tensors_hooks``) every floating tensor that autograd saves for
backward and that is large enough is stored as an MX tensor (FP8 elements plus one E8M0
power-of-two scale per 1x32 block along the last dim) and expanded back to its dtype when
backward needs it. A float32 activation then takes ``1 + 1/32`` bytes per element instead of 4
(a bfloat16 one instead of 2). :class:`MXSavedActivations` wraps a module so that its forward
runs inside the context.

Not packed (they are stored as they are and counted as skipped):

* parameters and views of parameters (a linear layer saves ``weight.t()``): they stay alive
  anyway, so packing would only add error;
* non-floating tensors, tensors below ``min_numel`` elements, 0-d tensors, and tensors whose
  last dim is not a multiple of ``block_size``.

MX has no infinities: a block holding ``inf`` comes back as NaN (the OCP NaN scale), so a saved
additive mask of ``-inf`` (``nn.MultiheadAttention`` or SDPA with a float mask) turns the
gradients into NaN. Keep such modules outside the context (a check for non-finite values would
synchronise with the GPU at every saved tensor).

The default scale rounding is ``"ceil"`` (the smallest power of two with ``amax / scale <=
448``), so no element saturates: each restored element is within ``2**-4 * |x| + 2**-10 *
scale`` of the original (half an E4M3 ulp, or half the subnormal spacing), with ``scale <
amax_block / 224``. The OCP ``"floor"`` rounding can clip block maxima by up to 12.5%.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from gem_precision.mx import MX_ELEMENT_DTYPES, MXTensor, dequantize_mx, quantize_mx

__all__ = ["MXSavedActivations", "SavedActivationStats", "mx_saved_activations"]

_PACKABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class SavedActivationStats:
    """Counters of what the saved-tensor hooks stored (accumulated over every forward)."""

    packed_tensors: int = 0
    """Saved tensors stored as MX."""
    skipped_tensors: int = 0
    """Saved tensors stored unchanged (parameters, small, non-floating or unaligned)."""
    bytes_before: int = 0
    """Bytes the packed tensors would have taken unpacked (``numel * element_size``)."""
    bytes_after: int = 0
    """Bytes of the MX storage that replaced them (elements plus scales, from the storages)."""
    skipped_bytes: int = 0
    """Bytes of the tensors stored unchanged (parameters' views included)."""
    unpacked_tensors: int = 0
    """Packed tensors expanded again by backward."""

    @property
    def bytes_saved(self) -> int:
        """``bytes_before - bytes_after``."""
        return self.bytes_before - self.bytes_after

    @property
    def compression(self) -> float:
        """``bytes_after / bytes_before`` (NaN when nothing was packed)."""
        return self.bytes_after / self.bytes_before if self.bytes_before else float("nan")

    def reset(self) -> None:
        """Set every counter back to zero."""
        for name in self.__dataclass_fields__:
            setattr(self, name, 0)


def _is_parameter_or_view(x: torch.Tensor, param_storages: frozenset[int]) -> bool:
    if isinstance(x, nn.Parameter) or isinstance(x._base, nn.Parameter):
        return True
    if x.is_leaf and x.requires_grad:
        return True
    return bool(param_storages) and x.untyped_storage().data_ptr() in param_storages


class _Packed:
    """An MX tensor plus what is needed to rebuild the saved tensor exactly in shape and dtype."""

    __slots__ = ("mx", "dtype", "shape")

    def __init__(self, mx: MXTensor, dtype: torch.dtype, shape: torch.Size) -> None:
        self.mx, self.dtype, self.shape = mx, dtype, shape


class mx_saved_activations:  # noqa: N801 - used like torch's lower-case context managers
    """Context manager: store tensors saved for backward as MXFP8, restore them in backward.

    Args:
        elem_dtype: ``torch.float8_e4m3fn`` (default) or ``torch.float8_e5m2``.
        block_size: elements per E8M0 scale along the last dim (32 in the OCP spec).
        scale_rounding: ``"ceil"`` (default, no element saturates) or ``"floor"`` (OCP spec).
        min_numel: tensors with fewer elements are stored unchanged (not worth a kernel).
        parameters: extra tensors whose storages must never be packed (the parameters of the
            wrapped module; parameters and their views are detected anyway).
        stats: counters to accumulate into (a fresh :class:`SavedActivationStats` if None).

    The hooks apply to every autograd op run inside the ``with`` block, in this thread;
    ``stats`` stays readable after the block. Backward may run after the block has exited.
    """

    def __init__(
        self,
        *,
        elem_dtype: torch.dtype = torch.float8_e4m3fn,
        block_size: int = 32,
        scale_rounding: str = "ceil",
        min_numel: int = 1024,
        parameters: list[torch.Tensor] | tuple[torch.Tensor, ...] = (),
        stats: SavedActivationStats | None = None,
    ) -> None:
        if elem_dtype not in MX_ELEMENT_DTYPES:
            raise TypeError(
                f"elem_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {elem_dtype}"
            )
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        if scale_rounding not in ("floor", "ceil"):
            raise ValueError(f"scale_rounding must be 'floor' or 'ceil', got {scale_rounding!r}")
        if isinstance(min_numel, bool) or not isinstance(min_numel, int) or min_numel < 0:
            raise ValueError(f"min_numel must be a non-negative int, got {min_numel!r}")
        if stats is not None and not isinstance(stats, SavedActivationStats):
            raise TypeError(
                f"stats must be a SavedActivationStats or None, got {type(stats).__name__}"
            )
        self.elem_dtype = elem_dtype
        self.block_size = block_size
        self.scale_rounding = scale_rounding
        self.min_numel = min_numel
        self.param_storages = frozenset(p.untyped_storage().data_ptr() for p in parameters)
        self.stats = stats if stats is not None else SavedActivationStats()
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None

    def _packable(self, x: torch.Tensor) -> bool:
        return (
            x.dtype in _PACKABLE_DTYPES
            and x.dim() > 0
            and x.numel() >= max(self.min_numel, 1)
            and x.shape[-1] % self.block_size == 0
            and not _is_parameter_or_view(x, self.param_storages)
        )

    def pack(self, x: torch.Tensor) -> torch.Tensor | _Packed:
        """The pack hook: an MX copy of ``x``, or ``x`` itself when it is not packed."""
        if not self._packable(x):
            self.stats.skipped_tensors += 1
            self.stats.skipped_bytes += x.numel() * x.element_size()
            return x
        with torch.no_grad():
            mx = quantize_mx(
                x.detach().contiguous(),
                block_size=self.block_size,
                elem_dtype=self.elem_dtype,
                scale_rounding=self.scale_rounding,
            )
        self.stats.packed_tensors += 1
        self.stats.bytes_before += x.numel() * x.element_size()
        self.stats.bytes_after += mx.data.untyped_storage().nbytes()
        self.stats.bytes_after += mx.scale.untyped_storage().nbytes()
        return _Packed(mx, x.dtype, x.shape)

    def unpack(self, packed: torch.Tensor | _Packed) -> torch.Tensor:
        """The unpack hook: the dequantized tensor in its original dtype and shape."""
        if not isinstance(packed, _Packed):
            return packed
        self.stats.unpacked_tensors += 1
        return dequantize_mx(packed.mx, dtype=packed.dtype).reshape(packed.shape)

    def __enter__(self) -> mx_saved_activations:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._hooks is not None
        self._hooks.__exit__(*exc)
        self._hooks = None


class MXSavedActivations(nn.Module):
    """Wraps ``module`` so that its forward stores saved activations as MXFP8.

    The keyword arguments are those of :class:`mx_saved_activations`; ``self.stats``
    accumulates over calls (``self.stats.reset()`` to start again).
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        elem_dtype: torch.dtype = torch.float8_e4m3fn,
        block_size: int = 32,
        scale_rounding: str = "ceil",
        min_numel: int = 1024,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
        self.module = module
        self.stats = SavedActivationStats()
        # Validate the options once, here, instead of at the first forward.
        self._options = {
            "elem_dtype": elem_dtype,
            "block_size": block_size,
            "scale_rounding": scale_rounding,
            "min_numel": min_numel,
        }
        mx_saved_activations(**self._options)

    def forward(self, *args: object, **kwargs: object) -> object:
        """``module(*args, **kwargs)`` with the MX saved-tensor hooks active."""
        hooks = mx_saved_activations(
            **self._options, parameters=list(self.module.parameters()), stats=self.stats
        )
        with hooks:
            return self.module(*args, **kwargs)
