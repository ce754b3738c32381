"""A sweep's report for the analyst, logged to its parent MLflow run (``report/``) when the sweep ends, and
rebuilt for any experiment by ``fedsweep report``.

- ``report/table.md|csv|parquet``: the fine-tuned table ``fedsweep table`` prints (best setting per
  algorithm by the sweep's metric, mean ± 95% CI over seeds);
- ``report/comparison.png``: each algorithm's best setting, mean personalized accuracy over rounds with
  its 95% CI band over seeds, the global model dashed;
- ``report/sensitivity_<algorithm>.png``: the ranked metric against each hyperparameter the sweep varied
  for that algorithm (a line per value of a second one, a heatmap for exactly two);
- ``report/clients.png``: for each best setting, the final personalized accuracy of every client (all
  seeds pooled), with worst, 10th percentile, median and best marked: personalization is about the tail;
- metrics ``best/<algorithm>/<metric>`` on the parent run, so the experiment's run table sorts sweeps.

Every number is read back from the trial runs; nothing is recomputed from configs.
"""

from __future__ import annotations

import io
import json
import math
import os
import re
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from fedsweep.table import best_settings, ci95, load_runs, to_markdown
from fedsweep.tracking import SYMBOLS, client, in_vocabulary, pyplot

#: The per-round curves of the comparison figure: (metric, line style, what the style means).
CURVES = (("personalized_accuracy_mean", "-", "solid: personalized (mean over clients)"),
          ("global_accuracy", "--", "dashed: global model"))
@dataclass
class Report:
    table: pd.DataFrame
    markdown: str
    figures: dict[str, bytes] = field(default_factory=dict)  # artifact name -> PNG
    summary: dict[str, float] = field(default_factory=dict)  # parent-run metric -> value


def _label(param: str) -> str:
    """``algorithm.local_lr`` -> ``β (local_lr)``: the shared symbol where there is one."""
    name = param.removeprefix("param:").removeprefix("algorithm.")
    return f"{SYMBOLS[name]} ({name})" if name in SYMBOLS else name


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, metadata={"Software": None})
    pyplot().close(fig)
    return buf.getvalue()


