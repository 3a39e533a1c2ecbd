"""The result store: one tidy JSON-Lines row per measurement, and tables built from rows.

A row holds what was measured (suite, provider, config, metric, unit), its distribution
(median, mean, std, min, max, n, warmup), how it ended (status: ok, oom, unsupported,
error, with a message), and where (device name, torch/triton/python versions, git
commit, timestamp, run id). Files live under a results folder, one per suite.
"""

from __future__ import annotations

import datetime as dt
import functools
import json
import os
import platform
import subprocess
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import torch

DEFAULT_RESULTS_DIR = Path("runs")  # git-ignored; committed measurements live in results/


@functools.cache
def git_commit() -> str:
    """The checkout's commit (+ "-dirty"); CS336_GIT_COMMIT overrides it where the tree travels without .git
    (the lent GPU machine)."""
    if os.environ.get("CS336_GIT_COMMIT"):
        return os.environ["CS336_GIT_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parent, timeout=10)
        commit = out.stdout.strip() or "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=Path(__file__).resolve().parent, timeout=10).stdout.strip()
        return commit + ("-dirty" if dirty and commit != "unknown" else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def environment(device: torch.device | str) -> dict:
    """Where a measurement was taken."""
    device = torch.device(device)
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    if device.type == "cuda":
        device_name = torch.cuda.get_device_name(device)
    else:
        device_name = platform.processor() or platform.machine() or "cpu"
    # Our switches set for the run (CS336_FLASH_GLUON=0, ...): two runs that differ only there tell apart.
    switches = {name: value for name, value in sorted(os.environ.items())
                if name.startswith("CS336_") and name != "CS336_GIT_COMMIT"}
    return dict(device=device.type, device_name=device_name, torch=torch.__version__, triton=triton_version,
                python=platform.python_version(), git_commit=git_commit(), switches=switches)


@dataclass
class ResultStore:
    """Appends rows to `<results_dir>/<suite>.jsonl`; keeps this run's rows in memory for tables."""

    suite: str
    device: torch.device | str
    results_dir: Path = DEFAULT_RESULTS_DIR
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    rows: list[dict] = field(default_factory=list)

    def __post_init__(self):
        self.results_dir = Path(self.results_dir)
        self._env = environment(self.device)

    @property
    def path(self) -> Path:
        return self.results_dir / f"{self.suite}.jsonl"

    def add(self, *, provider: str, config: dict, metric: str, unit: str, stats: dict | None = None,
            value: float | None = None, status: str = "ok", message: str | None = None) -> dict:
        """Append one row. Give `stats` (from Timing.stats) for a distribution or `value` for one number."""
        if stats is None and value is not None:
            stats = dict(median=value, mean=value, std=0.0, min=value, max=value, n=1, warmup=0)
        stats = stats or dict(median=None, mean=None, std=None, min=None, max=None, n=0, warmup=0)
        row = dict(suite=self.suite, provider=provider, config=config, metric=metric, unit=unit, **stats,
                   status=status, message=message, **self._env,
                   timestamp=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), run_id=self.run_id)
        self.results_dir.mkdir(parents=True, exist_ok=True)
        # A file cut off mid-row would glue this row onto the broken one: start a line of its own.
        lead = "" if _ends_with_newline(self.path) else "\n"
        with open(self.path, "a") as f:
            f.write(lead + json.dumps(row, default=str) + "\n")
        self.rows.append(row)
        return row

    def frame(self) -> pd.DataFrame:
        return rows_to_frame(self.rows)


def load_rows(path: str | Path) -> list[dict]:
    """Every row of a JSON-Lines file; a row that is not JSON is an error naming the file and line."""
    rows = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number}: not a JSON row ({error.msg} at column {error.colno}); "
                                 "fix or delete that line") from None
    return rows


def _ends_with_newline(path: Path) -> bool:
    """False for a non-empty file whose last byte is not a newline (an interrupted write leaves one)."""
    try:
        with open(path, "rb") as f:
            f.seek(-1, 2)
            return f.read(1) == b"\n"
    except OSError:  # missing or empty
        return True


def rows_to_frame(rows: list[dict]) -> pd.DataFrame:
    """Flatten rows: config keys become columns next to the row fields."""
    if not rows:
        return pd.DataFrame()
    frame = pd.json_normalize(rows, sep=".")
    clashing = [c for c in frame.columns if c.startswith("config.") and c.removeprefix("config.") in frame.columns]
    return frame.drop(columns=clashing).rename(columns=lambda c: c.removeprefix("config."))


def metric_labels(frame: pd.DataFrame) -> dict[str, str]:
    """Each metric's column heading with its unit ("time" -> "time ms"), from the rows' `unit`."""
    if "unit" not in frame.columns:
        return {}
    units = frame.dropna(subset=["unit"]).groupby("metric", sort=False)["unit"].first()
    return {metric: f"{metric} {unit}" for metric, unit in units.items() if unit}


def pivot_table(frame: pd.DataFrame, index: list[str], columns: str = "metric", value: str = "median"
                ) -> pd.DataFrame:
    """Wide table: one row per configuration, one column per metric (headed with its unit); failed cells show
    their status."""
    if frame.empty:
        return frame
    frame = frame.copy()
    frame["cell"] = [f"{v:.3g}" if s == "ok" and v is not None else s
                     for v, s in zip(frame[value], frame["status"])]
    index = [c for c in index if c in frame.columns]
    table = frame.pivot_table(index=index, columns=columns, values="cell", aggfunc="last", sort=False)
    if columns == "metric":
        table = table.rename(columns=metric_labels(frame))
    return table.reset_index()


def format_table(table: pd.DataFrame, fmt: str = "markdown") -> str:
    if table.empty:
        return "(no rows)"
    if fmt == "latex":
        return table.to_latex(index=False)
    return table.to_markdown(index=False)
