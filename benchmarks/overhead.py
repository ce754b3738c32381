"""Benchmark 1 - orchestration overhead: fedsweep's actors against a single-process loop doing the same client steps.

Workload (issue 6): FedAvg on Synthetic(0.5, 0.5), 20 clients, MLP, τ = 10, r = 0.5, 50 rounds,
evaluation every 10 rounds. Variants, each in a fresh process pinned with taskset:

  local     one process, no Ray: ``fedsweep.engine.local_federation`` (the engine the actors run, every host local)
  actors-1  fedsweep's ServerActor + ClientActors, everything on core 0
  actors-2  the same on cores 0-1

each with one client per actor (k=1, the default: 20 ClientActors) and packed, one ClientActor per CPU
(k=20 on 1 CPU, k=10 on 2), and packed with ``resources.vectorize_clients`` (``/vec``: the clients an
actor trains in a round form one stacked computation); ``local/vec/k=K`` is the in-process loop stacking
the same groups of K clients. ``pool-1`` and ``pool-2`` are worker pools (``resources.client_workers`` = CPUs):
on 1 CPU the ServerActor trains every client itself, on 2 it and one ClientActor split each round's clients
evenly (Ray calls; the socket channel of earlier versions is gone, docs/performance.md). ``local×2`` is the machine's own ceiling for any
2-CPU speedup: two copies of ``local`` at the same time, one per core (the time of the slower one).
Printed: medians over the repetitions of the rounds' wall time (rounds 1..R, start-up excluded)
and of the whole run (Ray start, actor start, rounds), and the paired ratios

  overhead on 1 CPU   = wall(actors-1) / wall(local)      (vectorized: actors-1/vec / local/vec, same arithmetic)
  parallel speedup    = wall(actors-1) / wall(actors-2)   and   wall(local) / wall(actors-2)
  ceiling             = 2 × wall(local) / wall(local×2)   (1 CPU's work done twice on 2 CPUs: ideal 2)

The final metrics of the one-by-one variants must be identical (same seed, same arithmetic), and so must
those of the vectorized ones among themselves: checked and printed.

    python benchmarks/overhead.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._harness import median, print_ratios, ratios, repeat, timed_actor_run


def config(args, cpus: float = 1.0, clients_per_actor: int = 1, vectorize: bool = False, client_workers: int = 0):
    from fedsweep.loading import validate

    actors = client_workers or -(-args.clients // clients_per_actor)
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
                          "clients_per_actor": clients_per_actor, "vectorize_clients": vectorize,
                          "client_workers": client_workers},
        },
        "overhead",
    )


def worker_local(args) -> dict:
    from fedsweep.engine import local_federation
    from fedsweep.federation import compute_threads

    with compute_threads():  # as in every actor
        t0 = time.perf_counter()
        cfg = config(args, clients_per_actor=args.clients_per_actor, vectorize=args.vectorize)
        server, pool = local_federation(cfg)
        server.step(pool, 0)
        t1, c1 = time.perf_counter(), time.process_time()
        for rnd in range(1, cfg.rounds + 1):
            last = server.step(pool, rnd)
        t2, c2 = time.perf_counter(), time.process_time()
    return {"rounds_s": t2 - t1, "total_s": t2 - t0, "rounds_cpu_s": c2 - c1, "final": last["personalized_accuracy_mean"],
            "params_sum": float(server.params.double().sum())}


def worker_local_pair(args) -> dict:
    """Two ``local`` workers at once, pinned to cores 0 and 1: what two independent processes get of the machine."""
    import subprocess

    argv = [a for a in sys.argv[1:] if a not in ("--worker", "local×2")]
    procs = [subprocess.Popen(["taskset", "-c", core, sys.executable, __file__, "--worker", "local", *argv],
                              stdout=subprocess.PIPE, text=True) for core in ("0", "1")]
    runs = [json.loads(p.communicate()[0].splitlines()[-1]) for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError("a local worker failed")
    slower = max(runs, key=lambda r: r["rounds_s"])
    return {**slower, "total_s": max(r["total_s"] for r in runs)}


def worker_actors(args) -> dict:
    cfg = config(args, args.cpus, args.clients_per_actor, args.vectorize, args.client_workers)
    rounds_s, total_s, last, params = timed_actor_run(cfg, args.cpus)
    return {"rounds_s": rounds_s, "total_s": total_s, "final": last["personalized_accuracy_mean"],
            "params_sum": float(params.astype("float64").sum())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", choices=["local", "local×2", "actors"])
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--hidden", type=int, nargs="+", default=[20])
    ap.add_argument("--cpus", type=int, default=1)
    ap.add_argument("--clients-per-actor", type=int, default=1)
    ap.add_argument("--vectorize", action="store_true", help="resources.vectorize_clients")
    ap.add_argument("--client-workers", type=int, default=0, help="resources.client_workers")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--variants", nargs="+", help="run only these variants (names as printed); default: all")
    args = ap.parse_args()
    if args.worker:
        print(json.dumps({"local": worker_local, "local×2": worker_local_pair, "actors": worker_actors}[args.worker](args)))
        return 0

    common = ["--clients", str(args.clients), "--rounds", str(args.rounds), "--hidden", *map(str, args.hidden)]
    per_cpu = {cpus: -(-args.clients // cpus) for cpus in (1, 2)}  # packed: one ClientActor per CPU
    cores = {1: "0", 2: "0,1"}
    variants = {"local": ("0", ["local", *common])}
    for k in sorted(set(per_cpu.values()), reverse=True):  # the in-process loop stacking the same groups
        variants[f"local/vec/k={k}"] = ("0", ["local", *common, "--clients-per-actor", str(k), "--vectorize"])
    variants["local×2"] = ("0,1", ["local×2", *common])
    for cpus in (1, 2):
        actors = ["actors", *common, "--cpus", str(cpus)]
        variants[f"actors-{cpus}/k=1"] = (cores[cpus], [*actors, "--clients-per-actor", "1"])
        variants[f"actors-{cpus}/k={per_cpu[cpus]}"] = (cores[cpus], [*actors, "--clients-per-actor", str(per_cpu[cpus])])
        variants[f"actors-{cpus}/k={per_cpu[cpus]}/vec"] = (
            cores[cpus], [*actors, "--clients-per-actor", str(per_cpu[cpus]), "--vectorize"])
        variants[f"pool-{cpus}"] = (cores[cpus], [*actors, "--client-workers", str(cpus)])
    if args.variants:
        unknown = set(args.variants) - set(variants)
        if unknown:
            ap.error(f"--variants: unknown {sorted(unknown)}; allowed: {list(variants)}")
        variants = {n: v for n, v in variants.items() if n in args.variants}
    print(f"FedAvg, Synthetic(0.5,0.5), {args.clients} clients, MLP{args.hidden}, τ=10, r=0.5, {args.rounds} rounds; "
          f"{args.repeats} repetitions, interleaved", flush=True)
    res = repeat(__file__, variants, args.repeats)

    # Stacking changes the order of float sums, so vectorized runs agree only with those stacking the same groups.
    groups = {"one by one": [n for n in res if "vec" not in n]}
    for k in sorted(set(per_cpu.values()), reverse=True):
        groups[f"vectorized, groups of {k}"] = [n for n in res if "vec" in n and f"k={k}" in n.split("/")]
    for label, names in groups.items():
        if not names:
            continue
        finals = {(r["final"], r["params_sum"]) for n in names for r in res[n]}
        print(f"\nidentical final metrics and parameters, {label} ({', '.join(names)}): {len(finals) == 1} {sorted(finals)[:3]}")
    print("\nmedian wall time (s):        rounds only   whole run")
    for name, rs in res.items():
        print(f"  {name:18s} {median(rs, 'rounds_s'):12.2f} {median(rs, 'total_s'):11.2f}")
    print("\nratios (median of paired ratios; rounds only | whole run):")
    k1, k2 = per_cpu[1], per_cpu[2]
    rows = [
        ("k=1: overhead on 1 CPU, actors-1 / local", "actors-1/k=1", "local"),
        ("k=1: parallel speedup, actors-1 / actors-2", "actors-1/k=1", "actors-2/k=1"),
        ("packed: overhead on 1 CPU, actors-1 / local", f"actors-1/k={k1}", "local"),
        ("packed: parallel speedup, actors-1 / actors-2", f"actors-1/k={k1}", f"actors-2/k={k2}"),
        ("packed: speedup over local, local / actors-2", "local", f"actors-2/k={k2}"),
        ("vec: overhead on 1 CPU, actors-1/vec / local/vec", f"actors-1/k={k1}/vec", f"local/vec/k={k1}"),
        ("vec: parallel speedup, actors-1/vec / actors-2/vec", f"actors-1/k={k1}/vec", f"actors-2/k={k2}/vec"),
        ("vec: speedup over local, local / actors-2/vec", "local", f"actors-2/k={k2}/vec"),
        ("pool: overhead on 1 CPU, pool-1 / local", "pool-1", "local"),
        ("pool: parallel speedup, pool-1 / pool-2", "pool-1", "pool-2"),
        ("pool: speedup over local, local / pool-2", "local", "pool-2"),
    ]
    print_ratios(res, [row for row in rows if row[1] in res and row[2] in res], width=52)
    if "local" in res and "local×2" in res:
        c, cs = ratios(res, "local", "local×2", "rounds_s")
        print(f"  {'ceiling: 2 × local / local×2 (two loops at once)':52s} {2 * c:6.3f} {[round(2 * x, 3) for x in cs]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
