"""CIFAR-10 on GPU slices: rounds per second and GPU utilisation of a PFL-style CIFAR-10 experiment
(ACID 5 classes, 100 devices, 10% per round, the PFL CNN, τ = 20, batch 50), on CPU actors and on
ClientActors holding a tenth of a GPU, measured in the same run; on the GPU twice, each actor's sampled clients
trained one at a time and stacked (``vectorize_clients``: one vmapped computation per actor and step), as
issue 23 asks. Without a GPU the two CPU variants run instead (one at a time, stacked).

    python benchmarks/cifar_gpu.py --data-dir DIR      # DIR holds cifar-10-batches-py/
    python benchmarks/cifar_gpu.py                      # stand-in files of CIFAR-10's size and format
    python benchmarks/cifar_gpu.py --rounds 2 --clients 10 --clients-per-actor 5 --per-class 20 --tau 2   # CI size (tests)

Without ``--data-dir`` the images are random bytes in CIFAR-10's exact files and shapes: the timings
are those of the real workload, the accuracies mean nothing and are not printed.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray
import torch

from benchmarks._harness import GPUSampler
from benchmarks.device_data import stand_in_cifar10
from fedsweep.experiment import ExperimentRunner
from fedsweep.loading import validate


def run(root: Path, rounds: int, cpus: float, gpus: float, k: int, stacked: bool = False, clients: int = 100,
        tau: int = 20) -> dict:
    cfg = validate({
        "name": "cifar-gpu", "seed": 0,
        "data": {"dataset": "cifar10", "root": str(root), "num_clients": clients,
                 "partition": {"name": "acid", "classes_per_client": 5}},
        "model": {"name": "cnn"},
        "algorithm": {"name": "pfldyn", "transform": "maml", "alpha": 0.01, "beta": 0.1, "lambda": 0.01,
                      "r": 0.1, "tau": tau, "batch_size": 50},
        "rounds": rounds, "eval_every": rounds,
        "resources": {"server_cpus": 1, "client_cpus": cpus, "client_gpus": gpus, "clients_per_actor": k,
                      "vectorize_clients": stacked},
    }, "cifar_gpu")
    runner = ExperimentRunner(cfg)
    sampler = GPUSampler() if gpus else None
    try:
        runner.start()
        rnds = runner.rounds()
        next(rnds)  # round 0 evaluation
        if sampler:
            sampler.start()
        t0 = time.perf_counter()
        for rnd in range(1, rounds):  # the training rounds; the last round (with its evaluation) apart
            next(rnds)
        train_s = time.perf_counter() - t0
        if sampler:
            sampler.stop.set()
        last = next(rnds)
    finally:
        runner.stop()
    return {"rounds_per_s": (rounds - 1) / train_s, "devices": sorted({i["device"] for i in runner.clients_info}),
            **(sampler.summary() if sampler else {}), "final": last}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--clients-per-actor", type=int, default=10)
    ap.add_argument("--clients", type=int, default=100)
    ap.add_argument("--per-class", type=int, default=1000, help="stand-in images of each class in each file")
    ap.add_argument("--tau", type=int, default=20, help="local steps a round (the PFL protocol's 20)")
    args = ap.parse_args()
    root = Path(args.data_dir) if args.data_dir else Path(tempfile.mkdtemp()) / "data"
    if not args.data_dir:
        stand_in_cifar10(root, args.per_class)
    gpus = torch.cuda.device_count()
    if os.environ.get("RAY_ADDRESS"):  # a running instance (the tests' own): its CPUs, this machine's GPUs
        ray.init(log_to_driver=False)
    else:
        from fedsweep.experiment import start_local_ray  # the dashboard agent on a free port, as fedsweep starts Ray

        start_local_ray(num_cpus=os.cpu_count(), num_gpus=gpus, log_to_driver=False)
    cpus = int(ray.cluster_resources()["CPU"])
    actors = -(-args.clients // args.clients_per_actor)
    print(f"{torch.cuda.get_device_name(0) if gpus else 'no GPU'}, {cpus} CPUs; {args.clients} clients in {actors} "
          f"actors; {'real' if args.data_dir else 'stand-in'} CIFAR-10 files", flush=True)
    cpu_share = round((cpus - 1) / actors, 2)
    variants = {"CPU actors, one client at a time": (cpu_share, 0.0, False)}
    if gpus:
        variants |= {"GPU actors, one client at a time": (1.0, round(1.0 / actors, 3), False),
                     "GPU actors, stacked": (1.0, round(1.0 / actors, 3), True)}
    else:
        variants |= {"CPU actors, stacked": (cpu_share, 0.0, True)}
    results = {}
    for name, (cpus, slice_, vectorize) in variants.items():
        r = results[name] = run(root, args.rounds, cpus, slice_, args.clients_per_actor, vectorize, args.clients, args.tau)
        util = f", GPU utilisation mean {r['gpu_util_mean']:.0f}% max {r['gpu_util_max']:.0f}%, memory {r['gpu_memory_used_mb']:.0f} MB" if slice_ else ""
        print(f"{name} ({cpus} CPU, {slice_} GPU each): {r['rounds_per_s']:.3f} rounds/s, devices {r['devices']}{util}", flush=True)
    one, stacked = (("GPU actors, one client at a time", "GPU actors, stacked") if gpus else
                    ("CPU actors, one client at a time", "CPU actors, stacked"))
    print(f"stacked / one at a time, rounds per second: {results[stacked]['rounds_per_s'] / results[one]['rounds_per_s']:.2f}")
    if gpus:
        print(f"GPU (one at a time) / CPU rounds per second: "
              f"{results[one]['rounds_per_s'] / results['CPU actors, one client at a time']['rounds_per_s']:.2f}")
    if args.data_dir:
        print("final personalized accuracy:", {n: r["final"]["personalized_accuracy_mean"] for n, r in results.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
