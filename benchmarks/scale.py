"""Benchmark - cross-device scale: how memory, start-up and rounds grow with the number of clients.

Ditto (a personal model per client: state that lives between rounds) on Synthetic(0.5, 0.5), 10 clients sampled
a round (``clients_per_round``, fixed, so that a round's work is the same at every size and what grows is what the
platform holds and moves), τ = 10, batch 20, 20 rounds, evaluation of every client at round 0, 10 and 20. Two
layouts: a worker pool of two (the ServerActor keeps every client's state and sends the sampled ones' with the
round's call to one ClientActor) and 10 packed ClientActors (each keeps its clients' states). Each size runs in a
fresh process pinned to the 2 cores; a sampler thread reads the whole process tree's memory every 0.5 s
(benchmarks/memory.py).

    python benchmarks/scale.py --clients 100 300 1000                       # MLP 60-20-10
    python benchmarks/scale.py --clients 100 --hidden 1000 1000             # 1.07M parameters

Reported per size: peak Σ RSS and Σ PSS; start-up (``ray.init`` to every actor holding its shards), the initial
evaluation (round 0, every client), the median training round without evaluation and the median evaluation
round; and the bytes of client state the ServerActor holds at the end.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._harness import measure
from benchmarks.memory import Sampler

LAYOUTS = {
    "pool2": lambda n: {"server_cpus": 0.5, "client_cpus": 0.7, "client_workers": 2},
    "packed10": lambda n: {"server_cpus": 0.2, "client_cpus": 0.18, "clients_per_actor": -(-n // 10)},
}


def config(clients: int, hidden: list[int], layout: str):
    from fedsweep.loading import validate

    return validate(
        {
            "name": "scale",
            "seed": 0,
            "data": {"dataset": "synthetic", "num_clients": clients, "alpha": 0.5, "beta": 0.5},
            "model": {"name": "mlp", "hidden": hidden},
            "algorithm": {"name": "ditto", "local_lr": 0.05, "personalization_lr": 0.05, "coupling": 0.1,
                          "clients_per_round": 10, "local_steps": 10, "batch_size": 20},
            "rounds": 20,
            "eval_every": 10,
            "resources": {**LAYOUTS[layout](clients), "cluster_cpus": 2},
        },
        "scale",
    )


def worker(args) -> dict:
    import numpy as np
    import ray

    from fedsweep.experiment import ExperimentRunner
    from fedsweep.models import build_model

    cfg = config(args.clients, args.hidden, args.layout)
    num_params = sum(p.numel() for p in build_model(cfg.model, 60, 10).parameters())
    sampler = Sampler()
    sampler.start()
    t0 = time.perf_counter()
    from fedsweep.experiment import start_local_ray  # the dashboard agent on a free port, as fedsweep starts Ray

    start_local_ray(num_cpus=2, log_to_driver=False)
    runner = ExperimentRunner(cfg)
    times: dict[int, float] = {}
    try:
        runner.start()
        t_started = time.perf_counter()
        mark = t_started
        for metrics in runner.rounds():
            now = time.perf_counter()
            times[int(metrics["round"])] = now - mark
            mark = now
        sampler.sample()
        held = ray.get(runner.server.client_states.remote(list(range(args.clients))))
        state_bytes = sum(sum(np.asarray(v).nbytes for v in s.values()) for s in held if s)
    finally:
        sampler.stop.set()
        runner.stop()
        ray.shutdown()
    evals = set(cfg.eval_rounds())
    return {
        "clients": args.clients, "layout": args.layout, "params": num_params,
        "peak_rss_gib": sampler.peak_rss / 2**30, "peak_pss_gib": sampler.peak_pss / 2**30,
        "processes": sampler.peak_procs,
        "startup_s": t_started - t0, "round0_s": times[0],
        "train_round_s": statistics.median(t for r, t in times.items() if r and r not in evals),
        "eval_round_s": statistics.median(t for r, t in times.items() if r and r in evals),
        "client_state_mib": state_bytes / 2**20,
        "final_accuracy": metrics["personalized_accuracy_mean"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--clients", type=int, nargs="+", default=[100, 300, 1000])
    ap.add_argument("--hidden", type=int, nargs="+", default=[20])
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--layout", default="pool2", choices=list(LAYOUTS))
    args = ap.parse_args()
    if args.worker:
        args.clients = args.clients[0]
        print(json.dumps(worker(args)))
        return 0
    hidden = [str(h) for h in args.hidden]
    print(f"Ditto, Synthetic, MLP 60-{'-'.join(hidden)}-10, 10 clients a round, 20 rounds; whole process tree")
    for n in args.clients:
        for layout in args.layouts:
            r = measure(__file__, "0,1", ["--clients", str(n), "--hidden", *hidden, "--layout", layout], timeout_s=3600)
            print(f"  n={n:<5d} {layout:9s} params {r['params']:>8d}  processes {r['processes']:3d}  "
                  f"peak RSS {r['peak_rss_gib']:5.2f} GiB  PSS {r['peak_pss_gib']:5.2f} GiB  start-up {r['startup_s']:6.2f} s  "
                  f"round 0 {r['round0_s']:6.2f} s  train round {1000 * r['train_round_s']:7.1f} ms  "
                  f"eval round {r['eval_round_s']:6.2f} s  client state {r['client_state_mib']:7.1f} MiB  "
                  f"acc {r['final_accuracy']:.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
