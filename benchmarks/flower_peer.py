"""Benchmark 2 - peer: the same FedAvg workload under Flower's simulation engine and under fedsweep.

Workload (issue 6, as benchmark 1): FedAvg on Synthetic(0.5, 0.5), 20 clients, MLP 60-20-10, τ = 10 SGD
steps of batch 20 at lr 0.05, r = 0.5 (10 clients a round), 50 rounds, sample-count weighted average;
``--workload`` picks another data section of ``_harness.WORKLOADS`` (uncapped sizes, MNIST Dirichlet(0.1)).
Both sides run on the same 2 cores (taskset), start their own Ray, and train every client with the
same code: Flower's ClientApp (``_flower_app.py``: each of its actors builds the data once) calls fedsweep's
:class:`fedsweep.federation.Client` on the client's shard, so data, model, initial vector and local steps are
identical; what differs is the orchestration (Flower's ServerApp/ClientApp messages and its Ray backend against fedsweep's
actors) and which 10 clients each round samples (each framework's own sampler).

  fedsweep  ExperimentRunner, 2 CPUs, clients packed ``--pack`` per ClientActor (evaluation on the
            clients every 10 rounds: personalized, global and train metrics of all 20 clients)
  flower    flwr.simulation.run_simulation, flwr.serverapp.strategy.FedAvg(fraction_train=0.5),
            Flower's default of 1 CPU per ClientApp (2 at a time); evaluation every 10 rounds on the
            server (the global model on the union of the clients' test sets, no client round trip)

Printed: wall time of the rounds (first round to last, start-up excluded) and of the whole run
(interpreter start excluded, Ray start included), the median of the paired ratios fedsweep/flower,
and both final accuracies of the global model on the union of the clients' test sets.

Flower lives in its own virtual environment: flwr 1.41 pins ray 2.55.1, fedsweep runs on ray 2.60.

    python3.11 -m venv ../venv-flower
    ../venv-flower/bin/pip install "flwr[simulation]==1.41.0" torch==2.13.0 pydantic pyyaml scikit-learn
    python benchmarks/flower_peer.py --flower-python ../venv-flower/bin/python --repeats 3
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._harness import WORKLOADS, median, print_ratios, repeat, timed_actor_run

EVAL_EVERY = 10


def config(args, clients_per_actor: int = 1, vectorize: bool = False):
    from fedsweep.loading import validate

    actors = -(-args.clients // clients_per_actor)
    return validate(
        {
            "name": "peer",
            "seed": args.seed,
            "data": {**WORKLOADS[args.workload], "num_clients": args.clients},
            "model": {"name": "mlp", "hidden": [20]},
            "algorithm": {"name": "fedavg", "local_lr": args.local_lr, "participation_rate": 0.5, "local_steps": 10,
                          "batch_size": 20},
            "rounds": args.rounds,
            "eval_every": EVAL_EVERY,
            "resources": {"server_cpus": 0.2, "client_cpus": round(1.8 / actors, 4),
                          "clients_per_actor": clients_per_actor, "vectorize_clients": vectorize},
        },
        "peer",
    )


def global_accuracy(cfg, ds, params) -> float:
    """The global model's accuracy on the union of the clients' test sets."""
    import torch

    from fedsweep.evaluation import score
    from fedsweep.models import FlatModel, build_model

    model = FlatModel(build_model(cfg.model, ds.num_features, ds.num_classes))
    w = torch.tensor(params, dtype=torch.float32)
    correct = sum(score(lambda x: model(w, x), d.x_test, d.y_test)[0] for d in ds.clients)
    return correct / sum(d.num_test for d in ds.clients)


def worker_fedsweep(args) -> dict:
    from fedsweep.data import build_federated_dataset

    cfg = config(args, args.pack, args.vectorize)
    rounds_s, total_s, _, params = timed_actor_run(cfg, 2)
    return {"rounds_s": rounds_s, "total_s": total_s,
            "final_global_accuracy": global_accuracy(cfg, build_federated_dataset(cfg.data), params)}


def worker_flower(args) -> dict:
    import os

    from flwr.app import ArrayRecord, Context, MetricRecord
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg
    from flwr.simulation import run_simulation

    from benchmarks import _flower_app
    from fedsweep.federation import Server

    t0 = time.perf_counter()
    # the settings every ClientApp actor builds its data from (Ray's workers inherit the driver's environment)
    os.environ[_flower_app.ENV] = json.dumps({k: getattr(args, k) for k in ("clients", "workload", "local_lr", "seed", "rounds")})
    cfg, ds = _flower_app.federation()
    initial = Server.of(cfg, ds.num_features, ds.num_classes).params.numpy()
    out: dict = {}

    server_app = ServerApp()

    def evaluate(rnd: int, arrays: ArrayRecord):
        if rnd % EVAL_EVERY and rnd != cfg.rounds:
            return None
        return MetricRecord({"accuracy": global_accuracy(cfg, ds, arrays.to_numpy_ndarrays()[0])})

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        strategy = FedAvg(fraction_train=0.5, fraction_evaluate=0.0, min_train_nodes=args.clients // 2,
                          min_available_nodes=args.clients)
        out["t1"] = time.perf_counter()
        result = strategy.start(grid=grid, initial_arrays=ArrayRecord([initial]), num_rounds=cfg.rounds,
                                evaluate_fn=evaluate)
        out["t2"] = time.perf_counter()
        out["params"] = result.arrays.to_numpy_ndarrays()[0]

    run_simulation(server_app, _flower_app.app, num_supernodes=args.clients,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                   "init_args": {"num_cpus": 2, "include_dashboard": False}})
    t3 = time.perf_counter()
    return {"rounds_s": out["t2"] - out["t1"], "total_s": t3 - t0,
            "final_global_accuracy": global_accuracy(cfg, ds, out["params"])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", choices=["fedsweep", "flower"])
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--workload", choices=list(WORKLOADS), default="capped", help="the data (_harness.WORKLOADS)")
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--local-lr", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pack", type=int, default=10, help="clients per ClientActor (fedsweep)")
    ap.add_argument("--vectorize", action="store_true", help="fedsweep worker: resources.vectorize_clients")
    ap.add_argument("--flower-python", default=str(Path(__file__).resolve().parents[2] / "venv-flower/bin/python"),
                    help="python of the virtual environment that has flwr[simulation]")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps((worker_fedsweep if args.worker == "fedsweep" else worker_flower)(args)))
        return 0

    common = ["--clients", str(args.clients), "--rounds", str(args.rounds), "--pack", str(args.pack), "--workload", args.workload]
    variants = {
        "flower": ("0,1", ["flower", *common], args.flower_python),
        "fedsweep": ("0,1", ["fedsweep", *common]),
        "fedsweep-vectorized": ("0,1", ["fedsweep", *common, "--vectorize"]),
    }
    print(f"FedAvg, {args.workload} {json.dumps(WORKLOADS[args.workload])}, {args.clients} clients, MLP hidden 20, τ=10, r=0.5, {args.rounds} rounds, "
          f"2 cores; {args.repeats} repetitions, interleaved", flush=True)
    res = repeat(__file__, variants, args.repeats)
    print("\nmedian wall time (s):        rounds only   whole run   final global accuracy (per repetition)")
    for name, rs in res.items():
        accs = [round(100 * r["final_global_accuracy"], 2) for r in rs]
        print(f"  {name:22s} {median(rs, 'rounds_s'):10.2f} {median(rs, 'total_s'):11.2f}   {accs}")
    print("\nratios flower / fedsweep (median of paired ratios; rounds only | whole run):")
    print_ratios(res, [(f"flower / {name}", "flower", name) for name in ("fedsweep", "fedsweep-vectorized")], width=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
