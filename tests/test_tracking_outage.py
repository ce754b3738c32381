"""A tracking server that goes away mid-sweep (issue 36), with the real server: PostgreSQL behind
`infra/mlflow_server.sh`, stopped while trials train and started again on the same port and store.

A trial whose writes fail keeps training and holds its metrics; written when the server answers again, every round's
metrics are in its run exactly once, as many as an uninterrupted run of the same config logs. An outage longer than
``tracking.outage_limit_s`` fails the trial with an error naming the limit; its run holds every round up to its last
checkpoint, and the retry from that checkpoint completes it, nothing missing and nothing twice."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from fedsweep import metric_writer, tracking
from fedsweep.experiment import InProcessRunner, execute
from fedsweep.loading import load_sweep, validate
from fedsweep.metric_writer import TrackingOutage
from fedsweep.tracking import RunLogger, ensure_experiment
from tests.conftest import config_dict

pytestmark = [pytest.mark.ray, pytest.mark.slow]

FEDSWEEP = str(Path(sys.executable).with_name("fedsweep"))
OUTAGE_S = 30
# The server starts three times here; one worker process starts in a third of the time of MLflow's four, and
# answers two trials (the UI test's server keeps the script's default).
MLFLOW_WORKERS = 1


def metric_steps(uri: str, run_id: str) -> dict[str, list[int]]:
    """Every metric key of the run with the steps it holds, sorted, repeats kept."""
    from mlflow import MlflowClient

    c = MlflowClient(uri)
    return {k: sorted(m.step for m in c.get_metric_history(run_id, k)) for k in c.get_run(run_id).data.metrics}


def assert_each_round_once(steps: dict[str, list[int]], reference: dict[str, list[int]]) -> None:
    assert all(len(set(s)) == len(s) for s in steps.values()), {k: s for k, s in steps.items() if len(set(s)) < len(s)}
    assert steps == reference
    assert sum(map(len, steps.values())) == sum(map(len, reference.values()))


def test_an_outage_past_the_limit_fails_the_trial_and_its_retry_loses_nothing(mlflow_server, tmp_path, monkeypatch):
    """In this process (no Ray): the server is stopped in round 7, once rounds 0-7 are written; the trial trains on,
    holding its rounds (past 40 metrics in a file) and saving no checkpoint (a sweep saves one once the logger's
    rounds are written, ``RunLogger.after_written``), until the limit fails it. Its run holds rounds 0-7 (the last
    checkpoint's, 6, and one more); the retry from that checkpoint, once the server is back, logs the rest once."""
    from mlflow import MlflowClient

    monkeypatch.setattr(metric_writer, "MAX_HELD", 40)
    monkeypatch.setattr(tracking, "LINGER_S", 0.0)  # each evaluation round hands its rounds to the writer, which holds them
    url, limit = mlflow_server.url, 2
    cfg = validate(config_dict(rounds=20, eval_every=2, resources=None,
                               tracking={"experiment": "outage-limit", "outage_limit_s": limit}))
    exp = ensure_experiment(url, "outage-limit")
    logger = RunLogger(url, exp, cfg, "limit")
    checkpoints: dict[int, dict] = {}
    seen: dict[str, object] = {}

    def on_round(m: dict[str, float]) -> None:
        rnd = int(m["round"])
        if rnd == 7:
            assert logger.flush()  # rounds 0-7 written (and the checkpoint of round 6 saved) before the outage
            mlflow_server.stop()
        if rnd == 11:  # the outage began at round 8's write; let it outlast the limit
            deadline = time.monotonic() + 60
            while (since := logger.writer.outage_since) is None or time.monotonic() - since <= limit:
                assert time.monotonic() < deadline, "the writer never saw the outage"
                time.sleep(0.1)
            seen.update(held=logger.writer.held, spill_file=logger.writer.spill_file)

    with pytest.raises(TrackingOutage, match=rf"tracking\.outage_limit_s={limit}: .* from round 8 on are held") as failed:
        execute(cfg, logger, on_round, checkpoint_every=3, runner=InProcessRunner(cfg),
                on_checkpoint=lambda m, checkpoint: logger.after_written(
                    lambda: checkpoints.update({int(m["round"]): checkpoint})))
    assert url in str(failed.value)
    # none at 9 or 12: rounds before them were not in MLflow (round 3's, if not yet saved when round 6's came, is
    # replaced by it: the newer supersedes)
    assert max(checkpoints) == 6 and set(checkpoints) <= {3, 6}
    assert seen["held"] > 40 and seen["spill_file"] is not None  # rounds 8-11, part of them in the file
    assert not Path(seen["spill_file"]).exists()  # removed with the writer: the retry recomputes those rounds

    mlflow_server.start()
    c = MlflowClient(url)
    assert c.get_run(logger.run_id).info.status == "RUNNING"  # not ended by an attempt that could not reach it
    assert sorted(m.step for m in c.get_metric_history(logger.run_id, "uploads")) == list(range(8))

    retry = RunLogger(url, exp, cfg, "limit", run_id=logger.run_id)  # what a Tune retry does (fedsweep.sweep)
    assert retry.logged_through == 7
    execute(cfg, retry, runner=InProcessRunner(cfg), resume=checkpoints[6])
    reference = RunLogger(url, exp, cfg, "reference")
    execute(cfg, reference, runner=InProcessRunner(cfg))
    assert c.get_run(logger.run_id).info.status == "FINISHED"
    assert_each_round_once(metric_steps(url, logger.run_id), metric_steps(url, reference.run_id))
    uploads = {m.step: m.value for m in c.get_metric_history(logger.run_id, "uploads")}
    assert uploads == {m.step: m.value for m in c.get_metric_history(reference.run_id, "uploads")}


def test_an_outage_past_the_limit_fails_fedsweep_runs_run_through_its_tracking_process(mlflow_server):
    """`fedsweep run`'s run, kept by its child (:mod:`fedsweep.tracking_process`): the same outage fails the command
    with the child's :class:`TrackingOutage`, at one of its next calls; the run holds the rounds written before it and
    stays RUNNING, as in process."""
    from mlflow import MlflowClient

    from fedsweep.tracking import run_record
    from fedsweep.tracking_process import TrackingProcess

    if mlflow_server.proc is None:  # left stopped by a failed test before
        mlflow_server.start()
    url, limit = mlflow_server.url, 2
    cfg = validate(config_dict(rounds=20, eval_every=2, resources=None,
                               tracking={"experiment": "outage-child", "outage_limit_s": limit}))
    logger = TrackingProcess()

    def on_round(m: dict[str, float]) -> None:
        if m["round"] == 6:
            assert logger.flush()  # rounds 0-6 written (the child may lag the rounds): the outage starts at round 7's
        if m["round"] == 7:
            mlflow_server.stop()
        if m["round"] == 12:  # the child's writer met the outage at round 8's write: let it outlast the limit
            time.sleep(limit + 5)

    try:
        logger.start(url, "outage-child", run_record(cfg), "child")
        logger.started()
        with pytest.raises(TrackingOutage, match=rf"tracking\.outage_limit_s={limit}: .* from round 7 on are held"):
            execute(cfg, logger, on_round, runner=InProcessRunner(cfg))
    finally:
        logger.close()
        mlflow_server.start()
    assert logger.proc.returncode == 0
    c = MlflowClient(url)
    assert c.get_run(logger.run_id).info.status == "RUNNING"
    assert sorted(m.step for m in c.get_metric_history(logger.run_id, "uploads")) == list(range(7))


def run_references(sweep_file: str, *uris: str) -> None:
    """Trial ``i`` of the sweep, uninterrupted, in this process into ``uris[i]``; with one local step a round instead
    of the trials' 100: which metrics a round logs, and at which steps (what the test compares), does not depend on
    τ, and the trials' steps would cost as much CPU as the sweep itself (2 × 57 s on a slow day with 250)."""
    trials = load_sweep(sweep_file).trials
    for index, uri in enumerate(uris):
        cfg = trials[index].config
        cfg = validate({**cfg.model_dump(), "algorithm": {**cfg.algorithm.model_dump(), "local_steps": 1}})
        logger = RunLogger(uri, ensure_experiment(uri, "reference"), cfg, run_name=f"trial {index}")
        execute(cfg, logger, runner=InProcessRunner(cfg))


def test_a_sweep_trains_through_an_outage_and_logs_every_round_once(mlflow_server, tmp_path):
    """Two trials at once (`fedsweep sweep`, its own Ray instance); once both have written some rounds the server is
    stopped for 30 s and started again. Then each trial's config runs uninterrupted into a SQLite store
    (:func:`run_references`)."""
    from mlflow import MlflowClient

    if mlflow_server.proc is None:  # left stopped by a failed test before
        mlflow_server.start()
    url = mlflow_server.url
    rounds = 100
    body = config_dict(algorithm={"local_steps": 100}, rounds=rounds, eval_every=4, resources=None,
                       tracking={"experiment": "outage", "tracking_uri": url})
    body["sweep"] = {"name": "outage", "max_concurrent_trials": 2, "seeds": [0, 1], "checkpoint_every": 4,
                     "storage_path": str(tmp_path / "ray_results")}
    path = tmp_path / "outage.yaml"
    path.write_text(yaml.safe_dump(body))
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_RUN_ID", "MLFLOW_TRACKING_URI")}
    log = open(tmp_path / "sweep.log", "w")  # noqa: SIM115 - the driver writes it until it ends
    started = time.time()
    driver = subprocess.Popen([FEDSWEEP, "sweep", str(path), "--quiet"], stdout=log, stderr=subprocess.STDOUT, env=env,
                              cwd=tmp_path, start_new_session=True)
    c = MlflowClient(url)

    def trials() -> list:
        exp = c.get_experiment_by_name("outage")
        runs = c.search_runs([exp.experiment_id]) if exp else []
        return [r for r in runs if "mlflow.parentRunId" in r.data.tags]

    def sweep_log() -> str:
        return (tmp_path / "sweep.log").read_text()[-4000:]

    try:
        deadline = time.time() + 300
        while True:  # both trials running, each past its first evaluation's write
            runs = trials()
            written = [max((m.step for m in c.get_metric_history(r.info.run_id, "uploads")), default=-1) for r in runs]
            if len(runs) == 2 and min(written) >= 4:
                break
            assert driver.poll() is None and time.time() < deadline, f"the sweep ended or stalled:\n{sweep_log()}"
            time.sleep(1)
        assert all(r.info.status == "RUNNING" for r in runs) and max(written) < rounds
        down_at = time.time()
        mlflow_server.stop()
        while time.time() < down_at + OUTAGE_S:
            assert driver.poll() is None, f"the sweep ended during the outage:\n{sweep_log()}"
            time.sleep(1)
        mlflow_server.start()
        up_at = time.time()
        assert driver.wait(timeout=420) == 0, sweep_log()
        ended = time.time()
    finally:
        if driver.poll() is None:
            driver.kill()
        log.close()
    ref_uris = [f"sqlite:///{tmp_path / f'reference_{i}.db'}" for i in range(2)]
    run_references(str(path), *ref_uris)
    print(f"sweep {ended - started:.0f} s; stopped after {down_at - started:.0f} s with rounds {written} written, "
          f"started again {up_at - down_at:.0f} s later")

    runs = trials()
    assert len(runs) == 2 and all(r.info.status == "FINISHED" and r.data.tags["fedsweep.outcome"] == "finished" for r in runs)
    for r in runs:
        index = int(r.data.tags["fedsweep.trial_index"])
        ref = MlflowClient(ref_uris[index])
        (ref_run,) = ref.search_runs([ref.get_experiment_by_name("reference").experiment_id])
        steps = metric_steps(url, r.info.run_id)
        assert_each_round_once(steps, metric_steps(ref_uris[index], ref_run.info.run_id))
        assert steps["uploads"] == list(range(rounds + 1))
        # rounds trained while the server was down were held and written afterwards, with the time they were taken
        taken = [m.timestamp / 1000 for m in c.get_metric_history(r.info.run_id, "uploads")]
        assert any(down_at < t < up_at for t in taken), (down_at, up_at)
