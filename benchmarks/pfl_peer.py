"""Benchmark — peer: Apple's pfl-research simulator against fedsweep's whole commands, on the same shards.

Workload: FedAvg, 20 clients, an MLP with one hidden layer of 20, τ = 10 SGD steps of batch 20, r = 0.5 (10 clients
a round), evaluation every 10 rounds, weighted aggregation, on the data of ``--workload``:

  capped     Synthetic(0.5, 0.5), at most 500 samples a client (issue 23's workload; MLP 60-20-10)
  powerlaw   Synthetic(0.5, 0.5), the generator's power-law sizes uncapped (38 to 2,147 samples a client)
  dirichlet  MNIST (``$FEDSWEEP_DATA_DIR``, else ../shared/data), every class divided over the clients in
             Dirichlet(0.1) proportions (MLP 784-20-10)

  single   one run, local_lr 0.05, seed 0
  grid     16 settings: local_lr ∈ {0.1, 0.05, 0.02, 0.01} × seed ∈ {0, 1, 2, 3}, two at a time on the 2 cores

What is timed is what a user waits for: the whole command, interpreter start to exit, on cores 0-1 (taskset):

  fedsweep  ``fedsweep run single.yaml`` / ``fedsweep sweep grid.yaml`` (Ray, actors, Tune for the grid, every
            metric of every round in MLflow, a SQLite store; for the grid also its table and report), once per
            layout given with ``--layouts``; ``tracking.log_train_loss: false`` (since 2026-11-27, thirty-third
            session): the peers do not score the global model on every client's training part, so fedsweep does
            not either
  pfl       ``python benchmarks/pfl_run.py ...`` in pfl's virtual environment, one process per setting; the grid
            as 16 such commands two at a time (a pool of 2), each process with 1 torch thread (2 with ``single``
            unless ``--pfl-threads``)

  flower    with ``--flower-python PY`` (Flower's own environment, see ``flower_peer.py``): ``flower_peer.py --worker
            flower`` per setting, two at a time as pfl; its own client sampler, so its accuracies are reported, not
            compared

With ``grid``, each repetition also times fedsweep's rounds of one setting alone (``run_local`` in a process of its
own, one thread; not part of any timed command): 16 × that / 2 cores is what the grid's trials cannot go below, and
its ratio to each peer, printed as "the floor", is the best a whole sweep could reach with no start-up, no tracking
and no contention between its two trial processes.

Same arithmetic on both sides: the shards, each seed's initial parameters, the clients each round samples and
each sampled client's minibatches are exported once from fedsweep (``export``; not timed) and given to pfl
(``benchmarks/pfl_run.py`` says how). The final global accuracies are printed side by side per setting and
must be equal; the script exits 1 if any differs by more than ``--tolerance`` (default 0: to the last digit).

    python3.11 -m venv ../venv-pfl && ../venv-pfl/bin/pip install "pfl[pytorch]==0.6.0" torch==2.13.0
    # issue 35's targets (docs/performance.md, targets and section 9): each workload, the single run and the grid
    python benchmarks/pfl_peer.py --rounds 50  --repeats 3 --only single --layouts default --workload powerlaw
    python benchmarks/pfl_peer.py --rounds 200 --repeats 3 --only grid   --layouts default --workload powerlaw
    python benchmarks/pfl_peer.py --rounds 50  --repeats 3 --only single --layouts default --workload dirichlet
    python benchmarks/pfl_peer.py --rounds 200 --repeats 3 --only grid   --layouts default --workload dirichlet
    # earlier ones (issue 23, the capped workload; Flower beside)
    python benchmarks/pfl_peer.py --rounds 50 --repeats 3
    python benchmarks/pfl_peer.py --rounds 200 --repeats 3 --workload powerlaw --flower-python ../venv-flower/bin/python
    python benchmarks/pfl_peer.py --rounds 200 --repeats 3 --only grid
    python benchmarks/pfl_peer.py --rounds 200 --repeats 1 --only grid --layouts default --flower-python ../venv-flower/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._harness import WORKLOADS

LRS = [0.1, 0.05, 0.02, 0.01]
SEEDS = [0, 1, 2, 3]
SINGLE = (0.05, 0)
EVAL_EVERY = 10
CORES = "0,1"
# layouts of fedsweep's resources section: what a user writes (nothing), and explicit choices
LAYOUTS = {
    "default": {},
    "pool": {"server_cpus": 0.5, "client_cpus": 0.5, "client_workers": 1},
    "pool-vec": {"server_cpus": 0.5, "client_cpus": 0.5, "client_workers": 1, "vectorize_clients": True},
    "pool2": {"server_cpus": 0.2, "client_cpus": 0.9, "client_workers": 2},
}


def experiment(rounds: int, lr: float | dict, seed: int, layout: str, db: Path, workload: str) -> dict:
    return {
        "name": "peer", "seed": seed,
        "data": dict(WORKLOADS[workload]),
        "model": {"name": "mlp", "hidden": [20]},
        "algorithm": {"name": "fedavg", "local_lr": lr, "participation_rate": 0.5, "local_steps": 10, "batch_size": 20},
        "rounds": rounds, "eval_every": EVAL_EVERY,
        "resources": dict(LAYOUTS[layout]),
        # equal work: pfl-research and Flower score the pooled test set only, not every client's training part
        "tracking": {"experiment": "peer", "tracking_uri": f"sqlite:///{db}", "log_train_loss": False},
    }


def export(folder: Path, rounds: int, workload: str) -> None:
    """The shards (data seed fixed) and, per seed of ``SEEDS``, the plan of :func:`export_plan`."""
    from fedsweep.loading import validate

    export_plan(folder, validate(experiment(rounds, SINGLE[0], 0, "default", folder / "unused.db", workload)), SEEDS)


def export_plan(folder: Path, cfg, seeds: list[int]) -> None:
    """``cfg``'s shards (``shards.npz``), its model (``model.json``: what ``pfl_run.py`` builds) and, per seed, the
    initial vector, each round's sampled clients and each sampled client's τ·B minibatch indices
    (``plan_seed{S}.npz``), drawn exactly as fedsweep's FedAvg client draws them."""
    import numpy as np
    import torch

    from fedsweep.data import build_federated_dataset
    from fedsweep.federation import _TRAIN, Client, Server, Setup
    from fedsweep.models import image_shape

    ds = build_federated_dataset(cfg.data)
    cat = lambda xs: np.concatenate([x.numpy() for x in xs])
    np.savez(folder / "shards.npz",
             x_train=cat(d.x_train for d in ds.clients), y_train=cat(d.y_train for d in ds.clients),
             x_test=cat(d.x_test for d in ds.clients), y_test=cat(d.y_test for d in ds.clients),
             n_train=np.array([d.num_train for d in ds.clients]))
    model = cfg.model.model_dump(mode="json") | {"inputs": ds.num_features, "classes": ds.num_classes}
    if cfg.model.name == "cnn":
        model["image"] = list(image_shape(ds.num_features))
    (folder / "model.json").write_text(json.dumps(model))
    hp, rounds = cfg.algorithm, cfg.rounds
    for seed in seeds:
        c = cfg.model_copy(update={"seed": seed})
        server = Server.of(c, ds.num_features, ds.num_classes)
        clients = [Client(i, d, Setup.of(c, ds.num_features, ds.num_classes)) for i, d in enumerate(ds.clients)]
        sampled = np.array([server.sample(t) for t in range(1, rounds + 1)])
        batches = np.empty((rounds, sampled.shape[1], hp.local_steps * hp.batch_size), dtype=np.int64)
        for t in range(rounds):
            for j, i in enumerate(sampled[t]):
                ctx = clients[i].context(t + 1, _TRAIN)  # the training stream, as Client.train draws it
                n = clients[i].data.num_train
                batches[t, j] = torch.cat([torch.randperm(n, generator=ctx.generator)[:hp.batch_size]
                                           for _ in range(hp.local_steps)]).numpy()
        np.savez(folder / f"plan_seed{seed}.npz", initial=server.params.numpy(), sampled=sampled, batches=batches,
                 local_steps=hp.local_steps)


