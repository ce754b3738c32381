"""The numbers a cell's section in docs/benchmark.md quotes, computed from the folder `fedsweep bench` wrote (and its
MLP cell's folder, for a CNN cell): what a publication writes and a reader can check, where cell_diff.py says what
moved between two runs of one cell.

    python benchmarks/cell_facts.py FOLDER [--mlp MLP_FOLDER] [--pfllib COLUMN]

Printed, at the largest budget (the table's) in points of the ranking metric: the top rows with their seeds; the
rows whose 95% CI overlaps the first's, and those that lie entirely below all of the top five; Local's rank, and the
CIs that end below its lower end; the rows equal in every metric column (FedBN and FedAvg on a model without a
normalization layer); against the MLP cell (rows in both, how many are lower, the median difference, Spearman's ρ of
the two orders, the largest gains and losses); the wide rows (CI above 5 points) with their seeds and their
smaller budget's row; the methods without a row (a final seed diverged); the unseen clients' lowest and highest;
the smaller budget against the largest (ρ, the same choices); the final runs' seconds and the transmissions; the
tuning trials that did not finish; each method's best two settings on validation. With ``--pfllib COLUMN`` (a column
of PFLlib's leaderboard as docs/results/benchmark/peers.md copies it, "Path FMNIST" or "Prac FMNIST"), the methods
both have, side by side: each row, Spearman's ρ of the two orders over the personalized ones and over all, the spans
of the personalized ones and how far ours lie below PFLlib's (and the MLP cell's ρ and gaps, given ``--mlp``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fedsweep.bench_folder import method_runs
from fedsweep.table import read_runs

M = "personalized_accuracy_mean"
PEERS = Path(__file__).resolve().parents[1] / "docs" / "results" / "benchmark" / "peers.md"
#: PFLlib's names (its leaderboard, peers.md's Table A) of the methods fedsweep has; its Per-FedAvg is the first-order
#: one (docs/benchmark.md, beside the Fashion-MNIST Dirichlet MLP cell), its FedAvg and FedProx the two not personalized.
PFLLIB = {"FedAvg": "fedavg", "FedProx": "fedprox", "Per-FedAvg": "perfedavg_fo", "pFedMe": "pfedme", "Ditto": "ditto",
          "APFL": "apfl", "FedFomo": "fedfomo", "FedAMP": "fedamp", "FedALA": "fedala", "FedPer": "fedper", "FedRep": "fedrep",
          "FedRoD": "fedrod", "FedBABU": "fedbabu", "FedDBE": "feddbe", "FedProto": "fedproto"}
GLOBAL_MODEL = ("fedavg", "fedavgm", "fedprox", "scaffold", "feddyn", "fedadam", "fedyogi", "fednova", "moon")


def _r(x, digits: int = 2) -> float:
    return round(float(x), digits)


def _budgets(folder: Path) -> list[int]:
    """The budgets the cell's tables are of (``table_b<B>.csv``), the largest first."""
    return sorted((int(p.stem.rsplit("_b", 1)[1]) for p in folder.glob("table_b*.csv")), reverse=True)


def _table(folder: Path, budget: int) -> pd.DataFrame:
    return pd.read_csv(folder / f"table_b{budget}.csv").set_index("algorithm")


def _points(table: pd.DataFrame, metric: str = M) -> tuple[pd.Series, pd.Series]:
    return 100 * table[f"{metric} mean"], 100 * table[f"{metric} ci95"]


