"""Fair tuning (issue 24): a validation part held out of each client's training data, settings selected on
it and reported on test; selection on test stays what it was."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
import yaml

from fedsweep.cli import main
from fedsweep.config import ConfigError
from fedsweep.data import build_federated_dataset, partitions
from fedsweep.engine import run_local
from fedsweep.evaluation import VAL
from fedsweep.loading import load_sweep, validate
from fedsweep.table import best_settings, load_runs, to_markdown
from fedsweep.tracking import TAG_PREFIX, client, ensure_experiment
from tests.conftest import BASE, config_dict

SYNTHETIC = {"dataset": "synthetic", "num_clients": 8, "max_samples_per_client": 80}


def test_validation_split_is_stratified_seeded_and_never_empty():
    labels = np.repeat([0, 1, 2], [50, 30, 20])
    keep, val = partitions.validation_split(labels, 0.2, np.random.default_rng(0))
    assert len(val) == 20 and len(keep) == 80 and not set(keep) & set(val)
    assert Counter(labels[val].tolist()) == {0: 10, 1: 6, 2: 4}  # each label its share
    again = partitions.validation_split(labels, 0.2, np.random.default_rng(0))
    assert np.array_equal(val, again[1])
    for n, fraction in ((2, 0.01), (2, 0.99), (3, 0.5)):  # at least one held out, at least one kept
        keep, val = partitions.validation_split(np.zeros(n, np.int64), fraction, np.random.default_rng(0))
        assert len(val) >= 1 and len(keep) >= 1
    # remainders go to the labels with the largest fractional parts; the total is exact
    keep, val = partitions.validation_split(np.repeat([0, 1, 2], [3, 3, 4]), 0.5, np.random.default_rng(1))
    assert len(val) == 5


def test_the_validation_part_comes_out_of_the_training_part_and_the_test_part_is_unchanged():
    from fedsweep.data import SyntheticConfig

    plain = build_federated_dataset(SyntheticConfig(**SYNTHETIC))
    held = build_federated_dataset(SyntheticConfig(**SYNTHETIC, validation_fraction=0.25))
    for a, b in zip(plain.clients, held.clients):
        assert b.num_train + b.num_val == a.num_train and b.num_val == max(1, round(0.25 * a.num_train))
        assert np.array_equal(a.x_test.numpy(), b.x_test.numpy())
        rows = {r.tobytes() for r in a.x_train.numpy()}
        assert all(r.tobytes() in rows for x in (b.x_train, b.x_val) for r in x.numpy())
        assert not {r.tobytes() for r in b.x_train.numpy()} & {r.tobytes() for r in b.x_val.numpy()}


def test_val_metrics_each_evaluation_and_none_without_a_validation_part():
    body = {"seed": 1, "data": {**SYNTHETIC}, "model": {"name": "mlr"}, "rounds": 4, "eval_every": 2,
            "algorithm": {"name": "perfedavg", "participation_rate": 0.5, "local_steps": 2, "personalization_lr": 0.01,
                          "local_lr": 0.05}}
    history, _ = run_local(validate(body))
    assert not any(k.startswith(VAL) for m in history for k in m)
    body["data"]["validation_fraction"] = 0.3
    history, _ = run_local(validate(body))
    evaluated = [m for m in history if "global_accuracy" in m]
    assert [m["round"] for m in evaluated] == [0, 2, 4]
    for m in evaluated:
        assert {VAL + k for k in m if k.startswith(("personalized_", "global_"))} <= set(m)
        assert 0 <= m[VAL + "personalized_accuracy_mean"] <= 1


def test_a_sweep_ranked_by_the_train_loss_must_measure_it_in_every_trial(tmp_path):
    body = config_dict(tracking={"log_train_loss": False})
    body["sweep"] = {"metric": "train_loss", "mode": "min", "seeds": [0, 1]}
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(body))
    with pytest.raises(ConfigError, match=r"s.yaml:\d+: sweep.metric: 'train_loss' is not measured with "
                                          r"tracking.log_train_loss: false; allowed: log_train_loss: true, or another metric"):
        load_sweep(tmp_path / "s.yaml", check_cluster=False)
    body["sweep"]["metric"] = "global_loss"
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(body))
    assert len(load_sweep(tmp_path / "s.yaml", check_cluster=False).trials) == 2


def test_select_on_validation_needs_a_validation_part_in_every_trial(tmp_path):
    body = config_dict(data={"validation_fraction": {"grid": [0.0, 0.2]}})
    body["sweep"] = {"select_on": "validation"}
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(body))
    with pytest.raises(ConfigError, match=r"sweep.select_on: 'validation' needs a validation part in every trial, "
                                          r"but data.validation_fraction is 0 in 1 of 2"):
        load_sweep(tmp_path / "s.yaml", check_cluster=False)
    body["sweep"]["select_on"] = "holdout"
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(body))
    with pytest.raises(ConfigError, match=r"sweep.select_on: Input should be 'test' or 'validation'"):
        load_sweep(tmp_path / "s.yaml", check_cluster=False)


def _log(c, exp, lr, seed, test, val):
    run = c.create_run(exp, tags={f"{TAG_PREFIX}algorithm": "fedavg", f"{TAG_PREFIX}setting": f"lr={lr}",
                                  f"{TAG_PREFIX}setting_label": f"local_lr={lr}", f"{TAG_PREFIX}seed": str(seed)}).info.run_id
    for key, value in (("personalized_accuracy_mean", test), (VAL + "personalized_accuracy_mean", val), ("global_accuracy", test)):
        c.log_metric(run, key, value, step=10)
    c.set_terminated(run, "FINISHED")


def test_selection_on_validation_reports_the_test_numbers_of_the_setting_validation_chose(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    c, exp = client(uri), ensure_experiment(uri, "crafted")
    for seed in (0, 1):  # lr 0.3 is best on test, lr 0.1 on validation
        _log(c, exp, 0.3, seed, test=0.80 + 0.02 * seed, val=0.70)
        _log(c, exp, 0.1, seed, test=0.75 + 0.02 * seed, val=0.72)
    runs, _ = load_runs(uri, "crafted")
    on_test = best_settings(runs, "personalized_accuracy_mean")
    on_val = best_settings(runs, "personalized_accuracy_mean", select_on="validation")
    assert on_test["best setting"].tolist() == ["local_lr=0.3"] and on_val["best setting"].tolist() == ["local_lr=0.1"]
    assert on_val["personalized_accuracy_mean mean"].iloc[0] == pytest.approx(0.76)  # lr 0.1's test mean
    assert on_val[VAL + "personalized_accuracy_mean mean"].iloc[0] == pytest.approx(0.72)
    assert "Settings selected on validation" in to_markdown(on_val) and "selected on" not in to_markdown(on_test)
    with pytest.raises(KeyError, match="select on validation needs runs with data.validation_fraction > 0"):
        best_settings(runs.drop(columns=[VAL + "personalized_accuracy_mean"]), "personalized_accuracy_mean", select_on="validation")


@pytest.mark.ray
def test_a_real_sweep_where_validation_and_test_pick_different_settings(ray_session, tmp_path, capsys):
    """Two learning rates × two seeds on Synthetic with a 30% validation part: the test data would pick
    local_lr = 0.3, the validation parts pick 0.1 (found once; same seeds, same numbers). The sweep selects
    on validation: its table reports lr 0.1's test accuracy, and says how it chose."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    body = {
        "data": {**SYNTHETIC, "validation_fraction": 0.3}, "model": {"name": "mlr"}, "rounds": 5, "eval_every": 5,
        "algorithm": {"name": "fedavg", "participation_rate": 0.5, "local_steps": 5, "batch_size": 10,
                      "local_lr": {"grid": [0.1, 0.3]}},
        "resources": {"server_cpus": 0.2, "client_cpus": 0.3, "client_workers": 1},
        "tracking": {**BASE["tracking"], "experiment": "fair", "tracking_uri": uri},
        "sweep": {"name": "fair", "seeds": [0, 1], "max_concurrent_trials": 2, "select_on": "validation",
                  "storage_path": str(tmp_path / "ray_results")},
    }
    (tmp_path / "fair.yaml").write_text(yaml.safe_dump(body))
    assert main(["sweep", str(tmp_path / "fair.yaml"), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "by final val_personalized_accuracy_mean" in printed and "Settings selected on validation" in printed
    runs, tags = load_runs(uri, "fair")
    assert tags[f"{TAG_PREFIX}select_on"] == "validation" and len(runs) == 4
    means = runs.groupby("param:algorithm.local_lr")[["personalized_accuracy_mean", VAL + "personalized_accuracy_mean"]].mean()
    assert means["personalized_accuracy_mean"].idxmax() == "0.3" and means[VAL + "personalized_accuracy_mean"].idxmax() == "0.1"
    table = best_settings(runs, "personalized_accuracy_mean", select_on="validation")
    assert table["best setting"].tolist() == ["local_lr=0.1"]
    assert table["personalized_accuracy_mean mean"].iloc[0] == pytest.approx(means.loc["0.1", "personalized_accuracy_mean"])
    # `fedsweep table` follows the sweep's choice, and can be asked for the other
    assert main(["table", "--experiment", "fair", "--tracking-uri", uri]) == 0
    assert "| fedavg | local_lr=0.1 |" in capsys.readouterr().out
    assert main(["table", "--experiment", "fair", "--tracking-uri", uri, "--select-on", "test"]) == 0
    assert "| fedavg | local_lr=0.3 |" in capsys.readouterr().out


def _search_body(tmp_path, name: str, algorithm: dict, sweep: dict, rounds: int) -> dict:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    return {
        "data": {**SYNTHETIC}, "model": {"name": "mlr"}, "rounds": rounds, "eval_every": 2,
        "algorithm": {"name": "fedavg", "participation_rate": 0.5, "local_steps": 5, "batch_size": 10, **algorithm},
        "resources": {"server_cpus": 0.2, "client_cpus": 0.3, "client_workers": 1},
        "tracking": {**BASE["tracking"], "experiment": name, "tracking_uri": uri},
        "sweep": {"name": name, "max_concurrent_trials": 2, "storage_path": str(tmp_path / "ray_results"), **sweep},
    }


def test_a_random_search_draws_the_same_settings_from_the_same_file_and_validates_them(tmp_path):
    body = _search_body(tmp_path, "random", {"local_lr": {"loguniform": [0.001, 1.0]}, "local_steps": {"randint": [1, 4]},
                                             "aggregation": {"choice": ["weighted", "uniform"]}},
                        {"search": "random", "num_samples": 8, "seeds": [0, 1]}, 4)
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(body))
    first, again = (load_sweep(tmp_path / "r.yaml", check_cluster=False) for _ in range(2))
    assert [t.overrides for t in first.trials] == [t.overrides for t in again.trials]
    assert len(first.trials) == 16 and len({t.config.setting_key() for t in first.trials}) == 8  # each drawn setting × 2 seeds
    for t in first.trials:
        a = t.config.algorithm
        assert 0.001 <= a.local_lr <= 1.0 and 1 <= a.local_steps <= 4 and a.aggregation in ("weighted", "uniform")
        assert t.overrides["algorithm.local_lr"] == a.local_lr and t.overrides["algorithm.local_steps"] == a.local_steps
    assert len({t.config.algorithm.local_steps for t in first.trials}) > 1
    body["sweep"]["search_seed"] = 1
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(body))
    assert [t.overrides for t in load_sweep(tmp_path / "r.yaml", check_cluster=False).trials] != [t.overrides for t in first.trials]
    # bad bounds and a distribution without a random search are refused before anything starts, naming the field
    for bad, message in (({"loguniform": [0.0, 1.0]}, r"algorithm.local_lr: loguniform takes \[low, high\] with 0 < low < high, got low=0.0"),
                         ({"uniform": [1.0, 0.5]}, r"algorithm.local_lr: uniform takes .* got low=1.0 >= high=0.5"),
                         ({"randint": [1.5, 3]}, r"algorithm.local_lr: randint takes \[low, high\], integers")):
        body["algorithm"]["local_lr"] = bad
        (tmp_path / "r.yaml").write_text(yaml.safe_dump(body))
        with pytest.raises(ConfigError, match=message):
            load_sweep(tmp_path / "r.yaml", check_cluster=False)
    body["sweep"] = {"name": "random"}
    body["algorithm"]["local_lr"] = {"uniform": [0.1, 0.5]}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(body))
    with pytest.raises(ConfigError, match=r"algorithm.local_lr: a distribution \(uniform\) is drawn by a search; allowed: sweep.search: random or optuna"):
        load_sweep(tmp_path / "r.yaml", check_cluster=False)


