"""Tests for the MXFP8 FSDP2 all-gather: real gloo ranks on the CPU (forked processes)."""

from __future__ import annotations

import copy
import os
import tempfile

import pytest
import torch

# Imported here, in the parent, so that forked ranks do not each pay for the imports (FSDP2
# imports torch._dynamo lazily, which takes seconds).
import torch._dynamo  # noqa: E402, F401
import torch.distributed as dist
import torch.multiprocessing as mp
from gem_precision import (
    MXAllGatherConfig,
    MXAllGatherWeight,
    all_gather_mx,
    dequantize_mx,
    enable_mx_all_gather,
    mx_all_gather_bytes,
    quantize_mx,
)
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: E402

CONFIGS = {
    "rows": MXAllGatherConfig(),
    "square": MXAllGatherConfig(square=True),
    "square_ceil_e5m2": MXAllGatherConfig(
        square=True, elem_dtype=torch.float8_e5m2, scale_rounding="ceil"
    ),
}


def run_ranks(fn, world: int) -> None:
    """Runs ``fn(rank, world)`` in ``world`` forked processes joined in one gloo group."""
    if dist.is_initialized():
        # A group left open in this interpreter (gem-train's Trainer keeps its one-process gloo
        # group until exit, when its tests run in the same session) would come with the fork,
        # and the ranks could not start their own.
        dist.destroy_process_group()
    store_path = os.path.join(tempfile.mkdtemp(prefix="gem-precision-"), "store")
    mp.start_processes(
        _worker, args=(world, store_path, fn), nprocs=world, start_method="fork", join=True
    )


def _worker(rank: int, world: int, store_path: str, fn) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        fn(rank, world)
    finally:
        dist.destroy_process_group()


def mx_bits(mx) -> tuple[torch.Tensor, torch.Tensor]:
    return mx.data.view(torch.uint8), mx.scale