def facts(folder: Path, mlp: Path | None = None) -> dict:
    """The section's numbers (see the module's docstring) of the methods with final runs, as plain values."""
    state = {k: e for k, e in json.loads((folder / "bench_state.json").read_text())["methods"].items() if "final_run" in e}
    budgets = _budgets(folder)
    top, small = budgets[0], budgets[-1]
    table, table_small = _table(folder, top), _table(folder, small)
    finals = read_runs(str(folder / f"final_runs_b{top}.csv"))[0]
    mean, ci = _points(table)
    order = list(mean.sort_values(ascending=False, kind="stable").index)
    rank = {k: i + 1 for i, k in enumerate(order)}

    def seeds(key: str) -> list:
        runs = finals[finals["algorithm"] == key].sort_values("seed")
        return [_r(100 * v) if o == "finished" else o for v, o in zip(runs[M], runs["outcome"])]

    first = order[0]
    top5_floor = min(mean[k] - ci[k] for k in order[:5])
    columns = [c for c in table.columns if c.endswith(" mean") and not c.startswith("wall_time")]
    same = [(a, b) for i, a in enumerate(order) for b in order[i + 1:]
            if table.loc[a, columns].fillna(-1).equals(table.loc[b, columns].fillna(-1))]
    out = {
        "methods": len(state), "rows": len(table), "budgets": budgets,
        "top": [(k, _r(mean[k]), _r(ci[k]), table.loc[k, "best setting"], seeds(k)) for k in order[:6]],
        "overlap_first": [k for k in order[1:] if mean[k] + ci[k] >= mean[first] - ci[first]],
        "below_top5": [k for k in order if mean[k] + ci[k] < top5_floor],
        "narrowest": (ci.idxmin(), _r(ci.min())),
        "identical": same,
        "no_row": {k: seeds(k) for k in sorted(set(state) - set(table.index))},
        "wide": [(k, rank[k], _r(mean[k]), _r(ci[k]), seeds(k)) for k in order if ci[k] > 5],
    }
    if "local" in rank:
        low = mean["local"] - ci["local"]
        out["local"] = {"rank": rank["local"], "global_model_above": [k for k in GLOBAL_MODEL if k in rank and rank[k] < rank["local"]],
                        "ci_below": [k for k in order if mean[k] + ci[k] < low]}
    if mlp is not None:
        mean_mlp = _points(_table(mlp, top))[0]
        both = [k for k in order if k in mean_mlp.index]
        diff = (mean[both] - mean_mlp[both]).sort_values()
        out["mlp"] = {"rows": len(both), "lower": int((diff < 0).sum()), "median": _r(diff.median()),
                      "spearman": round(float(mean[both].corr(mean_mlp[both], method="spearman")), 3),
                      "gains": [(k, _r(v)) for k, v in diff[::-1][:5].items()],
                      "losses": [(k, _r(v)) for k, v in diff[:5].items()]}
    if small != top:
        mean_small, ci_small = _points(table_small)
        both = [k for k in order if k in mean_small.index]
        out["small_budget"] = {
            "budget": small, "rows": len(both),
            "spearman": round(float(mean[both].corr(mean_small[both], method="spearman")), 3),
            "same_choice": sorted(k for k, e in state.items() if e["chosen"].get(str(top)) == e["chosen"].get(str(small))),
            "rows_of": {k: (_r(mean_small[k]), _r(ci_small[k]), table_small.loc[k, "best setting"])
                        for k in [*out["no_row"], *(w[0] for w in out["wide"])] if k in mean_small.index}}
    unseen = _points(table, "unseen_personalized_accuracy_mean")[0].dropna().sort_values()
    out["unseen_lowest"] = [(k, _r(v)) for k, v in unseen[:8].items()]
    out["unseen_highest"] = [(k, _r(v)) for k, v in unseen[::-1][:6].items()]
    wall = table["wall_time_s mean"].sort_values(ascending=False)
    out["final_run_s"] = [(k, _r(v, 0)) for k, v in wall.items()]
    out["transmissions"] = [(k, _r(v, 0)) for k, v in table["transmissions mean"].sort_values(ascending=False).items()]
    out.update(_tuning(folder, state))
    return out


