"""`fedsweep table` on runs written to a real MLflow store by hand: the papers' metrics (best and worst
device, rounds and transmissions to a target accuracy) and rows split by a parameter."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedsweep.bench_folder import code_note, row_codes
from fedsweep.cli import main
from fedsweep.table import best_settings, ci95, load_runs, read_runs, save_runs, to_markdown
from fedsweep.tracking import TAG_PREFIX, client, ensure_experiment


def log_run(c, exp_id, algorithm, model, lr, seed, accs, per_round_tx=20):
    """A finished trial: accuracy per evaluation round (every 10 rounds), transmissions growing per round."""
    tags = {f"{TAG_PREFIX}algorithm": algorithm, f"{TAG_PREFIX}setting": f"{algorithm}|{model}|{lr}",
            f"{TAG_PREFIX}setting_label": f"lr={lr}", f"{TAG_PREFIX}seed": str(seed)}
    run = c.create_run(exp_id, tags=tags).info.run_id
    c.log_param(run, "model.name", model)
    c.log_param(run, "algorithm.local_lr", str(lr))
    for i, acc in enumerate(accs):
        rnd = 10 * i
        c.log_metric(run, "personalized_accuracy_mean", acc, step=rnd)
        c.log_metric(run, "personalized_accuracy_worst", acc - 0.2, step=rnd)
        c.log_metric(run, "personalized_accuracy_best", acc + 0.1, step=rnd)
        c.log_metric(run, "global_accuracy", acc - 0.05, step=rnd)
        c.log_metric(run, "transmissions", per_round_tx * rnd, step=rnd)
    c.set_terminated(run, "FINISHED")
    return run


@pytest.fixture
def store(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    c = client(uri)
    exp = ensure_experiment(uri, "table-test")
    # fedavg: lr 0.1 is the better setting; its seeds reach 0.8 at rounds 20, 30 and never.
    for seed, accs in enumerate([[0.1, 0.5, 0.8, 0.85], [0.1, 0.5, 0.7, 0.82], [0.1, 0.4, 0.6, 0.7]]):
        log_run(c, exp, "fedavg", "mlr", 0.1, seed, accs)
        log_run(c, exp, "fedavg", "mlr", 0.01, seed, [0.1, 0.2, 0.3, 0.4])
    # pfldyn on two models: mlp reaches 0.8 at round 10, mlr at round 30.
    for seed in range(3):
        log_run(c, exp, "pfldyn", "mlp", 0.1, seed, [0.2, 0.81, 0.9, 0.9], per_round_tx=40)
        log_run(c, exp, "pfldyn", "mlr", 0.1, seed, [0.2, 0.5, 0.7, 0.8], per_round_tx=40)
    return uri


def test_best_and_worst_device_and_rounds_to_target(store):
    runs, _ = load_runs(store, "table-test", target_accuracy=0.8)
    table = best_settings(runs, "personalized_accuracy_mean", "max").set_index("algorithm")
    fed = table.loc["fedavg"]
    assert fed["best setting"] == "lr=0.1" and fed["seeds"] == 3
    finals = np.array([0.85, 0.82, 0.7])
    assert fed["personalized_accuracy_mean mean"] == pytest.approx(finals.mean())
    assert fed["personalized_accuracy_mean ci95"] == pytest.approx(ci95(finals))
    assert fed["personalized_accuracy_worst mean"] == pytest.approx(finals.mean() - 0.2)
    assert fed["personalized_accuracy_best mean"] == pytest.approx(finals.mean() + 0.1)
    # two of three seeds reached 0.8: at rounds 20 and 30, after 400 and 600 transmissions
    assert fed["seeds reaching target"] == "2/3"
    assert fed["rounds_to_target mean"] == pytest.approx(25.0)
    assert fed["transmissions_to_target mean"] == pytest.approx(500.0)
    assert fed["rounds_to_target ci95"] == pytest.approx(ci95(np.array([20.0, 30.0])))
    text = to_markdown(table.reset_index())
    assert "seeds reaching target" in text and "| 2/3 |" in text


def test_target_never_reached_is_reported_not_hidden(store):
    runs, _ = load_runs(store, "table-test", target_accuracy=0.95)
    table = best_settings(runs, "personalized_accuracy_mean").set_index("algorithm")
    assert table.loc["fedavg", "seeds reaching target"] == "0/3"
    assert math.isnan(table.loc["fedavg", "rounds_to_target mean"])
    assert "not reached" in to_markdown(table.reset_index())


def test_rows_split_by_a_parameter(store):
    runs, _ = load_runs(store, "table-test", target_accuracy=0.8)
    table = best_settings(runs, "personalized_accuracy_mean", group_by=["model.name"]).set_index("algorithm")
    assert list(table.index) == ["fedavg (model.name=mlr)", "pfldyn (model.name=mlp)", "pfldyn (model.name=mlr)"]
    assert table.loc["pfldyn (model.name=mlp)", "rounds_to_target mean"] == 10.0
    assert table.loc["pfldyn (model.name=mlp)", "transmissions_to_target mean"] == 400.0
    assert table.loc["pfldyn (model.name=mlr)", "rounds_to_target mean"] == 30.0
    with pytest.raises(KeyError, match="not logged"):
        best_settings(runs, "personalized_accuracy_mean", group_by=["model.nope"])


def test_table_cli_target_and_group_by(store, capsys, tmp_path):
    assert main(["table", "--experiment", "table-test", "--tracking-uri", store, "--target-accuracy", "0.8",
                 "--group-by", "model.name"]) == 0
    out = capsys.readouterr().out
    assert "| pfldyn (model.name=mlp) | lr=0.1 | 1 | 3 |" in out and "rounds_to_target" in out
    assert main(["table", "--experiment", "table-test", "--tracking-uri", store, "--target-accuracy", "87.6"]) == 2
    assert "--target-accuracy: 87.6 is outside (0, 1]" in capsys.readouterr().err
    assert main(["table", "--experiment", "table-test", "--tracking-uri", store, "--group-by", "nope"]) == 2
    assert main(["table", "--experiment", "table-test", "--tracking-uri", "mongo://host/db"]) == 2
    assert "--tracking-uri (mongo://host/db): unknown scheme 'mongo'" in capsys.readouterr().err
    # a CSV holds the numbers; the table is printed beside, with what chose its settings
    csv = tmp_path / "t.csv"
    assert main(["table", "--experiment", "table-test", "--tracking-uri", store, "--select-on", "test", "--budget", "1",
                 "--format", "csv", "--output", str(csv)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Budget: each row's best of the first 1 settings its search tried") and "| pfldyn | lr=0.1 |" in out
    assert out.endswith(f"wrote 2 row(s) to {csv}\n") and len(csv.read_text().splitlines()) == 1 + 2


def test_mean_over_the_last_evaluations(store, capsys):
    runs, _ = load_runs(store, "table-test", last_evaluations=2)
    table = best_settings(runs, "personalized_accuracy_mean").set_index("algorithm")
    # fedavg lr 0.1: per seed the mean of its last two evaluations, then mean over seeds
    per_seed = np.array([(0.8 + 0.85) / 2, (0.7 + 0.82) / 2, (0.6 + 0.7) / 2])
    assert table.loc["fedavg", "personalized_accuracy_mean mean"] == pytest.approx(per_seed.mean())
    assert table.loc["fedavg", "personalized_accuracy_worst mean"] == pytest.approx(per_seed.mean() - 0.2)
    assert main(["table", "--experiment", "table-test", "--tracking-uri", store, "--last-evaluations", "0"]) == 2
    assert "--last-evaluations: 0" in capsys.readouterr().err


def test_max_over_rounds_ranks_and_reports_each_runs_best_round(tmp_path, capsys):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    c = client(uri)
    exp = ensure_experiment(uri, "peak-test")
    histories = {0.1: [[0.1, 0.9, 0.6], [0.1, 0.8, 0.7]], 0.01: [[0.1, 0.5, 0.75], [0.1, 0.6, 0.75]]}
    for lr, per_seed in histories.items():
        for seed, accs in enumerate(per_seed):
            run = log_run(c, exp, "pfedme", "mlr", lr, seed, accs)
            for i, acc in enumerate(accs):  # a metric outside REPORTED, ranked by as the pFedMe protocol does
                c.log_metric(run, "personalized_accuracy_weighted", acc, step=10 * i)
    final = best_settings(load_runs(uri, "peak-test")[0], "personalized_accuracy_weighted").iloc[0]
    assert final["best setting"] == "lr=0.01" and final["personalized_accuracy_weighted mean"] == pytest.approx(0.75)
    peak = best_settings(load_runs(uri, "peak-test", peak=True)[0], "personalized_accuracy_weighted").iloc[0]
    assert peak["best setting"] == "lr=0.1"  # best rounds 0.9 and 0.8, against 0.75 and 0.75
    assert peak["personalized_accuracy_weighted mean"] == pytest.approx(0.85)
    assert peak["personalized_accuracy_weighted ci95"] == pytest.approx(ci95(np.array([0.9, 0.8])))
    assert peak["global_accuracy mean"] == pytest.approx(0.85 - 0.05)
    # the mean over the last evaluations applies to the ranked metric too
    last2 = best_settings(load_runs(uri, "peak-test", last_evaluations=2)[0], "personalized_accuracy_weighted").iloc[0]
    assert last2["best setting"] == "lr=0.1"  # 0.75 and 0.75 against 0.625 and 0.675
    assert last2["personalized_accuracy_weighted mean"] == pytest.approx(np.mean([(0.9 + 0.6) / 2, (0.8 + 0.7) / 2]))
    assert main(["table", "--experiment", "peak-test", "--tracking-uri", uri, "--metric", "personalized_accuracy_weighted",
                 "--max-over-rounds"]) == 0
    assert "| pfedme | lr=0.1 | 2 | 2 | 85.00 ±" in capsys.readouterr().out
    assert main(["table", "--experiment", "peak-test", "--tracking-uri", uri, "--max-over-rounds",
                 "--last-evaluations", "3"]) == 2
    assert "--max-over-rounds and --last-evaluations exclude each other" in capsys.readouterr().err


def test_a_metric_a_method_does_not_have_is_a_dash_not_a_miss(store):
    """A method without a global model (Local, FedPer, FedBN, ...) logs no global_accuracy: its cell says so."""
    runs, _ = load_runs(store, "table-test", target_accuracy=0.95)
    table = best_settings(runs, "personalized_accuracy_mean").reset_index(drop=True)
    table.loc[0, ["global_accuracy mean", "global_accuracy ci95"]] = math.nan
    row = to_markdown(table).splitlines()[-len(table) :][0]
    head = to_markdown(table).splitlines()[-len(table) - 2].split(" | ")
    cells = row.split(" | ")
    assert cells[head.index("global_accuracy (%)")] == "—"
    assert cells[head.index("rounds_to_target")] == "not reached"


def test_a_table_rebuilds_from_its_saved_runs_without_the_store(store, tmp_path, capsys):
    """docs/results/: the runs behind a table saved as CSV (--runs-output) give the same table (--from-runs)."""
    saved = str(tmp_path / "runs.csv")
    args = ["--target-accuracy", "0.8", "--group-by", "model.name"]
    assert main(["table", "--experiment", "table-test", "--tracking-uri", store, "--runs-output", saved, *args]) == 0
    from_store = capsys.readouterr().out.split("\n", 1)[1]  # after the line saying what was saved
    assert main(["table", "--from-runs", saved, "--group-by", "model.name"]) == 0
    assert capsys.readouterr().out == from_store
    runs, _ = load_runs(store, "table-test", target_accuracy=0.8)
    read, _ = read_runs(saved)
    assert list(read.columns) == list(runs.columns) and len(read) == len(runs) == 12
    # saved runs and a store together: one methods × sources table, a column pair for each
    assert main(["table", "--from-runs", saved, "--experiment", "table-test", "--tracking-uri", store]) == 0
    merged = capsys.readouterr().out.splitlines()
    assert merged[2].split(" | ")[1:3] == ["runs", "table-test"]
    assert len(merged) == 4 + runs["algorithm"].nunique()
    assert main(["table", "--from-runs", saved, "--from-runs", saved, "--runs-output", saved]) == 2
    assert main(["table", "--from-runs", str(tmp_path / "none.csv")]) == 2
    assert "cannot be read as saved runs" in capsys.readouterr().err


def test_a_setting_missing_a_seeds_run_is_not_chosen_and_the_table_says_so():
    """A setting whose third seed crashed (or still runs) would be compared on its two seeds' mean with settings of
    three: it is not eligible, and the header counts it; a method that never logged the ranked metric (no global
    model) has no row, said, where it crashed the command before; a "|" in a label stays inside its cell."""
    import pandas as pd

    rows = [{"algorithm": "a", "setting": s, "setting_label": f"lr={s}|x", "seed": seed, "outcome": "finished",
             "trial": (i, 0), "personalized_accuracy_mean": v, "global_accuracy": v}
            for i, (s, seeds, v) in enumerate((("good", (0, 1, 2), 0.80), ("lucky", (0, 1), 0.95))) for seed in seeds]
    rows += [{"algorithm": "b", "setting": "s", "setting_label": "x", "seed": seed, "outcome": "finished", "trial": (0, 0),
              "personalized_accuracy_mean": 0.5, "global_accuracy": float("nan")} for seed in (0, 1, 2)]
    table = best_settings(pd.DataFrame(rows), "personalized_accuracy_mean").set_index("algorithm")
    assert table.loc["a", "best setting"] == "lr=good|x" and table.loc["a", "seeds"] == 3
    text = to_markdown(table.reset_index())
    assert "Not chosen, a seed's run missing (crashed, or still running): 1 setting(s) of a." in text
    assert "| a | lr=good\\|x | 2 | 3 |" in text
    by_global = best_settings(pd.DataFrame(rows), "global_accuracy")
    assert list(by_global["algorithm"]) == ["a"] and by_global.attrs["unranked"] == ["b"]
    assert "No value of global_accuracy, so no row: b." in to_markdown(by_global)


def test_a_merged_table_refuses_a_source_twice_and_sources_ranked_otherwise(tmp_path, capsys):
    import json

    from fedsweep.table import save_runs

    runs = read_runs_of_hand(tmp_path)
    for name, metric in (("one", "personalized_accuracy_mean"), ("two", "personalized_accuracy_weighted")):
        save_runs(runs, {"fedsweep.metric": metric, "fedsweep.bench": name}, str(tmp_path / f"{name}.csv"))
    same = ["table", "--from-runs", str(tmp_path / "one.csv"), "--from-runs", str(tmp_path / "one.csv")]
    assert main(same) == 2 and "one given more than once" in capsys.readouterr().err
    mixed = ["table", "--from-runs", str(tmp_path / "one.csv"), "--from-runs", str(tmp_path / "two.csv")]
    assert main(mixed) == 2 and "rank by different metrics or modes" in capsys.readouterr().err
    assert main([*mixed, "--metric", "personalized_accuracy_mean", "--mode", "max"]) == 0
    assert json.loads((tmp_path / "two.csv.tags.json").read_text())["fedsweep.bench"] == "two"


def read_runs_of_hand(tmp_path):
    import pandas as pd

    return pd.DataFrame([{"run_id": f"r{seed}", "algorithm": "a", "setting": "s", "setting_label": "x", "seed": seed,
                          "outcome": "finished", "platform": "", "code": "", "trial": (0, 0),
                          "personalized_accuracy_mean": 0.5, "personalized_accuracy_weighted": 0.5} for seed in (0, 1, 2)])


def test_a_setting_and_seed_run_by_two_sweeps_counts_once_its_latest_run():
    """Read without --sweep-run, an experiment's sweeps are pooled: a (setting, seed) that two sweeps ran would count
    as two seeds and narrow the CI. The latest run of each counts, and the header says how many were set aside."""
    import pandas as pd

    rows = [{"algorithm": "a", "setting": "s", "setting_label": "x", "seed": seed, "outcome": "finished",
             "trial": (0, start), "personalized_accuracy_mean": v}
            for start, values in ((1, (0.5, 0.6)), (2, (0.7, 0.8))) for seed, v in enumerate(values)]
    table = best_settings(pd.DataFrame(rows), "personalized_accuracy_mean")
    assert table.loc[0, "seeds"] == 2 and table.loc[0, "personalized_accuracy_mean mean"] == pytest.approx(0.75)
    assert table.loc[0, "personalized_accuracy_mean ci95"] == pytest.approx(ci95(np.array([0.7, 0.8])))
    assert "2 run(s) repeated a (setting, seed) another run of these sweeps had" in to_markdown(table)


def test_a_tie_goes_to_the_setting_tried_first_as_in_bench():
    """Two settings with the same mean: the one tried first is chosen (``fedsweep bench``'s rule, ``bench.choose``),
    not the one whose key sorts first; with validation, whatever the test metric says."""
    import pandas as pd

    from fedsweep.bench import choose

    rows = [{"algorithm": "a", "setting": s, "setting_label": s, "seed": seed, "outcome": "finished", "trial": (i, i),
             "personalized_accuracy_mean": t, "val_personalized_accuracy_mean": 0.5}
            for i, (s, t) in enumerate((("zz", 0.1), ("aa", 0.9))) for seed in (0, 1)]
    runs = pd.DataFrame(rows)
    for select_on in ("validation", "test"):
        expected = "zz" if select_on == "validation" else "aa"  # on test the means differ
        assert best_settings(runs, "personalized_accuracy_mean", select_on=select_on).loc[0, "setting key"] == expected
    assert choose(runs, "personalized_accuracy_mean", "max", 2) == "zz"
    runs["personalized_accuracy_mean"] = 0.5
    assert best_settings(runs, "personalized_accuracy_mean").loc[0, "setting key"] == "zz"
    assert best_settings(runs, "personalized_accuracy_mean", mode="min").loc[0, "setting key"] == "zz"
    # a setting drawn again later (a random search's repeat; pooled sweeps) was still tried first: its latest runs
    # count, its first draw orders it, with and without a budget
    again = pd.concat([runs, runs.loc[runs["setting"] == "zz"].assign(trial=[(2, 2)] * 2)], ignore_index=True)
    for budget in (None, 1):
        assert best_settings(again, "personalized_accuracy_mean", budget=budget).loc[0, "setting key"] == "zz"
        assert choose(again, "personalized_accuracy_mean", "max", budget or 3) == "zz"


def test_a_tables_code_line_names_each_commit_with_the_methods_it_ran():
    """A method run again alone at a later commit, or a phase resumed after one, is named with its commits; the
    largest group of more than six is counted, not listed."""
    many = {f"m{i}": {"aaa"} for i in range(7)}
    assert code_note(many) == "\nCode: every run at aaa (the runs' `code` tag).\n"
    assert code_note({**many, "fedamp": {"bbb"}, "x": {"aaa", "bbb"}}) == (
        "\nCode (the runs' `code` tag; tuning and final runs): bbb: fedamp; aaa and bbb: x; aaa: the 7 other methods.\n")
    assert code_note({"a": {"aaa"}, "b": {"bbb"}, "c": set()}) == (
        "\nCode (the runs' `code` tag; tuning and final runs): aaa: a; bbb: b; no runs saved: c.\n")
    # one group with runs of unknown code is not "every run at" its commit
    assert code_note({"a": {"aaa", "tuning runs not saved"}, "b": {"aaa", "tuning runs not saved"}}) == (
        "\nCode (the runs' `code` tag; tuning and final runs): aaa and tuning runs not saved, every method.\n")
    assert code_note({"a": {"aaa", "no `code` tag"}}) == (
        "\nCode (the runs' `code` tag; tuning and final runs): aaa and no `code` tag, every method.\n")


def test_a_tables_code_line_counts_the_runs_behind_its_budget_only(tmp_path):
    """At budget B a row is made of the method's first B tuning settings (draw order) and its choice's final runs:
    a later setting's commit, or another budget's choice, is not named; a phase without a saved copy, or runs
    without the tag, are said as such."""
    import pandas as pd

    (tmp_path / "runs").mkdir()
    tuning = pd.DataFrame({"setting": ["s2", "s1", "s3", "t1"], "trial": [(1, 0), (0, 0), (2, 0), (0, 0)],
                           "seed": 0, "code": ["aaa", "aaa", "ccc", ""]})
    save_runs(tuning, {}, str(tmp_path / "runs" / "tune.csv"))
    final = pd.DataFrame({"setting": ["s1", "s1", "s3", "t1"], "seed": [1, 2, 1, 1], "code": ["bbb", "bbb", "ddd", ""]})
    done = {"m": {"tune_run": "tune", "settings": ["s1", "s2", "s3"], "chosen": {"2": "s1", "3": "s3"}},
            "t": {"tune_run": "tune", "settings": ["t1"], "chosen": {"2": "t1", "3": "t1"}},
            "u": {"tune_run": "gone", "settings": ["u1"], "chosen": {"2": "u1", "3": None}}}
    assert row_codes(tmp_path, done, final, [2, 3])[2] == {"m": {"aaa", "bbb"}, "t": {"no `code` tag"}, "u": {"tuning runs not saved"}}
    assert row_codes(tmp_path, done, final, [2, 3])[3] == {"m": {"aaa", "ccc", "ddd"}, "t": {"no `code` tag"}}
    assert code_note({"t": {"no `code` tag"}}) == "\nCode: not recorded (no run has a `code` tag).\n"
