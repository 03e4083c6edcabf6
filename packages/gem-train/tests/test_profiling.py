"""The profile's split of the end-to-end MFU: exposed communication from device activities."""

import pytest
from gem_model import ModelFlops
from gem_train.profiling import exposed_seconds, profile_table, region_profile
from rich.console import Console
from torch.autograd import DeviceType
from torch.autograd.profiler_util import FunctionEvent


@pytest.mark.parametrize(
    ("communication", "compute", "exposed"),
    [
        ([(0, 10)], [(2, 3), (5, 12)], 4),  # partly hidden, compute past its end
        ([(0, 4), (3, 8)], [(1, 2)], 7),  # overlapping collectives count once
        ([(5, 6)], [(0, 10)], 0),  # fully hidden
        ([(0, 2), (4, 6)], [(1, 5)], 2),  # one compute span over two collectives
        ([(5, 6)], [], 1),
        ([], [(0, 1)], 0),
    ],
)
def test_exposed_seconds(communication, compute, exposed):
    assert exposed_seconds(communication, compute) == exposed


def test_profile_splits_mfu_into_local_and_scaling():
    def device(name, start_us, end_us, annotation=False):
        return FunctionEvent(id=0, name=name, thread=0, start_us=start_us, end_us=end_us,
                             device_type=DeviceType.CUDA,
                             is_user_annotation=annotation)  # fmt: skip

    events = [
        device("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 0, 10_000),
        device("sm90_xmma_gemm_bf16bf16", 2_000, 3_000),
        device("triton_poi_fused_add", 5_000, 12_000),
        device("Memcpy HtoD (Pinned -> Device)", 8_000, 9_000),  # not compute
        device("Memcpy PtoP (Device -> Device)", 14_000, 15_000),  # a copy-engine collective
        # A profiler range as the GPU timeline shows it: a span, neither compute nor a region's
        # time (its host range and kernels are).
        device("gem_model/dhen", 0, 16_000, annotation=True),
    ]
    flops = ModelFlops(0.0, 4e12, 4e12, 0.0, 0.0, 2e12, 0.0, 0.0)
    profile = region_profile(events, steps=1, wall_seconds=0.02, flops=flops,
                             peak_tflops=1000.0, on_gpu=True)  # fmt: skip
    assert profile["exposed_communication_ms"] == pytest.approx(5.0)  # 4 of nccl + 1 PtoP
    assert profile["scaling_ratio"] == pytest.approx(0.75)
    assert profile["mfu"] == pytest.approx(flops.total / 1e12 / 0.02 / 1000.0)
    assert profile["mfu"] == pytest.approx(profile["local_mfu"] * profile["scaling_ratio"])
    assert {row["region"]: row["ms"] for row in profile["regions"]}["dhen"] == 0.0
    console = Console(record=True, width=200)
    console.print(profile_table(profile, "step"))
    caption = console.export_text().splitlines()[-1]
    assert caption == (
        "MFU 50.0% = local 66.7% x scaling 0.750 (exposed communication 5.00 ms of 20.00 ms)"
    )