def pfllib_column(column: str, peers: Path = PEERS) -> pd.Series:
    """PFLlib's mean accuracy (%) of each method fedsweep has, in ``column`` of peers.md's Table A, by fedsweep key."""
    lines = peers.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("### 1.3 Table A"))
    header = next(i for i in range(start, len(lines)) if lines[i].startswith("| Method |"))
    cells = lambda line: [c.strip() for c in line.strip("|").split("|")]
    names = cells(lines[header])
    if column not in names:
        raise SystemExit(f"--pfllib: {column!r} is not a column of PFLlib's Table A; its columns: {', '.join(names[1:])}")
    rows = {}
    for line in lines[header + 2:]:
        if not line.startswith("|"):
            break
        row = cells(line)
        if row[0] in PFLLIB:
            rows[PFLLIB[row[0]]] = float(row[names.index(column)].split("±")[0])
    return pd.Series(rows).sort_values(ascending=False, kind="stable")


def pfllib(folder: Path, column: str, mlp: Path | None = None) -> dict:
    """The cell's largest-budget rows beside PFLlib's ``column`` (see the module's docstring)."""
    budget = _budgets(folder)[0]
    theirs = pfllib_column(column)
    personal = [k for k in theirs.index if k not in GLOBAL_MODEL]

    def compare(cell: Path) -> dict:
        mean, ci = _points(_table(cell, budget))
        order = list(mean.sort_values(ascending=False, kind="stable").index)
        both = [k for k in theirs.index if k in mean.index]
        rho = lambda keys: round(float(theirs[keys].corr(mean[keys], method="spearman")), 2)
        mine = [k for k in personal if k in mean.index]
        gap = (theirs[both] - mean[both]).round(2)
        return {"rows": [(k, float(theirs[k]), _r(mean[k]), _r(ci[k]), order.index(k) + 1) for k in both], "of": len(order),
                "missing": [k for k in theirs.index if k not in mean.index],
                "spearman_personalized": (len(mine), rho(mine)), "spearman_all": (len(both), rho(both)),
                "span_personalized": {"pfllib": _r(theirs[personal].max() - theirs[personal].min()),
                                      "ours": (_r(mean[mine].min()), _r(mean[mine].max()))},
                "gap_personalized": sorted((_r(gap[k]), k) for k in mine),
                "gap_global": [(k, _r(gap[k])) for k in GLOBAL_MODEL if k in gap.index]}

    out = compare(folder)
    if mlp is not None:
        other = compare(mlp)
        out["mlp"] = {k: other[k] for k in ("spearman_personalized", "spearman_all", "gap_personalized", "gap_global")}
    return out


def _tuning(folder: Path, state: dict) -> dict:
    """Each method's tuning runs (its own settings, from the phase's saved copy): the trials that did not finish, and
    its best two settings on validation."""
    not_finished, best = {}, {}
    for key, runs in method_runs(folder, state, "tune_run").items():
        runs = runs.sort_values(f"val_{M}", ascending=False, kind="stable")
        not_finished[key] = int((runs["outcome"] != "finished").sum())
        best[key] = [(label, _r(100 * v)) for label, v in zip(runs["setting_label"][:2], runs[f"val_{M}"][:2])]
    return {"tuning_runs": sum(len(state[k]["settings"]) for k in best), "not_finished": not_finished, "best_on_validation": best}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--mlp", type=Path, help="the MLP cell's folder, for a CNN cell")
    parser.add_argument("--pfllib", metavar="COLUMN", help='a column of PFLlib\'s leaderboard (peers.md): "Path FMNIST", "Prac FMNIST"')
    args = parser.parse_args(argv)
    if args.pfllib:
        pfllib_column(args.pfllib)  # a column PFLlib's table lacks is refused before the folder is read
    found = facts(args.folder, args.mlp)
    if args.pfllib:
        found["pfllib"] = pfllib(args.folder, args.pfllib, args.mlp)
    for key, value in found.items():
        print(f"{key}: {value}")


if __name__ == "__main__":
    main()
