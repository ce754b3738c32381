"""The figures of a benchmark: each cell's methods ranked with their CI bars, accuracy against transmissions, and the
methods × datasets heatmap of several cells (PNG bytes, for the folder and the benchmark's MLflow run)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from fedsweep.report import _png
from fedsweep.tracking import pyplot


def ranking_figure(table: pd.DataFrame, metric: str, title: str) -> bytes:
    """The methods ranked by their test metric: each a point with its 95% CI whisker, on an axis fitted to the
    points (bars would have to start at 0 and hide differences of a point or two)."""
    plt = pyplot()
    rows = table.iloc[::-1]
    fig, ax = plt.subplots(figsize=(7, 1.2 + 0.28 * len(rows)))
    ax.errorbar(100 * rows[f"{metric} mean"], rows["algorithm"], xerr=100 * rows[f"{metric} ci95"].fillna(0), fmt="o",
                color="#4c72b0", capsize=2)
    ax.grid(axis="x", alpha=0.3)
    ax.set_xlabel(f"{metric} (%), test, mean ± 95% CI")
    ax.set_title(title)
    fig.tight_layout()
    return _png(fig)


def transmissions_figure(runs: pd.DataFrame, metric: str, title: str) -> bytes:
    """Each method's final test metric against the floats it moved (means over the final seeds)."""
    plt = pyplot()
    means = runs.groupby("algorithm")[[metric, "transmissions"]].mean()
    fig, ax = plt.subplots(figsize=(7, 5))
    ax.scatter(means["transmissions"], 100 * means[metric])
    for name, row in means.iterrows():
        ax.annotate(str(name), (row["transmissions"], 100 * row[metric]), fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel("model transmissions (floats sent up and down, whole run)")
    ax.set_ylabel(f"{metric} (%), test")
    ax.set_title(title)
    fig.tight_layout()
    return _png(fig)


def heatmap_figure(merged: pd.DataFrame, metric: str, mode: str = "max") -> bytes:
    """Methods × datasets: each cell coloured by the method's rank within its dataset (1 = best by ``mode``) and
    labelled with its test metric's mean (%). Accuracies differ by dataset far more than by method, so a colour
    scale of the values would show the datasets and hide the methods."""
    plt = pyplot()
    means = merged.set_index("algorithm")[[c for c in merged.columns if c.endswith(" mean")]].astype(float)
    ranks = means.rank(ascending=(mode == "min"), method="min")
    fig, ax = plt.subplots(figsize=(2.5 + 1.4 * means.shape[1], 1.2 + 0.3 * len(means)))
    image = ax.imshow(ranks.to_numpy(), aspect="auto", cmap="viridis_r")
    for (i, j), value in np.ndenumerate(means.to_numpy()):
        if np.isfinite(value):
            ax.text(j, i, f"{100 * value:.1f}", ha="center", va="center", fontsize=7, color="white" if ranks.iat[i, j] > len(means) / 2 else "black")
    ax.set_xticks(range(means.shape[1]), [c.removesuffix(" mean") for c in means.columns], rotation=30, ha="right")
    ax.set_yticks(range(len(means)), list(means.index))
    fig.colorbar(image, ax=ax, label=f"rank within the dataset (1 = best); cells: test {metric} (%)")
    fig.tight_layout()
    return _png(fig)
