"""A benchmark cell's phases on a lent GPU machine, without Ray or MLflow; then recorded into the cell's folder here.

`fedsweep bench` runs each phase (a method's tuning, then its chosen settings on the final seeds) as a `fedsweep
sweep` on Ray Tune, logged into MLflow. The `device` tool's GPU machine has neither (nor a network to fetch them),
and lends 15 minutes a session, so a full-scale cell (CIFAR-10, 38 methods × about 20 trials) advances there a few
methods at a time, in two steps:

    there:  python benchmarks/device_bench.py run sweeps/benchmark/cifar10_dirichlet.yaml --methods fedavg,fedavg_ft \\
                --out DIR [--workers 12] [--time-box 420] [--code COMMIT]
    here:   python benchmarks/device_bench.py log sweeps/benchmark/cifar10_dirichlet.yaml DIR --output docs/results/benchmark

``run``: each method of ``--methods`` that the cell's folder under ``--output`` (the repository's copy travels with
it) does not record as tuned; its tuning phase (``Bench.tune_sweep([method])``: the very trials `fedsweep bench` would run)
trial by trial in ``--workers`` processes (:func:`device_sweep.run_one`: the whole experiment in one process, clients
stacked where the algorithm allows, on ``--device``); once all of a method's tuning trials have ended, its settings
are chosen there by the benchmark's own rule (:func:`fedsweep.bench.chosen_settings`, on validation only) and its
final phase (``Bench.final_sweep``) is queued ahead of any tuning trial not yet started. A trial is started only while
the time left exceeds the longest trial of its method so far (the longest of any method before the first ends); past
``--time-box`` seconds a running trial stops after its round. ``DIR/<method>/{tune,final}/trial_NNNN.jsonl`` as
``device_sweep.py run`` writes them; ``DIR/<method>/chosen.json`` the choice made there.

``log``: for each method of ``DIR`` whose tuning trials all ended (finished or diverged) and which the folder has not
recorded yet: its tuning phase logged as a sweep nested under the benchmark's MLflow run (``device_sweep.log_trials``),
its choice made again here from the MLflow runs (``bench_run.record_tuning``, as `fedsweep bench` records it) and
compared with the choice made there; when they agree and its final trials all ended, its final phase the same way
(``bench_run.record_final``); then the cell's tables (``bench_run.write_tables``). A method with a trial that failed,
was cut by the time box or is missing is left unrecorded (named); `fedsweep bench --resume` or another ``run`` goes on.
The runs carry the platform and code the trial files name (the GPU's, and ``--code``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from multiprocessing import get_context
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.device_sweep import log_trials, read_trial, run_one, trial_file
from fedsweep.bench import Bench, chosen_settings, load_bench, missing_runs, read_state
from fedsweep.config import Sweep


def phase_sweep(bench: Bench, key: str, phase: str, chosen: dict[str, str | None] | None = None) -> Sweep:
    """Method ``key``'s tuning sweep, or the final sweep of the settings ``chosen`` (budget -> setting)."""
    if phase == "tune":
        return bench.tune_sweep([key])
    return bench.final_sweep(list(bench.final_sections({key: chosen or {}}).values()))


def ended_one(end: dict | None) -> bool:
    """A trial file's end line says it finished or diverged (not failed; None: no end line, cut short)."""
    return bool(end and (end["complete"] or end["diverged"]) and "error" not in end)


def ended(trials: list[tuple[dict, list[dict], dict | None]], n: int) -> bool:
    """Every one of the phase's ``n`` trials there and ended finished or diverged (not failed, not cut short)."""
    return len(trials) == n and all(ended_one(end) for _, _, end in trials)


def read_phase(folder: Path, sweep: Sweep) -> list[tuple[dict, list[dict], dict | None]]:
    """The phase's trial files in ``folder``, each checked to be of this very sweep (its text's hash)."""
    trials = [read_trial(f) for f in sorted(folder.glob("trial_*.jsonl"))]
    if other := [h["trial"] for h, _, _ in trials if h["yaml_sha1"] != sweep.source_hash() or h["cut_to"]]:
        raise SystemExit(f"{folder}: trial(s) {other} of another version of the phase's sweep, or cut: not used")
    return trials