@pytest.mark.ray
def test_a_random_search_of_8_samples_runs_each_drawn_setting_as_one_mlflow_run(ray_session, tmp_path):
    body = _search_body(tmp_path, "random", {"local_lr": {"loguniform": [0.01, 1.0]}, "local_steps": {"randint": [1, 6]}},
                        {"search": "random", "num_samples": 8, "search_seed": 7}, 4)
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(body))
    sweep = load_sweep(tmp_path / "r.yaml")
    from fedsweep.sweep import run_sweep

    out = run_sweep(sweep, verbose=0)
    assert out["errors"] == 0
    runs, tags = load_runs(out["tracking_uri"], "random", out["parent_run_id"])
    assert tags[f"{TAG_PREFIX}search"] == "random" and len(runs) == 8
    logged = sorted((float(r["param:algorithm.local_lr"]), int(r["param:algorithm.local_steps"])) for _, r in runs.iterrows())
    drawn = sorted((t.config.algorithm.local_lr, t.config.algorithm.local_steps) for t in sweep.trials)
    assert logged == drawn


@pytest.mark.ray
def test_asha_stops_bad_settings_early_and_the_table_never_picks_one(ray_session, tmp_path, capsys):
    """8 learning rates from 0.5 down to 1e-4 (learns next to nothing), 16 rounds, ASHA from round 2 halving: some
    trials stop early; their runs end FINISHED, marked stopped_early; fewer rounds are run than the grid's."""
    lrs = [0.5, 0.2, 0.05, 0.01, 0.003, 0.001, 0.0003, 0.0001]  # the good ones first: ASHA compares with those before
    body = _search_body(tmp_path, "asha", {"local_lr": {"grid": lrs}},
                        {"scheduler": {"asha": {"grace_rounds": 2, "reduction_factor": 2}}}, 16)
    (tmp_path / "a.yaml").write_text(yaml.safe_dump(body))
    assert main(["sweep", str(tmp_path / "a.yaml"), "--quiet"]) == 0
    printed = capsys.readouterr().out
    uri = body["tracking"]["tracking_uri"]
    c = client(uri)
    exp = c.get_experiment_by_name("asha").experiment_id
    trials = [r for r in c.search_runs([exp]) if "mlflow.parentRunId" in r.data.tags]
    assert len(trials) == 8 and {r.info.status for r in trials} == {"FINISHED"}
    rounds_run = {r.data.params["algorithm.local_lr"]: max(m.step for m in c.get_metric_history(r.info.run_id, "uploads"))
                  for r in trials}
    stopped = {r.data.params["algorithm.local_lr"] for r in trials if r.data.tags[f"{TAG_PREFIX}outcome"] == "stopped_early"}
    assert stopped and all(rounds_run[lr] < 16 for lr in stopped)
    assert all(rounds_run[lr] == 16 for lr in set(rounds_run) - stopped)
    assert sum(rounds_run.values()) < 8 * 16
    runs, _ = load_runs(uri, "asha")
    table = best_settings(runs, "personalized_accuracy_mean")
    best_lr = table["best setting"].iloc[0].split("=")[1]
    assert best_lr not in stopped and table["stopped early"].iloc[0] == len(stopped)
    assert "stopped early" in printed
    # the Tune scheduler saw the same thing: the stopped trials' last results are before round 16
    parent = next(r for r in c.search_runs([exp]) if r.data.tags.get(f"{TAG_PREFIX}sweep") == "true")
    assert json.loads(parent.data.tags[f"{TAG_PREFIX}scheduler"]) == {"asha": {"grace_rounds": 2, "reduction_factor": 2.0}}
    # tracking.log_plot off (the tests' default): the sweep report's tables, none of its figures
    assert sorted(a.path for a in c.list_artifacts(parent.info.run_id, "report")) == [
        "report/table.csv", "report/table.md", "report/table.parquet"]


