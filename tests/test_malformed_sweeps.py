"""Malformed sweep files, as a cluster user would submit them: each stops `fedsweep sweep` with exit code 2
and a message naming the file and the field, before Ray starts and before anything reaches MLflow; and
`fedsweep validate` and `fedsweep run` give every file the same verdict, word for word (one path of checks,
:func:`fedsweep.loading.load_sweep`).

All cases run in one separate Python process (one interpreter start instead of one per case), each
through `fedsweep.cli.main` — the function the `fedsweep` command exits with — in its own folder;
tests/test_cli.py checks the exit code of the real command."""

from __future__ import annotations

import json
import os
import pickle
import struct
import subprocess
import sys

import numpy as np
import pytest
from pydantic import BaseModel

from tests.conftest import ROOT

DRIVER = """
import contextlib, io, json, os, sys, time, traceback
import ray
from fedsweep.cli import main
results = {}
for command in ("sweep", "validate", "run"):
    for case, folder in json.loads(sys.argv[1]).items():
        os.chdir(folder)
        err = io.StringIO()
        t0 = time.perf_counter()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                rc = main([command, os.path.join(folder, "bad.yaml")])
            except BaseException:  # what the command would have shown: a traceback
                rc, _ = None, err.write(traceback.format_exc())
        results.setdefault(command, {})[case] = {
            "rc": rc, "stderr": err.getvalue(), "ray": ray.is_initialized(), "seconds": time.perf_counter() - t0,
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


BILLION_LAUGHS = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 10)}]\n" for i in range(8)
) + GOOD
CORRUPT_MNIST = {f"data/MNIST/raw/{f}.gz": b"\x1f\x8b\x08junk" for f in (
    "train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}



def idx(array: np.ndarray, type_code: int = 0x08) -> bytes:
    """An IDX file (MNIST's format) holding ``array`` with the given element type code."""
    dtype = {0x08: np.uint8, 0x0D: ">f4"}[type_code]
    return struct.pack(">BBBB", 0, 0, type_code, array.ndim) + b"".join(struct.pack(">I", d) for d in array.shape) \
        + np.asarray(array, dtype=dtype).tobytes()


def mnist_folder(per_class: int = 2, labels_to: int = 10, shape: tuple = (28, 28), type_code: int = 0x08) -> dict[str, bytes]:
    """The four MNIST files under data/MNIST/raw: ``per_class`` images of each label below ``labels_to``."""
    files = {}
    for split in ("train", "t10k"):
        y = np.repeat(np.arange(labels_to), per_class)
        files[f"data/MNIST/raw/{split}-images-idx3-ubyte"] = idx(np.zeros((len(y), *shape)), type_code)
        files[f"data/MNIST/raw/{split}-labels-idx1-ubyte"] = idx(y)
    return files


def cifar_folder(pixels: int) -> dict[str, bytes]:
    """CIFAR-10's six batches under data/cifar-10-batches-py, valid pickles of 10 images of ``pixels`` bytes."""
    batch = pickle.dumps({b"labels": list(range(10)), b"data": np.zeros((10, pixels), np.uint8)}, protocol=2)
    return {f"data/cifar-10-batches-py/{n}": batch for n in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]}


DATA = "data: {dataset: digits, num_clients: 3, partition: {name: label_skew, classes_per_client: 4}}"
RANDOM = "sweep: {name: bad, max_concurrent_trials: 2, seeds: [0], search: random, num_samples: 2}"
SWEEP = "sweep: {name: bad, max_concurrent_trials: 2, seeds: [0, 1]}"

