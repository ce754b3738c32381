"""``bench.kernels``: a benchmark cell names the CPU kernels its runs are computed with (the Synthetic cell, make demo's:
the same numbers on any x86-64 CPU; docs/benchmark.md). `fedsweep bench` starts its Ray workers with them, refuses
what would compute without them before anything runs, and records no run whose platform does not name them."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
import yaml

from fedsweep.bench import load_bench, use_kernels, with_kernels
from fedsweep.config import ConfigError
from fedsweep.table import read_runs
from fedsweep.tracking import KERNEL_VARS, names_kernels
from tests.conftest import ROOT
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


@pytest.fixture
def kernel_env(monkeypatch):
    """None of the kernel variables set, and each restored after the test (absent ones too: ``use_kernels`` sets them)."""
    for var in (*KERNEL_VARS, "RAY_ADDRESS"):
        monkeypatch.setenv(var, "-")
        monkeypatch.delenv(var)
    return monkeypatch


def test_a_platform_names_kernels_exactly():
    told = PLATFORM.format("AVX2") + ", MKL_CBWR=COMPATIBLE,STRICT, ONEDNN_MAX_CPU_ISA=AVX2"
    assert names_kernels(told, {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "COMPATIBLE,STRICT", "ONEDNN_MAX_CPU_ISA": "AVX2"})
    assert names_kernels(told, {"MKL_CBWR": "COMPATIBLE,STRICT", "ONEDNN_MAX_CPU_ISA": "AVX2"})
    assert not names_kernels(told, {"MKL_CBWR": "COMPATIBLE", "ONEDNN_MAX_CPU_ISA": "AVX2"})  # a prefix of the value is another value
    assert not names_kernels(told, {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "COMPATIBLE,STRICT"})  # oneDNN's set, not declared
    assert not names_kernels(told, {"ATEN_CPU_CAPABILITY": "avx512", "MKL_CBWR": "COMPATIBLE,STRICT", "ONEDNN_MAX_CPU_ISA": "AVX2"})
    assert not names_kernels(PLATFORM.format("AVX2"), {"MKL_CBWR": "COMPATIBLE"})  # not set: MKL chose by the CPU
    assert names_kernels(PLATFORM.format("AVX512"), {})


def test_kernels_that_choose_nothing_are_refused_naming_the_field(tmp_path):
    text = problems(cell(tmp_path, kernels={"OMP_NUM_THREADS": "1", "ATEN_CPU_CAPABILITY": "AVX2", "MKL_CBWR": "COMPATIBLE; rm",
                                            "ONEDNN_MAX_CPU_ISA": "AVX2 ", "FEDSWEEP_CONV": "onednn"}))
    assert f"bench.kernels.OMP_NUM_THREADS: not a variable that chooses CPU kernels; allowed: {', '.join(KERNEL_VARS)}" in text
    assert "bench.kernels.ATEN_CPU_CAPABILITY: 'AVX2'; allowed: default, avx2, avx512, zvector, vsx, sve256 (PyTorch ignores any other)" in text
    assert "bench.kernels.MKL_CBWR: 'COMPATIBLE; rm'; allowed: AUTO, COMPATIBLE, SSE2" in text
    assert "bench.kernels.ONEDNN_MAX_CPU_ISA: 'AVX2 '; allowed: a value as the variable takes it" in text
    assert ("bench.kernels.FEDSWEEP_CONV: 'onednn'; allowed: native (convolutions without oneDNN), or unset (oneDNN, "
            "PyTorch's default)") in text
    load_bench(cell(tmp_path, kernels={"MKL_CBWR": "AVX2,STRICT", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}), check_cluster=False)


#: A few SGD steps of the small CNN in a fresh process: oneDNN's primitive executions (its verbose log) and the
#: parameters' sum, exactly. ``LATE_CONV``: $FEDSWEEP_CONV set only after fedsweep's modules are imported.
_CNN_STEPS = """
import os, torch
from fedsweep.models import CNNConfig, build_model
from fedsweep.tracking import run_platform
if "LATE_CONV" in os.environ:
    os.environ["FEDSWEEP_CONV"] = os.environ["LATE_CONV"]
torch.manual_seed(0)
model = build_model(CNNConfig(channels=[6, 16], hidden=[120, 84]), 784, 10)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
x, y = torch.randn(20, 784), torch.randint(0, 10, (20,))
for _ in range(3):
    opt.zero_grad(); torch.nn.functional.cross_entropy(model(x), y).backward(); opt.step()
