"""GPU path check: ClientActors on fractional GPU slices, against the same experiment on CPU actors.

Run on a machine with a CUDA GPU (not part of the test suite; CI has no GPU):

    python benchmarks/gpu_check.py --clients 10 --client-gpus 0.1 --rounds 20

It prints, for each workload: where every client actor ran (torch device, Ray's GPU ids,
CUDA_VISIBLE_DEVICES), rounds per second on CPU actors and on GPU actors measured in the
same run, the largest difference between the CPU and GPU final metrics, and that an
over-subscribed ``client_gpus`` is refused by validation before any actor starts.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray
import torch

from fedsweep.checks import check_fits
from fedsweep.experiment import ExperimentRunner
from fedsweep.loading import validate

WORKLOADS = {
    # The embedded default's model: tiny, so a GPU can only add transfer and launch costs.
    "synthetic-mlp20": {
        "data": {"dataset": "synthetic", "alpha": 0.5, "beta": 0.5, "max_samples_per_client": 500},
        "model": {"name": "mlp", "hidden": [20]},
        "batch_size": 20,
    },
    # A model large enough for the GPU to matter: digits, MLP 2048-2048 (~4.3M parameters).
    "digits-mlp2048": {
        "data": {"dataset": "digits", "partition": {"name": "label_skew", "classes_per_client": 4}},
        "model": {"name": "mlp", "hidden": [2048, 2048]},
        "batch_size": 64,
    },
}


def experiment(workload: str, clients: int, rounds: int, client_cpus: float, client_gpus: float, clients_per_actor: int = 1) -> dict:
    w = WORKLOADS[workload]
    return {
        "name": f"gpu-check-{workload}",
        "seed": 0,
        "data": {**w["data"], "num_clients": clients},
        "model": w["model"],
        "algorithm": {
            "name": "fedavg",
            "local_lr": 0.05,
            "participation_rate": 0.5,
            "local_steps": 10,
            "batch_size": w["batch_size"],
        },
        "rounds": rounds,
        "eval_every": rounds,
        "resources": {"server_cpus": 1, "client_cpus": client_cpus, "client_gpus": client_gpus,
                      "clients_per_actor": clients_per_actor},
    }


def run(raw: dict) -> dict:
    cfg = validate(raw, "gpu_check")
    runner = ExperimentRunner(cfg)
    try:
        t0 = time.perf_counter()
        runner.start()
        start_s = time.perf_counter() - t0
        history = list(runner.rounds())
        infos = runner.clients_info
        gpu_mem = gpu_memory_used_mb()
    finally:
        runner.stop()
    last = history[-1]
    return {
        "start_s": start_s,
        "rounds_per_s": cfg.rounds / last["wall_time_s"],
        "final": {k: last[k] for k in ("personalized_accuracy_mean", "global_accuracy", "train_loss")},
        "devices": sorted({i["device"] for i in infos}),
        "gpu_ids": sorted({g for i in infos for g in i["gpu_ids"]}),
        "cuda_visible_devices": sorted({str(i["cuda_visible_devices"]) for i in infos}),
        "gpu_memory_used_mb": gpu_mem,
    }


def gpu_memory_used_mb() -> float | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"], capture_output=True, text=True, check=False
        )
        return float(out.stdout.split()[0])
    except (OSError, ValueError, IndexError):  # no nvidia-smi, or no GPU line
        return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--client-gpus", type=float, default=0.1)
    ap.add_argument("--client-cpus", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--pack", type=int, default=5, help="clients per actor of the packed GPU variant")
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS))
    args = ap.parse_args()

    if not torch.cuda.is_available():
        print("no CUDA device: this check needs a GPU", file=sys.stderr)
        return 1
    gpus = torch.cuda.device_count()
    from fedsweep.experiment import start_local_ray  # the dashboard agent on a free port, as fedsweep starts Ray

    start_local_ray(num_cpus=os.cpu_count(), num_gpus=gpus, log_to_driver=False)
    print(f"torch {torch.__version__}, ray {ray.__version__}, {torch.cuda.get_device_name(0)} x{gpus}, "
          f"{os.cpu_count()} CPUs; cluster {ray.cluster_resources()}")

    # Over-subscription is refused by validation, before any actor exists.
    too_much = validate(experiment("synthetic-mlp20", args.clients, 1, args.client_cpus, min(1.0, 2.0 * gpus / args.clients + 0.01)))
    problems = check_fits(too_much, float(os.cpu_count()), float(gpus), None, "gpu_check")
    print("over-subscribed client_gpus refused:", bool(problems), "|", problems[0] if problems else "")

    results = {}
    for workload in args.workloads:
        cpu = run(experiment(workload, args.clients, args.rounds, args.client_cpus, 0.0))
        gpu = run(experiment(workload, args.clients, args.rounds, args.client_cpus, args.client_gpus))
        packed = run(experiment(workload, args.clients, args.rounds, args.client_cpus, args.client_gpus, args.pack))
        diff = max(abs(cpu["final"][k] - gpu["final"][k]) for k in cpu["final"])
        same_packed = packed["final"] == gpu["final"]
        results[workload] = {"cpu": cpu, "gpu": gpu, "gpu_packed": packed, "max_final_metric_diff": diff}
        print(f"\n== {workload}: {args.clients} clients, client_gpus={args.client_gpus}, {args.rounds} rounds")
        for name, r in (("cpu actors", cpu), ("gpu actors", gpu), (f"gpu actors, {args.pack} clients each", packed)):
            print(f"  {name}: devices={r['devices']} ray_gpu_ids={r['gpu_ids']} CUDA_VISIBLE_DEVICES={r['cuda_visible_devices']}")
            print(f"    start {r['start_s']:.1f}s, {r['rounds_per_s']:.2f} rounds/s, final {json.dumps(r['final'])}, "
                  f"GPU memory used {r['gpu_memory_used_mb']} MB")
        print(f"  GPU/CPU rounds-per-second ratio: {gpu['rounds_per_s'] / cpu['rounds_per_s']:.2f} (packed: "
              f"{packed['rounds_per_s'] / cpu['rounds_per_s']:.2f}); largest |CPU - GPU| final metric: {diff:.2e}; "
              f"packed GPU == unpacked GPU: {same_packed}")
    ray.shutdown()
    out = os.environ.get("OUT")
    if out:
        Path(out, "gpu_check.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