def awkward_weight(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Random weight with an all-zero block, subnormals, huge values, an Inf and a NaN."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=gen) * torch.logspace(-6, 3, cols)
    w[:32, :32] = 0.0
    w[1, 40] = 1e-40  # float32 subnormal
    w[rows - 1, 5] = 3e38
    w[rows // 2, cols - 1] = float("inf")
    w[rows - 2, 33] = float("nan")
    return w


def standalone_all_gather_checks(rank: int, world: int) -> None:
    rows = 64 * world
    full = awkward_weight(rows, 96, seed=world)
    per_rank = rows // world
    shard = full[rank * per_rank : (rank + 1) * per_rank]
    for name, config in CONFIGS.items():
        for dtype in (torch.float32, torch.bfloat16):
            gathered = all_gather_mx(shard.to(dtype), config=config)
            expected = config.quantize(full.to(dtype))
            for got, want in zip(mx_bits(gathered), mx_bits(expected), strict=True):
                assert torch.equal(got, want), (name, dtype)
            assert gathered.orig_dtype == dtype and gathered.square == config.square


def build_model(bias: bool) -> nn.Sequential:
    torch.manual_seed(0)
    # Row counts 128 and 256 split into multiples of 32 rows for 2 and 4 ranks; the 8-row head
    # (in_features 256 is fine, but it is excluded) all-gathers as usual, mixed into the same
    # FSDP all-gather as the MX bytes.
    return nn.Sequential(
        nn.Linear(64, 128, bias=bias),
        nn.GELU(),
        nn.Linear(128, 256, bias=bias),
        nn.GELU(),
        nn.Linear(256, 8, bias=bias),
    )


class _FakeQuantize(torch.autograd.Function):
    """Forward: the MX round trip; backward: straight-through (what FSDP MX all-gather does)."""

    @staticmethod
    def forward(ctx, weight, config):
        return dequantize_mx(config.quantize(weight))

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def emulated_forward(model: nn.Sequential, x: torch.Tensor, config, wrapped) -> torch.Tensor:
    for index, layer in enumerate(model):
        if isinstance(layer, nn.Linear) and str(index) in wrapped:
            x = nn.functional.linear(x, _FakeQuantize.apply(layer.weight, config), layer.bias)
        else:
            x = layer(x)
    return x


def fsdp_training_step_checks(rank: int, world: int) -> None:
    for name in ("rows", "square"):
        config = CONFIGS[name]
        reference = build_model(bias=True)
        model = copy.deepcopy(reference)
        wrapped = enable_mx_all_gather(model, config=config, include=("0", "2"))
        assert wrapped == ["0", "2"]
        gathered: dict[str, torch.Tensor] = {}
        for index in wrapped:
            fully_shard(model[int(index)])
        fully_shard(model)
        for index in wrapped:
            model[int(index)].register_forward_pre_hook(
                lambda m, args, index=index, store=gathered: store.__setitem__(
                    index, m.weight.detach().clone()
                )
            )

        batch = torch.randn(4 * world, 64, generator=torch.Generator().manual_seed(1))
        local = batch[rank * 4 : (rank + 1) * 4]
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
        for step in range(2):
            out = model(local)
            # The unsharded weights the forward used are exactly quantize-after-gather.
            for index in wrapped:
                full_weight = reference[int(index)].weight.detach()
                expected = dequantize_mx(config.quantize(full_weight))
                assert torch.equal(gathered[index], expected), (name, step, index)
            reference_out = emulated_forward(reference, batch, config, wrapped)
            torch.testing.assert_close(out, reference_out[rank * 4 : (rank + 1) * 4])
            # FSDP averages gradients over ranks: the same as the mean loss of the full batch.
            (out**2).mean().backward()
            (reference_out**2).mean().backward()
            optimizer.step()
            reference_optimizer.step()
            optimizer.zero_grad()
            reference_optimizer.zero_grad()
            for p, ref in zip(model.parameters(), reference.parameters(), strict=True):
                shard = p.to_local()
                shard = shard._tensor if isinstance(shard, MXAllGatherWeight) else shard
                rows = ref.shape[0] // world
                torch.testing.assert_close(
                    shard, ref.detach()[rank * rows : (rank + 1) * rows], rtol=1e-5, atol=1e-6
                )


def _count_all_gather_bytes(monkeypatch_targets: list[str], counter: list[int]):
    originals = {}
    for target in monkeypatch_targets:
        original = getattr(dist, target)
        originals[target] = original

        def counting(output_tensor, input_tensor, *args, _original=original, **kwargs):
            counter.append(input_tensor.numel() * input_tensor.element_size())
            return _original(output_tensor, input_tensor, *args, **kwargs)

        setattr(dist, target, counting)
    return originals


def wire_bytes_checks(rank: int, world: int) -> None:
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    targets = [t for t in ("all_gather_single", "all_gather_into_tensor") if hasattr(dist, t)]
    measured = {}
    for name, config in (("bf16", None), ("rows", CONFIGS["rows"]), ("square", CONFIGS["square"])):
        model = build_model(bias=False)
        if config is not None:
            enable_mx_all_gather(model, config=config, include=("0", "2"))
        fully_shard(model, mp_policy=policy, reshard_after_forward=False)
        counter: list[int] = []
        originals = _count_all_gather_bytes(targets, counter)
        try:
            model(torch.randn(2, 64)).float().sum().backward()
        finally:
            for target, original in originals.items():
                setattr(dist, target, original)
        measured[name] = sum(counter)
    head = 8 * 256 * 2  # the head stays bf16
    assert measured["bf16"] == (64 * 128 + 128 * 256) * 2 // world + head // world
    for name in ("rows", "square"):
        square = name == "square"
        mx = mx_all_gather_bytes((128, 64), square=square) + mx_all_gather_bytes(
            (256, 128), square=square
        )
        assert measured[name] == (mx + head) // world, (name, measured)
        # The MX layers put half the bf16 bytes (plus 1/32 or 1/1024 for scales) on the wire.
        mx_ratio = (measured[name] - head // world) / (measured["bf16"] - head // world)
        assert mx_ratio <= 0.5 + 0.5 / 32 + 1e-9, (name, mx_ratio)


def uneven_shard_error_checks(rank: int, world: int) -> None:
    model = nn.Sequential(nn.Linear(64, 32 * world + 1))
    enable_mx_all_gather(model)
    fully_shard(model)
    with pytest.raises(ValueError, match="divisible by the FSDP world size"):
        model(torch.randn(2, 64))
    square = nn.Sequential(nn.Linear(64, 16 * world))
    enable_mx_all_gather(square, config=MXAllGatherConfig(square=True))
    fully_shard(square)
    with pytest.raises(ValueError, match="multiple of 32 rows per rank"):
        square(torch.randn(2, 64))


def all_checks(rank: int, world: int) -> None:
    standalone_all_gather_checks(rank, world)
    fsdp_training_step_checks(rank, world)
    wire_bytes_checks(rank, world)
    uneven_shard_error_checks(rank, world)


@pytest.mark.parametrize("world", [2, 4])
def test_mx_all_gather_on_gloo_ranks(world):
    run_ranks(all_checks, world)


def test_subclass_behaves_like_its_tensor_outside_fsdp():
    torch.manual_seed(0)
    plain = nn.Linear(64, 48)
    model = copy.deepcopy(plain)
    assert enable_mx_all_gather(model) == [""]
    assert isinstance(model.weight, MXAllGatherWeight) and isinstance(model.weight, nn.Parameter)
    x = torch.randn(5, 64)
    torch.testing.assert_close(model(x), plain(x), rtol=0, atol=0)
    model(x).sum().backward()
    plain(x).sum().backward()
    torch.testing.assert_close(model.weight.grad, plain.weight.grad, rtol=0, atol=0)
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    torch.optim.SGD(plain.parameters(), lr=0.1).step()
    torch.testing.assert_close(model.weight._tensor, plain.weight.detach(), rtol=0, atol=0)
    assert isinstance(model.weight.detach(), MXAllGatherWeight)
    assert enable_mx_all_gather(model) == []  # already wrapped


def test_enable_skips_unaligned_and_excluded_layers():
    model = nn.Sequential(nn.Linear(30, 64), nn.Linear(64, 64), nn.Linear(64, 1))
    assert enable_mx_all_gather(model, include=("1",)) == ["1"]
    assert not isinstance(model[0].weight, MXAllGatherWeight)
    assert not isinstance(model[2].weight, MXAllGatherWeight)


def test_enable_refuses_a_tied_weight():
    """Wrapping one holder of a shared weight untied it: FSDP would train two copies."""
    embedding, head = nn.Embedding(100, 64), nn.Linear(64, 100, bias=False)
    head.weight = embedding.weight
    model = nn.ModuleDict({"embedding": embedding, "head": head})
    with pytest.raises(ValueError, match=r"head.weight is shared by \['embedding.weight', 'head"):
        enable_mx_all_gather(model)
    assert model["head"].weight is model["embedding"].weight
    assert enable_mx_all_gather(model, include=("nothing",)) == []


def test_wire_bytes_formula_matches_quantized_sizes():
    for square in (False, True):
        mx = quantize_mx(torch.randn(64, 96), square=square)
        expected = mx.data.numel() * mx.data.element_size() + mx.scale.numel()
        assert mx_all_gather_bytes((64, 96), square=square) == expected


def test_bad_arguments():
    with pytest.raises(TypeError, match="elem_dtype"):
        MXAllGatherConfig(elem_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="scale_rounding"):
        MXAllGatherConfig(scale_rounding="nearest")
    with pytest.raises(TypeError, match="square"):
        MXAllGatherConfig(square=1)
    with pytest.raises(TypeError, match="module"):
        enable_mx_all_gather("model")
    with pytest.raises(TypeError, match="config"):
        enable_mx_all_gather(nn.Linear(32, 32), config="rows")
    with pytest.raises(TypeError, match="include"):
        enable_mx_all_gather(nn.Linear(32, 32), include="*")
    with pytest.raises(ValueError, match="multiple of 32"):
        all_gather_mx(torch.randn(4, 30))
    with pytest.raises(ValueError, match="2-D"):
        all_gather_mx(torch.randn(64))
