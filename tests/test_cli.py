"""The `fedsweep` command as a user runs it: a subprocess, exit codes, messages, nothing logged on bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT, config_dict


def _env(env_extra=None) -> dict:
    env = {**os.environ, **(env_extra or {})}
    env.pop("MLFLOW_TRACKING_URI", None)
    env.pop("RAY_ADDRESS", None)
    return env


def fedsweep(*args, cwd, env_extra=None, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "fedsweep.cli", *args], cwd=cwd, env=_env(env_extra), capture_output=True, text=True,
        timeout=timeout, check=False,
    )


# fedsweep.cli.main for several command lines in ONE fresh Python process (a start imports torch and
# sklearn: ~5 s here), each in its own working directory; per command line the exit code, the output,
# and whether it initialized Ray or created an MLflow store there.
_BATCH = r"""
import contextlib, io, json, os, sys
import ray
from fedsweep.cli import main
out = {}
for key, (argv, cwd) in json.loads(sys.stdin.read()).items():
    os.chdir(cwd)
    err, std = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(std):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
        except Exception as e:  # recorded, so that one broken case does not hide the others
            code = repr(e)
    out[key] = {"code": code, "stdout": std.getvalue(), "stderr": err.getvalue(), "ray": ray.is_initialized(),
                "mlflow_store": os.path.exists("mlflow.db") or os.path.exists("mlruns")}
    ray.shutdown()  # a case that started Ray must not make the next one look as if it did
