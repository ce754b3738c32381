"""Shared fixtures: one real local Ray instance for the session, a fresh SQLite MLflow store per test."""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
from pathlib import Path

import pytest

# A Ray instance the commands under test start (they inherit this environment) runs a log monitor that, below 1,000 log
# files, lists the logs folder ten times a second. Past this threshold (here 0) it lists them every 0.5 s: 0.87 s of CPU
# a minute instead of 1.82 with 207 files (benchmarks/ray_log_monitor.py, 2026-11-27). Worker output still reaches the
# driver, new files within 0.5 s. The suite's own instances (log_to_driver=False) run no log monitor at all.
os.environ.setdefault("RAY_LOG_MONITOR_MANY_FILES_THRESHOLD", "0")

ROOT = Path(__file__).resolve().parents[1]

# Decoded image datasets are cached per node (fedsweep.data.vision.cache_dir); the tests' tiny files go to a
# cache of their own, set before any Ray instance starts so that every actor sees it too.
_OWN_CACHE = None
if "FEDSWEEP_CACHE_DIR" not in os.environ:
    _OWN_CACHE = os.environ["FEDSWEEP_CACHE_DIR"] = tempfile.mkdtemp(prefix="fedsweep-test-cache-")


def pytest_sessionfinish(session, exitstatus):
    if _OWN_CACHE:
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)

# A small but complete experiment (digits, 3 clients); tests override fields of a deep copy. No per-trial plot
# (tracking.log_plot, on by default): drawing it cost a trial process 1.2 s (matplotlib's import) and each trial
# 0.3 s, most of a small trial's CPU; the tests that check the plot turn it on (test_sweep, test_mlflow_ui).
BASE = {
    "name": "test",
    "seed": 0,
    "data": {"dataset": "digits", "num_clients": 3, "partition": {"name": "label_skew", "classes_per_client": 4}},
    "model": {"name": "mlp", "hidden": [16]},
    "algorithm": {"name": "fedavg", "local_lr": 0.1, "participation_rate": 1.0, "local_steps": 3, "batch_size": 16},
    "rounds": 4,
    "eval_every": 2,
    "resources": {"server_cpus": 0.2, "client_cpus": 0.1},
    "tracking": {"experiment": "tests", "log_plot": False},
}


def config_dict(**sections) -> dict:
    """BASE with top-level keys replaced and section dicts merged one level deep; a section given as None is left
    out (``resources=None``: the layout fedsweep chooses, one process per trial for these small models — what a
    user's file without a layout gets, and the cheap choice for tests of sweeps, tracking and tables)."""
    d = copy.deepcopy(BASE)
    for key, value in sections.items():
        if value is None:
            d.pop(key, None)
        elif isinstance(value, dict) and isinstance(d.get(key), dict) and not value.get("_replace"):
            d[key] = {**d[key], **value}
        else:
            d[key] = {k: v for k, v in value.items() if k != "_replace"} if isinstance(value, dict) else value
    return d


def sqlite_store(db: Path) -> str:
    """The URI of a SQLite MLflow store at ``db``, made and opened in this process. A test that reads a store while a
    driver it started writes it creates the store before starting the driver: two processes creating one fresh store
    at once race on its migrations (CI of stop 81: the driver exited with "table sql_trace_metric_daily_rollups
    already exists" as the test's first poll created the same tables). Made as fedsweep makes a new store (a copy of
    the empty one, linked into place: :mod:`fedsweep.sqlite_store`), then opened."""
    from mlflow import MlflowClient

    from fedsweep.sqlite_store import seed_new_store

    uri = f"sqlite:///{db}"
    seed_new_store(uri)
    MlflowClient(uri).search_experiments()
    return uri


def assert_running(proc, deadline: float, what: str) -> None:
    """A test's sweep process is still running, before ``deadline`` (``time.time()``): else the test fails naming
    ``what`` it waited for, with the end of the process's output when it exited (its error, not only its code)."""
    import time

    if proc.poll() is not None:
        out, err = proc.communicate()
        pytest.fail(f"the sweep exited {proc.returncode} before {what}:\n{((out or '') + (err or ''))[-4000:]}")
    assert time.time() < deadline, f"the sweep stalled before {what}"


_REFERENCES: dict[str, dict] = {}


def run_local_last(cfg) -> dict:
    """The last evaluation of ``run_local(cfg)``, computed once per config in a test process: where the runs are
    tracked (``tracking.tracking_uri``) is no part of their numbers, so tests that run the same trials into their own
    stores (test_resume's folder and s3 cases) share it. The rest of ``tracking`` counts (``log_train_loss``)."""
    from fedsweep.engine import run_local

    key = cfg.model_dump_json(exclude={"tracking": {"tracking_uri"}})
    if key not in _REFERENCES:
        _REFERENCES[key] = run_local(cfg)[0][-1]
    return _REFERENCES[key]


def assert_runs_equal_run_local(trials, runs, keys=("personalized_accuracy_mean", "global_accuracy", "local_train_loss"),
                                rel: float = 1e-12, absolute: float = 0.0) -> None:
    """Every MLflow run's final ``keys`` equal those of its trial's config run in one process (``run_local``), the
    trial found by the run's ``fedsweep.trial_index`` tag in ``trials``."""
    for run in runs:
        reference = run_local_last(trials[int(run.data.tags["fedsweep.trial_index"])].config)
        for key in keys:
            assert run.data.metrics[key] == pytest.approx(reference[key], rel=rel, abs=absolute), (run.info.run_name, key)


