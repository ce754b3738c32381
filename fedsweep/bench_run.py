"""Running a benchmark (:mod:`fedsweep.bench`) and writing what it found.

The tuning sweep of the methods without a choice yet, then the final sweep of those without final runs, each a
`fedsweep sweep` (Ray Tune, one MLflow run per trial) nested under the benchmark's MLflow run.
``<output>/<name>/bench_state.json`` records what has finished: ``--resume`` skips what finished and resumes an
interrupted sweep where Tune left it; a sweep that stopped records each of its methods whose runs are all there
(:func:`_settle`). Each finished phase's runs are saved beside it (``runs/<sweep run id>.csv``),
so that the folder alone carries the finished phases to another MLflow store (a new machine, where a long benchmark
goes on in a later session): a recorded sweep that the store does not hold is read from there. The benchmark's
files (per budget: ``table_b<N>.md|csv``, ``final_runs_b<N>.csv`` with its ``.tags.json``, ``ranking_b<N>.png``;
``accuracy_vs_transmissions.png``; ``compact.md``, the budgets side by side) land in that folder and under ``bench/`` of the benchmark's run.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pandas as pd

from fedsweep.bench import (
    Bench,
    bench_table,
    chosen_settings,
    compact_markdown,
    load_bench,
    missing_runs,
    read_state,
    with_kernels,
    write_state,
)
from fedsweep.bench_figures import ranking_figure, transmissions_figure
from fedsweep.bench_folder import absent_note, bench_seeds, code_note, keep_runs, row_codes, saved_path
from fedsweep.config import ConfigError, Sweep, resolve_tracking_uri
from fedsweep.table import load_runs, read_runs, save_runs, to_markdown
from fedsweep.tracking import PARENT_TAG, TAG_PREFIX, client, end_run, ensure_experiment, kernel_settings


def _run(sweep: Sweep, resume: bool, parent: str, verbose: int) -> dict[str, Any]:
    """``fedsweep sweep`` of one phase: resumed where an interrupted attempt left it, else started."""
    from fedsweep.sweep import find_resumable, open_storage, run_sweep

    resumable = False
    if resume:
        try:
            find_resumable(sweep, open_storage(sweep))
            resumable = True
        except ConfigError:  # never started, or interrupted before Tune saved anything: start it
            pass
    out = run_sweep(sweep, verbose=verbose, resume=resumable, tags=phase_tags(parent, sweep))
    return {**out, "restored": resumable}


def _phase(bench: Bench, sweep: Sweep, resume: bool, parent: str, verbose: int, uri: str, experiment: str,
           settings: list[str], seeds: list[int], target: float | None = None) -> tuple[dict[str, Any], pd.DataFrame, int]:
    """A phase's sweep run (:func:`_run`), its runs and how many of those it owes are missing. A restored Tune
    experiment that Tune had finished runs nothing, even where MLflow lacks runs (deleted, or taken for missing by
    :func:`_choose_again`): then the phase runs again from the start, once."""
    out = _run(sweep, resume, parent, verbose)
    computed = load_runs(uri, experiment, out["parent_run_id"], target)[0]
    runs = with_kernels(bench, computed)
    missing = missing_runs(runs, settings, seeds)
    if out["restored"] and not out["interrupted"] and missing > out["errors"]:  # a run left out by with_kernels too
        print(f"[bench {bench.name}] {sweep.settings.name}: Tune's saved sweep had ended with {missing} run(s) missing in "
              "MLflow; it runs again from the start", file=sys.stderr)
        out = _run(sweep, False, parent, verbose)
        computed = load_runs(uri, experiment, out["parent_run_id"], target)[0]
        runs = with_kernels(bench, computed)
        missing = missing_runs(runs, settings, seeds)
    if len(computed) > len(runs):
        raise ConfigError([(f"{bench.path}: bench.kernels: {len(computed) - len(runs)} run(s) of {sweep.settings.name} were "
                           f"computed without {kernel_settings(bench.settings.kernels)} (their platforms above): the workers "
                           "kept another environment (a joined cluster's nodes keep the one they started with); nothing of "
                           "this phase is recorded; allowed: workers started with them")])
    return out, runs, missing


def _in_store(uri: str, run_id: str) -> bool:
    from mlflow.exceptions import MlflowException

    try:
        client(uri).get_run(run_id)
        return True
    except MlflowException:
        return False


def _phase_runs(bench: Bench, uri: str, experiment: str, run_id: str, folder: Path,
                target: float | None = None, final: bool = False) -> pd.DataFrame:
    """A recorded phase's runs: the store's, or, where the store does not hold that sweep at all (the folder came from
    another machine), the copy :func:`keep_runs` saved; for a final sweep without that copy (a folder written before
    2026-11-26, when phases were not yet saved), the runs the folder's tables were made of (``final_runs_b<N>.csv``:
    every chosen setting on every final seed, which the callers pick by setting); none of these, none (the phase
    runs again)."""
    saved = saved_path(folder, run_id)
    # the tables of this file's budgets only: a file left by a budget since dropped may hold another sweep's runs
    tables = [t for b in bench.budgets if (t := folder / f"final_runs_b{b}.csv").exists()] if final else []
    if not _in_store(uri, run_id) and (sources := [saved] if saved.exists() else tables):
        print(f"[bench {bench.name}] sweep {run_id}: not in the MLflow store at {uri}; its runs read from "
              f"{', '.join(map(str, sources))}", file=sys.stderr)
        runs = pd.concat([read_runs(str(path))[0] for path in sources], ignore_index=True)
        return with_kernels(bench, runs.drop_duplicates("run_id", ignore_index=True))  # a run chosen at two budgets is in both tables
    return with_kernels(bench, load_runs(uri, experiment, run_id, target)[0])


class Interrupted(Exception):
    """A phase's sweep returned interrupted, or with more runs missing than trials failed: trials never ran, so it
    was stopped (Ctrl-C; Tune saves its state and returns without an error). The benchmark stops there, every later cell unstarted; ``--resume`` goes on."""


def open_state(bench: Bench, output: str | Path, resume: bool) -> tuple[Path, dict[str, Any], str, str]:
    """The benchmark's folder and its state (``bench_state.json``) made ready for this file: its MLflow run in this
    store, each method's settings and seeds checked against the file (what changed runs again) and each recorded choice
    made again from its runs (:func:`_choose_again`); returns (folder, state, tracking URI, experiment)."""
    folder = Path(output) / bench.name
    state = read_state(folder)
    if state and not resume:
        raise ConfigError([(f"{folder}: a run of benchmark '{bench.name}' is there already; allowed: --resume to go on "
                            "with it, or another --output")])
    first = bench.first.trials[0].config
    experiment, uri = first.tracking.experiment, resolve_tracking_uri(first.tracking.tracking_uri)
    c = client(uri)
    if "run_id" in state and not _in_store(uri, state["run_id"]):  # the folder came from another store: a run here
        print(f"[bench {bench.name}] its MLflow run {state['run_id']} is not in the store at {uri}: a new one there",
              file=sys.stderr)
        state["previous_run_ids"] = [*state.get("previous_run_ids", []), state.pop("run_id")]
    if "run_id" not in state:
        state["run_id"] = c.create_run(ensure_experiment(uri, experiment), run_name=bench.name, tags={
            f"{TAG_PREFIX}bench": "true", f"{TAG_PREFIX}source_file": bench.path}).info.run_id
        c.log_text(state["run_id"], Path(bench.path).read_text(), "bench/benchmark.yaml")
    else:
        c.update_run(state["run_id"], status="RUNNING")
    methods = state.setdefault("methods", {})
    for key in bench.tunes:
        drawn = sorted(bench.sections[key])
        if methods.get(key) and methods[key].get("settings") != drawn:  # other files (or unrecorded): another protocol's
            print(f"[bench {bench.name}] {key}: its settings changed since {folder} was written (a benchmark or methods file "
                  "edited, or a code change to a trial's configuration, such as a new field): it runs again", file=sys.stderr)
            methods[key] = {}
        methods.setdefault(key, {})["settings"] = drawn
        _check_seeds(bench, key, methods[key], folder)
    _choose_again(bench, methods, uri, experiment, folder)
    write_state(folder, state)
    return folder, state, uri, experiment


def phase_tags(bench_run_id: str, sweep: Sweep) -> dict[str, str]:
    """The tags of a phase's sweep run: nested under the benchmark's run, named by the phase."""
    return {PARENT_TAG: bench_run_id, f"{TAG_PREFIX}bench": sweep.settings.name}


def record_tuning(bench: Bench, state: dict[str, Any], keys: list[str], sweep_run_id: str, runs: pd.DataFrame,
                  folder: Path) -> None:
    """A finished tuning phase (every run of ``keys`` there): each method's choice per budget, settings tried and
    tuning time recorded, its runs kept beside the state."""
    methods = state["methods"]
    method = runs["setting"].map(bench.owner())
    for key, chosen in chosen_settings(bench, runs, keys).items():
        mine = runs[method == key]
        methods[key].update(tune_run=sweep_run_id, chosen={str(b): s for b, s in chosen.items()},
                            tried=int(mine["setting"].nunique()), tuning_wall_s=float(mine["wall_time_s"].sum()))
    keep_runs(folder, sweep_run_id, runs)
    write_state(folder, state)


def record_final(state: dict[str, Any], keys: list[str], sweep_run_id: str, runs: pd.DataFrame, folder: Path) -> None:
    """A finished final phase (every chosen setting of ``keys`` on every final seed): recorded, its runs kept."""
    for key in keys:
        state["methods"][key]["final_run"] = sweep_run_id
    keep_runs(folder, sweep_run_id, runs)
    write_state(folder, state)


def run_bench(bench: Bench, output: str | Path, resume: bool = False, verbose: int = 1) -> tuple[Path, int]:
    """The tuning sweep of the methods without a choice yet, the final sweep of those without final runs, then
    the tables; returns the folder and the number of sweeps that did not finish (``--resume`` reruns them). The
    benchmark's MLflow run ends with the command, as a sweep's parent does: FINISHED, FAILED (a sweep did not finish)
    or KILLED (Ctrl-C or an error); ``--resume`` sets it RUNNING again."""
    folder, state, uri, experiment = open_state(bench, output, resume)
    status = "KILLED"
    try:
        failed = _run_phases(bench, folder, state, uri, experiment, resume, verbose)
        status = "FAILED" if failed else "FINISHED"
        return folder, failed
    finally:
        end_run(uri, state["run_id"], status)


def _run_phases(bench: Bench, folder: Path, state: dict[str, Any], uri: str, experiment: str, resume: bool,
                verbose: int) -> int:
    methods, target = state["methods"], bench.first.settings.target_accuracy
    done = [k for k in bench.in_file if "final_run" in methods.get(k, {})]
    print(f"[bench {bench.name}] {folder}: {len(done)} of the file's {len(bench.in_file)} methods done (their final runs "
          f"recorded); this command: {', '.join(k for k in bench.tunes if k not in done) or 'nothing left to run'}", flush=True)
    failed = 0
    if pending := [k for k in bench.tunes if "chosen" not in methods[k]]:
        keys = _sweep_keys(bench, state, "tuning", pending, resume, uri)
        owed = {k: [s for s, o in bench.owner().items() if o == k] for k in keys}
        sweep = bench.tune_sweep(keys)
        print(f"[bench {bench.name}] tuning {len(pending)} method(s): {sweep.describe()}", flush=True)
        ended = _phase(bench, sweep, resume, state["run_id"], verbose, uri, experiment, [s for k in keys for s in owed[k]],
                       bench.sweep_section["seeds"])
        if not _settle(bench, state, "tuning", owed, pending, folder, *ended):
            return 1  # a method missing a setting would choose among fewer: none of those chooses
    if pending := [k for k in bench.tunes if "final_run" not in methods[k] and any(methods[k]["chosen"].values())]:
        keys = _sweep_keys(bench, state, "final", pending, resume, uri)
        owed = {k: sorted({s for s in methods[k]["chosen"].values() if s is not None}) for k in keys}
        sweep = _final_sweep(bench, methods, keys)
        print(f"[bench {bench.name}] final runs of {len(pending)} method(s): {sweep.describe()}", flush=True)
        ended = _phase(bench, sweep, resume, state["run_id"], verbose, uri, experiment, [s for k in keys for s in owed[k]],
                       bench.settings.final_seeds, target)
        failed += not _settle(bench, state, "final", owed, pending, folder, *ended)
    for key in bench.tunes:
        if not any(methods[key].get("chosen", {}).values()):
            print(f"[bench {bench.name}] {key}: no setting finished on every tuning seed; not in the tables", file=sys.stderr)
    # the tables hold every method of the file that has its final runs, not only those of --methods
    write_tables(load_bench(bench.path, check_cluster=False) if bench.only else bench, state, uri, folder)
    return failed


def _final_sweep(bench: Bench, methods: dict[str, dict[str, Any]], keys: list[str]) -> Sweep:
    return bench.final_sweep(list(bench.final_sections({k: methods[k]["chosen"] for k in keys}).values()))


#: ``bench_state.json``'s record of each phase's sweep that stopped before its end (:func:`_settle`): its methods and
#: its MLflow run, for :func:`_sweep_keys`.
IN_FLIGHT = "in_flight"


def _sweep_keys(bench: Bench, state: dict[str, Any], phase: str, pending: list[str], resume: bool, uri: str) -> list[str]:
    """The methods of a phase's sweep: ``pending``, those without the phase recorded; on ``--resume``, the methods of
    the phase's sweep that stopped (``state["in_flight"]``) when the newest Tune experiment of that sweep that Tune
    can restore is that one (the same MLflow run, which this store holds) and each of its methods not pending has
    recorded the phase since: Tune goes on where it stopped, and none of their trials runs again. Elsewhere (the
    folder on another machine, or another selection of ``--methods``) a sweep of the pending methods starts."""
    from fedsweep.sweep import find_resumable, open_storage

    was = state.get(IN_FLIGHT, {}).get(phase, {})
    keys, recorded = was.get("methods", []), "chosen" if phase == "tuning" else "final_run"
    if not (resume and keys and set(pending) <= set(keys) <= set(bench.tunes)
            and all(recorded in state["methods"][k] for k in set(keys) - set(pending))):
        return pending
    sweep = bench.tune_sweep(keys) if phase == "tuning" else _final_sweep(bench, state["methods"], keys)
    try:
        saved = find_resumable(sweep, open_storage(sweep))[1]
    except ConfigError:
        return pending
    return keys if saved.get("parent_run_id") == was.get("sweep_run") and _in_store(uri, was["sweep_run"]) else pending


def _settle(bench: Bench, state: dict[str, Any], phase: str, owed: dict[str, list[str]], pending: list[str],
            folder: Path, out: dict[str, Any], runs: pd.DataFrame, missing: int) -> bool:
    """A phase's sweep has ended (``owed``: each of its methods -> its settings, owed on the phase's seeds; ``missing``
    of those runs are not there): each method of ``pending`` with every run it owes recorded, its runs kept (a
    method missing a run would choose among fewer settings, or have a row of fewer seeds; the others' runs are the
    same whatever else the sweep ran). True when none is missing; else the sweep is kept in ``in_flight`` (its
    methods and run, for :func:`_sweep_keys`), so that a folder carried to another machine loses only the methods
    not recorded, and a sweep stopped (more runs missing than trials failed: Ctrl-C ends Tune without an error)
    raises :class:`Interrupted`."""
    seeds = bench_seeds(bench)[phase]
    done = [k for k in pending if not missing_runs(runs, owed[k], seeds)]
    flight = state.setdefault(IN_FLIGHT, {})
    if missing:
        flight[phase] = {"methods": list(owed), "sweep_run": out["parent_run_id"]}
    else:
        flight.pop(phase, None)
    if not flight:
        del state[IN_FLIGHT]
    if phase == "tuning" and done:
        record_tuning(bench, state, done, out["parent_run_id"], runs, folder)
    elif done:
        record_final(state, done, out["parent_run_id"], runs, folder)
    else:
        write_state(folder, state)
    if not missing:
        if out["errors"]:  # a trial that failed after its run was written
            print(f"[bench {bench.name}] {out['errors']} {phase} trial(s) failed, but every run is there", file=sys.stderr)
        return True
    words = (f"{len(done)} of its {len(pending)} methods had every run and are recorded ({', '.join(done)})" if done
             else "no method had every run: nothing recorded")
    total = sum(map(len, owed.values())) * len(seeds)
    if out["interrupted"] or missing > out["errors"]:
        raise Interrupted(f"[bench {bench.name}] the {phase} sweep stopped with {missing} of {total} runs missing; {words}")
    print(f"[bench {bench.name}] the {phase} sweep did not finish ({out['errors']} trial(s) failed, {missing} of {total} runs "
          f"missing); {words}; --resume goes on with it", file=sys.stderr)
    return False


def _check_seeds(bench: Bench, key: str, entry: dict[str, Any], folder: Path) -> None:
    """A method's recorded phases against the file's seeds now: tuning seeds changed, it is tuned again (a choice
    averaged over other seeds, or a final seed that tuned); final seeds changed, its final runs run again (a table's
    n must be its seeds'). A state written before the seeds were recorded takes them as they are."""
    seeds = bench_seeds(bench)
    recorded = entry.get("seeds", seeds)
    for phase, gone in (("tuning", ("chosen", "tune_run", "final_run")), ("final", ("final_run",))):
        if recorded[phase] != seeds[phase] and any(g in entry for g in gone):
            print(f"[bench {bench.name}] {key}: the {phase} seeds are {seeds[phase]} now, {recorded[phase]} when {folder} "
                  f"was written: its {phase} runs run again", file=sys.stderr)
            for g in gone:
                entry.pop(g, None)
            break
    entry["seeds"] = seeds


def tabled(bench: Bench, methods: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The methods whose final runs are this file's protocol, sorted: its settings and seeds as the runs had them. A
    ``--methods`` run checks only its own methods (:func:`_check_seeds`), so the others are checked here: one whose
    draws or seeds changed since its runs stays out of the tables (:func:`absent_note` says why)."""
    seeds = bench_seeds(bench)
    return {k: e for k, e in sorted(methods.items()) if "final_run" in e and k in bench.tunes
            and e.get("settings") == sorted(bench.sections[k]) and e.get("seeds", seeds) == seeds}


def _choose_again(bench: Bench, methods: dict[str, dict[str, Any]], uri: str, experiment: str, folder: Path) -> None:
    """Each recorded phase checked against its runs, and each recorded choice made again. A method whose tuning
    or final runs are not all there (a run deleted; an interrupted trial's run, which fedsweep before 2026-11-26
    marked stopped_early) runs that phase again. Where the selection rule (``bench.choose``) now chooses otherwise than
    recorded, the new choice is recorded and that method's final runs run again."""
    for run_id, keys in _by_run(bench, methods, "tune_run").items():
        runs = _phase_runs(bench, uri, experiment, run_id, folder)
        complete = []
        for key in keys:
            if _incomplete(bench, key, "tuning", runs, list(bench.sections[key]), bench.sweep_section["seeds"]):
                for gone in ("chosen", "tune_run", "final_run"):
                    methods[key].pop(gone, None)
            else:
                complete.append(key)
        for key, chosen in chosen_settings(bench, runs, complete).items():
            if (now := {str(b): s for b, s in chosen.items()}) != methods[key]["chosen"]:
                print(f"[bench {bench.name}] {key}: the selection rule now chooses {now} (recorded: {methods[key]['chosen']}); "
                      "its final runs run again", file=sys.stderr)
                methods[key]["chosen"] = now
                methods[key].pop("final_run", None)
    for run_id, keys in _by_run(bench, methods, "final_run").items():
        runs = _phase_runs(bench, uri, experiment, run_id, folder)
        for key in keys:
            chosen = sorted({s for s in methods[key]["chosen"].values() if s is not None})
            if _incomplete(bench, key, "final", runs, chosen, bench.settings.final_seeds):
                methods[key].pop("final_run")


def _by_run(bench: Bench, methods: dict[str, dict[str, Any]], phase: str) -> dict[str, list[str]]:
    """The recorded sweeps of a phase (``tune_run`` or ``final_run``) -> the methods whose runs they hold."""
    by_run: dict[str, list[str]] = {}
    for key, entry in methods.items():
        if key in bench.tunes and phase in entry:
            by_run.setdefault(entry[phase], []).append(key)
    return by_run


def _incomplete(bench: Bench, key: str, phase: str, runs: pd.DataFrame, settings: list[str], seeds: list[int]) -> bool:
    if missing := missing_runs(runs, settings, seeds):
        print(f"[bench {bench.name}] {key}: {missing} of its {len(settings) * len(seeds)} {phase} runs are not there "
              f"(interrupted or deleted); its {phase} runs run again", file=sys.stderr)
    return bool(missing)


def write_tables(bench: Bench, state: dict[str, Any], uri: str, folder: Path) -> dict[int, pd.DataFrame]:
    """Each budget's table from the final runs of the methods that have them, written to ``folder`` and to the
    benchmark's MLflow run."""
    first = bench.first
    experiment, settings = first.trials[0].config.tracking.experiment, first.settings
    # methods sorted, runs by setting and seed: what a run writes, a resume that runs nothing writes byte for byte
    done = tabled(bench, state["methods"])
    frames = []
    for run in dict.fromkeys(e["final_run"] for e in done.values()):
        # a method's final runs from its own final sweep: an earlier final sweep may hold the same setting's runs
        # (a method whose choice changed, rerun in a later sweep, kept a setting it had)
        mine = {s for e in done.values() if e["final_run"] == run for s in e["chosen"].values()}
        runs = _phase_runs(bench, uri, experiment, run, folder, settings.target_accuracy, final=True)
        frames.append(runs[runs["setting"].isin(mine)])
    final = pd.concat(frames or [pd.DataFrame()], ignore_index=True)
    if len(final):
        final = final.sort_values(["setting", "seed", "run_id"], kind="stable", ignore_index=True)
    chosen = {k: {int(b): s for b, s in e["chosen"].items()} for k, e in done.items()}
    tried = {k: e["tried"] for k, e in done.items()}
    labels = {s: bench.label(k, s) for k, by_budget in chosen.items() for s in by_budget.values() if s is not None}
    wall = ", ".join(f"{k} {e['tuning_wall_s']:.0f}" for k, e in done.items())
    codes = row_codes(folder, done, final, bench.budgets)
    tables = {}
    # the final runs: one setting per method, chosen on validation before they ran
    tags = {f"{TAG_PREFIX}bench": bench.name, f"{TAG_PREFIX}metric": settings.metric, f"{TAG_PREFIX}mode": settings.mode,
            f"{TAG_PREFIX}select_on": "validation"}
    for budget in bench.budgets:
        table, runs = bench_table(final, chosen, tried, budget, settings.metric, settings.mode, labels)
        if table.empty:
            continue
        tables[budget] = table
        header = (f"Benchmark {bench.name}: budget {budget} setting(s) per method, chosen on validation "
                  f"(seeds {settings.seeds}); test metrics over the final seeds {bench.settings.final_seeds}, mean ± 95% CI. "
                  f"transmissions: floats sent up and down by the end, in models. Tuning time per method (s, the "
                  f"servers' wall time summed over its runs): {wall}.")
        rows = set(table["algorithm"])
        note = absent_note(bench, state["methods"], rows, budget) + code_note(
            {k: c for k, c in codes[budget].items() if k in rows})
        (folder / f"table_b{budget}.md").write_text(header + "\n\n" + to_markdown(table) + "\n" + note)
        table.to_csv(folder / f"table_b{budget}.csv", index=False)
        save_runs(runs, tags, str(folder / f"final_runs_b{budget}.csv"))
        (folder / f"ranking_b{budget}.png").write_bytes(ranking_figure(table, settings.metric, f"{bench.name}, budget {budget}"))
        if budget == bench.budgets[0]:
            (folder / "accuracy_vs_transmissions.png").write_bytes(transmissions_figure(runs, settings.metric, bench.name))
    if tables:
        (folder / "compact.md").write_text(compact_markdown(tables, settings.metric) + "\n")
        client(uri).log_artifacts(state["run_id"], str(folder), "bench")
    return tables
