"""The reference never pads to the batch max: score tensors stay bounded for skewed lengths."""

import torch
from gem_kernels import block_attention, gdpa, jagged_flash_attention
from gem_kernels.reference import (
    DEFAULT_SCORE_BUDGET,
    jagged_flash_attention_reference,
    track_score_elements,
)
from kernels_naive import make_jagged, offsets_of

H, D = 2, 4


def _self_inputs(lengths, dtype=torch.float32):
    total = sum(lengths)
    return [make_jagged(total, H, D, seed=i, dtype=dtype).requires_grad_(True) for i in range(3)]


def _jagged_work(q_lengths, k_lengths, heads=H):
    """Elements of the unpadded per-sample score matrices, each side at least 16."""
    return heads * sum(max(a, 16) * max(b, 16) for a, b in zip(q_lengths, k_lengths, strict=True))


def test_skewed_lengths_do_not_scale_with_batch_times_max_squared():
    lengths = [1000] + [4] * 400 + [0, 1]
    q, k, v = _self_inputs(lengths)
    with track_score_elements() as stats:
        out = jagged_flash_attention(q, k, v, offsets_of(lengths), causal=True)
        out.sum().backward()
    padded_to_max = H * len(lengths) * max(lengths) ** 2
    assert stats.max_elements <= DEFAULT_SCORE_BUDGET
    # Within the 2x-per-side bucket padding of the real jagged work ...
    assert stats.total_elements <= 4 * _jagged_work(lengths, lengths)
    # ... which is far below what padding every sample to the max would allocate.
    assert stats.total_elements * 100 < padded_to_max
    # Batched: a handful of score tensors, not one per sample.
    assert stats.num_tensors <= 4


def test_short_samples_are_batched_not_looped():
    lengths = [3, 7, 12, 1, 16, 9] * 500  # 3000 short samples
    q, k, v = _self_inputs(lengths)
    with track_score_elements() as stats:
        gdpa(q, k, v, offsets_of(lengths), activation="silu")
    assert stats.num_tensors <= 4
    assert stats.total_elements <= 4 * _jagged_work(lengths, lengths)


def test_long_sequence_is_row_chunked_under_the_budget():
    lengths = [700, 5, 0, 33, 1]
    q, k, v = _self_inputs(lengths, dtype=torch.float64)
    offsets = offsets_of(lengths)
    budget = 20_000  # far below one 700 x 700 x H score matrix
    with track_score_elements() as stats:
        chunked = jagged_flash_attention_reference(
            q, k, v, offsets, causal=True, window=(50, 0), score_budget=budget
        )
    assert stats.max_elements <= budget
    assert stats.num_tensors > 1
    whole = jagged_flash_attention_reference(q, k, v, offsets, causal=True, window=(50, 0))
    torch.testing.assert_close(chunked, whole)


def test_peak_score_tensor_is_independent_of_batch_size():
    peaks = []
    for num_short in (200, 800):
        lengths = [600] + [10] * num_short
        q, k, v = _self_inputs(lengths)
        with track_score_elements() as stats:
            jagged_flash_attention_reference(q, k, v, offsets_of(lengths), score_budget=50_000)
        peaks.append(stats.max_elements)
    assert max(peaks) <= 50_000
    assert peaks[1] <= peaks[0] * 1.01  # 4x more samples, same peak


def test_block_attention_pads_only_within_blocks():
    lengths = [2000] + [3] * 300
    q, k, v = _self_inputs(lengths)
    with track_score_elements() as stats:
        block_attention(q, k, v, offsets_of(lengths), block_size=64)
    num_blocks = sum(-(-n // 64) for n in lengths)
    assert stats.total_elements <= H * num_blocks * 64 * 64
    assert stats.max_elements <= DEFAULT_SCORE_BUDGET


def test_pma_broadcast_scores_scale_with_jagged_keys():
    k_lengths = [3000] + [2] * 500
    k = make_jagged(sum(k_lengths), H, D, seed=0, dtype=torch.float32)
    q = make_jagged(2, H, D, seed=1, dtype=torch.float32)
    with track_score_elements() as stats:
        out = gdpa(q, k, k, None, offsets_of(k_lengths))
    assert out.shape == (2 * len(k_lengths), H, D)
    assert stats.total_elements <= 4 * _jagged_work([2] * len(k_lengths), k_lengths)
