"""Benchmark — pfl-research's own CIFAR-10 setting, run by pfl-research and by fedsweep on the same device.

pfl-research's image-classification benchmark (``benchmarks/image_classification/configs/baseline.yaml`` there,
as in its paper): FedAvg, CIFAR-10 over 1,000 users of 50 images (IID), a cohort of 50 users a round, one local
epoch of batch 10 (5 steps) at local learning rate 0.1, the central step the plain average (learning rate 1, all
users weigh alike), its ``simple_cnn`` (two 3×3 convolutions of 32 and 64 channels, one 2×2 max-pool, a dense
layer of 128: 1,626,442 parameters). Here:

- data: fedsweep's ``iid`` split of the 60,000 pooled images over 1,000 clients, ``test_fraction`` 1/6 (50
  training and 10 test images each; pfl evaluates on the union of the clients' test parts, as fedsweep's global
  accuracy does); ``--data-dir`` holds ``cifar-10-batches-py/``, else stand-in files of its format and size
  (random pixels: the timings are the workload's, the accuracies mean nothing);
- model: fedsweep's ``cnn`` with ``pool: last`` — ``simple_cnn`` without its two dropout layers (fedsweep's models
  have none; the same arithmetic on both sides matters more than a dropout mask);
- the same arithmetic on both sides: the shards, the initial vector, each round's cohort and each user's 5
  minibatches are exported from fedsweep (``pfl_peer.export_plan``) and given to ``pfl_run.py``.

Variants, one after another in this run, on ``--device`` (``cuda`` where there is one):

  fedsweep, one by one   the whole experiment in this process (``fedsweep.engine.Engine``: a worker pool of one,
                         as ``fedsweep run`` runs in process), the clients' data and models on the device,
                         the cohort trained one client after another
  fedsweep, stacked      the same with ``vectorize_clients``: the cohort's 50 local trainings as one
                         ``torch.func.vmap`` computation per step
  pfl-research           ``pfl_run.py`` in ``--pfl-python`` (``python3`` with pfl importable; ``none`` skips it):
                         pfl's ``SimulatedBackend`` and ``PyTorchModel`` on the same device (on the CPU with one
                         torch thread, as fedsweep's in-process engine computes)

Per variant: seconds a training round (the median over rounds 2..R: no evaluation, no start-up), the whole run,
GPU memory (nvidia-smi's memory.used of the whole card, and torch's peak allocation in the variant's process) and GPU utilisation (nvidia-smi every
0.2 s), the achieved rate against the round's floating-point operations (the limit: counted from the layers,
3 × the forward pass for a training step), and the final global accuracy and loss (equal on the CPU up to
summation order, as on a GPU).

    python benchmarks/pfl_cifar.py --pfl-python ../venv-pfl/bin/python                 # stand-in files
    python benchmarks/pfl_cifar.py --rounds 3 --clients 20 --cohort 4 --per-class 10 --pfl-python none   # CI size
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch

from benchmarks._harness import GPUSampler
from benchmarks.device_data import stand_in_cifar10
from benchmarks.device_sweep import in_process
from benchmarks.pfl_peer import export_plan
from fedsweep.loading import validate

SIMPLE_CNN = {"name": "cnn", "channels": [32, 64], "kernel_size": 3, "hidden": [128], "pool": "last"}


def config(root: Path, rounds: int, clients: int, cohort: int) -> object:
    return validate({
        "name": "pfl-cifar10", "seed": 0,
        "data": {"dataset": "cifar10", "root": str(root), "num_clients": clients, "partition": {"name": "iid"},
                 "test_fraction": 1 / 6},
        "model": SIMPLE_CNN,
        "algorithm": {"name": "fedavg", "local_lr": 0.1, "participation_rate": cohort / clients, "local_steps": 5,
                      "batch_size": 10},
        "rounds": rounds, "eval_every": rounds,
    }, "pfl_cifar")


def train_flops(cfg, num_features: int, num_classes: int, samples: int) -> float:
    """Floating-point operations of ``samples`` training samples: 2 per multiply-add of the forward pass, 3 passes'
    worth for forward and backward (the usual count; pooling and activations left out)."""
    from fedsweep.models import build_model

    model = build_model(cfg.model, num_features, num_classes)
    macs = 0

    def count(module, inputs, output):
        nonlocal macs
        if isinstance(module, torch.nn.Conv2d):
            macs += output[0].numel() * module.in_channels * module.kernel_size[0] * module.kernel_size[1] // module.groups
        elif isinstance(module, torch.nn.Linear):
            macs += module.in_features * module.out_features

    for m in model.modules():
        m.register_forward_hook(count)
    with torch.no_grad():
        model(torch.zeros(1, num_features))
    return 3 * 2 * macs * samples


def fedsweep_variant(cfg, device: str, stack: bool, profile: bool = False) -> dict:
    """The run; with ``profile``, rounds 2..R-1 under cProfile and torch.profiler, their top entries printed."""
    import cProfile
    import pstats
    from contextlib import ExitStack

    from fedsweep.engine import Engine
    from fedsweep.federation import compute_threads

    cfg = in_process(cfg, stack)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    with compute_threads(), ExitStack() as profiling:
        engine = Engine(cfg, device)
        ends, last = [], {}
        for rnd in range(cfg.rounds + 1):
            if profile and rnd == 2:
                py = cProfile.Profile()
                activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device.startswith("cuda") else [])
                ops = profiling.enter_context(torch.profiler.profile(activities=activities))
                py.enable()
            if profile and rnd == cfg.rounds:
                py.disable()
                profiling.close()
                pstats.Stats(py).sort_stats("tottime").print_stats(20)
                print(ops.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
            for m in engine.steps(rnd, rnd, 1):
                last = m if "global_accuracy" in m else last
            ends.append(time.perf_counter())
    steps = [b - a for a, b in itertools.pairwise(ends[1:-1])]  # rounds 2..R-1: training alone (R evaluates)
    return {"stacked": cfg.resources.vectorize_clients, "run_s": time.perf_counter() - start,
            "round_s_median": statistics.median(steps) if steps else None,
            "max_memory_mb": torch.cuda.max_memory_allocated() / 2**20 if device.startswith("cuda") else None,
            "final_global_accuracy": last["global_accuracy"], "final_global_loss": last["global_loss"]}


def pfl_variant(python: str, folder: Path, cfg, device: str) -> dict:
    cmd = [python, str(ROOT / "benchmarks/pfl_run.py"), str(folder), "--seed", "0", "--local-lr", str(cfg.algorithm.local_lr),
           "--rounds", str(cfg.rounds), "--eval-every", str(cfg.rounds), *(["--threads", "1"] if device == "cpu" else [])]
    env = {**os.environ, "PFL_PYTORCH_DEVICE": device}
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if proc.returncode:
        raise RuntimeError(f"pfl_run.py failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--clients", type=int, default=1000)
    ap.add_argument("--cohort", type=int, default=50)
    ap.add_argument("--per-class", type=int, default=1000, help="stand-in images of each class in each file")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--pfl-python", default=str(ROOT.parent / "venv-pfl/bin/python"),
                    help="a python that imports pfl (and torch); 'none': fedsweep's variants only")
    ap.add_argument("--profile", action="store_true", help="profile fedsweep's rounds 2..R-1 (cProfile, torch.profiler; the round times then include their overhead)")
    ap.add_argument("--shared-module", action="store_true",
                    help="every client of a process shares one module on the GPU too (the A/B of the GPU section)")
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="the device's rate for the fraction printed (e.g. an H200's fp32 67, by its datasheet)")
    args = ap.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="fedsweep-pfl-cifar-"))
    root = Path(args.data_dir) if args.data_dir else folder / "data"
    if not args.data_dir:
        stand_in_cifar10(root, args.per_class)
    cfg = config(root, args.rounds, args.clients, args.cohort)
    export_plan(folder, cfg, [0])
    spec = json.loads((folder / "model.json").read_text())
    flops = train_flops(cfg, spec["inputs"], spec["classes"], args.cohort * cfg.algorithm.local_steps * cfg.algorithm.batch_size)
    gpu = args.device.startswith("cuda")
    print(f"{torch.cuda.get_device_name(0) if gpu else 'CPU'}, {os.cpu_count()} CPUs, torch {torch.__version__}; "
          f"{args.clients} clients, {args.cohort} a round, {cfg.rounds} rounds; {'real' if args.data_dir else 'stand-in'} "
          f"CIFAR-10 files; {flops / 1e9:.1f} GFLOP of training a round", flush=True)
    if args.shared_module:  # the A/B of docs/performance.md's GPU section: shared, stacked rounds ran 1.6x slower there
        from fedsweep.federation import SHARED_MODULE_DEVICES

        SHARED_MODULE_DEVICES.add("cuda")
    variants = {"fedsweep, one by one": lambda: fedsweep_variant(cfg, args.device, False, args.profile),
                "fedsweep, stacked": lambda: fedsweep_variant(cfg, args.device, True, args.profile)}
    if args.pfl_python != "none":
        variants["pfl-research"] = lambda: pfl_variant(args.pfl_python, folder, cfg, args.device)
    results = {}
    for name, run in variants.items():
        if gpu:
            torch.cuda.empty_cache()  # nvidia-smi counts the whole card: no blocks kept from the variant before
        sampler = GPUSampler() if gpu else None
        if sampler:
            sampler.start()
        try:
            r = results[name] = run()
        finally:
            if sampler:
                sampler.stop.set()
                sampler.join()
        if sampler:
            r |= sampler.summary()
        rate = flops / r["round_s_median"] / 1e12 if r.get("round_s_median") else None
        r["tflops"] = rate
        print(f"{name}: {r['round_s_median']:.4f} s a round ({1 / r['round_s_median']:.2f} rounds/s), whole run "
              f"{r['run_s']:.1f} s, {rate:.3f} TFLOP/s" + (f" ({rate / args.peak_tflops:.2%} of {args.peak_tflops:g})" if args.peak_tflops else "")
              + (f", GPU busy {r['gpu_util_mean']:.0f}% (max {r['gpu_util_max']:.0f}%), {r['gpu_memory_used_mb']:.0f} MB used, "
                 f"torch peak {r['max_memory_mb']:.0f} MB" if "gpu_util_mean" in r else "")
              + f"; final global accuracy {r['final_global_accuracy']:.4f}, loss {r['final_global_loss']:.6f}", flush=True)
    base = results["fedsweep, one by one"]["round_s_median"]
    for name, r in results.items():
        print(f"  {name}: {base / r['round_s_median']:.2f}x the rounds/s of fedsweep one by one")
    if "pfl-research" in results:
        pfl = results["pfl-research"]["round_s_median"]
        for name in ("fedsweep, one by one", "fedsweep, stacked"):
            print(f"  {name} / pfl-research, rounds per second: {pfl / results[name]['round_s_median']:.2f}")
    print(json.dumps({"rounds": cfg.rounds, "clients": args.clients, "cohort": args.cohort, "gflop_round": flops / 1e9,
                      "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
