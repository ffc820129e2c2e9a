"""Matplotlib figures (Agg backend, files only): sweep curves and paper-vs-simulator bar charts."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)

SWEEP_LABELS = {
    "servers": "#servers C",
    "eta": "fraction of fast servers eta",
    "rate": "request rate (req/s)",
    "l-out": "output length l_out",
}


def _finish(fig, ax, title: str, path: Path) -> None:
    """Title, legend, layout, and save as PNG (creating the folder)."""
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_sweep(rows: Sequence[dict], kind: str, title: str, path: Path) -> None:
    """Per-token time vs the swept parameter, one line per policy (Sun et al., Fig. 6-9 layout)."""
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for policy in dict.fromkeys(row["policy"] for row in rows):
        points = [(row["x"], row["per_token_time_mean"]) for row in rows if row["policy"] == policy]
        ax.plot(*zip(*points, strict=True), marker="o", label=policy)
    ax.set_xlabel(SWEEP_LABELS.get(kind, kind))
    ax.set_ylabel("avg per-token time (s)")
    _finish(fig, ax, title, path)


def plot_comparison(
    labels: Sequence[str], series: dict[str, Sequence[float]], ylabel: str, title: str, path: Path
) -> None:
    """Grouped bars: one group per table cell, one bar per series (paper experiment, paper sim, ours)."""
    fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(labels)), 4))
    width = 0.8 / max(len(series), 1)
    for k, (name, values) in enumerate(series.items()):
        ax.bar([i + k * width for i in range(len(labels))], values, width, label=name)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(labels))])
    ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel(ylabel)
    _finish(fig, ax, title, path)