# name -> (file text or bytes, what the message must contain[, other files of the case's folder])
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
    "too many classes": (edit("classes_per_client: 4", "classes_per_client: 11"), "bad.yaml:2: data.partition.classes_per_client: 11 exceeds"),
    "more sampled than exist": (edit("r: 1.0", "clients_per_round: 9"), "bad.yaml:4: algorithm.clients_per_round: 9 samples more"),
    "rate and count": (edit("r: 1.0", "r: 1.0, clients_per_round: 2"), "algorithm.clients_per_round: give participation_rate (r) or clients_per_round"),
    "unknown model": (edit("name: mlp", "name: transformer"), "model.name"),
    "cpus do not fit": (edit("client_cpus: 0.1", "client_cpus: 1.0"), "resources.client_cpus: one trial needs"),
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
    # --- what used to end in a traceback
    "latin-1 file": (GOOD.replace("name: m", "name: caf\u00e9").encode("latin-1"), "bad.yaml:1: not UTF-8 text"),
    "binary file": (bytes(range(256)) * 4, "bad.yaml:2: not UTF-8 text (byte 0x80)"),
    "control characters": ("\x00\x01" + GOOD, "bad.yaml:1: YAML syntax error"),
    "corrupt gzip under the data root": (
        edit("data: {dataset: digits, num_clients: 3, partition: {name: label_skew, classes_per_client: 4}}",
             "data: {dataset: mnist, root: data, num_clients: 3}"),
        "train-images-idx3-ubyte.gz cannot be read", CORRUPT_MNIST,
    ),
    "infinite resource count": (edit("cluster_cpus: 2", "cluster_cpus: .inf"), "resources.cluster_cpus"),
    "malformed ray address": (edit("cluster_cpus: 2", "cluster_cpus: 2, ray_address: 'http//head'"), "resources.ray_address"),
    "no cluster at the ray address": (edit("cluster_cpus: 2", "ray_address: '127.0.0.1:9'"), "resources.ray_address: '127.0.0.1:9': nothing answers there"),
    "tracking uri scheme": (edit("tracking: {experiment: bad}", "tracking: {experiment: bad, tracking_uri: 'mongo://x/y'}"),
                            "tracking.tracking_uri: 'mongo://x/y': unknown scheme 'mongo'"),
    "tracking path under a file": (edit("tracking: {experiment: bad}", "tracking: {experiment: bad, tracking_uri: bad.yaml/runs}"),
                                   "bad.yaml is not a folder"),
    "storage scheme": (edit("seeds: [0, 1]", "seeds: [0, 1], storage_path: 'ftp://host/results'"), "sweep.storage_path: unknown scheme 'ftp'"),
    "storage under a file": (edit("seeds: [0, 1]", "seeds: [0, 1], storage_path: bad.yaml/results"), "sweep.storage_path"),
    # --- accepted, then every trial failed
    "cpus below ray's unit": (edit("client_cpus: 0.1", "client_cpus: 0.00001"), "resources.client_cpus: 1e-05 is below Ray's resource unit"),
    "seed beyond the generators": (edit("seeds: [0, 1]", "seeds: [18446744073709551616]"), "sweep.seeds.0"),
    "model beyond memory": (edit("hidden: [16]", "hidden: [1000000, 1000000]"), "bad.yaml: model.hidden: one trial starts"),
    "absurd client count": (edit("num_clients: 3", "num_clients: 1000000000"), "data.num_clients"),
    # --- validation itself exhausted memory
    "more clients than digits has": (edit("num_clients: 3", "num_clients: 90000"), "data.num_clients: 90000: digits has 1797 samples"),
    "alias bomb": (BILLION_LAUGHS, "expands to more than 100000 values"),
    "deep nesting": ("a: " + "[" * 3000 + "]" * 3000 + "\n", "nested"),
    "grid product": (GOOD.replace("rounds: 4", "rounds: {grid: [" + ", ".join(map(str, range(1, 101))) + "]}")
                     .replace("eval_every: 2", "eval_every: {grid: [" + ", ".join(map(str, range(1, 101))) + "]}"), "at most 10000"),
    # --- silently accepted, wrong results
    "infinite step size": (edit("local_lr: {grid: [0.1, 0.05]}", "local_lr: .inf"), "algorithm.local_lr: Input should be a finite number"),
    "bool as a count": (edit("rounds: 4", "rounds: true"), "rounds: Input should be a valid integer (got True)"),
    "yes as a count": (edit("tau: 3", "tau: yes"), "algorithm.tau: Input should be a valid integer (got True)"),
    "bools as seeds": (edit("seeds: [0, 1]", "seeds: [true, false]"), "sweep.seeds.0: Input should be a valid integer"),
    "number in quotes": (edit("rounds: 4", "rounds: '4'"), "rounds: Input should be a valid integer (got '4')"),
    "bad seed hidden by sweep seeds": (GOOD + "seed: -3\n", "seed: Input should be greater than or equal to 0"),
    "sweep false": (edit("sweep: {name: bad, max_concurrent_trials: 2, seeds: [0, 1]}", "sweep: false"), "bad.yaml:9: sweep: must be a mapping"),
    "duplicate key": (GOOD + "algorithm: {name: fedprox}\n", "key 'algorithm' given twice (first on line 4)"),
    "duplicate seeds": (edit("seeds: [0, 1]", "seeds: [0, 1, 0]"), "bad.yaml:9: sweep.seeds: [0] given more than once"),
    "sweep name leaves storage": (edit("sweep: {name: bad,", "sweep: {name: ../../escape,"), "sweep.name: String should match pattern"),
    "gpus this machine lacks": (edit("cluster_cpus: 2", "cluster_cpus: 2, cluster_gpus: 1000"), "resources.cluster_gpus: 1000, but this machine has"),
    # --- validation and the run disagreed
    "fractional cluster cpus": (edit("cluster_cpus: 2", "cluster_cpus: 1.5"), "resources.cluster_cpus: Input should be a valid integer"),
    # --- messages that misled
    "oversized server cpus": (edit("server_cpus: 0.2", "server_cpus: 3"), "resources.server_cpus: the server bundle alone needs 3 CPUs"),
    "unsatisfiable split": (edit("num_clients: 3, partition: {name: label_skew, classes_per_client: 4}",
                                 "num_clients: 800, partition: {name: dirichlet, concentration: 0.01}"), "data.partition.concentration: the dirichlet split of digits leaves client"),
    "sweep error has its line": (edit("max_concurrent_trials: 2", "max_concurrent_trials: 0"), "bad.yaml:9: sweep.max_concurrent_trials"),
    "sweep-wide grid has its line": (edit("cluster_cpus: 2", "cluster_cpus: {grid: [1, 2]}"), "bad.yaml:7: resources.cluster_cpus: one value"),
    "a folder given as the file": (None, "bad.yaml: is a directory"),
    "invisible character in a key": (edit("rounds: 4", "rou\u200bnds: 4"), "rou\\u200bnds: unknown key 'rou\\u200bnds'"),
    # --- third pass (issue 36): data that reads but is not what its format says
    "cifar batches of 3-pixel images": (edit(DATA, "data: {dataset: cifar10, root: data, num_clients: 3}"),
                                        "images of shape (3,) each; the cifar10 format holds 3 × 32 × 32", cifar_folder(3)),
    "mnist labels beyond its classes": (edit(DATA, "data: {dataset: mnist, root: data, num_clients: 3}"),
                                        "train-labels-idx1-ubyte: labels 0..11; mnist has classes 0..9", mnist_folder(labels_to=12)),
    "mnist images of the wrong size": (edit(DATA, "data: {dataset: mnist, root: data, num_clients: 3}"),
                                       "images of shape (28, 27) each; the mnist format holds 28 × 28", mnist_folder(shape=(28, 27))),
    "mnist pixels as floats": (edit(DATA, "data: {dataset: mnist, root: data, num_clients: 3}"),
                               "images of type >f4; the mnist format holds uint8 pixels", mnist_folder(type_code=0x0D)),
    "fewer images than the official files": (edit(DATA, "data: {dataset: mnist, root: data, num_clients: 3}"),
                                             "20 images; the official mnist file holds 60000", mnist_folder()),
    # --- a search space checked at its edges whatever the draws, for random search as for Optuna
    "random space beyond a field's range": (edit("r: 1.0", "r: {uniform: [0.5, 1.5]}").replace(SWEEP, RANDOM),
                                            "algorithm.r: Input should be less than or equal to 1 (got 1.5) [at an edge"),
    "random choice with a bad value": (edit("local_lr: {grid: [0.1, 0.05]}", "local_lr: {choice: [0.1, -1]}").replace(SWEEP, RANDOM),
                                       "algorithm.local_lr: Input should be greater than 0 (got -1) [at an edge"),
    "unknown distribution form": (edit("local_lr: {grid: [0.1, 0.05]}", "local_lr: {normal: [0.05, 0.01]}").replace(SWEEP, RANDOM),
                                  "bad.yaml:4: algorithm.local_lr: unknown form 'normal'; allowed: a value, {grid: [values]}"),
    # --- validate and sweep agreed on everything but this
    "object store without a bucket": (edit("seeds: [0, 1]", "seeds: [0, 1], storage_path: 's3://'"),
                                      "sweep.storage_path: 's3://' names no bucket"),
    # --- the mistake named, not its size
    "unknown key under a large grid": (GOOD + "epochs: {grid: [" + ", ".join(map(str, range(3000))) + "]}\n",
                                       "bad.yaml:10: epochs: unknown key 'epochs'; allowed keys:"),
}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[str, dict]:
    folders = {}
    for i, (case, (content, _, *files)) in enumerate(CASES.items()):
        folder = tmp_path_factory.mktemp(f"case{i}")
        if content is None:
            (folder / "bad.yaml").mkdir()
        elif isinstance(content, bytes):
            (folder / "bad.yaml").write_bytes(content)
        else:
            (folder / "bad.yaml").write_text(content, encoding="utf-8")
        for name, data in (files[0] if files else {}).items():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_bytes(data)
        folders[case] = str(folder)
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "RAY_ADDRESS", "FEDSWEEP_DATA_DIR")}
    r = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(folders)], capture_output=True, text=True,
                       env=env, cwd=ROOT, timeout=600, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    return {command: {case: {**o, "path": os.path.join(folders[case], "bad.yaml")} for case, o in by_case.items()}
            for command, by_case in json.loads(r.stdout.splitlines()[-1]).items()}