print("SUM", repr(sum(p.double().sum().item() for p in model.parameters())))
print("PLATFORM", run_platform())
"""


def _cnn_steps(**env: str) -> tuple[int, str, str]:
    clean = {k: v for k, v in os.environ.items() if k not in KERNEL_VARS}
    done = subprocess.run([sys.executable, "-c", _CNN_STEPS], env={**clean, "ONEDNN_VERBOSE": "1", "DNNL_VERBOSE": "1", **env},
                          capture_output=True, text=True, check=False, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout.splitlines()
    value = lambda key: next(line.split(" ", 1)[1] for line in out if line.startswith(key + " "))
    return sum(",exec," in line for line in out), value("SUM"), value("PLATFORM")


@pytest.mark.slow  # four Python processes, each building a CNN: outside `make test-fast`
@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this PyTorch has no oneDNN to leave out")
def test_fedsweep_conv_native_computes_convolutions_without_onednn():
    """``FEDSWEEP_CONV=native`` (a ``bench.kernels`` variable, applied where a CNN is built): the CNN's convolutions
    run no oneDNN primitive, so oneDNN's own settings no longer change the numbers, and the platform names it."""
    with_onednn, _, plain = _cnn_steps()
    native, total, platform = _cnn_steps(FEDSWEEP_CONV="native")
    capped, total_capped, _ = _cnn_steps(FEDSWEEP_CONV="native", ONEDNN_MAX_CPU_ISA="SSE41")
    late, total_late, _ = _cnn_steps(LATE_CONV="native")
    assert with_onednn > 0 and native == capped == late == 0
    assert total == total_capped == total_late
    assert platform == plain + ", FEDSWEEP_CONV=native"


def test_another_fedsweep_conv_is_refused_before_anything_starts(monkeypatch):
    """Any value but ``native`` (or unset): every command refuses it first, exit 2 (bad input), naming the variable
    and the allowed values; a CNN is not built under it."""
    env = {**os.environ, "FEDSWEEP_CONV": "off"}
    done = subprocess.run([FEDSWEEP, "algorithms"], env=env, capture_output=True, text=True, check=False, timeout=120)
    allowed = "allowed: native (convolutions without oneDNN), or unset (oneDNN, PyTorch's default)"
    assert done.returncode == 2 and done.stderr == f"error: $FEDSWEEP_CONV: 'off'; {allowed}\n" and not done.stdout
    from fedsweep.models import CNNConfig, build_model

    monkeypatch.setenv("FEDSWEEP_CONV", "onednn")
    with pytest.raises(ValueError, match=re.escape(f"$FEDSWEEP_CONV: 'onednn'; {allowed}")):
        build_model(CNNConfig(), 784, 10)
    monkeypatch.setenv("FEDSWEEP_CONV", "")  # empty: unset
    build_model(CNNConfig(), 784, 10)


def test_the_kernels_go_into_the_environment_unless_it_says_otherwise(tmp_path, kernel_env):
    import fedsweep.bench

    # a Ray instance the suite's worker may hold from an earlier test is the next test's case, not this one's
    kernel_env.setattr(fedsweep.bench, "_ray_running", lambda: False)
    kernels = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "COMPATIBLE"}
    a, plain = load_bench(cell(tmp_path, "a", kernels), check_cluster=False), load_bench(cell(tmp_path, "b"), check_cluster=False)
    assert use_kernels([plain]) == {} and not any(v in os.environ for v in KERNEL_VARS)

    def refused(benches) -> str:
        before = dict(os.environ)
        with pytest.raises(ConfigError) as e:
            use_kernels(benches)
        assert dict(os.environ) == before  # nothing set when refused
        return str(e.value)

    assert "b.yaml: bench.kernels: none, " in refused([a, plain]) and "allowed: files with the same kernels in one command" in refused([a, plain])
    kernel_env.setenv("RAY_ADDRESS", "127.0.0.1:6379")  # a joined cluster's workers do not inherit this environment
    assert "bench.kernels: a joined cluster's (127.0.0.1:6379) workers keep the environment they started with" in refused([a])
    kernel_env.delenv("RAY_ADDRESS")
    joined = yaml.safe_load(Path(cell(tmp_path, "c", kernels)).read_text())  # a later file's own address counts as well
    joined["resources"] = {"ray_address": "10.0.0.1:6379"}
    Path(tmp_path / "c.yaml").write_text(yaml.safe_dump(joined))
    assert "a joined cluster's (10.0.0.1:6379) workers" in refused([a, load_bench(tmp_path / "c.yaml", check_cluster=False)])
    kernel_env.setenv("MKL_CBWR", "AUTO")
    assert "bench.kernels.MKL_CBWR: COMPATIBLE, but $MKL_CBWR is AUTO in this environment; allowed: MKL_CBWR=COMPATIBLE, or unset" in refused([a])
    kernel_env.setenv("MKL_CBWR", "COMPATIBLE")
    kernel_env.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # chooses kernels too, and the file leaves it out
    assert "bench.kernels: $ONEDNN_MAX_CPU_ISA is AVX2 in this environment and the file leaves it out; allowed: unset it" in refused([a])
    kernel_env.delenv("ONEDNN_MAX_CPU_ISA")
    kernel_env.delenv("MKL_CBWR")
    s390 = load_bench(cell(tmp_path, "d", {"ATEN_CPU_CAPABILITY": "zvector"}), check_cluster=False)  # not this CPU's
    assert "bench.kernels.ATEN_CPU_CAPABILITY: zvector, but this CPU runs " in refused([s390])
    assert use_kernels([a, a]) == kernels and {v: os.environ[v] for v in kernels} == kernels
    kernel_env.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    assert use_kernels([a]) == kernels  # set here (as by a job's runtime environment): the cluster's are the user's to set


