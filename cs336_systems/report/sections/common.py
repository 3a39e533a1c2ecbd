"""What every report section uses: the loaded result frames (`Results`), the latest run of each
configuration, the environment line under a table, and the ours-vs-baseline tables of the model suite."""

from __future__ import annotations

import functools
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from cs336_systems.report.document import Document, Heading, Paragraph
from cs336_systems.results import load_rows, rows_to_frame

# Our environment switches and the values the toolkit ships with: rows measured with another value (an A/B of a
# switch, CS336_FLASH_HOST_DESCRIPTORS=0) measured something a user does not run, and stay out of the report.
SHIPPED_SWITCHES = {"CS336_AUTOTUNE": "1", "CS336_FLASH_GLUON": "1", "CS336_FLASH_HOST_DESCRIPTORS": "1",
                    "CS336_FLASH_LAUNCH_PLANS": "1", "CS336_FLASH_NATIVE": "1", "CS336_TRITON_OPS": "1",
                    "CS336_FP32_WEIGHT_GRADIENTS": "1"}


def shipped_rows(frame: pd.DataFrame) -> pd.DataFrame:
    """The rows measured with every switch at its shipped value (unset, or set to it)."""
    keep = pd.Series(True, index=frame.index)
    for name, value in SHIPPED_SWITCHES.items():
        column = f"switches.{name}"
        if column in frame.columns:
            keep &= frame[column].isna() | (frame[column].astype(str) == value)
    return frame[keep]


@dataclass
class Results:
    frames: dict[str, pd.DataFrame]
    results_dir: Path
    figures_dir: Path
    missing: list[tuple[str, str]] = field(default_factory=list)

    @classmethod
    def load(cls, results_dir: Path, figures_dir: Path) -> Results:
        frames = {p.stem: shipped_rows(rows_to_frame(load_rows(p))) for p in sorted(results_dir.glob("*.jsonl"))}
        figures_dir.mkdir(parents=True, exist_ok=True)
        return cls(frames, results_dir, figures_dir)

    def frame(self, suite: str) -> pd.DataFrame:
        return self.frames.get(suite, pd.DataFrame())

    def copy_figure(self, name: str) -> str | None:
        """Copy a committed PNG into the report's figures; its path relative to the report, or None."""
        source = self.results_dir / name
        if not source.exists():
            return None
        shutil.copy(source, self.figures_dir / name)
        return f"figures/{name}"

    def note_missing(self, doc: Document, section: str, what: str) -> None:
        self.missing.append((section, what))
        doc.add(Paragraph(f"Missing: {what}."))

    def open_section(self, doc: Document, heading: str, suite: str, section: str, what: str) -> pd.DataFrame | None:
        """Add the section's heading and return the suite's rows, or note them missing and return None."""
        doc.add(Heading(heading))
        frame = self.frame(suite)
        if frame.empty:
            self.note_missing(doc, section, what)
            return None
        return frame

# What a commit may change without making any row older: the report, the notes, the tests, the README and the rows.
UNMEASURED_PATHS = ("docs", "notes", "results", "tests", "README.md")


