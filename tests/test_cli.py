"""The `fedsweep` command as a user runs it: a subprocess, exit codes, messages, nothing logged on bad input."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from tests.conftest import ROOT, config_dict


def fedsweep(*args, cwd, env_extra=None, timeout=300):
    env = {**os.environ, **(env_extra or {})}
    env.pop("MLFLOW_TRACKING_URI", None)
    env.pop("RAY_ADDRESS", None)
    return subprocess.run(
        [sys.executable, "-m", "fedsweep.cli", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def test_validate_ok_on_shipped_sweeps(tmp_path, full_size_image_root):
    # The MNIST/CIFAR protocols check their files and splits at validation: give them full-size stand-ins.
    env = {"FEDSWEEP_DATA_DIR": str(full_size_image_root)}
    for f in sorted((ROOT / "sweeps").glob("*.yaml")):
        r = fedsweep("validate", str(f), cwd=tmp_path, env_extra=env)
        assert r.returncode == 0, r.stderr
        assert "OK" in r.stdout
    assert not (tmp_path / "mlflow.db").exists()


BAD = {
    "unknown key": ({"roundz": 3}, "roundz: unknown key 'roundz'"),
    "bad rate": ({"algorithm": {"participation_rate": 2}}, "algorithm.participation_rate: Input should be less than or equal to 1"),
    "too many sampled": (
        {"algorithm": {"participation_rate": None, "clients_per_round": 9}},
        "clients_per_round=9 samples more clients than exist",
    ),
    "cannot fit": ({"data": {"num_clients": 50}, "resources": {"client_cpus": 0.05}}, "2.75 CPUs"),
    "unknown grid field": ({"algorithm": {"lr": {"grid": [1, 2]}}}, "algorithm.lr: unknown key 'lr'"),
    "missing image files": (
        {"data": {"dataset": "cifar10", "root": "no-data-here"}},
        "data.root: cifar10 files not found under",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
@pytest.mark.parametrize("command", ["validate", "run", "sweep"])
def test_bad_input_exits_2_before_anything_starts(case, command, tmp_path):
    change, expected = BAD[case]
    # cluster_cpus: 2 so that the plan is checked against a 2-CPU cluster whatever this machine has.
    resources = {"server_cpus": 0.25, **change.get("resources", {}), "cluster_cpus": 2}
    raw = config_dict(**{**change, "resources": resources})
    if command == "run" and case == "unknown grid field":
        expected = "a grid is only allowed in a sweep"
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(raw))
    r = fedsweep(command, str(path), cwd=tmp_path, timeout=120)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert expected in r.stderr
    assert "invalid configuration" in r.stderr
    assert not (tmp_path / "mlflow.db").exists()  # no MLflow run, not even a store
    assert "Started a local Ray instance" not in r.stderr  # and no Ray


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


def test_algorithms_lists_parameters_with_aliases(tmp_path):
    r = fedsweep("algorithms", cwd=tmp_path)
    assert r.returncode == 0
    assert "| fedavg | local_lr | beta, β | 0.05 |" in r.stdout
    assert "| fedavg | local_steps | tau, τ | 10 |" in r.stdout
