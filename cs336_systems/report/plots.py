"""Plots from result frames (rows_to_frame). Each returns the path it wrote."""

from __future__ import annotations

from pathlib import Path

import pandas as pd


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_attention_tflops(frame: pd.DataFrame, path: Path, pass_name: str = "fwd-bwd") -> Path:
    """TFLOP/s against sequence length, one line per provider, one panel per (head dim, dtype)."""
    plt = _pyplot()
    rows = frame[(frame["metric"] == "tflops") & (frame["status"] == "ok") & (frame["pass"] == pass_name)]
    panels = sorted({(d, t) for d, t in zip(rows["d"], rows["dtype"])})
    if not panels:
        raise ValueError(f"plot_attention_tflops: no ok TFLOP/s rows for pass {pass_name!r}")
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.8), squeeze=False)
    for ax, (d, dtype) in zip(axes[0], panels):
        sub = rows[(rows["d"] == d) & (rows["dtype"] == dtype)]
        for provider, line in sub.groupby("provider"):
            line = line.sort_values("seq")
            style = "--" if provider.startswith("sdpa") else "-"
            ax.plot(line["seq"], line["median"], style, marker="o", ms=3, label=provider)
        ax.set_xscale("log", base=2)
        ax.set_title(f"d={d}, {dtype}, {pass_name}")
        ax.set_xlabel("sequence length")
        ax.set_ylabel("TFLOP/s (causal FLOPs)")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
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
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