def _best_runs(runs: pd.DataFrame, table: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """Each table row's runs: its best setting's, every seed."""
    return {row["algorithm"]: runs[runs["setting"] == row["setting key"]] for _, row in table.iterrows()}


def comparison_figure(c, best: dict[str, pd.DataFrame], metric_title: str, target: float | None = None) -> bytes:
    """Mean over seeds ± 95% CI, per evaluation round, of each best setting: one colour per algorithm,
    solid its personalized accuracy, dashed its global model's."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.2 + 0.22 * len(best)))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (algorithm, chosen) in enumerate(best.items()):
        color = colors[i % len(colors)]
        for metric, style, _ in CURVES:
            histories = [{m.step: m.value for m in c.get_metric_history(run_id, metric)} for run_id in chosen["run_id"]]
            rounds = sorted(set.intersection(*(set(h) for h in histories))) if histories else []
            if not rounds:
                continue
            values = np.array([[h[r] for r in rounds] for h in histories])
            mean = values.mean(axis=0)
            label = f"{algorithm} ({in_vocabulary(chosen['setting_label'].iloc[0])})" if style == "-" else None
            ax.plot(rounds, mean, style, color=color, label=label, linewidth=1.6 if style == "-" else 1.0)
            if style == "-" and len(histories) > 1:
                half = np.array([ci95(values[:, j]) for j in range(len(rounds))])
                ax.fill_between(rounds, np.clip(mean - half, 0, 1), np.clip(mean + half, 0, 1), color=color, alpha=0.15, linewidth=0)
    for (_, style, suffix) in CURVES:  # what solid and dashed mean, once
        ax.plot([], [], style, color="black", linewidth=1.0, label=suffix)
    if target is not None:
        ax.axhline(target, color="gray", linestyle=":", linewidth=1, label=f"target accuracy {target:g}")
    ax.set_xlabel("round")
    ax.set_ylabel("test accuracy (fraction)")
    ax.set_ylim(0, 1)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_title(f"Best setting per algorithm, chosen by final {metric_title}\nmean over seeds; band: 95% CI over seeds",
                 fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=1, frameon=False)
    fig.tight_layout()
    return _png(fig)


def _varied(group: pd.DataFrame) -> list[str]:
    """The parameters this algorithm's runs took more than one value of (the seed left out)."""
    params = [k for k in group.columns if k.startswith("param:") and k != "param:seed" and not k.startswith("param:tracking")]
    return [k for k in params if group[k].nunique(dropna=True) > 1]


def _numeric(values: pd.Series) -> pd.Series:
    out = pd.to_numeric(values, errors="coerce")
    return out if out.notna().all() else values


def sensitivity_figure(algorithm: str, group: pd.DataFrame, metric: str) -> bytes | None:
    """The metric (mean over seeds) against each varied hyperparameter of one algorithm; None when the
    sweep varied none."""
    varied = _varied(group)
    if not varied:
        return None
    plt = pyplot()
    means = group.groupby(varied, dropna=False)[metric].mean().reset_index()
    if len(varied) == 2:
        x, y = varied
        grid = means.pivot(index=y, columns=x, values=metric)
        fig, ax = plt.subplots(figsize=(6, 4.5))
        image = ax.imshow(grid.to_numpy(dtype=float), cmap="viridis", aspect="auto", origin="lower")
        ax.set_xticks(range(len(grid.columns)), [str(v) for v in grid.columns])
        ax.set_yticks(range(len(grid.index)), [str(v) for v in grid.index])
        for (i, j), value in np.ndenumerate(grid.to_numpy(dtype=float)):
            if not math.isnan(value):
                ax.text(j, i, f"{value:.3f}", ha="center", va="center", fontsize=7, color="white")
        ax.set_xlabel(_label(x))
        ax.set_ylabel(_label(y))
        fig.colorbar(image, ax=ax, label=f"{metric} (mean over seeds)")
    else:
        fig, axes = plt.subplots(1, len(varied), figsize=(max(6, 4.5 * len(varied)), 4.2), squeeze=False)
        for ax, param in zip(axes[0], varied):
            others = [v for v in varied if v != param]
            lines = means.groupby(others, dropna=False) if others else [((), means)]
            for key, part in lines:
                part = part.assign(_x=_numeric(part[param])).sort_values("_x")
                label = ", ".join(f"{_label(o)}={v}" for o, v in zip(others, key if isinstance(key, tuple) else (key,)))
                ax.plot(part["_x"], part[metric], marker="o", label=label or None)
            tried = _numeric(means[param])
            if pd.api.types.is_numeric_dtype(tried) and (tried > 0).all():
                ax.set_xscale("log")  # step sizes and coefficients are tried on log grids; label the values tried
                ax.set_xticks(sorted(set(tried)), [f"{v:g}" for v in sorted(set(tried))])
                ax.minorticks_off()
            ax.set_xlabel(_label(param))
            ax.set_ylabel(f"{metric} (mean over seeds)")
            ax.grid(alpha=0.3)
            if others:
                ax.legend(fontsize=7)
    fig.suptitle(f"{algorithm}: sensitivity of the final {metric}", fontsize=10)
    fig.tight_layout()
    return _png(fig)


#: MLflow draws a progress bar per downloaded file unless this says false.
_PROGRESS_BAR = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"


def client_accuracies(c, run_ids: list[str]) -> np.ndarray:
    """Final-round personalized accuracy of every client of these runs (their ``clients/final_round.json``;
    a run logged without it, tracking.log_client_table: false, adds none)."""
    values: list[float] = []
    before = os.environ.get(_PROGRESS_BAR)
    os.environ[_PROGRESS_BAR] = "false"  # a bar per file at the end of a sweep is noise
    try:
        for run_id in run_ids:
            if "clients/final_round.json" not in {a.path for a in c.list_artifacts(run_id, "clients")}:
                continue
            with open(c.download_artifacts(run_id, "clients/final_round.json")) as f:
                table = json.load(f)
            column = table["columns"].index("personalized_accuracy")
            values += [float(row[column]) for row in table["data"]]
    finally:
        if before is None:
            del os.environ[_PROGRESS_BAR]
        else:
            os.environ[_PROGRESS_BAR] = before
    return np.array(values)


def clients_figure(c, best: dict[str, pd.DataFrame]) -> bytes | None:
    """The distribution over clients (seeds pooled) of each best setting's final personalized accuracy."""
    data = {algorithm: client_accuracies(c, list(chosen["run_id"])) for algorithm, chosen in best.items()}
    data = {k: v for k, v in data.items() if len(v)}
    if not data:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(max(5, 1.3 * len(data) + 2), 4.5))
    positions = range(1, len(data) + 1)
    ax.violinplot(list(data.values()), positions=positions, showextrema=False)
    for x, values in zip(positions, data.values()):
        marks = {"worst": values.min(), "p10": np.percentile(values, 10), "median": np.median(values), "best": values.max()}
        for (name, value), marker in zip(marks.items(), ("v", "<", "o", "^")):
            ax.plot([x], [value], marker, color="black", markersize=5, label=name if x == 1 else None)
    ax.set_xticks(list(positions), list(data), rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("final personalized test accuracy (fraction)")
    ax.set_title("Clients of each best setting (all seeds pooled)")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    return _png(fig)


def build_report(
    uri: str, experiment: str, sweep_run_id: str | None = None, metric: str | None = None, mode: str | None = None,
    group_by: list[str] | tuple = (), target_accuracy: float | None = None, select_on: str | None = None,
    figures: bool = True,
) -> Report:
    """The sweep's table of best settings and, with ``figures``, its figures (a sweep's ``tracking.log_plot``)."""
    runs, sweep_tags = load_runs(uri, experiment, sweep_run_id, target_accuracy)
    metric = metric or sweep_tags.get("fedsweep.metric", "personalized_accuracy_mean")
    mode = mode or sweep_tags.get("fedsweep.mode", "max")
    table = best_settings(runs, metric, mode, group_by, select_on or sweep_tags.get("fedsweep.select_on", "test"))
    report = Report(table, to_markdown(table))
    if table.empty:
        return report
    if figures:
        c = client(uri)
        finished = runs[runs["outcome"] == "finished"]
        best = _best_runs(finished, table)
        report.figures["comparison.png"] = comparison_figure(c, best, metric, target_accuracy)
        for algorithm, group in finished.groupby("algorithm", sort=True):
            if (png := sensitivity_figure(algorithm, group, table.attrs["ranked_by"])) is not None:
                report.figures[f"sensitivity_{algorithm.split(' ')[0]}.png"] = png
        if (png := clients_figure(c, best)) is not None:
            report.figures["clients.png"] = png
    for _, row in table.iterrows():
        name = re.sub(r"[^A-Za-z0-9_.-]+", "_", row["algorithm"]).strip("_")  # what MLflow allows in a metric name
        report.summary[f"best/{name}/{metric}"] = float(row[f"{metric} mean"])
    return report


def newest_sweep_run(uri: str, experiment: str, sweep_run_id: str | None = None) -> tuple[str, dict[str, str]]:
    """The id and tags of sweep ``sweep_run_id`` of ``experiment``, else of its newest sweep; LookupError if none."""
    from fedsweep.tracking import TAG_PREFIX

    c = client(uri)
    exp = c.get_experiment_by_name(experiment)
    if exp is None:
        raise LookupError(f"no MLflow experiment named {experiment!r} at {uri}")
    sweeps = [r for r in c.search_runs([exp.experiment_id], f"tags.`{TAG_PREFIX}sweep` = 'true'", order_by=["attributes.start_time DESC"])
              if sweep_run_id in (None, r.info.run_id)]
    if not sweeps:
        raise LookupError(f"no sweep run{f' {sweep_run_id}' if sweep_run_id else ''} in experiment {experiment!r}")
    return sweeps[0].info.run_id, sweeps[0].data.tags


def log_report(uri: str, parent_run_id: str, report: Report) -> None:
    """The report's files under ``report/`` of the parent run, and its summary metrics on it."""
    c = client(uri)
    c.log_text(parent_run_id, report.markdown + "\n", "report/table.md")
    c.log_text(parent_run_id, report.table.to_csv(index=False), "report/table.csv")
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        report.table.to_parquet(Path(tmp) / "table.parquet", index=False)
        for name, png in report.figures.items():
            (Path(tmp) / name).write_bytes(png)
        c.log_artifacts(parent_run_id, tmp, "report")
    for key, value in report.summary.items():
        c.log_metric(parent_run_id, key, value)
