"""Benchmark scripts run in CI size so that they cannot rot where no GPU is lent: ``benchmarks/cifar_gpu.py``'s CPU
path (its GPU variants run only where ``torch.cuda`` sees a device), and ``benchmarks/pfl_cifar.py``'s fedsweep
variants on the CPU (its pfl-research variant needs pfl's environment: ``--pfl-python none`` here); and the CPU-only
scripts that measure a kernel (trial split, plain forward, stack width)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_the_cifar_gpu_benchmark_runs_its_cpu_variants_in_ci_size(ray_session):
    """10 clients on stand-in CIFAR-10 files (20 images of a class in each), 2 actors of 5, 2 rounds of 2 local
    steps: both CPU variants (one client at a time, stacked) report a rate, and the script its ratio. The script
    joins the tests' Ray instance (``RAY_ADDRESS``, its 2 CPUs) instead of starting one of its own."""
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_RUN_ID"}
    env["RAY_ADDRESS"] = ray_session.get_runtime_context().gcs_address
    r = subprocess.run([sys.executable, "benchmarks/cifar_gpu.py", "--rounds", "2", "--clients", "10",
                        "--clients-per-actor", "5", "--per-class", "20", "--tau", "2"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600, env=env, check=False)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "10 clients in 2 actors; stand-in CIFAR-10 files" in r.stdout
    rates = dict(re.findall(r"^(CPU actors, [a-z ]+) \(.*\): ([0-9.]+) rounds/s, devices \['cpu'\]", r.stdout, re.MULTILINE))
    assert set(rates) == {"CPU actors, one client at a time", "CPU actors, stacked"}, r.stdout
    assert all(float(v) > 0 for v in rates.values())
    ratio = float(re.search(r"stacked / one at a time, rounds per second: ([0-9.]+)", r.stdout).group(1))
    assert ratio == pytest.approx(float(rates["CPU actors, stacked"]) / float(rates["CPU actors, one client at a time"]),
                                  rel=0.05)  # as printed: rates to 3 decimals, the ratio to 2


def test_the_pfl_cifar_benchmark_runs_fedsweeps_variants_on_the_cpu_in_ci_size():
    """pfl-research's CIFAR-10 setting cut to 20 clients (4 a round, 3 rounds) on stand-in files: the export for pfl
    is written, both fedsweep variants report a round time and the same final scores (3 rounds: equal up to
    summation order), and a round's operations are those of pfl's simple_cnn: 16,835,200 multiply-adds an image
    (3×3 convolutions 30·30·32·27 and 28·28·64·288, dense 12,544·128 and 128·10), ×6 for a training step, ×200
    images (4 clients × 5 steps × batch 10)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_RUN_ID")}
    r = subprocess.run([sys.executable, "benchmarks/pfl_cifar.py", "--rounds", "3", "--clients", "20", "--cohort", "4",
                        "--per-class", "10", "--pfl-python", "none", "--device", "cpu"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600, env=env, check=False)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["gflop_round"] == pytest.approx(6 * (30 * 30 * 32 * 27 + 28 * 28 * 64 * 288 + 12544 * 128 + 128 * 10) * 200 / 1e9)
    one, stacked = out["results"]["fedsweep, one by one"], out["results"]["fedsweep, stacked"]
    assert (one["stacked"], stacked["stacked"]) == (False, True)
    assert one["round_s_median"] > 0 and stacked["round_s_median"] > 0
    assert one["final_global_accuracy"] == stacked["final_global_accuracy"]
    assert one["final_global_loss"] == pytest.approx(stacked["final_global_loss"], abs=1e-5)
    assert "pfl-research" not in out["results"] and "stacked: " in r.stdout


def test_the_trial_split_script_times_an_evaluation_and_the_training_rounds(tmp_path):
    """``benchmarks/trial_split.py`` on a small digits experiment: both times measured, the trial's totals their
    multiples by the file's rounds and evaluations, the algorithm replaced when asked."""
    import yaml

    from benchmarks.trial_split import main
    from tests.conftest import config_dict

    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(config_dict(rounds=6, eval_every=3)))
    out = main([str(path), "--rounds", "2", "--algorithm", "ditto"])
    assert out["algorithm"] == "ditto" and out["evaluations"] == 3  # rounds 0, 3 and 6
    assert out["evaluation_s"] > 0 and out["training_round_s"] > 0
    assert out["trial_training_s"] == pytest.approx(6 * out["training_round_s"], abs=0.06)  # both rounded


