"""Named ranges around the phases of a step: NVTX (for Nsight Systems), torch.profiler
record_function (for our kernel summary) and per-phase CUDA-event timing and peak memory.

Everything is off by default and then costs a `nullcontext`. Nsight users run e.g.

    nsys profile -o xl_fwd --trace=cuda,nvtx --capture-range=cudaProfilerApi \
        cs336-bench model --preset xl --nvtx

and filter on the `measured` range so warm-up steps stay out of the numbers.
"""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from collections.abc import Iterator
from timeit import default_timer

import torch

import cs336_basics.model as basics_model


class PhaseRanges:
    """Opens one range per phase: `with ranges.phase("forward"): ...`.

    nvtx: push NVTX ranges; record: torch.profiler.record_function; time: per-phase times
    (CUDA events on GPU); memory: peak allocated/reserved bytes per phase (CUDA only); sync:
    synchronise the device at each range's edges (CUDA only), so a profile can place every kernel
    in the range it belongs to by when it ran (`trace.kernel_summary`); for profiles, not timing.
    """

    def __init__(self, device: torch.device | str = "cpu", *, nvtx: bool = False, record: bool = False,
                 time: bool = False, memory: bool = False, sync: bool = False):
        self.device = torch.device(device)
        self.sync = sync and self.device.type == "cuda"
        self.nvtx = nvtx and self.device.type == "cuda"
        self.record, self.time = record, time
        self.memory = memory and self.device.type == "cuda"
        self._pending: list[tuple[str, object, object]] = []
        self.times_s: dict[str, list[float]] = defaultdict(list)
        self.peak_bytes: dict[str, dict[str, int]] = {}

    @property
    def active(self) -> bool:
        return self.nvtx or self.record or self.time or self.memory or self.sync

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if not self.active:
            yield
            return
        with contextlib.ExitStack() as stack:
            if self.nvtx:
                stack.enter_context(torch.cuda.nvtx.range(name))
            if self.record:
                stack.enter_context(torch.profiler.record_function(name))
            if self.sync:  # inside the range at both ends: its kernels start and finish within it
                torch.cuda.synchronize(self.device)
                stack.callback(torch.cuda.synchronize, self.device)
            if self.memory:
                torch.cuda.reset_peak_memory_stats(self.device)
            start = self._mark()
            yield
            if self.time:
                self._pending.append((name, start, self._mark()))
            if self.memory:
                peaks = self.peak_bytes.setdefault(name, {"allocated": 0, "reserved": 0})
                peaks["allocated"] = max(peaks["allocated"], torch.cuda.max_memory_allocated(self.device))
                peaks["reserved"] = max(peaks["reserved"], torch.cuda.max_memory_reserved(self.device))

    def _mark(self):
        if self.time and self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return default_timer()

    def collect(self) -> dict[str, list[float]]:
        """Resolve recorded marks into seconds (synchronises once) and return times per phase."""
        if self._pending and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        for name, start, end in self._pending:
            elapsed = start.elapsed_time(end) / 1e3 if self.device.type == "cuda" else end - start
            self.times_s[name].append(elapsed)
        self._pending.clear()
        return dict(self.times_s)

    def reset(self) -> None:
        """Forget warm-up measurements."""
        self.collect()
        self.times_s.clear()
        self.peak_bytes.clear()


@contextlib.contextmanager
def annotated_attention(ranges: PhaseRanges) -> Iterator[None]:
    """Swap `cs336_basics.model.scaled_dot_product_attention` for a version with ranges around
    its three parts (scores, softmax, final matmul), then restore the original.

    Only the reference (materialised-scores) attention has these parts; the maths is the same.
    """
    original = basics_model.scaled_dot_product_attention
    # Names only: nested timing or peak resets would corrupt the enclosing phase's numbers.
    inner = PhaseRanges(ranges.device, nvtx=ranges.nvtx, record=ranges.record, sync=ranges.sync)
    if not inner.active:
        yield
        return

    def sdpa_with_ranges(Q, K, V, mask=None):
        with inner.phase("attention/scores"):
            scores = torch.einsum("...qd,...kd->...qk", Q, K) / math.sqrt(K.shape[-1])
            if mask is not None:
                scores = torch.where(mask, scores, float("-inf"))
        with inner.phase("attention/softmax"):
            weights = basics_model.softmax(scores, dim=-1)
        with inner.phase("attention/matmul"):
            return torch.einsum("...qk,...kd->...qd", weights, V)

    basics_model.scaled_dot_product_attention = sdpa_with_ranges
    try:
        yield
    finally:
        basics_model.scaled_dot_product_attention = original
