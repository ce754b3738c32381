"""`fedsweep bench` (issue 34) on a tiny two-method, two-dataset benchmark, on a real Ray instance and MLflow
store: equal budgets, selection on validation only, fresh final seeds, the merged methods × datasets table,
and the checks a benchmark file gets before anything runs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from fedsweep.bench import BENCH_METRICS, choose, compact_markdown, load_bench, missing_runs
from fedsweep.cli import main
from fedsweep.config import ConfigError
from fedsweep.table import load_runs
from fedsweep.tracking import code_version
from tests.conftest import BASE, ROOT

METHODS = {"methods": {
    "fedavg": {"name": "fedavg", "local_lr": {"loguniform": [0.02, 0.5]}},
    "local": {"name": "local", "local_lr": {"loguniform": [0.02, 0.5]}},
}}


def bench_file(folder, name: str, partition: dict, **bench) -> str:
    raw = {
        "data": {"dataset": "digits", "num_clients": 4, "partition": partition, "validation_fraction": 0.25},
        "model": {"name": "mlp", "hidden": [8]},
        "rounds": 2,
        "eval_every": 1,
        "unseen_fraction": 0.25,  # client 3 never trains: the table's unseen column
        "tracking": {**BASE["tracking"], "experiment": "bench-test"},
        "sweep": {"name": name, "search": "random", "num_samples": 3, "seeds": [0], "select_on": "validation",
                  "max_concurrent_trials": 1, "storage_path": str(folder / "ray_results")},
        "bench": {"methods": "methods.yaml", "common": {"r": 1.0, "tau": 2, "batch_size": 16}, "final_seeds": [1, 2],
                  "budgets": [1], **bench},
    }
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return str(path)


@pytest.fixture
def files(tmp_path):
    (tmp_path / "methods.yaml").write_text(yaml.safe_dump(METHODS))
    return tmp_path, *(bench_file(tmp_path, "skew", {"name": "label_skew", "classes_per_client": 4}),
                      bench_file(tmp_path, "dirichlet", {"name": "dirichlet", "concentration": 0.5}))


def test_a_two_method_benchmark_tunes_equally_selects_on_validation_and_merges(ray_session, tracking_uri, files, monkeypatch,
                                                                                 capsys):
    folder, a, b = files
    out = folder / "results"
    assert main(["bench", a, b, "--output", str(out), "--quiet"]) == 0
    for name in ("skew", "dirichlet"):
        state = json.loads((out / name / "bench_state.json").read_text())
        assert sorted(state["methods"]) == ["fedavg", "local"]
        tune_run, final_run = {e["tune_run"] for e in state["methods"].values()}, {e["final_run"] for e in state["methods"].values()}
        assert len(tune_run) == len(final_run) == 1  # one tuning sweep and one final sweep for the methods
        tuning_all, _ = load_runs(tracking_uri, "bench-test", tune_run.pop())
        final_all, _ = load_runs(tracking_uri, "bench-test", final_run.pop())
        # a sweep stopped before its end returns without errors: the runs it owes are counted, not assumed
        owed = list(tuning_all["setting"].unique())
        assert missing_runs(tuning_all, owed, [0]) == 0 and missing_runs(tuning_all.iloc[1:], owed, [0]) == 1
        assert missing_runs(final_all, list(final_all["setting"].unique()), [1, 2, 3]) == final_all["setting"].nunique()
        for key, entry in state["methods"].items():
            tuning = tuning_all[tuning_all["algorithm"] == key]
            final = final_all[final_all["algorithm"] == key]
            # the same budget for every method: 3 settings, each on the tuning seed only
            assert tuning["setting"].nunique() == 3 and set(tuning["seed"]) == {0} and len(tuning) == 3
            # chosen on validation: the best val_ mean, and the same with every test number scrambled or gone
            best = tuning.groupby("setting")["val_personalized_accuracy_mean"].mean().idxmax()
            assert entry["chosen"]["3"] == best
            scrambled = tuning.copy()
            tests = [c for c in tuning.columns if c.startswith(("personalized_", "global_"))]
            scrambled[tests] = np.random.default_rng(0).permutation(scrambled[tests].to_numpy())
            assert choose(scrambled, "personalized_accuracy_mean", "max", 3) == best
            assert choose(tuning.drop(columns=tests), "personalized_accuracy_mean", "max", 3) == best
            # budget 1: the first setting the search tried
            assert entry["chosen"]["1"] == tuning.sort_values("trial")["setting"].iloc[0]
            # the chosen settings, exactly, each on the fresh seeds
            assert set(final["setting"]) == {entry["chosen"]["3"], entry["chosen"]["1"]}
            assert sorted(final["seed"]) == sorted([1, 2] * final["setting"].nunique())
        table = pd.read_csv(out / name / "table_b3.csv")
        assert sorted(table["algorithm"]) == ["fedavg", "local"] and set(table["seeds"]) == {2}
        assert (out / name / "ranking_b3.png").stat().st_size > 0 and (out / name / "table_b1.md").exists()
        assert (out / name / "table_b3.md").read_text().endswith(f"\nCode: every run at {code_version()} (the runs' `code` tag).\n")
        compact = (out / name / "compact.md").read_text().splitlines()
        assert len(compact) == 2 + 2 and compact[0].startswith("| rank | method | chosen setting (budget 3) |")
        assert "| unseen clients (%) |" in compact[0] and table["unseen_personalized_accuracy_mean mean"].notna().all()
    merged = pd.read_csv(out / "summary.csv")
    assert sorted(merged["algorithm"]) == ["fedavg", "local"]  # one row per method
    assert [c for c in merged.columns if c.endswith(" mean")] == ["skew mean", "dirichlet mean"]  # one column per dataset
    assert (out / "heatmap.png").stat().st_size > 0
    # the same merge from the saved runs alone, as `fedsweep table` gives it
    assert main(["table", "--from-runs", str(out / "skew" / "final_runs_b3.csv"),
                 "--from-runs", str(out / "dirichlet" / "final_runs_b3.csv"), "--format", "csv",
                 "--output", str(folder / "merged.csv"), "--heatmap", str(folder / "heatmap.png")]) == 0
    again = pd.read_csv(folder / "merged.csv")
    pd.testing.assert_frame_equal(again, merged)
    assert (folder / "heatmap.png").read_bytes() == (out / "heatmap.png").read_bytes()
    assert main(["table", "--from-runs", str(out / "skew" / "final_runs_b3.csv"), "--heatmap", str(folder / "one.png")]) == 2
    assert not (folder / "one.png").exists()

    # the same cell's phases run where Ray and MLflow are missing (benchmarks/device_bench.py, for a lent GPU machine),
    # then recorded here: the same choices and, bit for bit, the same tables; and how it records (check_recorded_cell)
    from tests.test_device_bench import check_recorded_cell, device_cell, table_numbers

    device = device_cell(a, folder / "there", folder / "device")
    ray = json.loads((out / "skew" / "bench_state.json").read_text())["methods"]
    for key in ("fedavg", "local"):
        assert device[key]["chosen"] == ray[key]["chosen"] and device[key]["tried"] == ray[key]["tried"] == 3
    for budget in (3, 1):
        pd.testing.assert_frame_equal(table_numbers(folder / "device" / "skew" / f"table_b{budget}.csv"),
                                      table_numbers(out / "skew" / f"table_b{budget}.csv"))
    check_recorded_cell(a, folder, device)

    # a finished benchmark resumed runs nothing more; run again without --resume, it is refused
    from mlflow import MlflowClient

    before = MlflowClient(tracking_uri).search_runs([MlflowClient(tracking_uri).get_experiment_by_name("bench-test").experiment_id])
    assert main(["bench", a, "--output", str(out), "--quiet", "--resume"]) == 0
    after = MlflowClient(tracking_uri).search_runs([MlflowClient(tracking_uri).get_experiment_by_name("bench-test").experiment_id])
    assert len(after) == len(before)
    # each benchmark's own MLflow run ended with its command (not left RUNNING), as a sweep's parent run does
    assert {r.info.status for r in after if r.data.tags.get("fedsweep.bench") == "true"} == {"FINISHED"}
    assert main(["bench", a, "--output", str(out), "--quiet"]) == 2
    # --methods runs one method, and the tables still hold every method of the file that has its final runs
    capsys.readouterr()
    assert main(["bench", a, "--output", str(out), "--quiet", "--resume", "--methods", "local"]) == 0
    # where the benchmark stands, said first: every method of the file counted, --methods or not
    assert f"[bench skew] {out / 'skew'}: 2 of the file's 2 methods done (their final runs recorded); this command: " \
           "nothing left to run" in capsys.readouterr().out
    assert sorted(pd.read_csv(out / "skew" / "table_b3.csv")["algorithm"]) == ["fedavg", "local"]
    assert "Not in this table" not in (out / "skew" / "table_b3.md").read_text()

    # a choice recorded by another selection rule (an older code's tie-break): --resume chooses again from the
    # tuning runs, records the rule's choice and runs that method's final runs again; the other method's stay
    path = out / "skew" / "bench_state.json"
    state = json.loads(path.read_text())
    local, fedavg = state["methods"]["local"], dict(state["methods"]["fedavg"])
    rule = local["chosen"]["3"]
    local["chosen"]["3"] = next(s for s in local["settings"] if s != rule)
    path.write_text(json.dumps(state))
    assert main(["bench", a, "--output", str(out), "--quiet", "--resume"]) == 0
    state = json.loads(path.read_text())
    assert state["methods"]["local"]["chosen"]["3"] == rule and state["methods"]["local"]["final_run"] != local["final_run"]
    assert state["methods"]["fedavg"] == fedavg
    for budget in (1, 3):  # each method's runs from its own final sweep: the earlier sweep's runs of a kept setting left out
        runs = pd.read_csv(out / "skew" / f"final_runs_b{budget}.csv")
        assert sorted(runs.groupby("algorithm")["seed"].apply(sorted).tolist()) == [[1, 2], [1, 2]], budget
        assert set(pd.read_csv(out / "skew" / f"table_b{budget}.csv")["seeds"]) == {2}

    # a run that an interrupted trial left marked stopped_early (fedsweep before 2026-11-26 so marked a trial that
    # Ctrl-C stopped, and took it for done on resume): --resume finds that phase incomplete and runs it again, for
    # that method only (bench_run._choose_again, which run_bench calls first): a tuning run of local's (tuned
    # again: choice and final runs dropped), a final run of fedavg's (its final runs only)
    from fedsweep.bench_run import _choose_again

    c = MlflowClient(tracking_uri)
    methods = json.loads(path.read_text())["methods"]
    tuned, _ = load_runs(tracking_uri, "bench-test", methods["local"]["tune_run"])
    finals, _ = load_runs(tracking_uri, "bench-test", methods["fedavg"]["final_run"])
    marked = [runs.loc[runs["algorithm"] == key, "run_id"].iloc[0] for runs, key in ((tuned, "local"), (finals, "fedavg"))]
    for run_id in marked:
        c.set_tag(run_id, "fedsweep.outcome", "stopped_early")
    _choose_again(load_bench(a), methods, tracking_uri, "bench-test", out / "skew")
    assert not {"chosen", "tune_run", "final_run"} & set(methods["local"])
    assert "final_run" not in methods["fedavg"] and methods["fedavg"]["chosen"] == state["methods"]["fedavg"]["chosen"]
    for run_id in marked:
        c.set_tag(run_id, "fedsweep.outcome", "finished")

    # the protocol edited after its run (one more round): the folder's results are of another protocol, so
    # --resume runs every method again instead of rewriting the tables from the old runs
    raw = yaml.safe_load(Path(a).read_text())
    raw["rounds"] = 3
    Path(a).write_text(yaml.safe_dump(raw, sort_keys=False))
    assert main(["bench", a, "--output", str(out), "--quiet", "--resume", "--methods", "local"]) == 0  # one suffices
    state = json.loads((out / "skew" / "bench_state.json").read_text())
    runs, _ = load_runs(tracking_uri, "bench-test", state["methods"]["local"]["final_run"])
    assert set(runs["param:rounds"]) == {"3"}
    # its table has no method with a global model: that column says so ("—") instead of failing
    row = (out / "skew" / "compact.md").read_text().splitlines()[2].split(" | ")
    assert row[1] == "local" and row[6] == "—"
    # fedavg's runs are of the old protocol (2 rounds): left out, and the table says why
    assert "Not in this table: fedavg: its settings changed since its runs; --resume runs it again." in (
        out / "skew" / "table_b3.md").read_text()

    # a final run deleted after its sweep ended: restored, Tune's saved sweep (ended) would run nothing, and every
    # resume would stop there; the phase runs again from the start instead
    c.delete_run(runs["run_id"].iloc[0])
    assert main(["bench", a, "--output", str(out), "--quiet", "--resume", "--methods", "local"]) == 0
    again = json.loads((out / "skew" / "bench_state.json").read_text())["methods"]["local"]
    assert again["final_run"] != state["methods"]["local"]["final_run"]
    rerun, _ = load_runs(tracking_uri, "bench-test", again["final_run"])
    assert missing_runs(rerun, sorted(set(again["chosen"].values())), [1, 2]) == 0

    # the folder carries its finished phases to another store (a new machine, a later session): --resume there runs
    # no trial, writes the same tables from the runs saved beside the state, and gives the benchmark a run there
    assert sorted(p.stem for p in (out / "dirichlet" / "runs").glob("*.csv")) == sorted(
        {e[phase] for e in json.loads((out / "dirichlet" / "bench_state.json").read_text())["methods"].values()
         for phase in ("tune_run", "final_run")})
    written = ("table_b*.*", "final_runs_b*.csv", "compact.md")  # every text file the tables are made of, byte for byte
    tables = {p.name: p.read_text() for pattern in written for p in (out / "dirichlet").glob(pattern)}
    # whatever order the state lists the methods in (a run appends those it adds; a file read back has them sorted)
    path = out / "dirichlet" / "bench_state.json"
    state = json.loads(path.read_text())
    path.write_text(json.dumps({**state, "methods": dict(reversed(state["methods"].items()))}))
    other = f"sqlite:///{folder / 'other.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", other)
    assert main(["bench", b, "--output", str(out), "--quiet", "--resume"]) == 0
    assert {p.name: p.read_text() for pattern in written for p in (out / "dirichlet").glob(pattern)} == tables
    there = MlflowClient(other).search_runs([MlflowClient(other).get_experiment_by_name("bench-test").experiment_id])
    assert [r.data.tags.get("fedsweep.bench") for r in there] == ["true"]  # the benchmark's own run, no trial
    state = json.loads((out / "dirichlet" / "bench_state.json").read_text())
    assert state["run_id"] == there[0].info.run_id and len(state["previous_run_ids"]) == 1

    # a folder written before 2026-11-26 kept no runs/, and its store is gone: a method added to the methods file
    # since then runs alone (--resume --methods), and the tables hold it beside the methods whose final runs the
    # folder's tables were made of, their rows as they were
    import shutil

    shutil.rmtree(out / "dirichlet" / "runs")
    as_text = {"dtype": str, "keep_default_na": False}
    old_runs, old_table = (pd.read_csv(out / "dirichlet" / f, **as_text) for f in ("final_runs_b3.csv", "table_b3.csv"))
    (folder / "methods.yaml").write_text(yaml.safe_dump({"methods": {
        **METHODS["methods"], "fedprox": {"name": "fedprox", "local_lr": {"loguniform": [0.02, 0.5]}}}}))
    third = f"sqlite:///{folder / 'third.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", third)
    assert main(["bench", b, "--output", str(out), "--quiet", "--resume", "--methods", "fedprox"]) == 0
    trials = [r for r in MlflowClient(third).search_runs([MlflowClient(third).get_experiment_by_name("bench-test").experiment_id])
              if "fedsweep.trial_index" in r.data.tags]
    assert {r.data.params["algorithm.name"] for r in trials} == {"fedprox"}  # no other method ran again
    runs, table = (pd.read_csv(out / "dirichlet" / f, **as_text) for f in ("final_runs_b3.csv", "table_b3.csv"))
    assert sorted(table["algorithm"]) == ["fedavg", "fedprox", "local"]
    for new, old in ((runs, old_runs), (table, old_table)):
        kept = new[new["algorithm"] != "fedprox"].reset_index(drop=True)
        pd.testing.assert_frame_equal(kept[old.columns], old)
    state = json.loads((out / "dirichlet" / "bench_state.json").read_text())["methods"]
    assert sorted(p.stem for p in (out / "dirichlet" / "runs").glob("*.csv")) == sorted(
        {state["fedprox"]["tune_run"], state["fedprox"]["final_run"]})


def test_a_change_of_seeds_reruns_the_phases_it_touches_and_a_table_leaves_out_and_names_runs_of_other_seeds(files, capsys):
    """bench_state.json records each method's seeds: tuning seeds changed, it is tuned again; final seeds changed, its
    final runs run again (the choice stays). Each reason a method is not in a table is written under it."""
    from fedsweep.bench_folder import absent_note
    from fedsweep.bench_run import _check_seeds, tabled

    folder, a, _ = files
    bench = load_bench(a, check_cluster=False)
    settings = {key: sorted(bench.sections[key]) for key in bench.tunes}
    done = {"chosen": {"3": "s1", "1": "s2"}, "tune_run": "t", "final_run": "f"}
    seeds = {"tuning": [0], "final": [1, 2]}  # the file's
    entry = {"settings": settings["local"], **done}
    _check_seeds(bench, "local", entry, folder)  # recorded before seeds were: taken as they are
    assert entry == {"settings": settings["local"], **done, "seeds": seeds}
    entry["seeds"] = {"tuning": [0], "final": [1, 2, 3]}
    _check_seeds(bench, "local", entry, folder)
    assert "final_run" not in entry and entry["chosen"] == done["chosen"] and entry["seeds"] == seeds
    entry.update(done, seeds={"tuning": [5], "final": [1, 2]})
    _check_seeds(bench, "local", entry, folder)
    assert not {"chosen", "tune_run", "final_run"} & set(entry) and entry["seeds"] == seeds
    err = capsys.readouterr().err
    assert "local: the final seeds are [1, 2] now, [1, 2, 3]" in err and "local: the tuning seeds are [0] now, [5]" in err

    methods = {"fedavg": {"settings": settings["fedavg"], "chosen": {"3": "x", "1": None}, "final_run": "f"}}
    note = absent_note(bench, methods, set(), 1)
    assert "fedavg: none of its first 1 settings finished on every tuning seed." in note
    assert "local: not tuned yet, or its tuning did not finish" in note
    methods["local"] = {"settings": settings["local"], "chosen": {"3": "y", "1": "y"}}
    assert "local: its final runs did not all finish" in absent_note(bench, methods, set(), 3)
    assert "fedavg: a final run of its chosen setting did not finish" in absent_note(bench, methods, set(), 3)
    assert absent_note(bench, methods, {"fedavg", "local"}, 3) == ""
    # a --methods run checks only its own methods' seeds: another method's runs on other seeds stay out of its tables
    methods["local"].update(final_run="f", seeds={"tuning": [0], "final": [1, 2, 3]})
    methods["fedavg"]["seeds"] = seeds
    assert list(tabled(bench, methods)) == ["fedavg"]
    assert "local: its seeds changed since its runs; --resume runs it again." in absent_note(bench, methods, {"fedavg"}, 3)
    methods["local"]["seeds"] = seeds
    assert list(tabled(bench, methods)) == ["fedavg", "local"]


def problems(path) -> str:
    with pytest.raises(ConfigError) as err:
        load_bench(path, check_cluster=False)
    return str(err.value)


def test_a_drawn_field_left_out_of_the_sections_at_its_default_is_labelled_with_it(tmp_path):
    """maml_steps at 1 stays out of the composed sections (setting keys and resumes unchanged); a method that draws it
    still labels every setting, 1 included."""
    (tmp_path / "methods.yaml").write_text(yaml.safe_dump({"methods": {
        "pfldyn": {"name": "pfldyn", "transform": "maml", "maml_steps": {"choice": [1, 5]}, "local_lr": {"loguniform": [0.02, 0.5]}}}}))
    raw = yaml.safe_load(Path(bench_file(tmp_path, "steps", {"name": "label_skew", "classes_per_client": 4})).read_text())
    raw["sweep"]["num_samples"] = 6
    raw["model"] = {"name": "mlp", "hidden": [8]}
    (tmp_path / "steps.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    bench = load_bench(tmp_path / "steps.yaml", check_cluster=False)
    labels = [bench.label("pfldyn", s) for s in bench.sections["pfldyn"]]
    assert {label.split(", ")[-1] for label in labels} == {"maml_steps=1", "maml_steps=5"}, labels
    assert all("maml_steps" not in section for section in bench.sections["pfldyn"].values() if section.get("maml_steps", 1) == 1)


@pytest.mark.parametrize("failed", [0, 1])
def test_a_sweep_stopped_before_its_end_stops_the_whole_benchmark(tracking_uri, files, monkeypatch, capsys, failed):
    """Ctrl-C ends a Tune run without an error; the benchmark must then stop, not go on to the next file. The
    sweep here is our own stand-in for a stopped one (its parent run in the real store, none of its trials run):
    what is tested is the benchmark's reaction, not Tune's."""
    from fedsweep import bench_run
    from fedsweep.tracking import client, ensure_experiment

    def stopped(sweep, resume, parent, verbose):
        experiment_id = ensure_experiment(tracking_uri, "bench-test")
        run = client(tracking_uri).create_run(experiment_id, tags={"fedsweep.sweep": "true"}).info.run_id
        return {"errors": failed, "interrupted": False, "parent_run_id": run, "restored": False}  # a failed trial as well: still more runs missing than failed

    monkeypatch.setattr(bench_run, "_run", stopped)
    folder, a, b = files
    out = folder / "results"
    assert main(["bench", a, b, "--output", str(out), "--quiet"]) == 130
    err = capsys.readouterr().err
    assert "[bench skew] the tuning sweep stopped with 6 of 6 runs missing" in err and "1 file(s) after it not started" in err
    state = json.loads((out / "skew" / "bench_state.json").read_text())
    assert "chosen" not in json.dumps(state)
    assert not (out / "dirichlet").exists()
    assert client(tracking_uri).get_run(state["run_id"]).info.status == "KILLED"  # the benchmark's run ends with it


def test_a_benchmark_file_that_would_give_unequal_budgets_is_refused_before_anything_runs(tmp_path):
    methods = {"methods": {
        "fedavg": {"name": "fedavg", "local_lr": {"grid": [0.05, 0.1]}},  # a grid: two points, more tries
        "local": {"name": "local", "local_lr": 0.05},  # nothing drawn: one setting run again
        "ditto": {"name": "ditto", "local_lr": {"loguniform": [0.01, 0.1]}, "r": 0.5},  # r is common's
        "fedprox": {"name": "fedprox", "mu": {"loguniform": [0.01, 1]}, "participation_rate": 0.5},  # r by its name
    }}
    (tmp_path / "methods.yaml").write_text(yaml.safe_dump(methods))
    path = bench_file(tmp_path, "bad", {"name": "iid"}, final_seeds=[0, 1], budgets=[3])
    text = problems(path)
    assert "methods.fedavg.local_lr: a grid gives this method more settings than the others" in text
    assert "methods.local: no distribution" in text
    assert "methods.ditto: r also in bench.common (as r)" in text
    assert "methods.fedprox: participation_rate also in bench.common (as r)" in text
    assert "bench.final_seeds: [0] also tune (sweep.seeds)" in text
    assert "bench.budgets: [3]; allowed: integers from 1 to sweep.num_samples - 1 (2)" in text

    # a space too small for the budget draws a setting twice: a smaller budget than the others'
    (tmp_path / "methods.yaml").write_text(yaml.safe_dump({"methods": {"fedprox": {"name": "fedprox", "mu": {"choice": [0.01]}}}}))
    assert "methods.fedprox: its space gave 1 distinct setting(s) in 3 draws" in problems(bench_file(tmp_path, "small", {"name": "iid"}))

    raw = yaml.safe_load(Path(path).read_text())
    raw["sweep"].update(search="optuna", select_on="test", scheduler={"asha": {"grace_rounds": 1}})
    raw["algorithm"] = {"name": "fedavg"}
    Path(path).write_text(yaml.safe_dump(raw))
    text = problems(path)
    assert "sweep.search: 'optuna' in a benchmark file; allowed: 'random'" in text
    assert "sweep.select_on: 'test' in a benchmark file; allowed: 'validation'" in text
    assert "algorithm: a benchmark file takes its methods from bench.methods" in text
    assert "sweep.scheduler: {'asha': {'grace_rounds': 1}} in a benchmark file; allowed: none" in text


def test_validate_checks_a_benchmark_file_as_bench_does(files, capsys):
    _, good, _ = files
    assert main(["validate", good]) == 0
    assert "OK — a benchmark of 2 method(s), 3 setting(s) each on seeds [0], the chosen one(s) on seeds [1, 2]" in capsys.readouterr().out
    raw = yaml.safe_load(Path(good).read_text())
    raw["bench"]["final_seeds"] = [0, 5]
    Path(good).write_text(yaml.safe_dump(raw))
    assert main(["validate", good]) == 2
    assert "bench.final_seeds: [0] also tune (sweep.seeds)" in capsys.readouterr().err


def test_the_shipped_benchmark_files_are_valid():
    files = sorted(Path("sweeps/benchmark").glob("*.yaml"))
    files = [f for f in files if f.name != "methods.yaml"]
    assert files
    keys = None
    for f in files:
        # each file runs itself (line 1: the shebang; git keeps the run bit)
        assert f.read_text().splitlines()[0] == "#!/usr/bin/env -S fedsweep bench" and os.access(f, os.X_OK), f
        bench = load_bench(f, check_cluster=False)
        budgets = {len(s.trials) // len(s.settings.seeds) for s in bench.tunes.values()}
        assert budgets == {bench.budgets[0]}, f  # the same number of settings for every method
        keys = keys or list(bench.tunes)
        assert list(bench.tunes) == keys  # every file: every method of the one methods file
        # a field added after results were recorded, at its default, is not in the composed sweeps' text, which a
        # resume matches (config.KEY_OMITS_AT_DEFAULT): adding one leaves a running benchmark resumable
        assert not {"maml_steps", "weight_decay", "clip_norm"} & {k for s in bench.sections.values() for d in s.values() for k in d}, f


def test_each_cnn_cell_is_its_mlp_cell_with_the_cnn_and_no_train_loss_and_nothing_else():
    cnn_files = sorted(Path("sweeps/benchmark").glob("*_cnn.yaml"))
    assert len(cnn_files) == 4  # the MNIST family: mnist and fmnist, both splits
    for f in cnn_files:
        cnn = yaml.safe_load(f.read_text())
        mlp = yaml.safe_load(f.with_name(f.name.replace("_cnn", "")).read_text())
        assert mlp["model"] == {"name": "mlp", "hidden": [100]}
        assert cnn.pop("model") == {"name": "cnn", "channels": [6, 16], "hidden": [120, 84]}, f
        assert cnn["sweep"].pop("name") == mlp["sweep"].pop("name") + "-cnn", f
        assert cnn.pop("tracking") == {**mlp.pop("tracking"), "log_train_loss": False}, f  # no table reads train_loss
        del mlp["model"]
        for cell in (cnn, mlp):  # the kernels a cell's runs were computed with (bench.kernels): each cell its own
            cell["bench"].pop("kernels", None)
        assert cnn == mlp, f


def test_each_cifar10_cpu_cut_is_its_full_cell_cut_where_it_says_and_nowhere_else():
    cuts = sorted(Path("sweeps/benchmark").glob("cifar10_*_cpu_cut.yaml"))
    assert [f.name for f in cuts] == ["cifar10_dirichlet_cpu_cut.yaml", "cifar10_pathological_cpu_cut.yaml"]
    for f in cuts:
        cut = yaml.safe_load(f.read_text())
        full = yaml.safe_load(f.with_name(f.name.replace("_cpu_cut", "")).read_text())
        assert full["model"] == {"name": "cnn", "channels": [64, 64], "hidden": [384, 192]}  # the PFL CNN
        assert cut["data"].pop("subsample") == 0.1 and "subsample" not in full["data"]
        assert (cut.pop("eval_every"), full.pop("eval_every")) == (25, 10)
        assert "resources" not in cut and full.pop("resources")["client_gpus"] > 0
        assert cut["sweep"].pop("name") == full["sweep"].pop("name") + "-cpu-cut"
        assert (cut["sweep"].pop("num_samples"), full["sweep"].pop("num_samples")) == (4, 16)
        assert (cut["sweep"].pop("max_concurrent_trials"), full["sweep"].pop("max_concurrent_trials")) == (2, 4)
        assert "budgets" not in cut["bench"] and full["bench"].pop("budgets") == [4]
        assert cut == full, f
        # the cut's 4 settings per method are the full cell's first 4 (its budget-4 draws)
        cut_bench, full_bench = load_bench(f, check_cluster=False), load_bench(f.with_name(f.name.replace("_cpu_cut", "")),
                                                                               check_cluster=False)
        for method, sweep in cut_bench.tunes.items():
            settings = [t.config.algorithm for t in sweep.trials]
            assert settings == [t.config.algorithm for t in full_bench.tunes[method].trials[:4]], method


def test_a_tie_on_validation_goes_to_the_setting_drawn_first():
    # two draws of one method that score the same (Synthetic gives β = 0.09309 and 0.09318 equal validation
    # accuracy): the earlier draw wins, whatever the settings' keys or the order the store returns the runs in
    for keys in (("zz", "aa"), ("aa", "zz")):
        runs = pd.DataFrame({"setting": [keys[1], keys[0], "mid"], "trial": [5, 2, 3], "outcome": ["finished"] * 3,
                             "val_personalized_accuracy_mean": [0.85, 0.85, 0.80]})
        assert choose(runs, "personalized_accuracy_mean", "max", 3) == keys[0]
        assert choose(runs.iloc[::-1], "personalized_accuracy_mean", "min", 3) == "mid"


def test_a_method_without_a_row_at_the_smaller_budget_gets_dashes_in_the_compact_table():
    """A method whose smaller-budget choice has no row (a final seed diverged, so that setting is not eligible)
    keeps its full-budget row, with "—" for the smaller budget's score and rank; the others keep theirs."""
    def table(rows):
        frame = pd.DataFrame([{"algorithm": a, "best setting": f"β={v}", **{f"{m} mean": v for m in BENCH_METRICS},
                               **{f"{m} ci95": 0.01 for m in BENCH_METRICS}} for a, v in rows])
        frame.attrs["mode"] = "max"
        return frame

    lines = compact_markdown({16: table([("ifca", 0.9), ("local", 0.8)]), 4: table([("local", 0.7)])},
                             "personalized_accuracy_mean").splitlines()
    assert lines[2].startswith("| 1 | ifca | β=0.9 | 90.00 ± 1.00 |") and lines[2].endswith("| — | — |")
    assert lines[3].endswith("| 70.00 ± 1.00 | 1 |")


