"""Benchmark 5 - vectorized training of packed clients (``resources.vectorize_clients``), in one process.

Workload: the pFedMe Synthetic protocol of ``sweeps/pfedme_table1_synthetic.yaml`` (100 users, MLR,
R = 20, K = 5, |D| = 20; pFedMe trains every user every round) and Per-FedAvg FO on the same data (10 users
a round), each for ``--rounds`` rounds with ``fedsweep.engine.run_local`` on core 0, one torch thread.
Variants: clients one by one, and stacked in groups of 25 and of 100 (the groups ``clients_per_actor``
would form). Printed: median seconds per round, the speed-up over one by one, and the largest difference of
the final global parameters and of the final weighted personalized accuracy against one by one.

    python benchmarks/vectorized.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._harness import median, repeat

ALGORITHMS = {
    "pfedme": {"name": "pfedme", "coupling": 20, "local_lr": 0.01, "personalization_lr": 0.01, "server_mixing": 2,
               "inner_steps": 5, "aggregation": "uniform", "clients_per_round": 10, "local_steps": 20, "batch_size": 20},
    "perfedavg": {"name": "perfedavg", "variant": "fo", "personalization_lr": 0.02, "local_lr": 0.002,
                  "clients_per_round": 10, "local_steps": 20, "batch_size": 20},
}


def worker(args) -> dict:
    import torch

    from fedsweep.config import ExperimentConfig
    from fedsweep.engine import run_local

    torch.set_num_threads(1)
    cfg = ExperimentConfig.model_validate({
        "data": {"dataset": "synthetic", "num_clients": 100, "alpha": 0.5, "beta": 0.5},
        "model": {"name": "mlr"}, "algorithm": ALGORITHMS[args.algorithm], "rounds": args.rounds,
        "eval_every": args.rounds,
        "resources": {"clients_per_actor": args.group, "vectorize_clients": args.vectorize},
    })
    t0 = time.perf_counter()
    history, server = run_local(cfg)
    return {"s_per_round": (time.perf_counter() - t0) / args.rounds,
            "accuracy": history[-1]["personalized_accuracy_weighted"], "params": server.params.tolist()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--algorithm", choices=list(ALGORITHMS), default="pfedme")
    ap.add_argument("--group", type=int, default=100)
    ap.add_argument("--vectorize", action="store_true")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return 0
    for algorithm in ALGORITHMS:
        common = ["--algorithm", algorithm, "--rounds", str(args.rounds)]
        variants = {"one by one": ("0", [*common, "--group", "25"])}
        for group in (25, 100):
            variants[f"vectorized, groups of {group}"] = ("0", [*common, "--group", str(group), "--vectorize"])
        print(f"\n{algorithm}, Synthetic(0.5,0.5), 100 users, MLR, {args.rounds} rounds; {args.repeats} repetitions", flush=True)
        res = repeat(__file__, variants, args.repeats)
        base = median(res["one by one"], "s_per_round")
        ref = res["one by one"][0]
        for name, rs in res.items():
            s = median(rs, "s_per_round")
            dp = max(max(abs(a - b) for a, b in zip(r["params"], ref["params"])) for r in rs)
            da = max(abs(r["accuracy"] - ref["accuracy"]) for r in rs)
            print(f"  {name:26s} {s:7.3f} s/round  speed-up {base / s:5.2f}  max |Δparams| {dp:.1e}  max |Δaccuracy| {da:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
