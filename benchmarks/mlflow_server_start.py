"""Benchmark — how long `infra/mlflow_server.sh` takes to answer ``/health``, and how many processes it holds.

Three variants, alternated, each a fresh SQLite store on a free loopback port:

  jobs on, 4 workers   MLflow 3's defaults: its job execution (a job runner and seven huey consumers, each a process
                       with MLflow loaded) and four uvicorn workers (MLFLOW_SERVER_ENABLE_JOB_EXECUTION=true)
  jobs off, 4 workers  the script's default since the twenty-third session
  jobs off, 1 worker   what the outage tests start (MLFLOW_WORKERS=1)

Prints each variant's median seconds and processes, and its ratio to the first variant measured in the same run.

    python benchmarks/mlflow_server_start.py --repeats 2
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

VARIANTS = {
    "jobs on, 4 workers": {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "true"},
    "jobs off, 4 workers": {},
    "jobs off, 1 worker": {"MLFLOW_WORKERS": "1"},
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_once(extra: dict[str, str]) -> tuple[float, int]:
    """Seconds from the script's start to ``/health`` answering 200, and the processes of its group then."""
    folder, port = tempfile.mkdtemp(prefix="fedsweep-server-"), free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_WORKERS", "MLFLOW_SERVER_ENABLE_JOB_EXECUTION")}
    env.update(MLFLOW_PORT=str(port), MLFLOW_SERVER_DIR=folder, **extra)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    start = time.perf_counter()
    proc = subprocess.Popen(["bash", str(ROOT / "infra" / "mlflow_server.sh")], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        while True:
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200:
                    break
            except OSError:
                if proc.poll() is not None:
                    raise SystemExit(f"the server exited with {proc.returncode}") from None
                time.sleep(0.1)
        seconds = time.perf_counter() - start
        processes = len(subprocess.run(["pgrep", "-g", str(proc.pid)], check=False, capture_output=True, text=True).stdout.split())
        return seconds, processes
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    seconds: dict[str, list[float]] = {name: [] for name in VARIANTS}
    processes: dict[str, int] = {}
    for _ in range(args.repeats):
        for name, extra in VARIANTS.items():
            s, n = start_once(extra)
            seconds[name].append(s)
            processes[name] = n
            print(f"{name}: {s:.1f} s, {n} processes", flush=True)
    first = statistics.median(seconds[next(iter(VARIANTS))])
    for name, values in seconds.items():
        median = statistics.median(values)
        print(f"{name:>20}: median {median:.1f} s of {[round(v, 1) for v in values]}, {processes[name]} processes, "
              f"ratio to the defaults {median / first:.2f}")


if __name__ == "__main__":
    main()
