"""Jagged offsets helpers."""

import gc

import pytest
import torch
from gem_kernels import host_offsets, lengths_to_offsets, offsets_to_lengths, validate_offsets
from gem_kernels.jagged import TensorMemo, host_lengths
from hypothesis import given, settings
from hypothesis import strategies as st


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(0, 50), max_size=12), st.sampled_from([torch.int32, torch.int64]))
def test_lengths_offsets_round_trip(lengths, dtype):
    lengths_t = torch.tensor(lengths, dtype=dtype)
    offsets = lengths_to_offsets(lengths_t)
    assert offsets.dtype == dtype
    assert offsets.tolist() == [sum(lengths[:i]) for i in range(len(lengths) + 1)]
    assert offsets_to_lengths(offsets).tolist() == lengths
    validate_offsets(offsets, "offsets", num_rows=sum(lengths), max_len=max(lengths, default=0))


def test_lengths_to_offsets_dtype_override():
    offsets = lengths_to_offsets(torch.tensor([2, 3], dtype=torch.int32), dtype=torch.int64)
    assert offsets.dtype == torch.int64
    assert offsets.tolist() == [0, 2, 5]


@pytest.mark.parametrize(
    ("offsets", "kwargs", "error", "match"),
    [
        ([1, 2, 3], {}, ValueError, r"my_offsets must start at 0"),
        ([0, 3, 2], {}, ValueError, r"my_offsets must be non-decreasing.*my_offsets\[1\] = 3"),
        ([0, 2, 5], {"num_rows": 6}, ValueError, r"my_offsets\[-1\] must equal .* \(6\)"),
        ([0, 2, 9], {"max_len": 4}, ValueError, r"my_offsets has a sample of length 7"),
        ([], {}, ValueError, r"my_offsets must have at least one entry"),
    ],
)
def test_validate_offsets_rejects(offsets, kwargs, error, match):
    with pytest.raises(error, match=match):
        validate_offsets(torch.tensor(offsets, dtype=torch.int64), "my_offsets", **kwargs)


def test_validate_offsets_type_and_rank():
    with pytest.raises(TypeError, match=r"my_offsets must have dtype int32 or int64"):
        validate_offsets(torch.tensor([0.0, 1.0]), "my_offsets")
    with pytest.raises(ValueError, match=r"my_offsets must be 1-D"):
        validate_offsets(torch.zeros(2, 2, dtype=torch.int64), "my_offsets")
    with pytest.raises(TypeError, match=r"my_offsets must be a torch.Tensor"):
        validate_offsets([0, 1], "my_offsets")


def test_lengths_to_offsets_rejects_negative():
    with pytest.raises(ValueError, match=r"lengths must be non-negative"):
        lengths_to_offsets(torch.tensor([1, -1]))


def test_lengths_to_offsets_refuses_offsets_past_the_dtype():
    with pytest.raises(ValueError, match=r"above the largest torch.int32 offset"):
        lengths_to_offsets(torch.tensor([2**32 + 3, 5]), dtype=torch.int32)
    with pytest.raises(ValueError, match=r"pass dtype=torch.int64"):
        lengths_to_offsets(torch.tensor([2**30] * 3, dtype=torch.int32))
    assert (
        lengths_to_offsets(torch.tensor([2**30] * 3, dtype=torch.int32), dtype=torch.int64)[-1]
        == 3 * 2**30
    )


def test_host_offsets_of_cpu_int64_offsets_is_a_copy():
    """The cached host copy never shares storage with the caller's tensor, whose writes
    through .data or .numpy() would bypass the version counter the cache is keyed on."""
    offsets = torch.tensor([0, 2, 5])
    host = host_offsets(offsets)
    assert host.tolist() == [0, 2, 5] and host.data_ptr() != offsets.data_ptr()


def test_host_offsets_is_read_once_per_tensor_and_version():
    offsets = torch.tensor([0, 2, 2, 7], dtype=torch.int32)
    first = host_offsets(offsets)
    assert first.dtype == torch.int64 and first.tolist() == [0, 2, 2, 7]
    assert host_offsets(offsets) is first  # remembered: no second device read
    offsets[3] = 9  # an in-place change bumps the version counter: read again
    assert host_offsets(offsets).tolist() == [0, 2, 2, 9]
    twin = offsets.clone()  # same values, another tensor: its own entry
    assert host_offsets(twin) is not host_offsets(offsets)
    assert host_offsets(twin).tolist() == [0, 2, 2, 9]


def test_tensor_memo_is_per_tensor_and_version_and_forgets_dead_tensors():
    memo = TensorMemo()
    calls = []

    def derive(t):
        calls.append(t.tolist())
        return sum(calls[-1])

    lengths = torch.tensor([2, 5])
    assert memo.get(lengths, derive) == 7
    assert memo.get(lengths, derive) == 7 and len(calls) == 1  # remembered
    assert memo.get(lengths.clone(), derive) == 7 and len(calls) == 2  # another tensor
    lengths[0] = 4  # in place: derived again
    assert memo.get(lengths, derive) == 9 and len(calls) == 3
    del lengths
    gc.collect()
    assert len(memo) == 0  # entries die with their tensors
    with torch.inference_mode():  # no version counter: derived at every call
        frozen = torch.tensor([1])
    assert memo.get(frozen, derive) == memo.get(frozen, derive) == 1 and len(calls) == 5
    assert len(memo) == 0


def test_validation_is_remembered_per_version_and_arguments():
    """A passed check is not repeated for the same tensor version and arguments; any other
    version or argument is checked again (and can fail)."""
    offsets = torch.tensor([0, 2, 2, 7])
    validate_offsets(offsets, num_rows=7, max_len=5)
    validate_offsets(offsets, num_rows=7, max_len=5)  # remembered
    with pytest.raises(ValueError, match="must equal the number of rows"):
        validate_offsets(offsets, num_rows=8, max_len=5)
    with pytest.raises(ValueError, match="above the declared max length 4"):
        validate_offsets(offsets, num_rows=7, max_len=4)
    offsets[2] = 9  # now decreasing: the in-place change invalidates what was checked
    with pytest.raises(ValueError, match="must be non-decreasing"):
        validate_offsets(offsets, num_rows=7, max_len=5)
    assert host_lengths(offsets).tolist() == [2, 7, -2]