def test_a_scheduler_that_could_stop_nothing_is_refused(tmp_path):
    body = _search_body(tmp_path, "asha", {"local_lr": {"grid": [0.1, 0.2]}}, {"scheduler": {"asha": {"grace_rounds": 4}}}, 4)
    (tmp_path / "a.yaml").write_text(yaml.safe_dump(body))
    with pytest.raises(ConfigError, match=r"sweep.scheduler.asha.grace_rounds: 4, but 2 trial\(s\) run 4 round\(s\) or fewer"):
        load_sweep(tmp_path / "a.yaml", check_cluster=False)
    body["sweep"]["scheduler"] = {"asha": {"grace_rounds": 1, "reduction_factor": 1}}
    (tmp_path / "a.yaml").write_text(yaml.safe_dump(body))
    with pytest.raises(ConfigError, match=r"sweep.scheduler.asha.reduction_factor: Input should be greater than 1"):
        load_sweep(tmp_path / "a.yaml", check_cluster=False)


def test_a_budget_chooses_among_the_first_settings_each_algorithm_tried(tmp_path, capsys):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    c, exp = client(uri), ensure_experiment(uri, "budget")
    order = 0
    for lr, acc in ((0.1, 0.70), (0.2, 0.75), (0.3, 0.90)):  # the best setting is the third tried
        for seed in (0, 1):
            run = c.create_run(exp, tags={f"{TAG_PREFIX}algorithm": "fedavg", f"{TAG_PREFIX}setting": f"lr={lr}",
                                          f"{TAG_PREFIX}setting_label": f"local_lr={lr}", f"{TAG_PREFIX}seed": str(seed),
                                          f"{TAG_PREFIX}trial_index": str(order)}).info.run_id
            order += 1
            c.log_metric(run, "personalized_accuracy_mean", acc + 0.01 * seed, step=4)
            c.set_terminated(run, "FINISHED")
    runs, _ = load_runs(uri, "budget")
    assert best_settings(runs, "personalized_accuracy_mean")["best setting"].tolist() == ["local_lr=0.3"]
    two = best_settings(runs, "personalized_accuracy_mean", budget=2)
    assert two["best setting"].tolist() == ["local_lr=0.2"] and two["settings tried"].tolist() == [2]
    assert main(["table", "--experiment", "budget", "--tracking-uri", uri, "--budget", "1"]) == 0
    out = capsys.readouterr().out
    assert "| fedavg | local_lr=0.1 | 1 |" in out and "Budget: each row's best of the first 1 settings" in out
    assert main(["table", "--experiment", "budget", "--tracking-uri", uri, "--budget", "0"]) == 2


