"""The timing helper and kernel timing on CPU."""

import time

import pytest
import torch

from cs336_systems.profiling.timing import Timing, bench_kernel, kernel_time_ms, time_fn, warm_up
from tests._support import requires_cuda


def test_time_fn_counts_calls_and_measures_sleep():
    calls = []
    timing = time_fn(lambda: (calls.append(1), time.sleep(0.01)), warmup=3, steps=5, device="cpu")
    assert len(calls) == 8
    assert timing.n == 5 and timing.warmup == 3
    assert 0.009 < timing.median < 0.05
    assert timing.first_call_s is not None and timing.first_call_s >= 0.009
    stats = timing.stats()
    assert stats["min"] <= stats["median"] <= stats["max"]
    assert stats["median"] == pytest.approx(timing.median * 1e3)


def test_first_call_is_kept_out_of_samples():
    state = {"first": True}

    def slow_then_fast():
        if state["first"]:
            state["first"] = False
            time.sleep(0.05)

    timing = time_fn(slow_then_fast, warmup=1, steps=3, device="cpu")
    assert timing.first_call_s >= 0.05 and max(timing.samples_s) < 0.01


def test_after_warmup_runs_between_warmup_and_timed_calls():
    log = []
    time_fn(lambda: log.append("call"), warmup=2, steps=2, device="cpu", after_warmup=lambda: log.append("reset"))
    assert log == ["call", "call", "reset", "call", "call"]


def test_zero_warmup_has_no_first_call():
    assert time_fn(lambda: None, warmup=0, steps=2, device="cpu").first_call_s is None


@pytest.mark.parametrize("kwargs,match", [(dict(warmup=-1), "warmup"), (dict(steps=0), "steps")])
def test_time_fn_rejects_bad_counts(kwargs, match):
    with pytest.raises(ValueError, match=match):
        time_fn(lambda: None, device="cpu", **kwargs)


def test_timing_stats_spread():
    t = Timing(samples_s=[0.001, 0.002, 0.003], warmup=1)
    assert t.median == 0.002 and t.mean == pytest.approx(0.002)
    assert t.stats()["std"] == pytest.approx(1.0)


def test_bench_kernel_on_cpu_returns_samples():
    assert bench_kernel(lambda: sum(range(100)), device="cpu").n >= 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_kernel_time_needs_cuda():
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        kernel_time_ms(lambda: None)


@requires_cuda
def test_kernel_time_counts_gpu_work_and_leaves_out_host_waits():
    a = torch.randn(2048, 2048, device="cuda")
    matmul_ms = kernel_time_ms(lambda: a @ a)
    assert matmul_ms > 0

    def slow_host():  # the same kernel behind 5 ms of host time: the wall clock grows, the kernel time doesn't
        time.sleep(0.005)
        a @ a
    assert kernel_time_ms(slow_host) < 2 * matmul_ms + 0.5


def test_warmup_seconds_extend_the_warmup_past_its_count_but_not_the_first_call():
    """warmup_s keeps warming up until the calls after the first have run that long; the first call (compilation)
    does not count toward it, and the row's warm-up count says how many calls were made."""
    calls = []
    state = {"first": True}

    def step():
        calls.append(1)
        time.sleep(0.3 if state.pop("first", False) else 0.01)

    timing = time_fn(step, warmup=2, steps=3, device="cpu", warmup_s=0.1)
    assert timing.first_call_s >= 0.3
    # 0.1 s of 10 ms calls after the first (at most ten more, sleep never being shorter than asked), however long
    # the first took: more than the count asked for.
    assert 2 < timing.warmup <= 13 and len(calls) == timing.warmup + 3
    assert time_fn(lambda: None, warmup=2, steps=1, device="cpu", warmup_s=0.0).warmup == 2


def test_warmup_seconds_need_a_warmup_call_and_refuse_bad_values():
    assert time_fn(lambda: None, warmup=0, steps=1, device="cpu", warmup_s=1.0).warmup == 0
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="warmup_s"):
            time_fn(lambda: None, device="cpu", warmup_s=bad)


def test_warm_up_alone_counts_its_calls_and_refuses_bad_values():
    """`warm_up` (time_fn's warm-up, also used by scripts/step_host_profile.py): the calls asked, more by time."""
    calls = []
    made, first = warm_up(lambda: (calls.append(1), time.sleep(0.01)), calls=2, seconds=0.05)
    assert made == len(calls) > 2 and first >= 0.01
    assert warm_up(lambda: None, calls=0, seconds=1.0) == (0, None)
    for kwargs in (dict(calls=-1), dict(calls=1, seconds=-1.0)):
        with pytest.raises(ValueError, match="warm_up"):
            warm_up(lambda: None, **kwargs)