def choice(bench: Bench, key: str, sweep: Sweep, trials: list[tuple[dict, list[dict], dict | None]]) -> dict[str, str | None]:
    """The benchmark's choice (budget -> setting) from the trial files of method ``key``'s tuning sweep ``sweep``: the
    runs' frame as :func:`fedsweep.table.load_runs` gives the columns :func:`fedsweep.bench.choose` reads (setting,
    draw order, outcome, the final value of the validation metric)."""
    ranked = "val_" + sweep.settings.metric
    rows = []
    for head, rounds, _ in trials:
        scored = [m[ranked] for m in rounds if ranked in m]
        rows.append({"setting": sweep.trials[head["trial"]].config.setting_key(), "trial": head["trial"],
                     "outcome": "diverged" if rounds and rounds[-1].get("diverged") else "finished",
                     ranked: scored[-1] if scored else float("nan")})
    return {str(b): s for b, s in chosen_settings(bench, pd.DataFrame(rows), [key])[key].items()}


def gpu_cell(file: str, only: list[str] | None = None) -> Bench:
    """The benchmark file, refused where it declares CPU kernels (``bench.kernels``): its runs are computed on this
    route's GPU, and `fedsweep bench` would leave out every run whose platform does not name those kernels."""
    bench = load_bench(file, check_cluster=False, only=only)
    if bench.settings.kernels:
        raise SystemExit(f"{file}: bench.kernels: {bench.settings.kernels}: a CPU cell's kernels; allowed: a cell without "
                         "them on this route (its runs are the GPU's)")
    return bench


def run(args) -> None:
    start = time.time()
    deadline = start + args.time_box
    out = Path(args.out)
    keys = args.methods.split(",")
    recorded = read_state(Path(args.output) / gpu_cell(args.file, only=keys).name).get("methods", {})
    if tuned := [k for k in keys if "chosen" in recorded.get(k, {})]:  # `log` would not record them again
        print(f"[device bench] tuned already in {args.output}: {', '.join(tuned)}; not run", flush=True)
        keys = [k for k in keys if k not in tuned]
        if not keys:
            return
    bench = gpu_cell(args.file, only=keys)
    if any(out.glob("*/*/trial_*.jsonl")):  # `log` reads every trial file there: no mixing of two runs
        raise SystemExit(f"{out}: holds trial files of an earlier run; give an empty --out")
    sweeps = {(k, "tune"): phase_sweep(bench, k, "tune") for k in keys}
    queue = [(k, "tune", i) for k in keys for i in range(len(sweeps[k, "tune"].trials))]
    walls: dict[str, list[float]] = {}
    running: dict = {}
    with ProcessPoolExecutor(args.workers, mp_context=get_context("spawn")) as pool:
        while queue or running:
            while queue and len(running) < args.workers:
                key, phase, index = queue[0]
                longest = max(walls.get(key) or [w for ws in walls.values() for w in ws] or [0.0])
                if deadline - time.time() < longest:
                    print(f"[device bench] {deadline - time.time():.0f} s left, under the {longest:.0f} s a trial of {key} "
                          f"has taken: {len(queue)} trial(s) not started", flush=True)
                    queue.clear()
                    break
                queue.pop(0)
                sweep = sweeps[key, phase]
                folder = out / key / phase
                folder.mkdir(parents=True, exist_ok=True)
                running[pool.submit(run_one, sweep.trials[index], index, sweep.source_hash(), trial_file(folder, index),
                                    args.device, not args.no_stack, deadline, None, args.code)] = (key, phase)
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in done:
                key, phase = running.pop(future)
                result = future.result()
                walls.setdefault(key, []).append(result["wall_s"])
                print(json.dumps({"method": key, "phase": phase, **result}), flush=True)
                sweep = sweeps[key, phase]
                if phase == "tune" and not any(k == key and p == "tune" for k, p in running.values()) \
                        and not any(k == key for k, _, _ in queue):
                    trials = read_phase(out / key / "tune", sweep)
                    if not ended(trials, len(sweep.trials)):
                        print(f"[device bench] {key}: tuning did not end on every trial; no choice", flush=True)
                        continue
                    chosen = choice(bench, key, sweep, trials)
                    (out / key / "chosen.json").write_text(json.dumps(chosen))
                    sweeps[key, "final"] = final = phase_sweep(bench, key, "final", chosen)
                    print(f"[device bench] {key}: chose {chosen}; final phase: {final.describe()}", flush=True)
                    queue[:0] = [(key, "final", i) for i in range(len(final.trials))]
    print(f"[device bench] {time.time() - start:.0f} s", flush=True)