def _optuna_file(tmp_path, name: str, **sweep) -> str:
    body = _search_body(tmp_path, name, {"local_lr": {"loguniform": [0.01, 1.0]}, "local_steps": {"randint": [1, 6]}},
                        {"search": "optuna", "num_samples": 8, "seeds": [0, 1], "select_on": "validation", **sweep}, 2)
    body["data"]["validation_fraction"] = 0.3
    (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(body))
    return str(tmp_path / f"{name}.yaml")


@pytest.mark.ray
def test_an_optuna_search_of_8_samples_runs_reproducibly_each_setting_on_every_seed(ray_session, tmp_path):
    """The study draws 8 settings; each is run on both seeds, one MLflow run per seed with the drawn values as
    params; the same file (same search_seed) draws the same settings again."""
    from fedsweep.sweep import run_sweep

    drawn = []
    for attempt in ("first", "again"):
        (tmp_path / attempt).mkdir()
        sweep = load_sweep(_optuna_file(tmp_path / attempt, "optuna"))
        assert sweep.describe().startswith("an Optuna search of 8 setting(s) for each of 1 grid point(s), each on 2 seed(s)")
        out = run_sweep(sweep, verbose=0)
        assert out["errors"] == 0 and len(out["results"]) == 8
        runs, tags = load_runs(out["tracking_uri"], "optuna", out["parent_run_id"])
        assert tags[f"{TAG_PREFIX}search"] == "optuna" and len(runs) == 16
        assert all(sorted(seeds) == [0, 1] for seeds in runs.groupby("setting")["seed"].apply(list))
        settings = runs.groupby("setting").first()
        assert len(settings) == 8
        for _, run in settings.iterrows():  # every drawn value within its distribution, as logged
            assert 0.01 <= float(run["param:algorithm.local_lr"]) <= 1.0 and 1 <= int(run["param:algorithm.local_steps"]) <= 6
        drawn.append(sorted((int(run["trial"][0]), run["param:algorithm.local_lr"], run["param:algorithm.local_steps"])
                            for _, run in settings.iterrows()))
        # the study saw the mean over the seeds of the validation metric
        metric = VAL + "personalized_accuracy_mean"
        for result in out["results"]:
            mine = runs[runs["trial"].apply(lambda t: t[0]) == result.config["trial"]]
            assert result.metrics[metric] == pytest.approx(mine[metric].mean())
    assert drawn[0] == drawn[1]