def with_resources(cfg, **fields):
    """``cfg`` validated again with ``fields`` set in its resources section."""
    from fedsweep.loading import validate

    return validate({**cfg.model_dump(), "resources": {**cfg.resources.model_dump(), **fields}})


def stacked(cfg):
    """``cfg`` with all its clients in one block trained as one stacked computation (``vectorize_clients``)."""
    return with_resources(cfg, clients_per_actor=cfg.data.num_clients, vectorize_clients=True)


#: Seconds each test file took in `make test` (`--durations`, summed per file; a fresh clone on 2 cores, 2026-12-07,
#: reference 0.32 s before and 0.46 s after; the first figures, 2026-11-26, lacked test_bench_kernels.py and
#: test_published_results.py, which then went last). `make test` hands whole files to its workers (`--dist loadfile`)
#: in this order, heaviest first, so that no long file starts last while the others idle (xdist's own order, most
#: tests first, put the few-test Ray files last: 868 s measured, 819 s simulated heaviest first). A file not listed
#: goes after, in collection order.
FILE_SECONDS = {"test_resume.py": 295, "test_actors.py": 188, "test_cluster.py": 173, "test_bench.py": 160,
                "test_tracking_outage.py": 129, "test_sweep.py": 122, "test_conformance.py": 106, "test_faults.py": 105,
                "test_bench_kernels.py": 101, "test_worker_pool.py": 83, "test_published_results.py": 74,
                "test_tuning.py": 73, "test_job_submit.py": 72, "test_cli.py": 60, "test_benchmarks.py": 51,
                "test_mlflow_ui.py": 44, "test_tracking_process.py": 38, "test_device_bench.py": 5,
                "test_algorithms.py": 24, "test_report.py": 20, "test_table.py": 20, "test_metric_writer.py": 17,
                "test_tracking.py": 15, "test_device_runs.py": 10, "test_junk_input.py": 10}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """A test that takes the suite's Ray instance is a Ray test, marked or not (`make test-fast` deselects them).
    Files heaviest first (:data:`FILE_SECONDS`; a stable sort keeps each file's tests together and in order)."""
    for item in items:
        if "ray_session" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.ray)
    items.sort(key=lambda item: -FILE_SECONDS.get(item.path.name, 0))


@pytest.fixture(autouse=True)
def _ray_only_in_ray_tests(request, monkeypatch):
    """``ray.init`` fails in a test not marked ``ray``: the marker is what `make test-fast` trusts to leave Ray out."""
    if request.node.get_closest_marker("ray") is None:
        import ray

        def refuse(*args, **kwargs):
            raise AssertionError("this test starts Ray: mark it @pytest.mark.ray (or take the ray_session fixture)")

        monkeypatch.setattr(ray, "init", refuse)


@pytest.fixture(scope="session")
def ray_session():
    import ray

    from fedsweep.experiment import start_local_ray

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    start_local_ray(num_cpus=2, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture
def tracking_uri(tmp_path, monkeypatch) -> str:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    return uri


@pytest.fixture(scope="module")
def postgres():
    """A throw-away PostgreSQL cluster and database for the module (:func:`tests.services.postgres_cluster`), as its URI."""
    from tests.services import postgres_cluster

    with postgres_cluster() as uri:
        yield uri


@pytest.fixture(scope="module")
def mlflow_server(request, tmp_path_factory, postgres):
    """`infra/mlflow_server.sh` on a free loopback port, PostgreSQL behind it (:class:`tests.services.MlflowServer`:
    ``url``, ``port``, ``proc``; ``stop()`` and ``start()`` again on the same port and store), stopped at the end;
    with the module's ``MLFLOW_WORKERS`` worker processes, else the script's default."""
    from tests.services import MlflowServer

    server = MlflowServer(postgres, tmp_path_factory.mktemp("mlflow-server"), getattr(request.module, "MLFLOW_WORKERS", None))
    server.start()
    yield server
    server.stop()


# Class counts of the real MNIST train and test files; CIFAR-10 has 5000 and 1000 per class.
MNIST_COUNTS = {
    "train": [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949],
    "t10k": [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009],
}


@pytest.fixture(scope="session")
def full_size_image_root(tmp_path_factory):
    """MNIST and CIFAR-10 files of the real sizes, formats and class counts (blank images), so that the
    shipped protocol files validate (files present, splits feasible) without the real data."""
    import pickle
    import struct

    import numpy as np

    root = tmp_path_factory.mktemp("image-data")
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for split, counts in MNIST_COUNTS.items():
        labels = np.repeat(np.arange(10, dtype=np.uint8), counts)
        n = len(labels)
        (raw / f"{split}-images-idx3-ubyte").write_bytes(struct.pack(">BBBBIII", 0, 0, 8, 3, n, 28, 28) + bytes(n * 784))
        (raw / f"{split}-labels-idx1-ubyte").write_bytes(struct.pack(">BBBBI", 0, 0, 8, 1, n) + labels.tobytes())
    cifar = root / "cifar-10-batches-py"
    cifar.mkdir()
    for name, per_class in [(f"data_batch_{i}", 1000) for i in range(1, 6)] + [("test_batch", 1000)]:
        labels = [c for c in range(10) for _ in range(per_class)]
        batch = {b"labels": labels, b"data": np.zeros((len(labels), 3072), dtype=np.uint8)}
        (cifar / name).write_bytes(pickle.dumps(batch, protocol=2))
    return root
