"""Benchmark 1c - where an actor round's time goes on one core: CPU per round of every process.

Benchmark 1's packed variant on one core (FedAvg, Synthetic(0.5, 0.5), 20 clients in one ClientActor,
MLP 60-20-10, τ = 10, r = 0.5, evaluation every 10 rounds), run for ``--rounds`` rounds. With one core
every process's CPU time is wall time the round waits for, so the CPU seconds each process spends during
rounds 1..R (psutil, per process), divided by R, add up to the wall time of a round (less the time the
virtual machine's core was taken away, which counts as no process's CPU time: the CPU ratio below is
the one that noise on the host does not move):

  ClientActor   the clients' arithmetic, plus receiving the call and sending the replies
  ServerActor   sampling, aggregation, the call to the ClientActor, the reply to the driver
  driver        ExperimentRunner sending the next round and reading the metrics
  Ray daemons   raylet, GCS, log monitor, dashboard and agents: what a running Ray node costs anyway

``local`` is the same rounds in one process without Ray (the denominator of benchmark 1's overhead),
``call`` one bare actor-to-actor call on one core (a 6 KB argument, ten 6 KB arrays back), the unit a
round pays twice (driver → ServerActor → ClientActor). ``pool`` is benchmark 1's ``pool-1``
(``resources.client_workers: 1``): the ServerActor trains the clients itself, one call a round.

    python benchmarks/round_cost.py --rounds 300 --repeats 3
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._harness import median, ratios, repeat, timed_actor_run

ROLES = ("ClientActor", "ServerActor", "driver", "Ray daemons")


def _role(proc) -> str:
    title = " ".join(proc.cmdline())
    for actor in ("ClientActor", "ServerActor"):
        if f"ray::{actor}" in title:
            return actor
    return "Ray daemons"


@contextlib.contextmanager
def cpu_by_role(cpu: dict[str, float]):
    """Add to ``cpu[role]`` the CPU seconds this process and every process it started spend inside the block."""
    import psutil

    me = psutil.Process()
    procs = {p: _role(p) for p in me.children(recursive=True)} | {me: "driver"}
    before = {p: sum(p.cpu_times()[:2]) for p in procs}
    yield
    for p, role in procs.items():
        try:
            cpu[role] += sum(p.cpu_times()[:2]) - before[p]
        except psutil.NoSuchProcess:  # a short-lived helper that has exited
            pass


def worker_actors(args, client_workers: int = 0) -> dict:
    from benchmarks.overhead import config

    cfg = config(argparse.Namespace(clients=20, rounds=args.rounds, hidden=[20]), 1, 1 if client_workers else 20,
                 client_workers=client_workers)
    cpu = dict.fromkeys(ROLES, 0.0)
    rounds_s, *_ = timed_actor_run(cfg, 1, around_rounds=lambda: cpu_by_role(cpu))
    return {"round_ms": rounds_s / args.rounds * 1000, **{f"{r} ms": c / args.rounds * 1000 for r, c in cpu.items()}}


def worker_local(args) -> dict:
    from benchmarks.overhead import worker_local as run

    r = run(argparse.Namespace(clients=20, rounds=args.rounds, hidden=[20], clients_per_actor=20, vectorize=False))
    return {"round_ms": r["rounds_s"] / args.rounds * 1000, "cpu ms": r["rounds_cpu_s"] / args.rounds * 1000}


def worker_call(args) -> dict:
    import numpy as np
    import psutil
    import ray

    from fedsweep.experiment import start_local_ray  # the dashboard agent on a free port, as fedsweep starts Ray

    start_local_ray(num_cpus=1, log_to_driver=False)

    @ray.remote(num_cpus=0)
    class Callee:
        def f(self, payload, ids):
            return [np.zeros(1450, np.float32) for _ in ids]

        def pid(self):
            return os.getpid()

    @ray.remote(num_cpus=0)
    class Caller:
        def __init__(self, callee):
            self.callee = callee

        def calls(self, n, payload):
            for _ in range(n):
                ray.get(self.callee.f.remote(payload, list(range(10))))

        def pid(self):
            return os.getpid()

    callee = Callee.remote()
    caller = Caller.remote(callee)
    procs = [psutil.Process(ray.get(a.pid.remote())) for a in (caller, callee)]
    payload = {"params": np.zeros(1450, np.float32)}
    ray.get(caller.calls.remote(20, payload))
    n = args.rounds * 5
    cpu0 = [sum(p.cpu_times()[:2]) for p in procs]
    t0 = time.perf_counter()
    ray.get(caller.calls.remote(n, payload))
    wall = time.perf_counter() - t0
    cpu = [(sum(p.cpu_times()[:2]) - c) / n * 1000 for p, c in zip(procs, cpu0)]
    ray.shutdown()
    return {"round_ms": wall / n * 1000, "caller ms": cpu[0], "callee ms": cpu[1]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", choices=["local", "actors", "pool", "call"])
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if args.worker:
        workers = {"local": worker_local, "actors": worker_actors, "pool": lambda a: worker_actors(a, 1), "call": worker_call}
        print(json.dumps(workers[args.worker](args)))
        return 0

    common = ["--rounds", str(args.rounds)]
    variants = {name: ("0", [name, *common]) for name in ("local", "actors", "pool", "call")}
    print(f"packed FedAvg round on one core, {args.rounds} rounds; {args.repeats} repetitions, interleaved", flush=True)
    res = repeat(__file__, variants, args.repeats)
    print("\nper round, ms (median over repetitions):")
    print(f"  in-process loop, no Ray          {median(res['local'], 'round_ms'):7.2f}  (CPU {median(res['local'], 'cpu ms'):.2f})")
    for variant in ("actors", "pool"):
        print(f"  {variant}, wall{' ' * (27 - len(variant))}{median(res[variant], 'round_ms'):7.2f}")
        for role in ROLES:
            print(f"    CPU of {role:25s} {median(res[variant], f'{role} ms'):7.2f}")
    print(f"  one bare actor call, wall        {median(res['call'], 'round_ms'):7.2f}  "
          f"(CPU: caller {median(res['call'], 'caller ms'):.2f}, callee {median(res['call'], 'callee ms'):.2f})")
    print()
    for variant, trainer in (("actors", "ClientActor"), ("pool", "ServerActor")):
        r, rs = ratios(res, variant, "local", "round_ms")
        cpu = [sum(a[f"{role} ms"] for role in ROLES) / b["cpu ms"] for a, b in zip(res[variant], res["local"])]
        extra = statistics.median(a[f"{trainer} ms"] - b["cpu ms"] for a, b in zip(res[variant], res["local"]))
        print(f"overhead on 1 CPU, {variant} / local: wall {r:.3f} {[round(x, 3) for x in rs]}, "
              f"CPU of all processes {statistics.median(cpu):.3f} {[round(x, 3) for x in cpu]}; "
              f"{trainer} CPU minus the in-process round's (paired, median): {extra:+.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
