"""Fine-tuned hyperparameter tables read back from MLflow.

For each algorithm: the setting (all hyperparameters but the seed) whose mean
final-round metric over seeds is best, and its final accuracy as
mean ± 95% confidence interval over seeds (Student's t, n − 1 degrees of freedom).
Selected on validation (``select_on="validation"``), the ranking uses the metric
on the clients' validation parts (``val_<metric>``) and the reported numbers are
the test metrics of the setting so chosen: no reported number picked its setting.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from fedsweep.evaluation import VAL
from fedsweep.tracking import CODE_TAG, LEAK_TAG, PARENT_TAG, PLATFORM_TAG, STOPPED_EARLY, TAG_PREFIX, client

#: Final-round metrics reported for the best setting, beside the one ranked by.
REPORTED = ("personalized_accuracy_mean", "global_accuracy", "personalized_accuracy_worst", "personalized_accuracy_best")
#: Added by ``load_runs(target_accuracy=...)``: first evaluation round, and model transmissions by then,
#: at which personalized_accuracy_mean reached the target (NaN where it never did).
TARGET_COLUMNS = ("rounds_to_target", "transmissions_to_target")
#: Decimals of a table's counts and times (4 for the others: losses; accuracies are in percent, 2).
DIGITS = {"rounds_to_target": 1, "transmissions_to_target": 1, "transmissions": 1, "wall_time_s": 2}


def ci95(values: np.ndarray) -> float:
    """Half-width of the 95% confidence interval of the mean; NaN for fewer than two values."""
    from scipy import special  # Student's t quantile: scipy.stats.t.ppf's own function (equal for 1-1,999 degrees of
    # freedom), without importing scipy.stats (0.64 s against 0.21 s, every sweep's table)

    n = len(values)
    if n < 2:
        return math.nan
    return float(special.stdtrit(n - 1, 0.975) * np.std(values, ddof=1) / math.sqrt(n))


def to_target(c, run_id: str, target: float, metric: str = "personalized_accuracy_mean") -> tuple[float, float]:
    """(round, transmissions) of the first evaluation where ``metric`` >= ``target``; NaNs if never."""
    reached = sorted(m.step for m in c.get_metric_history(run_id, metric) if m.value >= target)
    if not reached:
        return math.nan, math.nan
    sent = {m.step: m.value for m in c.get_metric_history(run_id, "transmissions")}
    return float(reached[0]), float(sent.get(reached[0], math.nan))


def over_evaluations(c, run_id: str, metric: str, last: int = 1, peak: bool = False) -> float:
    """``metric`` reduced over its logged evaluation rounds: the mean of the last ``last`` ones, or with
    ``peak`` the maximum over all of them (how pFedMe's published code scores a run: each run's best
    round, then the mean over runs)."""
    values = [m.value for m in sorted(c.get_metric_history(run_id, metric), key=lambda m: m.step)]
    if not values:
        return math.nan
    return float(max(values)) if peak else float(np.mean(values[-last:]))


def load_runs(
    uri: str,
    experiment: str,
    sweep_run_id: str | None = None,
    target_accuracy: float | None = None,
    last_evaluations: int = 1,
    peak: bool = False,
) -> tuple[pd.DataFrame, dict]:
    """Finished trial runs of ``experiment`` (of one sweep if ``sweep_run_id``), and the sweep's tags.
    With ``target_accuracy``, each run also gets the :data:`TARGET_COLUMNS` from its metric history.
    Every accuracy metric is the final round's, or with ``last_evaluations`` > 1 each run's mean over its
    last ``last_evaluations`` evaluation rounds (as papers that average the last rounds report), or with
    ``peak`` its maximum over all of them (as pFedMe's code reports); the two exclude each other."""
    if peak and last_evaluations > 1:
        raise ValueError("peak and last_evaluations > 1 exclude each other")
    c = client(uri)
    exp = c.get_experiment_by_name(experiment)
    if exp is None:
        raise LookupError(f"no MLflow experiment named {experiment!r} at {uri}")
    runs = []
    page = None
    while True:
        batch = c.search_runs([exp.experiment_id], max_results=1000, page_token=page)
        runs += list(batch)
        page = batch.token
        if not page:
            break
    sweeps = [r for r in runs if r.data.tags.get(f"{TAG_PREFIX}sweep") == "true"]
    if sweep_run_id is None and sweeps:
        sweep_tags = max(sweeps, key=lambda r: r.info.start_time).data.tags
    else:
        sweep_tags = next((r.data.tags for r in sweeps if r.info.run_id == sweep_run_id), {})
    rows = []
    for r in runs:
        tags = r.data.tags
        outcome = tags.get(f"{TAG_PREFIX}outcome")
        outcome = outcome if outcome in ("diverged", STOPPED_EARLY) else "finished"
        if f"{TAG_PREFIX}algorithm" not in tags or not (r.info.status == "FINISHED" or outcome == "diverged"):
            continue
        if sweep_run_id is not None and tags.get(PARENT_TAG) != sweep_run_id:
            continue
        rows.append(
            {
                "run_id": r.info.run_id,
                # a leaking evaluation is its own row, marked, never mixed with or ranked against the others
                "algorithm": tags[f"{TAG_PREFIX}algorithm"] + (f" [{tags[LEAK_TAG]}]" if LEAK_TAG in tags else ""),
                "setting": tags[f"{TAG_PREFIX}setting"],
                "setting_label": tags.get(f"{TAG_PREFIX}setting_label", ""),
                "seed": int(tags.get(f"{TAG_PREFIX}seed", 0)),
                "outcome": outcome,
                "platform": tags.get(PLATFORM_TAG, ""),  # where its numbers were computed, and by which code
                "code": tags.get(CODE_TAG, ""),
                # the order the sweep ran its trials in (a budget counts the first settings tried)
                "trial": (int(tags[f"{TAG_PREFIX}trial_index"]) if f"{TAG_PREFIX}trial_index" in tags else math.inf,
                          r.info.start_time),
                **{f"param:{k}": v for k, v in r.data.params.items()},
                **r.data.metrics,
            }
        )
        if target_accuracy is not None:
            rows[-1].update(zip(TARGET_COLUMNS, to_target(c, r.info.run_id, target_accuracy)))
        if last_evaluations > 1 or peak:
            for key in r.data.metrics:
                if "accuracy" in key:  # the ranked metric as well as the REPORTED ones
                    rows[-1][key] = over_evaluations(c, r.info.run_id, key, last_evaluations, peak)
    return pd.DataFrame(rows), sweep_tags


#: Columns of :func:`load_runs` that hold text (besides the ``param:`` ones); every other is a number.
TEXT_COLUMNS = ("run_id", "algorithm", "setting", "setting_label", "outcome", "platform", "code")


def save_runs(runs: pd.DataFrame, sweep_tags: dict, path: str) -> None:
    """The runs behind a table as a CSV file (one row a run: its parameters, its metrics as :func:`load_runs`
    reduced them), and the sweep's ``fedsweep.*`` tags beside it (``<path>.tags.json``): what
    :func:`read_runs` needs to rebuild the table without the MLflow store (``fedsweep table --from-runs``)."""
    import json

    out = runs.copy()
    at = list(out.columns).index("trial")
    index, start = zip(*out.pop("trial")) if len(out) else ((), ())
    out.insert(at, "trial_start", list(start))
    out.insert(at, "trial_index", list(index))
    out.to_csv(path, index=False)
    tags = {k: v for k, v in sweep_tags.items() if k.startswith(TAG_PREFIX)}
    with open(f"{path}.tags.json", "w") as f:
        json.dump(tags, f, indent=1, sort_keys=True)


def read_runs(path: str) -> tuple[pd.DataFrame, dict]:
    """What :func:`save_runs` wrote, as :func:`load_runs` returned it."""
    import json
    from pathlib import Path

    runs = pd.read_csv(path, dtype=str, keep_default_na=False)
    for column in runs.columns:
        if column not in TEXT_COLUMNS and not column.startswith("param:"):
            runs[column] = pd.to_numeric(runs[column].replace("", np.nan))
    runs["seed"] = runs["seed"].astype(int)
    at = list(runs.columns).index("trial_index")
    runs.insert(at, "trial", list(zip(runs.pop("trial_index"), runs.pop("trial_start").astype(int))))
    tags_file = Path(f"{path}.tags.json")
    return runs, json.loads(tags_file.read_text()) if tags_file.exists() else {}


def best_settings(runs: pd.DataFrame, metric: str, mode: str = "max", group_by: list[str] | tuple = (),
                  select_on: str = "test", budget: int | None = None, reported: tuple = REPORTED) -> pd.DataFrame:
    """One row per algorithm (and per value of each ``group_by`` parameter): its best setting by the mean
    of ``metric`` over seeds, with mean ± 95% CI; with ``select_on="validation"`` the best by the mean of
    ``val_<metric>``, reported with ``metric`` and the other test metrics beside (``table.attrs`` says how).

    Only settings all of whose seeds ran to the end are eligible: one that diverged or that a scheduler
    stopped early is counted, never chosen. With ``budget`` N, each row chooses among the first N settings
    its algorithm's search tried (in trial order), so that an algorithm with more hyperparameters does not
    win by having more tries; a tie goes to the setting tried first (as `fedsweep bench` chooses). ``reported``:
    the metrics given beside the ranked one."""
    if runs.empty:
        return pd.DataFrame()
    ranked = VAL + metric if select_on == "validation" else metric
    for needed in dict.fromkeys((ranked, metric)):
        if needed not in runs.columns:
            hint = " (select on validation needs runs with data.validation_fraction > 0)" if needed.startswith(VAL) else ""
            raise KeyError(f"metric {needed!r} was not logged by these runs{hint}; "
                           f"logged: {sorted(c for c in runs.columns if '_' in c and not c.startswith('param:'))}")
    missing = [p for p in group_by if f"param:{p}" not in runs.columns]
    if missing:
        raise KeyError(f"group-by parameter(s) {missing} not logged by these runs")
    rows, incomplete, unranked = [], {}, []
    keys = ["algorithm"] + [f"param:{p}" for p in group_by]
    # only the columns read below: a benchmark's runs have ~170 (a parameter or metric each), which every subset of
    # rows would copy (a merge of eleven cells took 4-5 s, most of it copying; 2-3 s since)
    used = dict.fromkeys([*keys, "setting", "seed", "trial", "outcome", "setting_label", ranked, metric, *reported, *TARGET_COLUMNS])
    runs = runs[[c for c in used if c in runs.columns]]
    # a (setting, seed) run by several sweeps of an experiment (read without --sweep-run) counts once, its latest run:
    # pooled, each would count as one more seed and narrow the CI
    runs = runs.fillna({k: "" for k in keys})
    # the order the settings were tried in, read before the de-duplication: a setting drawn again later was still
    # tried first at its first draw (as bench.choose reads a search's every run)
    tried_first = {key: draw_order(tried) for key, tried in runs.groupby(keys, sort=True)}
    order = runs["trial"].map(lambda t: t[1]).sort_values(kind="stable").index
    latest = ~runs.loc[order].duplicated(keys + ["setting", "seed"], keep="last")
    repeated = int((~latest).sum())
    runs = runs[latest.reindex(runs.index)]  # in their own order (a mean's summation order stays the same)
    for key, tried in runs.groupby(keys, sort=True):
        first = tried_first[key]
        if budget is not None:
            tried = tried[tried["setting"].isin(first[:budget])]
        # a setting any of whose seeds diverged or was stopped early is not eligible (listed below the table)
        group = tried[~tried["setting"].isin(tried.loc[tried["outcome"] != "finished", "setting"])]
        stopped = int((tried["outcome"] == STOPPED_EARLY).sum())
        # a setting without a run of every seed its group ran (one crashed, or is running) is not eligible either
        seeds = group.groupby("setting")["seed"].agg(frozenset)
        every = frozenset().union(*seeds)
        short = seeds[[s != every for s in seeds]].index
        if len(short):
            incomplete[key[0]] = incomplete.get(key[0], 0) + len(short)
            group = group[~group["setting"].isin(short)]
        by_setting = group.groupby("setting")[ranked].mean().dropna()  # a method may not log it (no global model)
        # in the order they were tried: a tie goes to the setting tried first, as in `fedsweep bench` (bench.choose)
        by_setting = by_setting.loc[[s for s in first if s in by_setting.index]]
        if by_setting.empty:
            if not group.empty:
                unranked.append(key[0])
            continue
        best = by_setting.idxmax() if mode == "max" else by_setting.idxmin()
        chosen = group[group["setting"] == best]
        split = ", ".join(f"{p}={v}" for p, v in zip(group_by, key[1:]))
        row = {
            "algorithm": key[0] + (f" ({split})" if split else ""),
            "best setting": chosen["setting_label"].iloc[0],
            "settings tried": int(tried["setting"].nunique()),
            "seeds": len(chosen),
            **({"stopped early": stopped} if (runs["outcome"] == STOPPED_EARLY).any() else {}),
        }
        for key in dict.fromkeys((ranked, metric, *reported)):
            if key in chosen.columns:
                values = chosen[key].to_numpy(dtype=float)
                row[f"{key} mean"] = float(values.mean())
                row[f"{key} ci95"] = ci95(values)
        if TARGET_COLUMNS[0] in chosen.columns:
            # over the seeds that reached the target; how many did is reported beside
            reached = chosen.dropna(subset=[TARGET_COLUMNS[0]])
            row["seeds reaching target"] = f"{len(reached)}/{len(chosen)}"
            for key in TARGET_COLUMNS:
                values = reached[key].to_numpy(dtype=float)
                row[f"{key} mean"] = float(values.mean()) if len(values) else math.nan
                row[f"{key} ci95"] = ci95(values)
        row["setting key"] = best  # fedsweep.setting of its runs: what the report and the analyst filter on
        rows.append(row)
    table = pd.DataFrame(rows)
    table.attrs.update(select_on=select_on, ranked_by=ranked, metric=metric, budget=budget, mode=mode,
                       incomplete=incomplete, unranked=sorted(set(unranked)), repeated=repeated)
    return table


def draw_order(runs: pd.DataFrame) -> pd.Index:
    """The settings of ``runs`` in the order they were tried: by their first trial (its index in the sweep, then
    its start)."""
    return runs.groupby("setting")["trial"].min().sort_values(kind="stable").index


def selection_line(table: pd.DataFrame) -> str:
    """What picked the settings of ``table``, for its header: said whenever it was not the reported metric
    over every setting tried."""
    lines = []
    if table.attrs.get("select_on") == "validation":
        lines.append(f"Settings selected on validation: ranked by {table.attrs['ranked_by']} (the clients' validation "
                     f"parts, held out of their training data); every other column is measured on the test data, which "
                     f"chose nothing.")
    if table.attrs.get("budget") is not None:
        lines.append(f"Budget: each row's best of the first {table.attrs['budget']} settings its search tried "
                     f"(trial order); 'settings tried' counts those.")
    if "stopped early" in table.columns:
        lines.append("'stopped early': trials a scheduler stopped before their last round; their settings are never chosen.")
    if incomplete := table.attrs.get("incomplete"):
        lines.append("Not chosen, a seed's run missing (crashed, or still running): " + ", ".join(
            f"{n} setting(s) of {a}" for a, n in sorted(incomplete.items())) + ".")
    if repeated := table.attrs.get("repeated"):
        lines.append(f"{repeated} run(s) repeated a (setting, seed) another run of these sweeps had: the latest of each "
                     "counted (--sweep-run reads one sweep).")
    if unranked := table.attrs.get("unranked"):
        lines.append(f"No value of {table.attrs['ranked_by']}, so no row: {', '.join(unranked)}.")
    return "\n".join(lines)


def _diverged(runs: pd.DataFrame) -> pd.DataFrame:
    return runs[runs["outcome"] == "diverged"] if "outcome" in runs.columns else runs.iloc[:0]


def diverged_settings(runs: pd.DataFrame) -> str:
    """Markdown list of the settings whose global model became non-finite, with how many seeds did;
    they are left out of the best-setting table, never hidden."""
    bad = _diverged(runs)
    if bad.empty:
        return ""
    lines = ["Diverged (non-finite global model; not eligible as best setting):", "",
             "| algorithm | setting | seeds diverged |", "|---|---|---|"]
    for (algorithm, setting), group in bad.groupby(["algorithm", "setting"], sort=True):
        total = int(((runs["algorithm"] == algorithm) & (runs["setting"] == setting)).sum())
        lines.append(f"| {md(algorithm)} | {md(group['setting_label'].iloc[0])} | {len(group)}/{total} |")
    return "\n".join(lines)


def md(text: object) -> str:
    """A markdown table cell: its text, a "|" escaped (a setting label may hold one)."""
    return str(text).replace("|", "\\|")


def _pm(mean: float, half: float, percent: bool, digits: int = 4, missing: str = "—") -> str:
    """mean ± half-width; ``missing`` where there is no value (a method without a global model has no global
    accuracy; a target column says "not reached")."""
    scale = 100.0 if percent else 1.0
    digits = 2 if percent else digits
    if math.isnan(mean):
        return missing
    if math.isnan(half):
        return f"{mean * scale:.{digits}f} ± n/a"
    return f"{mean * scale:.{digits}f} ± {half * scale:.{digits}f}"


def to_markdown(table: pd.DataFrame) -> str:
    """Markdown table; accuracies in percent, each metric as mean ± 95% CI."""
    if table.empty:
        return "(no finished runs)"
    header = selection_line(table)
    metrics = [c[: -len(" mean")] for c in table.columns if c.endswith(" mean")]
    target = "seeds reaching target" in table.columns
    stopped = "stopped early" in table.columns
    head = ["algorithm", "best setting", "settings tried", "seeds"] + (["stopped early"] if stopped else []) + [
        m + (" (%)" if m.removeprefix(VAL).startswith(("personalized_accuracy", "global_accuracy")) else "") for m in metrics
    ] + (["seeds reaching target"] if target else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for _, r in table.iterrows():
        cells = [md(r["algorithm"]), md(r["best setting"]), str(r["settings tried"]), str(r["seeds"])]
        cells += [str(r["stopped early"])] if stopped else []
        cells += [
            _pm(r[f"{m} mean"], r[f"{m} ci95"], m not in TARGET_COLUMNS and "accuracy" in m, DIGITS.get(m, 4),
                "not reached" if m in TARGET_COLUMNS else "—")
            for m in metrics
        ]
        cells += [str(r["seeds reaching target"])] if target else []
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(([header, ""] if header else []) + lines)


def merged_table(sources: list[tuple[str, pd.DataFrame]], metric: str) -> pd.DataFrame:
    """Methods × datasets: one row per algorithm of any of the ``sources`` (a label, e.g. the dataset, and its
    :func:`best_settings` table), one ``<label> mean`` and ``<label> ci95`` column pair per source, then each
    method's mean rank over the sources it ran in (1 = best there); rows by that rank."""
    columns: dict[str, pd.Series] = {}
    ranks = []
    for label, table in sources:
        if table.empty:
            continue
        by_method = table.set_index("algorithm")
        columns[f"{label} mean"] = by_method[f"{metric} mean"]
        columns[f"{label} ci95"] = by_method[f"{metric} ci95"]
        ranks.append(by_method[f"{metric} mean"].rank(ascending=table.attrs.get("mode", "max") != "max"))
    if not columns:
        return pd.DataFrame()
    merged = pd.DataFrame(columns)
    merged["mean rank"] = pd.concat(ranks, axis=1).mean(axis=1)
    merged = merged.sort_values("mean rank", kind="stable").rename_axis("algorithm").reset_index()
    merged.attrs.update(metric=metric, sources=[label for label, _ in sources])
    return merged


def merged_markdown(merged: pd.DataFrame) -> str:
    """The merged table in markdown: accuracies in percent, mean ± 95% CI; "—" where a method did not run."""
    if merged.empty:
        return "(no finished runs)"
    labels = [c[: -len(" mean")] for c in merged.columns if c.endswith(" mean")]
    percent = "accuracy" in merged.attrs.get("metric", "accuracy")
    head = ["algorithm", *map(md, labels), "mean rank"]
    title = (f"{merged.attrs.get('metric', '')}{' (%)' if percent else ''}: mean ± 95% CI over seeds, each dataset's own "
             "best setting per method")
    lines = [title, "", "| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for _, r in merged.iterrows():
        cells = [md(r["algorithm"]), *(_pm(r[f"{x} mean"], r[f"{x} ci95"], percent) for x in labels), f"{r['mean rank']:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    rows = merged[[f"{x} mean" for x in labels]].notna().sum(axis=1)
    if (rows < len(labels)).any():  # a mean over fewer cells is not the others' mean: said
        fewer = ", ".join(f"{md(a)} ({k} of {len(labels)})" for a, k in zip(merged["algorithm"], rows) if k < len(labels))
        lines += ["", f"A method's mean rank is over the cells it has a row in: {fewer}."]
    return "\n".join(lines)
