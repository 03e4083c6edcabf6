"""FSDP2 all-gather of weights in MXFP8: each rank quantizes its own shard, then gathers bytes.

MX blocks never straddle the FSDP shard boundary (FSDP2 shards dim 0, the rows): with 1x32
blocks along the last dim every row is quantized on its own, and with 32x32 square blocks each
rank's row count is a multiple of 32. So quantize-then-gather gives bit for bit the MX tensor
that gather-then-quantize would, without any communication of amax (unlike tensorwise FP8).
The wire carries one FP8 byte per element plus one E8M0 byte per 32 (square: 1024) elements,
instead of 2 bytes per element for a bf16 all-gather.

Two entry points:

* :func:`all_gather_mx`: a standalone collective on a shard (any process group);
* :func:`enable_mx_all_gather`: wraps the weights of the ``nn.Linear`` layers of a module in
  :class:`MXAllGatherWeight` *before* ``fully_shard``. FSDP2 then calls the subclass's
  ``fsdp_pre_all_gather`` (quantize the local shard; the all-gather inputs are the FP8 elements
  and the E8M0 scales, as bytes) and ``fsdp_post_all_gather`` (dequantize the gathered MX
  tensor to the mixed-precision ``param_dtype``). The forward sees the dequantized MX weight;
  gradients flow to it unchanged (straight-through) and are reduce-scattered as usual. Outside
  FSDP the subclass behaves like its high-precision tensor.

Requirements (checked with a clear error): 2-D weights whose last dim is a multiple of 32,
dim 0 divisible by the FSDP world size (even shards: FSDP2's padding of uneven shards cannot
carry a separate scale tensor), and with square blocks a multiple of 32 rows per rank.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree

from gem_precision.mx import MX_ELEMENT_DTYPES, MXTensor, dequantize_mx, quantize_mx

__all__ = [
    "MXAllGatherConfig",
    "MXAllGatherWeight",
    "all_gather_mx",
    "enable_mx_all_gather",
    "mx_all_gather_bytes",
]

_MX_BLOCK = 32


@dataclass(frozen=True)
class MXAllGatherConfig:
    """How a weight is quantized for the all-gather."""

    square: bool = False
    """32x32 square blocks (transpose-invariant) instead of 1x32 blocks along the last dim."""
    elem_dtype: torch.dtype = torch.float8_e4m3fn
    """MX element dtype."""
    scale_rounding: str = "floor"
    """E8M0 scale rounding, ``"floor"`` (OCP spec) or ``"ceil"`` (RCEIL, no saturation)."""

    def __post_init__(self) -> None:
        if not isinstance(self.square, bool):
            raise TypeError(f"square must be a bool, got {self.square!r}")
        if self.elem_dtype not in MX_ELEMENT_DTYPES:
            raise TypeError(
                f"elem_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, "
                f"got {self.elem_dtype}"
            )
        if self.scale_rounding not in ("floor", "ceil"):
            raise ValueError(
                f"scale_rounding must be 'floor' or 'ceil', got {self.scale_rounding!r}"
            )

    def quantize(self, x: torch.Tensor) -> MXTensor:
        """``quantize_mx`` of ``x`` with these options."""
        return quantize_mx(
            x,
            block_size=_MX_BLOCK,
            elem_dtype=self.elem_dtype,
            scale_rounding=self.scale_rounding,
            square=self.square,
        )


def _check_shape(shape: torch.Size, rows_per_rank: int, config: MXAllGatherConfig) -> None:
    if len(shape) != 2:
        raise ValueError(f"MX all-gather needs a 2-D weight, got shape {tuple(shape)}")
    if shape[1] % _MX_BLOCK:
        raise ValueError(
            f"MX all-gather needs the last dim of the weight ({shape[1]}) to be a multiple of "
            f"{_MX_BLOCK}"
        )
    if config.square and rows_per_rank % _MX_BLOCK:
        raise ValueError(
            f"square MX blocks need a multiple of {_MX_BLOCK} rows per rank so that no block "
            f"straddles two shards; got {rows_per_rank} rows per rank (weight {tuple(shape)})"
        )


def all_gather_mx(
    shard: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    config: MXAllGatherConfig | None = None,
) -> MXTensor:
    """Quantize this rank's row shard to MX and all-gather it: the MX tensor of the full weight.

    Args:
        shard: ``(rows_per_rank, cols)`` float32/bfloat16/float16 rows of a weight; every rank
            passes the same shape, rank ``r`` holding rows ``[r * rows_per_rank, ...)``.
        group: process group (default: the world).
        config: block shape, element dtype and scale rounding.

    Returns:
        An :class:`MXTensor` of shape ``(world * rows_per_rank, cols)``, bit-identical to
        ``quantize_mx`` of the concatenated full tensor with the same options.
    """
    config = config or MXAllGatherConfig()
    if not isinstance(shard, torch.Tensor):
        raise TypeError(f"shard must be a torch.Tensor, got {type(shard).__name__}")
    if not isinstance(config, MXAllGatherConfig):
        raise TypeError(f"config must be an MXAllGatherConfig, got {type(config).__name__}")
    _check_shape(shard.shape, shard.shape[0] if shard.dim() == 2 else 0, config)
    local = config.quantize(shard.contiguous())
    world = dist.get_world_size(group)
    gathered = []
    for part in (local.data.view(torch.uint8), local.scale):
        outputs = [torch.empty_like(part) for _ in range(world)]
        dist.all_gather(outputs, part.contiguous(), group=group)
        gathered.append(torch.cat(outputs, dim=0))
    return MXTensor(
        data=gathered[0].view(config.elem_dtype),
        scale=gathered[1],
        block_size=_MX_BLOCK,
        orig_dtype=shard.dtype,
        square=config.square,
    )


def mx_all_gather_bytes(shape: tuple[int, int], *, square: bool = False) -> int:
    """Bytes one full MX weight of ``shape`` takes on the wire (elements plus scales)."""
    rows, cols = shape
    scales = (rows // _MX_BLOCK) * (cols // _MX_BLOCK) if square else rows * (cols // _MX_BLOCK)
    return rows * cols + scales


# Ops whose results stay an MXAllGatherWeight: the ones FSDP2 uses to shard, pad and copy the
# parameter, plus detach/clone/_to_copy so that module.to() and state_dict copies keep it.
_aten = torch.ops.aten
_PRESERVED_OPS = {
    _aten.detach.default,
    _aten.empty_like.default,
    _aten.new_zeros.default,
    _aten.new_empty.default,
    _aten.slice.Tensor,
    _aten.copy_.default,
    _aten.view.default,
    _aten.as_strided.default,
    _aten._to_copy.default,
    _aten._pin_memory.default,
    _aten.split.Tensor,
    _aten.clone.default,
}


class MXAllGatherWeight(torch.Tensor):
    """A weight that FSDP2 all-gathers as MXFP8 (``fsdp_pre_all_gather`` /
    ``fsdp_post_all_gather``); every other op sees its high-precision tensor."""

    _tensor: torch.Tensor
    _config: MXAllGatherConfig

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, config: MXAllGatherConfig | None = None):
        return torch.Tensor._make_wrapper_subclass(
            cls,
            tensor.size(),
            strides=tensor.stride(),
            storage_offset=tensor.storage_offset(),
            dtype=tensor.dtype,
            layout=tensor.layout,
            device=tensor.device,
            requires_grad=tensor.requires_grad,
        )

    def __init__(self, tensor: torch.Tensor, config: MXAllGatherConfig | None = None) -> None:
        self._tensor = tensor
        self._config = config or MXAllGatherConfig()

    def __repr__(self) -> str:
        return f"MXAllGatherWeight({self._tensor!r}, config={self._config})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        config = None

        def unwrap(t: MXAllGatherWeight) -> torch.Tensor:
            nonlocal config
            config = config or t._config
            return t._tensor

        args, kwargs = pytree.tree_map_only(cls, unwrap, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _PRESERVED_OPS:
            return out
        return pytree.tree_map_only(torch.Tensor, lambda t: cls(t, config), out)

    def __tensor_flatten__(self):
        return ["_tensor"], self._config

    @staticmethod
    def __tensor_unflatten__(inner_tensors, config, outer_size, outer_stride):
        return MXAllGatherWeight(inner_tensors["_tensor"], config)

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """Quantize the local shard; all-gather its FP8 elements and E8M0 scales as bytes."""
        world = mesh.size()
        if outer_size[0] % world:
            raise ValueError(
                f"MX all-gather needs dim 0 of the weight ({outer_size[0]}) divisible by the "
                f"FSDP world size ({world}): FSDP2 pads uneven shards, and the padding cannot "
                "carry a separate scale tensor"
            )
        _check_shape(torch.Size(outer_size), outer_size[0] // world, self._config)
        mx = self._config.quantize(self._tensor.contiguous())
        return (mx.data.view(torch.uint8), mx.scale), None

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        """Dequantize the gathered MX weight to ``param_dtype`` (into ``out`` when given)."""
        data, scale = all_gather_outputs
        mx = MXTensor(
            data=data.view(self._config.elem_dtype),
            scale=scale,
            block_size=_MX_BLOCK,
            orig_dtype=param_dtype,
            square=self._config.square,
        )
        weight = dequantize_mx(mx, dtype=param_dtype)
        if out is not None:
            # The re-gather before backward refills the storage that autograd saved in
            # forward; FSDP's own copy-out keeps the version counter the same way.
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(out):
                out.copy_(weight)
            return None
        return weight, (weight,)


def enable_mx_all_gather(
    module: nn.Module,
    *,
    config: MXAllGatherConfig | None = None,
    include: tuple[str, ...] = ("*",),
) -> list[str]:
    """Wrap the weights of ``module``'s ``nn.Linear`` layers in :class:`MXAllGatherWeight`.

    Call before ``fully_shard``. Layers whose qualified name matches none of the ``include``
    globs, or whose ``in_features`` is not a multiple of 32, are left alone (they all-gather
    as usual). Returns the names of the wrapped layers.
    """
    config = config or MXAllGatherConfig()
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
    if not isinstance(config, MXAllGatherConfig):
        raise TypeError(f"config must be an MXAllGatherConfig, got {type(config).__name__}")
    if not isinstance(include, tuple) or not all(isinstance(p, str) for p in include):
        raise TypeError(f"include must be a tuple of str, got {include!r}")
    # A weight held by several modules (tied to an embedding, say): wrapping it for one would
    # untie it, and FSDP would then train two copies.
    holders: dict[int, list[str]] = {}
    for owner_name, owner in module.named_modules(remove_duplicate=False):
        for param_name, param in owner.named_parameters(recurse=False):
            holders.setdefault(id(param), []).append(f"{owner_name}.{param_name}".lstrip("."))
    wrapped = []
    for name, layer in module.named_modules():
        if not isinstance(layer, nn.Linear) or isinstance(layer.weight, MXAllGatherWeight):
            continue
        if not any(fnmatch.fnmatchcase(name, p) for p in include):
            continue
        if layer.in_features % _MX_BLOCK:
            continue
        shared = holders[id(layer.weight)]
        if len(shared) > 1:
            raise ValueError(
                f"{name}.weight is shared by {shared}: exclude it from include, or untie it"
            )
        weight = layer.weight
        layer.weight = nn.Parameter(
            MXAllGatherWeight(weight.data, config), requires_grad=weight.requires_grad
        )
        wrapped.append(name)
    return wrapped
