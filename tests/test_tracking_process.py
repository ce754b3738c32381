"""``fedsweep run``'s run kept by a child process (:mod:`fedsweep.tracking_process`): the run it writes is the one the
same calls write in process; an error of the child's is raised in the command; a command that ends without
finishing its run (killed, or interrupted with Ctrl-C) leaves it ended, and no process behind. Real MLflow (SQLite)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from fedsweep.experiment import InProcessRunner, execute
from fedsweep.loading import validate
from fedsweep.tracking import RunLogger, client, ensure_experiment, run_record
from fedsweep.tracking_process import TrackingProcess, TrackingProcessError
from tests.conftest import ROOT, config_dict

CFG = config_dict(rounds=5, eval_every=2, resources=None, tracking={"log_plot": True})


def _run(c, run_id: str) -> dict:
    """Everything a run holds that the two ways of logging must agree on."""
    run = c.get_run(run_id)
    metrics = {k: [(m.step, m.value) for m in sorted(c.get_metric_history(run_id, k), key=lambda m: m.step)]
               for k in run.data.metrics if k != "wall_time_s"}  # the one metric of the clock, not of the data
    artifacts = sorted(a.path for top in c.list_artifacts(run_id) for a in (c.list_artifacts(run_id, top.path) if top.is_dir else [top]))
    return {"params": run.data.params, "tags": {k: v for k, v in run.data.tags.items() if not k.startswith("mlflow.")},
            "metrics": metrics, "artifacts": artifacts, "status": run.info.status, "name": run.info.run_name}


def test_the_child_writes_the_run_the_same_calls_write_in_process(tmp_path):
    cfg = validate(CFG)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    c = client(uri)
    runs = []
    for way in ("in process", "child"):
        if way == "child":
            logger = TrackingProcess()
            logger.start(uri, "same", run_record(cfg), "one run")
            assert logger.started() == logger.run_id
            maps = Path(f"/proc/{logger.proc.pid}/maps").read_text()  # the libraries the child has loaded
            assert "libtorch_cpu" not in maps, "the tracking process imported torch"
        else:
            logger = RunLogger(uri, ensure_experiment(uri, "same"), cfg, "one run")
        logger.log_metric("time_to_first_round_s", 1.5, step=1)
        history = execute(cfg, logger, runner=InProcessRunner(cfg))
        runs.append((logger.run_id, history))
    (a, history_a), (b, history_b) = runs
    clockless = lambda history: [{k: v for k, v in m.items() if k != "wall_time_s"} for m in history]
    assert clockless(history_a) == clockless(history_b)
    in_process, child = _run(c, a), _run(c, b)
    assert child == in_process
    assert child["status"] == "FINISHED" and "plots/accuracy_vs_round.png" in child["artifacts"]
    assert [s for s, _ in child["metrics"]["personalized_accuracy_mean"]] == [0, 2, 4, 5]
    assert child["tags"]["fedsweep.in_process"] == "true"


def test_an_error_in_the_child_is_raised_in_the_command_at_its_next_call(tmp_path):
    cfg = validate(CFG)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    logger = TrackingProcess()
    try:
        logger.start(uri, "errors", run_record(cfg), "errors")
        logger.started()
        logger.set_tag("x" * 1000, "a key longer than MLflow allows")  # refused by MLflow's checks, in the child
        with pytest.raises(TrackingProcessError, match="MlflowException: 'key' exceeds the maximum length"):
            logger.flush()
        assert logger.flush() is True  # the child goes on after an error
    finally:
        logger.close()
    assert logger.proc.returncode is not None
    assert client(uri).get_run(logger.run_id).info.status == "KILLED"  # closed without finish: the child ended it


def test_a_child_that_never_started_a_run_is_stopped_and_creates_no_store(tmp_path):
    logger = TrackingProcess()
    logger.close()  # bad input: the command stops before it sends the run
    assert logger.proc.returncode is not None
    assert not list(tmp_path.iterdir())
    with pytest.raises(TrackingProcessError, match="ended"):
        logger.start(f"sqlite:///{tmp_path / 'mlflow.db'}", "x", run_record(validate(CFG)), "x")


@pytest.mark.slow  # a fedsweep process: end to end
def test_ctrl_c_ends_the_commands_run_and_leaves_no_process(tmp_path):
    """The terminal sends Ctrl-C to the command and its child: the child ignores it, the command ends the run
    (FAILED, outcome error, as in process) and the child ends with it."""
    from mlflow import MlflowClient

    path = tmp_path / "long.yaml"
    long = config_dict(rounds=100_000, eval_every=50, resources=None, tracking={"experiment": "interrupted"})
    path.write_text(yaml.safe_dump(long))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    entry = "import sys; sys.argv = ['fedsweep', 'run', sys.argv[1]]; from fedsweep.cli import entry; entry()"
    cmd = [sys.executable, "-c", entry, str(path)]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # a process group of its own: the terminal's Ctrl-C is sent to it
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "round   50" in line:
            break
    children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True, check=False).stdout.split()
    assert len(children) == 1, "".join(lines)
    os.killpg(proc.pid, signal.SIGINT)
    rest, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0
    deadline = time.monotonic() + 30
    while any(os.path.exists(f"/proc/{pid}") for pid in children):
        assert time.monotonic() < deadline, "the tracking process outlived the command"
        time.sleep(0.1)
    c = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = c.search_runs([c.get_experiment_by_name("interrupted").experiment_id])
    assert run.info.status == "FAILED" and run.data.tags["fedsweep.outcome"] == "error", rest[-2000:]
    assert 50 in [m.step for m in c.get_metric_history(run.info.run_id, "personalized_accuracy_mean")]


def test_run_record_holds_what_the_run_is_created_with():
    cfg = validate(config_dict(algorithm={"name": "perfedavg", "evaluation": "adapt_on_test_batch"}))
    record = run_record(cfg, {"algorithm.local_lr": 0.1, "seed": 1}, {"extra": "tag"}, "parent")
    assert record.tags["fedsweep.setting_label"] == "local_lr=0.1" and record.tags["extra"] == "tag"
    assert record.tags["mlflow.parentRunId"] == "parent" and "leaks test data" in record.tags["fedsweep.evaluation"]
    assert record.params["algorithm.local_lr"] == "0.1" and record.title == cfg.name
    assert type(record)(**record.to_json()) == record  # what the child rebuilds from the JSON line
