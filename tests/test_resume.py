"""Resume: a sweep whose driver is killed (with its local Ray instance) after some trials finished is
continued with `fedsweep sweep FILE --resume`. Finished trials are not rerun, MLflow ends with exactly one
finished run per trial and none RUNNING, and every trial's final numbers equal an uninterrupted run's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from fedsweep.cli import main
from fedsweep.loading import load_sweep
from tests.conftest import assert_running, assert_runs_equal_run_local, config_dict, sqlite_store

pytestmark = [pytest.mark.ray, pytest.mark.slow]

FEDSWEEP = str(Path(sys.executable).with_name("fedsweep"))
TRIALS = 4


def children(uri: str, view: str = "ACTIVE_ONLY"):
    from mlflow import MlflowClient
    from mlflow.entities import ViewType

    c = MlflowClient(uri)
    exp = c.get_experiment_by_name("resume")
    if exp is None:
        return []
    runs = c.search_runs([exp.experiment_id], run_view_type=getattr(ViewType, view))
    return [r for r in runs if "mlflow.parentRunId" in r.data.tags]


def kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL every process of the driver's session at once, as a machine restart would: the driver, the
    Ray instance it started and Ray's workers. The workers lead process groups of their own, so a kill of
    the driver's group alone left trials running on; they finished their MLflow runs, and on a fast
    machine no trial was left mid-run."""
    while session := [p for p in psutil.process_iter() if _alive_in_session(p, proc.pid)]:
        for p in session:  # again while any is left: one may have been started between listing and killing
            try:
                p.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(session, timeout=30)
    proc.wait(timeout=60)


def ctrl_c_when(driver: subprocess.Popen, ready, timeout_s: float = 300) -> str:
    """SIGINT to the driver once ``ready()`` (polled), as Ctrl-C; its standard error once it exits (its whole session
    killed if it has not)."""
    deadline = time.time() + timeout_s
    try:
        while not ready():
            assert_running(driver, deadline, "it could be stopped")
            time.sleep(0.2)
        driver.send_signal(signal.SIGINT)
        return driver.communicate(timeout=timeout_s)[1]
    finally:
        if driver.poll() is None:
            kill_session(driver)


def _alive_in_session(p: psutil.Process, session_id: int) -> bool:
    try:
        return os.getsid(p.pid) == session_id and p.status() != psutil.STATUS_ZOMBIE
    except (ProcessLookupError, psutil.Error):
        return False


def checkpointed_runs(storage_path: str) -> set[str]:
    """The MLflow runs that a trial's newest complete checkpoint in the sweep's storage continues (as a resumed trial
    finds it: :func:`fedsweep.checkpoint.load_latest`). The kill waits for one of a running trial: its metrics in
    MLflow come before its checkpoint (written after them, by the trial's writer thread, an upload on S3), and a kill
    between them left no trial to go on from a checkpoint."""
    from fedsweep.checkpoint import load_latest
    from fedsweep.storage import Storage

    where, found = Storage(storage_path), set()
    for sweep in where.folders(where.root, "r-"):
        checkpoints = where.path(sweep, "fedsweep_checkpoints")
        for trial in where.folders(checkpoints, "trial_"):
            try:
                latest = load_latest(where, where.path(sweep, "fedsweep_checkpoints", trial))
            except OSError:  # replaced by a newer round's between the listing and the read
                continue
            if latest is not None:
                found.add(latest[1]["run_id"])
    return found


