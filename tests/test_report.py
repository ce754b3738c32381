"""The sweep report on the parent MLflow run: a real two-algorithm sweep on the session's Ray instance,
logged to a real SQLite store; the report's table equals `fedsweep table`'s numbers, its figures are
PNGs, its best/* metrics sit on the parent run, and `fedsweep report` rebuilds it identically."""

from __future__ import annotations

import io
from pathlib import Path

import pandas as pd
import pytest
import yaml

from fedsweep.cli import main
from fedsweep.loading import load_sweep
from fedsweep.sweep import run_sweep
from fedsweep.table import best_settings, load_runs
from tests.conftest import config_dict

pytestmark = pytest.mark.ray

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def sweep_run(ray_session, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("report")
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    body = config_dict(
        algorithm={"_replace": True, "grid": [
            {"name": "fedavg", "local_lr": {"grid": [0.1, 0.02]}, "local_steps": 3, "batch_size": 16},
            {"name": "ditto", "local_lr": 0.1, "alpha": {"grid": [0.05, 0.2]}, "lambda": {"grid": [0.1, 1.0]},
             "local_steps": 3, "batch_size": 16},
        ]},
        rounds=3, eval_every=1, tracking={"experiment": "report-test", "tracking_uri": uri, "log_plot": True}, resources=None,
    )
    body["sweep"] = {"name": "rep", "max_concurrent_trials": 2, "seeds": [0, 1], "target_accuracy": 0.3,
                     "storage_path": str(tmp / "ray_results")}
    path = tmp / "sweep.yaml"
    path.write_text(yaml.safe_dump(body))
    out = run_sweep(load_sweep(path), verbose=0)
    assert out["errors"] == 0
    return uri, out["parent_run_id"], tmp


def artifacts(uri: str, run_id: str, dest: Path) -> dict[str, bytes]:
    from mlflow import MlflowClient

    folder = Path(MlflowClient(uri).download_artifacts(run_id, "report", str(dest)))
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_the_parent_run_holds_the_report(sweep_run):
    from mlflow import MlflowClient

    uri, parent, tmp = sweep_run
    files = artifacts(uri, parent, tmp / "first")
    assert set(files) == {"table.md", "table.csv", "table.parquet", "comparison.png", "clients.png",
                          "sensitivity_fedavg.png", "sensitivity_ditto.png"}
    for name, data in files.items():
        assert len(data) > 1000 or name.startswith("table"), name
        assert data.startswith(PNG) == name.endswith(".png"), name

    # the table files carry the numbers `fedsweep table` computes, one row per algorithm
    runs, _ = load_runs(uri, "report-test", parent, target_accuracy=0.3)
    expected = best_settings(runs, "personalized_accuracy_mean", "max")
    csv = pd.read_csv(io.BytesIO(files["table.csv"]))
    parquet = pd.read_parquet(io.BytesIO(files["table.parquet"]))
    assert sorted(csv["algorithm"]) == ["ditto", "fedavg"] and len(parquet) == 2
    for table in (csv, parquet):
        merged = table.merge(expected, on="algorithm", suffixes=("", "_expected"))
        for column in ("personalized_accuracy_mean mean", "personalized_accuracy_mean ci95", "rounds_to_target mean"):
            assert merged[column].tolist() == pytest.approx(merged[f"{column}_expected"].tolist(), nan_ok=True)
    assert "seeds reaching target" in files["table.md"].decode() and "| ditto |" in files["table.md"].decode()

    # best/<algorithm>/<metric> on the parent run: the table's numbers
    metrics = MlflowClient(uri).get_run(parent).data.metrics
    for _, row in expected.iterrows():
        assert metrics[f"best/{row['algorithm']}/personalized_accuracy_mean"] == pytest.approx(row["personalized_accuracy_mean mean"])


def test_fedsweep_report_rebuilds_it_identically(sweep_run, capsys):
    uri, parent, tmp = sweep_run
    before = artifacts(uri, parent, tmp / "before")
    assert main(["report", "--experiment", "report-test", "--tracking-uri", uri]) == 0
    assert f"logged to run {parent}" in capsys.readouterr().out
    assert artifacts(uri, parent, tmp / "after") == before
    assert main(["report", "--experiment", "no-such-experiment", "--tracking-uri", uri]) == 2
