"""CPU of Ray's log monitor on an idle local instance holding a suite's worth of worker logs, with Ray's default
and with ``RAY_LOG_MONITOR_MANY_FILES_THRESHOLD=0`` (what ``tests/conftest.py`` sets), side by side in one run.

    python benchmarks/ray_log_monitor.py [--seconds 60] [--actors 120]

Each variant is a fresh process: ``ray.init(num_cpus=2, log_to_driver=False)`` as the tests' session does, ``--actors``
actors started and killed (each leaves its worker's log files), then the log monitor's CPU over ``--seconds`` idle.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

VARIANTS = {"ray default": {}, "threshold 0": {"RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0"}}


def measure(seconds: float, actors: int) -> dict:
    import glob

    import psutil
    import ray

    from fedsweep.experiment import start_local_ray  # the dashboard agent on a free port, as fedsweep starts Ray

    start_local_ray(num_cpus=2, log_to_driver=False)

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
    [monitor] = [p for p in psutil.Process().children(recursive=True) if "log_monitor" in " ".join(p.cmdline())]
    before = monitor.cpu_times()
    time.sleep(seconds)
    after = monitor.cpu_times()
    ray.shutdown()
    return {"log_files": files, "cpu_s": after.user + after.system - before.user - before.system}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--actors", type=int, default=120)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(measure(args.seconds, args.actors)))
        return
    got = {}
    for name, extra in VARIANTS.items():
        env = {k: v for k, v in os.environ.items() if k != "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD"} | extra
        out = subprocess.run([sys.executable, __file__, "--worker", "--seconds", str(args.seconds), "--actors", str(args.actors)],
                             env=env, capture_output=True, text=True, check=True).stdout
        got[name] = json.loads(out.strip().splitlines()[-1])
        print(f"{name}: {got[name]['log_files']} log files, log monitor {got[name]['cpu_s']:.2f} s of CPU in {args.seconds:g} s idle")
    a, b = (got[n]["cpu_s"] for n in VARIANTS)
    print(f"ratio default / threshold 0: {a / b:.2f}")


if __name__ == "__main__":
    main()
