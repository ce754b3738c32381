"""Where runs are logged: the config's URI, else $MLFLOW_TRACKING_URI, else ./mlflow.db, always absolute."""

from __future__ import annotations

import pytest

from fedsweep.config import resolve_tracking_uri
from fedsweep.tracking import setting_label


def test_default_is_sqlite_in_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert resolve_tracking_uri() == f"sqlite:///{tmp_path / 'mlflow.db'}"


def test_environment_then_config(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    assert resolve_tracking_uri() == "http://127.0.0.1:5000"
    assert resolve_tracking_uri("sqlite:///runs/x.db") == f"sqlite:///{tmp_path / 'runs' / 'x.db'}"
    assert resolve_tracking_uri("sqlite:////abs/x.db") == "sqlite:////abs/x.db"


def test_setting_label_leaves_out_seed_and_name():
    label = setting_label({"algorithm.name": "fedavg", "algorithm.local_lr": 0.05, "seed": 3, "rounds": 10})
    assert label == "local_lr=0.05, rounds=10"
    assert setting_label({"seed": 1}) == "default"


def test_rounds_are_written_at_evaluations_a_flush_and_the_end_and_none_is_lost(tmp_path, monkeypatch):
    """A run's per-round metrics go to the store in one call per evaluation interval (or several intervals, when
    they come faster than ``LINGER_S``): held until an evaluation round, which hands them to the writer's thread and
    goes on (a flush, as a scheduler's report does, waits until they are written), the rest written by finish,
    also on failure."""
    from fedsweep import tracking
    from fedsweep.engine import run_local
    from fedsweep.loading import validate
    from fedsweep.tracking import RunLogger, client, ensure_experiment

    monkeypatch.setattr(tracking, "LINGER_S", 3600.0)  # every evaluation round comes within the linger (below: 0)

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = validate({"data": {"dataset": "synthetic", "num_clients": 4, "max_samples_per_client": 60}, "model": {"name": "mlr"},
                    "algorithm": {"name": "fedavg", "participation_rate": 0.5, "local_steps": 2}, "rounds": 7, "eval_every": 3})
    history, _ = run_local(cfg)
    c = client(uri)
    log = RunLogger(uri, ensure_experiment(uri, "batched"), cfg, "batched")
    stored = lambda: sorted(m.step for m in c.get_metric_history(log.run_id, "uploads"))
    for metrics in history[:3]:  # rounds 0 (an evaluation, the run's first: handed over at once), 1, 2
        log.log_round(metrics)
    assert log.writer.wait() and stored() == [0] and log.logged_through == 2
    log.log_round(history[3])  # round 3, an evaluation within the linger: held with rounds 1-2
    assert len(log.pending) == 3 and log.writer.wait() and stored() == [0]
    log.log_round(history[4])
    log.flush()  # as a report to a scheduler does
    assert len(log.pending) == 0 and stored() == [0, 1, 2, 3, 4]
    monkeypatch.setattr(tracking, "LINGER_S", 0.0)
    log.log_round(history[5])
    assert len(log.pending) == 1
    log.log_round(history[6])  # round 6, an evaluation past the linger: rounds 5-6 in one write
    assert len(log.pending) == 0 and log.writer.wait() and stored() == list(range(7))
    monkeypatch.setattr(tracking, "LINGER_S", 3600.0)
    log.log_round(history[7])  # the last round, an evaluation within the linger: held
    assert len(log.pending) == 1
    log.finish(None, "FAILED", "error")  # a failure still writes what was held
    assert stored() == list(range(8))
    assert [m.value for m in sorted(c.get_metric_history(log.run_id, "uploads"), key=lambda m: m.step)] == \
        [h["uploads"] for h in history]


def test_a_stopped_early_run_counts_as_done_on_resume_only_under_a_scheduler(tracking_uri):
    """A trial restarted by --resume takes an earlier run for done when it finished, diverged or was stopped by
    the scheduler; in a sweep without a scheduler a stopped_early mark can only be an interruption's (fedsweep
    before 2026-11-26 so marked a Ctrl-C'd trial): that run is deleted and the trial reruns."""
    from mlflow import MlflowClient

    from fedsweep.sweep import _earlier_attempts
    from fedsweep.tracking import ensure_experiment

    c = MlflowClient(tracking_uri)
    experiment_id = ensure_experiment(tracking_uri, "resume-marks")
    parent = c.create_run(experiment_id).info.run_id

    def attempt(outcome: str) -> str:
        run = c.create_run(experiment_id, tags={"mlflow.parentRunId": parent, "ray.trial_id": outcome,
                                                "fedsweep.seed": "0", "fedsweep.outcome": outcome}).info.run_id
        c.set_terminated(run, "FINISHED")
        return run

    runs = {outcome: attempt(outcome) for outcome in ("finished", "stopped_early")}
    for scheduler, kept in (("asha", {"finished", "stopped_early"}), ("", {"finished"})):
        tracking = {"uri": tracking_uri, "experiment_id": experiment_id, "parent_run_id": parent, "scheduler": scheduler}
        done = {o for o in runs if (d := _earlier_attempts(tracking, o, 0)) is not None and d.info.run_id == runs[o]}
        assert done == kept, scheduler
    assert c.get_run(runs["stopped_early"]).info.lifecycle_stage == "deleted"


def test_a_new_sqlite_store_is_a_copy_of_the_empty_one_and_equals_what_mlflow_creates(tmp_path):
    """A new store made from the cached empty one has MLflow's own schema (every table, index and the head
    revision), its Default experiment under its own artifact root, and takes runs; a store that exists is left
    as it is."""
    import sqlite3

    from mlflow import MlflowClient

    from fedsweep.sqlite_store import empty_store
    from fedsweep.tracking import client

    def schema(path):  # a table's clauses as a set: MLflow's own migrations order some by a hash (PYTHONHASHSEED)
        con = sqlite3.connect(path)
        try:
            return (sorted((kind, name, tuple(sorted(line.strip().rstrip(",").strip() for line in (sql or "").split("\n"))))
                           for kind, name, sql in con.execute("select type, name, sql from sqlite_master")),
                    con.execute("select version_num from alembic_version").fetchall(),
                    sorted(con.execute("select name from workspaces")))
        finally:
            con.close()

    ours, theirs = tmp_path / "ours.db", tmp_path / "theirs.db"
    c = client(f"sqlite:///{ours}")
    assert empty_store().exists() and ours.exists()
    MlflowClient(f"sqlite:///{theirs}").search_experiments()  # MLflow's own creation
    assert schema(ours) == schema(theirs)
    assert c.get_experiment("0").name == "Default"
    run = c.create_run(c.create_experiment("e")).info.run_id
    c.log_metric(run, "m", 1.5)
    assert c.get_run(run).data.metrics == {"m": 1.5}
    before = ours.read_bytes()
    client(f"sqlite:///{ours}")  # exists: untouched
    assert ours.read_bytes() == before
    assert not list(tmp_path.glob(".*.tmp"))


def test_a_run_names_the_platform_and_the_code_its_numbers_came_from(tmp_path):
    """Every trial run carries the torch build, vector instruction set and CPU it computed on, and fedsweep's
    commit (+changes when the package's files differ from it): a number that moves between two runs of one
    config and seed can be put down to the platform or to the code (docs/reproduction.md); the runs behind a
    table keep both, in the store and in the saved CSV."""
    import subprocess
    from pathlib import Path

    import torch

    import fedsweep
    from fedsweep.engine import run_local
    from fedsweep.loading import validate
    from fedsweep.table import load_runs, read_runs, save_runs
    from fedsweep.tracking import CODE_TAG, PLATFORM_TAG, RunLogger, client, code_version, ensure_experiment

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = validate({"data": {"dataset": "synthetic", "num_clients": 2, "max_samples_per_client": 60}, "model": {"name": "mlr"},
                    "algorithm": {"name": "fedavg", "local_steps": 1}, "rounds": 1})
    log = RunLogger(uri, ensure_experiment(uri, "platform"), cfg, "platform")
    for metrics in run_local(cfg)[0]:
        log.log_round(metrics)
    log.finish(None)
    tags = client(uri).get_run(log.run_id).data.tags
    assert f"torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()})" in tags[PLATFORM_TAG]
    root = Path(fedsweep.__file__).resolve().parent.parent
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, check=False)
    assert tags[CODE_TAG] == code_version()
    assert tags[CODE_TAG].startswith(head.stdout.strip()) if (root / ".git").exists() else tags[CODE_TAG] == fedsweep.__version__
    runs, sweep = load_runs(uri, "platform")
    assert list(runs[["platform", "code"]].iloc[0]) == [tags[PLATFORM_TAG], tags[CODE_TAG]]
    save_runs(runs, sweep, str(tmp_path / "runs.csv"))
    assert list(read_runs(str(tmp_path / "runs.csv"))[0][["platform", "code"]].iloc[0]) == [tags[PLATFORM_TAG], tags[CODE_TAG]]


