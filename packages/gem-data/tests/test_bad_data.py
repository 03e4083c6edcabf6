"""Bad training data at run time (issue 27): every case of ``data_faults`` is a named
``DatasetFormatError`` giving the file (and the row group where there is one), or, with
``on_bad_row="skip"``, exactly the bad rows left out and counted."""

from __future__ import annotations

import pytest
from data_faults import BATCH, CASES, make_dataset, run_case
from gem_data import ParquetBatchLoader, ShardedBatchLoader


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_data_case(tmp_path, name):
    result = run_case(name, tmp_path / "dataset")
    key = "skipped" if name.endswith(("_skip", "_skip_in_memory")) else "named_error"
    assert result[key] == 1, result


@pytest.mark.parametrize("cls", [ParquetBatchLoader, ShardedBatchLoader])
def test_on_bad_row_is_checked(tmp_path, cls):
    directory = make_dataset(tmp_path / "dataset")
    with pytest.raises(ValueError, match="on_bad_row must be one of"):
        cls(directory, BATCH, on_bad_row="drop")
    assert cls(directory, BATCH).on_bad_row == "error"
    assert cls(directory, BATCH).skipped_rows == 0