print(json.dumps(out))
"""


def fedsweep_main_batch(invocations: dict[str, tuple[list[str], Path]], timeout=300) -> dict[str, dict]:
    r = subprocess.run([sys.executable, "-c", _BATCH], input=json.dumps({k: (a, str(c)) for k, (a, c) in invocations.items()}),
                       env=_env(), capture_output=True, text=True, timeout=timeout, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.splitlines()[-1])


@pytest.mark.slow  # a fedsweep process per file or case: end to end, outside `make test-fast`
def test_validate_ok_on_shipped_sweeps(tmp_path, full_size_image_root):
    # The MNIST/CIFAR protocols check their files and splits at validation: give them full-size stand-ins,
    # named relative to the folder the command is typed in (as FEDSWEEP_DATA_DIR=../shared/data is).
    env = {"FEDSWEEP_DATA_DIR": os.path.relpath(full_size_image_root, tmp_path)}
    files = [str(f) for f in sorted((ROOT / "sweeps").glob("*.yaml"))]
    r = fedsweep("validate", *files, cwd=tmp_path, env_extra=env)  # all in one call
    assert r.returncode == 0, r.stderr
    assert [line.split(": OK")[0] for line in r.stdout.splitlines()] == files
    assert not (tmp_path / "mlflow.db").exists()


BAD = {
    "unknown key": ({"roundz": 3}, "roundz: unknown key 'roundz'"),
    "bad rate": ({"algorithm": {"participation_rate": 2}}, "algorithm.participation_rate: Input should be less than or equal to 1"),
    "too many sampled": (
        {"algorithm": {"participation_rate": None, "clients_per_round": 9}},
        "algorithm.clients_per_round: 9 samples more clients than exist",
    ),
    "cannot fit": ({"data": {"num_clients": 50}, "resources": {"client_cpus": 0.05}}, "2.75 CPUs"),
    "unknown grid field": ({"algorithm": {"lr": {"grid": [1, 2]}}}, "algorithm.lr: unknown key 'lr'"),
    "missing image files": (
        {"data": {"dataset": "cifar10", "root": "no-data-here"}},
        "data.root: cifar10 files not found under",
    ),
}
COMMANDS = ["validate", "run", "sweep"]


def _bad_file(folder: Path, case: str) -> Path:
    change = BAD[case][0]
    # cluster_cpus: 2 so that the plan is checked against a 2-CPU cluster whatever this machine has.
    resources = {"server_cpus": 0.25, **change.get("resources", {}), "cluster_cpus": 2}
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "bad.yaml"
    path.write_text(yaml.safe_dump(config_dict(**{**change, "resources": resources})))
    return path


@pytest.fixture(scope="module")
def bad_input_results(tmp_path_factory):
    """Every bad case under every command, and ``validate`` of a bad and a good file, each in its own folder."""
    root = tmp_path_factory.mktemp("bad-input")
    calls = {}
    for case in BAD:
        for command in COMMANDS:
            folder = root / f"{command}-{case.replace(' ', '_')}"
            calls[f"{command}-{case}"] = ([command, str(_bad_file(folder, case))], folder)
    folder = root / "two-files"
    calls["validate-two-files"] = (["validate", str(_bad_file(folder, "unknown key")), str(ROOT / "sweeps" / "default.yaml")], folder)
    return fedsweep_main_batch(calls)


@pytest.mark.parametrize("case", list(BAD))
@pytest.mark.parametrize("command", COMMANDS)
def test_bad_input_exits_2_before_anything_starts(case, command, bad_input_results):
    expected = BAD[case][1]
    assert_refused(bad_input_results[f"{command}-{case}"], expected)


def assert_refused(r: dict, expected: str) -> None:
    """Exit 2 with the problem named, and nothing started: no MLflow run (not even a store), no Ray."""
    assert r["code"] == 2, r
    assert expected in r["stderr"]
    assert "invalid configuration" in r["stderr"]
    assert not r["mlflow_store"]
    assert not r["ray"]


def test_validate_checks_every_file_and_fails_if_one_is_bad(bad_input_results):
    r = bad_input_results["validate-two-files"]
    assert r["code"] == 2
    assert "bad.yaml:" in r["stderr"] and "roundz: unknown key 'roundz'" in r["stderr"]
    assert f"{ROOT / 'sweeps' / 'default.yaml'}: OK" in r["stdout"]  # the good file after the bad one is still checked


@pytest.mark.slow  # a fedsweep process per file or case: end to end, outside `make test-fast`
def test_bad_input_through_the_command_line_exits_2_before_ray_starts(tmp_path):
    # The same path as the batch above, through `python -m fedsweep.cli` and sys.exit: one case.
    r = fedsweep("sweep", str(_bad_file(tmp_path, "cannot fit")), cwd=tmp_path, timeout=120)
    assert_refused({"code": r.returncode, "stdout": r.stdout, "stderr": r.stderr,
                    "mlflow_store": (tmp_path / "mlflow.db").exists() or (tmp_path / "mlruns").exists(),
                    "ray": "Started a local Ray instance" in r.stderr}, BAD["cannot fit"][1])


def test_the_command_ends_as_python_does_but_for_the_modules_teardown(tmp_path):
    """``fedsweep`` (``fedsweep.cli:entry``) ends without finalizing its modules, after what Python's own end does
    first: a thread pool's idle worker is stopped, a thread that is not a daemon is waited for, the exit handlers
    run, all output is flushed, and the code is main's (2 here: one of the two files is bad)."""
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text(yaml.safe_dump(config_dict()))
    bad.write_text(yaml.safe_dump(config_dict(rounds=-1)))
    code = f"""
import atexit, sys, threading, time
from pathlib import Path
from fedsweep.cli import entry
atexit.register(lambda: Path({str(tmp_path / 'atexit')!r}).write_text('ran'))
threading.Thread(target=lambda: (time.sleep(0.5), Path({str(tmp_path / 'thread')!r}).write_text('done'))).start()
from concurrent.futures import ThreadPoolExecutor
pool = ThreadPoolExecutor(1); pool.submit(lambda: None).result()  # an idle worker, not a daemon: stopped, not waited on forever
sys.stdout.write('x' * 100000)  # buffered: flushed before the end
class Finalized:
    def __del__(self):
        Path({str(tmp_path / 'finalized')!r}).write_text('yes')
kept = Finalized()  # finalized only by the modules' teardown, which is skipped
sys.argv = ['fedsweep', 'validate', {str(good)!r}, {str(bad)!r}]
entry()
"""
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stdout.startswith("x" * 100000) and f"{good}: OK" in r.stdout and "rounds" in r.stdout + r.stderr
    assert (tmp_path / "atexit").read_text() == "ran" and (tmp_path / "thread").read_text() == "done"
    assert not (tmp_path / "finalized").exists()


