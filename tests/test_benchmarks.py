"""Benchmark scripts that need no peer framework, run in CI size so that they cannot rot where no GPU is lent:
``benchmarks/cifar_gpu.py``'s CPU path (its GPU variants run only where ``torch.cuda`` sees a device)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = [pytest.mark.ray, pytest.mark.slow]  # its own Ray, in the script's process


def test_the_cifar_gpu_benchmark_runs_its_cpu_variants_in_ci_size():
    """10 clients on stand-in CIFAR-10 files (20 images of a class in each), 2 actors of 5, 2 rounds of 2 local
    steps: both CPU variants (one client at a time, stacked) report a rate, and the script its ratio."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_RUN_ID")}
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
