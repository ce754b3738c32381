"""Shared fixtures: one real local Ray instance for the session, a fresh SQLite MLflow store per test."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# A small but complete experiment (digits, 3 clients); tests override fields of a deep copy.
BASE = {
    "name": "test",
    "seed": 0,
    "data": {"dataset": "digits", "num_clients": 3, "partition": {"name": "label_skew", "classes_per_client": 4}},
    "model": {"name": "mlp", "hidden": [16]},
    "algorithm": {"name": "fedavg", "local_lr": 0.1, "participation_rate": 1.0, "local_steps": 3, "batch_size": 16},
    "rounds": 4,
    "eval_every": 2,
    "resources": {"server_cpus": 0.2, "client_cpus": 0.1},
    "tracking": {"experiment": "tests"},
}


def config_dict(**sections) -> dict:
    """BASE with top-level keys replaced and section dicts merged one level deep."""
    d = copy.deepcopy(BASE)
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(d.get(key), dict) and not value.get("_replace"):
            d[key] = {**d[key], **value}
        else:
            d[key] = {k: v for k, v in value.items() if k != "_replace"} if isinstance(value, dict) else value
    return d


@pytest.fixture(scope="session")
def ray_session():
    import ray

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture
def tracking_uri(tmp_path, monkeypatch) -> str:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    return uri
