"""A torch.profiler run and the kernel summary a user would otherwise read in Nsight.

`profile_steps` runs a step function under torch.profiler, writes a Chrome/Perfetto trace,
and `kernel_summary` turns the events into a table: top device kernels (CPU ops on a
CPU-only run) by total time, calls per step, share of time, and the innermost named range
(`forward`, `backward`, `optimizer`, `attention/...`) each was launched from.
`category_summary` folds that table into kinds of work (matmuls, our attention passes, our
fused pointwise kernels, PyTorch's elementwise/reduction/copy kernels), which is how a step's
time is read: products against everything around them.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile


def profile_steps(step: Callable[[], object], *, steps: int, device: torch.device | str,
                  trace_path: str | Path | None = None, range_names: tuple[str, ...] = ()) -> pd.DataFrame:
    """Profile `steps` calls of `step` (already warmed up); return the kernel summary."""
    device = torch.device(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, record_shapes=False, with_stack=False) as prof:
        for _ in range(steps):
            with torch.profiler.record_function("step"):
                step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    if trace_path is not None:
        Path(trace_path).parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace_path))
    return kernel_summary(prof.events(), steps=steps, on_device=device.type == "cuda", range_names=range_names)


def _enclosing_range(event, range_names: set[str], intervals: list[tuple[float, float, str]]) -> str:
    """The innermost named range around a CPU op: its own call stack first, then (for ops the autograd
    engine runs on another thread) the shortest named range open at its start."""
    parent = event
    while parent is not None:
        if parent.name in range_names and parent.name != "step":
            return parent.name
        parent = parent.cpu_parent
    return _range_at(event.time_range.start, intervals)


def _range_at(time_us: float, intervals: list[tuple[float, float, str]]) -> str:
    """The shortest named range (CPU interval) open at `time_us`; `(other)` if none."""
    around = [(end - begin, name) for begin, end, name in intervals if begin <= time_us <= end]
    return min(around)[1] if around else "(other)"


def kernel_summary(events, *, steps: int, on_device: bool, range_names: tuple[str, ...] = ()) -> pd.DataFrame:
    """One row per (range, kernel): calls, calls/step, total ms, share of all kernel time.

    On a GPU every device activity (kernel, memcpy, memset) is counted once, from its own event, and
    placed in the named range open when it *started on the device*. That is exact when the ranges
    synchronise at their edges (`PhaseRanges(sync=True)`): the device has finished one range's work
    before the next range launches, whichever thread launched it (backward runs on the autograd
    engine's thread, which no CPU call stack ties to `backward`). Without synchronisation a kernel
    that runs late lands in a later range. On CPU, ops are counted by self time."""
    names = set(range_names) | {"step"}
    cpu_ranges = [e for e in events if e.name in names and e.device_type == DeviceType.CPU]
    intervals = [(e.time_range.start, e.time_range.end, e.name) for e in cpu_ranges]
    rows = []
    for event in events:
        if on_device:
            if event.device_type == DeviceType.CUDA and not event.is_user_annotation and event.name not in names:
                rows.append((_range_at(event.time_range.start, intervals), event.name,
                             event.time_range.elapsed_us() / 1e3))
        elif event.name not in names and event.self_cpu_time_total > 0:
            # CPU ops by self time (their children's time excluded), so nested ops are not counted twice
            # and an addmm keeps its own time rather than handing it to the copies it launches.
            rows.append((_enclosing_range(event, names, intervals), event.name, event.self_cpu_time_total / 1e3))
    columns = ["range", "kernel", "calls", "calls_per_step", "total_ms", "share"]
    if not rows:
        return pd.DataFrame(columns=columns)
    frame = pd.DataFrame(rows, columns=["range", "kernel", "ms"])
    table = frame.groupby(["range", "kernel"]).agg(calls=("ms", "size"), total_ms=("ms", "sum")).reset_index()
    table["calls_per_step"] = table["calls"] / steps
    table["share"] = table["total_ms"] / table["total_ms"].sum()
    return table.sort_values("total_ms", ascending=False)[columns].reset_index(drop=True)


# First match wins: our kernels by their jit names, then vendor matmuls, then PyTorch's generic kernels.
KERNEL_CATEGORIES: tuple[tuple[str, str], ...] = (
    (r"flash_forward", "attention forward"),
    (r"dkdv", "attention backward dK/dV"),
    (r"flash_dq", "attention backward dQ"),
    (r"flash_preprocess", "attention backward D"),
    (r"flash_row_stats", "attention backward row statistics"),
    (r"flash|fmha|cudnn|sdpa|attention", "attention (vendor)"),
    (r"rmsnorm", "rmsnorm (ours)"),
    (r"silu_mul", "swiglu gate (ours)"),
    (r"rope", "rope (ours)"),
    (r"adamw|multi_tensor_apply", "optimizer"),
    (r"nvjet|gemm|xmma|cutlass|cublas|matmul|^aten::(mm|addmm|bmm|baddbmm)$", "matmul"),  # aten: CPU runs
    (r"reduce|softmax|logsumexp|norm_kernel", "reduction (torch)"),
    (r"copy|CatArray|memcpy|memset|fill|index|gather|scatter|embedding", "copy / index (torch)"),
    (r"elementwise|vectorized|unrolled", "elementwise (torch)"),
    (r"^triton_", "inductor (compiled)"),
)


def kernel_category(name: str) -> str:
    """The kind of work a device kernel does, from its name (`KERNEL_CATEGORIES`); `other` if none match."""
    for pattern, category in KERNEL_CATEGORIES:
        if re.search(pattern, name, flags=re.IGNORECASE):
            return category
    return "other"


def category_summary(summary: pd.DataFrame, *, steps: int) -> pd.DataFrame:
    """`kernel_summary` rows grouped into (range, category): calls per step, ms per step, share."""
    columns = ["range", "category", "calls_per_step", "ms_per_step", "share"]
    if summary.empty:
        return pd.DataFrame(columns=columns)
    frame = summary.assign(category=summary["kernel"].map(kernel_category))
    table = frame.groupby(["range", "category"]).agg(calls=("calls", "sum"), total_ms=("total_ms", "sum"),
                                                     share=("share", "sum")).reset_index()
    table["calls_per_step"] = table["calls"] / steps
    table["ms_per_step"] = table["total_ms"] / steps
    return table.sort_values("ms_per_step", ascending=False)[columns].reset_index(drop=True)
