"""CPU of an idle local Ray instance holding a suite's worth of worker logs: with Ray's log monitor at Ray's default,
with ``RAY_LOG_MONITOR_MANY_FILES_THRESHOLD=0`` (what ``tests/conftest.py`` sets), and without a log monitor (what
``fedsweep.experiment.start_local_ray`` starts when ``log_to_driver=False``, as the tests' session does), side by side
in one run.

    python benchmarks/ray_log_monitor.py [--seconds 60] [--actors 120]

Each variant is a fresh process: ``start_local_ray(num_cpus=2)``, ``--actors`` actors started and killed (each leaves
its worker's log files), then the CPU of the log monitor and of every process of the instance over ``--seconds`` idle.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

#: name: (log_to_driver, environment)
VARIANTS = {"ray default": (True, {}), "threshold 0": (True, {"RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0"}),
            "no log monitor": (False, {})}


def measure(seconds: float, actors: int, log_to_driver: bool) -> dict:
    import glob

    import psutil
    import ray

    from fedsweep.experiment import start_local_ray  # the dashboard agent on a free port, as fedsweep starts Ray

    start_local_ray(num_cpus=2, log_to_driver=log_to_driver)

    @ray.remote(num_cpus=0)
    class Idle:
        def ping(self) -> int:
            return 1

    for _ in range(actors // 10):
        batch = [Idle.remote() for _ in range(10)]
        ray.get([a.ping.remote() for a in batch])
        for a in batch:
            ray.kill(a)
    time.sleep(5)
    files = len(glob.glob(os.path.join(ray._private.worker._global_node.get_logs_dir_path(), "*")))
    procs = psutil.Process().children(recursive=True)

    def cpu() -> dict:
        got = {}
        for p in procs:
            try:
                t = p.cpu_times()
                got[p.pid] = ("log_monitor" in " ".join(p.cmdline()), t.user + t.system)
            except psutil.Error:
                continue
        return got

    before = cpu()
    time.sleep(seconds)
    after = cpu()
    ray.shutdown()
    used = {pid: (monitor, value - before[pid][1]) for pid, (monitor, value) in after.items() if pid in before}
    return {"log_files": files, "monitor_cpu_s": sum(v for m, v in used.values() if m),
            "instance_cpu_s": sum(v for _, v in used.values())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--actors", type=int, default=120)
    parser.add_argument("--worker", choices=list(VARIANTS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(measure(args.seconds, args.actors, VARIANTS[args.worker][0])))
        return
    got = {}
    for name, (_, extra) in VARIANTS.items():
        env = {k: v for k, v in os.environ.items() if k != "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD"} | extra
        out = subprocess.run([sys.executable, __file__, "--worker", name, "--seconds", str(args.seconds), "--actors",
                              str(args.actors)], env=env, capture_output=True, text=True, check=True).stdout
        got[name] = json.loads(out.strip().splitlines()[-1])
        print(f"{name}: {got[name]['log_files']} log files; in {args.seconds:g} s idle, log monitor "
              f"{got[name]['monitor_cpu_s']:.2f} s of CPU, the whole instance {got[name]['instance_cpu_s']:.2f} s")
    whole = {n: got[n]["instance_cpu_s"] for n in VARIANTS}
    print(f"the whole instance, ray default / threshold 0: {whole['ray default'] / whole['threshold 0']:.2f}; "
          f"threshold 0 / no log monitor: {whole['threshold 0'] / whole['no log monitor']:.2f}")


if __name__ == "__main__":
    main()
