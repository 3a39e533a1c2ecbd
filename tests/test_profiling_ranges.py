"""Phase ranges, the annotated attention swap, and the memory-timeline replay (CPU-testable parts)."""

import time

import pandas as pd
import torch

import cs336_basics.model as basics_model
from cs336_systems.plots import plot_memory_timeline
from cs336_systems.profiling.memory_timeline import active_memory_series, largest_allocations, timeline_points
from cs336_systems.profiling.ranges import PhaseRanges, annotated_attention


def test_phase_ranges_time_each_phase_on_cpu():
    ranges = PhaseRanges("cpu", time=True)
    for _ in range(3):
        with ranges.phase("a"):
            time.sleep(0.005)
        with ranges.phase("b"):
            pass
    times = ranges.collect()
    assert len(times["a"]) == 3 and min(times["a"]) >= 0.004
    assert max(times["b"]) < 0.004
    ranges.reset()
    assert ranges.collect() == {}


def test_inactive_ranges_record_nothing():
    ranges = PhaseRanges("cpu")
    assert not ranges.active
    with ranges.phase("x"):
        pass
    assert ranges.collect() == {}


def test_annotated_attention_is_same_maths_and_restores_original():
    original = basics_model.scaled_dot_product_attention
    q, k, v = torch.randn(2, 5, 8), torch.randn(2, 6, 8), torch.randn(2, 6, 4)
    mask = torch.rand(5, 6) > 0.2
    mask[:, 0] = True
    with annotated_attention(PhaseRanges("cpu", record=True)):
        assert basics_model.scaled_dot_product_attention is not original
        out = basics_model.scaled_dot_product_attention(q, k, v, mask)
    assert basics_model.scaled_dot_product_attention is original
    torch.testing.assert_close(out, original(q, k, v, mask))


def _snapshot():
    # 100 bytes alive before recording, then +50, +30, -50 (free_completed) at t = 0, 1000, 2000 us.
    events = [dict(action="alloc", size=50, time_us=0), dict(action="free_requested", size=50, time_us=500),
              dict(action="alloc", size=30, time_us=1000), dict(action="free_completed", size=50, time_us=2000)]
    segments = [dict(device=0, blocks=[dict(size=100, state="active_allocated"), dict(size=30,
                                                                                      state="active_allocated"),
                                       dict(size=64, state="inactive")])]
    return dict(device_traces=[events], segments=segments)


def test_active_memory_series_replays_the_trace():
    times, levels = active_memory_series(_snapshot())
    assert times == [0.0, 1000.0, 2000.0]
    assert levels == [150, 180, 130]


def test_timeline_points_keep_every_peak_and_tag_phases():
    points = timeline_points(_snapshot(), phases=[("forward", 0.0, 1500.0)])
    assert points == [{"ms": 0.0, "gib": 150 / 2**30, "phase": "forward"},
                      {"ms": 1.0, "gib": 180 / 2**30, "phase": "forward"},
                      {"ms": 2.0, "gib": 130 / 2**30, "phase": ""}]
    # Cut to two points: the first run's highest level (180 at 1 ms) survives, not its first.
    assert [p["gib"] * 2**30 for p in timeline_points(_snapshot(), max_points=2)] == [180, 130]
    assert timeline_points(dict(device_traces=[])) == []


def test_plot_memory_timeline_writes_png(tmp_path):
    points = pd.DataFrame(timeline_points(_snapshot(), phases=[("forward", 0.0, 1500.0)]))
    png = plot_memory_timeline(points, tmp_path / "m.png", title="t")
    assert png.exists() and png.read_bytes()[:4] == b"\x89PNG"


def test_largest_allocations_name_the_model_code_that_made_them():
    torch_frame = dict(filename="/site-packages/torch/nn/functional.py", line=10, name="softmax")
    def frames(line, name):
        return [torch_frame, dict(filename="/repo/cs336_basics/model.py", line=line, name=name)]
    events = [dict(action="alloc", size=4 * 2**20, frames=frames(80, "scaled_dot_product_attention")),
              dict(action="alloc", size=4 * 2**20, frames=frames(80, "scaled_dot_product_attention")),
              dict(action="alloc", size=4 * 2**20, frames=frames(90, "forward")),
              dict(action="free_completed", size=8 * 2**20, frames=[]),
              dict(action="alloc", size=2**20, frames=[torch_frame]),
              dict(action="alloc", size=512, frames=frames(5, "small"))]
    largest = largest_allocations(dict(device_traces=[events]), top=2)
    assert largest == [dict(bytes=4 * 2**20, count=3, origin="model.py:80 (scaled_dot_product_attention)"),
                       dict(bytes=2**20, count=1, origin="(torch internals)")]
    assert largest_allocations(dict(device_traces=[]), top=3) == []