def timed(cmd: list[str], cwd: Path) -> tuple[float, str]:
    t0 = time.perf_counter()
    proc = subprocess.run(["taskset", "-c", CORES, *cmd], cwd=cwd, capture_output=True, text=True, check=False,
                          env={k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_RUN_ID")})
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return wall, proc.stdout


def pfl_cmd(args, folder: Path, lr: float, seed: int, threads: int) -> list[str]:
    return [args.pfl_python, str(ROOT / "benchmarks/pfl_run.py"), str(folder), "--seed", str(seed), "--local-lr",
            str(lr), "--rounds", str(args.rounds), "--eval-every", str(EVAL_EVERY), "--threads", str(threads)]


def two_at_a_time(settings: list[tuple[float, int]], command) -> tuple[float, dict]:
    """``command(setting)`` for every setting, two at a time (one if there is one): the wall time of them all, and
    per setting the last JSON line it printed with its own wall time."""
    def one(s):
        wall, out = timed(command(s), ROOT)
        return s, json.loads([ln for ln in out.splitlines() if ln.startswith("{")][-1]) | {"wall_s": wall}

    t0 = time.perf_counter()
    with ThreadPoolExecutor(2 if len(settings) > 1 else 1) as pool:
        results = dict(pool.map(one, settings))
    return time.perf_counter() - t0, results


def run_pfl(args, folder: Path, settings: list[tuple[float, int]], threads: int) -> tuple[float, dict]:
    return two_at_a_time(settings, lambda s: pfl_cmd(args, folder, *s, threads))


def run_flower(args, settings: list[tuple[float, int]]) -> tuple[float, dict]:
    """Flower's simulation on the same shards (``flower_peer.py --worker flower``: its own sampler, so its
    accuracies are not expected to equal), one command per setting, two at a time as for pfl."""
    return two_at_a_time(settings, lambda s: [args.flower_python, str(ROOT / "benchmarks/flower_peer.py"), "--worker",
                                              "flower", "--rounds", str(args.rounds), "--local-lr", str(s[0]),
                                              "--seed", str(s[1]), "--workload", args.workload])


def final_accuracies(db: Path) -> dict[tuple[float, int], float]:
    from mlflow import MlflowClient

    c = MlflowClient(f"sqlite:///{db}")
    runs = c.search_runs([c.get_experiment_by_name("peer").experiment_id])
    return {(float(r.data.params["algorithm.local_lr"]), int(r.data.params["seed"])): r.data.metrics["global_accuracy"]
            for r in runs if "global_accuracy" in r.data.metrics and "algorithm.local_lr" in r.data.params}


def rounds_in_process(rounds: int, workload: str) -> float:
    """Seconds of one setting's rounds alone (:func:`rounds_seconds` in a child process on the cores of the others, one
    torch thread): what a grid's 16 trials cannot go below on 2 cores is 16 × this / 2."""
    _, out = timed([sys.executable, __file__, "--worker-rounds", "--rounds", str(rounds), "--workload", workload], ROOT)
    return float(json.loads(out.strip().splitlines()[-1])["s"])


def rounds_seconds(rounds: int, workload: str) -> float:
    """One setting's rounds in this process: ``run_local`` of the grid's experiment at ``SINGLE``, timed the second time
    (the first builds the dataset and warms the kernels)."""
    from fedsweep.engine import run_local
    from fedsweep.layout import auto_layout
    from fedsweep.loading import validate

    cfg = validate(auto_layout(experiment(rounds, SINGLE[0], SINGLE[1], "default", Path("unused.db"), workload), 1))
    run_local(cfg)
    t0 = time.perf_counter()
    run_local(cfg)
    return time.perf_counter() - t0


def run_fedsweep(args, what: str, layout: str) -> tuple[float, dict]:
    folder = Path(tempfile.mkdtemp(prefix=f"fedsweep-peer-{what}-{layout}-"))
    db = folder / "mlflow.db"
    fedsweep = str(Path(sys.executable).with_name("fedsweep"))
    if what == "single":
        body = experiment(args.rounds, SINGLE[0], SINGLE[1], layout, db, args.workload)
        cmd = [fedsweep, "run", "single.yaml", "--quiet"]
    else:
        body = experiment(args.rounds, {"grid": LRS}, 0, layout, db, args.workload)
        body["sweep"] = {"name": "peer", "seeds": SEEDS, "max_concurrent_trials": 2,
                         "storage_path": str(folder / "ray_results")}
        cmd = [fedsweep, "sweep", "grid.yaml", "--quiet"]
    (folder / f"{what}.yaml").write_text(yaml.safe_dump(body))
    wall, _ = timed(cmd, folder)
    return wall, final_accuracies(db)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--workload", choices=list(WORKLOADS), default="capped")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", choices=["single", "grid"])
    ap.add_argument("--layouts", nargs="+", default=["default", "pool-vec"], choices=list(LAYOUTS))
    ap.add_argument("--pfl-python", default=str(ROOT.parent / "venv-pfl/bin/python"))
    ap.add_argument("--pfl-threads", type=int, default=0, help="torch threads of a single pfl run (0 = torch's default)")
    ap.add_argument("--tolerance", type=float, default=0.0)
    ap.add_argument("--flower-python", help="also time Flower (flower_peer.py) in this interpreter's environment")
    ap.add_argument("--worker-rounds", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    os.environ.setdefault("FEDSWEEP_DATA_DIR", str(ROOT.parent / "shared" / "data"))  # MNIST, for every process below
    if args.worker_rounds:  # rounds_in_process's child: one torch thread, as each trial process of the grid
        __import__("torch").set_num_threads(1)
        print(json.dumps({"s": rounds_seconds(args.rounds, args.workload)}))
        return 0

    folder = Path(tempfile.mkdtemp(prefix="fedsweep-pfl-export-"))
    export(folder, args.rounds, args.workload)
    sizes = __import__("numpy").load(folder / "shards.npz")["n_train"]
    grid = [(lr, s) for s in SEEDS for lr in LRS]
    print(f"FedAvg, workload {args.workload} ({json.dumps(WORKLOADS[args.workload])}; training samples a client "
          f"{sizes.min()}-{sizes.max()}), τ=10, B=20, r=0.5, {args.rounds} rounds, eval every {EVAL_EVERY}; cores "
          f"{CORES}; {args.repeats} repetitions, variants interleaved", flush=True)
    mismatches = 0
    for what in [args.only] if args.only else ["single", "grid"]:
        settings = [SINGLE] if what == "single" else grid
        walls: dict[str, list[float]] = {"pfl": [], **{f"fedsweep/{lay}": [] for lay in args.layouts},
                                         **({"flower": []} if args.flower_python else {})}
        accuracies: dict[str, dict] = {}
        floors: list[float] = []  # a grid's rounds alone: 16 settings × one setting's rounds in process / 2 cores
        for rep in range(args.repeats):
            wall, res = run_pfl(args, folder, settings, args.pfl_threads if what == "single" else 1)
            walls["pfl"].append(wall)
            accuracies["pfl"] = {s: r["final_global_accuracy"] for s, r in res.items()}
            inner = statistics.median(r["run_s"] for r in res.values())
            print(f"  {what} rep {rep + 1}: pfl {wall:.2f} s (per process: median algorithm.run {inner:.2f} s, "
                  f"import {statistics.median(r['import_s'] for r in res.values()):.2f} s)", flush=True)
            for lay in args.layouts:
                wall, acc = run_fedsweep(args, what, lay)
                walls[f"fedsweep/{lay}"].append(wall)
                accuracies[f"fedsweep/{lay}"] = acc
                print(f"  {what} rep {rep + 1}: fedsweep/{lay} {wall:.2f} s", flush=True)
            if what == "grid":
                one = rounds_in_process(args.rounds, args.workload)
                floors.append(len(settings) * one / 2)
                print(f"  {what} rep {rep + 1}: fedsweep's rounds of one setting in process {one:.2f} s (not timed "
                      f"above): the grid's rounds alone on 2 cores {floors[-1]:.2f} s", flush=True)
            if args.flower_python:
                wall, res = run_flower(args, settings)
                walls["flower"].append(wall)
                flower = {s: r["final_global_accuracy"] for s, r in res.items()}
                print(f"  {what} rep {rep + 1}: flower {wall:.2f} s; final accuracies (its own sampler) "
                      f"{[round(100 * flower[s], 2) for s in settings]}", flush=True)
        print(f"\n{what}, {args.rounds} rounds — whole command wall (s): median [per repetition]")
        for name, ws in walls.items():
            print(f"  {name:20s} {statistics.median(ws):7.2f} {[round(w, 2) for w in ws]}")
        print("  ratios (median of paired ratios, fedsweep / peer: < 1 = fedsweep faster):")
        peers = ("pfl", "flower")[: 2 if args.flower_python else 1]
        for name, ws in walls.items():
            if name.startswith("fedsweep/"):
                for peer in peers:
                    rs = [f / p for f, p in zip(ws, walls[peer])]
                    print(f"    {name} / {peer:8s} {statistics.median(rs):6.3f} {[round(r, 3) for r in rs]}")
        if floors:  # the best a whole sweep could do against each peer: its trials' rounds and nothing else
            for peer in peers:
                rs = [f / p for f, p in zip(floors, walls[peer])]
                print(f"    rounds alone / {peer:8s} {statistics.median(rs):6.3f} {[round(r, 3) for r in rs]} (the floor)")
        print("  final global accuracy (%) per setting (local_lr, seed):")
        for s in settings:
            row = {name: accuracies[name].get(s) for name in accuracies}
            ok = all(v is not None and abs(v - row["pfl"]) <= args.tolerance for v in row.values())
            mismatches += not ok
            print(f"    {s}: " + ", ".join(f"{n} {100 * v:.4f}" if v is not None else f"{n} missing"
                                           for n, v in row.items()) + ("" if ok else "   <- differs"))
    print(f"\naccuracies: {'all equal' if not mismatches else f'{mismatches} setting(s) differ'}"
          f" (tolerance {args.tolerance})")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