def test_the_plain_forward_script_times_both_paths_and_finds_the_same_metrics():
    """``benchmarks/plain_forward.py`` on the generated powerlaw workload, a few rounds: both layouts timed on both
    paths, every round's metrics the same on the direct path as on functional_call / vmap (the script exits 1
    otherwise). In a process with MKL's COMPATIBLE branch, where the stacked gradients agree on every x86-64 CPU
    (``tests/test_stacked.py``; an AMD CPU with MKL's own branch sums them apart in the last bits)."""
    done = subprocess.run([sys.executable, "benchmarks/plain_forward.py", "--workload", "powerlaw", "--rounds", "3",
                           "--repeats", "1"], env={**os.environ, "MKL_CBWR": "COMPATIBLE"}, cwd=ROOT,
                          capture_output=True, text=True, check=False, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    for layout in ("stacked", "one by one"):
        line = re.search(rf"^  {layout} +general +([0-9.]+) .* direct +([0-9.]+) .*every round's metrics the same$",
                         done.stdout, re.MULTILINE)
        assert line and float(line[1]) > 0 and float(line[2]) > 0, done.stdout


def test_the_stack_width_script_times_every_width_of_both_models():
    """``benchmarks/stack_width.py`` in a few steps: a cost per client for every stack width of both MLPs, and
    stacking ten clients costs less per client than one alone (what the stacked layout is for)."""
    from benchmarks.stack_width import WIDTHS, main

    out = main(["--repeats", "3", "--steps", "5"])  # medians of 3: one repetition of 3 steps beside the suite's load failed once
    assert sorted(out) == [60, 784]
    for per_client in out.values():
        assert sorted(per_client) == sorted(WIDTHS) and all(s > 0 for s in per_client.values())
        assert per_client[10] < per_client[1]


def test_the_cnn_pool_script_times_both_poolings_and_finds_the_same_metrics(tmp_path):
    """``benchmarks/cnn_pool.py`` on a digits CNN (8×8 images, pooled once), two algorithms of an experiment file, a
    few rounds, two repetitions (the order alternated): both ways timed, each way's own pooling run without autograd
    (the evaluations; IFCA's losses), every round's metrics the same, the layer's own forward back in place after."""
    import yaml

    from benchmarks.cnn_pool import main
    from fedsweep.models import MaxPool2
    from tests.conftest import config_dict

    forward = MaxPool2.forward
    path = tmp_path / "cnn.yaml"
    path.write_text(yaml.safe_dump(config_dict(model={"_replace": True, "name": "cnn", "channels": [4, 4], "hidden": [8],
                                                      "kernel_size": 3, "pool": "last"}, resources=None)))
    out = main([str(path), "--methods", "fedavg,ifca", "--rounds", "2", "--repeats", "2"])
    assert sorted(out) == ["fedavg", "ifca"]
    for r in out.values():
        assert r["same_metrics"] and len(r["kernel_s"]) == len(r["elementwise_s"]) == 2 and r["median_ratio"] > 0
        assert r["no_grad_calls"]["kernel"] == r["no_grad_calls"]["elementwise"] > 0
    assert out["ifca"]["no_grad_calls"]["kernel"] > out["fedavg"]["no_grad_calls"]["kernel"]  # IFCA scores its components
    assert MaxPool2.forward is forward


def test_the_peer_floor_times_the_rounds_of_the_grids_own_experiment(tmp_path):
    """``benchmarks/pfl_peer.py``'s floor (a grid's rounds alone) runs the experiment each of the grid's trials runs:
    the grid's file at one of its settings, nothing else changed; and it measures a time."""
    from benchmarks.pfl_peer import LRS, SINGLE, experiment, rounds_seconds

    one = experiment(2, SINGLE[0], SINGLE[1], "default", tmp_path / "a.db", "powerlaw")
    grid = experiment(2, {"grid": LRS}, 0, "default", tmp_path / "a.db", "powerlaw")
    assert SINGLE[0] in LRS and one["seed"] == SINGLE[1]
    assert {**grid, "algorithm": {**grid["algorithm"], "local_lr": SINGLE[0]}, "seed": SINGLE[1]} == one
    assert rounds_seconds(2, "powerlaw") > 0


def test_the_suite_cpu_script_gives_a_process_started_in_a_test_to_that_test(tmp_path):
    """``benchmarks/suite_cpu.py`` on a one-test file whose test starts a process living past one poll (an inline
    script, about a second busy, then asleep): that process's CPU goes to the test, in the printout and the CSV, not
    outside it (psutil's start times are up to a second off the clock the test's times come from), beside the pytest
    process's own."""
    (tmp_path / "test_tiny.py").write_text(
        "import subprocess, sys\n"
        "def test_child():\n"
        "    subprocess.run([sys.executable, '-c', 'import time; sum(range(8 * 10**7)); time.sleep(1.5)'], check=True)\n")
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "suite_cpu.py"), "--csv", str(tmp_path / "cpu.csv"), "--",
                          str(tmp_path / "test_tiny.py"), "-p", "no:cacheprovider"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    assert "pytest exit 0; " in out and "over 1 tests" in out and "python -c" in out.split("heaviest files:")[1], out
    import csv

    [row] = list(csv.DictReader((tmp_path / "cpu.csv").open()))
    assert row["test"].endswith("test_tiny.py::test_child") and float(row["cpu_s"]) >= 0.5  # the child's, at least
    assert 0 <= float(row["pytest_cpu_s"]) < float(row["cpu_s"])  # pytest's own (it waited on the child)
