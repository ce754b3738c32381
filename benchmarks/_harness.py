"""Shared by the benchmark scripts: run a measurement in a child process pinned to some cores, repeat, take medians.

Each measurement runs in a fresh process (``taskset -c CORES python SCRIPT --worker ...``) that prints
one JSON line; Ray and every actor it starts inherit the CPU affinity, so "1 CPU" means one core.
Variants are interleaved repetition by repetition, so that drift on a noisy machine hits all alike.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The peer benchmarks' data sections (pfl_peer.py, flower_peer.py), 20 clients each: issue 23's capped Synthetic, its
# uncapped power-law sizes, and a Dirichlet(0.1) split of MNIST.
_SYNTHETIC = {"dataset": "synthetic", "num_clients": 20, "alpha": 0.5, "beta": 0.5}
WORKLOADS = {
    "capped": {**_SYNTHETIC, "max_samples_per_client": 500},
    "powerlaw": _SYNTHETIC,
    "dirichlet": {"dataset": "mnist", "num_clients": 20, "partition": {"name": "dirichlet", "concentration": 0.1}},
}


def measure(script: str, cores: str, args: list[str], timeout_s: float = 1800, python: str | None = None) -> dict:
    """One worker run; ``python`` is another interpreter (a separate virtual environment) if given."""
    cmd = ["taskset", "-c", cores, python or sys.executable, script, "--worker", *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_DEDUP_LOGS": "0"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=ROOT, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def repeat(script: str, variants: dict[str, tuple], repeats: int) -> dict[str, list[dict]]:
    """{variant: [result per repetition]}; variant -> (cores, worker args[, python interpreter])."""
    results: dict[str, list[dict]] = {name: [] for name in variants}
    for rep in range(repeats):
        for name, (cores, args, *python) in variants.items():
            r = measure(script, cores, args, python=python[0] if python else None)
            results[name].append(r)
            print(f"  rep {rep + 1}/{repeats} {name}: {json.dumps(r)}", flush=True)
    return results


def timed_actor_run(cfg, num_cpus: int, around_rounds=contextlib.nullcontext) -> tuple[float, float, dict, object]:
    """Start Ray with ``num_cpus`` and run ``cfg`` on fedsweep's actors: (seconds of rounds 1..R, seconds
    since the call, the last round's metrics, the final global vector). Round 0 (evaluation of the initial
    model) is outside the timed rounds; ``around_rounds()`` is a context entered around rounds 1..R, when
    every actor is up (e.g. to read the processes' CPU times)."""
    import time

    import ray

    from fedsweep.experiment import ExperimentRunner

    t0 = time.perf_counter()
    from fedsweep.experiment import start_local_ray  # the dashboard agent on a free port, as fedsweep starts Ray

    start_local_ray(num_cpus=num_cpus, log_to_driver=False)
    runner = ExperimentRunner(cfg)
    try:
        runner.start()
        rounds = runner.rounds(pipelined=True)  # as fedsweep.experiment.execute drives them
        next(rounds)
        with around_rounds():
            t1 = time.perf_counter()
            for last in rounds:
                pass
            t2 = time.perf_counter()
        params = ray.get(runner.server.global_params.remote())
    finally:
        runner.stop()
        ray.shutdown()
    return t2 - t1, t2 - t0, last, params


def print_ratios(res: dict[str, list[dict]], rows: list[tuple[str, str, str]], width: int = 48) -> None:
    """One line per (label, numerator, denominator): median paired ratio and the ratios, rounds only | whole run."""
    for label, num, den in rows:
        r, rs = ratios(res, num, den, "rounds_s")
        t, ts = ratios(res, num, den, "total_s")
        print(f"  {label:{width}s} {r:6.3f} {[round(x, 3) for x in rs]} | {t:6.3f} {[round(x, 3) for x in ts]}")


def median(results: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in results)


def ratios(results: dict[str, list[dict]], num: str, den: str, key: str) -> tuple[float, list[float]]:
    """Median of the per-repetition ratios num/den (paired within a repetition), and the ratios themselves."""
    rs = [a[key] / b[key] for a, b in zip(results[num], results[den])]
    return statistics.median(rs), rs


class GPUSampler(threading.Thread):
    """(utilisation %, memory used MB) of GPU 0 from nvidia-smi every 0.2 s until ``stop`` is set."""

    def __init__(self):
        super().__init__(daemon=True)
        self.samples: list[tuple[float, float]] = []
        self.stop = threading.Event()

    def run(self):
        while not self.stop.is_set():
            out = subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu,memory.used", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, check=False).stdout.split(",")
            self.samples.append((float(out[0]), float(out[1])))
            time.sleep(0.2)

    def summary(self) -> dict[str, float]:
        """Mean and largest utilisation (%), largest memory used (MB); {} before any sample."""
        if not self.samples:
            return {}
        busy = [u for u, _ in self.samples]
        return {"gpu_util_mean": statistics.mean(busy), "gpu_util_max": max(busy),
                "gpu_memory_used_mb": max(m for _, m in self.samples)}
