"""Shared fixtures: one small config and one small dataset written once per session."""

from __future__ import annotations

import pytest
from gem_data import SyntheticConfig, write_synthetic_dataset


def pytest_configure(config) -> None:
    # Also registered in the workspace pyproject; repeated so the package tests run standalone.
    config.addinivalue_line("markers", "gpu: needs a CUDA device")


@pytest.fixture(scope="session")
def config() -> SyntheticConfig:
    return SyntheticConfig(seed=7)


@pytest.fixture(scope="session")
def dataset(tmp_path_factory, config):
    """600 samples in 3 shards with small row groups (several chunks per file)."""
    directory = tmp_path_factory.mktemp("dataset")
    return write_synthetic_dataset(
        config,
        directory,
        num_samples=600,
        num_shards=3,
        workers=1,
        progress=False,
        row_group_size=128,
    )
