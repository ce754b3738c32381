"""A real Ray Tune sweep on the session's 2-CPU Ray instance, logged to a real SQLite MLflow store,
then read back by `fedsweep table`."""

from __future__ import annotations

import sys

import pandas as pd
import pytest
import yaml

from fedsweep.cli import main
from fedsweep.loading import load_sweep
from fedsweep.sweep import quiet_ignored_exit, run_sweep
from fedsweep.table import best_settings, ci95, load_runs, to_markdown
from tests.conftest import assert_runs_equal_run_local, config_dict

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def tracking_uri(tmp_path_factory):
    """One store for the module's sweep; the working directory is left alone (paths are absolute)."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


@pytest.fixture(scope="module")
def finished_sweep(ray_session, tracking_uri, tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("sweep")
    body = config_dict(
        algorithm={"local_lr": {"grid": [0.1, 0.02]}, "participation_rate": 0.6},
        rounds=3,
        eval_every=2,
        tracking={"experiment": "sweep-test", "tracking_uri": tracking_uri, "log_plot": True},
        resources=None,
    )
    body["sweep"] = {"name": "t", "max_concurrent_trials": 2, "seeds": [0, 1], "storage_path": str(tmp_path / "ray_results")}
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(body))
    sweep = load_sweep(path)
    out = run_sweep(sweep, verbose=0)
    return sweep, out


def test_sweep_of_four_trials_two_at_a_time(finished_sweep, tracking_uri):
    from mlflow import MlflowClient

    _, out = finished_sweep
    assert out["errors"] == 0 and len(out["results"]) == 4
    c = MlflowClient(tracking_uri)
    exp = c.get_experiment_by_name("sweep-test")
    runs = c.search_runs([exp.experiment_id])
    parents = [r for r in runs if r.data.tags.get("fedsweep.sweep") == "true"]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId")]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    assert len(children) == 4
    assert {r.data.tags["mlflow.parentRunId"] for r in children} == {parents[0].info.run_id}
    assert all(r.info.status == "FINISHED" for r in children)
    assert len({r.data.tags["ray.trial_id"] for r in children}) == 4
    # Every resolved hyperparameter is a param; metrics are per round (step = round).
    for r in children:
        assert r.data.params["algorithm.local_lr"] in ("0.1", "0.02")
        assert r.data.params["data.num_clients"] == "3"
        steps = [m.step for m in c.get_metric_history(r.info.run_id, "personalized_accuracy_mean")]
        assert sorted(steps) == [0, 2, 3]
        assert sorted(m.step for m in c.get_metric_history(r.info.run_id, "local_train_loss")) == [1, 2, 3]
    # Tune knows each trial's last evaluation round (the final report, whichever rounds before it were reported,
    # sweep.REPORT_EVERY_S): what a searcher and the sweep's end read
    finals = {r.data.tags["ray.trial_id"]: r.data.metrics["personalized_accuracy_mean"] for r in children}
    assert {r.metrics["trial_id"]: (r.metrics["round"], r.metrics["personalized_accuracy_mean"]) for r in out["results"]} == \
        {trial: (3.0, value) for trial, value in finals.items()}
    for r in children:
        artifacts = {a.path for a in c.list_artifacts(r.info.run_id, "plots")} | {
            a.path for a in c.list_artifacts(r.info.run_id, "clients")
        }
        assert artifacts == {"plots/accuracy_vs_round.png", "clients/final_round.json"}
    assert {a.path for a in c.list_artifacts(parents[0].info.run_id)} == {"sweep.yaml", "report"}
    # At most two trials ran at once, and two did overlap.
    spans = sorted((r.info.start_time, r.info.end_time) for r in children)
    overlaps = [sum(1 for s, e in spans if s < t_end and e > t_start) for t_start, t_end in spans]
    assert max(overlaps) >= 2


def test_same_seed_same_numbers_across_trials(finished_sweep, tracking_uri):
    runs, _ = load_runs(tracking_uri, "sweep-test")
    # Trials that differ only in the seed have different numbers; the table groups them as one setting.
    assert runs.groupby("setting")["seed"].nunique().tolist() == [2, 2]


def test_trials_of_a_one_process_layout_run_in_their_tune_process_with_the_in_process_numbers(finished_sweep, tracking_uri):
    """The layout chosen here is one process (a worker pool of one): each trial runs the server and its clients in
    its own Tune process, starting no ServerActor (tag fedsweep.in_process), and its final metrics are those of the
    in-process reference."""
    from mlflow import MlflowClient

    sweep, _ = finished_sweep
    c = MlflowClient(tracking_uri)
    exp = c.get_experiment_by_name("sweep-test")
    children = [r for r in c.search_runs([exp.experiment_id]) if r.data.tags.get("mlflow.parentRunId")]
    assert all(r.data.tags.get("fedsweep.in_process") == "true" for r in children) and len(children) == 4
    assert_runs_equal_run_local(sweep.trials, children)


def test_trials_on_warm_actors_give_the_numbers_of_fresh_ones(ray_session, tmp_path):
    """A layout of two processes (the ServerActor and a ClientActor), three trials one at a time: the trials after
    the first reuse the actors of the one before (tag fedsweep.warm_actors), with the numbers of fresh ones."""
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    body = config_dict(algorithm={"local_lr": {"grid": [0.1, 0.05, 0.02]}}, rounds=2, eval_every=2,
                       tracking={"experiment": "warm", "tracking_uri": uri},
                       resources={"_replace": True, "server_cpus": 0.2, "client_cpus": 0.4, "client_workers": 2})
    body["sweep"] = {"name": "w", "max_concurrent_trials": 1, "storage_path": str(tmp_path / "ray_results")}
    (tmp_path / "w.yaml").write_text(yaml.safe_dump(body))
    sweep = load_sweep(tmp_path / "w.yaml")
    assert run_sweep(sweep, verbose=0)["errors"] == 0
    c = MlflowClient(uri)
    children = [r for r in c.search_runs([c.get_experiment_by_name("warm").experiment_id]) if r.data.tags.get("mlflow.parentRunId")]
    assert len(children) == 3 and not any(r.data.tags.get("fedsweep.in_process") for r in children)
    assert sum(r.data.tags.get("fedsweep.warm_actors") == "true" for r in children) == 2
    assert_runs_equal_run_local(sweep.trials, children)


def test_table_best_setting_with_ci(finished_sweep, tracking_uri):
    _, out = finished_sweep
    runs, tags = load_runs(tracking_uri, "sweep-test", out["parent_run_id"])
    assert tags["fedsweep.metric"] == "personalized_accuracy_mean"
    table = best_settings(runs, "personalized_accuracy_mean", "max")
    assert table["algorithm"].tolist() == ["fedavg"]
    row = table.iloc[0]
    by_setting = runs.groupby("setting_label")["personalized_accuracy_mean"].mean()
    assert row["best setting"] == by_setting.idxmax()
    chosen = runs[runs["setting_label"] == row["best setting"]]["personalized_accuracy_mean"].to_numpy()
    assert row["personalized_accuracy_mean mean"] == pytest.approx(chosen.mean())
    assert row["personalized_accuracy_mean ci95"] == pytest.approx(ci95(chosen))
    assert "| fedavg | local_lr=" in to_markdown(table)


def test_table_cli_formats(finished_sweep, tracking_uri, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking_uri)
    assert main(["table", "--experiment", "sweep-test"]) == 0
    out = capsys.readouterr().out
    assert "| algorithm | best setting |" in out and "| fedavg |" in out and " ± " in out
    csv = tmp_path / "t.csv"
    assert main(["table", "--experiment", "sweep-test", "--format", "csv", "--output", str(csv)]) == 0
    pq = tmp_path / "t.parquet"
    assert main(["table", "--experiment", "sweep-test", "--format", "parquet", "--output", str(pq)]) == 0
    a, b = pd.read_csv(csv), pd.read_parquet(pq)
    assert a["algorithm"].tolist() == b["algorithm"].tolist() == ["fedavg"]
    assert a["seeds"].tolist() == [2]
    assert main(["table", "--experiment", "sweep-test", "--metric", "nope"]) == 2
    assert main(["table", "--experiment", "missing"]) == 2


def test_an_exit_python_ignores_is_not_printed_other_ignored_errors_are(monkeypatch):
    """Ray's SIGTERM handler raising SystemExit inside a garbage-collector callback (a reused trial process ended at a
    sweep's end) printed a traceback into every sweep's log; other ignored exceptions still reach the hook."""
    printed = []
    monkeypatch.setattr(sys, "unraisablehook", printed.append)
    quiet_ignored_exit()
    quiet_ignored_exit()  # once per process: a second call wraps nothing more

    class Ends:
        def __init__(self, error):
            self.error = error

        def __del__(self):
            raise self.error

    Ends(SystemExit(1))
    Ends(ValueError("kept"))
    assert [type(u.exc_value) for u in printed] == [ValueError]


def test_ci95_values():
    import math

    assert math.isnan(ci95(pd.Series([0.5]).to_numpy()))
    # n = 3, s = 0.1: t_{0.975,2} = 4.3027 -> 4.3027 × 0.1 / sqrt(3)
    assert ci95(pd.Series([0.4, 0.5, 0.6]).to_numpy()) == pytest.approx(4.302652729911275 * 0.1 / 3**0.5)


def test_every_algorithm_runs_as_a_tune_trial_and_gets_a_table_row(ray_session, tmp_path_factory):
    from fedsweep.algorithms import ALGORITHMS

    tmp = tmp_path_factory.mktemp("all")
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    points = [{"name": name} for name in ALGORITHMS]
    points += [{"name": "pfldyn", "transform": "proto"}, {"name": "pflscaf", "transform": "proto"}]
    # one layout for every method (a worker pool of one, one by one): each trial process keeps its warm actor
    body = config_dict(rounds=2, eval_every=2, tracking={"experiment": "all", "tracking_uri": uri},
                       resources={"_replace": True, "client_workers": 1})
    body["algorithm"] = {"grid": [{**p, "local_steps": 2, "participation_rate": 0.6} for p in points]}
    body["sweep"] = {"name": "all", "max_concurrent_trials": 2, "storage_path": str(tmp / "ray_results")}
    path = tmp / "all.yaml"
    path.write_text(yaml.safe_dump(body))
    out = run_sweep(load_sweep(path), verbose=0)
    assert out["errors"] == 0
    runs, _ = load_runs(uri, "all", out["parent_run_id"])
    assert len(runs) == len(points)
    table = best_settings(runs, "personalized_accuracy_mean")
    assert sorted(table["algorithm"]) == sorted(ALGORITHMS)
    pflscaf = runs[runs["algorithm"] == "pflscaf"]
    assert (pflscaf["transmissions"] == 2 * 2 * 2 * 2).all()  # 2 rounds × 2 sampled × (down + up) × 2 vectors
    pfedme = runs[runs["algorithm"] == "pfedme"]
    assert (pfedme["downloads"] == 2 * 3).all() and (pfedme["uploads"] == 2 * 2).all()


def test_a_diverging_setting_stops_alone_and_the_table_reports_it(ray_session, tmp_path_factory, capsys, monkeypatch):
    """local_lr = 1e30 blows up in round 1: that trial stops at once (diverged in MLflow and in its Tune
    result), the other trial finishes, and `fedsweep table` lists the diverged setting below the table."""
    from mlflow import MlflowClient

    tmp = tmp_path_factory.mktemp("diverge")
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    body = config_dict(
        algorithm={"local_lr": {"grid": [0.1, 1e30]}}, rounds=5, eval_every=5,
        tracking={"experiment": "diverge", "tracking_uri": uri}, resources=None,
    )
    body["sweep"] = {"name": "d", "max_concurrent_trials": 2, "storage_path": str(tmp / "ray_results")}
    (tmp / "d.yaml").write_text(yaml.safe_dump(body))
    out = run_sweep(load_sweep(tmp / "d.yaml"), verbose=0)

    assert out["errors"] == 0  # the sweep goes on: a diverged trial is an outcome, not an error
    tune_diverged = [r.metrics for r in out["results"] if r.metrics.get("diverged")]
    assert len(tune_diverged) == 1 and tune_diverged[0]["round"] == 1.0
    c = MlflowClient(uri)
    children = [r for r in c.search_runs([c.get_experiment_by_name("diverge").experiment_id]) if "mlflow.parentRunId" in r.data.tags]
    outcome = {r.data.params["algorithm.local_lr"]: (r.info.status, r.data.tags["fedsweep.outcome"]) for r in children}
    assert outcome == {"0.1": ("FINISHED", "finished"), "1e+30": ("FAILED", "diverged")}
    bad = next(r for r in children if r.data.params["algorithm.local_lr"] == "1e+30")
    assert max(m.step for m in c.get_metric_history(bad.info.run_id, "uploads")) == 1  # stopped at round 1

    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    assert main(["table", "--experiment", "diverge"]) == 0
    printed = capsys.readouterr().out
    assert "| fedavg | local_lr=0.1 | 2 | 1 |" in printed  # both settings tried; the finite one is best
    assert "Diverged" in printed and "| fedavg | local_lr=1e+30 | 1/1 |" in printed


def test_resume_refuses_a_tune_folder_another_user_could_have_written(tmp_path, monkeypatch):
    """``--resume`` hands the chosen Tune folder to ``Tuner.restore``, which unpickles ``tuner.pkl`` and the
    experiment state with no restriction: a folder or file there that its group or anyone may write (or another
    user owns) is refused by name before anything runs, and the same folder made private is taken."""
    import json
    import os

    from fedsweep.config import ConfigError
    from fedsweep.storage import Storage
    from fedsweep.sweep import SWEEP_STATE, find_resumable

    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({**config_dict(), "sweep": {"name": "s", "seeds": [0],
                                                               "storage_path": str(tmp_path / "store")}}))
    sweep = load_sweep(str(path), check_cluster=False)
    folder = tmp_path / "store" / "s-20261206-000000"
    folder.mkdir(parents=True)
    (folder / "tuner.pkl").write_bytes(b"")  # what Tune's can_restore looks for
    (folder / SWEEP_STATE).write_text(json.dumps({"yaml_sha1": sweep.source_hash(), "parent_run_id": "x"}))
    for p in (folder, *folder.iterdir()):
        p.chmod(0o700 if p.is_dir() else 0o600)
    storage = Storage(str(tmp_path / "store"))
    assert find_resumable(sweep, storage)[0] == str(folder) and storage.others_could_write(str(folder)) == []
    (folder / "tuner.pkl").chmod(0o664)
    with pytest.raises(ConfigError, match=r"sweep.storage_path: refusing to resume .*tuner.pkl \(writable by its group"):
        find_resumable(sweep, storage)
    (folder / "tuner.pkl").chmod(0o600)
    folder.chmod(0o777)
    assert storage.others_could_write(str(folder)) == [f"{folder} (writable by its group and anyone: mode 777)"]
    folder.chmod(0o700)
    uid = os.getuid()
    monkeypatch.setattr(os, "getuid", lambda: uid + 1)  # as another user would see the folder: not theirs
    assert storage.others_could_write(str(folder))[0] == f"{folder} (owned by user {uid})"
