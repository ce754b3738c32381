"""Shared by the benchmark scripts: run a measurement in a child process pinned to some cores, repeat, take medians.

Each measurement runs in a fresh process (``taskset -c CORES python SCRIPT --worker ...``) that prints
one JSON line; Ray and every actor it starts inherit the CPU affinity, so "1 CPU" means one core.
Variants are interleaved repetition by repetition, so that drift on a noisy machine hits all alike.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def measure(script: str, cores: str, args: list[str], timeout_s: float = 1800) -> dict:
    cmd = ["taskset", "-c", cores, sys.executable, script, "--worker", *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_DEDUP_LOGS": "0"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=ROOT)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def repeat(script: str, variants: dict[str, tuple[str, list[str]]], repeats: int) -> dict[str, list[dict]]:
    """{variant: [result per repetition]}; variant -> (cores, worker args)."""
    results: dict[str, list[dict]] = {name: [] for name in variants}
    for rep in range(repeats):
        for name, (cores, args) in variants.items():
            r = measure(script, cores, args)
            results[name].append(r)
            print(f"  rep {rep + 1}/{repeats} {name}: {json.dumps(r)}", flush=True)
    return results


def median(results: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in results)


def ratios(results: dict[str, list[dict]], num: str, den: str, key: str) -> tuple[float, list[float]]:
    """Median of the per-repetition ratios num/den (paired within a repetition), and the ratios themselves."""
    rs = [a[key] / b[key] for a, b in zip(results[num], results[den])]
    return statistics.median(rs), rs
