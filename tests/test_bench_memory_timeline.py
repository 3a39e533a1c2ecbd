"""The model suite's `--memory` step on its CUDA-free parts: the timeline becomes rows (and a PNG) tagged with the
phases that ran, the largest allocations and per-phase peaks become rows. The CUDA memory recorder is replaced by
one that returns a made-up allocator trace stamped with the phases' own clock."""

from __future__ import annotations

import contextlib
import json
import time
from types import SimpleNamespace

import torch

import cs336_systems.profiling.memory_timeline as memory_timeline
from cs336_systems.bench.suites import model as model_suite
from cs336_systems.results import ResultStore


def test_memory_step_stores_the_timeline_as_phase_tagged_rows(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args, **kwargs: None)
    events = []

    def step_fn(mode, phase):
        def step():
            for name in ("forward", "backward"):
                with phase(name):
                    events.append(dict(action="alloc", size=2**30, time_us=time.time() * 1e6, frames=[]))
                    time.sleep(0.002)
            events.append(dict(action="free_completed", size=2**30, time_us=time.time() * 1e6, frames=[]))
        return step

    @contextlib.contextmanager
    def fake_recorder(path):
        recorded = {}
        try:
            yield recorded
        finally:
            # One of the two GiB is still allocated when recording stops.
            recorded["snapshot"] = dict(device_traces=[events],
                                        segments=[dict(device=0, blocks=[dict(size=2**30, state="active_allocated")])])

    monkeypatch.setattr(memory_timeline, "record_memory_history", fake_recorder)
    case = SimpleNamespace(preset="tiny", context=16, dtype="fp32", provider="ours", compile=False)
    harness = SimpleNamespace(case=case, step_fn=step_fn)
    args = SimpleNamespace(device=torch.device("cpu"), results_dir=str(tmp_path), steps=1)
    store = ResultStore("model", "cpu", tmp_path)
    model_suite._memory(harness, "train-step", {"preset": "tiny"}, args, store)

    rows = [json.loads(line) for line in (tmp_path / "memory-timeline.jsonl").read_text().splitlines()]
    assert [r["median"] for r in rows] == [1.0, 2.0, 1.0]  # GiB after each allocator event
    assert [r["config"]["phase"] for r in rows] == ["forward", "backward", ""]
    assert all(r["config"]["mode"] == "train-step" and r["metric"] == "active_memory" for r in rows)
    assert (tmp_path / "tiny_ctx16_fp32_ours_train-step_memory.png").exists()
    assert {r["metric"] for r in store.rows} == {"largest_allocation"}  # (per-phase peaks: CUDA only)
