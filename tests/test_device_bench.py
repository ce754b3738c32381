"""A benchmark cell's phases run where Ray and MLflow are missing (benchmarks/device_bench.py, for a lent GPU machine)
and recorded here as `fedsweep bench` records its phases; a method whose phase did not end there is left for a later
run. The cell run there and recorded here is tests/test_bench.py's (its benchmark test computes the cell once on Ray,
once here without, and compares the tables bit for bit, then :func:`check_recorded_cell`); here, a time box."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import yaml

from benchmarks import device_bench
from tests.test_device_runs import without_ray_and_mlflow

ROOT = Path(__file__).resolve().parents[1]

WITHOUT_RAY_AND_MLFLOW = without_ray_and_mlflow("device_bench.py")


def there(file: str, out: Path, *more: str) -> str:
    """``device_bench.py run`` of the two methods, two worker processes, in a process that cannot import Ray or MLflow."""
    args = ["run", file, "--methods", "fedavg,local", "--out", str(out), "--device", "cpu", "--workers", "2", "--no-stack", *more]
    return subprocess.run([sys.executable, "-c", WITHOUT_RAY_AND_MLFLOW, *args], cwd=ROOT, check=True, timeout=300,
                          capture_output=True, text=True).stdout


def device_cell(file: str, out: Path, output: Path) -> dict:
    """The cell run there (one by one, as `fedsweep bench` trains where the file says nothing) and recorded into
    ``output``; its state's methods."""
    printed = there(file, out, "--code", "abc123")
    assert "fedavg: chose" in printed and "local: chose" in printed
    device_bench.main(["log", file, str(out), "--output", str(output)])
    return json.loads((output / Path(file).stem / "bench_state.json").read_text())["methods"]


def table_numbers(path: Path) -> pd.DataFrame:
    """A table's columns that are computed from the runs' metrics (not their wall times)."""
    table = pd.read_csv(path)
    return table[[c for c in table.columns if "wall" not in c]]


def check_recorded_cell(file: str, folder: Path, methods: dict) -> None:
    """What :func:`device_cell` ran there (into ``folder / "there"``) and recorded (into ``folder / "device"``):
    3 settings tuned on seed 0 and the chosen ones (one or two) on seeds 1 and 2, chosen there from the trial files as
    here from the MLflow runs; a run there again with the folder beside it runs nothing; logged again, nothing more is
    recorded; a folder where a tuning trial of local's is missing records fedavg alone, local left for a later run.
    Called by tests/test_bench.py's benchmark test, on the cell its Ray run computed (one cell computed, not two)."""
    for key in ("fedavg", "local"):
        assert len(list((folder / "there" / key / "tune").glob("trial_*.jsonl"))) == 3
        chosen = json.loads((folder / "there" / key / "chosen.json").read_text())
        assert len(list((folder / "there" / key / "final").glob("trial_*.jsonl"))) == 2 * len(set(chosen.values()))
        assert methods[key]["chosen"] == chosen and methods[key]["tried"] == 3 and {"tune_run", "final_run"} <= set(methods[key])
    cell = folder / "device" / "skew"
    assert sorted(pd.read_csv(cell / "table_b3.csv")["algorithm"]) == ["fedavg", "local"]
    runs = pd.read_csv(cell / "final_runs_b3.csv")
    assert set(runs["code"]) == {"abc123"} and runs["platform"].str.startswith("torch ").all()
    assert (cell / "runs" / f"{methods['fedavg']['tune_run']}.csv").exists()  # the phases travel with the folder

    printed = there(file, folder / "again", "--output", str(folder / "device"))
    assert "tuned already in" in printed and "fedavg, local; not run" in printed and not (folder / "again").exists()

    device_bench.main(["log", file, str(folder / "there"), "--output", str(folder / "device")])
    assert json.loads((cell / "bench_state.json").read_text())["methods"] == methods
    shutil.copytree(folder / "there", folder / "partial")
    (folder / "partial" / "local" / "tune" / "trial_0001.jsonl").unlink()
    device_bench.main(["log", file, str(folder / "partial"), "--output", str(folder / "part")])
    state = json.loads((folder / "part" / "skew" / "bench_state.json").read_text())["methods"]
    assert "final_run" in state["fedavg"] and not {"chosen", "tune_run", "final_run"} & set(state["local"])
    assert sorted(pd.read_csv(folder / "part" / "skew" / "table_b3.csv")["algorithm"]) == ["fedavg"]


def test_no_trial_starts_with_less_time_left_than_a_trial_takes(tmp_path):
    from tests.test_bench import METHODS, bench_file

    (tmp_path / "methods.yaml").write_text(yaml.safe_dump(METHODS))
    file = bench_file(tmp_path, "skew", {"name": "label_skew", "classes_per_client": 4})
    printed = there(file, tmp_path / "there", "--time-box", "0")
    assert "6 trial(s) not started" in printed and not list((tmp_path / "there").glob("*/*/trial_*.jsonl"))
