"""Where the test suite's CPU goes: pytest in one process, every process it starts polled once a second.

    python benchmarks/suite_cpu.py [--top 40] -- -m "ray or slow" [pytest arguments...]

Each process's CPU (its last reading; a process shorter than a second may be missed) goes to the test that was
running when the process started; processes that outlive 10 minutes (the session's Ray instance, a process pool)
are counted apart; the pytest process's own CPU goes to the test it ran (its set-up and teardown included). Prints
the total, the long-lived processes by kind, the heaviest files and the heaviest tests with their Ray worker
processes and other processes by kind (``--csv`` writes every test's). Pytest runs without xdist, so one test runs
at a time.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

#: Substrings of a command line that name a kind of process (the first that matches).
KINDS = ("raylet", "gcs_server", "dashboard/agent.py", "dashboard/dashboard.py", "log_monitor", "runtime_env/agent",
         "monitor.py", "mlflow", "postgres", "chrom", "fedsweep")
PLUGIN = '''
import json, os, time
_rows = []
def _cpu():
    t = os.times()
    return t.user + t.system
def pytest_runtest_logstart(nodeid, location):
    _rows.append([nodeid, time.time(), None, _cpu()])
def pytest_runtest_logfinish(nodeid, location):
    _rows[-1][2] = time.time()
    _rows[-1][3] = _cpu() - _rows[-1][3]
    with open(os.environ["SUITE_CPU_TIMES"], "w") as f:
        json.dump(_rows, f)
'''


def kind(cmd: str) -> str:
    if "default_worker" in cmd or cmd.startswith("ray::"):
        return "Ray worker"
    words = cmd.split(" ", 3)
    if "python" in words[0] and "-c" in words[1:3]:  # a script given inline (after -B or not): its code is no kind
        return "python -c"
    return next((k for k in KINDS if k in cmd), cmd[:40])


def poll(root: psutil.Process, seen: dict, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            break
        for p in procs:
            try:
                t = p.cpu_times()
                e = seen.setdefault((p.pid, p.create_time()), {"cmd": " ".join(p.cmdline())[:300], "start": p.create_time()})
                e["cpu"], e["last"] = t.user + t.system, time.time()
            except psutil.Error:
                continue
        stop.wait(1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--csv", help="every test's CPU by kind of process, as CSV")
    parser.add_argument("pytest_args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="suite_cpu-"))
    (work / "suite_cpu_plugin.py").write_text(PLUGIN)
    env = {**os.environ, "SUITE_CPU_TIMES": str(work / "times.json"),
           "PYTHONPATH": os.pathsep.join([str(work), os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    pytest_args = [a for a in args.pytest_args if a != "--"]
    popen_at = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist", "-p", "suite_cpu_plugin",
                             "-q", *pytest_args], env=env)
    # psutil's start times are the boot time (whole seconds) plus the process's start in clock ticks: up to a second off
    # the clock the plugin's times come from; pytest's own start, against the moment it was started, gives the offset
    skew = psutil.Process(proc.pid).create_time() - popen_at
    seen: dict = {}
    stop = threading.Event()
    poller = threading.Thread(target=poll, args=(psutil.Process(proc.pid), seen, stop), daemon=True)
    poller.start()
    rc = proc.wait()
    stop.set()
    poller.join()
    times = json.loads((work / "times.json").read_text()) if (work / "times.json").exists() else []
    per: dict = collections.defaultdict(lambda: collections.defaultdict(lambda: [0, 0.0]))
    apart: dict = collections.defaultdict(lambda: [0, 0.0])
    for (pid, _), e in seen.items():
        k = "pytest" if pid == proc.pid else kind(e["cmd"])
        test = next((n for n, s, f, _ in times if s - 0.1 <= e["start"] - skew <= (f or 1e12)), None)
        bucket = apart[k] if test is None or pid == proc.pid or (e["last"] - e["start"] > 600 and k != "Ray worker") else per[test][k]
        bucket[0] += 1
        bucket[1] += e["cpu"]
    own = apart.pop("pytest", [1, 0.0])[1]
    for test, _, _, cpu in times:  # the pytest process's own CPU, test by test (set-up and teardown included)
        per[test]["pytest"] = [1, cpu]
    apart["pytest outside its tests"] = [1, own - sum(cpu for *_, cpu in times)]
    total = sum(c for _, c in apart.values()) + sum(c for kinds in per.values() for _, c in kinds.values())
    print(f"\npytest exit {rc}; {total:.0f} s of CPU in {len(seen)} processes over {len(times)} tests")
    print("long-lived or outside a test: " + ", ".join(f"{k} {c:.1f} s ({n})" for k, (n, c) in sorted(apart.items(), key=lambda x: -x[1][1])))
    rows = sorted(((sum(c for _, c in kinds.values()), test, kinds) for test, kinds in per.items()), reverse=True)
    files = collections.Counter()
    for cpu, test, _ in rows:
        files[test.split("::")[0]] += cpu
    kinds_all: dict = collections.defaultdict(lambda: [0, 0.0])
    for kinds in [apart, *per.values()]:
        for k, (n, c) in kinds.items():
            kinds_all[k][0] += n
            kinds_all[k][1] += c
    print("every process by kind: " + ", ".join(f"{k} {c:.1f} s ({n})" for k, (n, c) in sorted(kinds_all.items(), key=lambda x: -x[1][1])))
    print("heaviest files: " + ", ".join(f"{f} {c:.0f} s" for f, c in files.most_common(15)))
    if args.csv:
        with open(args.csv, "w") as f:
            f.write("test,cpu_s,ray_workers,ray_worker_cpu_s,pytest_cpu_s\n")
            for cpu, test, kinds in rows:
                f.write(f'"{test}",{cpu:.2f},{kinds.get("Ray worker", [0, 0.0])[0]},{kinds.get("Ray worker", [0, 0.0])[1]:.2f},'
                        f'{kinds.get("pytest", [0, 0.0])[1]:.2f}\n')
    for cpu, test, kinds in rows[:args.top]:
        workers = kinds.get("Ray worker", [0, 0.0])
        other = ", ".join(f"{k} {c:.1f} s ({n})" for k, (n, c) in kinds.items() if k != "Ray worker" and c >= 0.5)
        print(f"{cpu:7.1f} s  {workers[0]:3d} workers {workers[1]:6.1f} s  {test}  {other}")
    sys.exit(rc)


if __name__ == "__main__":
    main()
