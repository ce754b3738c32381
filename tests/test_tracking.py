"""Where runs are logged: the config's URI, else $MLFLOW_TRACKING_URI, else ./mlflow.db, always absolute."""

from __future__ import annotations

from fedsweep.tracking import resolve_tracking_uri, setting_label


def test_default_is_sqlite_in_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert resolve_tracking_uri() == f"sqlite:///{tmp_path / 'mlflow.db'}"


def test_environment_then_config(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    assert resolve_tracking_uri() == "http://127.0.0.1:5000"
    assert resolve_tracking_uri("sqlite:///runs/x.db") == f"sqlite:///{tmp_path / 'runs' / 'x.db'}"
    assert resolve_tracking_uri("sqlite:////abs/x.db") == "sqlite:////abs/x.db"


def test_setting_label_leaves_out_seed_and_name():
    label = setting_label({"algorithm.name": "fedavg", "algorithm.local_lr": 0.05, "seed": 3, "rounds": 10})
    assert label == "local_lr=0.05, rounds=10"
    assert setting_label({"seed": 1}) == "default"
