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
        else:
            logger = RunLogger(uri, ensure_experiment(uri, "same"), cfg, "one run")
        logger.log_metric("time_to_first_round_s", 1.5, step=1)
        history = execute(cfg, logger, lambda m, logger=logger: _no_torch(logger, m), runner=InProcessRunner(cfg))
        runs.append((logger.run_id, history))
    (a, history_a), (b, history_b) = runs
    clockless = lambda history: [{k: v for k, v in m.items() if k != "wall_time_s"} for m in history]
    assert clockless(history_a) == clockless(history_b)
    in_process, child = _run(c, a), _run(c, b)
    assert child == in_process
    assert child["status"] == "FINISHED" and "plots/accuracy_vs_round.png" in child["artifacts"]
    assert [s for s, _ in child["metrics"]["personalized_accuracy_mean"]] == [0, 2, 4, 5]
    assert child["tags"]["fedsweep.in_process"] == "true"


def _no_torch(logger, metrics: dict) -> None:
    """At the last round (the run written, the plot's matplotlib imported): the child has loaded no torch."""
    if isinstance(logger, TrackingProcess) and metrics["round"] == validate(CFG).rounds:
        maps = Path(f"/proc/{logger.proc.pid}/maps").read_text()  # the libraries the child has loaded
        assert "libtorch_cpu" not in maps, "the tracking process imported torch"

def test_an_error_in_the_child_is_raised_once_in_the_command_and_every_call_gets_its_own_answer(tmp_path):
    cfg = validate(CFG)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    logger = TrackingProcess()
    try:
        logger.start(uri, "errors", run_record(cfg), "errors")
        logger.started()
        with pytest.raises(TrackingProcessError, match="MlflowException: 'key' exceeds the maximum length"):
            logger.set_tag("x" * 1000, "a key longer than MLflow allows")  # refused by MLflow's checks, in the child
            logger.flush()  # raised here at the latest (at the set_tag if its answer came first), its own answer still to come
        logger.set_tag("y" * 1000, "refused too: not raised again")
        assert logger.flush() is True  # its own answer, not the earlier flush's
        logger.log_round({"round": 0.0, "personalized_accuracy_mean": 0.5})
        assert logger.flush() is True
    finally:
        logger.close()
    assert logger.proc.returncode == 0
    c = client(uri)
    assert c.get_run(logger.run_id).info.status == "KILLED"  # closed without finish: the child ended it
    assert [m.step for m in c.get_metric_history(logger.run_id, "personalized_accuracy_mean")] == [0]


def test_a_failed_start_is_raised_once_and_the_runs_end_raises_nothing_more(tmp_path):
    (tmp_path / "a-file").write_text("")
    logger = TrackingProcess()
    try:
        logger.start(f"sqlite:///{tmp_path / 'a-file' / 'mlflow.db'}", "x", run_record(validate(CFG)), "x")
        with pytest.raises(TrackingProcessError) as first:
            logger.log_round({"round": 0.0, "uploads": 1.0})
            logger.started()  # raises at the latest here
        logger.log_round({"round": 1.0, "uploads": 1.0})
        assert logger.flush() is False
        logger.finish(None, "FAILED", "error")  # what execute does on the error: it raises nothing else
    finally:
        logger.close()
    assert logger.failed is first.value and logger.run_id is None and logger.proc.returncode == 0


class _Gone:
    """The answers' pipe of a command that has gone."""

    def write(self, text: str) -> None:
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self) -> None:
        pass


def test_the_child_ends_the_run_killed_when_the_command_has_gone(tmp_path):
    """The command killed before it read an answer: the child's writes fail; its input's end ends the run KILLED."""
    import json

    from fedsweep.tracking_process import serve

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    lines = [json.dumps({"op": "start", "uri": uri, "experiment": "gone", "record": run_record(validate(CFG)).to_json(),
                         "run_name": "gone"}),
             json.dumps({"op": "round", "metrics": {"round": 0.0, "uploads": 3.0}}),
             json.dumps({"op": "flush"})]
    serve(iter(line + "\n" for line in lines), _Gone())
    c = client(uri)
    (run,) = c.search_runs([c.get_experiment_by_name("gone").experiment_id])
    assert run.info.status == "KILLED" and [m.step for m in c.get_metric_history(run.info.run_id, "uploads")] == [0]


def test_a_child_that_never_started_a_run_is_stopped_and_reaped():
    logger = TrackingProcess()
    logger.close()  # bad input: the command stops before it sends the run (tests/test_cli.py: no store, exit 2)
    assert logger.proc.returncode is not None
    with pytest.raises(TrackingProcessError, match="ended"):
        logger.start("sqlite:///unused.db", "x", run_record(validate(CFG)), "x")


@pytest.mark.slow  # a fedsweep process each: end to end
@pytest.mark.parametrize(("how", "status"), [("ctrl-c", "FAILED"), ("sigterm", "KILLED"), ("sigkill", "KILLED")])
def test_a_command_stopped_mid_run_leaves_its_run_ended_and_no_process(tmp_path, how, status):
    """Ctrl-C (the terminal sends it to the command and its child: the child ignores it, the command ends the run
    FAILED, outcome error, as in process); SIGTERM to the group (the command ends at once, the child, which ignores it,
    ends the run KILLED when its input ends); SIGKILL to the command alone (the same). No process is left."""
    from mlflow import MlflowClient

    path = tmp_path / "long.yaml"
    long = config_dict(rounds=100_000, eval_every=50, resources=None, tracking={"experiment": "interrupted"})
    path.write_text(yaml.safe_dump(long))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    entry = "import sys; sys.argv = ['fedsweep', 'run', sys.argv[1]]; from fedsweep.cli import entry; entry()"
    cmd = [sys.executable, "-c", entry, str(path)]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # a process group of its own, as a terminal's job
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "round   50" in line:
            break
    children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True, check=False).stdout.split()
    assert len(children) == 1, "".join(lines)
    if how == "sigkill":
        os.kill(proc.pid, signal.SIGKILL)
    else:
        os.killpg(proc.pid, signal.SIGINT if how == "ctrl-c" else signal.SIGTERM)
    rest, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0
    deadline = time.monotonic() + 60
    while any(Path(f"/proc/{pid}").exists() for pid in children):
        assert time.monotonic() < deadline, "the tracking process outlived the command"
        time.sleep(0.1)
    c = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = c.search_runs([c.get_experiment_by_name("interrupted").experiment_id])
    assert run.info.status == status, rest[-2000:]
    if how == "ctrl-c":
        assert run.data.tags["fedsweep.outcome"] == "error"
    assert 50 in [m.step for m in c.get_metric_history(run.info.run_id, "personalized_accuracy_mean")]


def test_run_record_holds_what_the_run_is_created_with():
    cfg = validate(config_dict(algorithm={"name": "perfedavg", "evaluation": "adapt_on_test_batch"}))
    record = run_record(cfg, {"algorithm.local_lr": 0.1, "seed": 1}, {"extra": "tag"}, "parent")
    assert record.tags["fedsweep.setting_label"] == "local_lr=0.1" and record.tags["extra"] == "tag"
    assert record.tags["mlflow.parentRunId"] == "parent" and "leaks test data" in record.tags["fedsweep.evaluation"]
    assert record.params["algorithm.local_lr"] == "0.1" and record.title == cfg.name
    assert type(record)(**record.to_json()) == record  # what the child rebuilds from the JSON line
