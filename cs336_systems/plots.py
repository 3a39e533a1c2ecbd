"""Plots from result frames (rows_to_frame). Each returns the path it wrote."""

from __future__ import annotations

import zlib
from pathlib import Path

import pandas as pd

# One colour per implementation, the same in every figure: matplotlib's 20-colour "tab20", its 10 strong shades for
# the first ten here, so no two of the attention suite's providers share one. Others take a fixed colour from their
# name.
IMPLEMENTATIONS = ("triton", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "naive", "naive-compiled", "pytorch-flash",
                   "triton-native", "triton-python", "triton-two-pass-bwd", "triton-tl-bwd", "triton-fused-bwd",
                   "triton-compile-bwd", "triton-tf32x3", "ours", "baseline", "torch", "liger")
# The training step's phases, the same colour in every memory timeline.
PHASE_COLOURS = {"forward": "tab:green", "loss": "tab:red", "backward": "tab:orange", "optimizer": "tab:purple"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _saved(plt, fig, path: Path, dpi: int = 120, rect: tuple | None = None) -> Path:
    """Lay the figure out (within `rect` of it, where a figure legend takes the rest), write it to `path` (its
    folder made) and close it."""
    fig.tight_layout(**({"rect": rect} if rect else {}))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def provider_colour(name: str) -> tuple:
    """The colour of implementation `name` in every figure."""
    import matplotlib

    palette = matplotlib.colormaps["tab20"].colors  # pairs: a strong and a light shade of each of 10 hues
    index = (IMPLEMENTATIONS.index(name) if name in IMPLEMENTATIONS else zlib.crc32(name.encode())) % len(palette)
    return palette[2 * index % len(palette) + index * 2 // len(palette)]  # the 10 strong shades first


def plot_attention_tflops(frame: pd.DataFrame, path: Path, pass_name: str = "fwd-bwd") -> Path:
    """TFLOP/s against sequence length, one line per provider (same colour in every panel), one panel per
    head dim (columns) and dtype (rows)."""
    plt = _pyplot()
    rows = frame[(frame["metric"] == "tflops") & (frame["status"] == "ok") & (frame["pass"] == pass_name)]
    dims, dtypes = sorted(set(rows["d"])), sorted(set(rows["dtype"]))
    if not dims:
        raise ValueError(f"plot_attention_tflops: no ok TFLOP/s rows for pass {pass_name!r}")
    providers = sorted(set(rows["provider"]))
    colours = {p: provider_colour(p) for p in providers}
    fig, axes = plt.subplots(len(dtypes), len(dims), figsize=(4.2 * len(dims), 3.4 * len(dtypes) + 0.6),
                             squeeze=False)
    for i, dtype in enumerate(dtypes):
        for j, d in enumerate(dims):
            ax = axes[i][j]
            sub = rows[(rows["d"] == d) & (rows["dtype"] == dtype)]
            if sub.empty:
                ax.set_axis_off()
                ax.text(0.5, 0.5, f"d={d}, {dtype}: not measured", ha="center", va="center", transform=ax.transAxes)
                continue
            for provider, line in sub.groupby("provider"):
                line = line.sort_values("seq")
                ax.plot(line["seq"], line["median"], "--" if provider.startswith("sdpa") else "-", marker="o",
                        ms=3, color=colours[provider], label=provider)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")  # short sequences run at a thousandth of long ones' rate: on a linear axis they vanish
            ax.set_title(f"d={d}, {dtype}, {pass_name}", fontsize=9)
            ax.set_xlabel("sequence length")
            ax.set_ylabel("TFLOP/s (causal FLOPs)")
            ax.grid(alpha=0.3)
    handles = [plt.Line2D([], [], color=colours[p], ls="--" if p.startswith("sdpa") else "-", marker="o", ms=3)
               for p in providers]
    # About three legend entries fit under a panel: more rows of entries where the panels are few.
    ncol = min(len(providers), 3 * len(dims))
    legend_rows = -(-len(providers) // ncol)
    fig.legend(handles, providers, loc="lower center", ncol=ncol, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, (0.035 if len(dtypes) > 1 else 0.06) * (legend_rows + 1), 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")  # the legend is never cut at the figure's edge
    plt.close(fig)
    return path


def plot_collectives(frame: pd.DataFrame, path: Path) -> Path:
    """Time and bus bandwidth against size, one line per (op, world size, backend)."""
    plt = _pyplot()
    ok = frame[frame["status"] == "ok"]
    fig, (ax_time, ax_bw) = plt.subplots(1, 2, figsize=(10, 3.8))
    for (op, n, backend), rows in ok.groupby(["op", "world_size", "backend"]):
        label = f"{op}, {n} ranks ({backend})"
        times = rows[rows["metric"] == "time"].sort_values("size_mb")
        bus = rows[rows["metric"] == "busbw"].sort_values("size_mb")
        ax_time.plot(times["size_mb"], times["median"], marker="o", ms=3, label=label)
        ax_bw.plot(bus["size_mb"], bus["median"], marker="o", ms=3, label=label)
    for ax, ylabel in ((ax_time, "median time (ms)"), (ax_bw, "bus bandwidth (GB/s)")):
        ax.set_xscale("log")
        ax.set_xlabel("tensor size (MB)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    ax_time.set_yscale("log")
    ax_bw.legend(fontsize=6)
    return _saved(plt, fig, path)


def plot_ratio_by_size(wide: pd.DataFrame, path: Path) -> Path:
    """ours / baseline time (column "ours / baseline") against the preset, one line per "execution" mode, one panel
    per context. A mode keeps its colour and marker in every panel (eager, compiled and CUDA graphs their own; a
    variant of one, "compiled, inductor pointwise", its mode's marker dashed), and one legend lists every line."""
    plt = _pyplot()
    contexts = sorted(set(wide["context"]))
    fig, axes = plt.subplots(1, len(contexts), figsize=(3.8 * len(contexts), 3.6), squeeze=False, sharey=True)
    markers = {"eager": "o", "compiled": "s", "CUDA graphs": "^"}
    executions = sorted(set(wide["execution"]), key=lambda e: (e.split(",")[0] not in markers, e))
    colours = {execution: f"C{i}" for i, execution in enumerate(executions)}
    handles = {}
    for ax, context in zip(axes[0], contexts):
        panel = wide[wide["context"] == context]
        for execution, line in panel.groupby("execution", observed=True):
            line = line.sort_values("preset")
            mode = execution.split(",")[0]
            (handle,) = ax.plot(line["preset"].astype(str), line["ours / baseline"], marker=markers.get(mode, "o"),
                                ls="-" if execution == mode else "--", color=colours[execution], ms=4,
                                label=execution)
            handles.setdefault(execution, handle)
        ax.axhline(1.0, color="grey", ls="--", lw=1)
        ax.set_title(f"context {int(context)}", fontsize=9)
        ax.set_xlabel("model size")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("ours / baseline (train step time)")
    ordered = [e for e in executions if e in handles]
    fig.legend([handles[e] for e in ordered], ordered, fontsize=8, loc="lower center", ncol=min(len(ordered), 4),
               frameon=False)
    return _saved(plt, fig, path, dpi=110, rect=(0, 0.1, 1, 1))


def plot_memory_timeline(points: pd.DataFrame, path: Path, title: str) -> Path:
    """Active memory (GiB) against time (ms), each phase's span shaded: `points` holds ms, gib and phase columns
    (`profiling.memory_timeline.timeline_points`, or the rows the model suite stored from them)."""
    plt = _pyplot()
    points = points.sort_values("ms")
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.step(points["ms"], points["gib"], where="post", color="tab:blue", lw=1)
    # A phase's span: from its first point to the point after its last (consecutive points of one phase).
    runs = (points["phase"] != points["phase"].shift()).cumsum()
    ends = points["ms"].shift(-1).fillna(points["ms"].iloc[-1])
    shown = set()
    for _, run in points.assign(end=ends).groupby(runs):
        phase = run["phase"].iloc[0]
        if phase:
            ax.axvspan(run["ms"].iloc[0], run["end"].iloc[-1], alpha=0.15, color=PHASE_COLOURS.get(phase, "grey"),
                       label=None if phase in shown else phase)
            shown.add(phase)
    if shown:
        ax.legend(loc="upper right")
    ax.set_xlabel("time (ms)")
    ax.set_ylabel("active memory (GiB)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    return _saved(plt, fig, path)
