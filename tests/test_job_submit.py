"""The cluster path end to end: `ray start --head` on 127.0.0.1, a tiny sweep submitted with `ray job submit`,
the job SUCCEEDED, and the MLflow store holding the sweep's parent run and one finished run per trial."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from tests.conftest import config_dict

pytestmark = [pytest.mark.ray, pytest.mark.slow]

RAY = str(Path(sys.executable).with_name("ray"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def head_node(tmp_path):
    """A one-node Ray cluster of its own (its own ports and temp dir), stopped with its process group."""
    gcs, dash, agent, agent_grpc, metrics, runtime_env = (free_port() for _ in range(6))
    # Clusters started by `ray start` use token authentication (Ray 2.60); the CLI then needs the mode
    # and finds the token `ray start` wrote to ~/.ray/auth_token.
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_AUTH_MODE"] = "token"
    # as in an activated virtual environment: the job's entrypoint finds `fedsweep` on PATH
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    temp = Path("/tmp") / f"rayjob{os.getpid()}"  # short: Ray's socket paths have a length limit
    with (tmp_path / "head.log").open("w") as log:
        proc = subprocess.Popen(
            [RAY, "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={gcs}",
             "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", "--num-cpus=2", "--num-gpus=0",
             f"--temp-dir={temp}", "--include-dashboard=true",
             # its own agent ports, so that another Ray instance on the machine (the suite's) does not collide
             f"--dashboard-agent-listen-port={agent}", f"--dashboard-agent-grpc-port={agent_grpc}",
             f"--metrics-export-port={metrics}", f"--runtime-env-agent-port={runtime_env}"],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )
        try:
            address = f"http://127.0.0.1:{dash}"
            deadline, last_error = time.time() + 120, ""
            while time.time() < deadline:
                r = subprocess.run([RAY, "job", "list", "--address", address], check=False, capture_output=True,
                                   text=True, env=env)
                if r.returncode == 0:
                    break
                last_error = r.stderr[-1500:]
                if proc.poll() is not None:
                    pytest.fail(f"ray start exited: {(tmp_path / 'head.log').read_text()[-3000:]}")
                time.sleep(2)
            else:
                pytest.fail(f"the head's job server did not answer: {last_error}")
            yield address, env
        finally:
            stop(proc)


def stop(proc: subprocess.Popen) -> None:
    """Stop the head's process tree. Ray's own shutdown on SIGTERM waits out grace periods (about 30 s
    here); this cluster's data is disposable, so what has not exited 1 s after SIGTERM is killed."""
    try:
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        os.killpg(proc.pid, signal.SIGTERM)
    except (psutil.NoSuchProcess, ProcessLookupError):  # `ray start` already exited (and its group with it)
        return
    _, alive = psutil.wait_procs(tree, timeout=1)
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(alive, timeout=30)
    proc.wait(timeout=30)


def submit(cmd: list[str], env: dict, wait_s: float = 120) -> subprocess.CompletedProcess:
    """``ray job submit``, again while the job server answers that no agent is available yet: it waits 10 s for the
    head's dashboard agent to register (``WAIT_AVAILABLE_AGENT_TIMEOUT``), which on a loaded 2-core machine took
    longer, and answers before it creates the job ("please try again later")."""
    deadline = time.time() + wait_s
    while True:
        r = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, timeout=900)
        if r.returncode == 0 or "No available agent" not in r.stderr or time.time() > deadline:
            return r
        time.sleep(2)


def test_sweep_submitted_with_ray_job_submit(head_node, tmp_path):
    from mlflow import MlflowClient

    address, env = head_node
    work = tmp_path / "job"
    (work / "sweeps").mkdir(parents=True)
    db = tmp_path / "mlflow.db"
    body = config_dict(
        algorithm={"local_lr": {"grid": [0.1, 0.05]}}, rounds=3, eval_every=1, tracking={"experiment": "job-test"},
        resources=None,
    )
    body["sweep"] = {"name": "job", "max_concurrent_trials": 2, "seeds": [0]}
    sweep_file = work / "sweeps" / "tiny.yaml"
    # the sweep file is the entrypoint: line 1 is a shebang comment, and the file has its run bit
    sweep_file.write_text("#!/usr/bin/env -S fedsweep sweep\n" + yaml.safe_dump(body))
    sweep_file.chmod(0o755)
    # runtime-env needs from a file, as the README documents (infra/runtime_env.yaml)
    (tmp_path / "runtime_env.yaml").write_text(yaml.safe_dump({"env_vars": {"MLFLOW_TRACKING_URI": f"sqlite:///{db}"}}))
    r = submit([RAY, "job", "submit", "--address", address, "--working-dir", str(work), "--submission-id", "fedsweep-e2e",
                "--runtime-env", str(tmp_path / "runtime_env.yaml"), "--", "sweeps/tiny.yaml", "--quiet"], env)
    status = subprocess.run([RAY, "job", "status", "--address", address, "fedsweep-e2e"],
                            check=False, capture_output=True, text=True, env=env)
    assert r.returncode == 0 and "succeeded" in status.stdout.lower(), (r.stdout[-4000:], r.stderr[-3000:], status.stdout[-500:])
    assert "| fedavg |" in r.stdout  # the job printed the table
    c = MlflowClient(f"sqlite:///{db}")
    runs = c.search_runs([c.get_experiment_by_name("job-test").experiment_id])
    parents = [x for x in runs if x.data.tags.get("fedsweep.sweep") == "true"]
    children = [x for x in runs if "mlflow.parentRunId" in x.data.tags]
    assert len(parents) == 1 and len(children) == 2 and len(runs) == 3
    assert all(x.info.status == "FINISHED" for x in runs)
    for child in children:
        assert [m.step for m in c.get_metric_history(child.info.run_id, "global_accuracy")] == [0, 1, 2, 3]