@pytest.fixture
def s3_server():
    """A local S3-compatible server (moto's, in this process) on 127.0.0.1, and the environment a client of it
    needs (credentials of moto's choosing: it accepts any)."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}", {"AWS_ACCESS_KEY_ID": "fedsweep", "AWS_SECRET_ACCESS_KEY": "fedsweep",
                                    "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}
    server.stop()


@pytest.mark.parametrize("storage", ["folder", "s3"])
def test_killed_sweep_resumes_without_rerunning_or_duplicating(tmp_path, storage, request, monkeypatch, capsys):
    """``folder``: ``sweep.storage_path`` a local folder (a shared filesystem on a cluster). ``s3``: a bucket of a
    local S3-compatible server; the resuming driver runs in another folder with another home, as on a driver
    node that replaced the lost one: all it finds of the sweep is in the bucket and in MLflow."""
    uri = sqlite_store(tmp_path / "mlflow.db")  # before the driver: the test reads the store while it runs
    body = config_dict(
        # rounds long enough that an evaluation interval outlasts tracking.LINGER_S: each evaluation round's metrics
        # (and the checkpoints after them) are written while the trial runs, for the kill below to fall mid-trial
        algorithm={"local_lr": {"grid": [0.1, 0.05]}, "local_steps": 400}, rounds=6, eval_every=2,
        resources={"cluster_cpus": 2, "client_workers": 1}, tracking={"experiment": "resume", "tracking_uri": uri},
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_RUN_ID")}
    if storage == "s3":
        endpoint, credentials = request.getfixturevalue("s3_server")
        env |= credentials
        storage_path = f"s3://fedsweep-results/sweeps?endpoint_override={endpoint}&allow_bucket_creation=true"
    else:
        storage_path = str(tmp_path / "ray_results")
    body["sweep"] = {"name": "r", "max_concurrent_trials": 2, "seeds": [0, 1], "checkpoint_every": 1,
                     "storage_path": storage_path}
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(body))

    # Nothing to resume yet: exit 2 before any cluster work (in this process, with the commands' environment: the
    # command line itself is the driver's below; a process of its own cost about 6 s of CPU for its imports)
    with monkeypatch.context() as m:
        m.chdir(tmp_path)
        for key in set(os.environ) - set(env):
            m.delenv(key)
        for key, value in env.items():
            m.setenv(key, value)
        assert main(["sweep", str(path), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "nothing to resume" in err and "sweep.storage_path" in err

    driver = subprocess.Popen([FEDSWEEP, "sweep", str(path), "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env=env, cwd=tmp_path, start_new_session=True)  # a failure shows its output
    deadline = time.time() + 300
    if storage == "s3":  # the test reads the bucket too
        for key, value in credentials.items():
            monkeypatch.setenv(key, value)

    def progressed(runs) -> bool:  # 2 trials done, and a running one with a checkpoint in the storage
        running = {x.info.run_id for x in runs if x.info.status == "RUNNING"}
        return len(runs) - len(running) >= 2 and bool(running & checkpointed_runs(storage_path))

    while not progressed(children(uri)):
        assert_running(driver, deadline, "it could be killed")
        time.sleep(0.5)
    kill_session(driver)
    before = children(uri)
    finished_before = {x.info.run_id: x.info.end_time for x in before if x.info.status == "FINISHED"}
    assert 2 <= len(finished_before) < TRIALS
    assert any(x.info.status == "RUNNING" for x in before)  # killed mid-trial: orphans exist now

    where = tmp_path
    if storage == "s3":  # the lost driver's folder and home are gone; the new driver has its own
        assert not (tmp_path / "ray_results").exists() and not (tmp_path / "sweeps").exists()
        where = tmp_path / "new_driver"
        where.mkdir()
        env["HOME"] = str(where)
    r = subprocess.run([FEDSWEEP, "sweep", str(path), "--quiet", "--resume"], capture_output=True, text=True, env=env,
                       cwd=where, timeout=600, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    if storage == "s3":  # the sweep's state, Tune's and fedsweep's checkpoints are in the bucket
        from fedsweep.storage import Storage

        bucket = Storage(storage_path)
        [folder] = bucket.folders(bucket.root, "r-")
        assert bucket.is_file(bucket.path(folder, "fedsweep_sweep.json"))
        assert len(bucket.folders(bucket.path(folder, "fedsweep_checkpoints"), "trial_")) == TRIALS
        assert [f for f in bucket.folders(bucket.path(folder)) if f.startswith("trial_")]  # Tune's trial folders

    from mlflow import MlflowClient

    c = MlflowClient(uri)
    after = children(uri)
    assert len(after) == TRIALS and all(x.info.status == "FINISHED" for x in after)
    assert len({x.data.tags["ray.trial_id"] for x in after}) == TRIALS  # one run per trial
    assert not [x for x in children(uri, "ALL") if x.info.status == "RUNNING"]  # no orphan left RUNNING
    # interrupted attempts that had no checkpoint Tune knew of were KILLED and deleted; the others went
    # on in their own run from their last checkpoint
    assert all(x.info.status == "KILLED" for x in children(uri, "DELETED_ONLY"))
    resumed = [x for x in after if "fedsweep.resumed_after_round" in x.data.tags]
    print("resumed after rounds:", [x.data.tags["fedsweep.resumed_after_round"] for x in resumed])
    assert resumed, "no trial went on from a checkpoint"
    for x in after:  # each round logged exactly once, resumed or not
        assert [m.step for m in c.get_metric_history(x.info.run_id, "uploads")] == list(range(7))
    # finished trials were not rerun: same runs, untouched
    assert {x.info.run_id: x.info.end_time for x in after if x.info.run_id in finished_before} == finished_before

    parents = [x for x in c.search_runs([c.get_experiment_by_name("resume").experiment_id]) if x.data.tags.get("fedsweep.sweep")]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"

    # every trial's final numbers equal an uninterrupted run of the same config (same seeds)
    assert_runs_equal_run_local(load_sweep(path).trials, after, ("personalized_accuracy_mean", "global_accuracy", "global_loss"),
                                rel=1e-9, absolute=1e-12)
    assert "| fedavg | local_lr=" in r.stdout and "| 2 | 2 |" in r.stdout  # both settings × 2 seeds in the table


def test_a_storage_that_cannot_be_reached_is_refused_before_anything_starts(tmp_path, s3_server):
    """A bucket the S3 server does not have (and may not create): exit 2 naming sweep.storage_path, before
    Ray starts and before any MLflow run."""
    endpoint, credentials = s3_server
    body = config_dict(tracking={"experiment": "unreachable", "tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}"})
    body["sweep"] = {"name": "u", "storage_path": f"s3://no-such-bucket/sweeps?endpoint_override={endpoint}"}
    path = tmp_path / "u.yaml"
    path.write_text(yaml.safe_dump(body))
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_RUN_ID")} | credentials
    r = subprocess.run([FEDSWEEP, "sweep", str(path)], capture_output=True, text=True, env=env, cwd=tmp_path,
                       timeout=120, check=False)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "sweep.storage_path" in r.stderr and "no-such-bucket" in r.stderr
    assert "Traceback" not in r.stderr and "Started a local Ray instance" not in r.stderr
    assert not (tmp_path / "mlflow.db").exists()


def test_a_sweep_stopped_with_ctrl_c_reruns_its_stopped_trials_on_resume(tmp_path):
    """Ctrl-C (SIGINT to the driver) while a trial runs, no scheduler: Tune saves its state and stops the trial.
    That trial's run ends KILLED (whether its thread saw the stop or Ray ended its process first), never FINISHED
    nor stopped_early (which --resume would take for done, and a table for a setting a scheduler dropped); the
    parent run ends KILLED and the command exits 130 saying how to go on; --resume reruns the trial to its last
    round, with an uninterrupted run's numbers."""
    uri = sqlite_store(tmp_path / "mlflow.db")  # before the driver: the test reads the store while it runs
    body = config_dict(algorithm={"local_lr": {"grid": [0.1, 0.05]}, "local_steps": 600}, rounds=6, eval_every=2,
                       resources={"cluster_cpus": 2, "client_workers": 1}, tracking={"experiment": "resume", "tracking_uri": uri})
    body["sweep"] = {"name": "c", "max_concurrent_trials": 1, "storage_path": str(tmp_path / "ray_results")}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(body))
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_RUN_ID")}
    driver = subprocess.Popen([FEDSWEEP, "sweep", str(path), "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env, cwd=tmp_path, start_new_session=True)
    from mlflow import MlflowClient

    def mid_trial(runs) -> bool:  # a trial past its first evaluation and short of its last
        steps = [m.step for x in runs if x.info.status == "RUNNING" for m in MlflowClient(uri).get_metric_history(x.info.run_id, "uploads")]
        return 2 <= max(steps, default=0) < 5
    err = ctrl_c_when(driver, lambda: mid_trial(children(uri)))
    assert driver.returncode == 130, err[-3000:]
    assert f"fedsweep sweep {path} --resume" in err
    before = children(uri)
    assert not [x for x in before if x.data.tags.get("fedsweep.outcome") == "stopped_early"]
    stopped = [x for x in before if x.info.status == "KILLED"]
    assert len(stopped) == 1 and len(before) <= 2, [(x.info.status, x.data.tags.get("fedsweep.outcome")) for x in before]
    c = MlflowClient(uri)
    [parent] = [x for x in c.search_runs([c.get_experiment_by_name("resume").experiment_id]) if x.data.tags.get("fedsweep.sweep")]
    assert parent.info.status == "KILLED"

    r = subprocess.run([FEDSWEEP, "sweep", str(path), "--quiet", "--resume"], capture_output=True, text=True, env=env,
                       cwd=tmp_path, timeout=600, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    after = children(uri)
    assert len(after) == 2 and all(x.info.status == "FINISHED" and x.data.tags["fedsweep.outcome"] == "finished" for x in after)
    assert stopped[0].info.run_id not in {x.info.run_id for x in after}
    for x in after:
        assert [m.step for m in c.get_metric_history(x.info.run_id, "uploads")] == list(range(7))
    # abs=1e-12: pytest.approx's default, which this check had before
    assert_runs_equal_run_local(load_sweep(path).trials, after, ("personalized_accuracy_mean",), rel=1e-9, absolute=1e-12)


def test_a_benchmark_stopped_mid_tuning_records_its_finished_methods_and_resumes_where_tune_stopped(tmp_path, monkeypatch):
    """`fedsweep bench` stopped with Ctrl-C while its tuning sweep runs the second of two methods: the first, every
    run of it there, is recorded (its choice, its runs saved beside bench_state.json), so that a folder carried to
    another machine loses only the methods not recorded; the sweep (its methods and run) is kept (``in_flight``).
    ``--resume`` on this machine goes on with Tune's saved sweep of both (none of the first's trials run again, its
    choice stays) and ends with both methods' tables; with a store without that sweep's run (Tune's state still in
    the storage, as a shared one keeps it) it would tune the second alone, the first's choice made from the folder."""
    import json
    import shutil

    from fedsweep.bench import load_bench
    from fedsweep.bench_run import _sweep_keys, open_state
    from tests.test_bench import bench_file

    (tmp_path / "methods.yaml").write_text(yaml.safe_dump({"methods": {
        "fedavg": {"name": "fedavg", "local_lr": {"loguniform": [0.02, 0.5]}, "local_steps": 2},
        "local": {"name": "local", "local_lr": {"loguniform": [0.02, 0.5]}, "local_steps": 1500}}}))
    path = bench_file(tmp_path, "stop", {"name": "label_skew", "classes_per_client": 4}, common={"r": 1.0, "batch_size": 16})
    raw = yaml.safe_load(Path(path).read_text())
    raw.update(rounds=6, eval_every=2)
    raw["sweep"].update(num_samples=2, name="stop")
    Path(path).write_text(yaml.safe_dump(raw, sort_keys=False))
    uri = sqlite_store(tmp_path / "mlflow.db")  # before the driver: the test reads the store while it runs
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_RUN_ID")} | {"MLFLOW_TRACKING_URI": uri}
    command = [FEDSWEEP, "bench", path, "--output", str(tmp_path / "out"), "--quiet"]
    driver = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path,
                              start_new_session=True)
    from mlflow import MlflowClient

    c = MlflowClient(uri)

    def trials():
        exp = c.get_experiment_by_name("bench-test")
        return [r for r in c.search_runs([exp.experiment_id]) if "fedsweep.trial_index" in r.data.tags] if exp else []

    def local_mid_run() -> bool:  # a trial of the second method past its first round and short of its last
        return any(x.info.status == "RUNNING" and x.data.tags.get("fedsweep.algorithm") == "local"
                   and 1 <= max((m.step for m in c.get_metric_history(x.info.run_id, "uploads")), default=0) < 5
                   for x in trials())
    err = ctrl_c_when(driver, local_mid_run)
    assert driver.returncode == 130, err[-3000:]
    assert "1 of its 2 methods had every run and are recorded (fedavg)" in err, err[-3000:]
    folder = tmp_path / "out" / "stop"
    state = json.loads((folder / "bench_state.json").read_text())
    fedavg = state["methods"]["fedavg"]
    assert state["in_flight"] == {"tuning": {"methods": ["fedavg", "local"], "sweep_run": fedavg["tune_run"]}}
    assert "chosen" not in state["methods"]["local"]
    assert fedavg["tried"] == 2 and (folder / "runs" / f"{fedavg['tune_run']}.csv").exists()
    assert c.get_run(state["run_id"]).info.status == "KILLED"  # the benchmark's run ends with its command
    fedavg_runs = {x.info.run_id for x in trials() if x.data.tags["fedsweep.algorithm"] == "fedavg"}
    assert len(fedavg_runs) == 2
    monkeypatch.chdir(tmp_path)
    bench = load_bench(path, check_cluster=False)
    assert _sweep_keys(bench, state, "tuning", ["local"], True, uri) == ["fedavg", "local"]  # Tune's sweep, this store's run

    # another store, Tune's state still in the storage: the second method is tuned alone (Tune's saved sweep belongs to
    # a run this store lacks), the first's choice made again from the runs saved in the folder
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(folder, elsewhere / "stop")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", other := f"sqlite:///{elsewhere / 'mlflow.db'}")
    _, moved_state, _, _ = open_state(bench, elsewhere, resume=True)
    assert moved_state["methods"]["fedavg"]["chosen"] == fedavg["chosen"] and "chosen" not in moved_state["methods"]["local"]
    assert _sweep_keys(bench, moved_state, "tuning", ["local"], True, other) == ["local"]

    r = subprocess.run([*command, "--resume"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    state = json.loads((folder / "bench_state.json").read_text())
    assert state["methods"]["fedavg"]["tune_run"] == fedavg["tune_run"] == state["methods"]["local"]["tune_run"]
    assert state["methods"]["fedavg"]["chosen"] == fedavg["chosen"] and "in_flight" not in state
    assert c.get_run(state["run_id"]).info.status == "FINISHED"  # set RUNNING again by --resume, then ended
    tuning = [x for x in trials() if x.data.tags.get("mlflow.parentRunId") == fedavg["tune_run"]]
    assert {x.info.run_id for x in tuning if x.data.tags["fedsweep.algorithm"] == "fedavg"} == fedavg_runs  # not rerun
    assert sorted(x.info.status for x in tuning) == ["FINISHED"] * 4  # the stopped trial run again (its first attempt deleted)
    table = (folder / "table_b1.md").read_text()
    assert "fedavg" in table and "local" in table
