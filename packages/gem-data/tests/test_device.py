"""DevicePrefetcher and Batch stream helpers: CPU pass-through here, the CUDA path under `gpu`."""

from __future__ import annotations

import time

import pytest
import torch
from gem_data import Batch, DevicePrefetcher, ShardedBatchLoader


def _same(left: Batch, right: Batch) -> None:
    for name in ("sequence_features", "sparse_features"):
        a, b = getattr(left, name), getattr(right, name)
        assert a.keys() == b.keys()
        assert torch.equal(a.values().cpu(), b.values().cpu())
        assert torch.equal(a.lengths().cpu(), b.lengths().cpu())
    for name in (
        "sequence_offsets",
        "sequence_timestamps",
        "dense_features",
        "labels",
        "label_probs",
        "sample_indices",
    ):
        assert torch.equal(getattr(left, name).cpu(), getattr(right, name).cpu()), name


def test_cpu_prefetcher_passes_batches_through(dataset):
    loader = ShardedBatchLoader(dataset.directory, 64, seed=1, sub_batch_size=16)
    reference = list(ShardedBatchLoader(dataset.directory, 64, seed=1, sub_batch_size=16))
    prefetcher = DevicePrefetcher(loader, "cpu", depth=2)
    assert len(prefetcher) == len(loader)
    moved = list(prefetcher)
    assert len(moved) == len(reference)
    for left, right in zip(moved, reference, strict=True):
        _same(left, right)
        assert left.dense_features.device.type == "cpu"


def test_prefetcher_state_resumes_after_the_batch_handed_out(dataset):
    reference = list(ShardedBatchLoader(dataset.directory, 64, seed=1, sub_batch_size=16))
    prefetcher = DevicePrefetcher(
        ShardedBatchLoader(dataset.directory, 64, seed=1, sub_batch_size=16), "cpu"
    )
    for index, _batch in enumerate(prefetcher):
        if index == 2:
            state = prefetcher.state_dict()
            break
    resumed = ShardedBatchLoader(dataset.directory, 64, seed=1, sub_batch_size=16)
    resumed.load_state_dict(state)
    _same(next(iter(resumed)), reference[3])


def test_batches_are_drawn_ahead_by_a_background_thread(dataset):
    """While the consumer holds batch i, the next is already drawn, off the consumer's thread:
    the consumer's time between steps is not spent assembling batches."""
    import threading

    drawn: list[tuple[int, str]] = []

    class Source:
        def __init__(self, batches):
            self.batches = batches

        def __iter__(self):
            for index, batch in enumerate(self.batches):
                drawn.append((index, threading.current_thread().name))
                yield batch

    batches = list(ShardedBatchLoader(dataset.directory, 64, seed=1, sub_batch_size=16))[:4]
    prefetcher = DevicePrefetcher(Source(batches), "cpu")
    for index, batch in enumerate(prefetcher):
        _same(batch, batches[index])
        deadline = time.monotonic() + 10
        while len(drawn) < min(index + 2, len(batches)) and time.monotonic() < deadline:
            time.sleep(0.001)
        assert len(drawn) >= min(index + 2, len(batches)), "the next batch was not drawn ahead"
    assert {name for _, name in drawn} == {"gem-data-prefetch"}
    assert not any(t.name == "gem-data-prefetch" for t in threading.enumerate())


def test_an_error_of_the_source_reaches_the_consumer():
    def broken():
        yield from ()
        raise OSError("row group 3 of shard-00001.parquet is unreadable")

    with pytest.raises(OSError, match="row group 3"):
        list(DevicePrefetcher(broken(), "cpu"))


def test_iterating_again_after_an_early_stop_skips_nothing(dataset):
    reference = list(ShardedBatchLoader(dataset.directory, 64, seed=1, sub_batch_size=16))
    prefetcher = DevicePrefetcher(
        ShardedBatchLoader(dataset.directory, 64, seed=1, sub_batch_size=16), "cpu", depth=3
    )
    for index, _batch in enumerate(prefetcher):
        if index == 1:
            break  # the thread has drawn batches 2, 3, ... already
    _same(next(iter(prefetcher)), reference[2])


def test_prefetcher_arguments():
    with pytest.raises(ValueError, match="depth"):
        DevicePrefetcher([], "cpu", depth=0)
    assert list(DevicePrefetcher([], "cpu")) == []
    with pytest.raises(TypeError, match="pin_memory"):
        DevicePrefetcher([], "cpu", pin_memory="no")  # type: ignore[arg-type]
    if not torch.cuda.is_available():  # checked here, not in the producer thread
        with pytest.raises(ValueError, match="pin_memory=True needs CUDA"):
            DevicePrefetcher([], "cpu", pin_memory=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_prefetch_on_side_stream(dataset):
    loader = ShardedBatchLoader(dataset.directory, 64, seed=1, sub_batch_size=16)
    assert loader.pin_memory  # CUDA is available: batches come pinned
    reference = list(
        ShardedBatchLoader(dataset.directory, 64, seed=1, sub_batch_size=16, pin_memory=False)
    )
    assert not reference[0].is_pinned()
    first = next(iter(ShardedBatchLoader(dataset.directory, 64, seed=1, sub_batch_size=16)))
    assert first.is_pinned()
    compute = torch.cuda.Stream()
    with torch.cuda.stream(compute):  # the consumer works on a non-default stream
        sums = []
        moved = []
        for batch in DevicePrefetcher(loader, "cuda", depth=2):
            assert batch.dense_features.is_cuda and batch.sequence_features.values().is_cuda
            # Work on the consumer stream right away: it must see the finished copy.
            assert not batch.sequence_offsets.is_cuda  # the host copy the kernels plan from
            sums.append((batch.dense_features.double().sum(), batch.sequence_offsets[-1]))
            moved.append(batch)
    torch.cuda.synchronize()
    assert len(moved) == len(reference)
    # Two batches ahead, the prefetcher still reports the position after the one handed out.
    loader = ShardedBatchLoader(dataset.directory, 64, seed=1, sub_batch_size=16)
    prefetcher = DevicePrefetcher(loader, "cuda", depth=2)
    for index, _batch in enumerate(prefetcher):
        if index == 1:
            resumed = ShardedBatchLoader(dataset.directory, 64, seed=1, sub_batch_size=16)
            resumed.load_state_dict(prefetcher.state_dict())
            _same(next(iter(resumed)), reference[2])
            break
    for (dense_sum, total), left, right in zip(sums, moved, reference, strict=True):
        _same(left, right)
        assert dense_sum.item() == pytest.approx(right.dense_features.double().sum().item())
        assert total.item() == right.sequence_offsets[-1].item()