def test_the_majority_class_baseline_is_each_clients_most_frequent_training_label(tmp_path):
    """``benchmarks/majority_baseline.py``: a client predicting its training part's most frequent label (the lowest on
    a tie); on the Synthetic cell, the figure docs/benchmark.md quotes beside the methods (81.75%), written to the CSV
    as the committed ``docs/results/benchmark/majority_baseline.csv`` holds it."""
    import pandas as pd
    import torch

    from benchmarks.majority_baseline import cell, main, majority_accuracies
    from fedsweep.client_data import ClientData

    def client(train, test):
        return ClientData(torch.zeros(len(train), 1), torch.tensor(train), torch.zeros(len(test), 1), torch.tensor(test))

    accs = majority_accuracies([client([2, 2, 1], [2, 1, 2, 0]), client([0, 1], [1, 1]), client([3], [3, 3, 3])])
    assert accs.tolist() == [0.5, 0.0, 1.0]
    row = cell(str(ROOT / "sweeps" / "benchmark" / "synthetic.yaml"))
    assert round(100 * row["mean"], 2) == 81.75 and round(100 * row["p10"], 2) == 55.88 and round(100 * row["worst"], 2) == 43.48
    main([str(ROOT / "sweeps" / "benchmark" / "synthetic.yaml"), "--output", str(tmp_path / "baseline.csv")])
    written = pd.read_csv(tmp_path / "baseline.csv")
    assert written.to_dict("records") == [{k: float(v) if k != "cell" else v for k, v in row.items()}]
    committed = pd.read_csv(ROOT / "docs" / "results" / "benchmark" / "majority_baseline.csv").set_index("cell")
    assert committed.loc[row["cell"]].to_dict() == {k: float(v) for k, v in row.items() if k != "cell"}

