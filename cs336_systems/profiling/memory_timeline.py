"""CUDA memory history over a region: a snapshot for pytorch.org/memory_viz and our own PNG.

`record_memory_history()` wraps `torch.cuda.memory._record_memory_history`; on exit it
dumps the snapshot pickle. `plot_active_memory` replays the allocator trace (alloc /
free_completed) into active bytes over time and draws it with the phases shaded;
`largest_allocations` names the biggest allocations and the model code that made them.
"""

from __future__ import annotations

import contextlib
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


def plot_active_memory(snapshot: dict, png_path: str | Path, *, title: str,
                       phases: list[tuple[str, float, float]] = ()) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    times, levels = active_memory_series(snapshot)
    fig, ax = plt.subplots(figsize=(10, 4))
    if times:
        t0 = times[0]
        has_clock = "time_us" in snapshot["device_traces"][0][0]
        xs = [(t - t0) / 1e3 for t in times] if has_clock else times
        ax.step(xs, [b / 2**30 for b in levels], where="post", color="tab:blue", lw=1)
        colours = {"forward": "tab:green", "backward": "tab:orange", "optimizer": "tab:purple", "loss": "tab:red"}
        if has_clock:
            for name, start, end in phases:
                ax.axvspan((start - t0) / 1e3, (end - t0) / 1e3, alpha=0.15, color=colours.get(name, "grey"),
                           label=name)
            handles, labels = ax.get_legend_handles_labels()
            unique = dict(zip(labels, handles))
            if unique:
                ax.legend(unique.values(), unique.keys(), loc="upper right")
        ax.set_xlabel("time (ms)" if has_clock else "allocator event")
    ax.set_ylabel("active memory (GiB)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    Path(png_path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
    return Path(png_path)