def test_the_platform_names_the_settings_that_choose_mkl_and_onednn_kernels():
    """MKL and oneDNN pick their kernels by the CPU, not by ATEN_CPU_CAPABILITY, and each of these variables changes
    that choice and so the numbers (docs/reproduction.md, "Same kernels, other CPU"): a run made with one set names
    it in its platform, one made without names none."""
    import os
    import subprocess
    import sys

    from fedsweep.tracking import LIBRARY_DISPATCH

    code = "from fedsweep.tracking import run_platform; print(run_platform())"
    clean = {k: v for k, v in os.environ.items() if k not in LIBRARY_DISPATCH}
    told = subprocess.run([sys.executable, "-c", code], env={**clean, "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
                          capture_output=True, text=True, check=True).stdout.strip()
    plain = subprocess.run([sys.executable, "-c", code], env=clean, capture_output=True, text=True, check=True).stdout.strip()
    assert told == plain + ", MKL_CBWR=AVX2, ONEDNN_MAX_CPU_ISA=AVX2"
    assert not any(var in plain for var in LIBRARY_DISPATCH)


def test_mlflow_telemetry_is_off_in_a_fedsweep_process_unless_the_user_turned_it_on(tmp_path):
    """MLflow 3 starts a telemetry client at import (a config fetched from its makers' site, usage sent at exit);
    importing fedsweep first turns it off, and a user's own setting wins. Run in a clean environment: MLflow
    itself stays silent under pytest or a CI variable, which would hide the default this guards against."""
    import subprocess
    import sys
    from pathlib import Path

    import fedsweep

    probe = ("import os, sys; [__import__(m) for m in sys.argv[1:]]; from mlflow.telemetry.client import get_telemetry_client;"
             "print(get_telemetry_client() is None, os.environ.get('MLFLOW_DISABLE_TELEMETRY'))")
    root = str(Path(fedsweep.__file__).resolve().parent.parent)

    def telemetry_off(*modules, **env) -> str:
        clean = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONPATH": root, **env}
        return subprocess.run([sys.executable, "-c", probe, *modules], env=clean, capture_output=True, text=True,
                              check=True, timeout=120).stdout.strip()

    assert telemetry_off("mlflow") == "False None"  # MLflow's own default, which this test would otherwise not see
    assert telemetry_off("fedsweep", "mlflow") == "True true"
    assert telemetry_off("fedsweep", "mlflow", MLFLOW_DISABLE_TELEMETRY="false") == "False false"
    assert "MLFLOW_DISABLE_TELEMETRY=\"${MLFLOW_DISABLE_TELEMETRY:-true}\"" in (Path(root) / "infra" / "mlflow_server.sh").read_text()


def test_a_thread_stopped_after_the_schedulers_tag_ends_its_run_finished_stopped_early(tracking_uri):
    """Tune returns from a trial ASHA stopped without waiting for its thread, so the thread's ending and the driver's
    mark (fedsweep.stopping.mark_stopped_early) may come in either order: both write the same one. CI of 2026-11-27
    saw a stopped trial's thread write KILLED after the driver's FINISHED. Without the tag a stop is an interruption."""
    from fedsweep.experiment import InProcessRunner, execute
    from fedsweep.loading import validate
    from fedsweep.tracking import STOPPED_AFTER, STOPPED_EARLY, RunLogger, client, ensure_experiment

    cfg = validate({"data": {"dataset": "synthetic", "num_clients": 4, "max_samples_per_client": 60}, "model": {"name": "mlr"},
                    "algorithm": {"name": "fedavg", "participation_rate": 0.5, "local_steps": 2}, "rounds": 6, "eval_every": 2,
                    "tracking": {"log_plot": False}})
    c = client(tracking_uri)
    for tagged, ending in ((True, ("FINISHED", STOPPED_EARLY)), (False, ("KILLED", "killed"))):
        log = RunLogger(tracking_uri, ensure_experiment(tracking_uri, "stops"), cfg, "stopped")

        def on_round(metrics, log=log, tagged=tagged):
            if metrics["round"] == 2:  # the scheduler's decision, then Tune's stop at the trial's report
                if tagged:
                    c.set_tag(log.run_id, STOPPED_AFTER, "2")
                raise SystemExit(1)

        with pytest.raises(SystemExit):
            execute(cfg, log, on_round, runner=InProcessRunner(cfg))
        run = c.get_run(log.run_id)
        assert (run.info.status, run.data.tags["fedsweep.outcome"]) == ending
        assert max(m.step for m in c.get_metric_history(log.run_id, "uploads")) == 2  # rounds after the stop: none


def test_a_run_that_diverged_at_the_round_the_scheduler_stopped_it_stays_diverged(tracking_uri):
    """ASHA may decide STOP on the very result that diverged; that trial ends FAILED/diverged, and the sweep's end
    (mark_stopped_early) must not make it a FINISHED, stopped-early one: the table would lose a diverged seed. A
    stopped run beside it is marked as before."""
    from fedsweep.stopping import mark_stopped_early
    from fedsweep.tracking import STOPPED_AFTER, STOPPED_EARLY, client, ensure_experiment

    c, experiment = client(tracking_uri), ensure_experiment(tracking_uri, "diverged-and-stopped")
    parent = c.create_run(experiment).info.run_id
    runs = {}
    for name, outcome in (("diverged", "diverged"), ("stopped", None)):
        tags = {"mlflow.parentRunId": parent, "ray.trial_id": name, STOPPED_AFTER: "2",
                **({"fedsweep.outcome": outcome} if outcome else {})}
        runs[name] = c.create_run(experiment, tags=tags).info.run_id
    c.set_terminated(runs["diverged"], "FAILED")
    marked = mark_stopped_early({"uri": tracking_uri, "experiment_id": experiment, "parent_run_id": parent})
    assert marked == {"stopped"}
    run = c.get_run(runs["diverged"])
    assert (run.info.status, run.data.tags["fedsweep.outcome"]) == ("FAILED", "diverged")
    run = c.get_run(runs["stopped"])
    assert (run.info.status, run.data.tags["fedsweep.outcome"]) == ("FINISHED", STOPPED_EARLY)


def test_a_tag_two_writers_set_at_once_is_stored_without_an_error(tracking_uri):
    """A stopped trial's thread and the sweep's driver may both write its first ``fedsweep.outcome`` at once; MLflow's
    SQL store then inserts it twice, and one write failed on the tags' UNIQUE key (CI, 2026-11-27). Two threads, each
    with its own client, write 30 new tags at the same instant: with ``set_tag`` about half the pairs collided here."""
    import threading

    from fedsweep.tracking import client, ensure_experiment, set_shared_tag

    c = client(tracking_uri)
    run_id = c.create_run(ensure_experiment(tracking_uri, "race")).info.run_id
    errors: list[BaseException] = []
    for i in range(30):
        start = threading.Barrier(2)

        def write(value, i=i, start=start):
            mine = client(tracking_uri)
            start.wait()
            try:
                set_shared_tag(mine, run_id, f"outcome{i}", value)
            except BaseException as error:  # noqa: BLE001 - counted below
                errors.append(error)

        threads = [threading.Thread(target=write, args=("stopped_early",)) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert errors == []
    tags = c.get_run(run_id).data.tags
    assert [tags[f"outcome{i}"] for i in range(30)] == ["stopped_early"] * 30


def test_the_code_tag_is_read_when_the_module_is_imported():
    """A process tags its runs with the checkout its modules were read from: code_version is computed at import
    (a reused trial process once tagged runs with a commit pulled after it had loaded its code)."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    probe = "import fedsweep.tracking as t; print(t.code_version.cache_info().currsize, t.code_version())"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT).stdout.split()
    assert out[0] == "1" and out[1]


def test_a_command_whose_run_cannot_be_ended_still_shows_the_error_that_stopped_it(tmp_path, capsys):
    """``end_run`` from a command's ``finally``: the run ends with its status; where the store cannot take it (here a
    store without the run, as one gone or unreachable would be) the error already on its way out goes on, the store's
    said on stderr; with no error on its way out, the store's error is the command's."""
    from mlflow.exceptions import MlflowException

    from fedsweep.tracking import client, end_run, ensure_experiment

    uri, elsewhere = (f"sqlite:///{tmp_path / name}" for name in ("mlflow.db", "other.db"))
    run_id = client(uri).create_run(ensure_experiment(uri, "ending")).info.run_id
    end_run(uri, run_id, "KILLED")
    assert client(uri).get_run(run_id).info.status == "KILLED"
    with pytest.raises(ValueError, match="the command's own error"):
        try:
            raise ValueError("the command's own error")
        finally:
            end_run(elsewhere, run_id, "KILLED")
    assert f"MLflow run {run_id} not ended (KILLED): MlflowException" in capsys.readouterr().err
    with pytest.raises(MlflowException):
        end_run(elsewhere, run_id, "FINISHED")
