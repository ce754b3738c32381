"""A benchmark cell's phases run where Ray and MLflow are missing (benchmarks/device_bench.py, for a lent GPU machine)
and recorded here give what `fedsweep bench` gives on Ray: the same choices, final runs and tables; a method whose
phase did not end there is left for a later run."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import yaml

from benchmarks import device_bench
from fedsweep.cli import main
from tests.test_bench import METHODS, bench_file

ROOT = Path(__file__).resolve().parents[1]

# The machine has neither: the run step must not import them.
WITHOUT_RAY_AND_MLFLOW = (
    "import sys, runpy\n"
    "for m in ('ray', 'mlflow'): sys.modules[m] = None\n"
    "sys.argv = ['device_bench.py', *sys.argv[1:]]\n"
    "runpy.run_path('benchmarks/device_bench.py', run_name='__main__')\n"
)


def _there(file: str, out: Path, *more: str) -> str:
    args = ["run", file, "--methods", "fedavg,local", "--out", str(out), "--device", "cpu", "--workers", "2", "--no-stack", *more]
    return subprocess.run([sys.executable, "-c", WITHOUT_RAY_AND_MLFLOW, *args], cwd=ROOT, check=True, timeout=300,
                          capture_output=True, text=True).stdout


def _numbers(path: Path) -> pd.DataFrame:
    """A table's columns that are computed from the runs' metrics (not their wall times nor where they ran)."""
    table = pd.read_csv(path)
    return table[[c for c in table.columns if "wall" not in c and "platform" not in c and "code" not in c]]


def test_a_cell_run_without_ray_and_mlflow_then_logged_gives_fedsweep_bench_s_tables(ray_session, tracking_uri, tmp_path):
    (tmp_path / "methods.yaml").write_text(yaml.safe_dump(METHODS))
    file = bench_file(tmp_path, "skew", {"name": "label_skew", "classes_per_client": 4})
    printed = _there(file, tmp_path / "there", "--code", "abc123")
    assert "fedavg: chose" in printed and "local: chose" in printed
    for key in ("fedavg", "local"):  # 3 settings tuned on seed 0; the chosen ones (one or two) on seeds 1 and 2
        assert len(list((tmp_path / "there" / key / "tune").glob("trial_*.jsonl"))) == 3
        chosen = set(json.loads((tmp_path / "there" / key / "chosen.json").read_text()).values())
        assert len(list((tmp_path / "there" / key / "final").glob("trial_*.jsonl"))) == 2 * len(chosen)
    device_bench.main(["log", file, str(tmp_path / "there"), "--output", str(tmp_path / "device")])
    assert main(["bench", file, "--output", str(tmp_path / "ray"), "--quiet"]) == 0

    device = json.loads((tmp_path / "device" / "skew" / "bench_state.json").read_text())["methods"]
    ray = json.loads((tmp_path / "ray" / "skew" / "bench_state.json").read_text())["methods"]
    for key in ("fedavg", "local"):
        assert device[key]["chosen"] == ray[key]["chosen"] and device[key]["tried"] == ray[key]["tried"] == 3
        assert {"tune_run", "final_run"} <= set(device[key])
    for budget in (3, 1):  # bit for bit: the same trials in one process as on Ray (tests/test_conformance.py)
        pd.testing.assert_frame_equal(_numbers(tmp_path / "device" / "skew" / f"table_b{budget}.csv"),
                                      _numbers(tmp_path / "ray" / "skew" / f"table_b{budget}.csv"))
    runs = pd.read_csv(tmp_path / "device" / "skew" / "final_runs_b3.csv")
    assert set(runs["code"]) == {"abc123"} and runs["platform"].str.startswith("torch ").all()

    # logged again, nothing more is recorded; a fresh folder from files where a tuning trial of local's is missing
    # records fedavg alone, and local stays for a later run
    again = json.loads((tmp_path / "device" / "skew" / "bench_state.json").read_text())
    device_bench.main(["log", file, str(tmp_path / "there"), "--output", str(tmp_path / "device")])
    assert json.loads((tmp_path / "device" / "skew" / "bench_state.json").read_text())["methods"] == again["methods"]
    shutil.copytree(tmp_path / "there", tmp_path / "partial")
    (tmp_path / "partial" / "local" / "tune" / "trial_0001.jsonl").unlink()
    device_bench.main(["log", file, str(tmp_path / "partial"), "--output", str(tmp_path / "part")])
    state = json.loads((tmp_path / "part" / "skew" / "bench_state.json").read_text())["methods"]
    assert "final_run" in state["fedavg"] and not {"chosen", "tune_run", "final_run"} & set(state["local"])
    assert sorted(pd.read_csv(tmp_path / "part" / "skew" / "table_b3.csv")["algorithm"]) == ["fedavg"]


def test_no_trial_starts_with_less_time_left_than_a_trial_takes(tmp_path):
    (tmp_path / "methods.yaml").write_text(yaml.safe_dump(METHODS))
    file = bench_file(tmp_path, "skew", {"name": "label_skew", "classes_per_client": 4})
    printed = _there(file, tmp_path / "there", "--time-box", "0")
    assert "6 trial(s) not started" in printed and not list((tmp_path / "there").glob("*/*/trial_*.jsonl"))
