"""The result store and table helpers."""

import json

import pytest

from cs336_systems.results import ResultStore, format_table, load_rows, pivot_table, rows_to_frame

REQUIRED = {"suite", "provider", "config", "metric", "unit", "median", "mean", "std", "min", "max", "n", "warmup",
            "status", "device", "device_name", "torch", "triton", "python", "git_commit", "timestamp", "run_id"}


def test_rows_are_appended_as_json_lines(tmp_path):
    store = ResultStore("demo", "cpu", tmp_path)
    store.add(provider="ours", config={"size": 1}, metric="time", unit="ms",
              stats=dict(median=2.0, mean=2.1, std=0.1, min=1.9, max=2.3, n=5, warmup=2))
    store.add(provider="ours", config={"size": 2}, metric="time", unit="ms", status="oom", message="CUDA OOM")
    again = ResultStore("demo", "cpu", tmp_path)  # a second run appends, never overwrites
    again.add(provider="baseline", config={"size": 1}, metric="time", unit="ms", value=3.0)
    rows = load_rows(tmp_path / "demo.jsonl")
    assert len(rows) == 3
    assert all(REQUIRED <= set(r) for r in rows)
    assert rows[1]["status"] == "oom" and rows[1]["median"] is None
    assert rows[2]["n"] == 1 and rows[2]["median"] == 3.0
    assert rows[0]["run_id"] != rows[2]["run_id"]
    json.dumps(rows)  # plain JSON throughout


def test_rows_carry_the_switches_set_for_the_run(tmp_path, monkeypatch):
    """Two runs that differ only in an environment switch (CS336_FLASH_HOST_DESCRIPTORS, ...) are told apart by
    their rows; the commit override (`git_commit`'s, read once a process) is not a switch."""
    monkeypatch.setenv("CS336_FLASH_HOST_DESCRIPTORS", "1")
    monkeypatch.setenv("CS336_GIT_COMMIT", "abc123")
    store = ResultStore("demo", "cpu", tmp_path)
    store.add(provider="ours", config={"size": 1}, metric="time", unit="ms", value=2.0)
    row, = load_rows(tmp_path / "demo.jsonl")
    assert row["switches"]["CS336_FLASH_HOST_DESCRIPTORS"] == "1" and "CS336_GIT_COMMIT" not in row["switches"]
    assert list(rows_to_frame([row])["size"]) == [1]


def test_frame_and_pivot_show_failed_cells(tmp_path):
    store = ResultStore("demo", "cpu", tmp_path)
    store.add(provider="ours", config={"size": 1}, metric="time", unit="ms", value=2.0)
    store.add(provider="ours", config={"size": 1}, metric="mfu", unit="%", value=40.0)
    store.add(provider="ours", config={"size": 2}, metric="time", unit="ms", status="oom")
    frame = rows_to_frame(store.rows)
    assert "size" in frame.columns
    table = pivot_table(frame, index=["size", "provider"])
    assert list(table["time ms"]) == ["2", "oom"] and table["mfu %"].iloc[0] == "40"  # headed with units
    md = format_table(table)
    assert md.splitlines()[0].replace(" ", "").startswith("|size|provider|") and "oom" in md
    assert "\\begin{tabular}" in format_table(table, "latex")


def test_a_row_after_an_interrupted_write_starts_its_own_line(tmp_path):
    store = ResultStore("demo", "cpu", tmp_path)
    store.add(provider="ours", config={"size": 1}, metric="time", unit="ms", value=1.0)
    text = store.path.read_text()
    store.path.write_text(text + text[: len(text) // 2])  # a second row cut off mid-write, no newline
    store.add(provider="ours", config={"size": 2}, metric="time", unit="ms", value=2.0)
    lines = store.path.read_text().splitlines()
    assert len(lines) == 3 and json.loads(lines[2])["config"] == {"size": 2}  # intact, not glued on
    with pytest.raises(ValueError, match=r"demo.jsonl:2: not a JSON row .*fix or delete that line"):
        load_rows(store.path)
