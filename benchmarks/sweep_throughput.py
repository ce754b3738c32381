"""Benchmark 3 - sweep throughput: a 16-trial grid on 2 CPUs against perfect packing of its trials.

Each trial (FedAvg, Synthetic(0.5, 0.5), 10 clients in one packed ClientActor, 30 rounds) reserves
1 CPU (server 0.5 + client actor 0.5), so two run at once on 2 CPUs. Measured in fresh processes:

  sweep    ``run_sweep`` on the 16-trial file: Ray start, Tune, placement groups, MLflow parent and child runs
  single   the same 16 trials one after another, each alone on a warm Ray instance with the same resources
           and the same MLflow logging; each trial's wall time is recorded

  ratio = wall(sweep) / (Σ single-trial wall / 2 CPUs)      (1.0 = perfect packing; target ≤ 1.2)

    python benchmarks/sweep_throughput.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._harness import median, ratios, repeat

SWEEP = """\
name: throughput
seed: 0
data: {dataset: synthetic, num_clients: 10, alpha: 0.5, beta: 0.5, max_samples_per_client: 500}
model: {name: mlp, hidden: [20]}
algorithm:
  name: fedavg
  local_lr: {grid: [0.1, 0.05, 0.02, 0.01]}
  personalization_lr: {grid: [0.0, 0.05]}
  participation_rate: 0.5
  local_steps: 10
  batch_size: 20
rounds: ROUNDS
eval_every: 5
resources: {server_cpus: 0.5, client_cpus: 0.5, clients_per_actor: 10, cluster_cpus: 2}
tracking: {experiment: throughput, tracking_uri: "sqlite:///DIR/mlflow.db"}
sweep:
  name: throughput
  max_concurrent_trials: 2
  seeds: [0, 1]
  storage_path: DIR/ray_results
"""


def write_sweep(rounds: int) -> Path:
    d = Path(tempfile.mkdtemp(prefix="fedsweep-throughput-"))
    p = d / "sweep.yaml"
    p.write_text(SWEEP.replace("ROUNDS", str(rounds)).replace("DIR", str(d)))
    return p


def worker_sweep(args) -> dict:
    from fedsweep.loading import load_sweep
    from fedsweep.sweep import run_sweep

    sweep = load_sweep(write_sweep(args.rounds))
    t0 = time.perf_counter()
    out = run_sweep(sweep, verbose=0)
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "trials": len(sweep.trials), "errors": out["errors"]}


def worker_single(args) -> dict:
    import ray

    from fedsweep.config import resolve_tracking_uri
    from fedsweep.experiment import connect_ray, execute
    from fedsweep.loading import load_sweep
    from fedsweep.tracking import RunLogger, ensure_experiment

    sweep = load_sweep(write_sweep(args.rounds))
    first = sweep.trials[0].config
    connect_ray(first.resources)
    uri = resolve_tracking_uri(first.tracking.tracking_uri)
    experiment_id = ensure_experiment(uri, first.tracking.experiment)
    times = []
    for t in sweep.trials:
        t0 = time.perf_counter()
        logger = RunLogger(uri, experiment_id, t.config, run_name=f"single-{t.index:03d}", overrides=t.overrides)
        execute(t.config, logger)
        times.append(time.perf_counter() - t0)
    ray.shutdown()
    return {"sum_single_s": sum(times), "perfect_packing_s": sum(times) / 2, "single_s": [round(x, 2) for x in times]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", choices=["sweep", "single"])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps((worker_sweep if args.worker == "sweep" else worker_single)(args)))
        return 0
    common = ["--rounds", str(args.rounds)]
    print(f"16 trials (4 local_lr × 2 personalization_lr × 2 seeds), {args.rounds} rounds, 1 CPU each, 2 CPUs; "
          f"{args.repeats} repetitions, interleaved", flush=True)
    res = repeat(__file__, {"sweep": ("0,1", ["sweep", *common]), "single": ("0,1", ["single", *common])}, args.repeats)
    for r in res["single"]:
        r["wall_s"] = r["perfect_packing_s"]
    ratio, rs = ratios(res, "sweep", "single", "wall_s")
    print(f"\nmedian sweep wall {median(res['sweep'], 'wall_s'):.1f} s; median Σ single-trial wall "
          f"{median(res['single'], 'sum_single_s'):.1f} s -> perfect packing on 2 CPUs {median(res['single'], 'perfect_packing_s'):.1f} s")
    print(f"sweep / perfect packing: {ratio:.3f} (per repetition {[round(x, 3) for x in rs]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