@pytest.mark.ray
def test_run_command_logs_one_run_with_progress(tmp_path):
    from mlflow import MlflowClient

    path = tmp_path / "one.yaml"
    path.write_text(yaml.safe_dump(config_dict(rounds=3, eval_every=1, tracking={"experiment": "cli-run"})))
    r = fedsweep("run", str(path), cwd=tmp_path, env_extra={"RAY_DEDUP_LOGS": "0"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "round    3  personalized acc" in r.stdout
    c = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = c.search_runs([c.get_experiment_by_name("cli-run").experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    assert [m.step for m in c.get_metric_history(runs[0].info.run_id, "global_accuracy")] == [0, 1, 2, 3]


@pytest.mark.slow
def test_run_command_runs_a_one_process_layout_in_its_own_process(tmp_path):
    """A file without a layout, a stacked model: the chosen layout is one process, which `fedsweep run` runs
    itself, starting no Ray; every round in MLflow, the run tagged, the time to the first round logged."""
    from mlflow import MlflowClient

    path = tmp_path / "here.yaml"
    path.write_text(yaml.safe_dump({**config_dict(rounds=3, eval_every=2, tracking={"experiment": "cli-here"}), "resources": {}}))
    r = fedsweep("run", str(path), cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "in this process" in r.stdout and "Started a local Ray instance" not in r.stderr
    c = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = c.search_runs([c.get_experiment_by_name("cli-here").experiment_id])
    assert run.info.status == "FINISHED" and run.data.tags["fedsweep.in_process"] == "true"
    assert run.data.params["resources.client_workers"] == "1" and run.data.params["resources.vectorize_clients"] == "True"
    assert [m.step for m in c.get_metric_history(run.info.run_id, "uploads")] == [0, 1, 2, 3]
    assert [m.step for m in c.get_metric_history(run.info.run_id, "global_accuracy")] == [0, 2, 3]
    assert run.data.metrics["time_to_first_round_s"] > 0


def test_algorithms_lists_parameters_with_aliases(capsys):
    from fedsweep.cli import main  # in this process: the listing is what is checked, not a start

    assert main(["algorithms"]) == 0
    out = capsys.readouterr().out
    assert "| fedavg | local_lr | beta, β | 0.05 |" in out
    assert "| fedavg | local_steps | tau, τ | 10 |" in out


@pytest.mark.slow
def test_ui_serves_the_store_without_mlflow_job_processes(tmp_path):
    """`fedsweep ui`: MLflow's UI on 127.0.0.1 for the store, one worker process (MLflow's default is 4); MLflow's job
    execution (a job runner and seven huey consumers, each with MLflow loaded) stays off, as fedsweep runs no MLflow job."""
    import signal

    import psutil

    from tests.services import wait_healthy
    from tests.test_job_submit import free_port

    port = free_port()
    env = _env()
    env.pop("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", None)
    env.pop("MLFLOW_WORKERS", None)
    ui = subprocess.Popen([sys.executable, "-m", "fedsweep.cli", "ui", "--port", str(port), "--tracking-uri",
                           f"sqlite:///{tmp_path / 'mlflow.db'}"], cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", ui, 120)
        session = [p.cmdline() for p in psutil.process_iter() if os.getsid(p.pid) == ui.pid]
        assert any("mlflow" in " ".join(c) for c in session)
        assert not [c for c in session if "huey" in " ".join(c) or "_job_runner" in " ".join(c)], session
        [ui_cmd] = [c for c in session if c[1:4] == ["-m", "mlflow", "ui"]]
        assert ui_cmd[-2:] == ["--workers", "1"]  # one analyst: one worker process
    finally:
        os.killpg(ui.pid, signal.SIGTERM)
        ui.wait(timeout=60)