def test_an_optuna_search_state_restores_to_the_same_draws_and_refuses_any_other_global(tmp_path):
    """A study saved after trials completed (every kind of distribution, past TPE's 10 random starts) and restored
    in a new searcher draws what the saved one draws next; a state that names anything else (here os.system) is
    refused by name before it is called (fedsweep.safe_pickle), as is a call of an allowed class with arguments (its
constructor may act), and the searcher keeps its own state."""
    import os
    import pickle

    from fedsweep.optuna_search import PointwiseOptuna
    from fedsweep.search import optuna_space

    value = {"a": {"loguniform": [0.001, 0.1]}, "b": {"uniform": [0, 1]}, "c": {"randint": [1, 5]}, "d": {"choice": [1, 2]}}
    make = lambda: PointwiseOptuna([optuna_space(value), optuna_space({"a": {"uniform": [0, 1]}})], 16, "acc", "max", 0)
    study = make()
    for i in range(24):
        drawn = study.suggest(f"t{i}")["drawn"]
        study.on_trial_complete(f"t{i}", {"acc": sum(float(v) for v in drawn.values()), **drawn}, error=i == 3)
    study.save(str(tmp_path / "state.pkl"))
    restored = make()
    restored.restore(str(tmp_path / "state.pkl"))
    assert [restored.suggest(f"n{i}") for i in range(4)] == [study.suggest(f"n{i}") for i in range(4)]

    class Attack:
        def __reduce__(self):
            return os.system, (f"touch {tmp_path / 'pwned'}",)

    (tmp_path / "bad.pkl").write_bytes(pickle.dumps({"counter": Attack()}))
    fresh = make()
    with pytest.raises(pickle.UnpicklingError, match=r"refusing to load posix.system: .*bad.pkl is a sweep's Optuna search state"):
        fresh.restore(str(tmp_path / "bad.pkl"))
    assert not (tmp_path / "pwned").exists() and fresh.counter == 0
    # a class the state may hold is not called with arguments of the file's choosing: Study(name, storage URL) would
    # open, and create, a database (GLOBAL, two strings, TUPLE, REDUCE, as a hand-written pickle has them)
    db = tmp_path / "made.db"
    study = b"coptuna.study.study\nStudy\n(Vs\nVsqlite:///" + str(db).encode() + b"\ntR."
    (tmp_path / "call.pkl").write_bytes(study)
    with pytest.raises(pickle.UnpicklingError, match=r"refusing to call optuna.study.study.Study with arguments"):
        fresh.restore(str(tmp_path / "call.pkl"))
    assert not db.exists() and fresh.counter == 0
    old = b"(Vs\nVsqlite:///" + str(db).encode() + b"\nioptuna.study.study\nStudy\n."  # MARK, two strings, INST
    (tmp_path / "inst.pkl").write_bytes(old)
    with pytest.raises(pickle.UnpicklingError, match=r"refusing to call optuna.study.study.Study with arguments"):
        fresh.restore(str(tmp_path / "inst.pkl"))
    assert not db.exists()


