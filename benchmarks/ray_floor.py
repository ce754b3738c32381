"""Benchmark 1b - the floor under the orchestration overhead: what a running Ray instance costs work that never calls it.

The in-process loop of benchmark 1 (``local``: fedsweep's in-process engine, no Ray) timed on one
core twice in the same process: alone, then with a local Ray instance of 1 CPU started on that core
and left idle (its raylet, GCS, agents and log monitor keep running). The ratio is the part of the
actor path's overhead that no change to fedsweep's calls can remove on a machine where Ray shares the
core with the work. Variants alternate: ``ray`` starts Ray after timing alone, ``none`` times twice
without it (the same-process drift between the two timings).

    python benchmarks/ray_floor.py --repeats 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._harness import repeat


def worker(args) -> dict:
    from benchmarks.overhead import config
    from fedsweep.engine import local_federation
    from fedsweep.federation import compute_threads

    server, pool = local_federation(config(argparse.Namespace(clients=20, rounds=args.rounds, hidden=[20]), clients_per_actor=20))

    def rounds_ms(first: int) -> float:  # median training round, evaluation excluded
        times = []
        for rnd in range(first, first + args.rounds):
            t = time.perf_counter()
            server.train_round(pool, rnd)
            times.append(time.perf_counter() - t)
        return statistics.median(times) * 1000

    with compute_threads():
        alone = rounds_ms(1)
        if args.ray:
            from fedsweep.experiment import start_local_ray  # the dashboard agent on a free port, as fedsweep starts it

            start_local_ray(num_cpus=1, log_to_driver=False)
            time.sleep(5)  # past its start-up
        second = rounds_ms(1 + args.rounds)
    return {"alone_ms": alone, "second_ms": second, "ratio": second / alone}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", choices=["run"])
    ap.add_argument("--ray", action="store_true")
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return 0
    common = ["run", "--rounds", str(args.rounds)]
    res = repeat(__file__, {"none": ("0", common), "ray": ("0", [*common, "--ray"])}, args.repeats)
    for name, rs in res.items():
        ratios = [r["ratio"] for r in rs]
        print(f"{name:5s} second/first timing: median {statistics.median(ratios):.3f} {[round(x, 3) for x in ratios]}"
              f"  (round alone {statistics.median(r['alone_ms'] for r in rs):.1f} ms)")
    floor = statistics.median(r["ratio"] / n["ratio"] for r, n in zip(res["ray"], res["none"]))
    print(f"floor: an idle Ray instance on the core makes the same rounds {floor:.3f}x as long (paired with 'none')")
    return 0


if __name__ == "__main__":
    sys.exit(main())
