import pytest
import torch.distributed as dist
from gem_model import GemArchitecture
from gem_train import DataConfig, TrainConfig


def small_train_config(root) -> TrainConfig:
    """A config that trains in seconds (tiny data, tiny model), with its data and run under
    ``root``."""
    return TrainConfig(
        recipe="test",
        data=DataConfig(
            directory=str(root / "data"),
            num_train=1024,
            num_eval=512,
            max_seq_len=32,
            num_shards=2,
            workers=1,
        ),
        model=GemArchitecture(embedding_dim=16, num_heads=2, dhen_layers=1, expert_hidden_dim=32),
        batch_size=128,
        eval_batch_size=256,
        log_every=2,
        output_dir=str(root / "run"),
        device="cpu",
    )


@pytest.fixture
def small_config(tmp_path) -> TrainConfig:
    """A config that trains in seconds: tiny data, tiny model."""
    return small_train_config(tmp_path)


@pytest.fixture(autouse=True, scope="module")
def _no_process_group_left_behind():
    """The Trainer starts a one-process gloo group and keeps it until exit: ended after each
    module, so that tests run after these in one session (other packages' own groups, forked
    ranks) start without it."""
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
