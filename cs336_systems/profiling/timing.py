"""The one timing helper every suite uses.

`time_fn` synchronises the device, times the first call on its own (it carries compile
and autotune time), runs the rest of the warm-up, then times `steps` calls. On CUDA the
samples come from CUDA events around each call (the host clock, `timeit.default_timer`
after a synchronise, is kept too); on CPU from the host clock.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from timeit import default_timer

import torch


def synchronize(device: torch.device | str | None) -> None:
    """Wait for queued work on `device` (a no-op on CPU)."""
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Timing:
    """Samples in seconds of the timed calls, plus the first (cold) call timed apart."""

    samples_s: list[float]
    warmup: int
    first_call_s: float | None = None
    host_samples_s: list[float] = field(default_factory=list)

    @property
    def n(self) -> int:
        return len(self.samples_s)

    @property
    def median(self) -> float:
        return statistics.median(self.samples_s)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.samples_s)

    @property
    def std(self) -> float:
        return statistics.stdev(self.samples_s) if self.n > 1 else 0.0

    def pooled(self, later: Timing) -> Timing:
        """This timing with `later`'s samples added (its warm-up and first call kept): rounds of one measurement."""
        return replace(self, samples_s=self.samples_s + later.samples_s,
                                   host_samples_s=self.host_samples_s + later.host_samples_s)

    def stats(self, scale: float = 1e3) -> dict[str, float]:
        """median/mean/std/min/max (scaled, default to ms), n and warm-up count: the result-row fields."""
        return dict(median=self.median * scale, mean=self.mean * scale, std=self.std * scale,
                    min=min(self.samples_s) * scale, max=max(self.samples_s) * scale, n=self.n, warmup=self.warmup)


def default_warmup_seconds(device: torch.device | str) -> float:
    """Warm-up by time after a compile: 1 s on CUDA (a GPU idle through a compile is not back at speed after a few
    short steps), none on the CPU."""
    return 1.0 if torch.device(device).type == "cuda" else 0.0


def warm_up(fn: Callable[[], object], *, calls: int, device: torch.device | str | None = None,
            seconds: float = 0.0) -> tuple[int, float | None]:
    """Call `fn()` `calls` times, then on until the calls after the first have run `seconds` (the first carries
    compilation, and a GPU left idle through a compile needs more than a few millisecond-long steps to be back at
    speed). Returns the number of calls made and the first call's time in seconds (None without calls); the device
    is synchronised at the end."""
    if calls < 0:
        raise ValueError(f"warm_up: calls must be >= 0, got {calls}")
    if not seconds >= 0:  # (also refuses NaN)
        raise ValueError(f"warm_up: seconds must be >= 0, got {seconds}")
    synchronize(device)
    first_call_s = None
    for i in range(calls):
        start = default_timer()
        fn()
        if i == 0:
            synchronize(device)
            first_call_s = default_timer() - start
            after_first = default_timer()
    if calls and seconds > 0:
        synchronize(device)
        while default_timer() - after_first < seconds:
            fn()
            synchronize(device)
            calls += 1
    synchronize(device)
    return calls, first_call_s


def time_fn(fn: Callable[[], object], *, warmup: int = 5, steps: int = 10,
            device: torch.device | str | None = None, after_warmup: Callable[[], object] | None = None,
            warmup_s: float = 0.0) -> Timing:
    """Time `fn()` `steps` times after `warmup` untimed calls (the first of which is timed apart).

    `warmup_s`: after those calls, keep warming up until the calls after the first have run this many seconds
    (`warm_up`); `Timing.warmup` counts every warm-up call made.
    `after_warmup` runs once between warm-up and the timed calls (e.g. to drop warm-up phase times).
    """
    if warmup < 0:
        raise ValueError(f"time_fn: warmup must be >= 0, got {warmup}")
    if steps < 1:
        raise ValueError(f"time_fn: steps must be >= 1, got {steps}")
    if not warmup_s >= 0:  # (also refuses NaN)
        raise ValueError(f"time_fn: warmup_s must be >= 0 seconds, got {warmup_s}")
    device = torch.device(device) if device is not None else torch.device("cpu")
    on_cuda = device.type == "cuda"
    warmup, first_call_s = warm_up(fn, calls=warmup, device=device, seconds=warmup_s)
    if after_warmup is not None:
        after_warmup()
    samples, host = [], []
    for _ in range(steps):
        if on_cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
        start = default_timer()
        fn()
        if on_cuda:
            end.record()
        synchronize(device)
        host.append(default_timer() - start)
        samples.append(begin.elapsed_time(end) / 1e3 if on_cuda else host[-1])
    return Timing(samples_s=samples, warmup=warmup, first_call_s=first_call_s, host_samples_s=host)


def bench_kernel(fn: Callable[[], object], *, device: torch.device | str, warmup_ms: float = 25,
                 rep_ms: float = 100, grad_to_none=None) -> Timing:
    """Kernel-level timing: `triton.testing.do_bench` on CUDA (cache flushed between calls,
    all samples kept), `time_fn` on CPU."""
    device = torch.device(device)
    if device.type != "cuda":
        def call():
            if grad_to_none:
                for t in grad_to_none:
                    t.grad = None
            fn()
        return time_fn(call, warmup=2, steps=5, device=device)
    import triton.testing

    samples_ms = triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, grad_to_none=grad_to_none,
                                         return_mode="all")
    return Timing(samples_s=[t / 1e3 for t in samples_ms], warmup=-1)


def kernel_time_ms(fn: Callable[[], object], *, calls: int = 20, warmup: int = 3, grad_to_none=None) -> float:
    """The GPU's kernel time per call (ms): the summed durations of the kernels `calls` calls launch, from
    torch.profiler, divided by `calls`. Unlike `bench_kernel` it leaves out the time the GPU waits for the
    host, so beside it it says how host-bound a short call is. CUDA only."""
    from torch.profiler import ProfilerActivity, profile

    if not torch.cuda.is_available():
        raise RuntimeError("kernel_time_ms: needs a CUDA device")

    def call():
        for t in grad_to_none or ():
            t.grad = None
        fn()

    for _ in range(warmup):
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    return sum(event.self_device_time_total for event in prof.key_averages()) / calls / 1e3
