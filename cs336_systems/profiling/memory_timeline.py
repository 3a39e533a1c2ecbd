"""CUDA memory history over a region: a snapshot for pytorch.org/memory_viz and our own timeline.

`record_memory_history()` wraps `torch.cuda.memory._record_memory_history`; on exit it
dumps the snapshot pickle. `timeline_points` replays the allocator trace (alloc /
free_completed) into active bytes over time, a few hundred points tagged with their phase
(the rows `plots.plot_memory_timeline` draws); `largest_allocations` names the biggest
allocations and the model code that made them.
"""

from __future__ import annotations

import contextlib
import math
import pickle
import time
from collections.abc import Iterator
from pathlib import Path

import torch


class PhaseClock:
    """Wall-clock (microseconds since the epoch, the allocator trace's clock) of phase boundaries."""

    def __init__(self):
        self.marks: list[tuple[str, float, float]] = []

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        torch.cuda.synchronize()
        start = time.time() * 1e6
        yield
        torch.cuda.synchronize()
        self.marks.append((name, start, time.time() * 1e6))


@contextlib.contextmanager
def record_memory_history(snapshot_path: str | Path, max_entries: int = 1_000_000) -> Iterator[dict]:
    """Record allocator history inside the block; the snapshot dict is put in the yielded dict's 'snapshot'."""
    out: dict = {}
    torch.cuda.memory._record_memory_history(max_entries=max_entries)
    try:
        yield out
    finally:
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        Path(snapshot_path).parent.mkdir(parents=True, exist_ok=True)
        with open(snapshot_path, "wb") as f:
            pickle.dump(snapshot, f)
        out["snapshot"] = snapshot


def active_memory_series(snapshot: dict, device: int = 0) -> tuple[list[float], list[int]]:
    """(time_us, active bytes) after each alloc/free in the trace of `device`."""
    traces = snapshot.get("device_traces", [])
    if device >= len(traces):
        return [], []
    # Blocks alive when recording started count as a base level.
    base = sum(block["size"] for segment in snapshot.get("segments", []) if segment.get("device", 0) == device
               for block in segment.get("blocks", []) if block.get("state") == "active_allocated")
    events = traces[device]
    delta = sum(e["size"] if e["action"] == "alloc" else -e["size"] if e["action"] == "free_completed" else 0
                for e in events)
    level = base - delta  # the level before the first recorded event
    times, levels = [], []
    for i, e in enumerate(events):
        if e["action"] == "alloc":
            level += e["size"]
        elif e["action"] == "free_completed":
            level -= e["size"]
        else:
            continue
        times.append(float(e.get("time_us", i)))
        levels.append(level)
    return times, levels


def _origin(frames: list[dict]) -> str:
    """The innermost frame of the model's own code (not torch's) that made an allocation: 'file:line (function)'."""
    for frame in frames:
        name = frame.get("filename", "")
        if ("cs336" in name or "baseline_lm" in name) and "/torch/" not in name:
            return f"{Path(name).name}:{frame.get('line', 0)} ({frame.get('name', '?')})"
    return "(torch internals)"


def largest_allocations(snapshot: dict, top: int = 5, device: int = 0) -> list[dict]:
    """memory_profiling (e): the `top` largest allocation sizes in the trace, each with how many times it was
    allocated and where (the model code's innermost frame of the most frequent call site)."""
    traces = snapshot.get("device_traces", [])
    events = [e for e in traces[device] if e.get("action") == "alloc"] if device < len(traces) else []
    by_size: dict[int, dict[str, int]] = {}
    for event in events:
        origins = by_size.setdefault(event["size"], {})
        origin = _origin(event.get("frames", []))
        origins[origin] = origins.get(origin, 0) + 1
    largest = sorted(by_size.items(), reverse=True)[:top]
    return [{"bytes": size, "count": sum(origins.values()), "origin": max(origins, key=origins.get)}
            for size, origins in largest]


def timeline_points(snapshot: dict, phases: list[tuple[str, float, float]] = (), max_points: int = 200,
                    device: int = 0) -> list[dict]:
    """The active-memory timeline as at most `max_points` points {ms, gib, phase}: the trace cut into equal runs
    of events, each run's highest level (so every peak survives), at its time from the first event (or its event
    index where the trace has no clock), in the phase whose span holds it ('' outside every phase)."""
    times, levels = active_memory_series(snapshot, device)
    if not times:
        return []
    has_clock = "time_us" in snapshot["device_traces"][device][0]
    per_point = max(1, math.ceil(len(levels) / max_points))
    points = []
    for start in range(0, len(levels), per_point):
        top = max(range(start, min(start + per_point, len(levels))), key=levels.__getitem__)
        when = times[top]
        phase = next((name for name, begin, end in phases if begin <= when <= end), "") if has_clock else ""
        points.append({"ms": (when - times[0]) / 1e3 if has_clock else float(top), "gib": levels[top] / 2**30,
                       "phase": phase})
    return points
