"""Benchmark 4 - memory: peak resident memory of a 100-client experiment, per client.

FedAvg on Synthetic(0.5, 0.5) with 100 clients and an MLP 60-1000-40-10 (101,450 parameters),
r = 0.1, τ = 10, 20 rounds, evaluation every 10. A sampler thread in the driver reads, every
0.5 s, the memory of the driver and of every process it started (Ray's GCS, raylet and workers:
the whole process tree). Reported: peak Σ RSS (counts shared library pages once per process, an
upper bound) and peak Σ PSS (shared pages split between the processes that map them: what the
node really holds), in total and per client, for several ``clients_per_actor`` packings.
One actor per client (k = 1) is not run: validation refuses it on this machine's memory, and the
message is printed.

    python benchmarks/memory.py --pack 10 25 100
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._harness import measure


def config(clients: int, k: int):
    from fedsweep.loading import validate

    actors = -(-clients // k)
    return validate(
        {
            "name": "memory",
            "seed": 0,
            "data": {"dataset": "synthetic", "num_clients": clients, "alpha": 0.5, "beta": 0.5,
                     "max_samples_per_client": 500},
            "model": {"name": "mlp", "hidden": [1000, 40]},
            "algorithm": {"name": "fedavg", "local_lr": 0.05, "participation_rate": 0.1, "local_steps": 10,
                          "batch_size": 20},
            "rounds": 20,
            "eval_every": 10,
            "resources": {"server_cpus": 0.2, "client_cpus": round(1.8 / actors, 4), "clients_per_actor": k},
        },
        "memory",
    )


class Sampler(threading.Thread):
    def __init__(self, period_s: float = 0.5):
        super().__init__(daemon=True)
        import psutil

        self.me = psutil.Process()
        self.period_s = period_s
        self.peak_rss = self.peak_pss = 0
        self.peak_procs = 0
        self.stop = threading.Event()

    def sample(self) -> None:
        import psutil

        rss = pss = 0
        procs = [self.me, *self.me.children(recursive=True)]
        for p in procs:
            try:
                m = p.memory_full_info()
                rss += m.rss
                pss += m.pss
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        self.peak_rss, self.peak_pss = max(self.peak_rss, rss), max(self.peak_pss, pss)
        self.peak_procs = max(self.peak_procs, len(procs))

    def run(self) -> None:
        while not self.stop.is_set():
            self.sample()
            time.sleep(self.period_s)


def worker(args) -> dict:
    import ray

    from fedsweep.experiment import ExperimentRunner
    from fedsweep.models import build_model

    cfg = config(args.clients, args.clients_per_actor)
    num_params = sum(p.numel() for p in build_model(cfg.model, 60, 10).parameters())
    sampler = Sampler()
    sampler.start()
    from fedsweep.experiment import start_local_ray  # the dashboard agent on a free port, as fedsweep starts Ray

    start_local_ray(num_cpus=2, log_to_driver=False)
    runner = ExperimentRunner(cfg)
    try:
        runner.start()
        for last in runner.rounds():
            pass
        sampler.sample()
    finally:
        sampler.stop.set()
        runner.stop()
        ray.shutdown()
    gib = 2**30
    return {
        "clients": args.clients, "clients_per_actor": args.clients_per_actor, "params": num_params,
        "processes": sampler.peak_procs,
        "peak_rss_gib": sampler.peak_rss / gib, "peak_pss_gib": sampler.peak_pss / gib,
        "rss_per_client_mib": sampler.peak_rss / args.clients / 2**20,
        "pss_per_client_mib": sampler.peak_pss / args.clients / 2**20,
        "final_accuracy": last["personalized_accuracy_mean"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--clients", type=int, default=100)
    ap.add_argument("--clients-per-actor", type=int, default=10)
    ap.add_argument("--pack", type=int, nargs="+", default=[10, 25, 100])
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return 0

    from fedsweep.checks import check_resources
    from fedsweep.config import ConfigError

    try:
        check_resources([config(args.clients, 1)], "memory")
        print(f"k=1: {args.clients} actors fit this machine by validation")
    except ConfigError as e:
        print(f"k=1 refused by validation, before Ray starts: {e}")
    print(f"\n{args.clients} clients, MLP 60-1000-40-10; peak memory of the whole process tree (driver, Ray, actors)")
    for k in args.pack:
        r = measure(__file__, "0,1", ["--clients", str(args.clients), "--clients-per-actor", str(k)])
        print(f"  k={k:<4d} processes {r['processes']:4d}  peak Σ RSS {r['peak_rss_gib']:6.2f} GiB "
              f"({r['rss_per_client_mib']:6.1f} MiB/client)  peak Σ PSS {r['peak_pss_gib']:6.2f} GiB "
              f"({r['pss_per_client_mib']:6.1f} MiB/client)  params {r['params']}  final acc {r['final_accuracy']:.4f}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
