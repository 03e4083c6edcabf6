"""The training batch: jagged histories, sparse ids as KeyedJaggedTensors, dense features, labels."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.streamable import Pipelineable

__all__ = ["Batch"]


@dataclass
class Batch(Pipelineable):
    """One training batch of ``B`` samples whose histories hold ``T`` events in total.

    A torchrec ``Pipelineable`` (``to`` and ``record_stream``): torchrec's train pipelines
    copy it to the device and start its lookups' input distribution ahead of its step."""

    sequence_features: KeyedJaggedTensor
    """Keys ``hist_item_ids``, ``hist_category_ids``, ``hist_action_types``; every key's
    lengths are the history lengths (B,), values int64 (T,) per key."""
    sequence_offsets: torch.Tensor
    """(B + 1,) int64 offsets of the histories into each key's values (0 first, T last). Always
    on the host (pinned with the batch; :meth:`to` leaves it there): the attention kernels plan
    their tiles from it, so the training step never copies lengths back from the GPU."""
    sequence_timestamps: torch.Tensor
    """(T,) int64 event timestamps (seconds), increasing within a history."""
    sparse_features: KeyedJaggedTensor
    """Keys ``user_id``, ``user_segments``, ``device_type``, ``region``, ``ad_id``,
    ``ad_category_id``; single-valued features have length 1 per sample."""
    dense_features: torch.Tensor
    """(B, num_dense_features) float32."""
    labels: torch.Tensor
    """(B, 2) float32: column 0 click, column 1 conversion."""
    label_probs: torch.Tensor
    """(B, 2) float32 true probabilities of the labels (diagnostics only, never train on it)."""
    sample_indices: torch.Tensor | None = None
    """(B,) int64 global sample index of each row (None when built by hand)."""

    @property
    def batch_size(self) -> int:
        """Number of samples ``B``."""
        return int(self.dense_features.shape[0])

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        """A copy of the batch on ``device``: every tensor and both KeyedJaggedTensors, except
        ``sequence_offsets``, which stays on the host."""
        device = torch.device(device)
        return Batch(
            sequence_features=self.sequence_features.to(device=device, non_blocking=non_blocking),
            sequence_offsets=self.sequence_offsets,
            sequence_timestamps=self.sequence_timestamps.to(device, non_blocking=non_blocking),
            sparse_features=self.sparse_features.to(device=device, non_blocking=non_blocking),
            dense_features=self.dense_features.to(device, non_blocking=non_blocking),
            labels=self.labels.to(device, non_blocking=non_blocking),
            label_probs=self.label_probs.to(device, non_blocking=non_blocking),
            sample_indices=(
                None
                if self.sample_indices is None
                else self.sample_indices.to(device, non_blocking=non_blocking)
            ),
        )

    def pin_memory(self) -> Batch:
        """A copy in pinned host memory, for ``to(cuda, non_blocking=True)``."""
        return Batch(
            sequence_features=self.sequence_features.pin_memory(),
            sequence_offsets=self.sequence_offsets.pin_memory(),
            sequence_timestamps=self.sequence_timestamps.pin_memory(),
            sparse_features=self.sparse_features.pin_memory(),
            dense_features=self.dense_features.pin_memory(),
            labels=self.labels.pin_memory(),
            label_probs=self.label_probs.pin_memory(),
            sample_indices=None
            if self.sample_indices is None
            else self.sample_indices.pin_memory(),
        )

    def is_pinned(self) -> bool:
        """Whether every dense tensor of the batch is in pinned host memory."""
        return all(
            tensor.is_pinned()
            for tensor in (
                self.sequence_features.values(),
                self.sparse_features.values(),
                self.sequence_offsets,
                self.dense_features,
                self.labels,
            )
        )

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        """Mark every CUDA tensor as used by ``stream`` (for tensors made on another stream).

        The caching allocator then does not reuse their memory until ``stream``'s work queued so
        far is done, even after the batch is freed.
        """
        self.sequence_features.record_stream(stream)
        self.sparse_features.record_stream(stream)
        for tensor in (
            self.sequence_timestamps,
            self.dense_features,
            self.labels,
            self.label_probs,
            self.sample_indices,
        ):
            if tensor is not None:
                tensor.record_stream(stream)
