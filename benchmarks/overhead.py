"""Benchmark 1 - orchestration overhead: fedsweep's actors against a single-process loop doing the same client steps.

Workload (issue 6): FedAvg on Synthetic(0.5, 0.5), 20 clients, MLP, τ = 10, r = 0.5, 50 rounds,
evaluation every 10 rounds. Variants, each in a fresh process pinned with taskset:

  local     one process, no Ray: ``fedsweep.federation`` Server + LocalPool (the same code the actors run)
  actors-1  fedsweep's ServerActor + ClientActors, everything on core 0
  actors-2  the same on cores 0-1

each with one client per actor (k=1, the default) and with clients packed k per actor.
Printed: medians over the repetitions of the rounds' wall time (rounds 1..R, start-up excluded)
and of the whole run (Ray start, actor start, rounds), and the paired ratios

  overhead on 1 CPU   = wall(actors-1) / wall(local)
  parallel speedup    = wall(actors-1) / wall(actors-2)   and   wall(local) / wall(actors-2)

The final metrics of every variant must be identical (same seed, same arithmetic): checked and printed.

    python benchmarks/overhead.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._harness import median, ratios, repeat  # noqa: E402


def config(args, cpus: float = 1.0, clients_per_actor: int = 1):
    from fedsweep.config import validate

    actors = -(-args.clients // clients_per_actor)
    server_cpus = 0.2
    return validate(
        {
            "name": "overhead",
            "seed": 0,
            "data": {"dataset": "synthetic", "num_clients": args.clients, "alpha": 0.5, "beta": 0.5,
                     "max_samples_per_client": 500},
            "model": {"name": "mlp", "hidden": args.hidden},
            "algorithm": {"name": "fedavg", "local_lr": 0.05, "participation_rate": 0.5, "local_steps": 10,
                          "batch_size": 20},
            "rounds": args.rounds,
            "eval_every": 10,
            "resources": {"server_cpus": server_cpus, "client_cpus": round((cpus - server_cpus) / actors, 4),
                          "clients_per_actor": clients_per_actor},
        },
        "overhead",
    )


def worker_local(args) -> dict:
    import torch

    from fedsweep.data import build_federated_dataset
    from fedsweep.federation import Client, LocalPool, Server

    torch.set_num_threads(1)  # as in every actor
    t0 = time.perf_counter()
    cfg = config(args)
    ds = build_federated_dataset(cfg.data)
    server = Server(cfg, ds.num_features, ds.num_classes)
    pool = LocalPool([Client(i, d, cfg, ds.num_features, ds.num_classes) for i, d in enumerate(ds.clients)])
    server.step(pool, 0)
    t1 = time.perf_counter()
    for rnd in range(1, cfg.rounds + 1):
        last = server.step(pool, rnd)
    t2 = time.perf_counter()
    return {"rounds_s": t2 - t1, "total_s": t2 - t0, "final": last["personalized_accuracy_mean"],
            "params_sum": float(server.params.double().sum())}


def worker_actors(args) -> dict:
    import ray

    from fedsweep.experiment import ExperimentRunner

    t0 = time.perf_counter()
    ray.init(num_cpus=args.cpus, include_dashboard=False, log_to_driver=False)
    cfg = config(args, args.cpus, args.clients_per_actor)
    runner = ExperimentRunner(cfg)
    try:
        runner.start()
        rounds = runner.rounds()
        next(rounds)  # round 0: evaluation of the initial model, outside the timed rounds as in `local`
        t1 = time.perf_counter()
        for last in rounds:
            pass
        t2 = time.perf_counter()
        params = ray.get(runner.server.global_params.remote())
    finally:
        runner.stop()
        ray.shutdown()
    return {"rounds_s": t2 - t1, "total_s": t2 - t0, "final": last["personalized_accuracy_mean"],
            "params_sum": float(params.astype("float64").sum())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", choices=["local", "actors"])
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--hidden", type=int, nargs="+", default=[20])
    ap.add_argument("--cpus", type=int, default=1)
    ap.add_argument("--clients-per-actor", type=int, default=1)
    ap.add_argument("--pack", type=int, default=10, help="clients per actor of the packed variants")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps((worker_local if args.worker == "local" else worker_actors)(args)))
        return 0

    common = ["--clients", str(args.clients), "--rounds", str(args.rounds), "--hidden", *map(str, args.hidden)]
    variants = {"local": ("0", ["local", *common])}
    for k in (1, args.pack):
        for cpus, cores in ((1, "0"), (2, "0,1")):
            variants[f"actors-{cpus}/k={k}"] = (cores, ["actors", *common, "--cpus", str(cpus), "--clients-per-actor", str(k)])
    print(f"FedAvg, Synthetic(0.5,0.5), {args.clients} clients, MLP{args.hidden}, τ=10, r=0.5, {args.rounds} rounds; "
          f"{args.repeats} repetitions, interleaved", flush=True)
    res = repeat(__file__, variants, args.repeats)

    finals = {(r["final"], r["params_sum"]) for rs in res.values() for r in rs}
    print(f"\nidentical final metrics and parameters across all variants: {len(finals) == 1} {sorted(finals)[:3]}")
    print("\nmedian wall time (s):        rounds only   whole run")
    for name, rs in res.items():
        print(f"  {name:18s} {median(rs, 'rounds_s'):12.2f} {median(rs, 'total_s'):11.2f}")
    print("\nratios (median of paired ratios; rounds only | whole run):")
    for k in (1, args.pack):
        a1, a2 = f"actors-1/k={k}", f"actors-2/k={k}"
        for label, num, den in (
            ("overhead on 1 CPU, actors-1 / local", a1, "local"),
            ("parallel speedup, actors-1 / actors-2", a1, a2),
            ("speedup over local, local / actors-2", "local", a2),
        ):
            r, rs = ratios(res, num, den, "rounds_s")
            t, ts = ratios(res, num, den, "total_s")
            print(f"  k={k:<3d} {label:40s} {r:6.3f} {[round(x, 3) for x in rs]} | {t:6.3f} {[round(x, 3) for x in ts]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
