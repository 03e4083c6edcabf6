"""``precision.saved_activations='mx'`` and ``parallel.fsdp_all_gather='mx'`` through the trainer.

The MX all-gather needs a shard group of at least 2 ranks (with one rank FSDP2 gathers nothing
and its 1-rank path cannot run all-gather extensions), so that test spawns two gloo ranks.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from gem_model import GemArchitecture
from gem_precision import MXAllGatherConfig, dequantize_mx
from gem_train import Trainer, apply_overrides, tiny
from gem_train.cli import prepare_data
from gem_train.config import ParallelConfig, PrecisionConfig
from gem_train.parallel import mx_all_gather_layers
from torch import nn

# A float32 tensor packed as MXFP8 keeps 1 byte per element plus 1 E8M0 byte per 32 elements.
FP32_MX_COMPRESSION = (1 + 1 / 32) / 4


# ------------------------------------------------------------------------- config validation
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["precision.saved_activations=fp8"], "precision.saved_activations must be one of"),
        (["parallel.fsdp_all_gather=fp8"], "parallel.fsdp_all_gather must be one of"),
        (["parallel.fsdp_all_gather=mx"], "only applies to parallel.dense='fsdp'"),
    ],
)
def test_bad_mx_options_are_clear_errors(overrides, message):
    with pytest.raises(ValueError, match=message):
        apply_overrides(tiny(), overrides)


def test_mx_options_parse_and_default_off():
    assert tiny().precision.saved_activations == "none"
    assert tiny().parallel.fsdp_all_gather == "bf16"
    config = apply_overrides(
        tiny(),
        ["precision.saved_activations=mx", "parallel.dense=fsdp", "parallel.fsdp_all_gather=mx"],
    )
    assert config.precision.saved_activations == "mx"
    assert config.parallel == ParallelConfig(dense="fsdp", fsdp_all_gather="mx")


def test_mx_all_gather_layer_selection():
    model = nn.ModuleDict(
        {
            "ok": nn.Linear(64, 32),
            "odd_rows": nn.Linear(64, 33),
            "narrow": nn.Linear(16, 32),
            "expert": nn.Linear(64, 32),
        }
    )
    eligible, skipped = mx_all_gather_layers(model, 2, ignored={model["expert"].weight})
    assert eligible == ["ok"]
    assert set(skipped) == {"odd_rows", "narrow"}
    assert "33" in skipped["odd_rows"] and "16" in skipped["narrow"]
    _, all_skipped = mx_all_gather_layers(model, 1)
    assert set(all_skipped) == {"ok", "odd_rows", "narrow", "expert"}
    with pytest.raises(ValueError, match="shard_size"):
        mx_all_gather_layers(model, 0)


# ------------------------------------------------------------------------ saved activations
def _read_metrics(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_mx_saved_activations_train_and_log_the_bytes(small_config, tmp_path):
    """Forward values do not change (the first loss is bit-equal); backward sees activations
    with E4M3 elements (relative error <= 2**-4 each), so gradients move by a few percent at
    most and, with AdamW steps of at most ~lr = 3e-3 per weight during warm-up, three steps
    move the loss by far less than 1%. The 'mx' run must still differ from the 'none' run
    (otherwise nothing was packed)."""
    train_data, _ = prepare_data(small_config.data, progress=False)
    config = dataclasses.replace(small_config, max_steps=3)
    plain = Trainer(config, train_data, output_dir=tmp_path / "none")
    plain_losses = plain.fit(progress=False)

    mx_config = dataclasses.replace(config, precision=PrecisionConfig(saved_activations="mx"))
    packed = Trainer(mx_config, train_data, output_dir=tmp_path / "mx")
    # The torchrec lookups keep exact saved tensors (the fused optimizer updates the tables).
    assert packed.saved_activations.excluded
    mx_losses = packed.fit(progress=False)

    assert all(torch.isfinite(torch.tensor(mx_losses)))
    assert mx_losses[0] == plain_losses[0]
    assert mx_losses == pytest.approx(plain_losses, rel=1e-2)
    assert mx_losses != plain_losses

    # The tables are saved for the fused backward; excluded, they stay out of the counters.
    table_bytes = sum(
        p.numel() * p.element_size()
        for name, p in packed.model.named_parameters()
        if "_embeddings." in name
    )
    assert packed.saved_activations.last_stats.skipped_bytes < table_bytes / 4

    records = [r for r in _read_metrics(tmp_path / "mx" / "metrics.jsonl") if r["split"] == "train"]
    assert [r["step"] for r in records] == [2, 3]  # log_every=2, and the last step
    for record in records:
        before, after = record["saved_act_bytes_fp"], record["saved_act_bytes_mx"]
        assert before > 0
        assert before % (4 * 32) == 0  # whole float32 blocks of 32 elements
        assert after == before // 4 + before // (4 * 32)  # n + n/32 bytes for n elements
        assert record["saved_act_bytes_saved"] == before - after
        assert record["saved_act_compression"] == pytest.approx(FP32_MX_COMPRESSION, rel=1e-9)
    plain_records = _read_metrics(tmp_path / "none" / "metrics.jsonl")
    assert not any("saved_act_bytes_fp" in r for r in plain_records)

    # FSDP2 (one rank) keeps its unsharded parameters as nn.Parameter, never packed: the same
    # activations are packed, so it follows the DDP 'mx' run up to float rounding.
    fsdp_config = dataclasses.replace(mx_config, parallel=ParallelConfig(dense="fsdp"))
    fsdp = Trainer(fsdp_config, train_data, output_dir=tmp_path / "fsdp")
    assert fsdp.fit(progress=False) == pytest.approx(mx_losses, rel=1e-5)
    assert fsdp.saved_activations.metrics() == packed.saved_activations.metrics()


# --------------------------------------------------------------------------- MX all-gather
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _mx_all_gather_rank(rank: int, config, port: int, out_dir: str) -> None:
    """One of two gloo ranks: a 'bf16' (plain) and an 'mx' FSDP trainer from the same seed."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        train_data, _ = prepare_data(config.data, progress=False)
        plain_config = dataclasses.replace(config, parallel=ParallelConfig(dense="fsdp"))
        plain = Trainer(plain_config, train_data, output_dir=f"{out_dir}/bf16")
        mx_config = dataclasses.replace(
            config, parallel=ParallelConfig(dense="fsdp", fsdp_all_gather="mx")
        )
        mx_trainer = Trainer(mx_config, train_data, output_dir=f"{out_dir}/mx")
        wrapper = mx_trainer.parallel.fsdp_wrapper
        inner = mx_trainer.model.module
        # The full initial weights (identical in both runs: same seed, same init order).
        plain_inner = plain.model.module
        full = {
            name: plain_inner.get_submodule(name).weight.full_tensor().detach().clone()
            for name in wrapper.mx_layers
        }
        seen: dict[str, torch.Tensor] = {}

        def capture(name):
            def hook(module, _args):
                seen.setdefault(name, module.weight.detach().clone())

            return hook

        for name in wrapper.mx_layers:
            inner.get_submodule(name).register_forward_pre_hook(capture(name))
        mx_losses = mx_trainer.fit(progress=False)
        plain_losses = plain.fit(progress=False)
        if rank == 0:
            torch.save(
                {
                    "mx_layers": wrapper.mx_layers,
                    "skipped": wrapper.mx_skipped,
                    "full": full,
                    "seen": seen,
                    "mx_losses": mx_losses,
                    "plain_losses": plain_losses,
                    "describe": mx_trainer.parallel.describe(),
                },
                f"{out_dir}/result.pt",
            )
    finally:
        dist.destroy_process_group()