def test_runs_computed_without_the_kernels_are_not_the_cells(tmp_path, capsys):
    bench = load_bench(cell(tmp_path, kernels={"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "COMPATIBLE"}), check_cluster=False)
    runs = pd.DataFrame({"run_id": ["a", "b", "c"], "platform": [PLATFORM.format("AVX2") + ", MKL_CBWR=COMPATIBLE",
                                                                 PLATFORM.format("AVX512"), None]})
    assert list(with_kernels(bench, runs)["run_id"]) == ["a"]
    assert f"[bench cell] 2 run(s) computed without bench.kernels (ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=COMPATIBLE), on no platform recorded; {PLATFORM.format('AVX512')}: " \
        in capsys.readouterr().err
    assert with_kernels(load_bench(cell(tmp_path, "plain"), check_cluster=False), runs) is runs


def test_a_recorded_phase_computed_without_the_kernels_runs_again(tmp_path, tracking_uri, capsys):
    """The published Synthetic folder (806 runs, each naming make demo's kernels) resumes with nothing to run under its
    own file; declare other kernels and every recorded phase is owed again, before anything runs."""
    from fedsweep.bench_run import open_state

    (tmp_path / "out").mkdir()
    shutil.copytree(ROOT / "docs/results/benchmark/bench-synthetic", tmp_path / "out" / "bench-synthetic")
    shutil.copy(ROOT / "sweeps/benchmark/methods.yaml", tmp_path)
    raw = yaml.safe_load((ROOT / "sweeps/benchmark/synthetic.yaml").read_text())
    for name, kernels in (("own", raw["bench"]["kernels"]), ("other", {"ATEN_CPU_CAPABILITY": "avx2"})):
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump({**raw, "bench": {**raw["bench"], "kernels": kernels}}))
        _, state, _, _ = open_state(load_bench(tmp_path / f"{name}.yaml", check_cluster=False), tmp_path / "out", resume=True)
        done = [k for k, m in state["methods"].items() if {"chosen", "tune_run", "final_run"} <= set(m)]
        assert len(done) == (38 if name == "own" else 0), name
    assert "608 run(s) computed without bench.kernels (ATEN_CPU_CAPABILITY=avx2), on torch 2.13.0+cpu (AVX2)" in capsys.readouterr().err


@pytest.mark.ray
def test_ray_already_running_without_the_kernels_is_refused(ray_session, tmp_path, kernel_env):
    bench = load_bench(cell(tmp_path, kernels={"MKL_CBWR": "COMPATIBLE"}), check_cluster=False)
    with pytest.raises(ConfigError, match="the Ray instance already running in this process workers keep the environment"):
        use_kernels([bench])


@pytest.mark.ray
def test_bench_runs_every_trial_with_the_cells_kernels(tmp_path):
    """The command as a user types it, none of the variables set: every run's platform names the cell's kernels
    (PyTorch's kernels without vector extensions and MKL's COMPATIBLE branch, neither this CPU's own, and
    convolutions without oneDNN: the Ray workers' environment has them all)."""
    kernels = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE", "FEDSWEEP_CONV": "native"}
    path = cell(tmp_path, kernels=kernels, max_concurrent_trials=2)
    env = {k: v for k, v in os.environ.items() if k not in (*KERNEL_VARS, "RAY_ADDRESS", "MLFLOW_RUN_ID")}
    env["MLFLOW_TRACKING_URI"] = f"sqlite:///{tmp_path / 'mlflow.db'}"
    bench = subprocess.run([FEDSWEEP, "bench", path, "--output", str(tmp_path / "out"), "--quiet"], env=env, cwd=tmp_path,
                           capture_output=True, text=True, timeout=300, check=False)
    assert bench.returncode == 0, bench.stdout[-2000:] + bench.stderr[-3000:]
    assert "CPU kernels (bench.kernels): ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE FEDSWEEP_CONV=native" in bench.stdout
    saved = sorted((tmp_path / "out" / "cell" / "runs").glob("*.csv"))
    runs = pd.concat([read_runs(str(p))[0] for p in saved])
    assert len(saved) == 2 and len(runs) == 2 + 2  # the tuning phase's 2 settings, the chosen one on 2 seeds
    assert all(names_kernels(p, kernels) and "(DEFAULT)" in p for p in runs["platform"]), set(runs["platform"])

    env["MKL_CBWR"] = "AUTO"  # said otherwise in the environment: refused before Ray or MLflow
    again = subprocess.run([FEDSWEEP, "bench", path, "--output", str(tmp_path / "out"), "--resume"], env=env, cwd=tmp_path,
                           capture_output=True, text=True, timeout=120, check=False)
    assert again.returncode == 2 and "bench.kernels.MKL_CBWR: COMPATIBLE, but $MKL_CBWR is AUTO" in again.stderr
    assert "[bench cell]" not in again.stdout + again.stderr
