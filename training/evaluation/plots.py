"""PNG plots of evaluation and analysis results (matplotlib, headless Agg backend).

Every function writes one PNG atomically (temporary file, then rename) and returns its path.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

from icr.core.atomic import atomic_write

if TYPE_CHECKING:  # annotations only: matplotlib is imported inside _figure (plots only)
    from matplotlib.figure import Figure

# Lines drawn per direction in the score-distribution plot: enough to see the spread, few enough
# to stay readable (the percentile curves summarise all sampled queries).
MAX_QUERY_LINES = 300


def _figure(ncols: int = 1, width: float = 6.0, height: float = 4.5) -> tuple[ModuleType, Figure, np.ndarray]:
    """``(pyplot, figure, axes)``: a headless figure with one row of ``ncols`` axes (an object array)."""
    import matplotlib  # noqa: PLC0415 (matplotlib: plots only)

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt  # noqa: PLC0415 (matplotlib: plots only)

    fig, axes = plt.subplots(1, ncols, figsize=(width * ncols, height), squeeze=False)
    return plt, fig, axes[0]


def _save(plt: ModuleType, fig: Figure, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=110))
    plt.close(fig)
    return path


def plot_pr_curves(curves: Mapping[str, Mapping[str, Sequence[float]]], path: str | Path, title: str) -> Path:
    """Global precision-recall curves: ``{label: {"recall": [...], "precision": [...]}}``, one line each."""
    plt, fig, (ax,) = _figure()
    for label, c in curves.items():
        ax.plot(c["recall"], c["precision"], label=label, linewidth=1.5)
    ax.set(
        xlabel="recall (all caption-image pairs)",
        ylabel="precision",
        xlim=(0, 1),
        ylim=(0, 1.02),
        title=title,
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(plt, fig, path)


def plot_score_distribution(distribution: Mapping[str, Any], path: str | Path, title: str) -> Path:
    """Per-query "neighbours with score >= x" curves (Cross-Example Softmax paper, Fig. 4 right)."""
    plt, fig, axes = _figure(ncols=len(distribution))
    for ax, (direction, section) in zip(axes, distribution.items(), strict=True):
        grid = np.asarray(section["grid"])
        curves = np.asarray(section["curves"])  # (Q, G)
        for row in curves[:MAX_QUERY_LINES]:
            ax.plot(grid, np.maximum(row, 0.8), color="tab:blue", alpha=0.08, linewidth=0.7)
        for name in ("p5", "p95"):
            ax.plot(
                grid, np.maximum(section["percentile_curves"][name], 0.8), color="tab:orange", linewidth=2
            )
        query = "image" if direction == "i2t" else "caption"
        ax.set(
            yscale="log",
            xlabel="similarity score",
            ylabel="candidates scoring >= x",
            title=f"{title}: {direction} ({section['queries']} {query} queries)",
        )
        ax.grid(alpha=0.3)
    return _save(plt, fig, path)


def plot_reliability(bins: Sequence[Mapping[str, Any]], path: str | Path, title: str) -> Path:
    """Reliability diagram: fraction relevant against mean predicted relevance per bin."""
    plt, fig, (ax,) = _figure(width=5.0)
    used = [b for b in bins if b["pairs"]]
    ax.plot([0, 1], [0, 1], color="grey", linestyle="--", linewidth=1)
    ax.plot([b["mean_predicted"] for b in used], [b["fraction_relevant"] for b in used], marker="o")
    ax.set(
        xlabel="calibrated relevance", ylabel="fraction truly relevant", xlim=(0, 1), ylim=(0, 1), title=title
    )
    ax.grid(alpha=0.3)
    return _save(plt, fig, path)


def plot_reliability_by_kind(figures: Mapping[str, Any], path: str | Path, title: str) -> Path:
    """Threshold honesty at a glance: reliability per query kind (left) and the precision each
    ``min_relevance`` target delivers per kind (right; the dashed lines are the promises)."""
    plt, fig, (left, right) = _figure(ncols=2, width=5.5)
    groups = [("pooled", figures["pooled"]), *sorted(figures.get("by_kind", {}).items())]
    left.plot([0, 1], [0, 1], color="grey", linestyle="--", linewidth=1)
    for name, group in groups:
        used = [b for b in group["reliability"] if b["pairs"]]
        left.plot(
            [b["mean_predicted"] for b in used],
            [b["fraction_relevant"] for b in used],
            marker="o",
            markersize=3,
            linewidth=2.5 if name == "pooled" else 1.2,
            label=f"{name} ({group['queries']})",
        )
    left.set(
        xlabel="predicted relevance", ylabel="fraction truly relevant", xlim=(0, 1), ylim=(0, 1), title=title
    )
    left.grid(alpha=0.3)
    left.legend(fontsize=7)
    targets = list(figures["pooled"]["thresholds"])
    x = np.arange(len(groups))
    width = 0.8 / max(len(targets), 1)
    for k, target in enumerate(targets):
        values = [g["thresholds"][target]["precision"] for _, g in groups]
        bars = right.bar(
            x + k * width,
            [v if v is not None else 0.0 for v in values],
            width,
            label=f"min_relevance {target}",
        )
        right.axhline(float(target), color=bars.patches[0].get_facecolor(), linestyle="--", linewidth=1)
    right.set_xticks(
        x + width * (len(targets) - 1) / 2, [n for n, _ in groups], rotation=30, ha="right", fontsize=8
    )
    right.set(
        ylabel="delivered precision (no bar: nothing passed)",
        ylim=(0, 1),
        title="precision of the hits passing each threshold",
    )
    right.legend(fontsize=7)
    return _save(plt, fig, path)


def plot_grouped_bars(
    values: Mapping[str, Mapping[str, tuple[float, float]]], path: str | Path, title: str, ylabel: str
) -> Path:
    """Grouped bars with error bars: ``{group: {series: (mean, std)}}`` (e.g. COCOS per objective)."""
    plt, fig, (ax,) = _figure(width=max(6.0, 1.2 * len(values)))
    groups = list(values)
    series = sorted({s for g in values.values() for s in g})
    width = 0.8 / max(len(series), 1)
    for k, name in enumerate(series):
        means = [values[g].get(name, (np.nan, 0.0))[0] for g in groups]
        stds = [values[g].get(name, (np.nan, 0.0))[1] for g in groups]
        ax.bar(np.arange(len(groups)) + k * width, means, width, yerr=stds, label=name, capsize=2)
    ax.set_xticks(np.arange(len(groups)) + 0.4 - width / 2, groups, rotation=20, ha="right", fontsize=8)
    ax.set(ylabel=ylabel, title=title)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    return _save(plt, fig, path)
