"""What a benchmark's folder holds beside ``bench_state.json`` (:mod:`fedsweep.bench_run` writes it): each finished
phase's runs (``runs/<sweep run id>.csv``, which carry the folder to another MLflow store), and what its tables say
about their rows: the commits that ran each row (the runs' ``code`` tag) and the methods a table leaves out, with why.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from fedsweep.bench import Bench
from fedsweep.table import draw_order, read_runs, save_runs

#: The folder, beside bench_state.json, of each finished phase's runs (:func:`keep_runs`).
RUNS = "runs"


def saved_path(folder: Path, run_id: str) -> Path:
    return folder / RUNS / f"{run_id}.csv"


def keep_runs(folder: Path, run_id: str, runs: pd.DataFrame) -> None:
    """A finished phase's runs (those of sweep ``run_id``) saved as ``fedsweep table --runs-output`` saves them."""
    (folder / RUNS).mkdir(parents=True, exist_ok=True)
    save_runs(runs, {}, str(saved_path(folder, run_id)))


def saved_runs(folder: Path, run_id: str) -> pd.DataFrame | None:
    """The runs :func:`keep_runs` saved of sweep ``run_id``; None when not saved."""
    if not (path := saved_path(folder, run_id)).exists():
        return None
    return read_runs(str(path))[0]


def method_runs(folder: Path, methods: dict, phase: str) -> dict[str, pd.DataFrame]:
    """Each method's runs of one recorded phase (``tune_run``: its own settings; ``final_run``: its chosen ones), from
    the phase's saved copy in ``runs/``, each copy read once though many methods' runs are in it; a method whose
    phase is not recorded, or not saved, is left out."""
    copies: dict[str, pd.DataFrame | None] = {}
    out = {}
    for key, entry in methods.items():
        if not (run_id := entry.get(phase)):
            continue
        if run_id not in copies:
            copies[run_id] = saved_runs(folder, run_id)
        if (runs := copies[run_id]) is not None:
            chosen = [s for s in entry.get("chosen", {}).values() if s is not None]
            out[key] = runs[runs["setting"].isin(entry.get("settings", []) if phase == "tune_run" else chosen)]
    return out


def bench_seeds(bench: Bench) -> dict[str, list[int]]:
    """The file's tuning and final seeds, as ``bench_state.json`` records them for each method's runs."""
    return {"tuning": sorted(bench.sweep_section["seeds"]), "final": sorted(bench.settings.final_seeds)}


NO_CODE, NO_TUNING = "no `code` tag", "tuning runs not saved"
_CODES = "\nCode (the runs' `code` tag; tuning and final runs): "


def row_codes(folder: Path, done: dict[str, dict[str, Any]], final: pd.DataFrame,
              budgets: list[int]) -> dict[int, dict[str, set[str]]]:
    """For each budget, the commits (runs' ``code``) of the runs behind each method's row: its first ``budget``
    tuning settings' runs (from the phase's saved copy) and its choice's final runs. A phase resumed after a
    commit, or a method run again alone, mixes them; the table says so."""
    tuning = method_runs(folder, done, "tune_run")
    codes: dict[int, dict[str, set[str]]] = {budget: {} for budget in budgets}
    for key, entry in done.items():
        runs = tuning.get(key)
        for budget in budgets:
            if (chosen := entry["chosen"].get(str(budget))) is None:
                continue
            mine, found = [final.loc[final["setting"] == chosen]] if len(final) else [], set()
            if runs is None:
                found.add(NO_TUNING)
            else:
                mine.append(runs.loc[runs["setting"].isin(draw_order(runs)[:budget])])
            for part in mine:
                found |= {c if isinstance(c, str) and c else NO_CODE for c in part.get("code", [NO_CODE] * len(part))}
            codes[budget][key] = found
    return codes


def code_note(codes: dict[str, set[str]]) -> str:
    """A table's line naming the code that ran it: one commit, or each commit with the methods whose runs it ran
    (the largest group, of more than six, counted)."""
    groups: dict[tuple[str, ...], list[str]] = {}
    for key, commits in sorted(codes.items()):
        groups.setdefault(tuple(sorted(commits)), []).append(key)
    if len(groups) == 1:
        only = next(iter(groups))
        if only == (NO_CODE,):
            return "\nCode: not recorded (no run has a `code` tag).\n"
        if not {NO_CODE, NO_TUNING} & set(only):
            return f"\nCode: every run at {' and '.join(only)} (the runs' `code` tag).\n"
        return f"{_CODES}{' and '.join(only)}, every method.\n"
    ordered = sorted(groups.items(), key=lambda g: len(g[1]))
    parts = [f"{' and '.join(c) or 'no runs saved'}: "
             + (f"the {len(keys)} other methods" if i == len(ordered) - 1 and len(keys) > 6 else ", ".join(keys))
             for i, (c, keys) in enumerate(ordered)]
    return _CODES + "; ".join(parts) + ".\n"


def absent_note(bench: Bench, methods: dict[str, dict[str, Any]], rows: set[str], budget: int) -> str:
    """Every method of the file missing from budget ``budget``'s table, with why: a table says what it leaves out."""
    why, seeds = {}, bench_seeds(bench)
    for key in bench.tunes:
        entry = methods.get(key, {})
        if key in rows:
            continue
        if "chosen" not in entry:
            why[key] = "not tuned yet, or its tuning did not finish; --resume goes on"
        elif entry.get("settings") != sorted(bench.sections[key]):
            why[key] = "its settings changed since its runs; --resume runs it again"
        elif entry.get("seeds", seeds) != seeds:
            why[key] = "its seeds changed since its runs; --resume runs it again"
        elif entry["chosen"].get(str(budget)) is None:
            why[key] = f"none of its first {budget} settings finished on every tuning seed"
        elif "final_run" not in entry:
            why[key] = "its final runs did not all finish; --resume goes on"
        else:
            why[key] = f"a final run of its chosen setting did not finish (diverged, or interrupted); see final_runs_b{budget}.csv"
    return "".join(f"\nNot in this table: {key}: {reason}.\n" for key, reason in sorted(why.items()))
