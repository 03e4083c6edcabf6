"""profile_kernels.py turns Nsight Compute's raw CSV into per-kernel metrics and result rows."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import profile_kernels  # noqa: E402

# The shape of `ncu --page raw --csv` output: tool lines, a header row, a units row, one row
# per kernel launch (numbers may carry thousands separators).
RAW = """==PROF== Connected to process 1
==PROF== Disconnected from process 1
"ID","Process ID","Kernel Name","gpu__time_duration.sum","dram__bytes_read.sum","dram__bytes_write.sum","launch__registers_per_thread","smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio","l1tex__t_bytes.sum"
"","","","ns","byte","byte","register/thread","ratio","byte"
"0","7","blockwise_tile_kernel","365,088","536,913,664","539,561,728","211","0.29","12"
"1","7","column_sum_kernel(float*, float*)","6,432","8,395,520","0","56","0.67","3"
"""


def test_raw_csv_keeps_the_chosen_metrics_per_kernel():
    kernels = profile_kernels.parse_raw_csv(RAW)
    assert [k["kernel"] for k in kernels] == [
        "blockwise_tile_kernel",
        "column_sum_kernel(float*, float*)",
    ]
    first = kernels[0]
    assert first["gpu__time_duration.sum [ns]"] == 365088.0
    assert first["launch__registers_per_thread [register/thread]"] == 211.0
    assert first["smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio [ratio]"] == 0.29
    assert not any(name.startswith("l1tex__t_bytes") for name in first)  # not a kept metric
    assert profile_kernels.parse_raw_csv("==PROF== no kernels profiled\n") == []


def test_summary_rows_convert_units_and_derive_dram_bandwidth():
    rows = profile_kernels.summary_rows("dy", profile_kernels.parse_raw_csv(RAW))
    by = {(r["provider"], r["metric"]): r["value"] for r in rows}
    assert by[("blockwise_tile_kernel", "us")] == 365.088
    assert by[("blockwise_tile_kernel", "registers")] == 211.0
    # (read + write) bytes over ns = GB/s
    assert by[("blockwise_tile_kernel", "dram_gbps")] == round((536913664 + 539561728) / 365088, 1)
    assert by[("column_sum_kernel", "dram_gbps")] == round(8395520 / 6432, 1)
    assert all(r["case"] == "dy" and r["mode"] == "profile" for r in rows)