def test_an_optuna_search_is_checked_at_the_edges_of_its_space_before_it_starts(tmp_path, monkeypatch):
    path = _optuna_file(tmp_path, "edges")
    body = yaml.safe_load((tmp_path / "edges.yaml").read_text())
    body["algorithm"]["participation_rate"] = {"uniform": [0.5, 1.5]}  # r must be <= 1: its high end is refused
    (tmp_path / "edges.yaml").write_text(yaml.safe_dump(body))
    with pytest.raises(ConfigError, match=r"participation_rate: Input should be less than or equal to 1 .*\[at an edge of the search space"):
        load_sweep(path, check_cluster=False)
    body["algorithm"]["participation_rate"] = 0.5
    body["sweep"]["scheduler"] = {"asha": {"grace_rounds": 1}}
    (tmp_path / "edges.yaml").write_text(yaml.safe_dump(body))
    with pytest.raises(ConfigError, match=r"sweep.scheduler: with search: 'optuna' a trial runs its seeds one after another"):
        load_sweep(path, check_cluster=False)
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "optuna" else real(name, *a))
    with pytest.raises(ConfigError, match=r"sweep.search: 'optuna' needs the optuna package, which is not installed: pip install 'fedsweep\[optuna\]'"):
        load_sweep(path, check_cluster=False)
