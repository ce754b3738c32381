"""What moved between two runs of one benchmark cell: two folders `fedsweep bench` wrote for the same file (a cell run
again with other kernels, on another CPU, at another commit). docs/reproduction.md's comparisons of the MLP cells run
again with ``make demo``'s kernels are its output.

    python benchmarks/cell_diff.py NEW_FOLDER OLD_FOLDER [--docs]

Printed, for the largest budget (the table's) and the others: the methods whose chosen setting moved; the final runs
of a setting both folders ran, seed for seed (equal to the last digit, or moved: median and largest move, in points of
the ranking metric); the rows (means over the final seeds, ``table_b<B>.csv``) that moved, how many of them in the two
decimals ``compact.md`` shows (not the rows that moved by half a hundredth or more: 93.816 and 93.819 show alike, 93.814 and 93.816 do not), by how much, and
which left their old 95% CI; Spearman's ρ between the two orders of the rows; the top five of each (ties, such as
FedBN's and FedAvg's identical rows, kept in the table's order). Then every run both folders record (the phases
``bench_state.json`` names, from ``runs/``: the tuning trials and the final runs; a folder of some methods only, such
as a ``--methods`` run on another CPU, is compared by the runs it has): how many are equal in their outcome and every
metric column. With ``--docs``:
every line of the documents that quotes a ``mean ± CI`` of the old ``compact.md`` that the new one no longer holds
(across line breaks), the comparisons a publication of the new folder must rewrite.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pandas as pd

from fedsweep.bench import read_state
from fedsweep.bench_folder import method_runs
from fedsweep.table import read_runs

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("docs/benchmark.md", "docs/reproduction.md", "docs/performance.md", "README.md")
QUOTE = re.compile(r"(\d+\.\d\d)\s+±\s+(\d+\.\d\d)")  # a mean ± CI as compact.md prints it, a line break allowed


def compare(new: Path, old: Path, budget: int) -> dict:
    """The differences at one budget (see the module's docstring), as numbers, in the metric the cell ranked by (the
    tag `fedsweep bench` saved beside its final runs)."""
    chosen = {f: {k: e["chosen"][str(budget)] for k, e in read_state(f)["methods"].items() if "chosen" in e} for f in (new, old)}
    both = sorted(set(chosen[new]) & set(chosen[old]))
    (runs_new, tags), (runs_old, _) = (read_runs(str(f / f"final_runs_b{budget}.csv")) for f in (new, old))
    metric = tags["fedsweep.metric"]
    same = runs_new.merge(runs_old, on=["setting", "seed"], suffixes=("", "_old"))
    move = (100 * (same[metric] - same[f"{metric}_old"])).abs()
    moved = move[move > 0]
    worst = same.loc[moved.idxmax()] if len(moved) else None
    tables = {f: pd.read_csv(f / f"table_b{budget}.csv").set_index("algorithm") for f in (new, old)}
    # the rows both tables hold (a method whose chosen setting diverged on a final seed has none)
    rowed = [k for k in both if all(k in t.index for t in tables.values())]
    tables = {f: t.loc[rowed] for f, t in tables.items()}
    means = {f: 100 * t[f"{metric} mean"] for f, t in tables.items()}
    rows = (means[new] - means[old]).abs()  # a row moved when its mean differs at all (its runs did not all repeat)
    outside = [k for k in rowed if rows[k] > 100 * tables[old].loc[k, f"{metric} ci95"]]
    return {
        "methods": len(both), "rows": len(rowed),
        "choices_moved": [k for k in both if chosen[new][k] != chosen[old][k]],
        "runs_compared": len(same), "runs_equal": int((move == 0).sum()), "runs_moved": len(moved),
        "run_move_median": float(moved.median()) if len(moved) else 0.0, "run_move_max": float(moved.max()) if len(moved) else 0.0,
        "run_move_max_at": (worst["algorithm"], int(worst["seed"])) if worst is not None else None,
        "rows_moved": int((rows > 0).sum()),
        "rows_moved_shown": int((means[new].map("{:.2f}".format) != means[old].map("{:.2f}".format)).sum()),
        "row_move_max": float(rows.max()), "row_move_max_at": rows.idxmax() if rows.max() > 0 else None,
        "rows_outside_old_ci": outside,
        "spearman": float(means[new].corr(means[old], method="spearman")),
        "top5": {name: list(means[f].sort_values(ascending=False, kind="stable").index[:5]) for name, f in (("new", new), ("old", old))},
    }


def recorded_runs(folder: Path) -> pd.DataFrame:
    """The runs of the phases ``bench_state.json`` names for each method (:func:`method_runs`): its tuning sweep's
    runs of its own settings and its final sweep's runs of its chosen ones. A phase run again (FedAMP's after its
    fix) replaces the one before, whose copy stays in ``runs/``; a phase without a saved copy is left out."""
    methods = read_state(folder).get("methods", {})
    phases = {phase: method_runs(folder, methods, phase) for phase in ("tune_run", "final_run")}
    parts = [phases[phase][key] for key in methods for phase in ("tune_run", "final_run") if key in phases[phase]]
    return pd.concat(parts, ignore_index=True).drop_duplicates(["setting", "seed"]) if parts else pd.DataFrame()


def every_run(new: Path, old: Path) -> dict:
    """Every recorded run of ``new`` (:func:`recorded_runs`) matched by (setting, seed) with ``old``'s: how many are
    equal in their outcome and every metric column (NaN equal to NaN; the seconds a run took and its bookkeeping are
    not metrics), and the (setting label, setting, seed) of those that are not."""
    runs_new, runs_old = recorded_runs(new), recorded_runs(old)
    if runs_new.empty or runs_old.empty:
        return {"runs": len(runs_new), "compared": 0, "equal": 0, "columns": 0, "differ": []}
    metrics = [c for c in runs_new.columns if c in runs_old.columns and not c.startswith("param:") and c != "seed"
               and not c.endswith("_s") and runs_new[c].dtype.kind in "fi"]
    both = runs_new.merge(runs_old, on=["setting", "seed"], suffixes=("", "_old"))
    same = both["outcome"] == both["outcome_old"]
    for c in metrics:
        same &= (both[c] == both[f"{c}_old"]) | (both[c].isna() & both[f"{c}_old"].isna())
    return {"runs": len(runs_new), "compared": len(both), "equal": int(same.sum()), "columns": len(metrics),
            "differ": [(r.setting_label, r.setting, int(r.seed)) for r in both[~same].itertuples()]}


def stale_quotes(new: Path, old: Path, docs=DOCS) -> list[str]:
    """``file:line: quote`` for each quote of the old compact.md's numbers that the new one does not hold."""
    numbers = {f: {f"{m} ± {c}" for m, c in QUOTE.findall((f / "compact.md").read_text())} for f in (new, old)}
    gone = numbers[old] - numbers[new]
    out = []
    for doc in docs:
        text = (ROOT / doc).read_text()
        for m in QUOTE.finditer(text):
            if f"{m[1]} ± {m[2]}" in gone:
                out.append(f"{doc}:{text.count(chr(10), 0, m.start()) + 1}: {m[1]} ± {m[2]}")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("new", type=Path)
    parser.add_argument("old", type=Path)
    parser.add_argument("--docs", action="store_true", help="list the documents' quotes of numbers that moved")
    args = parser.parse_args(argv)
    budgets = sorted((int(p.stem.rsplit("_b", 1)[1]) for p in args.new.glob("final_runs_b*.csv")), reverse=True)
    for budget in budgets:
        d = compare(args.new, args.old, budget)
        print(f"budget {budget}: {len(d['choices_moved'])} of {d['methods']} choices moved {d['choices_moved']}; "
              f"of {d['runs_compared']} final runs of a setting both ran, {d['runs_equal']} equal, {d['runs_moved']} moved "
              f"(median {d['run_move_median']:.3f}, at most {d['run_move_max']:.3f} points: {d['run_move_max_at']}); "
              f"{d['rows_moved']} of {d['rows']} rows moved ({d['rows_moved_shown']} in the two decimals shown), at most {d['row_move_max']:.2f} ({d['row_move_max_at']}), "
              f"outside their old CI: {d['rows_outside_old_ci']}; Spearman {d['spearman']:.3f}; "
              f"top five {d['top5']['new']} (before {d['top5']['old']})")
    d = every_run(args.new, args.old)
    more = f" and {len(d['differ']) - 10} more" if len(d["differ"]) > 10 else ""
    print(f"every recorded run: {d['runs']} in the new folder, {d['compared']} of them in the old; {d['equal']} equal in "
          f"their outcome and all {d['columns']} metric columns; differ: {d['differ'][:10]}{more}")
    if args.docs:
        print("\n".join(stale_quotes(args.new, args.old)) or "no document quotes a number that moved")


if __name__ == "__main__":
    main()
