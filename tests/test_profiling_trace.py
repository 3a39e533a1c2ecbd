"""The kernel summary: device activities placed in ranges by when they ran, kinds of work, totals."""

from types import SimpleNamespace

import pytest
from torch.autograd import DeviceType
from torch.autograd.profiler_util import Interval

from cs336_systems.profiling.trace import kernel_summary


def _event(name, start, end, device=DeviceType.CUDA, annotation=False):
    return SimpleNamespace(name=name, device_type=device, is_user_annotation=annotation,
                           time_range=Interval(start, end), self_cpu_time_total=0.0, cpu_parent=None)


def test_device_kernels_land_in_the_range_open_when_they_ran():
    events = [
        _event("step", 0, 1000, DeviceType.CPU),
        _event("forward", 10, 400, DeviceType.CPU),
        _event("backward", 400, 990, DeviceType.CPU),
        _event("forward", 12, 390, annotation=True),  # the GPU-side copy of a range is not a kernel
        _event("nvjet_gemm", 20, 120),
        _event("nvjet_gemm", 500, 700),  # launched from the autograd thread: only its time places it
        _event("_dkdv_kernel", 700, 950),
        _event("Memset (Device)", 995, 996),  # after the phases, inside the step
        _event("aten::mm", 30, 40, DeviceType.CPU),  # CPU ops are not device time
    ]
    table = kernel_summary(events, steps=1, on_device=True, range_names=("forward", "backward"))
    got = {(r.range, r.kernel): (r.calls, r.total_ms) for r in table.itertuples()}
    assert got == {("forward", "nvjet_gemm"): (1, 0.1), ("backward", "nvjet_gemm"): (1, 0.2),
                   ("backward", "_dkdv_kernel"): (1, 0.25), ("step", "Memset (Device)"): (1, 0.001)}
    assert table["share"].sum() == pytest.approx(1.0)


@pytest.mark.parametrize("name, category", [
    ("_dkdv_kernel", "attention backward dK/dV"),
    ("flash_dq_kernel", "attention backward dQ"),
    ("flash_row_stats_kernel", "attention backward row statistics"),
    ("flash_forward_kernel", "attention forward"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>", "attention (vendor)"),
    ("nvjet_hsh_256x128_64x4_1x2_h_bz_coopB_NNT", "matmul"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64", "matmul"),
    ("aten::addmm", "matmul"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>",
     "elementwise (torch)"),
    ("void at::native::elementwise_kernel<128, 4, direct_copy_kernel_cuda>", "copy / index (torch)"),
    ("void at::native::reduce_kernel<512, 1, ReduceOp<float, MaxOps<float>>>", "reduction (torch)"),
    ("silu_mul_backward_kernel", "swiglu gate (ours)"),
    ("adamw_multi_tensor_kernel", "optimizer"),
    ("something_new", "other"),
])
def test_kernel_categories(name, category):
    from cs336_systems.profiling.trace import kernel_category

    assert kernel_category(name) == category


def test_category_summary_adds_up():
    import pandas as pd

    from cs336_systems.profiling.trace import category_summary

    kernels = pd.DataFrame({"range": ["forward", "forward", "backward"],
                            "kernel": ["nvjet_a", "gemm_b", "_dkdv_kernel"],
                            "calls": [4, 2, 3], "calls_per_step": [2.0, 1.0, 1.5], "total_ms": [8.0, 2.0, 6.0],
                            "share": [0.5, 0.125, 0.375]})
    table = category_summary(kernels, steps=2).set_index(["range", "category"])
    assert table.loc[("forward", "matmul"), "ms_per_step"] == 5.0
    assert table.loc[("forward", "matmul"), "calls_per_step"] == 3.0
    assert table.loc[("backward", "attention backward dK/dV"), "share"] == 0.375
    assert table["share"].sum() == 1.0
