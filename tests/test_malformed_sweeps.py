"""Malformed sweep files, as a cluster user would submit them: each stops `fedsweep sweep` with exit code 2
and a message naming the file and the field, before Ray starts and before anything reaches MLflow.

All cases run in one separate Python process (one interpreter start instead of one per case), each
through `fedsweep.cli.main` — the function the `fedsweep` command exits with — in its own folder;
tests/test_cli.py checks the exit code of the real command."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

DRIVER = """
import contextlib, io, json, os, sys
import ray
from fedsweep.cli import main
results = {}
for case, folder in json.loads(sys.argv[1]).items():
    os.chdir(folder)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(["sweep", os.path.join(folder, "bad.yaml")])
    results[case] = {"rc": rc, "stderr": err.getvalue(), "ray": ray.is_initialized(),
                     "mlflow": [f for f in ("mlflow.db", "mlruns", "mlartifacts") if os.path.exists(f)]}
print(json.dumps(results))
"""

GOOD = """\
name: m
data: {dataset: digits, num_clients: 3, partition: {name: label_skew, classes_per_client: 4}}
model: {name: mlp, hidden: [16]}
algorithm: {name: fedavg, local_lr: {grid: [0.1, 0.05]}, r: 1.0, tau: 3, batch_size: 16}
rounds: 4
eval_every: 2
resources: {server_cpus: 0.2, client_cpus: 0.1, cluster_cpus: 2}
tracking: {experiment: bad}
sweep: {name: bad, max_concurrent_trials: 2, seeds: [0, 1]}
"""

ALGO = "algorithm: {name: fedavg, local_lr: {grid: [0.1, 0.05]}, r: 1.0, tau: 3, batch_size: 16}"


def edit(old: str, new: str) -> str:
    assert old in GOOD
    return GOOD.replace(old, new)


# name -> (file text, what the message must contain)
CASES = {
    "yaml syntax": (edit(ALGO, "algorithm: {name: fedavg, local_lr: 0.1"), "bad.yaml:"),
    "not a mapping": ("- rounds\n- 4\n", "expected a mapping of config fields"),
    "python tag": (edit("rounds: 4", "rounds: !!python/object/apply:os.system ['echo x']"), "bad.yaml:"),
    "unknown top key": (GOOD + "epochs: 3\n", "epochs: unknown key 'epochs'"),
    "unknown algorithm": (edit("name: fedavg", "name: fedavgg"), "algorithm.name"),
    "wrong type": (edit("rounds: 4", "rounds: ten"), "rounds"),
    "negative step": (edit("local_lr: {grid: [0.1, 0.05]}", "local_lr: {grid: [0.1, -0.05]}"), "algorithm.local_lr"),
    "rate above 1": (edit("r: 1.0", "r: 1.5"), "algorithm.r: Input should be less than or equal to 1"),
    "zero local steps": (edit("tau: 3", "tau: 0"), "algorithm.tau: Input should be greater than or equal to 1"),
    "grid over missing field": (edit("batch_size: 16}", "batch_size: 16, lr: {grid: [1, 2]}}"), "algorithm.lr: unknown key 'lr'"),
    "top grid over missing field": (GOOD + "epochs: {grid: [1, 2]}\n", "epochs"),
    "empty grid": (edit("{grid: [0.1, 0.05]}", "{grid: []}"), "bad.yaml:4: algorithm.local_lr.grid: must be a non-empty list"),
    "unused hyperparameter": (edit("batch_size: 16}", "batch_size: 16, coupling: 5}"), "algorithm.coupling"),
    "unknown dataset": (edit("dataset: digits", "dataset: imagenet"), "data.dataset"),
    "unknown partition": (edit("name: label_skew", "name: bogus"), "data.partition.name"),
    "too many classes": (edit("classes_per_client: 4", "classes_per_client: 11"), "classes_per_client"),
    "more sampled than exist": (edit("r: 1.0", "clients_per_round: 9"), "clients_per_round=9"),
    "rate and count": (edit("r: 1.0", "r: 1.0, clients_per_round: 2"), "participation_rate (r) or clients_per_round"),
    "unknown model": (edit("name: mlp", "name: transformer"), "model.name"),
    "cpus do not fit": (edit("client_cpus: 0.1", "client_cpus: 1.0"), "resources: one trial needs"),
    "gpus do not fit": (edit("client_cpus: 0.1", "client_cpus: 0.1, client_gpus: 0.5, cluster_gpus: 0"), "resources.client_gpus"),
    "zero cadence": (edit("eval_every: 2", "eval_every: 0"), "eval_every"),
    "unknown metric": (edit("sweep: {name: bad,", "sweep: {name: bad, metric: accuracy,"), "sweep.metric"),
    "negative seed": (edit("seeds: [0, 1]", "seeds: [-1]"), "sweep.seeds"),
    "unknown sweep key": (edit("sweep: {name: bad,", "sweep: {name: bad, retries: 3,"), "sweep.retries"),
    "grid over sweep-wide field": (edit("tracking: {experiment: bad}", "tracking: {experiment: {grid: [a, b]}}"), "tracking.experiment"),
    "table group by missing param": (edit("seeds: [0, 1]", "seeds: [0, 1], table_group_by: [model.depth]"), "sweep.table_group_by"),
    "image files absent": (
        edit("data: {dataset: digits, num_clients: 3, partition: {name: label_skew, classes_per_client: 4}}",
             "data: {dataset: mnist, root: nowhere, num_clients: 3}"),
        "data.root: mnist files not found",
    ),
}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[str, dict]:
    folders = {}
    for i, (case, (text, _)) in enumerate(CASES.items()):
        folder = tmp_path_factory.mktemp(f"case{i}")
        (folder / "bad.yaml").write_text(text)
        folders[case] = str(folder)
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "RAY_ADDRESS")}
    r = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(folders)], capture_output=True, text=True,
                       env=env, cwd=ROOT, timeout=600, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    return {case: {**o, "path": os.path.join(folders[case], "bad.yaml")} for case, o in json.loads(r.stdout.splitlines()[-1]).items()}


@pytest.mark.parametrize("case", list(CASES))
def test_malformed_sweep_file_exits_2_and_names_the_field(case, outcomes):
    _, expected = CASES[case]
    o = outcomes[case]
    assert o["rc"] == 2, o["stderr"][-2000:]
    assert expected in o["stderr"], o["stderr"]
    assert o["path"] in o["stderr"] or "bad.yaml" in o["stderr"]
    assert not o["mlflow"]  # zero MLflow runs: no store was even created
    assert not o["ray"]  # Ray never started


def test_there_are_at_least_twenty_cases():
    assert len(CASES) >= 20