def test_mx_all_gather_forward_sees_quantized_weights(small_config, tmp_path):
    """Two gloo ranks: the weights the forward sees are exactly dequantize(quantize(W)) of the
    full weight (the MX all-gather of the two row shards equals quantizing the whole tensor)."""
    config = dataclasses.replace(
        small_config,
        max_steps=2,
        data=dataclasses.replace(small_config.data, num_train=512, num_eval=128),
        # in_features of 32 so that most layers qualify for the 1x32 MX blocks
        model=GemArchitecture(embedding_dim=32, num_heads=2, dhen_layers=1, expert_hidden_dim=32),
    )
    prepare_data(config.data, progress=False)  # generated once, read by both ranks
    mp.start_processes(
        _mx_all_gather_rank,
        args=(config, _free_port(), str(tmp_path)),
        nprocs=2,
        start_method="spawn",
    )
    result = torch.load(tmp_path / "result.pt", weights_only=False)
    assert len(result["mx_layers"]) >= 5
    assert "heads.ctr.3" in result["skipped"]  # 1 output row cannot split over 2 ranks
    assert "MX all-gather on" in result["describe"]
    quantizer = MXAllGatherConfig()
    changed = 0
    for name in result["mx_layers"]:
        full = result["full"][name]
        expected = dequantize_mx(quantizer.quantize(full), dtype=full.dtype)
        seen = result["seen"][name]
        assert torch.equal(seen, expected), name
        changed += not torch.equal(seen, full)
    # Quantization did happen (zero-initialised output projections are exact in MX).
    assert changed >= len(result["mx_layers"]) // 2
    mx_losses, plain_losses = result["mx_losses"], result["plain_losses"]
    assert all(torch.isfinite(torch.tensor(mx_losses)))
    # E4M3 weights (<= 2**-4 relative per element, up to 12.5% clipping of a block maximum
    # with the OCP floor scale) move the first loss by a few percent at most.
    assert mx_losses == pytest.approx(plain_losses, rel=5e-2)
    assert mx_losses[0] != plain_losses[0]
