"""``bench.kernels``: a benchmark cell names the CPU kernels its runs are computed with (the Synthetic cell, make demo's:
the same numbers on any x86-64 CPU; docs/benchmark.md). `fedsweep bench` starts its Ray workers with them, refuses
what would compute without them before anything runs, and records no run whose platform does not name them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

from fedsweep.bench import load_bench, use_kernels, with_kernels
from fedsweep.config import ConfigError
from fedsweep.table import read_runs
from fedsweep.tracking import KERNEL_VARS, names_kernels
from tests.test_bench import METHODS, bench_file, problems

FEDSWEEP = str(Path(sys.executable).with_name("fedsweep"))
PLATFORM = "torch 2.13.0+cpu ({}), Intel(R) Xeon(R) Processor (x86_64), Python 3.11.7"


def cell(folder: Path, name: str = "cell", kernels: dict | None = None, **sweep) -> str:
    """A one-method cell of 2 settings, the chosen one on 2 seeds: 4 trials of 2 rounds."""
    (folder / "methods.yaml").write_text(yaml.safe_dump({"methods": {"fedavg": METHODS["methods"]["fedavg"]}}))
    path = Path(bench_file(folder, name, {"name": "dirichlet", "concentration": 0.5}, budgets=[],
                           **({"kernels": kernels} if kernels is not None else {})))
    raw = yaml.safe_load(path.read_text())
    raw["sweep"].update(num_samples=2, **sweep)
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return str(path)


def test_a_platform_names_kernels_exactly():
    told = PLATFORM.format("AVX2") + ", MKL_CBWR=COMPATIBLE,STRICT, ONEDNN_MAX_CPU_ISA=AVX2"
    assert names_kernels(told, {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "COMPATIBLE,STRICT", "ONEDNN_MAX_CPU_ISA": "AVX2"})
    assert not names_kernels(told, {"MKL_CBWR": "COMPATIBLE"})  # a prefix of the value set is another value
    assert not names_kernels(told, {"ATEN_CPU_CAPABILITY": "avx512"})
    assert not names_kernels(PLATFORM.format("AVX2"), {"MKL_CBWR": "COMPATIBLE"})  # not set: MKL chose by the CPU
    assert names_kernels(PLATFORM.format("AVX512"), {})


def test_kernels_that_choose_nothing_are_refused_naming_the_field(tmp_path):
    text = problems(cell(tmp_path, kernels={"OMP_NUM_THREADS": "1", "MKL_CBWR": "COMPATIBLE; rm -rf"}))
    assert f"bench.kernels.OMP_NUM_THREADS: not a variable that chooses CPU kernels; allowed: {', '.join(KERNEL_VARS)}" in text
    assert "bench.kernels.MKL_CBWR: 'COMPATIBLE; rm -rf'; allowed: a value as the variable takes it" in text


def test_the_kernels_go_into_the_environment_unless_it_says_otherwise(tmp_path, monkeypatch):
    kernels = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "COMPATIBLE"}
    for var in (*KERNEL_VARS, "RAY_ADDRESS"):
        monkeypatch.delenv(var, raising=False)  # restored after the test, as use_kernels leaves them
    a, plain = load_bench(cell(tmp_path, "a", kernels), check_cluster=False), load_bench(cell(tmp_path, "b"), check_cluster=False)
    assert use_kernels([plain]) == {} and not any(v in os.environ for v in KERNEL_VARS)

    def refused(benches) -> str:
        before = dict(os.environ)
        with pytest.raises(ConfigError) as e:
            use_kernels(benches)
        assert dict(os.environ) == before  # nothing set when refused
        return str(e.value)

    assert "b.yaml: bench.kernels: none, " in refused([a, plain]) and "allowed: files with the same kernels in one command" in refused([a, plain])
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")  # a joined cluster's workers do not inherit this environment
    assert "bench.kernels: a joined cluster's (127.0.0.1:6379) workers keep the environment they started with" in refused([a])
    monkeypatch.delenv("RAY_ADDRESS")
    monkeypatch.setenv("MKL_CBWR", "AUTO")
    assert "bench.kernels.MKL_CBWR: COMPATIBLE, but $MKL_CBWR is AUTO in this environment; allowed: MKL_CBWR=COMPATIBLE, or unset" in refused([a])
    monkeypatch.setenv("MKL_CBWR", "COMPATIBLE")
    assert use_kernels([a, a]) == kernels and {v: os.environ[v] for v in kernels} == kernels
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    assert use_kernels([a]) == kernels  # set here (as by a job's runtime environment): the cluster's are the user's to set


def test_runs_computed_without_the_kernels_are_not_the_cells(tmp_path, capsys):
    bench = load_bench(cell(tmp_path, kernels={"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "COMPATIBLE"}), check_cluster=False)
    runs = pd.DataFrame({"run_id": ["a", "b", "c"], "platform": [PLATFORM.format("AVX2") + ", MKL_CBWR=COMPATIBLE",
                                                                 PLATFORM.format("AVX512"), None]})
    assert list(with_kernels(bench, runs)["run_id"]) == ["a"]
    assert f"[bench cell] 2 run(s) computed without bench.kernels (ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=COMPATIBLE), on no platform recorded; {PLATFORM.format('AVX512')}: " \
        in capsys.readouterr().err
    assert with_kernels(load_bench(cell(tmp_path, "plain"), check_cluster=False), runs) is runs


@pytest.mark.ray
def test_bench_runs_every_trial_with_the_cells_kernels(tmp_path):
    """The command as a user types it, none of the variables set: every run's platform names the cell's kernels
    (PyTorch's kernels without vector extensions and MKL's COMPATIBLE branch, neither this CPU's own)."""
    kernels = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE"}
    path = cell(tmp_path, kernels=kernels, max_concurrent_trials=2)
    env = {k: v for k, v in os.environ.items() if k not in (*KERNEL_VARS, "RAY_ADDRESS", "MLFLOW_RUN_ID")}
    env["MLFLOW_TRACKING_URI"] = f"sqlite:///{tmp_path / 'mlflow.db'}"
    bench = subprocess.run([FEDSWEEP, "bench", path, "--output", str(tmp_path / "out"), "--quiet"], env=env, cwd=tmp_path,
                           capture_output=True, text=True, timeout=300, check=False)
    assert bench.returncode == 0, bench.stdout[-2000:] + bench.stderr[-3000:]
    assert "CPU kernels (bench.kernels): ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE" in bench.stdout
    saved = sorted((tmp_path / "out" / "cell" / "runs").glob("*.csv"))
    runs = pd.concat([read_runs(str(p))[0] for p in saved])
    assert len(saved) == 2 and len(runs) == 2 + 2  # the tuning phase's 2 settings, the chosen one on 2 seeds
    assert all(names_kernels(p, kernels) and "(DEFAULT)" in p for p in runs["platform"]), set(runs["platform"])

    env["MKL_CBWR"] = "AUTO"  # said otherwise in the environment: refused before Ray or MLflow
    again = subprocess.run([FEDSWEEP, "bench", path, "--output", str(tmp_path / "out"), "--resume"], env=env, cwd=tmp_path,
                           capture_output=True, text=True, timeout=120, check=False)
    assert again.returncode == 2 and "bench.kernels.MKL_CBWR: COMPATIBLE, but $MKL_CBWR is AUTO" in again.stderr
    assert "[bench cell]" not in again.stdout + again.stderr