@pytest.mark.parametrize("case", list(CASES))
def test_malformed_sweep_file_exits_2_and_names_the_field(case, outcomes):
    expected = CASES[case][1]
    o = outcomes["sweep"][case]
    assert o["rc"] == 2, o["stderr"][-2000:]
    assert expected in o["stderr"], o["stderr"]
    assert o["path"] in o["stderr"] or "bad.yaml" in o["stderr"]
    assert ":?:" not in o["stderr"]  # a line is given where the file has one, and nothing where it has none
    assert not o["mlflow"]  # zero MLflow runs: no store was even created
    assert not o["ray"]  # Ray never started
    assert o["seconds"] < 20, o["seconds"]  # refused in seconds (the first case also pays the imports)


def test_the_corpus_names_a_field_of_every_section_and_each_kind_of_mistake():
    """The cases' expected messages name a field of every top-level section of an experiment and of the sweep, and
    cover each kind of mistake: the YAML itself (syntax, a tag, not a mapping), an unknown key, a value of the wrong
    type or out of range, a grid, a distribution's form, and a case that needs a file beside the sweep file."""
    from fedsweep.config import ExperimentConfig

    expected = [case[1] for case in CASES.values()]
    sections = [name for name, field in ExperimentConfig.model_fields.items()
                if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)]
    for section in {*sections, "data", "model", "algorithm", "sweep"}:
        assert any(f"{section}." in e for e in expected), section
    kinds = {"syntax": "yaml syntax", "tag": "python tag", "mapping": "not a mapping", "unknown key": "unknown top key",
             "type": "wrong type", "range": "rate above 1", "grid": "grid over missing field",
             "distribution": "unknown distribution form"}
    assert all(case in CASES for case in kinds.values()), set(kinds.values()) - set(CASES)
    assert any(len(case) > 2 for case in CASES.values())  # a case whose folder holds other files


@pytest.mark.parametrize("command", ["validate", "run"])
def test_validate_and_run_give_every_malformed_file_the_verdict_of_sweep(command, outcomes):
    """The whole corpus through the three commands: the same exit code and the same problems, word for word,
    none started Ray or created an MLflow store."""
    differ = {case: (o["rc"], o["stderr"]) for case, o in outcomes[command].items()
              if (o["rc"], o["stderr"]) != (outcomes["sweep"][case]["rc"], outcomes["sweep"][case]["stderr"])}
    assert not differ, differ
    assert not any(o["ray"] or o["mlflow"] for o in outcomes[command].values())