def log(args) -> None:
    from fedsweep.bench_run import open_state, phase_tags, record_final, record_tuning, write_tables
    from fedsweep.table import load_runs
    from fedsweep.tracking import client

    out = Path(args.dir)
    keys = [k for k in gpu_cell(args.file).in_file if (out / k / "tune").is_dir()]
    bench = gpu_cell(args.file, only=keys)
    folder, state, uri, experiment = open_state(bench, args.output, resume=True)
    methods, settings = state["methods"], bench.sweep_section
    for key in keys:
        if "chosen" in methods[key]:
            print(f"[device bench] {key}: tuned already in {folder}; its files in {out} not logged")
            continue
        sweep = phase_sweep(bench, key, "tune")
        trials = read_phase(out / key / "tune", sweep)
        if not ended(trials, len(sweep.trials)):
            ok = sum(ended_one(e) for _, _, e in trials)
            failed = sum(bool(e and "error" in e) for _, _, e in trials)
            print(f"[device bench] {key}: of its {len(sweep.trials)} tuning trials {ok} ended there, {failed} failed, "
                  f"{len(sweep.trials) - ok - failed} cut short or missing; not recorded")
            continue
        parent, _ = log_trials(sweep, trials, uri, experiment, phase_tags(state["run_id"], sweep))
        runs, _ = load_runs(uri, experiment, parent)
        assert missing_runs(runs, list(bench.sections[key]), settings["seeds"]) == 0, f"{key}: tuning runs missing in MLflow"
        record_tuning(bench, state, [key], parent, runs, folder)
        there = json.loads((out / key / "chosen.json").read_text()) if (out / key / "chosen.json").exists() else None
        if there != methods[key]["chosen"]:
            print(f"[device bench] {key}: chose {methods[key]['chosen']} here, {there} there: its final trials not used")
            continue
        final = phase_sweep(bench, key, "final", methods[key]["chosen"])
        trials = read_phase(out / key / "final", final) if (out / key / "final").is_dir() else []
        if not ended(trials, len(final.trials)):
            print(f"[device bench] {key}: tuned; {len(trials)} of its {len(final.trials)} final trials there, not all "
                  "ended: its final runs not recorded")
            continue
        parent, _ = log_trials(final, trials, uri, experiment, phase_tags(state["run_id"], final))
        runs, _ = load_runs(uri, experiment, parent, final.settings.target_accuracy)
        chosen = sorted({s for s in methods[key]["chosen"].values() if s is not None})
        assert missing_runs(runs, chosen, bench.settings.final_seeds) == 0, f"{key}: final runs missing in MLflow"
        record_final(state, [key], parent, runs, folder)
        print(f"[device bench] {key}: tuning and final runs recorded in {folder}")
    write_tables(load_bench(args.file, check_cluster=False), state, uri, folder)
    client(uri).set_terminated(state["run_id"], "FINISHED")  # as `fedsweep bench` ends it


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="step", required=True)
    r = sub.add_parser("run")
    r.add_argument("file")
    r.add_argument("--methods", required=True, help="comma-separated keys of the methods file, run in this order")
    r.add_argument("--out", required=True)
    r.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    r.add_argument("--time-box", type=float, default=float("inf"), help="seconds from the start; then stop after a round")
    r.add_argument("--device", default="cuda")
    r.add_argument("--no-stack", action="store_true")
    r.add_argument("--code", help="the commit the copy of the repository is at (it travels without .git)")
    r.add_argument("--output", default="docs/results/benchmark",
                   help="the benchmark's output folder: a method its state records as tuned is not run")
    lg = sub.add_parser("log")
    lg.add_argument("file")
    lg.add_argument("dir")
    lg.add_argument("--output", required=True, help="the benchmark's output folder (as fedsweep bench --output)")
    args = ap.parse_args(argv)
    {"run": run, "log": log}[args.step](args)


if __name__ == "__main__":
    main()
