"""benchmarks/harness.py: one results file from a run split over several invocations."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from harness import earlier_rows, gpu_idle, kernel_ms_by_kind, write_results  # noqa: E402


def _row(case, provider="gem", value=1.0):
    return {"case": case, "provider": provider, "mode": "fwd_bwd_step", "metric": "ms",
            "value": value}  # fmt: skip


def test_earlier_rows_keep_other_cases_and_join_the_commands(tmp_path):
    path = tmp_path / "train.json"
    first = {"benchmark": "train", "commit": "abc", "command": "bench --cases A B"}
    assert earlier_rows(path, first, ["A", "B"]) == (first, [])  # nothing there yet
    write_results(path, first, [_row("A"), _row("B"), _row("B", "baseline")])
    second = {"benchmark": "train", "commit": "abc", "command": "bench --cases B C"}
    meta, kept = earlier_rows(path, second, ["B", "C"])
    assert kept == [_row("A")]  # B is redone by this invocation
    assert meta["command"] == "bench --cases A B ; bench --cases B C"
    write_results(path, meta, [*kept, _row("B", value=2.0), _row("C")])
    third = {"benchmark": "train", "commit": "abc", "command": "bench --cases B C"}
    meta, kept = earlier_rows(path, third, ["D"])
    assert meta["command"] == "bench --cases A B ; bench --cases B C"  # a command once
    assert [r["case"] for r in kept] == ["A", "B", "C"]
    assert json.loads(path.read_text())["rows"][1]["value"] == 2.0


def test_earlier_rows_with_providers_keep_the_case_s_other_providers(tmp_path):
    path = tmp_path / "train.json"
    meta = {"benchmark": "train", "commit": "abc", "command": "bench --cases A"}
    write_results(path, meta, [_row("A"), _row("A", "baseline"), _row("B")])
    second = {**meta, "command": "bench --cases A --providers gem-eager baseline"}
    _, kept = earlier_rows(path, second, ["A"], ["gem-eager", "baseline"])
    assert kept == [_row("A"), _row("B")]  # gem's row of A stays; baseline is redone


@pytest.mark.parametrize("key", ["benchmark", "commit"])
def test_earlier_rows_refuse_another_benchmark_or_commit(tmp_path, key):
    path = tmp_path / "train.json"
    meta = {"benchmark": "train", "commit": "abc", "command": "bench"}
    write_results(path, meta, [_row("A")])
    with pytest.raises(ValueError, match=f"holds {key}"):
        earlier_rows(path, {**meta, key: "other"}, ["B"])


def test_kernels_are_split_by_kind_per_step():
    kernels = [
        ("nvjet_sm90_tst_256x152_64x4_1x2_h_bz_coopA_bias_TNT", 3000.0),
        ("triton_poi_fused_cat_mul_silu_silu_backward_split_0", 1000.0),
        ("jfa_bwd_dkdv_kernel", 800.0),
        ("triton_tem_fused_0", 400.0),  # FlexAttention's template kernel
        (
            "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>",
            200.0,
        ),
        ("void split_embedding_nobag_codegen_forward_unweighted_kernel<float>", 100.0),
        ("Memcpy HtoD (Pinned -> Device)", 50.0),
        ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 20.0),
        ("segment_sum_kernel", 10.0),
    ]
    split = kernel_ms_by_kind(kernels, steps=2)
    assert list(split) == [
        "gemm",
        "attention",
        "inductor",
        "elementwise",
        "embedding",
        "copy",
        "communication",
        "other",
    ]  # largest first
    assert split == pytest.approx(
        {
            "gemm": 1.5,
            "attention": 0.6,
            "inductor": 0.5,
            "elementwise": 0.1,
            "embedding": 0.05,
            "copy": 0.025,
            "communication": 0.01,
            "other": 0.005,
        }
    )


def test_gpu_idle_merges_streams_and_keeps_only_real_gaps():
    # Two streams overlap (0-100, 50-150), then a gap to 400, a touching interval, a short gap.
    busy = [(400, 410), (0, 100), (50, 150), (410, 420), (425, 430)]
    assert gpu_idle(busy) == [(150, 400), (420, 425)]
    assert gpu_idle(busy, min_gap=10) == [(150, 400)]
    assert gpu_idle([]) == []