@functools.cache
def commits_behind(commit: str, repo: Path | None = None) -> int | None:
    """How many commits between `commit` and HEAD changed code, in the checkout holding `repo` (ours by default);
    None outside a git checkout or for a commit its history does not hold. A table's rows that old may no longer
    describe the code. Commits of the report itself, the notes, tests, the README or result rows do not count, so
    committing a rebuilt report leaves it byte-identical to a rebuild at the new HEAD."""
    if not commit or commit in ("nan", "None", "unknown"):
        return None
    try:
        done = subprocess.run(["git", "rev-list", "--count", f"{commit}..HEAD", "--", ":/",
                               *(f":(top,exclude){folder}" for folder in UNMEASURED_PATHS)],
                              cwd=repo or Path(__file__).parent, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return int(done.stdout) if done.returncode == 0 and done.stdout.strip().isdigit() else None


def environment(frame: pd.DataFrame) -> str:
    """'measured on X (torch a, triton b), commits c, d (n-m code commits before the build)' for a table's rows."""
    if frame.empty:
        return "no rows"
    parts = []
    for (device, torch_v, triton_v), rows in frame.groupby(["device_name", "torch", "triton"], dropna=False):
        shas = sorted({str(c)[:10] for c in rows["git_commit"]})
        ages = [a for a in map(commits_behind, shas) if a is not None]
        age = "" if not ages else (f"; {min(ages)} code commits before the build" if min(ages) == max(ages)
                                   else f"; {min(ages)}-{max(ages)} code commits before the build")
        parts.append(f"{device} (torch {torch_v}, triton {triton_v}; commit {', '.join(shas)}{age})")
    return "Measured on " + "; ".join(parts) + "."

def latest(frame: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """The newest row of each configuration (re-runs append; the last one counts)."""
    keys = [k for k in keys if k in frame.columns]
    return frame.sort_values("timestamp").drop_duplicates(keys, keep="last")

def col(frame: pd.DataFrame, name: str, default=None) -> pd.Series:
    return frame[name] if name in frame.columns else pd.Series(default, index=frame.index)

def span(values: pd.Series | None, fmt: str = "{:.2f}", missing: str = "-") -> str:
    """'a-b' over a column's values, 'a' when they all print alike, `missing` where there are none."""
    if values is None or values.dropna().empty:
        return missing
    low, high = fmt.format(values.min()), fmt.format(values.max())
    return low if low == high else f"{low}-{high}"


def rows_of(frame: pd.DataFrame, **config) -> pd.DataFrame:
    """The rows whose columns hold the given values (e.g. one configuration of one run)."""
    mask = pd.Series(True, index=frame.index)
    for key, value in config.items():
        mask &= frame[key] == value
    return frame[mask]


def shared_value(values: pd.Series) -> str:
    """The value a table's rows share, as text ("1", not "1.0"); where they differ, all of them ("1, 4")."""
    unique = sorted(set(values.dropna()))
    return ", ".join(f"{v:g}" if isinstance(v, float) else str(v) for v in unique) or "-"


def ms(value) -> str:
    return "-" if value is None or (isinstance(value, float) and np.isnan(value)) else f"{value:.1f}"

def eager_reference_rows(model: pd.DataFrame) -> pd.DataFrame:
    """Rows of the plain model suite: reference attention (or the baseline's SDPA), no checkpointing,
    no fused kernels, cs336 AdamW for ours, batch 4, context 512, whole-step timings; compiled in torch.compile's
    default mode, the step neither captured whole (`--step-graph`) nor timed without dynamo's guards."""
    if model.empty:
        return model
    m = model[(model["metric"] == "time") & (model["context"] == 512)]
    m = m[col(m, "checkpoint", "none").fillna("none") == "none"]
    m = m[~col(m, "step_graph", False).astype(object).eq(True) & ~col(m, "skip_guards", False).astype(object).eq(True)]
    m = m[col(m, "compile_mode", "default").fillna("default").isin(["default", "-"])]
    m = m[col(m, "fused", False).fillna(False) == False]  # noqa: E712
    m = m[col(m, "attention").isin(["reference", "sdpa"])]
    return m

def ours_vs_baseline(rows: pd.DataFrame, index: list[str], stat: str = "median") -> pd.DataFrame:
    """Ours beside the baseline per configuration: `stat` (median or mean) ± std ms, and ours / baseline."""
    rows = latest(rows, index + ["provider"])
    wide = rows.pivot_table(index=index, columns="provider", values=stat, aggfunc="last").reset_index()
    spread = rows.pivot_table(index=index, columns="provider", values="std", aggfunc="last").reset_index()
    for provider in ("ours", "baseline"):
        if provider in wide:
            wide[f"{provider} ms ({stat} ± std)"] = [
                f"{m:.1f} ± {s:.1f}" if not np.isnan(m) else "-" for m, s in zip(wide[provider], spread[provider])]
    if {"ours", "baseline"} <= set(wide.columns):
        wide["ours / baseline"] = (wide["ours"] / wide["baseline"]).round(2)
    return wide.drop(columns=[c for c in ("ours", "baseline") if c in wide.columns])
